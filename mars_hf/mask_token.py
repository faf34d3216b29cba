"""The `[MASK]` token and the `config.mars` metadata every MARS checkpoint carries.

MARS adds no parameters except one embedding row: the mask token. Everything MARS needs at load
time (block size, mask token id) lives in ``config.mars``, a plain dict saved in ``config.json``.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

DEFAULT_MASK_TOKEN = "<|mask|>"
# Bumped when the meaning of a key in ``config.mars`` changes.
MARS_FORMAT_VERSION = 1


def add_mask_token(model, tokenizer, mask_token: str = DEFAULT_MASK_TOKEN) -> int:
    """Make sure ``tokenizer`` has a mask token and ``model`` an embedding row for it.

    Reuses the tokenizer's own mask token when it has one. Otherwise adds ``mask_token`` as a special
    token. The embedding matrix is resized only when the tokenizer outgrows it (many checkpoints
    reserve spare rows), and every new row starts at the mean of the existing rows, which keeps the
    first MARS steps close to the base model. Returns the mask token id.
    """
    if tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": mask_token})
        logger.info("Added mask token %r to the tokenizer.", mask_token)
    mask_token_id = tokenizer.mask_token_id
    input_embeddings = model.get_input_embeddings()
    old_rows = input_embeddings.weight.shape[0]
    if len(tokenizer) > old_rows:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        _fill_new_rows_with_mean(model, old_rows)
        logger.info("Resized token embeddings from %d to %d rows.", old_rows, len(tokenizer))
    elif mask_token_id >= old_rows:  # pragma: no cover - defensive, tokenizer ids are < len(tokenizer)
        raise ValueError(f"mask token id {mask_token_id} does not fit the {old_rows}-row embedding matrix.")
    return int(mask_token_id)


@torch.no_grad()
def _fill_new_rows_with_mean(model, old_rows: int) -> None:
    """Initialise rows ``old_rows:`` of the input (and untied output) embeddings to the row mean."""
    matrices = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None and output.weight.data_ptr() != matrices[0].data_ptr():
        matrices.append(output.weight)
    for weight in matrices:
        weight[old_rows:] = weight[:old_rows].mean(dim=0, keepdim=True)
    if output is not None and getattr(output, "bias", None) is not None:
        output.bias[old_rows:] = output.bias[:old_rows].mean()


def set_mars_config(model_or_config, *, block_size: int, mask_token_id: int, **extra) -> dict:
    """Record MARS metadata in ``config.mars`` (saved to ``config.json`` by ``save_pretrained``)."""
    if int(block_size) < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    config = getattr(model_or_config, "config", model_or_config)
    mars = dict(getattr(config, "mars", None) or {})
    mars.update(
        {
            "block_size": int(block_size),
            "mask_token_id": int(mask_token_id),
            "format_version": MARS_FORMAT_VERSION,
            **extra,
        }
    )
    config.mars = mars
    return mars


def get_mars_config(model_or_config) -> dict:
    """Return ``config.mars``; raise an error that names the fix when it is missing or incomplete."""
    config = getattr(model_or_config, "config", model_or_config)
    mars = getattr(config, "mars", None)
    if not isinstance(mars, dict) or "block_size" not in mars or "mask_token_id" not in mars:
        raise ValueError(
            "This model has no MARS metadata (`config.mars` with `block_size` and `mask_token_id`). "
            "Train it with `MARSTrainer`, call `mars_hf.set_mars_config(model, block_size=..., "
            "mask_token_id=...)`, or load it with `AutoMARSModelForCausalLM.from_pretrained(..., block_size=...)`."
        )
    return mars


def suppress_mask_token(model) -> bool:
    """Never emit the mask token as an output (``generation_config.suppress_tokens``); True if added.

    The mask token is an input-only token. With tied input/output embeddings, training its input row
    also moves its output logit, and the model can start *generating* ``<|mask|>``. Suppressing it
    changes no other token's argmax, so greedy decoding is otherwise untouched.
    """
    mask_token_id = int(get_mars_config(model)["mask_token_id"])
    config = model.generation_config
    suppressed = list(config.suppress_tokens or [])
    if mask_token_id in suppressed:
        return False
    config.suppress_tokens = [*suppressed, mask_token_id]
    logger.info("Suppressing the mask token (id %d) as an output token.", mask_token_id)
    return True
