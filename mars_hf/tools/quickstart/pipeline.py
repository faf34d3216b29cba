"""The one-command MARS quickstart: the shipped model first, then self-distil, train, evaluate, plot, save.

Pipeline (``mars-hf quickstart`` / ``python examples/quickstart.py``), offline, on the embedded
SmolLM2-135M-Instruct by default:

0. the MARS model that ships inside mars_hf (``"embedded-mars"``, trained once by a long run) is
   evaluated first, within ``shipped_eval_minutes``: stock vs τ = 1 vs τ vs verify at batch 1 and 4,
   in the precision this machine runs fast (:mod:`mars_hf.tools.quickstart.evaluate`);
1. prompts from the project's own templates (:mod:`mars_hf.training.prompts`), training and held-out splits;
2. the base model answers the training prompts greedily (:func:`mars_hf.training.data.self_distill`); the
   dataset is cached on disk, so a rerun skips this step;
3. the base model's greedy answers to the held-out prompts are the agreement reference (cached too);
4. MARS training (:class:`mars_hf.MARSTrainer`) until ``budget_minutes`` have passed, with a learning
   rate that warms up and decays linearly *in time*, so it reaches zero when the budget ends on any
   machine (or for exactly ``max_steps`` steps with the usual step-based schedule);
5. evaluation on the held-out prompts in float32, at batch 1 (stock ``generate``, MARS at each τ and
   verify, interleaved per prompt) and then at batch 4 like the shipped model: tokens per forward,
   wall-clock and token agreement with the base model; then a short benchmark of the same model on
   prompts users know (one MT-Bench first turn per category, one HumanEval problem), per category
   (:mod:`mars_hf.tools.quickstart.known_prompts`; the training prompts never hold one);
6. ``results.json``, ``pareto.png`` (tokens per forward against agreement, one point per τ, the shipped
   model's curve next to this run's), one table on the terminal with both models' rows (what the
   quickstart's minutes bought next to what the long run bought), and the trained model as a Hub-ready folder (:func:`mars_hf.hub.save_pretrained`).

The default method, ``gated_lora``, trains a LoRA adapter gated to mask positions (docs/method.md §7) plus
the mask row: real tokens run the base weights exactly, so stock decoding, τ = 1 and verified decoding
are the base model's output, and the checkpoint is the adapter (megabytes), not a copy of the model.
Plain ``lora`` is merged into the weights for evaluation and saving (a plain ``transformers`` folder).

Precision and threads are chosen at start-up by measuring what this machine does fast (about a
second): bf16 autocast only where a bf16 matmul really is faster than float32; the shipped model is
evaluated in that precision too (stock and MARS alike, so the speed ratio compares like with like). The
thread count is measured again before self-distillation, training and evaluation (a passing load must not
decide for the whole run); each choice is logged and printed in the summary.

This module holds the precision probe and the pipeline. The settings live in
:mod:`mars_hf.tools.quickstart.config`; the steps in :mod:`mars_hf.tools.quickstart.data` (self-distillation
and reference, cached), :mod:`mars_hf.tools.quickstart.train` (training within a time budget) and
:mod:`mars_hf.tools.quickstart.evaluate` (decoding rows, table, plot).

Default time split (budgets of 30 min in all; loading, saving, compiling and the install come on top): shipped
model 3 min, self-distillation 4, reference answers 1, training 12, evaluation of the trained model 4, the short
benchmark on prompts users know 6 (in the probe's precision). Every budget holds on a slow machine too
(:mod:`mars_hf.tools.quickstart.budget`), except the short benchmark's where its minimum (answers of 64 tokens, its
graphs compiled) does not fit: it then warns and runs over.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_hf.evaluation.runs import run_label, teacher_forced_acceptance
from mars_hf.models.embedded_model import resolve_model_path
from mars_hf.models.precision import matmul_rate as _matmul_rate
from mars_hf.tools.divergence import narrower_than_float32
from mars_hf.tools.quickstart.config import QuickstartConfig
from mars_hf.tools.quickstart.data import (
    budgeted_self_distill,
    cached_reference,
    training_prompts_without_benchmarks,
)
from mars_hf.tools.quickstart.evaluate import (
    OWN_SECTION,
    SHIPPED_SECTION,
    VERIFY_LABEL,
    decoded_prompts,
    evaluate,
    evaluate_shipped,
    hub_rows,
    pareto_plot,
    results_table,
    summarize_against,
)
from mars_hf.tools.quickstart.known_prompts import bench_prompts, bench_table, short_benchmark
from mars_hf.tools.quickstart.train import resolved, train_mars
from mars_hf.training.calibration_fit import attach_calibration, held_out_split
from mars_hf.training.data import chat_prompt_ids
from mars_hf.training.prompts import held_out_prompts

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Precision and threads: what this machine does fast
# --------------------------------------------------------------------------------------------------
# One probe for the whole package (`mars_hf.models.precision`: also `--dtype auto` of the commands that load a model).


def choose_precision_and_threads(config: QuickstartConfig, probe_seconds: float = 0.2) -> dict:
    """Decide ``bf16`` and the torch thread count by measurement (about a second on a CPU); log the choice.

    bf16 autocast is used only if a bf16 matmul runs at least 1.3× faster than float32 here (CPUs
    without native bf16 emulate it, several times slower). Threads: all cores, unless one thread is
    measurably faster (a machine whose cores are busy with other work); re-checked before each later
    phase (:func:`recheck_threads`), since a load that is there now may be gone in a minute. Explicit
    settings win.
    """
    info: dict = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    if info["device"] == "cuda":
        info["bf16"] = config.bf16 if config.bf16 is not None else bool(torch.cuda.is_bf16_supported())
        info["threads"] = torch.get_num_threads()
        info["reason"] = "CUDA: bf16 where the GPU supports it"
        logger.info("Precision: %s (%s).", "bf16 autocast" if info["bf16"] else "float32", info["reason"])
        return info
    info["cores"] = torch.get_num_threads()
    info["threads_explicit"] = bool(config.num_threads)
    if config.num_threads:
        threads, thread_reason = config.num_threads, "--num-threads"
        torch.set_num_threads(threads)
    else:
        threads, thread_reason = _measured_threads(info["cores"], probe_seconds)
    info["threads"], info["threads_reason"] = threads, thread_reason
    info["thread_choices"] = [{"phase": "start-up", "threads": threads, "reason": thread_reason}]
    fp32 = _matmul_rate(torch.float32, probe_seconds)
    bf16 = _matmul_rate(torch.bfloat16, probe_seconds)
    info["float32_rate"], info["bf16_rate"] = fp32, bf16
    if config.bf16 is not None:
        info["bf16"], info["reason"] = bool(config.bf16), "--bf16 set explicitly"
    else:
        info["bf16"] = bf16 >= 1.3 * fp32
        info["reason"] = f"bf16 matmul {bf16 / fp32:.2f}× the speed of float32 on this CPU"
    logger.info(
        "Precision: %s (%s); threads: %d (%s).",
        "bf16 autocast" if info["bf16"] else "float32",
        info["reason"],
        threads,
        thread_reason,
    )
    return info


def _measured_threads(cores: int, probe_seconds: float) -> tuple[int, str]:
    """All ``cores`` or 1, whichever runs float32 matmuls faster now; set it; ``(threads, what was measured)``."""
    if cores <= 1:
        torch.set_num_threads(1)
        return 1, "one core"
    torch.set_num_threads(cores)
    many = _matmul_rate(torch.float32, probe_seconds)
    torch.set_num_threads(1)
    one = _matmul_rate(torch.float32, probe_seconds)
    threads = cores if many >= one else 1
    torch.set_num_threads(threads)
    return threads, f"float32 matmuls/s: {many:.0f} with {cores} threads, {one:.0f} with 1"


def recheck_threads(machine: dict, phase: str, probe_seconds: float = 0.2) -> int:
    """Measure the thread choice again right before ``phase`` (under half a second) and log it.

    Why: one probe at start-up decided for the whole run, and a load beside it (a ``pip install``) made one
    thread look faster for all of training. An explicit ``--num-threads`` and CUDA are left as they are.
    Each choice is kept in ``machine["thread_choices"]`` (the summary prints them). Returns the thread count.
    """
    if machine.get("device") != "cpu" or machine.get("threads_explicit") or machine["cores"] <= 1:
        return torch.get_num_threads()
    threads, reason = _measured_threads(machine["cores"], probe_seconds)
    previous = machine["thread_choices"][-1]
    machine["thread_choices"].append({"phase": phase, "threads": threads, "reason": reason})
    changed = (
        f" (was {previous['threads']} for {previous['phase']})" if threads != previous["threads"] else ""
    )
    logger.info("Threads for %s: %d%s (%s).", phase, threads, changed, reason)
    return threads


def threads_line(machine: dict) -> str:
    """The summary's words for the thread choices: ``"2"``, or each phase's choice and what was measured."""
    choices = machine.get("thread_choices")
    if not choices:
        return str(machine.get("threads", machine.get("torch_threads")))
    return "; ".join(f"{c['threads']} for {c['phase']} ({c['reason']})" for c in choices)


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------
def _reload_gated(peft_model, tokenizer, model_path: str, dtype: torch.dtype = torch.float32):
    """The trained gated adapter, saved and applied to a fresh base model the way users load it."""
    from mars_hf import hub
    from mars_hf.models.modeling import load_mars_model

    with tempfile.TemporaryDirectory(prefix="mars_gated_") as folder:
        hub.save_pretrained(peft_model, tokenizer, folder, base_model=None, overwrite=True)
        model, _ = load_mars_model(folder, base_model_name_or_path=str(model_path), dtype=dtype)
    return model.eval()


def _bench_model(config: QuickstartConfig, base: _Base, trained, evaluated, bf16: bool):
    """The model the short benchmark decodes: in the precision the start-up probe chose for this machine, as the
    shipped model's rows (bfloat16 where the CPU computes it natively; our commands' ``--dtype auto``), loaded the
    way a user loads it; the float32 evaluation model otherwise (and as the near-tie reference of bf16 rows)."""
    if not bf16:
        return evaluated
    if config.method == "gated_lora":
        return _reload_gated(trained, base.tokenizer, base.path, dtype=torch.bfloat16)
    return copy.deepcopy(evaluated).to(torch.bfloat16).eval()


def shipped_evaluation(config: QuickstartConfig, bf16: bool) -> dict:
    """Evaluate the MARS model shipped inside mars_hf first (see :func:`mars_hf.tools.quickstart.evaluate.evaluate_shipped`).

    Raises a clear error when the package has no shipped model (a checkout without its weights), naming
    ``--skip-shipped``. Adds ``checkpoint``, ``dtype`` and ``seconds`` to the result.
    """
    from mars_hf.models import embedded_model
    from mars_hf.models.modeling import load_mars_model

    try:
        folder = embedded_model.embedded_mars_checkpoint()
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"{error} To run the quickstart without it, pass --skip-shipped "
            "(QuickstartConfig(skip_shipped=True))."
        ) from error
    dtype_name = config.shipped_dtype or ("bfloat16" if bf16 else "float32")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shipped_dtype must be a torch dtype name such as 'float32', got {dtype_name!r}.")
    start = time.monotonic()
    model, tokenizer = load_mars_model(str(folder), dtype=dtype)
    model.eval()
    prompts = held_out_prompts(config.num_eval_prompts, seed=config.seed)
    eval_ids = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
    logger.info(
        "Evaluating the shipped MARS model %s (%s) for up to %s min at batch 1 and 4.",
        folder,
        dtype_name,
        "∞" if config.shipped_eval_minutes is None else f"{config.shipped_eval_minutes:g}",
    )
    result = evaluate_shipped(
        model,
        tokenizer,
        eval_ids,
        config.shipped_thresholds,
        minutes=config.shipped_eval_minutes,
        verify=config.verify,
        max_new_tokens=config.max_new_tokens,
        progress=config.progress,
        divergence_reference=_float32_copy(folder) if narrower_than_float32(dtype) else None,
        tau_window=config.tau_window,
    )
    del model
    return {"checkpoint": str(folder), **result, "seconds": time.monotonic() - start}


def _float32_copy(folder):
    """A loader of the shipped model in float32, called only if a lossless bf16 row differs from stock: it
    measures each divergence's logit gap in float32."""
    from mars_hf.models.modeling import load_mars_model

    @functools.cache
    def load():
        return load_mars_model(str(folder), dtype=torch.float32)[0].eval()

    return load


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------
def save_checkpoint(
    model,
    tokenizer,
    folder: Path,
    rows: list[dict],
    config: QuickstartConfig,
    training: dict,
    num_prompts: int | None = None,
    max_new_tokens: int | None = None,
):
    """Hub-ready folder through :func:`mars_hf.hub.save_pretrained` (plain ``save_pretrained`` without it)."""
    try:
        from mars_hf import hub
    except ImportError:  # the Hub tooling is optional for the quickstart
        hub = None
    if hub is None or not hasattr(hub, "save_pretrained"):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return
    num_prompts = config.num_eval_prompts if num_prompts is None else num_prompts
    max_new_tokens = config.max_new_tokens if max_new_tokens is None else max_new_tokens
    hub.save_pretrained(
        model,
        tokenizer,
        folder,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct" if config.model_name_or_path is None else None,
        tags=["mars-quickstart"],
        training={
            "method": {
                "gated_lora": f"LoRA r{config.lora_r} ({config.lora_target_modules}) gated to mask positions + mask row",
                "mask_row": "mask-token row only",
                "lora": "LoRA (merged) + mask row",
                "full": "full",
            }[config.method],
            "mask_targets": config.mask_targets,
            "block_size": config.block_size,
            "learning_rate": config.learning_rate,
            "clean_loss": config.clean_loss,
            "steps": training["steps"],
            "examples": config.num_train_prompts,
            "precision": "bf16 autocast" if config.bf16 else "float32",
            "data": "self-distilled greedy answers to mars_hf's template prompts",
        },
        results=hub_rows(rows),
        results_description=(
            f"Greedy decoding of {num_prompts} held-out template prompts (max {max_new_tokens} "
            "new tokens, batch 1, CPU); quality = token agreement with the base model's greedy output."
        ),
        quality_metric="agreement with base greedy",
        overwrite=True,
    )


