"""The decoding section: stock `generate` against every MARS configuration, one group per model x rate x batch.

A group decodes the same prompts with every configuration, interleaved repeat by repeat (drift of a shared
machine hits them alike), and keeps medians. Its rows are `bench`'s rows plus what the forced pattern
implies (tokens per step and, where exact, tokens per forward), peak memory and verify's draft counts.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from mars_hf.tools.bench import (
    BenchConfiguration,
    ForwardCounter,
    greedy_generation_config,
    run_once,
    summarise_measurements,
)
from mars_hf.tools.gpu_check.generation import SynchronizedGenerate
from mars_hf.tools.gpu_check.machine import peak_memory_mb, peak_memory_reset
from mars_hf.tools.gpu_check.random_models import make_prompts


@dataclass(frozen=True)
class CheckConfiguration(BenchConfiguration):
    """A `bench` configuration plus the acceptance rule and verify's draft layout."""

    acceptance: str = "probability"
    layout: str | None = None
    # the paper's window: the check predicts τ's tokens per forward from the forced acceptance pattern
    tau_window: str = "fixed"

    @property
    def label(self) -> str:
        if self.acceptance == "verify":
            return f"verify {self.layout} W={self.window}"
        return super().label

    def generate_kwargs(self, acceptance: str | None = None) -> dict:
        if self.acceptance != "verify":
            return super().generate_kwargs(self.acceptance)
        kwargs = {"mars_acceptance": "verify", "mars_layout": self.layout, "mars_block_size": self.window}
        if self.tau is not None:
            kwargs["mars_threshold"] = self.tau  # verify's proposal floor
        return kwargs


STOCK = BenchConfiguration("stock")


def verify_configurations(args) -> list[CheckConfiguration]:
    """Verified decoding with each of ``args.layouts`` (no τ: every mask is proposed)."""
    return [
        CheckConfiguration("verify", None, args.window, acceptance="verify", layout=layout)
        for layout in args.layouts
    ]


def decoding_configurations(args) -> list[BenchConfiguration]:
    """Stock, then τ rows of each cache scheme (cursor, block per C, none), then verify per layout."""
    configurations = [STOCK, CheckConfiguration("cursor", args.tau, args.window)]
    configurations += [CheckConfiguration("block", args.tau, args.window, c) for c in args.cache_blocks]
    configurations.append(CheckConfiguration("none", args.tau, args.window))
    return configurations + verify_configurations(args)


def group_name(shape: str, rate: float, batch: int) -> str:
    return f"{shape}: decode rate={rate:g} batch={batch}"


def decode_item(check, shape: str, rate: float, batch: int) -> None:
    """Estimate one group, and run it if it fits the budget."""
    configurations = decoding_configurations(check.args)
    estimate = check.estimates.decode(shape, rate, batch, configurations)
    check.run_item(
        group_name(shape, rate, batch), estimate, decode_group, check, shape, rate, batch, configurations
    )


@dataclass
class GroupRuns:
    """What the timed runs of one group left: per configuration, its measurements and what came with them."""

    measurements: dict = field(default_factory=dict)  # configuration -> [RunMeasurement]
    clocked: dict = field(default_factory=dict)  # configuration -> [seconds by the check's clock]
    peaks: dict = field(default_factory=dict)  # configuration -> peak MiB (CUDA) or None
    drafts: dict = field(default_factory=dict)  # configuration -> (proposed, accepted) or None
    failed: dict = field(default_factory=dict)  # configuration -> why it could not run


