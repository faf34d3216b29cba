"""Side-by-side benchmark of stock `generate` and MARS decoding, with the §4 cost model next to it.

Why a benchmark and not a timed test: speed depends on the machine, the model and the batch, so the
only honest number is a ratio against stock `generate` measured in the same process, on the same
prompts, interleaved so that drift of a shared machine hits every configuration alike.

What is reported, per batch size and configuration (stock, or MARS with threshold τ, window W,
cache scheme and block C):

- ``tokens_per_forward``: generated tokens ÷ (batch × model calls), prompt forwards included. At
  batch 1 this is generated tokens ÷ forwards; stock `generate` reaches 1.0 only when no row stops
  early, so at larger batch compare with the stock row. Every batch size decodes the whole prompt
  set (in batches), so rows of different batch sizes do the same work.
- ``tokens_per_s`` and ``speedup`` = tokens/s ÷ stock tokens/s (equal to the wall-clock ratio when both
  produce the same number of tokens, which they do whenever the outputs match).
- ``efficiency`` = speedup ÷ (tokens_per_forward ÷ stock tokens_per_forward): the share of the saved
  forwards that turned into saved time (at batch 1: speedup ÷ tokens per forward).
- ``predicted``: the speedup MARS_SPEC §4's cost model predicts from the measured cost of an
  (n + W)-token cached forward relative to a 1-token cached forward (see `measure_step_costs`).
- for verified decoding with the step planner (``v-auto``, the default layout): the cost curve the
  decoder measured for itself (``mars_hf.decoding.cost_model``) and what the planner chose with it — a
  histogram of the columns per row each forward fed, and how often a row fed nothing extra, drafts
  only, a linear or a quadratic mask layout.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import transformers
from tqdm.auto import tqdm

from mars_hf.decoding.acceptance import one_token_per_step
from mars_hf.tools.tables import Column, cost_curve_text, fixed_width_table, fmt, planner_choices

logger = logging.getLogger(__name__)

SCHEMES = ("stock", "none", "cursor", "block")

# General chat prompts that ask for answers longer than a typical ``max_new_tokens``, so most rows
# decode until the limit and timings compare equal amounts of work.
BUILTIN_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works, step by step.",
    "List the days of the week and say one thing people often do on each.",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "Count from 1 to 40, separated by commas.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between Python and C? Give several examples.",
    "Give five tips for staying focused while studying, with a sentence on each.",
]


GROUNDED_PROMPTS_FILE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "templates", "grounded_prompts.json"
)
PROMPT_SETS = ("chat", "grounded")


def grounded_prompts() -> list[str]:
    """Prompts whose answers repeat their input (rewrite, summarise, convert, edit code): where prompt
    lookup's drafts are kept (``mars_hf/templates/grounded_prompts.json``)."""
    with open(GROUNDED_PROMPTS_FILE, encoding="utf-8") as handle:
        return list(json.load(handle)["prompts"])


@dataclass(frozen=True)
class BenchConfiguration:
    """One decoding configuration: stock `generate`, or MARS with a cache scheme; ``lookup`` adds
    prompt lookup (``prompt_lookup_num_tokens``): transformers' own with stock, or verified drafts."""

    scheme: str
    tau: float | None = None
    window: int | None = None
    cache_block: int | None = None
    layout: str | None = None  # verified decoding (mars_acceptance="verify", no τ): auto, linear, quadratic
    lookup: int | None = None

    @property
    def verify(self) -> bool:
        return self.layout is not None

    @property
    def label(self) -> str:
        if self.scheme == "stock":
            return f"stock prompt-lookup={self.lookup}" if self.lookup else "stock"
        label = f"{self.scheme} verify-{self.layout}" if self.verify else f"{self.scheme} tau={self.tau:g}"
        label += f" W={self.window}" + (f" prompt-lookup={self.lookup}" if self.lookup else "")
        return label + (f" C={self.cache_block}" if self.cache_block is not None else "")

    def generate_kwargs(self, acceptance: str) -> dict:
        if self.scheme == "stock":
            return {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}
        kwargs = {"mars_block_size": self.window, "mars_cache": self.scheme}
        if self.lookup:
            kwargs["prompt_lookup_num_tokens"] = self.lookup
        if self.verify:
            kwargs.update(mars_acceptance="verify", mars_layout=self.layout)
        else:
            kwargs.update(mars_threshold=self.tau, mars_acceptance=acceptance)
        if self.cache_block is not None:
            kwargs["mars_cache_block"] = self.cache_block
        return kwargs


