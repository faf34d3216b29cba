"""`mars-hf eval`: scores and tokens per forward of a MARS checkpoint over a τ list.

Two modes:

* `--tasks a,b` runs lm-evaluation-harness tasks (`mars_hf/evaluation/lm_eval_harness.py`, model `mars-hf`):
  stock decoding, MARS at each τ (and `--verify`), one row per task and run with lm-eval's scores and
  tokens per forward. `humaneval_mars` ships offline; other tasks need their data (docs/lm_eval.md).
* otherwise, the built-in loop: HumanEval pass@1 and held-out chat prompts, greedy, max 256 new
  tokens, batch 1 (as in the paper's tables), against stock `generate` on the same weights; with
  `--base-model`, also token agreement with that model's greedy output.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from mars_hf.commands.comma_lists import floats, words
from mars_hf.commands.generate import add_dtype_argument
from mars_hf.tools.loading import resolve_dtype

HELP = "Evaluate a MARS checkpoint: HumanEval pass@1, tokens/forward and speed over τ, agreement with a base model."


def run_tasks(args: argparse.Namespace) -> int:
    """`--tasks`: lm-eval runs through the registered `mars-hf` model."""
    from lm_eval.utils import simple_parse_args_string

    from mars_hf.evaluation.lm_eval_harness import evaluate_tasks, format_rows

    gen_kwargs = simple_parse_args_string(args.gen_kwargs) if args.gen_kwargs else {}
    if args.max_new_tokens is not None:
        gen_kwargs["max_gen_toks"] = args.max_new_tokens
    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    rows = evaluate_tasks(
        args.model,
        args.tasks,
        args.thresholds,
        stock=not args.no_stock,
        verify=args.verify,
        limit=limit,
        batch_size=args.batch_size,
        num_fewshot=args.num_fewshot,
        gen_kwargs=gen_kwargs or None,
        include_path=args.include_path,
        confirm_run_unsafe_code=args.confirm_run_unsafe_code,
        apply_chat_template=args.apply_chat_template,
        device=args.device,
        mars_block_size=args.window,
        dtype=str(resolve_dtype(args.model, args.dtype)).replace("torch.", ""),
    )
    print(f"\nlm-eval tasks ({args.model}; tokens/forward counts every model call, the prompt's included)")
    print(format_rows(rows))
    if args.output:
        Path(args.output).write_text(
            json.dumps({"model": args.model, "tasks": args.tasks, "rows": rows}, indent=2)
        )
        print(f"\nresults: {args.output}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="MARS checkpoint: a folder (full model or LoRA adapter), a cached Hub id, or 'embedded-mars' "
        "(the MARS model shipped with mars-hf).",
    )
    add_dtype_argument(parser)
    parser.add_argument(
        "--base-model",
        default=None,
        help="Model whose greedy output is the agreement reference ('embedded' = the embedded SmolLM2).",
    )
    parser.add_argument("--thresholds", type=floats, default=[1.0, 0.95, 0.9, 0.8, 0.7], help="τ values.")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="Per completion (default 256, the paper's; with --tasks: the task's own max_gen_toks).",
    )
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
    lm = parser.add_argument_group("lm-evaluation-harness (with --tasks)")
    lm.add_argument(
        "--tasks",
        type=words,
        default=None,
        help="lm-eval task names, comma-separated (e.g. humaneval_mars).",
    )
    lm.add_argument("--limit", type=float, default=None, help="Documents per task (N, or a fraction < 1).")
    lm.add_argument("--batch-size", type=int, default=1, help="lm-eval batch size (left-padded batches).")
    lm.add_argument(
        "--num-fewshot", type=int, default=None, help="Few-shot examples (task default otherwise)."
    )
    lm.add_argument(
        "--gen-kwargs",
        default=None,
        help="Extra generation kwargs, lm-eval syntax: 'max_gen_toks=128,top_k=1'.",
    )
    lm.add_argument("--include-path", default=None, help="Folder of extra task YAML files.")
    lm.add_argument("--no-stock", action="store_true", help="Skip the stock-decoding run.")
    lm.add_argument("--verify", action="store_true", help="Add a run with verified (lossless) MARS decoding.")
    lm.add_argument(
        "--apply-chat-template", action="store_true", help="Format prompts with the chat template."
    )
    lm.add_argument(
        "--confirm-run-unsafe-code",
        action="store_true",
        help="Needed by tasks that run generated code (humaneval_mars), as in lm-eval.",
    )
    lm.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available).")


def run(args: argparse.Namespace) -> int:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "datasets", "peft", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.tasks:
        if args.held_out or args.base_model:
            raise SystemExit("--held-out / --base-model belong to the built-in loop; drop them with --tasks.")
        return run_tasks(args)
    return run_builtin(args)


def run_builtin(args: argparse.Namespace) -> int:
    """The built-in loop: HumanEval and/or held-out prompts, stock vs MARS at each τ; optional JSON output."""
    if args.max_new_tokens is None:
        args.max_new_tokens = 256
    if args.no_humaneval and not args.held_out:
        raise SystemExit("Nothing to evaluate: drop --no-humaneval or pass --held-out N.")
    model, tokenizer, base = _load_models(args)
    thresholds = [None, *args.thresholds]
    mars_kwargs = {"mars_block_size": args.window} if args.window else None
    results: dict = {
        "model": args.model,
        "base_model": args.base_model,
        "max_new_tokens": args.max_new_tokens,
    }
    if not args.no_humaneval:
        results["humaneval"] = _humaneval_rows(args, model, tokenizer, base, thresholds, mars_kwargs)
    if args.held_out:
        results["held_out"] = _held_out_rows(args, model, tokenizer, base, thresholds, mars_kwargs)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
        print(f"\nresults: {args.output}")
    return 0


def _load_models(args: argparse.Namespace):
    """``(model, tokenizer, base)``: the MARS checkpoint (mask token suppressed) and, with ``--base-model``,
    the agreement reference, both in the precision ``--dtype`` resolves to for the checkpoint."""
    from transformers import AutoModelForCausalLM

    from mars_hf.models.embedded_model import resolve_model_path
    from mars_hf.models.mask_token import suppress_mask_token
    from mars_hf.models.modeling import load_mars_model, require_tokenizer

    dtype = resolve_dtype(args.model, args.dtype)
    model, tokenizer = load_mars_model(args.model, merge_adapter="auto", dtype=dtype)
    tokenizer = require_tokenizer(tokenizer, args.model, "evaluation (it tokenizes the prompts)")
    model.eval()
    suppress_mask_token(model)
    base = None
    if args.base_model:
        base = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.base_model), dtype=dtype).eval()
    return model, tokenizer, base


def _humaneval_rows(args, model, tokenizer, base, thresholds, mars_kwargs) -> list[dict]:
    from mars_hf.evaluation.runs import evaluate_humaneval, format_table

    rows = evaluate_humaneval(
        model,
        tokenizer,
        thresholds,
        limit=args.humaneval_limit,
        max_new_tokens=args.max_new_tokens,
        timeout=args.timeout,
        reference_model=base,
        mars_kwargs=mars_kwargs,
        progress=not args.quiet,
    )
    print(f"\nHumanEval ({rows[-1]['num_problems']} problems, greedy, max {args.max_new_tokens} new tokens)")
    print(format_table(rows, _columns(extra=[("pass@1", "pass@1", "{:.1%}")])))
    return rows


def _held_out_rows(args, model, tokenizer, base, thresholds, mars_kwargs) -> dict:
    from mars_hf.evaluation.runs import format_table, measure_decoding, run_label, summarize_runs
    from mars_hf.training.data import chat_prompt_ids
    from mars_hf.training.prompts import held_out_prompts

    prompts = held_out_prompts(args.held_out, seed=args.held_out_seed)
    prompt_ids = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
    common = dict(max_new_tokens=args.max_new_tokens, progress=not args.quiet)
    references = None
    if base is not None:
        references = measure_decoding(
            base, tokenizer, prompt_ids, [None], desc="Held-out prompts (base model)", **common
        )[run_label(None)].outputs
    runs = measure_decoding(
        model, tokenizer, prompt_ids, thresholds, mars_kwargs=mars_kwargs, desc="Held-out prompts", **common
    )
    rows = summarize_runs(runs, references=references)
    print(f"\nHeld-out template prompts ({len(prompts)}, greedy, max {args.max_new_tokens} new tokens)")
    print(format_table(rows, _columns()))
    return {"prompts": prompts, "rows": rows}


def _columns(extra=()):
    return [
        ("label", "decoding", "{}"),
        ("tokens_per_forward", "tokens/forward", "{:.2f}"),
        *extra,
        ("agreement", "agreement", "{:.1%}"),
        ("seconds", "seconds", "{:.1f}"),
        ("speedup_vs_stock", "vs stock", "{:.2f}x"),
    ]
