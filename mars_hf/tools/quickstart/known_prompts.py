"""The quickstart's short benchmark on prompts users know: a small `mars-hf bench --dataset mt-bench,humaneval`.

After this run's model has been evaluated on held-out template prompts, the same model (float32, batch 1)
decodes the first ``bench_per_category`` prompts of each category of ``bench_datasets`` (by default one
MT-Bench first turn per category and one HumanEval problem) with the configurations `mars-hf bench
--dataset` compares: stock ``generate``, τ = 1 through the MARS decoder (MARS-off on the same kernels), the
quickstart's other τ, verify, transformers' prompt lookup, and verify with prompt-lookup drafts. With
``bench_compile`` (default) the MARS rows run on transformers' fast path (static cache, compiled forward), beside
stock ``generate`` eager and compiled (their MARS-off), as `mars-hf bench --compile`; answers are at least
:data:`BENCH_MIN_NEW_TOKENS` long (shorter ones show no gain).

The measuring is the bench package's own (:func:`mars_hf.tools.bench.run_benchmark`, per category
:mod:`mars_hf.tools.bench.categories`), so each category row means what it means in `mars-hf bench`: tokens
per forward, answers identical to stock greedy, tokens/s against stock ``generate`` and against the fastest
MARS-off row on the same kernels.

Budget (:mod:`mars_hf.tools.quickstart.budget`): every chosen prompt is decoded once per configuration (one
timed repeat, no cost model). A first decode of a few tokens of the first prompt by every configuration pays
the one-off costs untimed and measures the pace; the answers are then cut so that the whole set fits
``bench_minutes`` (never below :data:`~mars_hf.tools.quickstart.budget.MIN_NEW_TOKENS`; a warning where even
that is predicted to overrun).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from mars_hf.tools.bench import BenchArguments, prepare_batches, run_benchmark
from mars_hf.tools.bench.configurations import one_cache_length
from mars_hf.tools.bench.eval_sets import dataset_prompts
from mars_hf.tools.bench.report import CATEGORY_COLUMNS
from mars_hf.tools.quickstart.budget import Deadline, answer_length_that_fits
from mars_hf.tools.tables import fixed_width_table

if TYPE_CHECKING:
    from mars_hf.tools.quickstart.config import QuickstartConfig

logger = logging.getLogger(__name__)

# prompt_lookup_num_tokens of the prompt-lookup rows, as `mars-hf bench --dataset` by default.
LOOKUP_TOKENS = 10
# New tokens of the untimed first decode that pays one-off costs (the compiles) and measures the pace.
PACE_TOKENS = 8
# Shortest answers of the timed run: a few dozen tokens are mostly the prompt's forward and show no MARS gain.
BENCH_MIN_NEW_TOKENS = 64
# The bench's per-category columns, less those about untrained-mask rows (the quickstart runs none).
COLUMNS = [column for column in CATEGORY_COLUMNS if column.header not in ("masks", "masks' own")]


def bench_prompts(config: QuickstartConfig) -> tuple[list[str], list[str]] | None:
    """``(messages, categories)`` of the short benchmark, or None where it is off (``skip_bench``).

    Called at start-up, so that a missing benchmark package fails before any minute is spent: the error names
    the install and ``--skip-bench``.
    """
    if config.skip_bench:
        return None
    datasets = (config.bench_datasets,) if isinstance(config.bench_datasets, str) else config.bench_datasets
    if not datasets:
        raise ValueError(
            "bench_datasets is empty: name at least one prompt set (mt-bench, humaneval, a JSONL file), or "
            "pass --skip-bench (QuickstartConfig(skip_bench=True)) to run the quickstart without the benchmark."
        )
    if config.bench_per_category < 1:
        raise ValueError(
            f"bench_per_category must be at least 1, got {config.bench_per_category}; to run the quickstart "
            "without the benchmark, pass --skip-bench (QuickstartConfig(skip_bench=True))."
        )
    try:
        return dataset_prompts(datasets, config.bench_per_category, qualify="clashing")
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"{error} To run the quickstart without the short benchmark on prompts users know, pass "
            "--skip-bench (QuickstartConfig(skip_bench=True))."
        ) from error


def bench_arguments(config: QuickstartConfig, max_new_tokens: int) -> BenchArguments:
    """The configurations of `mars-hf bench --dataset` at batch 1, with the quickstart's τ (τ = 1 always: the
    MARS-off row through our decoder), its window, one timed repeat and no cost model."""
    return BenchArguments(
        batch_sizes=[1],
        taus=sorted({1.0, *(float(tau) for tau in config.thresholds)}, reverse=True),
        windows=[config.block_size],
        schemes=["stock", "cursor"],
        verify_layouts=["auto"] if config.verify else [],
        lookup_tokens=[LOOKUP_TOKENS],
        max_new_tokens=max_new_tokens,
        repeats=1,
        warmup=0,
        cost_repeats=0,
        cpu_kernels=["auto"],
        compiled=config.bench_compile,
        tau_window=config.tau_window,
    )


def short_benchmark(
    model,
    tokenizer,
    messages: list[str],
    categories: list[str],
    config: QuickstartConfig,
    reference_model=None,
) -> dict:
    """Run the short benchmark on ``model`` within ``config.bench_minutes``; returns `run_benchmark`'s result
    (``rows`` overall, ``categories["1"]`` per category) with ``datasets``, ``per_category``,
    ``max_new_tokens`` (the answer length decoded), ``minutes`` and ``seconds`` added. ``reference_model``:
    the model that judges near-tie flips of lossless rows (a float32 one for a bf16 ``model``; default ``model``)."""
    start = time.monotonic()
    deadline = Deadline(config.bench_minutes)
    args = bench_arguments(config, config.max_new_tokens)
    if args.compiled:  # the pace run's warm-up compiles every graph at the size the timed run uses
        batches = prepare_batches(tokenizer, messages, 1)
        args = dataclasses.replace(args, max_cache_len=one_cache_length(batches, config.max_new_tokens))
    # Every configuration decodes a few tokens of the first prompt twice (the first untimed): the one-off
    # costs (the decoder's cost probe, allocations, compiling, prompt lookup's set-up) stay out of the timed
    # run, and the timed decode gives the pace.
    paced = run_benchmark(
        model,
        tokenizer,
        messages[:1],
        dataclasses.replace(args, max_new_tokens=PACE_TOKENS, warmup=1),
        progress=False,
    )
    length = config.max_new_tokens
    if config.bench_minutes is not None:
        # Seconds per new token of one prompt through every configuration (its prompt's forward counted in,
        # so the pace errs on the slow side), times the prompts.
        per_prompt = sum(row["seconds"] / max(1, row["generated_tokens"]) for row in paced["rows"])
        per_token = per_prompt * len(messages)
        length = answer_length_that_fits(
            deadline.left(), per_token, config.max_new_tokens, floor=BENCH_MIN_NEW_TOKENS
        )
        predicted = length * per_token
        if predicted > deadline.left():
            logger.warning(
                "Short benchmark: %d prompts at %d new tokens are predicted to take %.1f min, over its %.1f-min "
                "budget (--bench-minutes) on this machine; decoding them anyway (fewer prompts: "
                "--bench-per-category, --bench-datasets; none: --skip-bench).",
                len(messages),
                length,
                (deadline.elapsed() + predicted) / 60,
                deadline.seconds / 60,
            )
        elif length < config.max_new_tokens:
            logger.info(
                "Short benchmark: answers cut to %d new tokens (of %d) to fit its %.1f-min budget here "
                "(%.2f s per new token measured for all %d prompts).",
                length,
                config.max_new_tokens,
                deadline.seconds / 60,
                per_token,
                len(messages),
            )
    logger.info(
        "Short benchmark on prompts users know: %d prompts of %s (%d per category), batch 1, ≤ %d new tokens.",
        len(messages),
        ", ".join(config.bench_datasets),
        config.bench_per_category,
        length,
    )
    result = run_benchmark(
        model,
        tokenizer,
        messages,
        dataclasses.replace(args, max_new_tokens=length),
        model_name="this run",
        progress=config.progress,
        categories=categories,
        divergence_reference=None if reference_model is None else (lambda: reference_model),
    )
    result.update(
        datasets=list(config.bench_datasets),
        per_category=config.bench_per_category,
        max_new_tokens=length,
        minutes=config.bench_minutes,
        seconds=time.monotonic() - start,
    )
    return result


def bench_table(bench: dict, checkpoint: str | None = None) -> str:
    """The short benchmark's per-category table, with a header that says what it ran (and, given the saved
    ``checkpoint``, the command that runs the whole benchmark on it) and a legend."""
    rows = (bench.get("categories") or {}).get("1") or []
    datasets = ",".join(bench["datasets"])
    header = (
        f"Prompts users know: {bench['num_prompts']} prompts ({bench['per_category']} per category of "
        f"{', '.join(bench['datasets'])}), this run's model in {bench['environment']['dtype']}, batch 1, "
        f"≤ {bench['max_new_tokens']} new tokens, timed once: a short `mars-hf bench --dataset {datasets} "
        f"--per-category {bench['per_category']}`."
    )
    if checkpoint:
        header += f" Every prompt, repeated: mars-hf bench --model {checkpoint} --dataset {datasets}"
    legend = (
        "tau: 1.00 = MARS-off through the MARS decoder (one token per forward), other τ = MARS; v-auto = verify "
        f"(lossless); v-auto+pl = verify with prompt-lookup drafts; pl{LOOKUP_TOKENS} = transformers' prompt "
        "lookup (stock generate); identical = k/n answers equal to stock greedy (~f: near-tie flips among the "
        "others); vs stock = tokens/s / stock generate's; vs off = tokens/s / the fastest MARS-off row on the "
        "same kernels (off ref). A few prompts timed once: read the ratios as rough."
    )
    return "\n".join([header, *fixed_width_table(COLUMNS, rows, group=lambda row: row["category"]), legend])
