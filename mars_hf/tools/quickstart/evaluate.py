"""The quickstart's evaluation: decoding rows (stock, τ, verify) at batch 1 and 4, the table and the plot.

Two sections share one table:

* **shipped** — the MARS model that ships inside mars_hf (``"embedded-mars"``), trained once by a long
  run: evaluated first, in the precision this machine runs fast (bf16 only where it is native and
  faster), at batch 1 and at batch 4 (4 held-out prompts decoded together, left-padded), within its
  own time budget. The reference is the base model's batch-1 greedy answer in that same precision
  (the stock rows), so "identical answers" means "what ``generate`` would have said".
* **this run** — the model the quickstart has just trained for its budget, at batch 1 and at batch 4 alike
  (float32, reference = the base model's float32 greedy answers).

Every loop here stops *before* it would overrun its budget (the last item's duration predicts the
next one's), after a minimum amount of work whose answer length is fitted to the budget from a measured
pace (:mod:`mars_hf.tools.quickstart.budget`), so the whole quickstart keeps its wall-clock promise.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch

from mars_hf.evaluation.runs import DecodingRun, format_table, measure_decoding, run_label, summarize_runs
from mars_hf.tools.bench.configurations import DEFAULT_TAU_WINDOW, tau_feed_kwargs
from mars_hf.tools.divergence import judge_against_stock
from mars_hf.tools.quickstart.budget import Deadline, answer_length_that_fits

logger = logging.getLogger(__name__)

VERIFY_LABEL = "verify"
# Decodings whose answers are stock greedy's by construction (stock itself at batch 4 too).
LOSSLESS_LABELS = (run_label(None), run_label(1.0), VERIFY_LABEL)
SHIPPED_SECTION = "embedded-mars"
OWN_SECTION = "this run"
BATCH_SIZE = 4  # prompts decoded together in a section's batched rows
# Share of a section's budget spent at batch 1 before the batch-4 groups start.
BATCH1_SHARE = 0.6
# Prompts every batch-1 evaluation decodes, however short its budget.
MIN_PROMPTS = 4
# New tokens per decoding when measuring the pace that fits the answer length to a budget.
PACE_TOKENS = 8

SUMMARY_COLUMNS = [
    ("section", "model", "{}"),
    ("batch", "batch", "{}"),
    ("dtype", "dtype", "{}"),
    ("label", "decoding", "{}"),
    ("tokens_per_forward", "tokens/forward", "{:.2f}"),
    ("agreement", "agreement", "{:.1%}"),
    ("prefix_agreement", "prefix agreement", "{:.1%}"),
    ("exact_match", "identical answers", "{:.0%}"),
    ("seconds", "seconds", "{:.1f}"),
    ("tokens_per_second", "tokens/s", "{:.1f}"),
    ("speedup_vs_stock", "vs stock", "{:.2f}x"),
    # only where a row that should give stock's answers does not (bf16): see `judge_divergences`
    ("near_tie_flips", "near-tie flips", "{}"),
    ("other_differences", "other differences", "{}"),
]


def _warm_up(model, tokenizer, ids, thresholds, with_verify: bool, tau_kwargs: dict) -> None:
    """Pay the first calls' one-off costs (allocations, kernel selection) on a short decode, untimed."""
    short = list(ids)[:8]
    measure_decoding(
        model,
        tokenizer,
        [short],
        thresholds,
        max_new_tokens=4,
        progress=False,
        warmup=False,
        mars_kwargs=tau_kwargs,
    )
    if with_verify:
        measure_decoding(
            model,
            tokenizer,
            [short],
            [0.0],
            max_new_tokens=4,
            progress=False,
            warmup=False,
            mars_kwargs={"mars_acceptance": "verify"},
        )


