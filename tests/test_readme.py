"""Every command in README.md is run here or by a named test (or is .ci/run's own install / test line)."""

import ast
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from mars_hf.cli import main as cli_main
from tests.tiny import tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CI_RUN = (REPO / ".ci" / "run").read_text()

# README command (its start, comments stripped) -> the test that runs it.
COVERED_BY = {
    "mars-hf generate ": ("tests/test_readme.py", "test_generate_commands_run_on_a_tiny_checkpoint"),
    "mars-hf eval mars-quickstart/checkpoint --tasks humaneval_mars": (
        "tests/test_lm_eval.py", "test_mars_hf_eval_tasks_humaneval_on_tiny_model"),
    "mars-hf train --config recipe.yaml --accelerate_config zero2": (
        "tests/test_train_script.py", "test_launch_arguments_are_split_like_trl"),
    "mars-hf train --config recipe.yaml --accelerate_config multi_cpu --use_cpu": (
        "tests/test_train_script.py", "test_two_cpu_processes_give_the_one_process_loss_curve"),
    "mars-hf train --config recipe.yaml": (
        "tests/test_train_script.py", "test_config_file_trains_in_process_and_command_line_wins"),
    "mars-hf push SmolLM2-135M-MARS --repo-id your-name/SmolLM2-135M-MARS-blk4 --dry-run": (
        "tests/test_hub.py", "test_cli_dry_run_prints_exactly_the_files_written"),
    "mars-hf push SmolLM2-135M-MARS --repo-id your-name/SmolLM2-135M-MARS-blk4 --private": (
        "tests/test_hub.py", "test_cli_push_passes_its_options_to_the_hub_api"),
    "mars-hf serve ": ("tests/test_serving_cli.py", "test_serve_command_answers_verify_and_tau_requests_and_shuts_down"),
    "mars-hf bench ": ("tests/test_bench.py", "test_bench_cli_on_a_saved_tiny_model"),
}  # fmt: skip


def blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands():
    for block in blocks("bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command:
                yield command


def test_the_two_fresh_machine_commands_are_what_ci_runs():
    install, tests = blocks("bash")[:2]
    steps = [step.strip() for step in install.strip().split(" && ")]
    assert steps[0] == "python3 -m venv .venv" and steps[-1] == "mars-hf quickstart"
    for step in steps[2:-1]:  # every install step of the README is a line of .ci/run
        assert step in CI_RUN.splitlines(), step
    assert tests.strip().split(" && ", 1)[1] in CI_RUN  # ruff check . && python -m pytest -q -rs


@pytest.mark.parametrize("command", [c for c in commands() if c.startswith("mars-hf ")])
def test_every_readme_command_is_covered_by_a_test(command):
    match = next(
        (COVERED_BY[key] for key in sorted(COVERED_BY, key=len, reverse=True) if command.startswith(key)),
        None,
    )
    assert match is not None, f"README command without a test: {command}"
    path, name = match
    tree = ast.parse((REPO / path).read_text())
    assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, (path, name)


def test_recipe_keys_are_training_options():
    from trl import ModelConfig, ScriptArguments

    from mars_hf import MARSConfig

    (recipe,) = [b for b in blocks("yaml") if "model_name_or_path" in b]
    fields = {f for cls in (ScriptArguments, MARSConfig, ModelConfig) for f in cls.__dataclass_fields__}
    unknown = set(yaml.safe_load(recipe)) - fields
    assert not unknown, f"README recipe keys that TrlParser would not know: {unknown}"


@pytest.fixture
def quickstart_checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "mars-quickstart" / "checkpoint"
    tokenizer = tiny_tokenizer()
    tiny_model("llama", seed=1, tokenizer=tokenizer, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    return folder


def test_generate_python_block_runs_on_a_tiny_checkpoint(quickstart_checkpoint, capsys):
    (code,) = [b for b in blocks("python") if "AutoMARSModelForCausalLM.from_pretrained" in b]
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own snippet
    assert capsys.readouterr().out.strip() != ""


def test_generate_commands_run_on_a_tiny_checkpoint(quickstart_checkpoint, capsys):
    for command in commands():
        if command.startswith("mars-hf generate "):
            assert cli_main(shlex.split(command)[1:]) == 0
    assert os.path.isdir(quickstart_checkpoint) and capsys.readouterr().out.strip() != ""