# --------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------
def _calibration_split(dataset, config: QuickstartConfig):
    """``(training rows, calibration rows or None)``: a seeded slice of the self-distilled answers that
    training never sees fits the confidence calibration (none when the set is too small to spare one)."""
    count = held_out_split(len(dataset), config.calibration_holdout)
    if count == 0:
        return dataset, None
    parts = dataset.train_test_split(test_size=count, seed=config.seed, shuffle=True)
    return parts["train"], parts["test"]


def run_quickstart(config: QuickstartConfig) -> dict:
    """Run the whole quickstart; returns (and writes to ``results.json``) everything measured.

    The steps, each its own function: the shipped model first (what a user can call at once), the base
    model and its self-distilled answers, training, evaluation of the trained model, the report.
    """
    config = resolved(config)
    known = bench_prompts(config)  # a missing benchmark package fails here, before any minute is spent
    timings: dict[str, float] = {}
    total_start = time.monotonic()
    machine = choose_precision_and_threads(config)
    config = dataclasses.replace(config, bf16=machine["bf16"])  # threads: measured again per phase
    torch.manual_seed(config.seed)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    shipped = None
    if not config.skip_shipped:
        shipped = shipped_evaluation(config, bf16=machine["bf16"])
        timings["shipped"] = shipped.pop("seconds")
        (output_dir / "results.json").write_text(json.dumps({"shipped": shipped}, indent=2))
    with _timed(timings, "load"):
        base = _load_base(config)
    recheck_threads(machine, "self-distillation")
    data = _base_answers(config, base, timings)
    recheck_threads(machine, "training")
    trained, training = _train(config, base, data, timings)
    _save_before_evaluation(trained, base.tokenizer, config, training, timings)
    recheck_threads(machine, "evaluation")
    with _timed(timings, "evaluate"):
        evaluated = _evaluation_model(config, base, trained)
        own = _evaluate_own(config, base, data, evaluated)
    bench = None
    if known is not None:
        # What was measured so far is on disk before the benchmark runs: a failing benchmark loses none of it.
        timings["total"] = time.monotonic() - total_start
        partial = _results(config, machine, base, data, training, own, shipped, None, timings)
        (output_dir / "results.json").write_text(json.dumps(partial, indent=2))
        with _timed(timings, "bench"):
            bench_model = _bench_model(config, base, trained, evaluated, machine["bf16"])
            reference = evaluated if bench_model is not evaluated else None
            bench = short_benchmark(bench_model, base.tokenizer, *known, config, reference_model=reference)
            del bench_model, reference
    del evaluated
    timings["total"] = time.monotonic() - total_start
    results = _results(config, machine, base, data, training, own, shipped, bench, timings)
    _write_report(results, trained, base.tokenizer, config, timings, total_start)
    return results


