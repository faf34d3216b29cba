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


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mars_hf.models.embedded_model import resolve_model_path
    from mars_hf.training.data import self_distill
    from mars_hf.training.prompts import training_prompts

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    prompts = training_prompts(args.num_prompts, seed=args.seed)
    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")
    done = partial.read_text(encoding="utf-8").count("\n") if partial.exists() else 0
    start = time.monotonic()
    with partial.open("a", encoding="utf-8") as handle:
        for index in range(done, len(prompts), args.chunk):
            chunk = prompts[index : index + args.chunk]
            dataset = self_distill(
                model, tokenizer, chunk, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
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
