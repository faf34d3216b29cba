"""``mars-hf export``: turn a MARS checkpoint into a folder another serving engine loads (vLLM drafter)."""

from __future__ import annotations

import argparse
import shlex
import sys

HELP = "Export a MARS checkpoint for another engine: `--for vllm` writes a parallel drafter (docs/serving_at_scale.md)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="MARS checkpoint folder or Hub id (full model or LoRA adapter).")
    parser.add_argument(
        "--for",
        dest="engine",
        required=True,
        choices=["vllm"],
        help="The engine: `vllm` (speculative_config method draft_model with parallel_drafting).",
    )
    parser.add_argument("--out", required=True, help="New or empty folder to write.")
    parser.add_argument(
        "--target",
        default=None,
        help="Folder or Hub id of the target model the drafter will serve; its vocabulary must match. "
        "Default: an adapter's base model, else the vocabulary size the checkpoint recorded.",
    )
    parser.add_argument(
        "--drafter-only-merge",
        action="store_true",
        help="Merge a mask-gated LoRA into the weights for every position (refused otherwise: it cannot be "
        "merged exactly; the drafter's drafts then differ from the gated model's).",
    )
    parser.add_argument(
        "--base-model", default=None, help="Base model of a LoRA adapter (default: the adapter config's)."
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="Only for checkpoints that do not record it."
    )


def run(args: argparse.Namespace) -> int:
    from mars_hf.hub.export import ExportRefusedError, export_for_vllm
    from mars_hf.models.mask_token import get_mars_config

    try:
        out = export_for_vllm(
            args.checkpoint,
            args.out,
            target=args.target,
            drafter_only_merge=args.drafter_only_merge,
            block_size=args.block_size,
            base_model_name_or_path=args.base_model,
        )
    except ExportRefusedError as error:
        print(f"mars-hf export: {error}", file=sys.stderr)
        return 2
    from transformers import AutoConfig

    mars = get_mars_config(AutoConfig.from_pretrained(out))
    k = int(mars["block_size"]) + 1
    target = args.target or mars.get("vllm_export", {}).get("target") or "TARGET_MODEL"
    spec = f'{{"method": "draft_model", "model": "{out}", "num_speculative_tokens": {k}, "parallel_drafting": true}}'
    print(f"Wrote {out}. Serve it as a parallel drafter (K = block_size + 1 = {k}):")
    print(f"  vllm serve {shlex.quote(str(target))} --speculative-config {shlex.quote(spec)}")
    return 0