def build_configurations(
    taus,
    windows,
    schemes=("stock", "none", "cursor", "block"),
    cache_blocks=("W", 16, 32),
    acceptance: str = "probability",
    one_token_schemes=("cursor",),
    verify_layouts=(),
    lookup_tokens=(),
) -> list[BenchConfiguration]:
    """The grid, stock first. ``cache_blocks`` may hold ``"W"`` (C = the window). In one-token mode
    (τ ≥ 1 with the probability or margin metric: ``one_token_per_step``) the schemes all do the same
    work, so only ``one_token_schemes`` run there. Each of ``verify_layouts`` adds verified decoding
    (cursor scheme) for every window. Each k of ``lookup_tokens`` adds transformers' prompt lookup
    (stock ``generate``, batch 1 only) and every verify row again with prompt-lookup drafts."""
    unknown = set(schemes) - set(SCHEMES)
    if unknown:
        raise ValueError(f"Unknown scheme(s) {sorted(unknown)}; choose from {list(SCHEMES)}.")
    configurations = [BenchConfiguration("stock")] if "stock" in schemes else []
    for tau in taus:
        for window in windows:
            for scheme in schemes:
                if scheme == "stock":
                    continue
                if one_token_per_step(acceptance, tau) and scheme not in one_token_schemes:
                    continue
                if scheme != "block":
                    configurations.append(BenchConfiguration(scheme, float(tau), int(window)))
                    continue
                blocks = sorted({int(window) if str(c).upper() == "W" else int(c) for c in cache_blocks})
                for block in blocks:
                    configurations.append(BenchConfiguration(scheme, float(tau), int(window), block))
    for window in windows:
        for layout in verify_layouts:
            configurations.append(BenchConfiguration("cursor", None, int(window), None, layout))
    for k in lookup_tokens:
        if "stock" in schemes:
            configurations.append(BenchConfiguration("stock", lookup=int(k)))
        for window in windows:
            for layout in verify_layouts:
                configurations.append(BenchConfiguration("cursor", None, int(window), None, layout, int(k)))
    return list(dict.fromkeys(configurations))


