"""`mars-hf gpu-check`: MARS decoding and training on random weights of real shapes, in one budgeted run."""

from __future__ import annotations

import argparse
import json
import logging

from mars_hf.commands.comma_lists import floats, ints, words

HELP = (
    "Prepared GPU check: stock generate vs MARS (cursor/block/none/verify) on random Qwen2.5-shaped models with "
    "forced acceptance, bf16 exactness, flex vs sdpa training; stops itself within --budget-seconds."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="JSON file to write (rewritten after every item).")
    parser.add_argument(
        "--budget-seconds",
        type=float,
        required=True,
        help="Hard wall-clock limit of the whole run, model builds included; what does not fit is skipped.",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="Tiny shapes on the CPU (same items and JSON; what the tests run).",
    )
    parser.add_argument("--models", type=words, default=None, help="Model shapes, in priority order.")
    parser.add_argument("--batch-sizes", type=ints, default=None, help="Comma-separated batch sizes.")
    parser.add_argument("--rates", type=floats, default=None, help="Forced mask agreement rates.")
    parser.add_argument("--window", type=int, default=None, help="MARS window W.")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--prompt-length", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="Timed repeats per configuration (median).")
    parser.add_argument("--train-models", type=int, default=None, help="Train-check the first N shapes.")
    parser.add_argument(
        "--parts", type=words, default=None, help="Subset of decode,exactness,training (default: all)."
    )
    parser.add_argument("--device", default=None, help="Default: cuda if available, else cpu.")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU).")


_OVERRIDES = {
    "models": "models",
    "batch_sizes": "batch_sizes",
    "rates": "rates",
    "window": "window",
    "max_new_tokens": "max_new_tokens",
    "prompt_length": "prompt_length",
    "repeats": "repeats",
    "train_models": "train_models",
    "device": "device",
    "parts": "parts",
}


def run(args) -> int:
    import time

    start = time.monotonic()  # the budget counts from here: heavy imports included
    import torch

    from mars_hf.tools.gpu_check import GPUCheckArguments, format_table, run_gpu_check, tiny_arguments

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mars_hf.tools.gpu_check").setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {
        field: getattr(args, name) for name, field in _OVERRIDES.items() if getattr(args, name) is not None
    }
    check_args = tiny_arguments(**overrides) if args.tiny else GPUCheckArguments(**overrides)
    if not args.tiny and (check_args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
        logging.getLogger(__name__).warning(
            "No GPU: the full-size plan on the CPU will mostly be skipped by the budget; use --tiny for a CPU run."
        )
    result = run_gpu_check(check_args, args.budget_seconds, out=args.out, start=start)
    print(format_table(result))
    print(f"JSON written to {args.out} ({len(json.dumps(result))} characters)")
    return 0
