"""`mars-hf eval`: HumanEval pass@1 and tokens per forward of a MARS checkpoint over a τ list.

Greedy, max 256 new tokens, batch 1 (as in the paper's tables), against stock `generate` on the same
weights; with `--base-model`, also token agreement with that model's greedy output. `--held-out N`
adds the quickstart's held-out chat prompts (never used for training) to the evaluation.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

HELP = "Evaluate a MARS checkpoint: HumanEval pass@1, tokens/forward and speed over τ, agreement with a base model."


def _float_list(text: str) -> list[float]:
    return [float(value) for value in text.split(",") if value.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="MARS checkpoint: a folder (full model or LoRA adapter) or a cached Hub id."
    )
    parser.add_argument(
        "--base-model",
        default=None,
        help="Model whose greedy output is the agreement reference ('embedded' = the embedded SmolLM2).",
    )
    parser.add_argument(
        "--thresholds", type=_float_list, default=[1.0, 0.95, 0.9, 0.8, 0.7], help="τ values."
    )
    parser.add_argument("--max-new-tokens", type=int, default=256, help="Per completion (paper: 256).")
    parser.add_argument(
        "--humaneval-limit",
        type=int,
        default=None,
        help="Only the first N HumanEval problems (all 164 by default: ~1 h per τ on 2 CPU cores).",
    )
    parser.add_argument("--no-humaneval", action="store_true", help="Skip HumanEval.")
    parser.add_argument("--held-out", type=int, default=0, help="Also evaluate N held-out template prompts.")
    parser.add_argument("--held-out-seed", type=int, default=1, help="Seed of the held-out prompt draw.")
    parser.add_argument("--timeout", type=float, default=10.0, help="Seconds per HumanEval program.")
    parser.add_argument(
        "--window", type=int, default=None, help="MARS window W (default: config.mars block_size)."
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads.")
    parser.add_argument("--output", default=None, help="Write the results as JSON here.")
    parser.add_argument("--quiet", action="store_true", help="No progress bars.")


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from mars_hf.data import chat_prompt_ids
    from mars_hf.embedded_model import resolve_model_path
    from mars_hf.evaluation import (
        evaluate_humaneval,
        format_table,
        measure_decoding,
        run_label,
        summarize_runs,
    )
    from mars_hf.mask_token import suppress_mask_token
    from mars_hf.modeling import load_mars_model
    from mars_hf.prompts import held_out_prompts

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "datasets", "peft", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.no_humaneval and not args.held_out:
        raise SystemExit("Nothing to evaluate: drop --no-humaneval or pass --held-out N.")
    model, tokenizer = load_mars_model(args.model, merge_adapter=True, dtype=torch.float32)
    model.eval()
    suppress_mask_token(model)
    base = None
    if args.base_model:
        base_path = resolve_model_path(args.base_model)
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    thresholds = [None, *args.thresholds]
    mars_kwargs = {"mars_block_size": args.window} if args.window else None
    progress = not args.quiet
    results: dict = {
        "model": args.model,
        "base_model": args.base_model,
        "max_new_tokens": args.max_new_tokens,
    }

    if not args.no_humaneval:
        rows = evaluate_humaneval(
            model,
            tokenizer,
            thresholds,
            limit=args.humaneval_limit,
            max_new_tokens=args.max_new_tokens,
            timeout=args.timeout,
            reference_model=base,
            mars_kwargs=mars_kwargs,
            progress=progress,
        )
        results["humaneval"] = rows
        print(
            f"\nHumanEval ({rows[-1]['num_problems']} problems, greedy, max {args.max_new_tokens} new tokens)"
        )
        print(format_table(rows, _columns(extra=[("pass@1", "pass@1", "{:.1%}")])))

    if args.held_out:
        prompts = held_out_prompts(args.held_out, seed=args.held_out_seed)
        prompt_ids = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
        references = None
        if base is not None:
            references = measure_decoding(
                base,
                tokenizer,
                prompt_ids,
                [None],
                max_new_tokens=args.max_new_tokens,
                progress=progress,
                desc="Held-out prompts (base model)",
            )[run_label(None)].outputs
        runs = measure_decoding(
            model,
            tokenizer,
            prompt_ids,
            thresholds,
            max_new_tokens=args.max_new_tokens,
            mars_kwargs=mars_kwargs,
            progress=progress,
            desc="Held-out prompts",
        )
        rows = summarize_runs(runs, references=references)
        results["held_out"] = {"prompts": prompts, "rows": rows}
        print(f"\nHeld-out template prompts ({len(prompts)}, greedy, max {args.max_new_tokens} new tokens)")
        print(format_table(rows, _columns()))

    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
        print(f"\nresults: {args.output}")
    return 0


def _columns(extra=()):
    return [
        ("label", "decoding", "{}"),
        ("tokens_per_forward", "tokens/forward", "{:.2f}"),
        *extra,
        ("agreement", "agreement", "{:.1%}"),
        ("seconds", "seconds", "{:.1f}"),
        ("speedup_vs_stock", "vs stock", "{:.2f}x"),
    ]
