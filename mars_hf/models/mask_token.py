"""The `[MASK]` token and the `config.mars` metadata every MARS checkpoint carries.

MARS adds no parameters except one embedding row: the mask token. Everything MARS needs at load
time (block size, mask token id) lives in ``config.mars``, a plain dict saved in ``config.json``.
"""

from __future__ import annotations

import logging

import torch

from mars_hf.decoding.gated_lora import grow_embeddings

logger = logging.getLogger(__name__)

DEFAULT_MASK_TOKEN = "<|mask|>"
# Bumped when the meaning of a key in ``config.mars`` changes.
MARS_FORMAT_VERSION = 1


# Where the mask token goes (``add_mask_token(placement=...)``, ``MARSConfig.mask_token_placement``).
# "append": the historical default (a new token; on a spare row when there is one, else one more row).
# The other three never change the vocabulary size, which serving the model as a separate drafter
# needs (vLLM requires the drafter's vocab_size to equal the target's; docs/serving_at_scale.md).
MASK_PLACEMENTS = ("append", "spare_row", "reuse_token", "keep_vocab_size")


def add_mask_token(
    model, tokenizer, mask_token: str = DEFAULT_MASK_TOKEN, *, placement: str = "append"
) -> int:
    """Make sure ``tokenizer`` has a mask token and ``model`` an embedding row for it; return its id.

    A tokenizer's own mask token is always reused. Otherwise ``placement`` decides:

    * ``"append"`` (default): add ``mask_token`` as a special token. The embeddings are resized only
      when the tokenizer outgrows them (many checkpoints reserve spare rows); new rows start at the
      mean of the existing rows, which keeps the first MARS steps close to the base model.
    * ``"spare_row"``: add ``mask_token`` on the first spare embedding row (an id the tokenizer does not
      use, e.g. Qwen2.5's reserved rows); raises when there is none. Never resizes.
    * ``"reuse_token"``: make an existing special token the mask token: ``mask_token`` itself when the
      tokenizer has it (the explicit choice), else one found by :func:`find_unused_special_token`.
    * ``"keep_vocab_size"``: ``"spare_row"`` when a spare row exists, else ``"reuse_token"``.

    The last three rewrite the chosen row (input, and output when untied) to the mean row, like a fresh
    row: a spare row holds whatever pretraining left there and a reused token carries its old meaning.
    ``config.mars["base_vocab_size"]`` records the row count before this call, so an exporter can tell
    whether the vocabulary grew. A reused token is the mask from then on: text that spells it (in training
    data or prompts) is read as a mask.
    """
    if placement not in MASK_PLACEMENTS:
        raise ValueError(f"placement must be one of {MASK_PLACEMENTS}, got {placement!r}.")
    rows = model.get_input_embeddings().weight.shape[0]
    _record_base_vocab_size(model, rows)
    if placement == "append":
        if tokenizer.mask_token is None:
            tokenizer.add_special_tokens({"mask_token": mask_token})
            logger.info("Added mask token %r to the tokenizer.", mask_token)
        return _append(model, tokenizer, rows)
    if tokenizer.mask_token is not None:
        mask_token_id = int(tokenizer.mask_token_id)
        if mask_token_id >= rows:
            raise ValueError(
                f"The tokenizer's mask token {tokenizer.mask_token!r} has id {mask_token_id}, beyond the "
                f"{rows}-row embedding matrix, so placement={placement!r} cannot keep the vocabulary size. "
                "Use a tokenizer without a mask token, or placement='append'."
            )
        return mask_token_id
    if placement == "keep_vocab_size":
        placement = "spare_row" if len(tokenizer) < rows else "reuse_token"
    if placement == "spare_row":
        if len(tokenizer) >= rows:
            raise ValueError(
                f"The embedding matrix has no spare row: {rows} rows for a {len(tokenizer)}-token tokenizer. "
                "Use placement='reuse_token' (an unused special token becomes the mask) or 'keep_vocab_size'."
            )
        if mask_token in tokenizer.get_vocab():
            raise ValueError(
                f"{mask_token!r} is already a token of this tokenizer; to make it the mask token use "
                "placement='reuse_token'."
            )
        tokenizer.add_special_tokens({"mask_token": mask_token})
        logger.info("Put mask token %r on spare embedding row %d.", mask_token, tokenizer.mask_token_id)
    else:  # reuse_token
        vocab = tokenizer.get_vocab()
        if mask_token in vocab:
            chosen = mask_token
        elif mask_token != DEFAULT_MASK_TOKEN:
            raise ValueError(
                f"placement='reuse_token' with mask_token={mask_token!r}, but the tokenizer has no such token. "
                "Name one of its tokens, or leave mask_token at its default to pick an unused special token."
            )
        else:
            chosen = find_unused_special_token(tokenizer, max_id=rows)
        tokenizer.mask_token = chosen
        logger.warning(
            "Using the existing token %r (id %d) as the mask token; it is no longer an ordinary token of this "
            "model. To choose another, pass its text as mask_token with placement='reuse_token'.",
            chosen,
            tokenizer.mask_token_id,
        )
    mask_token_id = int(tokenizer.mask_token_id)
    if mask_token_id >= rows:
        raise ValueError(f"mask token id {mask_token_id} does not fit the {rows}-row embedding matrix.")
    fill_rows_with_mean(model, [mask_token_id])
    return mask_token_id


