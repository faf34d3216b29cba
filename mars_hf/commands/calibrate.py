"""`mars-hf calibrate CHECKPOINT --data FILE.jsonl`: fit the confidence calibration τ is compared with."""

from __future__ import annotations

import argparse
import json
import logging

logger = logging.getLogger(__name__)

HELP = (
    "Fit a checkpoint's confidence calibration on held-out self-distilled answers (so that τ = 0.9 means "
    "'90 % likely to be the model's own token') and store it in config.mars."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="A saved MARS checkpoint folder (full model or adapter), or 'embedded-mars'."
    )
    parser.add_argument(
        "--data",
        required=True,
        help="JSONL of answers the model never trained on, in a training format: the model's own greedy "
        "answers (`mars-hf distill`) as 'messages', 'prompt'/'completion' or 'input_ids'/'labels'.",
    )
    parser.add_argument("--num-examples", type=int, default=None, help="Use only the first N rows.")
    parser.add_argument(
        "--unconditional",
        action="store_true",
        help="Fit each mask on every position, not only where the masks before it in the step were right.",
    )
    parser.add_argument("--bins", type=int, default=64, help="Quantile bins before the isotonic fit.")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="Precision of the fitting forwards (float32: the confidences float32 decoding sees).",
    )
    parser.add_argument("--dry-run", action="store_true", help="Print the fit; do not write it.")


def run(args) -> int:
    import torch

    from mars_hf.models.embedded_model import resolve_model_path
    from mars_hf.models.modeling import load_mars_model, require_tokenizer
    from mars_hf.training.calibration_fit import (
        calibrate,
        examples_from_records,
        read_jsonl,
        write_calibration,
    )

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "peft", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    folder = resolve_model_path(args.checkpoint)
    model, tokenizer = load_mars_model(folder, dtype=getattr(torch, args.dtype))
    tokenizer = require_tokenizer(tokenizer, folder, "calibration (it tokenizes the examples)")
    model.config._attn_implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    records = read_jsonl(args.data, limit=args.num_examples)
    if not records:
        raise SystemExit(f"{args.data} holds no examples.")
    sequences, labels = examples_from_records(tokenizer, records)
    record = calibrate(model, sequences, labels, conditional=not args.unconditional, bins=args.bins)
    record["data"] = str(args.data)
    summary = {k: record[k] for k in ("num_examples", "num_samples", "accuracy", "reliability")}
    print(json.dumps(summary, indent=1))
    if args.dry_run:
        return 0
    target = write_calibration(folder, record)
    print(f"calibration written to {target}")
    return 0