def decode_group(check, shape: str, rate: float, batch: int, configurations) -> None:
    """One group: every configuration decodes the same prompts; runs interleaved, medians."""
    args = check.args
    model, forcer = check.models[shape]["model"], check.models[shape]["forcer"]
    forcer.enabled = True
    forcer.set_rate(rate)
    inputs = make_prompts(model, batch, args.prompt_length, args.seed, check.device)
    runs = _run_group(check, model, inputs, configurations)
    for configuration, reason in runs.failed.items():
        check.skip(f"{group_name(shape, rate, batch)} {configuration.label}", reason)
        runs.measurements.pop(configuration)
    rows = summarise_measurements(batch, [inputs], runs.measurements, shape)
    last_positions = (inputs["attention_mask"].sum(1) - 1).tolist()
    steps = forcer.simulate_steps(last_positions, args.max_new_tokens, args.window)
    stock_step = check.estimates.step_seconds.get((shape, batch))
    for configuration, row in zip(runs.measurements, rows):
        _describe_row(check, row, configuration, runs, rate, forcer, steps)
        if stock_step and row["num_forwards"]:
            seconds = statistics.median(runs.clocked[configuration])
            check.estimates.learn_factor(configuration, seconds, row["num_forwards"], stock_step)
    check.result["rows"].extend(rows)


def _run_group(check, model, inputs, configurations) -> GroupRuns:
    """Warm-up then timed repeats, every configuration once per repeat; a verify configuration that the
    decoder rejects is recorded as failed (and skipped), any other failure ends the item."""
    args = check.args
    configs = {
        True: greedy_generation_config(model, args.max_new_tokens),
        False: greedy_generation_config(model, min(args.warmup_tokens, args.max_new_tokens)),
    }
    generator = SynchronizedGenerate(model)
    counter = ForwardCounter(model)
    runs = GroupRuns(
        measurements={c: [] for c in configurations},
        clocked={c: [] for c in configurations},
        peaks={c: None for c in configurations},
    )
    try:
        for repeat in range(args.warmup + args.repeats):
            for configuration in configurations:  # interleaved: drift hits every configuration alike
                if configuration in runs.failed:
                    continue
                check.budget.check()
                timed = repeat >= args.warmup
                _run_configuration(
                    check, generator, counter, inputs, configs[timed], configuration, timed, runs
                )
    finally:
        counter.remove()
    return runs


def _run_configuration(check, generator, counter, inputs, config, configuration, timed: bool, runs) -> None:
    peak_memory_reset(check.device)
    start = check.clock()
    try:
        measurement = run_once(generator, [inputs], config, configuration, None, counter)
    except (ValueError, TypeError, NotImplementedError) as error:
        if getattr(configuration, "acceptance", None) != "verify":
            raise
        runs.failed[configuration] = f"failed: {type(error).__name__}: {error}"
        return
    peak = peak_memory_mb(check.device)
    if not timed:
        return
    runs.clocked[configuration].append(check.clock() - start)
    runs.drafts[configuration] = generator.drafts
    runs.measurements[configuration].append(measurement)
    if peak is not None:
        runs.peaks[configuration] = max(runs.peaks[configuration] or 0.0, peak)


def _describe_row(check, row: dict, configuration, runs: GroupRuns, rate: float, forcer, steps) -> None:
    """Add to a `bench` row what the check knows besides: the rule, the forced rate and what it implies,
    memory and verify's draft counts."""
    args = check.args
    stock = configuration.scheme == "stock"
    row.update(
        label=configuration.label,
        acceptance=getattr(configuration, "acceptance", None),
        layout=getattr(configuration, "layout", None),
        rate=rate,
        dtype=args.dtype,
        device=str(check.device),
        peak_memory_mb=runs.peaks[configuration],
        expected_tokens_per_step=None if stock else forcer.expected_tokens_per_step(args.window),
        predicted_tokens_per_forward=predicted_tokens_per_forward(configuration, steps, args.max_new_tokens),
    )
    proposed, accepted = runs.drafts.get(configuration) or (None, None)
    row.update(
        drafts_proposed=proposed,
        drafts_accepted=accepted,
        draft_acceptance=accepted / proposed if proposed else None,
    )


def predicted_tokens_per_forward(configuration, steps: list[int], new_tokens: int) -> float | None:
    """Tokens per forward the forced pattern implies: exact for cursor/none (forwards = the longest
    row's steps), 1 for stock, None where the scheme adds forwards of its own (block commits, verify)."""
    if configuration.scheme == "stock":
        return 1.0
    if getattr(configuration, "acceptance", None) == "verify" or configuration.scheme == "block":
        return None
    return new_tokens / max(steps)
