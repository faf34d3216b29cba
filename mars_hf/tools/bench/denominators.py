"""Each MARS row's two denominators: stock `generate`, and MARS-off on the same kernels; and the masks' own value.

Why two: on a CPU a MARS step's multi-row linears may run on packed oneDNN kernels that plain decoding could
use too, and the base model guesses some tokens through even an untrained mask row. A speed-up against
stock `generate` mixes those in; against MARS-off on the same kernels it is MARS's own gain:

- ``vs_off`` = the row's tokens/s ÷ the fastest MARS-off row on the same kernels (``kernels``: what its
  forwards ran on, ``"packed"`` or ``"stock"``), in the same batch size (and category). MARS-off is stock
  `generate` (on packed kernels: the ``stock+packed`` row) or τ = 1 through our decoder (one token per
  forward), without prompt lookup; ``off_reference`` names the row it was divided by.
- ``masks_value`` (verify rows with the trained masks) = tokens/s ÷ the tokens/s of the same configuration
  on the untrained-mask model (`mars_hf.tools.bench.untrained`): what the training adds. Per token, since
  in bfloat16 the two runs' answers can differ at near ties and so their lengths.
"""

from __future__ import annotations

from mars_hf.decoding.acceptance import one_token_per_step
from mars_hf.tools.bench.step_costs import row_kernels

IDENTITY = (
    "scheme",
    "tau",
    "window",
    "layout",
    "prompt_lookup_num_tokens",
    "cache_block",
    "cpu_kernels",
    "compiled",
)


def label_rows(model, rows: list[dict], acceptance: str) -> None:
    """Give each row ``kernels`` (what its forwards ran on) and ``mars_off`` (whether it decodes one token
    per forward without drafts: a denominator)."""
    for row in rows:
        row["kernels"] = row_kernels(model, row)
        row["mars_off"] = is_mars_off(row, acceptance)


def is_mars_off(row: dict, acceptance: str) -> bool:
    """Stock `generate` (any kernels) or τ in one-token mode, without prompt lookup, with the trained model."""
    if row.get("prompt_lookup_num_tokens") or row.get("masks", "trained") != "trained":
        return False
    if row["scheme"] == "stock":
        return True
    return (
        row["acceptance"] != "verify"
        and row["tau"] is not None
        and one_token_per_step(acceptance, row["tau"])
    )


def off_label(row: dict) -> str:
    """A MARS-off row's short name: ``stock``, ``stock+packed``, ``tau=1 W=4`` (with a forced kernel mode)."""
    mode = row.get("cpu_kernels") or "auto"
    compiled = " compiled" if row.get("compiled") else ""
    if row["scheme"] == "stock":
        return "stock" + ("+packed" if mode == "packed" else "") + compiled
    return f"tau={row['tau']:g} W={row['window']}" + ("" if mode == "auto" else f" {mode}") + compiled


def add_denominators(rows: list[dict], rate: str = "tokens_per_s") -> None:
    """``vs_off``, ``off_reference`` and ``masks_value`` of every MARS row of one group (one batch size, or
    one category of it), from the group's own ``rate``s: the same run's numbers."""
    for row in rows:
        if row["scheme"] == "stock" or not row[rate]:
            continue
        references = [
            other
            for other in rows
            if other is not row and other["mars_off"] and other["kernels"] == row["kernels"] and other[rate]
        ]
        if references:
            best = max(references, key=lambda other: other[rate])
            row["vs_off"], row["off_reference"] = row[rate] / best[rate], off_label(best)
        else:
            row["vs_off"], row["off_reference"] = None, None
        row["masks_value"] = None
        if row["acceptance"] == "verify" and row.get("masks", "trained") == "trained":
            twin = untrained_twin(rows, row)
            if twin is not None and twin[rate]:
                row["masks_value"] = row[rate] / twin[rate]


def untrained_twin(rows: list[dict], row: dict) -> dict | None:
    """The row of the same configuration on the untrained-mask model, if the group has one."""
    key = tuple(row.get(name) for name in IDENTITY)
    return next(
        (
            other
            for other in rows
            if other.get("masks") == "untrained" and tuple(other.get(name) for name in IDENTITY) == key
        ),
        None,
    )
