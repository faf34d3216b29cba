"""MARS fine-tuning from the command line (TrlParser over ScriptArguments / MARSConfig / ModelConfig).

The script itself lives in the package, as TRL's ``trl/scripts/sft.py`` does, so that ``mars-hf train``
works from any install; this file runs it, e.g.

    python examples/train_mars.py --model_name_or_path embedded --dataset_name data/train.jsonl --block_size 4 --output_dir out
    accelerate launch --num_processes 2 examples/train_mars.py ...

See ``mars_hf/scripts/train_mars.py`` for the full option list and recipes.
"""

from mars_hf.scripts.train_mars import cli

if __name__ == "__main__":
    cli()
