"""``mars-hf distill``: the model's own greedy answers to the project's training prompts, as a JSONL file.

Why a command: the shipped MARS model is trained by ``mars-hf train`` from a committed recipe, and its
data must be rebuilt by anyone with the same two commands. The prompts come from the project's
templates (``mars_hf.training.prompts``), training split only, so no evaluation prompt can ever be trained on.
The file is written in chunks with a ``.partial`` suffix until complete; a rerun resumes from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

HELP = "Self-distil the project's training prompts with a model's own greedy answers into a JSONL dataset."
PROMPT_SOURCES = ("templates", "stdlib", "mixed")
COLUMNS = ("messages", "input_ids", "labels", "completion_mask", "ends_with_eos")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="embedded", help="Model folder or Hub id (default: embedded SmolLM2)."
    )
    parser.add_argument("--out", required=True, help="JSONL file to write (TRL-ready, already tokenized).")
    parser.add_argument("--num-prompts", type=int, default=1024, help="Training-split prompts to answer.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompt draw.")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="Answer length limit.")
    parser.add_argument("--batch-size", type=int, default=32, help="Prompts per generate call.")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="Distillation dtype (float32 answers are the base model's exact greedy output).",
    )
    parser.add_argument("--chunk", type=int, default=256, help="Prompts answered between two file flushes.")
    parser.add_argument(
        "--device", default=None, help="Device to generate on (default: cuda if available, else cpu)."
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy answers. > 0: sampled answers (varied training contexts; see self_distill).",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling with --temperature > 0.")
    parser.add_argument(
        "--samples-per-prompt",
        type=int,
        default=1,
        help="Answers per prompt (sampled ones differ; written round by round, every prompt once per round).",
    )
    parser.add_argument(
        "--prompt-source",
        default="templates",
        choices=PROMPT_SOURCES,
        help="Where the prompts come from: 'templates' (the project's template prompts, training split), "
        "'stdlib' (code and text requests built from the Python standard library's documented functions: "
        "real-world text, mars_hf.training.source_prompts) or 'mixed' (the two in turn).",
    )
    parser.add_argument(
        "--exclude-prompts-from",
        nargs="*",
        default=[],
        help="JSONL files written by this command whose prompts are skipped (rows kept apart for curves or "
        "calibration stay unseen).",
    )


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mars_hf.models.embedded_model import resolve_model_path
    from mars_hf.training.data import self_distill

    if args.samples_per_prompt < 1:
        raise ValueError(f"--samples-per-prompt must be >= 1, got {args.samples_per_prompt}.")
    if args.samples_per_prompt > 1 and not args.temperature:
        raise ValueError("--samples-per-prompt > 1 needs --temperature > 0 (greedy answers would repeat).")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(device)
    torch.manual_seed(args.seed)
    excluded = excluded_prompts(args.exclude_prompts_from)
    drawn = [
        prompt
        for prompt in draw_prompts(args.prompt_source, args.num_prompts, args.seed)
        if prompt not in excluded
    ]
    if len(drawn) < args.num_prompts:
        logger.warning(
            "distill: %d drawn prompts skipped (--exclude-prompts-from).", args.num_prompts - len(drawn)
        )
    prompts = drawn * args.samples_per_prompt
    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")
    done = partial.read_text(encoding="utf-8").count("\n") if partial.exists() else 0
    start = time.monotonic()
    with partial.open("a", encoding="utf-8") as handle:
        for index in range(done, len(prompts), args.chunk):
            chunk = prompts[index : index + args.chunk]
            dataset = self_distill(
                model,
                tokenizer,
                chunk,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
                temperature=args.temperature,
                top_p=args.top_p,
            )
            for row in dataset:
                handle.write(json.dumps({name: row[name] for name in COLUMNS}) + "\n")
            handle.flush()
            logger.warning(
                "distill: %d/%d prompts (%.1f min)",
                index + len(chunk),
                len(prompts),
                (time.monotonic() - start) / 60,
            )
    partial.replace(out)
    print(f"Wrote {len(prompts)} self-distilled answers to {out}.")
    return 0


def draw_prompts(source: str, num_prompts: int, seed: int) -> list[str]:
    """``num_prompts`` prompts of ``source`` (``PROMPT_SOURCES``), none holding a benchmark's prompt."""
    from mars_hf.tools.bench.eval_sets import without_evaluation_prompts
    from mars_hf.training.prompts import training_prompts
    from mars_hf.training.source_prompts import source_prompts

    if source == "templates":
        prompts = training_prompts(num_prompts, seed=seed)
    elif source == "stdlib":
        prompts = source_prompts(num_prompts, seed=seed)
    else:
        halves = zip(
            training_prompts(num_prompts - num_prompts // 2, seed=seed),
            source_prompts(num_prompts, seed=seed),
        )
        prompts = [prompt for pair in halves for prompt in pair][:num_prompts]
    return without_evaluation_prompts(prompts, "distill prompts")


def excluded_prompts(files) -> set[str]:
    """The user prompts of JSONL files this command wrote (their ``messages`` column)."""
    prompts = set()
    for name in files:
        for line in Path(name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                prompts.update(m["content"] for m in json.loads(line)["messages"] if m["role"] == "user")
    return prompts
