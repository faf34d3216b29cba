"""mars_hf: train and serve MARS (Mask AutoRegreSsion) models the Hugging Face way.

Submodules are imported lazily so that ``import mars_hf`` stays cheap and the decoding path
never pulls in TRL/PEFT.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "MARSConfig": "mars_hf.config",
    "MARSTrainer": "mars_hf.trainer",
    "MARSDataCollator": "mars_hf.trainer",
    "mars_generate": "mars_hf.generation",
    "MARSGenerationMixin": "mars_hf.generation",
    "MARSGenerateOutput": "mars_hf.generation",
    "enable_mars": "mars_hf.generation",
    "MARSBatchDecoder": "mars_hf.decoder",
    "RowSettings": "mars_hf.decoder",
    "MARSBlockCache": "mars_hf.cache",
    "AutoMARSModelForCausalLM": "mars_hf.modeling",
    "add_mask_token": "mars_hf.mask_token",
    "get_mars_config": "mars_hf.mask_token",
    "set_mars_config": "mars_hf.mask_token",
    "self_distill": "mars_hf.data",
    "embedded_mars_checkpoint": "mars_hf.embedded_model",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mars_hf' has no attribute {name!r}")