@dataclasses.dataclass
class _Base:
    """The base model the quickstart trains, as loaded (float32)."""

    path: str
    tokenizer: object
    model: object


@dataclasses.dataclass
class _BaseAnswers:
    """The prompts, the base model's self-distilled training answers and its held-out reference answers."""

    train_prompts: list
    train_prompts_excluded: int  # training prompts left out because they hold a benchmark's prompt
    eval_prompts: list
    eval_ids: list
    dataset: object
    distill_cached: bool
    reference: list
    reference_cached: bool

    @property
    def tracking(self) -> tuple[list, list]:
        """Held-out prompts + reference answers as ``(input_ids, labels)``: teacher-forced acceptance."""
        return (
            [ids + out for ids, out in zip(self.eval_ids, self.reference)],
            [[-100] * len(ids) + out for ids, out in zip(self.eval_ids, self.reference)],
        )


@contextlib.contextmanager
def _timed(timings: dict, name: str):
    start = time.monotonic()
    yield
    timings[name] = time.monotonic() - start


def _load_base(config: QuickstartConfig) -> _Base:
    path = resolve_model_path(config.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _Base(path, tokenizer, model)


def _base_answers(config: QuickstartConfig, base: _Base, timings: dict) -> _BaseAnswers:
    """Self-distilled training answers and the held-out reference (both cached on disk)."""
    train_prompts, excluded = training_prompts_without_benchmarks(config.num_train_prompts, seed=config.seed)
    eval_prompts = held_out_prompts(config.num_eval_prompts, seed=config.seed)
    eval_ids = [chat_prompt_ids(base.tokenizer, prompt) for prompt in eval_prompts]
    with _timed(timings, "self_distill"):
        dataset, distill_cached = budgeted_self_distill(
            base.model, base.tokenizer, train_prompts, model_path=base.path, config=config
        )
    with _timed(timings, "reference"):
        reference, reference_cached = cached_reference(
            base.model, base.tokenizer, eval_ids, model_path=base.path, prompts=eval_prompts, config=config
        )
    evaluable = len(reference)  # a budget may have answered only the first prompts
    return _BaseAnswers(
        train_prompts,
        excluded,
        eval_prompts[:evaluable],
        eval_ids[:evaluable],
        dataset,
        distill_cached,
        reference,
        reference_cached,
    )


def _train(config: QuickstartConfig, base: _Base, data: _BaseAnswers, timings: dict):
    """Train within the budget on all but the calibration slice; then fit the calibration on that slice
    (every checkpoint gets a τ that means the same thing) and score teacher-forced acceptance."""
    tracking = data.tracking
    with _timed(timings, "train"):
        train_rows, calibration_rows = _calibration_split(data.dataset, config)
        with tempfile.TemporaryDirectory(prefix="mars_quickstart_") as work_dir:
            # with LoRA, PEFT wraps the base model (merged back after training)
            trained, training = train_mars(
                base.model, base.tokenizer, train_rows, config, work_dir, tracking=tracking
            )
    if calibration_rows is not None:
        training["calibration"] = attach_calibration(trained, base.tokenizer, calibration_rows)
    training["teacher_forced"] = teacher_forced_acceptance(trained, *tracking, config.thresholds)
    return trained, training


@dataclasses.dataclass
class _OwnEvaluation:
    """The trained model's rows: batch 1 (``runs``, kept for the samples) and batch 4, one answer length."""

    runs: dict
    rows: list
    batch4_rows: list
    batch4_prompts: int
    length: int


def _evaluation_model(config: QuickstartConfig, base: _Base, trained):
    """The trained model as a user decodes with it: with ``gated_lora``, the saved adapter on the base model,
    gated by forward hooks (as custom_generate/ and hub.load apply it; PEFT's wrapper decodes several times
    slower); else the trained model itself."""
    if config.method == "gated_lora":
        return _reload_gated(trained, base.tokenizer, base.path)
    return trained


def _evaluate_own(config: QuickstartConfig, base: _Base, data: _BaseAnswers, model) -> _OwnEvaluation:
    """The trained model (:func:`_evaluation_model`) at batch 1 and 4 against the base model's float32
    reference answers."""
    batch1, batch4, length = evaluate(model, base.tokenizer, data.eval_ids, config)
    # A budget may have cut the answers: the first `length` tokens of a greedy answer are the greedy
    # answer of that length, so the references are cut alike.
    references = [answer[:length] for answer in data.reference]
    return _OwnEvaluation(
        runs=batch1,
        rows=summarize_against(batch1, references),
        batch4_rows=summarize_against(batch4, references),
        batch4_prompts=decoded_prompts(batch4),
        length=length,
    )


def _results(
    config, machine, base: _Base, data: _BaseAnswers, training, own: _OwnEvaluation, shipped, bench, timings
) -> dict:
    """Everything measured, JSON-able: settings, machine, data, training, evaluation, the short benchmark on
    prompts users know (None where it was skipped), samples."""
    evaluated = decoded_prompts(own.runs)
    dataset = data.dataset
    return {
        "config": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(config).items()
        },
        "model": base.path,
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads(), **machine},
        "data": {
            "train_prompts": len(dataset),
            "train_prompts_requested": len(data.train_prompts) + data.train_prompts_excluded,
            "train_prompts_holding_a_benchmark_prompt": data.train_prompts_excluded,
            "train_tokens": int(sum(sum(1 for t in labels if t != -100) for labels in dataset["labels"])),
            "ended_with_eos": int(sum(dataset["ends_with_eos"])),
            "eval_prompts": evaluated,
            "eval_batch_prompts": own.batch4_prompts,
            "eval_max_new_tokens": own.length,
            "self_distill_cached": data.distill_cached,
            "reference_cached": data.reference_cached,
        },
        "training": training,
        "evaluation": own.rows,
        "evaluation_batch4": own.batch4_rows,
        "shipped": shipped,
        "bench": bench,
        "timings_seconds": timings,
        "checkpoint": str(Path(config.output_dir) / "checkpoint") if config.save_checkpoint else None,
        "samples": _samples(base.tokenizer, data, own.runs, evaluated),
    }


