"""Where a generation ends: a model's EOS ids, the pad id used with them, and a token list cut at its first EOS.

Training data, evaluation runs and the lm-eval adapter all read generated tokens the same way; this is the
one definition they share.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends a generation: the model's ``generation_config.eos_token_id`` (one or a list)
    plus the tokenizer's EOS. Raises when neither defines one (a generation would never end)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = {int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("The tokenizer and generation config define no EOS token; set `tokenizer.eos_token`.")
    return ids


def pad_token_id(tokenizer, eos_ids: Collection[int]) -> int:
    """The tokenizer's pad token, else the smallest EOS id (padding is masked out either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)


def trim_at_eos(tokens: Iterable[int], eos_ids: Collection[int]) -> list[int]:
    """``tokens`` up to and including the first one in ``eos_ids`` (all of them when none is)."""
    trimmed = []
    for token in tokens:
        trimmed.append(token)
        if token in eos_ids:
            break
    return trimmed