def find_unused_special_token(tokenizer, max_id: int | None = None) -> str:
    """The highest-id special token that nothing names: not bos/eos/pad/unk/... and not in the chat template.

    Such tokens are reserved by the tokenizer (SmolLM2's code-pretraining markers ``<repo_name>`` ...
    ``<empty_output>``) and never produced in chat use. The highest id is taken so that the choice is
    deterministic; pass a token explicitly when you know better.
    """
    named = set(tokenizer.all_special_tokens)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if isinstance(tokenizer.chat_template, dict):
        template = " ".join(tokenizer.chat_template.values())
    candidates = [
        (int(token_id), added.content)
        for token_id, added in tokenizer.added_tokens_decoder.items()
        if added.special
        and added.content not in named
        and added.content not in template
        and (max_id is None or int(token_id) < max_id)
    ]
    if not candidates:
        raise ValueError(
            "The tokenizer has no unused special token (every special token is named or used by the chat "
            "template) and the embedding matrix has no spare row, so the mask token cannot be placed without "
            "resizing. Use placement='append' (the vocabulary grows by one row), or name a token to reuse."
        )
    return max(candidates)[1]


def _record_base_vocab_size(model, rows: int) -> None:
    mars = dict(getattr(model.config, "mars", None) or {})
    mars.setdefault("base_vocab_size", int(rows))
    model.config.mars = mars


def _append(model, tokenizer, old_rows: int) -> int:
    """The historical path: grow the embeddings only if the tokenizer outgrew them (new rows = mean)."""
    if len(tokenizer) > old_rows:
        grow_embeddings(model, len(tokenizer))
        logger.info("Resized token embeddings from %d to %d rows.", old_rows, len(tokenizer))
    mask_token_id = int(tokenizer.mask_token_id)
    if mask_token_id >= model.get_input_embeddings().weight.shape[0]:  # pragma: no cover - defensive
        raise ValueError(f"mask token id {mask_token_id} does not fit the embedding matrix.")
    return mask_token_id


@torch.no_grad()
def fill_rows_with_mean(model, ids: list[int]) -> None:
    """Set rows ``ids`` of the input (and untied output) embeddings to the mean of the other rows."""
    matrices = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None and output.weight.data_ptr() != matrices[0].data_ptr():
        matrices.append(output.weight)
    for weight in matrices:
        keep = torch.ones(weight.shape[0], dtype=torch.bool, device=weight.device)
        keep[ids] = False
        weight[ids] = weight[keep].mean(dim=0, keepdim=True)
    if output is not None and getattr(output, "bias", None) is not None:
        keep = torch.ones(output.bias.shape[0], dtype=torch.bool, device=output.bias.device)
        keep[ids] = False
        output.bias[ids] = output.bias[keep].mean()


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