def evaluate_prompts(
    model,
    tokenizer,
    eval_ids: Sequence[Sequence[int]],
    thresholds: Sequence[float],
    *,
    verify: bool = True,
    minutes: float | None = None,
    min_prompts: int = MIN_PROMPTS,
    max_new_tokens: int = 128,
    progress: bool = False,
    desc: str = "Evaluating stock, MARS at each τ and verify",
    warm_up: bool = True,
    tau_window: str = DEFAULT_TAU_WINDOW,
) -> dict[str, DecodingRun]:
    """Batch 1: stock ``generate``, MARS at each τ and verified decoding, interleaved prompt by prompt.

    Interleaving keeps the wall-clock comparison fair on a machine whose load changes. Verified
    decoding proposes every mask as a draft (proposal floor 0) and keeps only what the model's own
    next-token prediction confirms, so its output is the model's greedy output. Prompts are evaluated
    until ``minutes`` would be overrun (at least ``min_prompts``). ``warm_up=False``: the caller has
    already paid the first calls' one-off costs (see :func:`fit_answer_length`). ``tau_window``: how the τ rows
    feed their masks (``mars_hf.tools.bench.configurations.TAU_WINDOWS``).
    """
    from tqdm.auto import tqdm

    thresholds = [None, *thresholds]
    runs: dict[str, DecodingRun] = {}
    if not eval_ids:
        return runs
    tau_kwargs = tau_feed_kwargs(tau_window)
    if warm_up:
        _warm_up(model, tokenizer, eval_ids[0], thresholds, verify, tau_kwargs)
    deadline = Deadline(minutes)
    bar = tqdm(eval_ids, desc=desc, unit="prompt", disable=not progress)
    for index, ids in enumerate(bar):
        if index >= min_prompts and not deadline.allows_another():
            logger.info(
                "Evaluation budget (%.1f min) reached: %d of %d held-out prompts evaluated.",
                deadline.seconds / 60,
                index,
                len(eval_ids),
            )
            break
        started = time.monotonic()
        measured = measure_decoding(
            model,
            tokenizer,
            [ids],
            thresholds,
            max_new_tokens=max_new_tokens,
            progress=False,
            warmup=False,
            mars_kwargs=tau_kwargs,
        )
        if verify:
            verified = measure_decoding(
                model,
                tokenizer,
                [ids],
                [0.0],
                max_new_tokens=max_new_tokens,
                progress=False,
                warmup=False,
                mars_kwargs={"mars_acceptance": "verify"},
            )
            run = next(iter(verified.values()))
            run.label, run.threshold = VERIFY_LABEL, 0.0
            measured[VERIFY_LABEL] = run
        for label, run in measured.items():
            if label not in runs:
                runs[label] = DecodingRun(label, run.threshold)
            runs[label].outputs += run.outputs
            runs[label].num_forwards += run.num_forwards
            runs[label].seconds += run.seconds
        deadline.record(time.monotonic() - started)
    return runs


def evaluate(
    model, tokenizer, eval_ids, config
) -> tuple[dict[str, DecodingRun], dict[str, DecodingRun], int]:
    """The quickstart's own model at batch 1 and 4 (``config.thresholds``, ``config.eval_minutes``):
    ``(batch-1 runs, batch-4 runs, answer length)``, as :func:`evaluate_both_batches`."""
    return evaluate_both_batches(
        model,
        tokenizer,
        eval_ids,
        config.thresholds,
        minutes=config.eval_minutes,
        verify=config.verify,
        max_new_tokens=config.max_new_tokens,
        progress=config.progress,
        tau_window=config.tau_window,
    )


def evaluate_both_batches(
    model,
    tokenizer,
    eval_ids: Sequence[Sequence[int]],
    thresholds: Sequence[float],
    *,
    minutes: float | None,
    verify: bool = True,
    max_new_tokens: int = 128,
    progress: bool = False,
    desc: str = "Evaluating stock, MARS at each τ and verify at batch 1",
    tau_window: str = DEFAULT_TAU_WINDOW,
) -> tuple[dict[str, DecodingRun], dict[str, DecodingRun], int]:
    """Batch 1, then groups of :data:`BATCH_SIZE` of the prompts batch 1 evaluated, within ``minutes``
    (about :data:`BATCH1_SHARE` / the rest): ``(batch-1 runs, batch-4 runs, answer length)``.

    With a budget, the answers are cut to the length at which the minimum work (:data:`MIN_PROMPTS`
    prompts at batch 1, one group) fits in it on this machine; compare them with references cut alike
    (the first n tokens of a greedy answer are the greedy answer of length n).
    """
    deadline = Deadline(minutes)
    configurations = _configurations(thresholds, verify, tau_window)
    work = [([eval_ids[0]], MIN_PROMPTS)] if eval_ids else []
    if len(eval_ids) >= BATCH_SIZE:
        work.append((list(eval_ids[:BATCH_SIZE]), 1))
    length = fit_answer_length(model, tokenizer, work, configurations, deadline, max_new_tokens)
    paced = minutes is not None  # fit_answer_length paid the first calls' one-off costs
    batch1 = evaluate_prompts(
        model,
        tokenizer,
        eval_ids,
        thresholds,
        verify=verify,
        minutes=None if minutes is None else deadline.left() * BATCH1_SHARE / 60,
        min_prompts=max(MIN_PROMPTS, BATCH_SIZE),
        max_new_tokens=length,
        progress=progress,
        desc=desc,
        warm_up=not paced,
        tau_window=tau_window,
    )
    evaluated = decoded_prompts(batch1)
    batch4 = evaluate_batched(
        model,
        tokenizer,
        eval_ids[:evaluated],
        thresholds,
        verify=verify,
        minutes=None if minutes is None else deadline.left() / 60,
        max_new_tokens=length,
        warm_up=not paced,
        tau_window=tau_window,
    )
    return batch1, batch4, length


