"""Running the grid: every batch size, every configuration interleaved, then rows and step costs."""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, field, replace

import torch
import transformers

from mars_hf.decoding.cost_model import batch_bucket, cost_table
from mars_hf.decoding.cpu_kernels import packed_linears, use_packed
from mars_hf.decoding.home import cpu_name, speed_cpu_flags
from mars_hf.decoding.memory import PlannerMemory
from mars_hf.decoding.settings import resolve_mask_token
from mars_hf.tools.bench.categories import categorised_batches, summarise_categories
from mars_hf.tools.bench.configurations import (
    DEFAULT_TAU_WINDOW,
    SCHEMES,
    BenchConfiguration,
    build_configurations,
    one_cache_length,
)
from mars_hf.tools.bench.denominators import add_denominators, label_rows
from mars_hf.tools.bench.divergences import add_divergences
from mars_hf.tools.bench.measure import (
    ForwardCounter,
    UntrainedDecoder,
    greedy_generation_config,
    interleaved_runs,
)
from mars_hf.tools.bench.step_costs import add_cost_model
from mars_hf.tools.bench.summary import summarise_measurements


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
    cost_repeats: int = field(
        default=9,
        metadata={
            "help": "Repeats of each forward of the cost model (0: no cost model, no predicted speed-ups)."
        },
    )
    cpu_kernels: list[str] = field(
        default_factory=lambda: ["auto"],
        metadata={"help": "mars_cpu_kernels modes: every MARS row runs once per mode (auto, packed, stock)."},
    )
    compiled: bool = field(
        default=False,
        metadata={
            "help": "Run every MARS row on transformers' fast path (static cache + compiled forward), and stock "
            "generate there too (its MARS-off), besides stock generate eager."
        },
    )
    max_cache_len: int | None = field(
        default=None,
        metadata={
            "help": "compiled: one static cache size for every call (default: the longest prompt's, see "
            "configurations.one_cache_length), so that no prompt compiles its graphs again during the timing."
        },
    )
    untrained_masks: bool = field(
        default=False,
        metadata={
            "help": "Run every planner verify row (layout auto, no lookup) again on an untrained-mask model "
            "(run_benchmark's untrained_model): the masks' own value."
        },
    )
    tau_window: str = field(
        default=DEFAULT_TAU_WINDOW,
        metadata={
            "help": "How τ rows feed masks: 'planned' (the step planner sizes each step's mask group from what "
            "τ keeps, mars_planner=True: masks that do not pay are not fed, so τ accepts other tokens) or "
            "'fixed' (the paper's window at every step, generate's default)."
        },
    )


