"""`mars-hf reduce-rank CHECKPOINT --rank K --out DIR`: a cheaper gated forward for a little acceptance."""

from __future__ import annotations

import argparse

HELP = (
    "Lower a trained LoRA adapter's rank by truncated SVD of each layer's update (the mask-gated forward "
    "streams fewer bytes per step); measure what it costs with examples/mars_quality.py."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="A saved LoRA adapter folder (a MARS checkpoint), or 'embedded-mars'.")
    parser.add_argument("--rank", type=int, required=True, help="The new rank (below the adapter's own).")
    parser.add_argument("--out", required=True, help="Folder to write (the original is left as it is).")


def run(args) -> int:
    from mars_hf.models.embedded_model import resolve_model_path
    from mars_hf.models.rank_reduction import reduce_adapter_rank

    report = reduce_adapter_rank(resolve_model_path(args.checkpoint), args.out, args.rank)
    print(
        f"{args.out}: rank {report.old_rank} -> {report.new_rank} on {len(report.kept_energy)} layers; share of each "
        f"update's energy kept: mean {report.mean_kept_energy:.4f}, lowest {report.min_kept_energy:.4f}."
    )
    return 0
