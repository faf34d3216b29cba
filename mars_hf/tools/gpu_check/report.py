"""The plain-text report of a GPU check's result: decoding, planner, exactness, training, skipped, errors."""

from __future__ import annotations

from mars_hf.tools.bench import planner_choices


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict) -> str:
    """The table `mars-hf gpu-check` prints (the JSON has every number; this is what a reader scans)."""
    env = result["environment"]
    lines = [
        f"mars-hf gpu-check: {env['device']} ({env['device_name']}), torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['dtype']}, {result['budget']['elapsed_seconds']:.0f} s of a "
        f"{result['budget']['budget_seconds']:.0f} s budget, {env['date']}",
        "",
        "DECODING (random weights, forced acceptance; greedy; medians of interleaved repeats)",
    ]
    header = (
        f"{'model':<13} {'rate':>4} {'batch':>5} {'configuration':<24} {'tok/fwd':>7} {'pred.':>5} "
        f"{'tok/s':>8} {'speedup':>7} {'effic.':>6} {'=stock':>6} {'drafts':>6} {'peak MiB':>8}"
    )
    lines += [header, "-" * len(header)]
    previous = None
    for row in result["rows"]:
        key = (row["model"], row["rate"], row["batch"])
        if previous is not None and key != previous:
            lines.append("")
        previous = key
        lines.append(
            f"{row['model']:<13} {row['rate']:>4.2f} {row['batch']:>5} {row['label']:<24} "
            f"{row['tokens_per_forward']:>7.2f} {_fmt(row['predicted_tokens_per_forward'], '.2f'):>5} "
            f"{row['tokens_per_s']:>8.1f} {row['speedup']:>6.2f}x {row['efficiency']:>6.2f} "
            f"{row['same_as_stock']:>6.2f} {_fmt(row.get('draft_acceptance'), '.2f'):>6} "
            f"{_fmt(row['peak_memory_mb'], '.0f'):>8}"
        )
    lines += [
        "tok/fwd = generated / (batch x forwards, the prompt's included); pred. = what the forced pattern "
        "implies (exact for cursor/none); speedup = tokens/s vs stock generate; effic. = speedup / "
        "(tok/fwd / stock tok/fwd), the MARS_SPEC §4 cost factor; =stock = share of rows equal to stock; "
        "drafts = verify's accepted / proposed drafts.",
    ]
    lines += _planner_lines(result)
    lines += ["", "EXACTNESS (unforced random model, greedy, vs stock generate)"]
    for row in result["exactness"]:
        lines.append(
            f"{row['model']:<13} batch {row['batch']:>2} {row['label']:<24} identical rows {row['rows_identical']}/"
            f"{row['rows']}, near-tie flips {row['near_tie_flips']}, other differences {row['other_differences']}, "
            f"mean agreeing prefix {_fmt(row['mean_agreeing_prefix'], '.2f')}"
        )
    lines += ["", "TRAINING (one MARS step through MARSTrainer.compute_loss, forward + backward, float32)"]
    for row in result["training"]:
        if "comparison" in row:
            lines.append(
                f"{row['model']:<13} {row['comparison']}: loss diff {row['loss_abs_diff']:.2e}, grad max abs "
                f"diff {row['grad_max_abs_diff']:.2e}, grad rel diff {row['grad_rel_diff']:.2e}, "
                f"time ratio {row['step_time_ratio']:.2f}"
            )
        else:
            lines.append(
                f"{row['model']:<13} {row['variant']:<18} loss {row['loss']:.4f}, step "
                f"{row['step_seconds'] * 1000:.1f} ms (first, with compilation: {row['first_step_seconds']:.2f} s), peak "
                f"{_fmt(row['peak_memory_mb'], '.0f')} MiB"
            )
    lines += ["", f"SKIPPED ({len(result['skipped'])})"]
    lines += [f"  {entry['item']}: {entry['reason']}" for entry in result["skipped"]]
    errors = [item for item in result["items"] if item["status"] == "error"]
    if errors:
        lines += ["", f"ERRORS ({len(errors)})"]
        lines += [f"  {item['item']}: {item['error']}" for item in errors]
    if result["budget"]["stopped"]:
        lines.append(f"stopped: {result['budget']['stopped']}")
    return "\n".join(lines)


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
        lines.append(
            f"{row['model']:<13} {row['rate']:>4.2f} {row['batch']:>5} {row['label']:<24} {widths}; {plans}"
        )
        if row.get("cost_curve"):
            curves.setdefault((row["model"], row["batch"]), row["cost_curve"])
    for (model, batch), curve in curves.items():
        points = ", ".join(f"{n}:{float(c):.2f}" for n, c in curve.items())
        lines.append(f"{model:<13} batch {batch}: cost curve (columns per row: relative cost) {points}")
    return lines