def _configurations(
    thresholds: Sequence[float], verify: bool, tau_window: str
) -> list[tuple[str, float | None, dict]]:
    """``(label, τ or None for stock, MARS keywords)`` for every decoding a section compares."""
    configurations = [(run_label(None), None, {})]
    configurations += [(run_label(tau), float(tau), tau_feed_kwargs(tau_window)) for tau in thresholds]
    if verify:
        configurations.append((VERIFY_LABEL, 0.0, {"mars_acceptance": "verify"}))
    return configurations


def pace(model, tokenizer, rows: Sequence[Sequence[int]], configurations, tokens: int = PACE_TOKENS) -> float:
    """Seconds per new token of ``rows`` decoded together by every configuration, measured here.

    Each configuration first decodes 2 tokens untimed (one-off costs: the decoder's cost probe,
    allocations), then ``tokens`` timed; the prompt's prefill is counted in, so the pace errs on the
    slow side.
    """
    seconds = 0.0
    for _, tau, mars_kwargs in configurations:
        decode_batch(model, tokenizer, rows, tau, max_new_tokens=2, mars_kwargs=mars_kwargs)
        seconds += decode_batch(model, tokenizer, rows, tau, max_new_tokens=tokens, mars_kwargs=mars_kwargs)[
            2
        ]
    return seconds / tokens


def fit_answer_length(model, tokenizer, work, configurations, deadline: Deadline, max_new_tokens: int) -> int:
    """The answer length at which a section's minimum ``work`` fits in what ``deadline`` has left.

    ``work``: ``[(rows decoded together, how many such decodes the minimum needs)]``, e.g. one prompt
    × 4 at batch 1 and one group × 1 at batch 4. Without a budget: ``max_new_tokens``, nothing measured.
    """
    if deadline.seconds == float("inf") or not work:
        return max_new_tokens
    per_token = sum(count * pace(model, tokenizer, rows, configurations) for rows, count in work)
    length = answer_length_that_fits(deadline.left(), per_token, max_new_tokens)
    if length < max_new_tokens:
        logger.info(
            "Answers cut to %d new tokens (of %d) so that the minimum work fits the %.1f-min budget here "
            "(%.2f s per new token measured).",
            length,
            max_new_tokens,
            deadline.seconds / 60,
            per_token,
        )
    return length


@torch.no_grad()
def decode_batch(
    model,
    tokenizer,
    rows: Sequence[Sequence[int]],
    threshold: float | None,
    *,
    max_new_tokens,
    mars_kwargs=None,
):
    """Greedy-decode ``rows`` together (left-padded). Returns ``(outputs per row, batch forwards, seconds)``.

    ``threshold`` None is stock ``generate``: one forward per generated column. MARS reports its own
    forward count (the prompt's included); ``mars_kwargs``: its other MARS keywords (verify, τ's feed).
    """
    from mars_hf.evaluation.runs import greedy_generate, greedy_kwargs
    from mars_hf.models.eos import eos_token_ids, pad_token_id, trim_at_eos

    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    device = next(model.parameters()).device
    width = max(len(ids) for ids in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + list(ids) for ids in rows], device=device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=device)
    kwargs = greedy_kwargs(
        input_ids, attention_mask, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_ids=eos_ids
    )
    model.eval()
    start = time.perf_counter()
    sequences, forwards = greedy_generate(model, kwargs, threshold, mars_kwargs)
    if forwards is None:  # stock: one forward per generated column
        forwards = sequences.shape[1] - width
    seconds = time.perf_counter() - start
    outputs = [trim_at_eos(row[width:].tolist(), eos_ids) for row in sequences]
    return outputs, max(1, forwards), seconds


