"""`mars-hf bench`: stock `generate` against MARS decoding, side by side, with the §4 cost model."""

from __future__ import annotations

import argparse
import functools
import json
import logging

from mars_hf.commands.comma_lists import floats, ints, words
from mars_hf.commands.generate import add_dtype_argument

HELP = "Benchmark stock generate against MARS decoding (none/cursor/block caches) in one process."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="Model folder (default: the embedded SmolLM2-135M-Instruct, given an untrained mask token if it "
        "has no config.mars); 'synthetic' is the tiny model trained on mars_hf.tools.synthetic's counting language.",
    )
    parser.add_argument(
        "--batch-sizes", type=ints, default=[1, 4, 8], help="Comma-separated (default 1,4,8)."
    )
    parser.add_argument(
        "--taus", type=floats, default=[1.0, 0.9], help="MARS thresholds τ (default 1.0,0.9)."
    )
    parser.add_argument("--windows", type=ints, default=[4], help="MARS windows W (default 4).")
    parser.add_argument(
        "--schemes",
        type=words,
        default=["stock", "none", "cursor", "block"],
        help="Subset of stock,none,cursor,block.",
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
        default=["auto", "linear", "quadratic"],
        help="Verified-decoding rows to add (lossless, cursor scheme): subset of auto,linear,quadratic (auto = "
        "the step planner on the measured cost curve); 'none' for none.",
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
        "--prompt-lookup",
        type=ints,
        default=[],
        help="prompt_lookup_num_tokens values (e.g. 10): each adds transformers' own prompt lookup (stock "
        "generate, batch 1 only) and every verify row again with prompt-lookup drafts (default: none).",
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
    parser.add_argument("--cost-repeats", type=int, default=9, help="Repeats of each cost-model forward.")
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


def run(args) -> int:
    import torch

    from mars_hf.tools.bench import (
        BUILTIN_PROMPTS,
        BenchArguments,
        format_table,
        grounded_prompts,
        load_prompts,
        run_benchmark,
    )
    from mars_hf.tools.loading import load_model_and_tokenizer

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mars_hf.models.precision").setLevel(logging.INFO)  # say which dtype --dtype auto chose
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, trained = load_model_and_tokenizer(
        args.model, block_size=args.block_size, dtype=args.dtype
    )
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
    )
    table = format_table(result)
    print(table)
    print("JSON: " + json.dumps(result))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(table + "\n\n" + json.dumps(result, indent=1) + "\n")
    return 0


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