def run_benchmark(
    model,
    tokenizer,
    prompts: list[str],
    args: BenchArguments,
    *,
    model_name: str = "",
    progress=True,
    divergence_reference=None,
    categories: list[str] | None = None,
    untrained_model=None,
):
    """Run the grid for every batch size; returns a JSON-able dict with ``rows`` and ``costs`` (and
    ``categories``: per category rows, where ``categories`` gives each prompt's).

    ``divergence_reference``: a function returning the model that measures the logit gap where a lossless
    row differs from stock greedy (`mars-hf bench` passes a float32 copy's loader for a bfloat16 model);
    default: the benchmarked model itself. ``untrained_model``: the base model with an untrained mask row
    (`mars_hf.tools.bench.untrained`) that ``args.untrained_masks`` rows run on.
    """
    configurations = build_configurations(
        args.taus,
        args.windows,
        args.schemes,
        args.cache_blocks,
        args.acceptance,
        args.one_token_schemes,
        args.verify_layouts,
        args.lookup_tokens,
        args.cpu_kernels,
        untrained_masks=args.untrained_masks,
        compiled=args.compiled,
        tau_window=args.tau_window,
    )
    if "stock" not in args.schemes:
        raise ValueError(
            "The benchmark reports ratios against stock `generate`; keep 'stock' in the schemes."
        )
    if args.untrained_masks and untrained_model is None:
        raise ValueError(
            "untrained_masks=True needs untrained_model= (the base model with an untrained mask row: "
            "mars_hf.tools.bench.untrained.with_untrained_mask), or set untrained_masks=False."
        )
    if args.compiled:
        room_for_compiled_shapes()
    # Where some MARS row runs on packed kernels, stock `generate` runs on them too: that row's MARS-off.
    kernels = {mode: "packed" if use_packed(model, mode) else "stock" for mode in args.cpu_kernels}
    if "packed" in kernels.values():
        configurations.insert(1, BenchConfiguration("stock", cpu_kernels="packed"))
    untrained = None
    if args.untrained_masks:
        untrained = UntrainedDecoder(untrained_model, ForwardCounter(untrained_model), kernels)
    generation_config = greedy_generation_config(model, args.max_new_tokens, tokenizer=tokenizer)
    result = {
        "model": model_name,
        "environment": bench_environment(model),
        "arguments": asdict(args),
        "num_prompts": len(prompts),
        "rows": [],
        "costs": {},
    }
    if categories is not None:
        result["categories"] = {}
    counter = ForwardCounter(model)
    # eager MARS rows plan on the step costs measured here, one memory per model for the whole run, measured
    # before anything is timed
    memories = {"trained": PlannerMemory(), "untrained": PlannerMemory()}
    try:
        for batch_size in args.batch_sizes:
            batches, batch_categories = categorised_batches(tokenizer, prompts, categories, batch_size)
            batches = [{k: v.to(model.device) for k, v in inputs.items()} for inputs in batches]
            sized = args
            if args.compiled:  # one cache shape for every prompt: the warm-up run compiles every graph once
                sized = replace(
                    args, max_cache_len=args.max_cache_len or one_cache_length(batches, args.max_new_tokens)
                )
            if len(configurations) > 1:
                _measure_decoder_costs(
                    model, memories["trained"], batch_size, args.windows, args.max_new_tokens, args.cpu_kernels
                )
                if untrained is not None:
                    modes = sorted(set(kernels.values()))
                    _measure_decoder_costs(
                        untrained.model, memories["untrained"], batch_size, args.windows, args.max_new_tokens, modes
                    )
            # transformers' own prompt lookup (assisted decoding) serves batch size 1 only
            active = [c for c in configurations if batch_size == 1 or not (c.scheme == "stock" and c.lookup)]
            measurements = interleaved_runs(
                model,
                batches,
                generation_config,
                active,
                sized,
                counter,
                progress,
                f"bench batch={batch_size}",
                untrained=untrained,
                memories=memories,
            )
            rows = summarise_measurements(batch_size, batches, measurements, model_name)
            label_rows(model, rows, args.acceptance)
            add_divergences(rows, measurements, batches, divergence_reference or (lambda: model))
            if args.cost_repeats > 0:
                trained = [row for row in rows if row["masks"] == "trained"]
                result["costs"][str(batch_size)] = add_cost_model(model, batches[0], trained, args)
            add_denominators(rows)
            result["rows"].extend(rows)
            if categories is not None:
                result["categories"][str(batch_size)] = summarise_categories(
                    batch_size, batch_categories, measurements, rows
                )
    finally:
        counter.remove()
        if untrained is not None:
            untrained.counter.remove()
    return result


def room_for_compiled_shapes(graphs: int = 64) -> None:
    """Let one process keep a graph per compiled shape of the model's call (each step width, batch size, stock's
    own and the untrained-mask model's): past dynamo's default of 8 per function it would run the rest eager,
    silently; it fails loudly instead (`fail_on_recompile_limit_hit`), so no row is timed eager by mistake."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def bench_environment(model) -> dict:
    """Versions, threads, dtype, device and attention of the run: what the numbers depend on."""
    parameter = next(model.parameters())
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_flags": speed_cpu_flags(),
        "dtype": str(parameter.dtype).replace("torch.", ""),
        "device": str(parameter.device),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        # what mars_cpu_kernels="auto" runs the steps' multi-row linears on, here (cpu_kernels.py)
        "cpu_kernels_auto": "packed" if use_packed(model, "auto") else "stock",
    }


def _measure_decoder_costs(
    model, memory, batch_size: int, windows, max_new_tokens: int, kernel_modes=("auto",)
) -> None:
    """Measure the planner's cost curves into ``memory`` before anything is timed or counted: once per run,
    for every batch bucket a batch passes through as its rows finish and every kernel mode (a one-time
    cost, not a step's)."""
    mask_token_id = resolve_mask_token(model, None)
    for mode in kernel_modes:
        with packed_linears(model, mode):
            for window in windows:
                for rows in sorted({batch_bucket(n) for n in range(1, batch_size + 1)} | {batch_size}):
                    cost_table(
                        model,
                        batch_size=rows,
                        window=min(int(window), max(max_new_tokens, 1)),
                        mask_token_id=mask_token_id,
                        memory=memory,
                    )
