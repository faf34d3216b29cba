"""The ``mars-hf`` console command.

Each subcommand lives in ``mars_hf/commands/<name>.py`` and exposes ``HELP``, ``add_arguments(parser)``
and ``run(args) -> int``; heavy imports happen inside ``run`` so ``mars-hf --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# commands that decode for a user keep the measured cost curves on disk, under $MARS_HF_HOME/cost-curves
# (``cost_model.disk_cache_by_default``): a one-shot `generate` would otherwise pay the ~2 s probe every time
KEEPS_COST_CURVES = ("generate", "serve")
COMMANDS = ["quickstart", "distill", "train", "calibrate", "reduce-rank", "generate", "bench", "eval", "push", "export", "serve", "loadtest", "gpu-check"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mars-hf", description="Train and serve MARS multi-token models.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"mars_hf.commands.{name.replace('-', '_')}")
        # argparse %-formats help strings (not descriptions): a literal % in HELP must be doubled there
        sub = subparsers.add_parser(
            name,
            help=module.HELP.replace("%", "%%"),
            description=module.HELP,
            **getattr(module, "PARSER_OPTIONS", {}),  # e.g. `train`: its arguments are another parser's
        )
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in KEEPS_COST_CURVES:
        return int(args._run(args) or 0)
    from mars_hf.decoding.cost_model import disk_cache_by_default
    from mars_hf.decoding.home import mars_hf_home

    with disk_cache_by_default(mars_hf_home() / "cost-curves"):
        return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
