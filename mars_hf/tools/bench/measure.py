"""Measuring one configuration: decode every batch once, timed, and count what really happened.

The forward counter is a hook on the model, independent of what a decoding loop reports about itself; the
generated tokens are counted up to each row's first EOS.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from mars_hf.decoding.cpu_kernels import packed_linears
from mars_hf.decoding.memory import PlannerMemory
from mars_hf.tools.bench.configurations import BenchConfiguration


def count_generated_tokens(new_tokens: torch.Tensor, eos_token_ids) -> torch.Tensor:
    """Tokens each row really generated: up to and including its first EOS (padding after it, which
    may use the EOS id, is not counted)."""
    if not eos_token_ids:
        return torch.full((new_tokens.shape[0],), new_tokens.shape[1], dtype=torch.long)
    is_eos = torch.isin(new_tokens, torch.tensor(list(eos_token_ids), device=new_tokens.device))
    lengths = []
    for row in is_eos:
        hits = row.nonzero()
        lengths.append(int(hits[0]) + 1 if len(hits) else new_tokens.shape[1])
    return torch.tensor(lengths, dtype=torch.long)


def _eos_ids(generation_config) -> list[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


class ForwardCounter:
    """Counts calls of the model's ``forward`` (every call, the prompt's included) and the tokens each
    call feeds, independently of what a decoding loop reports about itself."""

    def __init__(self, model):
        self.widths: list[int] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    @property
    def count(self) -> int:
        return len(self.widths)

    def reset(self):
        self.widths = []

    def _hook(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            # traced into a compiled forward it would run once, at tracing, and guard every step on the list's
            # length (a recompile per step): compiled steps are counted from what the call reports instead
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            input_ids = kwargs["inputs_embeds"]
        self.widths.append(int(input_ids.shape[1]))

    def remove(self):
        self._handle.remove()


@dataclass
class RunMeasurement:
    """One configuration decoding every batch once."""

    seconds: float
    new_tokens: list[list[int]]  # each row's generated tokens, up to and including its EOS
    forwards_per_batch: list[int]
    counted_forwards: int
    accepted_per_row: list[int] | None = None
    step_tokens: float = 1.0  # mean tokens fed per forward after each prompt's forward
    width_histogram: dict[int, int] | None = None  # columns per row of MARS forwards -> count
    plan_counts: dict[str, int] | None = None  # planner choices per row-step (MARS only)
    cost_curve: dict[int, float] | None = None  # the decoder's cost curve (when a step needed it)
    drafts_by_source: dict | None = None  # verify: {source: {"proposed", "accepted"}} over the run
    batch_seconds: list[float] | None = None  # each batch's own seconds (per-category timings)

    @property
    def generated_per_row(self) -> list[int]:
        return [len(tokens) for tokens in self.new_tokens]

    @property
    def num_forwards(self) -> int:
        return sum(self.forwards_per_batch)


def _stock_kernels(model, configuration):
    """Stock `generate` on the packed linears MARS steps use (the reference row that shows what the kernels
    alone buy); every other row as it comes."""
    if configuration.scheme == "stock" and configuration.cpu_kernels == "packed":
        return packed_linears(model, "packed")
    return contextlib.nullcontext()


def _generate_kwargs(configuration, acceptance, model, cache_length: int | None, memory) -> dict:
    """The configuration's ``generate`` keywords; a compiled one's compile config is the model device's, and its
    static cache ``cache_length`` entries when given; an eager MARS row's planner measures into ``memory``."""
    if getattr(configuration, "compiled", False):
        kwargs = configuration.generate_kwargs(acceptance, str(model.device))
        if cache_length is not None:
            kwargs["max_cache_len"] = cache_length
        return kwargs
    kwargs = configuration.generate_kwargs(acceptance)
    # a planned τ row plans on the assumed curve: what τ keeps then never depends on the timing (repeats agree)
    if configuration.scheme != "stock" and memory is not None and not kwargs.get("mars_planner"):
        kwargs["mars_cost_probe"] = memory
    return kwargs