def _samples(tokenizer, data: _BaseAnswers, runs, evaluated: int, count: int = 3) -> list[dict]:
    """The first held-out answers side by side: base, stock, τ = 0.9 and verify."""
    shown = ("stock", run_label(0.9), VERIFY_LABEL)
    return [
        {
            "prompt": prompt,
            "base": tokenizer.decode(data.reference[i], skip_special_tokens=True),
            **{
                label: tokenizer.decode(run.outputs[i], skip_special_tokens=True)
                for label, run in runs.items()
                if label in shown
            },
        }
        for i, prompt in enumerate(data.eval_prompts[: min(count, evaluated)])
    ]


def _save_before_evaluation(trained, tokenizer, config: QuickstartConfig, training: dict, timings) -> None:
    """The trained checkpoint, saved as soon as training ends (its card without results yet), so that an
    evaluation that fails or is interrupted loses no training; the report saves it again with the results."""
    if not config.save_checkpoint:
        return
    with _timed(timings, "save"):
        save_checkpoint(trained, tokenizer, Path(config.output_dir) / "checkpoint", [], config, training)


def _write_report(results: dict, trained, tokenizer, config: QuickstartConfig, timings, total_start) -> None:
    """``results.json`` and the plot first, so that a failing save loses nothing measured; then the
    checkpoint, and ``results.json`` again with the save's time."""
    output_dir = Path(config.output_dir)
    rows, shipped = results["evaluation"], results["shipped"]
    (output_dir / "results.json").write_text(json.dumps(results, indent=2))
    pareto_plot(rows, output_dir / "pareto.png", shipped_rows=shipped["rows"] if shipped else None)
    if not config.save_checkpoint:
        return
    with _timed(timings, "save"):
        save_checkpoint(
            trained,
            tokenizer,
            output_dir / "checkpoint",
            rows,
            config,
            results["training"],
            num_prompts=results["data"]["eval_prompts"],
            max_new_tokens=results["data"]["eval_max_new_tokens"],
        )
    timings["total"] = time.monotonic() - total_start
    (output_dir / "results.json").write_text(json.dumps(results, indent=2))


