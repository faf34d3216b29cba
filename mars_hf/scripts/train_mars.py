# /// script
# dependencies = [
#     "mars-hf",
# ]
# ///

"""
MARS fine-tuning, shaped like TRL's `trl/scripts/sft.py`: every `SFTConfig` / `ModelConfig` option works,
plus MARS's own (`--block_size`, `--ar_weight`, `--pad_to_block_with_eos`, `--clean_loss`, ...).

# Full training on the embedded SmolLM2-135M-Instruct and a local JSONL file
```bash
python examples/train_mars.py \
    --model_name_or_path embedded \
    --dataset_name data/train.jsonl \
    --block_size 4 \
    --learning_rate 5e-6 \
    --lr_scheduler_type cosine --warmup_steps 0.03 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 8 \
    --output_dir SmolLM2-135M-MARS
```

# LoRA (the mask token's embedding row is trained through PEFT's `trainable_token_indices`)
```bash
python examples/train_mars.py \
    --model_name_or_path path/to/model \
    --dataset_name data/train.jsonl \
    --use_peft --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear \
    --learning_rate 2e-4 \
    --output_dir model-MARS-LoRA
```

# A recipe file, several processes (bundled accelerate configs: multi_cpu, multi_gpu, zero2, fsdp)
```bash
mars-hf train --config recipe.yaml --accelerate_config zero2 --num_processes 8
accelerate launch --num_processes 2 examples/train_mars.py --model_name_or_path embedded ...
```

The dataset can be any TRL format (`messages`, `prompt`/`completion`, `text`), given as a Hub name or
a local `.json` / `.jsonl` file or folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def load_dataset_from_args(script_args):
    """A Hub dataset name, or a local JSON/JSONL file (loaded with the `json` builder).

    An empty local file is refused by name (the `json` builder raises a bare StopIteration on one).
    """
    from datasets import load_dataset

    name = script_args.dataset_name
    if name is None:
        raise ValueError("Pass `--dataset_name` (a Hub dataset or a local .json/.jsonl file).")
    local_file = name.endswith((".json", ".jsonl")) or os.path.isfile(name)
    if local_file and os.path.isfile(name) and not _has_content(name):
        raise ValueError(f"{name} is empty: it holds no training rows. {ROW_FORMATS_HINT}")
    if local_file and os.path.isfile(name):
        check_json_file(name)
    try:
        if local_file:
            return load_dataset("json", data_files={script_args.dataset_train_split: name})
        return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    except StopIteration as error:  # the json builder on a file (or a folder's file) without rows
        raise ValueError(f"{name} holds no training rows (an empty file?). {ROW_FORMATS_HINT}") from error


ROW_FORMATS_HINT = (
    "Each row needs one of: 'messages' (a chat), 'prompt' and 'completion', 'text' (`--dataset_text_field`), "
    "'conversations' (from/value turns) or tokenized 'input_ids'; e.g. `mars-hf distill` writes such a file."
)


def check_json_file(path: str) -> None:
    """Refuse a file the `json` builder cannot read, naming the line: not UTF-8 (a latin-1 file raised a bare
    ``UnicodeDecodeError``), or a line that is not JSON (a pyarrow ``DatasetGenerationError`` traceback).

    JSON lines are read one by one (a file of any size); a file that opens with ``[`` or is one JSON document
    over several lines is parsed whole, as the builder reads it.
    """
    import json

    bad = None  # (line, column, what) of the first line that is not JSON
    with open(path, "rb") as handle:
        first = None
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}, line {number}: byte {raw[error.start]:#04x} at column {error.start + 1} is not "
                    "UTF-8 (a latin-1 or Windows-1252 file?). Save the file as UTF-8, e.g. "
                    f"`iconv -f latin1 -t utf-8 {path} > fixed.jsonl`."
                ) from None
            if number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark: the builder reads past it too
            if first is None and line.strip():
                first = line.lstrip()[:1]
            if bad is None and line.strip():
                try:
                    json.loads(line)
                except (ValueError, RecursionError) as error:
                    bad = (number, getattr(error, "colno", 1), getattr(error, "msg", str(error)))
            if bad is not None and first == "[":
                break  # a JSON document, not JSON lines: parsed whole below
    if bad is None:
        return
    if first in ("[", "{"):
        with open(path, encoding="utf-8") as handle:
            try:
                json.load(handle)  # one document over several lines: what the builder reads
                return
            except (ValueError, RecursionError) as error:
                if first == "[":
                    bad = (
                        getattr(error, "lineno", 1),
                        getattr(error, "colno", 1),
                        getattr(error, "msg", str(error)),
                    )
    line, column, what = bad
    raise ValueError(
        f"{path}, line {line}, column {column}: not JSON ({what}). Each line of a .jsonl file is one JSON "
        f'object, e.g. {{"text": "..."}}. {ROW_FORMATS_HINT}'
    )


def _has_content(path: str) -> bool:
    """Whether a file holds anything but whitespace (read until the first such byte)."""
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 16), b""):
            if chunk.strip():
                return True
    return False


def check_rows(dataset, script_args, training_args) -> None:
    """Refuse a training row in no format TRL reads, naming the file and the row (before any work is done)."""
    from mars_hf.training.screening import check_row_formats

    check_row_formats(
        dataset[script_args.dataset_train_split],
        training_args.dataset_text_field,
        source=script_args.dataset_name,
    )


def main(script_args, training_args, model_args):
    from accelerate.logging import get_logger
    from transformers import AutoTokenizer
    from trl import get_peft_config

    from mars_hf import MARSTrainer
    from mars_hf.models.embedded_model import resolve_model_path

    logger = get_logger(__name__)
    refuse_unjoined_processes(training_args)
    model_path = str(resolve_model_path(model_args.model_name_or_path))  # None / "embedded": SmolLM2
    logger.info(f"Training {model_path} with MARS (block_size={training_args.block_size}).")
    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
    tokenizer = AutoTokenizer.from_pretrained(
        model_path, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
    )
    dataset = load_dataset_from_args(script_args)
    check_rows(dataset, script_args, training_args)
    drop_evaluation_prompts(dataset, script_args, training_args, logger)
    calibration_rows = hold_out_for_calibration(dataset, script_args, training_args, logger)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = dataset[script_args.dataset_test_split]

    trainer = MARSTrainer(
        model=model_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    save_trained(trainer, training_args)  # first: nothing that can fail after training may lose it
    if calibration_rows is not None:
        fit_calibration_after_training(trainer, calibration_rows, training_args, logger)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    # Only the main process writes files, so the others reach `end()` first; tearing down a gloo group while a
    # peer is still busy can hang (pytorch/pytorch#75097). Every process destroys it together instead.
    trainer.accelerator.wait_for_everyone()
    trainer.end()
    return trainer


def refuse_unjoined_processes(training_args) -> None:
    """torchrun started several processes that did not join one group (no GPU and no ``--use_cpu``):
    each would train alone on the whole data set."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size != launched:
        raise ValueError(
            f"{launched} processes were launched but each sees a world size of {training_args.world_size}. "
            "On a machine without GPUs pass `--use_cpu` (e.g. `mars-hf train ... --accelerate_config multi_cpu --use_cpu`)."
        )


def model_init_kwargs(model_args, training_args) -> dict:
    """How TRL loads the model: the model options, sdpa attention by default, ``model_init_kwargs`` on top."""
    kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        # MARS needs a backend that takes a custom mask: default to sdpa rather than the library default.
        attn_implementation=model_args.attn_implementation or "sdpa",
        dtype=model_args.dtype,
    )
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs


def save_trained(trainer, training_args) -> None:
    """Save the model and the loss curve (also when no checkpoint was saved), right after training."""
    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        trainer.state.save_to_json(os.path.join(training_args.output_dir, "trainer_state.json"))
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")


def drop_evaluation_prompts(dataset, script_args, training_args, logger) -> None:
    """Remove the training rows that contain a benchmark's prompt (``exclude_evaluation_prompts``), saying how
    many went and which benchmarks could not be checked (their package is not installed)."""
    if not training_args.exclude_evaluation_prompts:
        return
    from mars_hf.tools.bench.eval_sets import available_evaluation_prompts, exclude_evaluation_rows

    prompts, missing = available_evaluation_prompts()
    for reason in missing:
        logger.warning(f"Evaluation prompts not checked against the training data: {reason}")
    split = script_args.dataset_train_split
    before = len(dataset[split]) if hasattr(dataset[split], "__len__") else None
    dataset[split] = exclude_evaluation_rows(dataset[split], prompts)
    if before is not None:
        logger.info(
            f"Dropped {before - len(dataset[split])} of {before} training rows holding an evaluation prompt."
        )


def hold_out_for_calibration(dataset, script_args, training_args, logger):
    """Take ``calibration_holdout`` rows out of the training split (seeded), for the calibration fit."""
    from mars_hf.training.calibration_fit import held_out_split

    split = script_args.dataset_train_split
    if not training_args.calibration_holdout:
        return None
    if not hasattr(dataset[split], "__len__"):
        logger.warning(
            "A streamed dataset cannot hold rows out: no calibration is fitted (use `mars-hf calibrate`)."
        )
        return None
    count = held_out_split(len(dataset[split]), training_args.calibration_holdout)
    if count == 0:
        logger.warning(
            f"calibration_holdout={training_args.calibration_holdout} of {len(dataset[split])} rows holds out none: "
            "no calibration is fitted (pass a count, or fit one later with `mars-hf calibrate`)."
        )
        return None
    parts = dataset[split].train_test_split(test_size=count, seed=training_args.seed, shuffle=True)
    dataset[split] = parts["train"]
    logger.info(f"Held out {count} training rows to fit the confidence calibration after training.")
    return parts["test"]


