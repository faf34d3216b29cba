"""A benchmark's numbers per category of its prompts (MT-Bench's eight, HumanEval, a JSONL file's own).

Every batch holds prompts of one category only (`categorised_batches`), so each batch's own seconds,
forwards and tokens belong to one category, and a category's row is read from the same runs as the
overall rows: tokens per forward, the share of answers identical to stock greedy (same dtype) with the
near-tie flips among the others, and both speed ratios (`mars_hf.tools.bench.denominators`).
"""

from __future__ import annotations

import statistics

from mars_hf.tools.bench.denominators import add_denominators
from mars_hf.tools.bench.prompts import prepare_batches

# What a category row copies from its overall row (what the row *is*, not what it measured).
ROW_KEYS = (
    "batch",
    "scheme",
    "tau",
    "window",
    "layout",
    "prompt_lookup_num_tokens",
    "cache_block",
    "cpu_kernels",
    "masks",
    "acceptance",
    "kernels",
    "compiled",
    "mars_off",
)


def categorised_batches(tokenizer, prompts: list[str], categories: list[str] | None, batch_size: int):
    """``(batches, category of each batch)``: every category's prompts in batches of their own (the last
    filled up by cycling the category's prompts), categories in order of first appearance."""
    if categories is None:
        batches = prepare_batches(tokenizer, prompts, batch_size)
        return batches, [None] * len(batches)
    groups: dict[str, list[str]] = {}
    for prompt, category in zip(prompts, categories, strict=True):
        groups.setdefault(category, []).append(prompt)
    batches, batch_categories = [], []
    for category, group in groups.items():
        group_batches = prepare_batches(tokenizer, group, batch_size)
        batches += group_batches
        batch_categories += [category] * len(group_batches)
    return batches, batch_categories


def summarise_categories(
    batch_size: int, batch_categories: list, measurements, rows: list[dict]
) -> list[dict]:
    """One row per category and configuration (in ``rows``' order), with its denominators."""
    stock_tokens = next(iter(measurements.values()))[0].new_tokens
    result = []
    for category in dict.fromkeys(batch_categories):
        batches = [i for i, c in enumerate(batch_categories) if c == category]
        members = [i * batch_size + j for i in batches for j in range(batch_size)]
        group = []
        for row, runs in zip(rows, measurements.values()):
            first = runs[0]
            generated = sum(len(first.new_tokens[r]) for r in members)
            forwards = sum(first.forwards_per_batch[i] for i in batches)
            seconds = statistics.median(sum(run.batch_seconds[i] for i in batches) for run in runs)
            identical = sum(first.new_tokens[r] == stock_tokens[r] for r in members)
            differences = (row.get("divergences") or {}).get("differences") or []
            flips = sum(1 for d in differences if d["near_tie"] and d["row"] in members)
            group.append(
                {
                    **{key: row.get(key) for key in ROW_KEYS},
                    "category": category,
                    "rows": len(members),
                    "generated_tokens": generated,
                    "num_forwards": forwards,
                    "tokens_per_forward": generated / (batch_size * forwards),
                    "seconds": seconds,
                    "tokens_per_s": generated / seconds if seconds else None,
                    "rows_identical": identical,
                    "near_tie_flips": flips if "divergences" in row else None,
                }
            )
        stock = group[0]
        for category_row in group:
            rate, base = category_row["tokens_per_s"], stock["tokens_per_s"]
            category_row["speedup"] = rate / base if rate and base else None
        add_denominators(group)
        result += group
    return result
