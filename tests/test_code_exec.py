"""The generated-code executor (mars_hf/code_execution.py): every guard checked by a program that trips it."""

import logging
import os
import socket
import time

import pytest

from mars_hf import code_execution
from mars_hf.code_execution import ExecutionLimits, active_guards, run_program
from mars_hf.evaluation import humaneval_program, load_humaneval
from mars_hf.metrics import load_metric

GUARDS = active_guards()
needs_netns = pytest.mark.skipif(not GUARDS["network_namespace"], reason="no network namespace here")
needs_nobody = pytest.mark.skipif(GUARDS["unprivileged_user"] is None, reason="not root / no nobody python")


def test_humaneval_known_correct_and_known_wrong_completion():
    problem = load_humaneval(limit=1)[0]
    assert problem["task_id"] == "HumanEval/0"
    right = run_program(humaneval_program(problem, problem["canonical_solution"]), timeout=20)
    assert right.passed and right.status == "passed", right.output
    wrong = run_program(humaneval_program(problem, "    return False\n"), timeout=20)
    assert not wrong.passed and wrong.status == "failed"
    assert "AssertionError" in wrong.output
    syntax = run_program("def f(:\n", timeout=10)
    assert not syntax.passed and "SyntaxError" in syntax.output


def test_timeout_kills_the_program_and_its_children():
    program = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nwhile True: pass\n"
    start = time.monotonic()
    result = run_program(program, timeout=2)
    assert not result.passed and result.status == "timed out"
    assert time.monotonic() - start < 15


def test_cpu_time_limit_applies_even_with_a_long_wall_timeout():
    result = run_program("while True: pass\n", timeout=30, cpu_seconds=1)
    assert (
        result.status == "failed" and result.returncode is not None and result.returncode < 0
    )  # SIGXCPU/SIGKILL


def test_memory_limit():
    result = run_program("x = bytearray(1500 * 2**20)\n", memory_mb=512)
    assert not result.passed and "MemoryError" in result.output
    assert run_program("x = bytearray(100 * 2**20)\n", memory_mb=512).passed  # below the cap it works


def test_file_size_limit_and_private_working_folder():
    program = (
        "import os, tempfile\n"
        "print(os.getcwd(), tempfile.gettempdir(), os.environ['HOME'])\n"
        "open('small', 'wb').write(b'0' * 2**20)\n"
        "open('big', 'wb').write(b'0' * 8 * 2**20)\n"
    )
    result = run_program(program, max_file_mb=4)
    assert not result.passed and "File too large" in result.output
    cwd, tmp, home = result.output.splitlines()[0].split()
    assert cwd == tmp == home and os.path.basename(cwd).startswith("mars_hf_exec_")
    assert not os.path.exists(cwd)  # removed afterwards


def test_environment_is_emptied():
    os.environ["MARS_HF_SECRET_FOR_TEST"] = "leak"
    try:
        result = run_program(
            "import os\nprint(sorted(os.environ))\nassert 'MARS_HF_SECRET_FOR_TEST' not in os.environ\n"
        )
    finally:
        del os.environ["MARS_HF_SECRET_FOR_TEST"]
    assert result.passed, result.output


@needs_netns
def test_network_namespace_blocks_even_the_raw_socket_module():
    """The in-process socket guard is bypassable (`import _socket`); the namespace is not."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    program = (
        "import _socket\n"
        "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
        "s.settimeout(3)\n"
        "try:\n"
        f"    s.connect(('127.0.0.1', {port}))\n"
        "except OSError as error:\n"
        "    print('blocked', error)\n"
        "else:\n"
        "    raise SystemExit(3)\n"
    )
    try:
        result = run_program(program, timeout=10)
    finally:
        server.close()
    assert result.passed and "blocked" in result.output, result.output


@needs_nobody
def test_runs_unprivileged_cannot_write_our_files_and_process_count_is_capped(tmp_path):
    ours = tmp_path / "ours.txt"
    ours.write_text("keep")
    os.chmod(tmp_path, 0o755)
    result = run_program(f"import os\nprint(os.getuid())\nopen({str(ours)!r}, 'a').write('x')\n")
    assert not result.passed and "PermissionError" in result.output
    assert result.output.splitlines()[0] == str(code_execution.NOBODY_UID)
    assert ours.read_text() == "keep"
    fork = "import subprocess\nps = [subprocess.Popen(['sleep', '5']) for _ in range(40)]\n"
    result = run_program(fork, max_processes=8, timeout=20)
    assert not result.passed and (
        "BlockingIOError" in result.output or "Resource temporarily" in result.output
    )


def test_missing_network_namespace_is_logged_as_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(code_execution, "_network_namespace_prefix", lambda: ())
    code_execution.log_guards.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="mars_hf.code_execution"):
            result = run_program(
                "import socket\ntry:\n    socket.socket()\nexcept OSError:\n    print('guarded')\n"
            )
        assert result.passed and "guarded" in result.output  # the fallback guard still works
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("No network namespace" in r.getMessage() for r in warnings)
        assert active_guards()["network"].startswith("in-process socket guard only")
    finally:
        code_execution.log_guards.cache_clear()


def test_active_guards_reports_limits():
    guards = active_guards(ExecutionLimits(timeout=3, memory_mb=300, max_file_mb=5))
    assert guards["resource_limits"]["memory_mb"] == 300 and guards["resource_limits"]["cpu_seconds"] == 4
    assert guards["resource_limits"]["max_file_mb"] == 5 and guards["private_tmp"] is True


def test_code_pass_at_k_metric_uses_the_executor_and_reports_guards():
    problems = load_humaneval(limit=2)
    metric = load_metric("code_pass_at_k")
    predictions = [
        [humaneval_program(problems[0], problems[0]["canonical_solution"])],
        [humaneval_program(problems[1], "    return []\n")],
    ]
    scores = metric.compute(predictions=predictions, references=[p["task_id"] for p in problems], k=[1])
    assert scores["pass@1"] == pytest.approx(0.5)
    assert scores["results"]["HumanEval/0"][0][0] is True
    assert scores["results"]["HumanEval/1"][0][0] is False
    assert scores["guards"] == active_guards()