def fit_calibration_after_training(trainer, rows, training_args, logger):
    """Fit ``config.mars["calibration"]`` on the held-out rows and write it into the saved model.

    The model is saved before this runs, so a failure here costs only the calibration: it is logged with the
    command that fits one later, then raised.
    """
    from mars_hf.training.calibration_fit import attach_calibration, write_calibration

    output_dir = training_args.output_dir
    try:
        model = trainer.accelerator.unwrap_model(trainer.model)
        record = attach_calibration(
            model, trainer.processing_class, rows, text_field=training_args.dataset_text_field
        )
        if record is not None and trainer.is_world_process_zero():
            write_calibration(output_dir, record)
    except Exception:
        logger.error(
            f"The confidence calibration fit failed; the trained model is saved in {output_dir} without it. "
            f"Fit it later with `mars-hf calibrate {output_dir} --data ANSWERS.jsonl`."
        )
        raise
    if record is not None:
        reliability = record.get("reliability", {})
        logger.info(
            f"Confidence calibration fitted on {record['num_examples']} held-out rows and written to {output_dir}: "
            f"held-out calibration error {reliability.get('pooled_before')} -> {reliability.get('pooled_after')}."
        )


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    from trl import ModelConfig, ScriptArguments, TrlParser

    from mars_hf import MARSConfig

    dataclass_types = (ScriptArguments, MARSConfig, ModelConfig)
    if subparsers is not None:
        return subparsers.add_parser(
            "mars", help="Run the MARS training script", dataclass_types=dataclass_types
        )
    return TrlParser(dataclass_types, prog=prog)


def exit_without_teardown_if_distributed() -> None:
    """A worker of a multi-process run ends here, its files written and its process group destroyed by every
    process together (``main``), without tearing the rest down at interpreter exit.

    Why: freeing the trainer at exit (its DDP wrapper keeps the gloo group alive past ``destroy_process_group``)
    can block for ever once a peer has already exited — seen once in a CI run of the two-process test: rank 1
    gone, rank 0 stuck in that teardown with only a gloo thread left (pytorch/pytorch#75097; pytorch#179291
    describes gloo work outliving the interpreter). Output is flushed first; a single process exits normally.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cli(argv: list[str] | None = None, *, fail_with_unknown_args: bool = True):
    parser = make_parser(prog="train_mars.py")
    script_args, training_args, model_args = parser.parse_args_and_config(
        argv, fail_with_unknown_args=fail_with_unknown_args
    )
    return main(script_args, training_args, model_args)


if __name__ == "__main__":
    # Started by `accelerate launch` (e.g. from `mars-hf train --accelerate_config ...`): keys of a recipe
    # file that are launch options (num_processes, ...) were accelerate's; unknown command-line options
    # still fail.
    trainer = cli(fail_with_unknown_args=False)  # kept referenced: freeing it is the teardown that can hang
    exit_without_teardown_if_distributed()