def load_prompts(path: str | os.PathLike) -> list[str]:
    """Prompts from a file: one per line (``.txt``) or JSON lines with a ``prompt`` field or a
    ``messages`` list whose first user message is taken."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            if str(path).endswith((".jsonl", ".json")):
                record = json.loads(line)
                if "prompt" in record and isinstance(record["prompt"], str):
                    prompts.append(record["prompt"])
                else:
                    messages = record.get("messages") or record.get("prompt") or []
                    prompts.append(next(m["content"] for m in messages if m["role"] == "user"))
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError(f"No prompts found in {path}.")
    return prompts


def prepare_inputs(tokenizer, prompts: list[str], batch_size: int) -> dict:
    """Chat-template ``batch_size`` prompts (cycling through the list), left-padded."""
    chosen = [prompts[i % len(prompts)] for i in range(batch_size)]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in chosen
    ]
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = padding_side
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}


def prepare_batches(tokenizer, prompts: list[str], batch_size: int) -> list[dict]:
    """Every prompt once, in batches of ``batch_size`` (the last one filled up by cycling the list),
    so that each batch size decodes the same prompt set and batch 1 is not one prompt's anecdote."""
    count = max(len(prompts), batch_size)
    count = -(-count // batch_size) * batch_size
    rows = [prompts[i % len(prompts)] for i in range(count)]
    return [
        prepare_inputs(tokenizer, rows[i : i + batch_size], batch_size) for i in range(0, count, batch_size)
    ]


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

    @property
    def generated_per_row(self) -> list[int]:
        return [len(tokens) for tokens in self.new_tokens]

    @property
    def num_forwards(self) -> int:
        return sum(self.forwards_per_batch)


def run_once(model, batches, generation_config, configuration, acceptance, counter) -> RunMeasurement:
    """Decode every batch once (timed); stock `generate` when ``configuration.scheme == "stock"``."""
    seconds, new_tokens, forwards, widths, accepted = 0.0, [], [], [], []
    counted = 0
    histogram, plans, curve, sources = {}, {}, None, {}
    for inputs in batches:
        prompt_length = inputs["input_ids"].shape[1]
        counter.reset()
        start = time.perf_counter()
        output = model.generate(
            **inputs, generation_config=generation_config, **configuration.generate_kwargs(acceptance)
        )
        seconds += time.perf_counter() - start
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


@torch.no_grad()
def measure_step_costs(model, inputs, *, context_tokens: int, step_sizes, full_lengths=(), repeats: int = 5):
    """Seconds (fastest of ``repeats``) of a cached forward of ``k`` new tokens on a ``context_tokens``-long prefix, for
    each ``k`` in ``step_sizes``, and of an uncached forward of each length in ``full_lengths``.

    The prefix is the (left-padded) prompt batch extended with filler tokens, the batch the model sees
    in the benchmark; the cache is cropped back after each timed forward so every ``k`` sees the
    same prefix.
    """
    from transformers import DynamicCache

    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    batch = input_ids.shape[0]
    filler = max(0, context_tokens - input_ids.shape[1])
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    prefix = torch.cat([input_ids, torch.randint(0, vocab, (batch, filler), generator=generator)], dim=1)
    prefix_mask = torch.cat([attention_mask, torch.ones(batch, filler, dtype=attention_mask.dtype)], dim=1)
    positions = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, attention_mask=prefix_mask, position_ids=positions, cache=cache, use_cache=True)
    last = positions[:, -1:]
    cached = {}
    for k in sorted({int(size) for size in step_sizes}):
        mask = torch.cat([prefix_mask, torch.ones(batch, k, dtype=prefix_mask.dtype)], dim=1)
        new = torch.randint(0, vocab, (batch, k), generator=generator)
        cached[k] = (new, mask, last + torch.arange(1, k + 1))
    uncached = {
        n: torch.randint(0, vocab, (batch, n), generator=generator) for n in sorted(set(full_lengths))
    }
    times = {("cached", k): [] for k in cached} | {("full", n): [] for n in uncached}
    # Interleaved (every size once per round) so that a busy spell of a shared machine hits all sizes;
    # round 0 is a warm-up.
    for round_index in range(repeats + 1):
        for k, (new, mask, position_ids) in cached.items():
            start = time.perf_counter()
            model(input_ids=new, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True)
            elapsed = time.perf_counter() - start
            cache.crop(-k)
            if round_index:
                times[("cached", k)].append(elapsed)
        for n, ids in uncached.items():
            start = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            if round_index:
                times[("full", n)].append(time.perf_counter() - start)
    # The fastest repeat: a forward of a few milliseconds is easily slowed by a neighbour process on
    # a shared machine, never sped up, so the minimum is the steadiest estimate of its cost.
    costs = {k: min(times[("cached", k)]) for k in cached}
    full_costs = {n: min(times[("full", n)]) for n in uncached}
    return costs, full_costs


def _interpolate(costs: dict[int, float], x: float) -> float:
    low, high = math.floor(x), math.ceil(x)
    if low == high or high not in costs:
        return costs[low if low in costs else high]
    return costs[low] + (costs[high] - costs[low]) * (x - low)