def evaluate_batched(
    model,
    tokenizer,
    eval_ids: Sequence[Sequence[int]],
    thresholds: Sequence[float],
    *,
    verify: bool = True,
    batch_size: int = BATCH_SIZE,
    minutes: float | None = None,
    min_groups: int = 1,
    max_new_tokens: int = 128,
    warm_up: bool = True,
    tau_window: str = DEFAULT_TAU_WINDOW,
) -> dict[str, DecodingRun]:
    """Groups of ``batch_size`` prompts decoded together by stock, each τ and verify, interleaved per group.

    Only full groups are decoded. Each row's output is kept (compare it with the batch-1 answer);
    tokens per forward = generated tokens / (rows × batch forwards), as in ``mars-hf bench``: a row
    that ends early idles through the rest of its group's forwards, stock included.
    """
    configurations = _configurations(thresholds, verify, tau_window)
    runs = {label: DecodingRun(label, tau) for label, tau, _ in configurations}
    groups = [
        list(eval_ids[i : i + batch_size]) for i in range(0, len(eval_ids) - batch_size + 1, batch_size)
    ]
    if not groups:
        return {}
    for _, tau, mars_kwargs in configurations if warm_up else ():  # warm-up at this batch shape, untimed
        decode_batch(
            model, tokenizer, [ids[:8] for ids in groups[0]], tau, max_new_tokens=4, mars_kwargs=mars_kwargs
        )
    deadline = Deadline(minutes)
    for index, group in enumerate(groups):
        if index >= min_groups and not deadline.allows_another():
            logger.info("Batch-%d budget reached: %d of %d groups evaluated.", batch_size, index, len(groups))
            break
        started = time.monotonic()
        for label, tau, mars_kwargs in configurations:
            outputs, forwards, seconds = decode_batch(
                model, tokenizer, group, tau, max_new_tokens=max_new_tokens, mars_kwargs=mars_kwargs
            )
            run = runs[label]
            run.outputs += outputs
            run.num_forwards += [forwards] * len(group)  # summed: rows × batch forwards
            run.seconds.append(seconds)
        deadline.record(time.monotonic() - started)
    return runs


def _dtype_name(model) -> str:
    return str(next(model.parameters()).dtype).replace("torch.", "")


def evaluate_shipped(
    model,
    tokenizer,
    eval_ids: Sequence[Sequence[int]],
    thresholds: Sequence[float],
    *,
    minutes: float | None,
    verify: bool = True,
    max_new_tokens: int = 128,
    progress: bool = False,
    divergence_reference=None,
    tau_window: str = DEFAULT_TAU_WINDOW,
) -> dict:
    """The shipped model at batch 1 then batch 4 within ``minutes`` (about 60 % / 40 %).

    Returns ``{"rows": [...], "eval_prompts": n, "batch_prompts": m, "max_new_tokens": length}``; each
    row carries ``section``, ``batch`` and ``dtype``. Agreement is with the stock rows' batch-1 answers
    (same weights, same dtype). With a budget, the answer length is fitted so that the minimum work
    (4 prompts at batch 1, one group of 4) fits in it on this machine. A lossless row whose answers differ
    from those (bf16) gets its divergences judged (`judge_divergences`) on ``divergence_reference()``
    (default: the model itself; the quickstart passes a float32 copy's loader for a bf16 model).
    """
    batch1, batch4, length = evaluate_both_batches(
        model,
        tokenizer,
        eval_ids,
        thresholds,
        minutes=minutes,
        verify=verify,
        max_new_tokens=max_new_tokens,
        progress=progress,
        desc="Shipped embedded-mars: stock, τ, verify at batch 1",
        tau_window=tau_window,
    )
    reference = batch1["stock"].outputs
    evaluated = len(reference)
    dtype = _dtype_name(model)
    rows = []
    for batch, runs in ((1, batch1), (BATCH_SIZE, batch4)):
        for row in summarize_against(runs, reference):
            judge_divergences(
                row, runs[row["label"]], eval_ids, reference, divergence_reference or (lambda: model)
            )
            rows.append({"section": SHIPPED_SECTION, "batch": batch, "dtype": dtype, **row})
    batch_prompts = decoded_prompts(batch4)
    return {
        "rows": rows,
        "eval_prompts": evaluated,
        "batch_prompts": batch_prompts,
        "dtype": dtype,
        "max_new_tokens": length,
    }


