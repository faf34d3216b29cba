"""`mars-hf train`: the training script `mars_hf/scripts/train_mars.py` behind the console command.

Shaped like `trl sft`: every argument after `train` goes to the script's TrlParser (`SFTConfig` /
`MARSConfig` / `ModelConfig` options, `--config recipe.yaml`), so `mars-hf train --help` lists them all.
Arguments the script does not know are `accelerate launch` options: with any of them, or with
`--accelerate_config NAME|FILE` (bundled: multi_cpu, multi_gpu, zero2, fsdp in `mars_hf/accelerate_configs`),
the script runs under `accelerate launch` in as many processes as asked; without, it runs in this process.
A recipe file may carry launch options too (e.g. `num_processes: 2`), as with `trl`.
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

HELP = "Fine-tune a causal LM with MARS (TrlParser over MARSConfig/ModelConfig; `accelerate launch` for several processes)."
BUNDLED_CONFIGS = ("multi_cpu", "multi_gpu", "zero2", "fsdp")


# Every argument after `train`, `--help` included, belongs to the training script's TrlParser or to
# `accelerate launch` (`split_arguments`), so this command's parser takes them all as they are: no option
# prefix (argparse would read `--block_size` as an unknown option of its own) and no `-h` of its own.
PARSER_OPTIONS = {
    "prefix_chars": "\0",
    "add_help": False,
    "usage": "mars-hf train [--help] [--config RECIPE.yaml] [--accelerate_config NAME|FILE] [TRAIN_MARS_ARGS ...]",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="TRAIN_MARS_ARGS",
        help="The training script's options (`mars-hf train --help` lists them) and `accelerate launch`'s.",
    )


def load_example_script():
    """The training script module (``mars_hf/scripts/train_mars.py``, run by ``examples/train_mars.py`` too)."""
    from mars_hf.scripts import train_mars

    return train_mars


def script_path() -> Path:
    return Path(str(importlib.resources.files("mars_hf.scripts").joinpath("train_mars.py")))


def resolve_accelerate_config(launch_args: list[str]) -> list[str]:
    """``--accelerate_config NAME|FILE`` -> ``--config_file PATH`` (a bundled name or a file)."""
    if "--accelerate_config" not in launch_args:
        return launch_args
    index = launch_args.index("--accelerate_config")
    if index + 1 >= len(launch_args):
        raise ValueError(f"`--accelerate_config` needs a value: a file or one of {BUNDLED_CONFIGS}.")
    name = launch_args[index + 1]
    if Path(name).is_file():
        path = Path(name)
    else:
        path = Path(str(importlib.resources.files("mars_hf.accelerate_configs").joinpath(f"{name}.yaml")))
        if not path.is_file():
            raise ValueError(f"--accelerate_config {name!r} is neither a file nor one of {BUNDLED_CONFIGS}.")
    return ["--config_file", str(path), *launch_args[:index], *launch_args[index + 2 :]]


def _subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """``items`` without the (ordered) ``subsequence``: the script's own arguments."""
    pending = iter(subsequence)
    current = next(pending, None)
    kept = []
    for item in items:
        if current is not None and item == current:
            current = next(pending, None)
        else:
            kept.append(item)
    return kept


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(launch_args, script_args)``: what ``accelerate launch`` takes and what the training script takes."""
    parser = load_example_script().make_parser(prog="mars-hf train")
    *_, config_remaining, cli_remaining = parser.parse_args_and_config(
        list(argv), return_remaining_strings=True, separate_remaining_strings=True
    )
    launch_args = resolve_accelerate_config(list(config_remaining) + list(cli_remaining))
    return launch_args, _subtract_subsequence(list(argv), list(cli_remaining))


def launch(launch_args: list[str], script_args: list[str], launch_command_fn=None) -> None:
    """``accelerate launch [launch_args] train_mars.py [script_args]`` (in this process's Python)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    arguments = launch_command_parser().parse_args([*launch_args, str(script_path()), *script_args])
    logger.info("accelerate launch %s %s %s", " ".join(launch_args), script_path(), " ".join(script_args))
    (launch_command_fn or launch_command)(arguments)


def run(args: argparse.Namespace) -> int:
    argv = list(args.script_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if any(flag in argv for flag in ("-h", "--help")):
        load_example_script().cli(argv)  # prints the script's help and exits
        return 0
    launch_args, script_args = split_arguments(argv)
    if not launch_args:
        load_example_script().cli(script_args)
        return 0
    launch(launch_args, script_args)
    return 0