def run_once(
    model,
    batches,
    generation_config,
    configuration,
    acceptance,
    counter,
    cache_length: int | None = None,
    memory: PlannerMemory | None = None,
) -> RunMeasurement:
    """Decode every batch once (timed); stock `generate` when ``configuration.scheme == "stock"``. A compiled
    configuration's static cache holds ``cache_length`` entries (one size for every batch: one set of graphs).
    An eager MARS row's step planner measures the step costs into ``memory`` and starts from what it holds (the
    benchmark keeps one per model, as a caller would); None: generate's default feed, nothing timed."""
    seconds, new_tokens, forwards, widths, accepted, batch_seconds = 0.0, [], [], [], [], []
    counted = 0
    histogram, plans, curve, sources = {}, {}, None, {}
    # The row's generation settings (a static cache, prompt lookup) go into its own copy of the config, MARS's
    # keywords stay keywords: transformers warns about a config passed beside its own settings as keywords.
    row_config = copy.deepcopy(generation_config)
    keywords = row_config.update(**_generate_kwargs(configuration, acceptance, model, cache_length, memory))
    for inputs in batches:
        prompt_length = inputs["input_ids"].shape[1]
        counter.reset()
        start = time.perf_counter()
        with _stock_kernels(model, configuration):
            output = model.generate(**inputs, generation_config=row_config, **keywords)
        batch_seconds.append(time.perf_counter() - start)
        seconds += batch_seconds[-1]
        new = output.sequences[:, prompt_length:]
        lengths = count_generated_tokens(new, _eos_ids(generation_config)).tolist()
        new_tokens.extend(row[:n] for row, n in zip(new.tolist(), lengths))
        if configuration.scheme == "stock" and configuration.lookup:
            forwards.append(counter.count)  # prompt lookup: one forward per verified candidate set
        elif configuration.scheme == "stock":
            # Stock `generate` makes one forward per new column (the prompt's forward makes the first).
            forwards.append(new.shape[1])
        else:
            forwards.append(int(output.num_forwards))
        if configuration.compiled:  # the counter sees the eager prefill only (``ForwardCounter._hook``)
            counted += forwards[-1]
            reported = getattr(output, "forward_widths", None)
            widths.extend(reported.tolist()[1:] if reported is not None else [1] * (forwards[-1] - 1))
        else:
            counted += counter.count
            widths.extend(counter.widths[1:])
        accepted_counts = getattr(output, "accepted_counts", None)
        if accepted_counts is not None:
            accepted.extend(accepted_counts.sum(dim=0).tolist())
        curve = _add_planner_record(output, histogram, plans) or curve
        for source, counts in (getattr(output, "drafts_by_source", None) or {}).items():
            total = sources.setdefault(source, {"proposed": 0, "accepted": 0})
            total["proposed"] += counts["proposed"]
            total["accepted"] += counts["accepted"]
    return RunMeasurement(
        seconds=seconds,
        new_tokens=new_tokens,
        forwards_per_batch=forwards,
        counted_forwards=counted,
        accepted_per_row=accepted if configuration.scheme != "stock" else None,
        step_tokens=statistics.mean(widths) if widths else 1.0,
        width_histogram=dict(sorted(histogram.items())) if configuration.scheme != "stock" else None,
        plan_counts=plans if configuration.scheme != "stock" else None,
        cost_curve=curve,
        drafts_by_source=sources or None,
        batch_seconds=batch_seconds,
    )


def _add_planner_record(output, histogram: dict, plans: dict):
    """Add one `generate` call's forward widths and planner choices; return its cost curve."""
    widths = getattr(output, "forward_widths", None)
    if widths is not None:
        for width in widths.tolist():
            histogram[width] = histogram.get(width, 0) + 1
    for kind, count in (getattr(output, "plan_counts", None) or {}).items():
        plans[kind] = plans.get(kind, 0) + count
    return getattr(output, "cost_curve", None)


def interleaved_runs(
    model,
    batches,
    generation_config,
    configurations,
    args,
    counter,
    progress=True,
    desc="bench",
    untrained=None,
    memories=None,
) -> dict[BenchConfiguration, list[RunMeasurement]]:
    """``args.warmup`` untimed then ``args.repeats`` timed runs of every configuration, interleaved (so
    that drift of a shared machine hits every configuration alike): the timed measurements.

    ``untrained``: an `UntrainedDecoder` that runs the configurations with ``masks="untrained"``. ``memories``:
    the ``PlannerMemory`` of the ``"trained"`` and the ``"untrained"`` model (eager MARS rows measure into them),
    else new ones for this call."""
    measurements: dict[BenchConfiguration, list[RunMeasurement]] = {c: [] for c in configurations}
    cache_length = getattr(args, "max_cache_len", None)
    if memories is None:  # eager MARS rows plan on the step costs measured here, one memory per model
        memories = {"trained": PlannerMemory(), "untrained": PlannerMemory()}
    bar = tqdm(total=len(configurations) * (args.warmup + args.repeats), desc=desc, disable=not progress)
    for repeat in range(args.warmup + args.repeats):
        for configuration in configurations:
            if configuration.untrained:
                if untrained is None:
                    raise ValueError(f"{configuration.label} needs the untrained-mask model (`untrained=`).")
                measurement = run_once(
                    untrained.model,
                    batches,
                    generation_config,
                    untrained.configuration(configuration),
                    args.acceptance,
                    untrained.counter,
                    cache_length,
                    memories["untrained"],
                )
            else:
                measurement = run_once(
                    model,
                    batches,
                    generation_config,
                    configuration,
                    args.acceptance,
                    counter,
                    cache_length,
                    memories["trained"],
                )
            if repeat >= args.warmup:
                measurements[configuration].append(measurement)
            bar.update(1)
    bar.close()
    return measurements


@dataclass
class UntrainedDecoder:
    """The untrained-mask model, its forward counter, and the kernels the trained model's rows ran on per
    ``mars_cpu_kernels`` mode (``"packed"`` / ``"stock"``): an untrained-mask row runs on the same kernels
    as its trained twin, not on what ``"auto"`` would decide for the second model."""

    model: object
    counter: ForwardCounter
    kernels: dict[str, str]

    def configuration(self, configuration: BenchConfiguration) -> BenchConfiguration:
        return dataclasses.replace(configuration, cpu_kernels=self.kernels[configuration.cpu_kernels])


def greedy_generation_config(model, max_new_tokens: int, *, tokenizer=None, output_logits: bool = False):
    """The model's generation config made greedy, of exactly ``max_new_tokens``, with a dict output; pad
    and EOS from ``tokenizer`` where the model's config has none."""
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if hasattr(config, name):
            setattr(config, name, None)
    config.max_new_tokens = max_new_tokens
    config.max_length = None
    config.return_dict_in_generate = True
    config.output_logits = output_logits
    if tokenizer is not None and config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    if tokenizer is not None and config.eos_token_id is None:
        config.eos_token_id = tokenizer.eos_token_id
    return config
