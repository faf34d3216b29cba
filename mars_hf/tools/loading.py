"""Load a model by name for the project's own commands: a checkpoint folder, a Hub id, ``embedded``,
``embedded-mars`` or ``synthetic``, in the dtype asked for (``auto``: the fastest this CPU computes natively)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_hf.decoding.generation import MARSGenerationMixin, enable_mars
from mars_hf.models.embedded_model import resolve_model_path
from mars_hf.models.mask_token import add_mask_token, set_mars_config
from mars_hf.models.modeling import load_mars_model, require_tokenizer
from mars_hf.models.precision import choose_dtype, log_choice, model_shapes

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 4


def resolve_dtype(name_or_path: str | None, dtype="auto"):
    """The torch dtype to load ``name_or_path`` in (``"auto"`` decided by `mars_hf.models.precision`); logged."""
    if dtype != "auto":
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if name_or_path == "synthetic":
        torch_dtype, why = choose_dtype("auto", hidden_size=None)
    else:
        hidden, intermediate = model_shapes(resolve_model_path(name_or_path))
        torch_dtype, why = choose_dtype("auto", hidden_size=hidden, intermediate_size=intermediate)
    log_choice(torch_dtype, why, name_or_path or "embedded model")
    return torch_dtype


def load_model_and_tokenizer(
    name_or_path: str | None = None, *, block_size: int = DEFAULT_BLOCK_SIZE, dtype="float32"
):
    """Load a model ready for ``generate(mars_threshold=...)``; returns ``(model, tokenizer, trained)``.

    ``trained`` is False when the model had no ``config.mars``: then a mask token is added (its
    embedding is untrained, so MARS accepts about one token per step) and a warning is logged.
    ``"synthetic"`` loads the tiny model trained on `mars_hf.tools.synthetic` (training it once if needed);
    ``"embedded-mars"`` the MARS model shipped with the package. ``dtype="auto"``: see
    `mars_hf.models.precision.choose_dtype`.
    """
    torch_dtype = resolve_dtype(name_or_path, dtype)
    if name_or_path == "synthetic":
        from mars_hf.tools.synthetic import load_synthetic_model

        model, tokenizer = load_synthetic_model(dtype=torch_dtype)
    else:
        path = resolve_model_path(name_or_path)
        if _is_mars_checkpoint(path):
            model, tokenizer = load_mars_model(path, dtype=torch_dtype)
            tokenizer = require_tokenizer(tokenizer, path, "decoding text prompts")
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    model.eval()
    trained = isinstance(getattr(model.config, "mars", None), dict)
    if not trained:
        logger.warning(
            "%s has no MARS metadata (config.mars): adding a mask token with an UNTRAINED embedding and "
            "block_size=%d. MARS will accept about one token per forward; train it with MARSTrainer first "
            "for real speed-ups.",
            name_or_path or "The embedded model",
            block_size,
        )
        mask_token_id = add_mask_token(model, tokenizer)
        set_mars_config(model, block_size=block_size, mask_token_id=mask_token_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # a MARS checkpoint loads as its MARS class; a plain model is owned by a MARSModel (enable_mars)
    return (model if isinstance(model, MARSGenerationMixin) else enable_mars(model)), tokenizer, trained


def _is_mars_checkpoint(path: str) -> bool:
    """A local folder with ``config.mars``, a LoRA adapter, or the paper's ``a2d-*`` model type; a Hub id
    (not a local folder) is left to `mars_hf.models.modeling.load_mars_model`, which knows every format."""
    folder = Path(path)
    if not folder.is_dir():
        return True
    if (folder / "adapter_config.json").exists() and not (folder / "config.json").exists():
        return True
    config_file = folder / "config.json"
    if not config_file.exists():
        return False
    config = json.loads(config_file.read_text())
    return isinstance(config.get("mars"), dict) or str(config.get("model_type", "")).startswith("a2d-")




def load_served_model(name_or_path: str, dtype: str = "float32"):
    """``(model, tokenizer)`` for `mars-hf serve` / `loadtest`; warns when the model has no MARS training."""
    model, tokenizer, trained = load_model_and_tokenizer(name_or_path, dtype=dtype)
    if not trained:
        logger.warning("Serving a model without MARS training: expect about one token per forward.")
    return model, tokenizer
