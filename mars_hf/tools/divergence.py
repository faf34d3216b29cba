"""Where a lossless run's greedy output leaves stock greedy's, and whether that is a near tie.

Why: verified decoding and τ = 1 are the model's own greedy output token for token, but only as far as
floating point lets them be. A forward of several rows runs other kernels than a one-row forward, and in
bfloat16 the two round differently; where the model's top two tokens are almost equally likely, that can
flip greedy's choice and every token after it. Such a *near-tie flip* is a property of the arithmetic; a
divergence at a token the model clearly prefers is a bug. This module tells the two apart at each row's
first differing token ``t``: the *gap* is the reference model's logit for stock's token minus its logit for
the other run's token there, computed by one forward of the shared prefix. It is a near tie when the gap is
within ``spacings`` bfloat16 spacings at that logit's magnitude (``2^(e - 7)`` for a logit in ``[2^e,
2^(e+1))``): a gap bf16's own rounding of the logit can hide.

`mars-hf bench`, `mars-hf gpu-check` and the quickstart measure the gap in float32 (on a float32 copy of a
bfloat16 model, made only when some row differs).
"""

from __future__ import annotations

import math
import statistics

import torch

TIE_SPACINGS = 4


def narrower_than_float32(dtype: torch.dtype) -> bool:
    """Whether a model in ``dtype`` needs a float32 copy to measure its gaps in float32 (bf16, fp16)."""
    return dtype not in (torch.float32, torch.float64)


def first_difference(stock: list[int], tokens: list[int]) -> int | None:
    """The first position where the two token lists differ; the shorter length where one list is a prefix of
    the other (a run that stopped earlier or later); None where they are equal."""
    length = min(len(stock), len(tokens))
    first = next((t for t in range(length) if stock[t] != tokens[t]), None)
    if first is None:
        return None if len(stock) == len(tokens) else length
    return first


def tie_tolerance(logit: float, spacings: int = TIE_SPACINGS) -> float:
    """``spacings`` bfloat16 spacings at the magnitude of ``logit``: how far apart two logits may be and
    still swap order under bf16 rounding."""
    magnitude = max(abs(float(logit)), 1e-3)
    return spacings * 2.0 ** (math.floor(math.log2(magnitude)) - 7)


def judge_gap(
    row: int, position: int, logits: torch.Tensor, stock_token: int, other_token: int, spacings: int
):
    """One differing row's record, from the reference logits at its first differing token."""
    gap = float(logits[stock_token] - logits[other_token])
    tolerance = tie_tolerance(float(logits[stock_token]), spacings)
    return {
        "row": row,
        "position": position,
        "stock_token": int(stock_token),
        "other_token": int(other_token),
        "gap": gap,
        "tie_tolerance": tolerance,
        "near_tie": abs(gap) <= tolerance,
    }


def summarise(stock_tokens: list[list[int]], firsts: list[int | None], differences: list[dict]) -> dict:
    """Counts over rows, from each row's `first_difference` (``firsts``): identical rows, near-tie flips, other
    differences (a wider gap, or a run that stopped earlier or later), the mean share of each stock answer the
    run agreed on before diverging."""
    prefixes = [1.0 if f is None else f / max(len(a), 1) for f, a in zip(firsts, stock_tokens)]
    rows, identical = len(stock_tokens), firsts.count(None)
    flips = sum(1 for d in differences if d["near_tie"])
    return {
        "rows": rows,
        "rows_identical": identical,
        "agreement": identical / max(rows, 1),
        "mean_agreeing_prefix": statistics.mean(prefixes) if prefixes else None,
        "near_tie_flips": flips,
        "other_differences": len(differences) - flips,
        "differences": differences,
    }


def compare(stock_tokens, tokens, logits_at, spacings: int = TIE_SPACINGS) -> dict:
    """Compare each row's tokens with stock greedy's (both cut after EOS), judging a row that differs at a
    token by ``logits_at(row, position)``, the reference logits there (called only for such rows)."""
    firsts = [first_difference(a, b) for a, b in zip(stock_tokens, tokens)]
    differences = []
    for row, (a, b, first) in enumerate(zip(stock_tokens, tokens, firsts)):
        if first is None:
            continue
        if first >= min(len(a), len(b)):
            differences.append(_length_difference(row, first))
            continue
        differences.append(judge_gap(row, first, logits_at(row, first), a[first], b[first], spacings))
    return summarise(stock_tokens, firsts, differences)


def compare_with_reference(
    reference_model, prompts: list[list[int]], stock_tokens, tokens, spacings: int = TIE_SPACINGS
) -> dict:
    """`compare`, judged by ``reference_model``'s logits at the first differing token: one uncached forward of
    the row's prompt (``prompts[row]``, no padding) and the tokens both runs share. Pass a float32 copy of a
    bfloat16 model to measure the gap in float32."""
    logits_at = _shared_prefix_logits(lambda: reference_model, prompts, stock_tokens)
    return compare(stock_tokens, tokens, logits_at, spacings)


def judge_against_stock(reference, prompts: list[list[int]], stock_tokens, tokens) -> dict:
    """`compare_with_reference` on ``reference()``, a function called only when a row differs at a token (so
    that a float32 copy is built or loaded only then); the record adds ``gap_dtype``, the dtype the gaps
    were measured in (None where no gap was measured)."""
    loaded = []

    def model():
        if not loaded:
            loaded.append(reference())
        return loaded[0]

    comparison = compare(stock_tokens, tokens, _shared_prefix_logits(model, prompts, stock_tokens))
    comparison["gap_dtype"] = (
        str(next(loaded[0].parameters()).dtype).replace("torch.", "") if loaded else None
    )
    return comparison


def _shared_prefix_logits(model, prompts, stock_tokens):
    """`compare`'s ``logits_at``: ``model()``'s next-token logits (float32) after a row's prompt and the
    tokens both runs share, by one uncached forward."""

    @torch.no_grad()
    def logits_at(row: int, position: int) -> torch.Tensor:
        reference = model()
        ids = list(prompts[row]) + stock_tokens[row][:position]
        ids = torch.tensor([ids], device=next(reference.parameters()).device)
        return reference(input_ids=ids, use_cache=False).logits[0, -1].float()

    return logits_at


def prompt_rows(batches) -> list[list[int]]:
    """Each decoded row's prompt tokens without its left padding, in the order the rows were decoded."""
    return [
        ids[mask.bool()].tolist()
        for inputs in batches
        for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])
    ]


def _length_difference(row: int, position: int) -> dict:
    """A run that agreed on every token both have but stopped earlier or later: not a token flip."""
    return {
        "row": row,
        "position": position,
        "stock_token": None,
        "other_token": None,
        "gap": None,
        "tie_tolerance": None,
        "near_tie": False,
    }