def judge_divergences(row: dict, run: DecodingRun, eval_ids, references, reference_model) -> None:
    """Where a row that should give stock's batch-1 answers (stock at batch 4, τ = 1, verify) does not, add
    its near-tie flips and other differences (`mars_hf.tools.divergence`: the logit gap at each differing
    answer's first differing token, measured on ``reference_model()``). Rows that match get no such keys,
    so the table shows those columns only where something differed: in float32 never (that would be a bug),
    in bf16 where a wider forward rounded a near tie the other way."""
    if row["label"] not in LOSSLESS_LABELS:
        return
    count = len(run.outputs)
    judged = judge_against_stock(
        reference_model, eval_ids[:count], [list(a) for a in references[:count]], run.outputs
    )
    if judged["rows_identical"] == judged["rows"]:
        return
    row["near_tie_flips"] = judged["near_tie_flips"]
    row["other_differences"] = judged["other_differences"]
    row["divergences"] = judged["differences"]


def summarize_against(runs: dict[str, DecodingRun], references: Sequence[Sequence[int]]) -> list[dict]:
    """One batch size's summary rows (none without runs), each compared with the references of the prompts
    that batch size decoded (a budget may have stopped it before the last ones)."""
    if not runs:
        return []
    return summarize_runs(runs, references=references[: decoded_prompts(runs)])


def decoded_prompts(runs: dict[str, DecodingRun]) -> int:
    """How many prompts one batch size decoded before its budget ran out (0 without runs)."""
    return len(runs["stock"].outputs) if runs else 0


def own_rows(rows: list[dict], section: str, dtype: str = "float32", batch: int = 1) -> list[dict]:
    """The quickstart's own rows at ``batch``, labelled for the shared table."""
    return [{"section": section, "batch": batch, "dtype": dtype, **row} for row in rows]


def results_table(results: dict) -> str:
    """One table: the shipped model's rows (if evaluated), then this run's."""
    shipped = (results.get("shipped") or {}).get("rows") or []
    training = results["training"]
    section = f"{OWN_SECTION} ({training['seconds'] / 60:.0f} min, {training['steps']} steps)"
    rows = [
        *shipped,
        *own_rows(results["evaluation"], section),
        *own_rows(results.get("evaluation_batch4") or [], section, batch=BATCH_SIZE),
    ]
    return format_table(rows, SUMMARY_COLUMNS)


# --------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------
def pareto_plot(
    rows: list[dict],
    path: str | os.PathLike,
    title: str = "MARS on held-out prompts",
    shipped_rows: list[dict] | None = None,
) -> None:
    """Tokens per forward (x) against agreement with the base model (y), one labelled point per τ.

    ``shipped_rows`` (batch 1 of the shipped model) are drawn as a second curve, so the plot shows
    what the quickstart's minutes of training bought next to what the long run bought.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4.2), dpi=120)
    series = [(rows, "this run", "tab:blue", "tab:green")]
    if shipped_rows:
        series.insert(
            0, ([r for r in shipped_rows if r.get("batch", 1) == 1], SHIPPED_SECTION, "tab:orange", "tab:red")
        )
    for group, name, color, verify_color in series:
        mars_rows = sorted(
            (row for row in group if row["threshold"] is not None and row["label"] != VERIFY_LABEL),
            key=lambda row: -row["threshold"],
        )
        xs = [row["tokens_per_forward"] for row in mars_rows]
        ys = [100 * row["agreement"] for row in mars_rows]
        axis.plot(xs, ys, "-o", color=color, label=f"MARS τ ({name})")
        for row, x, y in zip(mars_rows, xs, ys):
            axis.annotate(
                f"τ={row['threshold']:g}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8
            )
        verify = next((row for row in group if row["label"] == VERIFY_LABEL), None)
        if verify is not None:
            axis.plot(
                [verify["tokens_per_forward"]],
                [100 * verify["agreement"]],
                "*",
                markersize=12,
                color=verify_color,
                label=f"verify, identical up to near-ties ({verify.get('near_tie_flips', 0)} flips; {name})",
            )
    stock = next((row for row in rows if row["threshold"] is None), None)
    if stock is not None:
        axis.plot(
            [1.0], [100 * stock["agreement"]], "s", color="tab:gray", label="stock generate (same weights)"
        )
    axis.set_xlabel("tokens per forward")
    axis.set_ylabel("agreement with base greedy output (%)")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def hub_rows(rows: list[dict]) -> list[dict]:
    """The model card's results rows (τ or verify: tokens per forward, agreement, speed-up)."""
    return [
        {
            "tau": "verify" if row["label"] == VERIFY_LABEL else row["threshold"],
            "tokens_per_forward": row["tokens_per_forward"],
            "quality": row["agreement"],
            "speedup": row["speedup_vs_stock"],
        }
        for row in rows
        if row["threshold"] is not None
    ]
