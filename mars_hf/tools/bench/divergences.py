"""Each row that should equal stock greedy (verify, τ = 1, stock on other kernels), its divergences judged.

A lossless row whose output differs from stock `generate`'s is judged at each differing row's first
differing token by `mars_hf.tools.divergence.judge_against_stock`: a near-tie flip (floating point), or a
real difference (a bug). The gap is measured on a reference model: a float32 copy where the benchmark runs
in a narrower dtype (the command loads one only when some row differs), else the benchmarked model itself.
"""

from __future__ import annotations

from mars_hf.tools.divergence import judge_against_stock, prompt_rows


def is_lossless(row: dict) -> bool:
    """Rows whose output is stock greedy's by construction: verify, τ ≥ 1, stock on other kernels."""
    return (
        row["acceptance"] == "verify"
        or (row["tau"] is not None and row["tau"] >= 1.0)
        or row["scheme"] == "stock"
    )


def add_divergences(rows: list[dict], measurements, batches, reference) -> None:
    """Give every lossless row a ``divergences`` record (counts, and each differing row's gap).

    ``reference()`` returns the model that measures the gaps; it is called only if some row differs.
    """
    runs = list(measurements.values())
    stock_tokens = runs[0][0].new_tokens
    prompts = prompt_rows(batches)
    for row, row_runs in zip(rows[1:], runs[1:]):
        if not is_lossless(row):
            continue
        row["divergences"] = judge_against_stock(reference, prompts, stock_tokens, row_runs[0].new_tokens)
        row["answers"] = answers_verdict(row["divergences"])


def answers_verdict(d: dict) -> str:
    """What a row that should equal stock greedy gave, in words: ``identical``, ``identical up to near-ties
    (n flips)`` (bf16: a multi-row forward rounded a near tie the other way), or the differences beyond that
    (a bug). Never "lossless" where the answers differ."""
    if d["rows_identical"] == d["rows"]:
        return "identical"
    if not d["other_differences"]:
        return f"identical up to near-ties ({d['near_tie_flips']} flips)"
    return f"NOT identical: {d['other_differences']} differences beyond near ties ({d['near_tie_flips']} near-tie flips)"


def format_divergences(result: dict, label) -> list[str]:
    """Lines under the table: per lossless row that differs from stock greedy, its near-tie flips and real
    differences with their gaps; one line when none differs."""
    judged = [row for row in result["rows"] if row.get("divergences")]
    differing = [row for row in judged if row["divergences"]["rows_identical"] < row["divergences"]["rows"]]
    if not judged:
        return []
    if not differing:
        return ["", f"divergences from stock greedy: none (all {len(judged)} lossless rows identical)"]
    lines = ["", "divergences from stock greedy at the first differing token (gap = reference logit of stock's "
             "token - of the run's; near tie = within 4 bf16 spacings):"]  # fmt: skip
    lines += [
        f"{label(row)}: {divergence_line(row['divergences'])} -> {answers_verdict(row['divergences'])}"
        for row in differing
    ]
    return lines


def divergence_line(d: dict) -> str:
    """One `judge_against_stock` record in words: counts, each difference's gap, the mean agreeing prefix."""
    gaps = ", ".join("stopped apart" if x["gap"] is None else f"{x['gap']:.3g}" for x in d["differences"])
    measured = f"gaps in {d['gap_dtype']}: {gaps}; " if gaps else ""
    return (
        f"{d['rows_identical']} of {d['rows']} identical, near-tie flips {d['near_tie_flips']}, other differences "
        f"{d['other_differences']} ({measured}mean agreeing prefix {d['mean_agreeing_prefix']:.2f})"
    )
