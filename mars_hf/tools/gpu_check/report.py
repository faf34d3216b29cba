"""The plain-text report of a GPU check's result: decoding, planner, exactness, training, skipped, errors."""

from __future__ import annotations

from mars_hf.tools.tables import Column, cost_curve_text, fixed_width_table, fmt, planner_choices

DECODING_COLUMNS = [
    Column("model", 13, "model", align="<"),
    Column("rate", 4, "rate", ".2f"),
    Column("batch", 5, "batch"),
    Column("configuration", 24, "label", align="<"),
    Column("tok/fwd", 7, "tokens_per_forward", ".2f"),
    Column("pred.", 5, "predicted_tokens_per_forward", ".2f"),
    Column("tok/s", 8, "tokens_per_s", ".1f"),
    Column("speedup", 7, "speedup", ".2f", "x"),
    Column("effic.", 6, "efficiency", ".2f"),
    Column("=stock", 6, "same_as_stock", ".2f"),
    Column("drafts", 6, lambda row: row.get("draft_acceptance"), ".2f"),
    Column("peak MiB", 8, "peak_memory_mb", ".0f"),
]
DECODING_LEGEND = (
    "tok/fwd = generated / (batch x forwards, the prompt's included); pred. = what the forced pattern "
    "implies (exact for cursor/none); speedup = tokens/s vs stock generate; effic. = speedup / "
    "(tok/fwd / stock tok/fwd), the docs/method.md §4 cost factor; =stock = share of rows equal to stock; "
    "drafts = verify's accepted / proposed drafts."
)


def format_table(result: dict) -> str:
    """The table `mars-hf gpu-check` prints (the JSON has every number; this is what a reader scans)."""
    env = result["environment"]
    lines = [
        f"mars-hf gpu-check: {env['device']} ({env['device_name']}), host CPU {env.get('cpu', '?')} (flags: "
        f"{env.get('cpu_flags', '?')}), torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['dtype']}, {result['budget']['elapsed_seconds']:.0f} s of a "
        f"{result['budget']['budget_seconds']:.0f} s budget, {env['date']}",
        "",
        "DECODING (random weights, forced acceptance; greedy; medians of interleaved repeats)",
    ]
    lines += fixed_width_table(DECODING_COLUMNS, result["rows"], group=_decoding_group)
    lines.append(DECODING_LEGEND)
    lines += _planner_lines(result)
    lines += ["", "EXACTNESS (unforced random model, greedy, vs stock generate)"]
    lines += [_exactness_line(row) for row in result["exactness"]]
    lines += ["", "TRAINING (one MARS step through MARSTrainer.compute_loss, forward + backward, float32)"]
    lines += [_training_line(row) for row in result["training"]]
    lines += _outcome_lines(result)
    return "\n".join(lines)


def _decoding_group(row: dict) -> tuple:
    return row["model"], row["rate"], row["batch"]


def _planner_lines(result: dict) -> list[str]:
    """What the step planner chose (forwards by columns per row, choices per row-step) and the cost
    curve the decoder measured on this device, per model and batch (rows recorded by `bench.run_once`)."""
    lines = [
        "",
        "PLANNER (forwards by columns per row, width:count; choices per row-step; the measured curve)",
    ]
    curves = {}
    for row in result["rows"]:
        if row["scheme"] == "stock" or not row.get("width_histogram"):
            continue
        widths, plans = planner_choices(row)
        label = " ".join(column.cell(row) for column in DECODING_COLUMNS[:4])
        lines.append(f"{label} {widths}; {plans}")
        if row.get("cost_curve"):
            curves.setdefault((row["model"], row["batch"]), row["cost_curve"])
    for (model, batch), curve in curves.items():
        points = cost_curve_text(curve)
        lines.append(f"{model:<13} batch {batch}: cost curve (columns per row: relative cost) {points}")
    return lines


def _exactness_line(row: dict) -> str:
    return (
        f"{row['model']:<13} batch {row['batch']:>2} {row['label']:<24} identical rows {row['rows_identical']}/"
        f"{row['rows']}, near-tie flips {row['near_tie_flips']}, other differences {row['other_differences']}, "
        f"mean agreeing prefix {fmt(row['mean_agreeing_prefix'], '.2f')}"
    )


def _training_line(row: dict) -> str:
    if "comparison" in row:
        return (
            f"{row['model']:<13} {row['comparison']}: loss diff {row['loss_abs_diff']:.2e}, grad max abs "
            f"diff {row['grad_max_abs_diff']:.2e}, grad rel diff {row['grad_rel_diff']:.2e}, "
            f"time ratio {row['step_time_ratio']:.2f}"
        )
    return (
        f"{row['model']:<13} {row['variant']:<18} loss {row['loss']:.4f}, step "
        f"{row['step_seconds'] * 1000:.1f} ms (first, with compilation: {row['first_step_seconds']:.2f} s), "
        f"peak {fmt(row['peak_memory_mb'], '.0f')} MiB"
    )


def _outcome_lines(result: dict) -> list[str]:
    """What was skipped and why, what failed, and why the run stopped (if it did)."""
    lines = ["", f"SKIPPED ({len(result['skipped'])})"]
    lines += [f"  {entry['item']}: {entry['reason']}" for entry in result["skipped"]]
    errors = [item for item in result["items"] if item["status"] == "error"]
    if errors:
        lines += ["", f"ERRORS ({len(errors)})"]
        lines += [f"  {item['item']}: {item['error']}" for item in errors]
    if result["budget"]["stopped"]:
        lines.append(f"stopped: {result['budget']['stopped']}")
    return lines