def summary(results: dict) -> str:
    """The terminal summary: the evaluation table plus where everything went."""
    timings = results["timings_seconds"]
    training = results["training"]
    shipped = results.get("shipped")
    header = [
        "",
        f"MARS quickstart: held-out prompts never trained on, greedy; {OWN_SECTION}: the model trained "
        f"just now, {results['data']['eval_prompts']} prompts at batch 1 and "
        f"{results['data'].get('eval_batch_prompts', 0)} at batch 4 (≤ {results['data']['eval_max_new_tokens']} "
        "new tokens), in float32, against the base model's float32 greedy answers.",
    ]
    if shipped:
        header.append(
            f"{SHIPPED_SECTION}: the MARS model shipped in mars_hf (trained by a long run; see its model card "
            f"{Path(shipped['checkpoint']) / 'README.md'}), {shipped['eval_prompts']} prompts at batch 1 and "
            f"{shipped['batch_prompts']} at batch 4 (left-padded, ≤ {shipped['max_new_tokens']} new tokens), "
            f"in {shipped['dtype']}, against stock "
            "generate's batch-1 answers in the same dtype."
        )
    header.append(
        "agreement: matching token positions; prefix agreement: share of the answer before the first "
        "difference; batch 4 tokens/forward: tokens / (4 × batch forwards), so rows that end early "
        "lower stock too; vs stock: speed against stock generate at the same batch."
    )
    planned = results["config"].get("tau_window", "fixed") == "planned"  # results of older releases: fixed
    header.append(
        "τ rows: "
        + (
            "masks fed where the step planner expects them to pay (mars_planner=True)"
            if planned
            else "W masks every step"
        )
        + "; --tau-window "
        + ("fixed for the paper's window." if planned else "planned to let the planner size them.")
    )
    lines = [*header, "", results_table(results), ""]
    if results.get("bench"):
        lines += [bench_table(results["bench"], results.get("checkpoint")), ""]
    lines += [
        f"training: {training['steps']} steps ({training['epochs']:.2f} epochs of {results['data']['train_prompts']} "
        f"self-distilled answers) in {training['seconds'] / 60:.1f} min; "
        f"total {timings['total'] / 60:.1f} min ("
        + ", ".join(f"{k} {v / 60:.1f}" for k, v in timings.items() if k != "total")
        + ")",
        f"precision: {'bf16 autocast' if results['machine'].get('bf16') else 'float32'}"
        + (f" ({results['machine']['reason']})" if results["machine"].get("reason") else "")
        + f"; torch threads: {threads_line(results['machine'])}",
        f"results: {Path(results['config']['output_dir']) / 'results.json'}, plot: "
        f"{Path(results['config']['output_dir']) / 'pareto.png'}"
        + (f", checkpoint: {results['checkpoint']}" if results.get("checkpoint") else ""),
    ]
    return "\n".join(lines)
