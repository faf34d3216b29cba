"""mars_hf: train and serve MARS (Mask AutoRegreSsion) models the Hugging Face way.

Submodules are imported lazily so that ``import mars_hf`` stays cheap and the decoding path
never pulls in TRL/PEFT.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "MARSConfig": "mars_hf.training.config",
    "MARSTrainer": "mars_hf.training.trainer",
    "MARSDataCollator": "mars_hf.training.collator",
    "mars_generate": "mars_hf.decoding.generation",
    "MARSGenerationMixin": "mars_hf.decoding.generation",
    "MARSGenerateOutput": "mars_hf.decoding.generation",
    "enable_mars": "mars_hf.decoding.enable",
    "MARSModel": "mars_hf.decoding.enable",
    "mars_class": "mars_hf.decoding.generation",
    "MARSBatchDecoder": "mars_hf.decoding.decoder",
    "RowSettings": "mars_hf.decoding.decoder",
    "MARSBlockCache": "mars_hf.decoding.cache",
    "MARSStaticCache": "mars_hf.decoding.cache",
    "PlannerMemory": "mars_hf.decoding.memory",
    "AutoMARSModelForCausalLM": "mars_hf.models.modeling",
    "add_mask_token": "mars_hf.models.mask_token",
    "get_mars_config": "mars_hf.models.mask_token",
    "set_mars_config": "mars_hf.models.mask_token",
    "self_distill": "mars_hf.training.data",
    "embedded_mars_checkpoint": "mars_hf.models.embedded_model",
    "packed_linears": "mars_hf.decoding.cpu_kernels",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mars_hf' has no attribute {name!r}")
