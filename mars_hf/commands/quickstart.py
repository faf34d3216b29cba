"""`mars-hf quickstart`: the newcomer's first command (see `mars_hf.tools.quickstart.pipeline`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from mars_hf.commands.comma_lists import floats, words
from mars_hf.tools.quickstart.config import QuickstartConfig, config_from_args

HELP = (
    "Offline MARS demo on the embedded SmolLM2-135M-Instruct: first the MARS model shipped in mars_hf "
    "(embedded-mars) at batch 1 and 4, then self-distil, train within a time budget, evaluate tokens/forward, "
    "speed and agreement at several τ, and print both models' rows in one table; then a short benchmark of the "
    "trained model on MT-Bench and HumanEval prompts, per category; saves results.json, a Pareto plot and the "
    "Hub-ready checkpoint (about 30 min on 2 CPU cores)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = QuickstartConfig()
    help_of = {field.name: field.metadata.get("help", "") for field in dataclasses.fields(QuickstartConfig)}

    def option(name, **kwargs):
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        parser.add_argument(
            flag, dest=name, default=None, help=f"{help_of[name]} (default: {default})", **kwargs
        )

    option("model_name_or_path", metavar="MODEL")
    option("output_dir")
    option("budget_minutes", type=float)
    option("distill_minutes", type=float)
    option("reference_minutes", type=float)
    option("eval_minutes", type=float)
    option("shipped_eval_minutes", type=float)
    option("bench_minutes", type=float)
    option("bench_per_category", type=int)
    option("max_steps", type=int)
    option("num_train_prompts", type=int)
    option("num_eval_prompts", type=int)
    option("max_new_tokens", type=int)
    option("block_size", type=int)
    option("learning_rate", type=float)
    option("batch_size", type=int)
    option("clean_loss", choices=["ce", "kl_to_base"])
    option("ar_weight", type=float)
    option("lora_r", type=int)
    option("distill_batch_size", type=int)
    option("seed", type=int)
    option("num_threads", type=int)
    option("cache_dir")
    option("method", choices=["gated_lora", "mask_row", "lora", "full"])
    option("lora_alpha", type=int)
    option("lora_target_modules")
    option("mask_targets", choices=["hard", "soft"])
    option("tau_window", choices=["planned", "fixed"])
    option("warmup_fraction", type=float)
    option("max_length", type=int)
    option("track_every", type=int)
    parser.add_argument(
        "--bf16",
        dest="bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast in training (default: chosen by a one-second measurement at start-up).",
    )
    parser.add_argument(
        "--bench-compile",
        dest="bench_compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{help_of['bench_compile']} (default: on)",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        default=None,
        help="Skip the verified-decoding row.",
    )
    parser.add_argument(
        "--thresholds",
        type=floats,
        default=None,
        help=f"Comma-separated τ values (default: {','.join(f'{t:g}' for t in defaults.thresholds)}).",
    )
    parser.add_argument(
        "--shipped-thresholds",
        dest="shipped_thresholds",
        type=floats,
        default=None,
        help="Comma-separated τ values for the shipped model "
        f"(default: {','.join(f'{t:g}' for t in defaults.shipped_thresholds)}).",
    )
    parser.add_argument(
        "--shipped-dtype",
        dest="shipped_dtype",
        choices=["float32", "bfloat16", "float64"],
        default=None,
        help=help_of["shipped_dtype"],
    )
    parser.add_argument(
        "--skip-shipped",
        dest="skip_shipped",
        action="store_true",
        default=None,
        help="Do not evaluate the shipped MARS model (embedded-mars) first.",
    )
    parser.add_argument(
        "--bench-datasets",
        dest="bench_datasets",
        type=words,
        default=None,
        help=f"{help_of['bench_datasets']} Comma-separated (default: {','.join(defaults.bench_datasets)}).",
    )
    parser.add_argument(
        "--skip-bench",
        dest="skip_bench",
        action="store_true",
        default=None,
        help=help_of["skip_bench"],
    )
    parser.add_argument("--no-save", dest="save_checkpoint", action="store_false", default=None)
    parser.add_argument(
        "--quiet", dest="progress", action="store_false", default=None, help="No progress bars."
    )


def run(args: argparse.Namespace) -> int:
    from mars_hf.tools.quickstart.pipeline import run_quickstart, summary

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "datasets", "trl", "peft", "accelerate", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    results = run_quickstart(config_from_args(args))
    print(summary(results))
    return 0
