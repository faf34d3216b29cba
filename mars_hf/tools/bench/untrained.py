"""The row that isolates the masks: the checkpoint's base model with an untrained mask row.

Why: part of verify's speed is not the training. A base model already guesses some tokens through a
mask row it never saw, and a step of several rows may run on cheaper kernels than stock's one-row step.
Verify on the *base* model with a mean-initialized mask row (no adapter, same window, planner and kernels)
is what MARS gives without training; verify with the trained masks ÷ that row is what the training adds
("masks' own value").
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch

from mars_hf.decoding.gated_lora import grow_embeddings
from mars_hf.decoding.generation import enable_mars
from mars_hf.decoding.settings import model_defaults
from mars_hf.models.mask_token import fill_rows_with_mean, set_mars_config

logger = logging.getLogger(__name__)


def adapter_base(name_or_path: str | None) -> str | None:
    """The base model an adapter checkpoint was trained on (the embedded SmolLM2 for ``embedded-mars``);
    None for anything that is not a local adapter folder (a full checkpoint carries no record of its base)."""
    from mars_hf.models.embedded_model import resolve_adapter_base, resolve_model_path

    if name_or_path in (None, "synthetic"):
        return None
    folder = Path(resolve_model_path(name_or_path))
    config = folder / "adapter_config.json"
    if not folder.is_dir() or not config.is_file() or (folder / "config.json").is_file():
        return None
    recorded = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    return resolve_adapter_base(str(folder), recorded)


@torch.no_grad()
def with_untrained_mask(base_model, trained_model):
    """``base_model`` (no MARS training, no adapter) made to decode like ``trained_model`` but with a
    mean-initialized mask row: the trained model's mask token id and window, the mask row set to the mean
    of the base's other rows (a row added past the base's vocabulary starts there too). Returns it, in
    eval mode with MARS enabled."""
    settings = model_defaults(trained_model)
    mask_token_id, window = int(settings["mask_token_id"]), int(settings["block_size"])
    rows = base_model.get_input_embeddings().weight.shape[0]
    if mask_token_id >= rows:
        grow_embeddings(base_model, mask_token_id + 1)  # new rows: the mean of the base's rows
    else:
        fill_rows_with_mean(base_model, [mask_token_id])
    set_mars_config(base_model, block_size=window, mask_token_id=mask_token_id, base_vocab_size=rows)
    base_model.generation_config = copy.deepcopy(trained_model.generation_config)
    base_model.eval()
    return enable_mars(base_model)


def load_untrained_mask_model(trained_model, base: str):
    """Load ``base`` in the trained model's dtype and device and give it an untrained mask row
    (`with_untrained_mask`)."""
    from transformers import AutoModelForCausalLM

    from mars_hf.models.embedded_model import resolve_model_path

    parameter = next(trained_model.parameters())
    logger.info("Loading %s with a mean-initialized mask row (the untrained-mask row).", base)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(base), dtype=parameter.dtype)
    return with_untrained_mask(model.to(parameter.device), trained_model)
