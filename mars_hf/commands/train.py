"""`mars-hf train`: the training script `mars_hf/scripts/train_mars.py` behind the console command.

Every argument after `train` goes to the script's TrlParser (`SFTConfig`/`MARSConfig`/`ModelConfig`
options, `--config recipe.yaml`), so `mars-hf train --help` lists them all.
"""

from __future__ import annotations

import argparse

HELP = "Fine-tune a causal LM with MARS (TrlParser over MARSConfig/ModelConfig; see examples/train_mars.py)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "mars-hf train [--help] [TRAIN_MARS_ARGS ...]"

    # argparse would reject the script's options (they are TrlParser's, not this parser's), so every
    # argument after `train`, `--help` included, is handed to the script untouched.
    def parse_known_args(args=None, namespace=None):
        namespace = namespace if namespace is not None else argparse.Namespace()
        for key, value in parser._defaults.items():  # set_defaults(_run=...) of the CLI
            setattr(namespace, key, value)
        namespace.script_args = list(args or [])
        return namespace, []

    parser.parse_known_args = parse_known_args


def load_example_script():
    """The training script module (``mars_hf/scripts/train_mars.py``, run by ``examples/train_mars.py`` too)."""
    from mars_hf.scripts import train_mars

    return train_mars


def run(args: argparse.Namespace) -> int:
    argv = list(args.script_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    load_example_script().cli(argv)
    return 0
