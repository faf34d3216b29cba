"""A benchmark's rows: one per configuration and batch size, with ratios against stock `generate`."""

from __future__ import annotations

import statistics

from mars_hf.tools.bench.configurations import BenchConfiguration


def summarise_measurements(batch_size, batches, measurements, model_name) -> list[dict]:
    """One row per configuration from its repeats (the first run's outputs and counts, the median time),
    with ratios against the stock row, which comes first."""
    stock_tokens = measurements[BenchConfiguration("stock")][0].new_tokens
    prompt_tokens = statistics.mean(inputs["input_ids"].shape[1] for inputs in batches)
    rows = []
    for configuration, runs in measurements.items():
        first = runs[0]
        generated = sum(first.generated_per_row)
        seconds = statistics.median(r.seconds for r in runs)
        same_rows = [a == b for a, b in zip(first.new_tokens, stock_tokens)]
        row = {
            "model": model_name,
            "batch": batch_size,
            "tau": configuration.tau,
            "window": configuration.window,
            "scheme": configuration.scheme,
            "acceptance": "verify"
            if configuration.verify
            else ("stock" if configuration.scheme == "stock" else None),
            "layout": configuration.layout,
            "prompt_lookup_num_tokens": configuration.lookup,
            "cache_block": configuration.cache_block,
            "cpu_kernels": configuration.cpu_kernels,
            "masks": getattr(configuration, "masks", "trained"),
            "compiled": configuration.compiled,
            "num_batches": len(batches),
            "prompt_tokens": prompt_tokens,
            "generated_tokens": generated,
            "generated_per_row": first.generated_per_row,
            "num_forwards": first.num_forwards,
            "forwards_per_batch": first.forwards_per_batch,
            "counted_forwards": first.counted_forwards,
            "tokens_per_forward": generated / (batch_size * first.num_forwards),
            "accepted_per_row": first.accepted_per_row,
            "step_tokens": first.step_tokens,
            "seconds": seconds,
            "seconds_all": [r.seconds for r in runs],
            "tokens_per_s": generated / seconds,
            "same_as_stock": sum(same_rows) / len(same_rows),
            "deterministic": all(r.new_tokens == first.new_tokens for r in runs),
            "width_histogram": first.width_histogram,
            "plan_counts": first.plan_counts,
            "cost_curve": first.cost_curve,
            "drafts_by_source": first.drafts_by_source,
            # kept drafts per row-forward, by source: what each source added to tokens per forward
            "tokens_per_forward_by_source": {
                source: counts["accepted"] / (batch_size * first.num_forwards)
                for source, counts in (first.drafts_by_source or {}).items()
            },
        }
        rows.append(row)
    stock = rows[0]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / stock["tokens_per_s"]
        row["wall_clock_ratio"] = stock["seconds"] / row["seconds"]
        # Same ratio from the fastest repeat of each: less sensitive to a busy spell of a shared machine.
        row["speedup_best"] = (row["generated_tokens"] / min(row["seconds_all"])) / (
            stock["generated_tokens"] / min(stock["seconds_all"])
        )
        relative_tpf = row["tokens_per_forward"] / stock["tokens_per_forward"]
        row["efficiency"] = row["speedup"] / relative_tpf
    return rows
