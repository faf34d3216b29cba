"""The benchmark's plain-text table: one block per batch size, the planner's choices, the step costs."""

from __future__ import annotations

from mars_hf.tools.bench.divergences import format_divergences
from mars_hf.tools.tables import Column, cost_curve_text, fixed_width_table, fmt, planner_choices


def format_table(result: dict) -> str:
    """A plain-text table of the rows (one block per batch size) and the measured step costs."""
    lines = [f"model: {result['model']}  ({_describe_environment(result)})"]
    lines += [f"note: {note}" for note in result.get("notes", [])]
    lines += fixed_width_table(TABLE_COLUMNS, result["rows"], group=lambda row: row["batch"])
    lines.append("")
    lines.append(
        "tok/fwd = generated tokens / (batch x forwards); speedup = tokens/s vs stock generate on stock kernels "
        "(same run, medians; (best): from each configuration's fastest repeat); kernels = what the row's "
        "forwards ran on (stock kernels, or packed oneDNN linears); vs off = tokens/s vs the fastest MARS-off row "
        "on the same kernels (off ref: stock generate, stock+packed = stock generate on the packed kernels, or "
        "tau=1 through the MARS decoder; MARS's own gain); masks = the trained masks, or untrained = the "
        "checkpoint's base model with a mean-initialized mask row and no adapter (same window, planner, kernels); "
        "effic. = speedup / (tok/fwd relative to stock); step = tokens one forward feeds on its cache "
        "after the prompt, mean over the run (n + W for cursor; the open block + W for block; the whole "
        "sequence, uncached, for none); cost = that forward's measured time (one real token then masks, fastest of "
        "the cost repeats, on the kernels the row ran: packed where its mars_cpu_kernels mode picks them) / stock "
        "generate's 1-token cached forward; pred. = docs/method.md §4 cost-model speedup = relative tok/fwd / cost; "
        "=stock = share of rows whose output equals stock generate (measured, also for verify); "
        "tau v-auto / v-line / v-quad = verified decoding (mars_acceptance='verify'): the step planner, "
        "or the fixed linear / quadratic layout; +pl: with prompt-lookup drafts; plK = transformers' own "
        "prompt lookup (prompt_lookup_num_tokens=K, stock generate)."
    )
    lines += format_divergences(result, _label)
    lines += format_masks_value(result["rows"])
    lines += format_categories(result)
    lines += format_planner(result)
    for batch, costs in result["costs"].items():
        cached = ", ".join(f"{k}:{v:.2f}" for k, v in costs["cached_step_cost"].items())
        line = f"batch {batch}: 1-token cached forward {costs['one_token_seconds'] * 1000:.1f} ms at context "
        line += f"{costs['context_tokens']}; cached k-token forward / 1-token forward: {cached}"
        if costs["uncached_forward_cost"]:
            full = ", ".join(f"{k}:{v:.2f}" for k, v in costs["uncached_forward_cost"].items())
            line += f"; uncached L-token forward / 1-token cached: {full}"
        if "cached_step_cost_packed" in costs:
            packed = ", ".join(f"{k}:{v:.2f}" for k, v in costs["cached_step_cost_packed"].items())
            line += f"; on packed kernels (MARS rows' multi-row linears), / the same stock 1-token forward: {packed}"
        lines.append(line)
    return "\n".join(lines)


def format_planner(result: dict) -> list[str]:
    """Per MARS row: columns per row fed by each forward (histogram) and the planner's choices; per
    batch size, the cost curve the decoder measured (the planner's input)."""
    lines = ["", "forwards by columns per row (width:count) and planner choices per row-step:"]
    curves = {}
    for row in result["rows"]:
        if row["scheme"] == "stock" or not row.get("width_histogram"):
            continue
        widths, plans = planner_choices(row)
        label = _label(row)
        lines.append(f"{label} widths {widths}" + (f"; plans: {plans}" if plans else ""))
        if row.get("drafts_by_source"):
            kept = ", ".join(
                f"{source} {c['accepted']}/{c['proposed']} kept, +{row['tokens_per_forward_by_source'][source]:.2f} tok/fwd"
                for source, c in row["drafts_by_source"].items()
                if c["proposed"]
            )
            lines.append(f"{label} drafts by source: {kept or 'none proposed'}")
        if row.get("cost_curve"):
            curves.setdefault(row["batch"], row["cost_curve"])
    for batch, curve in curves.items():
        points = cost_curve_text(curve)
        lines.append(f"batch {batch}: the decoder's cost curve (columns per row: relative cost) {points}")
    return lines


def format_masks_value(rows: list[dict]) -> list[str]:
    """Per verify row with the trained masks and an untrained-mask twin: what the training adds."""
    valued = [row for row in rows if row.get("masks_value") is not None]
    if not valued:
        return []
    lines = ["", "masks' own value = verify with the trained masks / verify with an untrained mask row (tokens/s, "
             "same window, planner and kernels; per token, since bf16 answers can differ at near ties):"]  # fmt: skip
    lines += [f"{_label(row)}: {row['masks_value']:.2f}x" for row in valued]
    return lines