@dataclass
class BenchArguments:
    """What to benchmark. Lists restrict the grid so that a run fits a few minutes."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8], metadata={"help": "Batch sizes."})
    taus: list[float] = field(default_factory=lambda: [1.0, 0.9], metadata={"help": "MARS thresholds τ."})
    windows: list[int] = field(default_factory=lambda: [4], metadata={"help": "MARS windows W."})
    schemes: list[str] = field(default_factory=lambda: list(SCHEMES), metadata={"help": "Configurations."})
    cache_blocks: list = field(default_factory=lambda: ["W", 16, 32], metadata={"help": "Block sizes C."})
    one_token_schemes: list[str] = field(
        default_factory=lambda: ["cursor"], metadata={"help": "Schemes run at τ ≥ 1 (one-token mode)."}
    )
    acceptance: str = field(default="probability", metadata={"help": "MARS acceptance metric of the τ rows."})
    verify_layouts: list[str] = field(
        default_factory=lambda: ["auto", "linear", "quadratic"],
        metadata={
            "help": "Verified-decoding layouts to add (lossless; auto = the step planner; `[]` for none)."
        },
    )
    lookup_tokens: list[int] = field(
        default_factory=list,
        metadata={
            "help": "prompt_lookup_num_tokens values: each adds transformers' prompt lookup (stock generate, "
            "batch 1 only) and the verify rows with prompt-lookup drafts."
        },
    )
    max_new_tokens: int = field(default=64, metadata={"help": "New tokens per row (greedy)."})
    repeats: int = field(default=3, metadata={"help": "Timed repeats per configuration (median)."})
    warmup: int = field(default=1, metadata={"help": "Untimed runs per configuration first."})
    cost_repeats: int = field(default=9, metadata={"help": "Repeats of each forward of the cost model."})


def run_benchmark(
    model, tokenizer, prompts: list[str], args: BenchArguments, *, model_name: str = "", progress=True
):
    """Run the grid for every batch size; returns a JSON-able dict with ``rows`` and ``costs``."""
    configurations = build_configurations(
        args.taus,
        args.windows,
        args.schemes,
        args.cache_blocks,
        args.acceptance,
        args.one_token_schemes,
        args.verify_layouts,
        args.lookup_tokens,
    )
    if "stock" not in args.schemes:
        raise ValueError(
            "The benchmark reports ratios against stock `generate`; keep 'stock' in the schemes."
        )
    generation_config = greedy_generation_config(model, args.max_new_tokens, tokenizer=tokenizer)
    result = {
        "model": model_name,
        "environment": bench_environment(model),
        "arguments": asdict(args),
        "num_prompts": len(prompts),
        "rows": [],
        "costs": {},
    }
    counter = ForwardCounter(model)
    try:
        for batch_size in args.batch_sizes:
            batches = [
                {k: v.to(model.device) for k, v in inputs.items()}
                for inputs in prepare_batches(tokenizer, prompts, batch_size)
            ]
            if len(configurations) > 1:
                _measure_decoder_costs(model, batch_size, args.windows, args.max_new_tokens)
            # transformers' own prompt lookup (assisted decoding) serves batch size 1 only
            active = [c for c in configurations if batch_size == 1 or not (c.scheme == "stock" and c.lookup)]
            measurements = interleaved_runs(
                model,
                batches,
                generation_config,
                active,
                args,
                counter,
                progress,
                f"bench batch={batch_size}",
            )
            rows = summarise_measurements(batch_size, batches, measurements, model_name)
            result["costs"][str(batch_size)] = _add_cost_model(model, batches[0], rows, args)
            result["rows"].extend(rows)
    finally:
        counter.remove()
    return result


def interleaved_runs(
    model, batches, generation_config, configurations, args, counter, progress=True, desc="bench"
) -> dict[BenchConfiguration, list[RunMeasurement]]:
    """``args.warmup`` untimed then ``args.repeats`` timed runs of every configuration, interleaved (so
    that drift of a shared machine hits every configuration alike): the timed measurements."""
    measurements: dict[BenchConfiguration, list[RunMeasurement]] = {c: [] for c in configurations}
    bar = tqdm(total=len(configurations) * (args.warmup + args.repeats), desc=desc, disable=not progress)
    for repeat in range(args.warmup + args.repeats):
        for configuration in configurations:
            measurement = run_once(model, batches, generation_config, configuration, args.acceptance, counter)
            if repeat >= args.warmup:
                measurements[configuration].append(measurement)
            bar.update(1)
    bar.close()
    return measurements


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


def bench_environment(model) -> dict:
    """Versions, threads, dtype, device and attention of the run: what the numbers depend on."""
    parameter = next(model.parameters())
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "dtype": str(parameter.dtype).replace("torch.", ""),
        "device": str(parameter.device),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }


def _measure_decoder_costs(model, batch_size: int, windows, max_new_tokens: int) -> None:
    """Let the decoder measure its cost curves before anything is timed or counted: once per process,
    for every batch bucket a batch passes through as its rows finish (a one-time cost, not a step's)."""
    from mars_hf.decoding.cost_model import batch_bucket, cost_table
    from mars_hf.decoding.settings import resolve_mask_token

    mask_token_id = resolve_mask_token(model, None)
    for window in windows:
        for rows in sorted({batch_bucket(n) for n in range(1, batch_size + 1)} | {batch_size}):
            cost_table(
                model,
                batch_size=rows,
                window=min(int(window), max(max_new_tokens, 1)),
                mask_token_id=mask_token_id,
            )


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


def _add_cost_model(model, inputs, rows, args) -> dict:
    """Measure what the rows' forwards cost and add each row's predicted speedup (MARS_SPEC §4).

    ``step_tokens`` is the mean number of tokens a row's forwards fed after the prompt's (counted by
    the forward hook): 1 for stock, n + W for the cursor scheme, the uncommitted block plus masks
    for the block scheme, and the whole sequence, recomputed without cache, for ``none``. The
    prediction is (tokens per forward relative to stock) ÷ (cost of such a forward ÷ a 1-token one).
    """
    stock = rows[0]
    mean_generated = stock["generated_tokens"] / len(stock["generated_per_row"])
    context = round(stock["prompt_tokens"] + mean_generated / 2)
    step_sizes, full_lengths = {1}, set()
    for row in rows:
        if row["scheme"] == "none":
            full_lengths.add(round(row["step_tokens"]))
        else:
            step_sizes.update({math.floor(row["step_tokens"]), math.ceil(row["step_tokens"])})
    costs, full_costs = measure_step_costs(
        model,
        inputs,
        context_tokens=context,
        step_sizes=step_sizes,
        full_lengths=full_lengths,
        repeats=args.cost_repeats,
    )
    one = costs[1]
    for row in rows:
        if row["scheme"] == "none":
            relative_cost = full_costs[round(row["step_tokens"])] / one
        else:
            relative_cost = _interpolate(costs, row["step_tokens"]) / one
        relative_tpf = row["tokens_per_forward"] / stock["tokens_per_forward"]
        row["step_cost"] = relative_cost
        row["predicted_speedup"] = relative_tpf / relative_cost
    return {
        "context_tokens": context,
        "one_token_seconds": one,
        "cached_step_cost": {str(k): v / one for k, v in sorted(costs.items())},
        "uncached_forward_cost": {str(k): v / one for k, v in sorted(full_costs.items())},
    }


def format_table(result: dict) -> str:
    """A plain-text table of the rows (one block per batch size) and the measured step costs."""
    lines = [f"model: {result['model']}  ({_describe_environment(result)})"]
    lines += fixed_width_table(TABLE_COLUMNS, result["rows"], group=lambda row: row["batch"])
    lines.append("")
    lines.append(
        "tok/fwd = generated tokens / (batch x forwards); speedup = tokens/s vs stock generate (same run, "
        "medians; (best): from each configuration's fastest repeat); "
        "effic. = speedup / (tok/fwd relative to stock); step = tokens one forward feeds on its cache "
        "after the prompt, mean over the run (n + W for cursor; the open block + W for block; the whole "
        "sequence, uncached, for none); cost = that forward's measured time (fastest of the cost repeats) "
        "/ a 1-token cached forward; pred. = MARS_SPEC §4 cost-model speedup = relative tok/fwd / cost; "
        "=stock = share of rows whose output equals stock generate (measured, also for verify); "
        "tau v-auto / v-line / v-quad = verified decoding (mars_acceptance='verify'): the step planner, "
        "or the fixed linear / quadratic layout; +pl: with prompt-lookup drafts; plK = transformers' own "
        "prompt lookup (prompt_lookup_num_tokens=K, stock generate)."
    )
    lines += format_planner(result)
    for batch, costs in result["costs"].items():
        cached = ", ".join(f"{k}:{v:.2f}" for k, v in costs["cached_step_cost"].items())
        line = f"batch {batch}: 1-token cached forward {costs['one_token_seconds'] * 1000:.1f} ms at context "
        line += f"{costs['context_tokens']}; cached k-token forward / 1-token forward: {cached}"
        if costs["uncached_forward_cost"]:
            full = ", ".join(f"{k}:{v:.2f}" for k, v in costs["uncached_forward_cost"].items())
            line += f"; uncached L-token forward / 1-token cached: {full}"
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
        label = " ".join(column.cell(row) for column in TABLE_COLUMNS[:2] + TABLE_COLUMNS[3:4])
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


def _rule(row) -> str:
    """The acceptance column: τ, the verify layout (``v-auto``, with ``+pl`` for prompt-lookup drafts), or
    transformers' own prompt lookup (``plK``)."""
    lookup = row.get("prompt_lookup_num_tokens")
    if row.get("layout"):
        return f"v-{row['layout'][:4]}" + ("+pl" if lookup else "")
    if lookup:
        return f"pl{lookup}"
    return fmt(row["tau"], ".2f")


def _measured(key: str):
    """A column of the cost model's numbers (NaN until `_add_cost_model` has added them)."""
    return lambda row: row.get(key, float("nan"))


TABLE_COLUMNS = [
    Column("batch", 5, "batch"),
    Column("tau", 6, _rule),
    Column("W", 3, "window", "d"),
    Column("scheme", 7, "scheme", align="<"),
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
]


def _describe_environment(result):
    env = result["environment"]
    args = result["arguments"]
    return (
        f"{env['dtype']}, {env['device']}, {env['threads']} threads, attn={env['attn_implementation']}, "
        f"max_new_tokens={args['max_new_tokens']}, median of {args['repeats']}, acceptance={args['acceptance']}, "
        f"torch {env['torch']}, transformers {env['transformers']}, {env['date']}"
    )
