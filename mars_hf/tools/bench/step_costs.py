"""The §4 cost model next to the measurements: what a k-token cached forward costs against a 1-token one,
and the speed-up that predicts for each row.

Each row's forwards are timed on the kernels the row ran on (a MARS row's multi-row linears on packed
kernels where its ``mars_cpu_kernels`` mode picks them, stock `generate` on stock ones unless it is the
``stock+packed`` row), against stock `generate`'s own 1-token forward: on a CPU the two kernels differ by
far more than the columns do (SmolLM2 float32 at batch 1, one 2-vCPU AVX2 EPYC: 9 columns cost 1.99× stock's
one column on stock kernels, 1.29× on packed ones), and a cost read on the wrong kernels predicted 0.89× for a
row that ran 1.33×.
"""

from __future__ import annotations

import math
import time

import torch

from mars_hf.decoding.cpu_kernels import packed_linears, use_packed
from mars_hf.decoding.settings import model_defaults


@torch.no_grad()
def measure_step_costs(
    model, inputs, *, context_tokens: int, step_sizes, full_lengths=(), repeats: int = 5, mask_token_id=None
):
    """Seconds (fastest of ``repeats``) of a cached forward of ``k`` new tokens on a ``context_tokens``-long prefix, for
    each ``k`` in ``step_sizes``, and of an uncached forward of each length in ``full_lengths``.

    The prefix is the (left-padded) prompt batch extended with filler tokens, the batch the model sees
    in the benchmark; the cache is cropped back after each timed forward so every ``k`` sees the
    same prefix. With ``mask_token_id``, a forward of ``k > 1`` tokens feeds one real token then ``k - 1``
    masks, as a MARS step (and the decoder's cost probe) does: on a gated checkpoint the masks switch the
    adapter on, and random tokens alone timed the base model (embedded-mars in bf16 on an AVX-512 BF16 CPU:
    9 columns read 1.13× one packed column that way, 1.27× with the adapter the steps really ran).
    """
    from transformers import DynamicCache

    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    batch = input_ids.shape[0]
    filler = max(0, context_tokens - input_ids.shape[1])
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    prefix = torch.cat([input_ids, torch.randint(0, vocab, (batch, filler), generator=generator)], dim=1)
    prefix_mask = torch.cat([attention_mask, torch.ones(batch, filler, dtype=attention_mask.dtype)], dim=1)
    positions = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, attention_mask=prefix_mask, position_ids=positions, cache=cache, use_cache=True)
    last = positions[:, -1:]
    cached = {}
    for k in sorted({int(size) for size in step_sizes}):
        mask = torch.cat([prefix_mask, torch.ones(batch, k, dtype=prefix_mask.dtype)], dim=1)
        new = torch.randint(0, vocab, (batch, k), generator=generator)
        if mask_token_id is not None:
            new[:, 1:] = int(mask_token_id)
        cached[k] = (new, mask, last + torch.arange(1, k + 1))
    uncached = {
        n: torch.randint(0, vocab, (batch, n), generator=generator) for n in sorted(set(full_lengths))
    }
    times = {("cached", k): [] for k in cached} | {("full", n): [] for n in uncached}
    # Interleaved (every size once per round) so that a busy spell of a shared machine hits all sizes;
    # round 0 is a warm-up.
    for round_index in range(repeats + 1):
        for k, (new, mask, position_ids) in cached.items():
            start = time.perf_counter()
            model(input_ids=new, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True)
            elapsed = time.perf_counter() - start
            cache.crop(-k)
            if round_index:
                times[("cached", k)].append(elapsed)
        for n, ids in uncached.items():
            start = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            if round_index:
                times[("full", n)].append(time.perf_counter() - start)
    # The fastest repeat: a forward of a few milliseconds is easily slowed by a neighbour process on
    # a shared machine, never sped up, so the minimum is the steadiest estimate of its cost.
    costs = {k: min(times[("cached", k)]) for k in cached}
    full_costs = {n: min(times[("full", n)]) for n in uncached}
    return costs, full_costs


def _interpolate(costs: dict[int, float], x: float) -> float:
    low, high = math.floor(x), math.ceil(x)
    if low == high or high not in costs:
        return costs[low if low in costs else high]
    return costs[low] + (costs[high] - costs[low]) * (x - low)


def add_cost_model(model, inputs, rows, args) -> dict:
    """Measure what the rows' forwards cost and add each row's predicted speedup (docs/method.md §4).

    ``step_tokens`` is the mean number of tokens a row's forwards fed after the prompt's (counted by
    the forward hook): 1 for stock, n + W for the cursor scheme, the uncommitted block plus masks
    for the block scheme, and the whole sequence, recomputed without cache, for ``none``. The
    prediction is (tokens per forward relative to stock) ÷ (cost of such a forward ÷ a 1-token one).
    """
    stock = rows[0]
    mean_generated = stock["generated_tokens"] / len(stock["generated_per_row"])
    context = round(stock["prompt_tokens"] + mean_generated / 2)
    step_sizes, full_lengths = {1}, set()
    for row in rows:
        if row["scheme"] == "none":
            full_lengths.add(round(row["step_tokens"]))
        else:
            step_sizes.update({math.floor(row["step_tokens"]), math.ceil(row["step_tokens"])})
    kernels_of = [row_kernels(model, row) for row in rows]
    measured = {}  # kernels -> (cached costs, uncached costs); stock first: its 1-token forward is the unit
    for kernels in sorted({"stock", *kernels_of}, key=lambda k: k != "stock"):
        with packed_linears(model, kernels):
            measured[kernels] = measure_step_costs(
                model,
                inputs,
                context_tokens=context,
                step_sizes=step_sizes,
                full_lengths=full_lengths,
                repeats=args.cost_repeats,
                mask_token_id=model_defaults(model).get("mask_token_id"),
            )
    one = measured["stock"][0][1]
    for row, kernels in zip(rows, kernels_of):
        costs, full_costs = measured[kernels]
        if row["scheme"] == "none":
            relative_cost = full_costs[round(row["step_tokens"])] / one
        else:
            relative_cost = _interpolate(costs, row["step_tokens"]) / one
        relative_tpf = row["tokens_per_forward"] / stock["tokens_per_forward"]
        row["step_kernels"] = kernels
        row["step_cost"] = relative_cost
        row["predicted_speedup"] = relative_tpf / relative_cost
    result = {"context_tokens": context, "one_token_seconds": one}
    for kernels, (costs, full_costs) in measured.items():
        suffix = "" if kernels == "stock" else f"_{kernels}"
        result[f"cached_step_cost{suffix}"] = {str(k): v / one for k, v in sorted(costs.items())}
        result[f"uncached_forward_cost{suffix}"] = {str(k): v / one for k, v in sorted(full_costs.items())}
    return result


def row_kernels(model, row: dict) -> str:
    """``"packed"``, ``"stock"`` or ``"compiled"``: the kernels a bench row's forwards ran on (``compiled``: the
    Inductor graph of transformers' fast path) (stock `generate` on stock ones
    unless it is the stock+packed row; a MARS row on what its ``mars_cpu_kernels`` mode picks)."""
    if row.get("compiled"):
        return "compiled"
    mode = row.get("cpu_kernels") or "auto"
    if row["scheme"] == "stock":
        return "packed" if mode == "packed" else "stock"
    return "packed" if use_packed(model, mode) else "stock"