def format_categories(result: dict) -> list[str]:
    """Per batch size, a block per category (`mars_hf.tools.bench.categories`): the rows' counts and ratios."""
    lines = []
    for batch, rows in (result.get("categories") or {}).items():
        lines += ["", f"per category, batch {batch} (identical = k/n answers equal to stock greedy in this dtype, "
                  "~f: f near-tie flips among the others; ratios of tokens/s from the same runs):"]  # fmt: skip
        lines += fixed_width_table(CATEGORY_COLUMNS, rows, group=lambda row: row["category"])
    return lines


def _label(row) -> str:
    """A row's name under the table: its batch, rule and scheme cells (and its masks where untrained)."""
    label = " ".join(column.cell(row) for column in TABLE_COLUMNS[:2] + TABLE_COLUMNS[3:4])
    label = label.rstrip() + (" compiled" if row.get("compiled") else "")
    return label + (" untrained masks" if row.get("masks") == "untrained" else "")


def _rule(row) -> str:
    """The acceptance column: τ, the verify layout (``v-auto``, with ``+pl`` for prompt-lookup drafts), or
    transformers' own prompt lookup (``plK``)."""
    lookup = row.get("prompt_lookup_num_tokens")
    if row.get("layout"):
        return f"v-{row['layout'][:4]}" + ("+pl" if lookup else "")
    if lookup:
        return f"pl{lookup}"
    return fmt(row["tau"], ".2f")


def _scheme(row) -> str:
    """The cache scheme, with the ``mars_cpu_kernels`` mode when a row forces one (``+packed``, ``+stock``)."""
    kernels = row.get("cpu_kernels") or "auto"
    return row["scheme"] + ("" if kernels == "auto" else f"+{kernels}")


def _measured(key: str):
    """A column of the cost model's numbers (``-`` where `add_cost_model` gave the row none)."""
    return lambda row: row.get(key)


def _masks(row) -> str | None:
    """``trained`` / ``untrained`` for a MARS row; None (``-``) for stock `generate`."""
    return None if row["scheme"] == "stock" else row.get("masks", "trained")


def _identical(row) -> str:
    """``k/n`` answers equal to stock greedy's, with the near-tie flips among the others."""
    flips = row.get("near_tie_flips")
    return f"{row['rows_identical']}/{row['rows']}" + (f" ~{flips}" if flips else "")


TABLE_COLUMNS = [
    Column("batch", 5, "batch"),
    Column("tau", 6, _rule),
    Column("W", 3, "window", "d"),
    Column("scheme", 13, _scheme, align="<"),
    Column("C", 3, "cache_block", "d"),
    Column("tok/fwd", 7, "tokens_per_forward", ".2f"),
    Column("fwds", 5, "num_forwards"),
    Column("tok/s", 8, "tokens_per_s", ".1f"),
    Column("speedup", 7, "speedup", ".2f", "x"),
    Column("(best)", 6, "speedup_best", ".2f", "x"),
    Column("effic.", 6, "efficiency", ".2f"),
    Column("step", 6, _measured("step_tokens"), ".1f"),
    Column("cost", 5, _measured("step_cost"), ".2f"),
    Column("pred.", 6, _measured("predicted_speedup"), ".2f", "x"),
    Column("=stock", 6, "same_as_stock", ".2f"),
    Column("kernels", 7, "kernels", align="<"),
    Column("masks", 9, _masks, align="<"),
    Column("vs off", 6, "vs_off", ".2f", "x"),
    Column("off ref", 16, "off_reference", align="<"),
]

CATEGORY_COLUMNS = [
    Column("category", 12, "category", align="<"),
    Column("tau", 9, _rule),
    Column("W", 3, "window", "d"),
    Column("scheme", 13, _scheme, align="<"),
    Column("kernels", 7, "kernels", align="<"),
    Column("masks", 9, _masks, align="<"),
    Column("tok/fwd", 7, "tokens_per_forward", ".2f"),
    Column("identical", 9, _identical),
    Column("tok/s", 8, "tokens_per_s", ".1f"),
    Column("vs stock", 8, "speedup", ".2f", "x"),
    Column("vs off", 6, "vs_off", ".2f", "x"),
    Column("off ref", 16, "off_reference", align="<"),
    Column("masks' own", 10, "masks_value", ".2f", "x"),
]


def _describe_environment(result):
    env = result["environment"]
    args = result["arguments"]
    return (
        f"{env['dtype']}, {env['device']}, {env.get('cpu', '?')} (flags: {env.get('cpu_flags', '?')}), "
        f"{env['threads']} threads, attn={env['attn_implementation']}, "
        f"max_new_tokens={args['max_new_tokens']}, median of {args['repeats']}, acceptance={args['acceptance']}, "
        f"multi-row linears under mars_cpu_kernels=auto: {env.get('cpu_kernels_auto', 'stock')}, "
        f"torch {env['torch']}, transformers {env['transformers']}, {env['date']}"
    )
