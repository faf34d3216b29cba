"""The generated-code executor (mars_hf/evaluation/code_execution.py): every guard checked by a program that trips it."""

import ctypes
import dataclasses
import glob
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid

import pytest

from mars_hf.evaluation import code_execution
from mars_hf.evaluation.code_execution import ExecutionLimits, active_guards, run_program
from mars_hf.evaluation.metrics import load_metric
from mars_hf.evaluation.runs import humaneval_program, load_humaneval

GUARDS = active_guards()


# Hang guard for calls that must return early: far above what a loaded machine needs, far below the
# deadlines (DETACHED_TIMEOUT) and sleeps (600 s) that a regression would wait for.
HANG_GUARD = 45
DETACHED_TIMEOUT = {True: 4, False: 300}  # main_sleeps -> run_program timeout


def _require(guard: str, what: str) -> None:
    """The suite runs as root where `unshare` works (the README's test setup): a guard missing here is a
    failure that names it, not a skip (the fallbacks are tested on purpose, with ``no_namespaces``)."""
    assert GUARDS[guard], f"{what} is not active here ({guard}={GUARDS[guard]!r}); see active_guards()"


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
    program = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\nwhile True: pass\n"
    start = time.monotonic()
    result = run_program(program, timeout=2)
    assert not result.passed and result.status == "timed out"
    assert time.monotonic() - start < HANG_GUARD  # the child would hold the pipe open for 600 s


def _holders(marker: str) -> list[int]:
    """Host pids of live processes whose command line carries ``marker`` (zombies have none)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _detaching_program(marker: str, main_sleeps: bool) -> str:
    """A child that leaves our process group (setsid), forks again, keeps stdout open and sleeps 600 s with
    ``marker`` in its command line (how we find it: its pid here is not the one it sees)."""
    return (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        print('grandchild', os.getpid(), flush=True)\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n" + ("time.sleep(600)\n" if main_sleeps else "")
    )


@pytest.mark.parametrize("main_sleeps", [True, False], ids=["program-times-out", "program-exits"])
def test_a_detached_grandchild_neither_outlives_the_call_nor_holds_it_up(main_sleeps):
    """setsid + double fork + stdout kept open: the call still returns by the deadline (a program that
    exits returns long before its 300 s one), and the grandchild (any process with its marker) is dead
    afterwards."""
    marker = f"mars-hf-detached-{uuid.uuid4().hex}"
    start = time.monotonic()
    timeout = DETACHED_TIMEOUT[main_sleeps]
    result = run_program(_detaching_program(marker, main_sleeps), timeout=timeout)
    took = time.monotonic() - start
    try:
        # waiting for the grandchild (or the deadline, for a program that exited) would pass the guard
        assert took < HANG_GUARD, f"took {took:.1f} s: the call waited for the detached grandchild"
        if main_sleeps:
            assert result.status == "timed out"
        else:
            assert result.passed, result.output
        assert "grandchild" in result.output, result.output
        _require("pid_namespace", "the PID namespace")  # without it the grandchild survives (own test)
        assert not _holders(marker)
    finally:
        for pid in _holders(marker):
            os.kill(pid, signal.SIGKILL)


def test_writes_to_tmp_and_dev_shm_stay_in_the_private_folder():
    """/tmp, /var/tmp and /dev/shm are views of the program's own folder: nothing it writes there persists."""
    name = f"mars-hf-{uuid.uuid4().hex}"
    program = "".join(
        f"open({folder + '/' + name!r}, 'w').write('x')\n" for folder in ("/tmp", "/var/tmp", "/dev/shm")
    )
    try:
        result = run_program(program)
        assert result.passed, result.output
        for folder in ("/tmp", "/var/tmp", "/dev/shm"):
            assert not os.path.exists(os.path.join(folder, name)), folder
        assert {"/tmp", "/var/tmp", "/dev/shm"} <= set(GUARDS["private_tmp_views"])
    finally:
        for folder in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.exists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))


def test_cpu_time_limit_applies_even_with_a_long_wall_timeout():
    result = run_program("while True: pass\n", timeout=30, cpu_seconds=1)
    assert (
        result.status == "failed" and result.returncode is not None and result.returncode < 0
    )  # SIGXCPU/SIGKILL


def test_memory_limit():
    result = run_program("x = bytearray(1500 * 2**20)\n", memory_mb=512)
    assert not result.passed and "MemoryError" in result.output
    assert run_program("x = bytearray(100 * 2**20)\n", memory_mb=512).passed  # below the cap it works


@pytest.mark.parametrize("isolated", [True, False], ids=["namespaces", "fallback"])
def test_file_size_limit_and_private_working_folder(isolated, request):
    if isolated:
        _require("private_tmp_views", "the mount namespace's private /tmp")
    else:
        request.getfixturevalue("no_namespaces")
    name = f"mars-hf-{uuid.uuid4().hex}"
    program = (
        "import os, tempfile\n"
        "print(os.getcwd(), tempfile.gettempdir(), os.environ['HOME'])\n"
        f"open({name!r}, 'wb').write(b'0' * 2**20)\n"
        "open('big', 'wb').write(b'0' * 8 * 2**20)\n"
    )
    result = run_program(program, max_file_mb=4)
    assert not result.passed and "File too large" in result.output
    cwd, tmp, home = result.output.splitlines()[0].split()
    assert cwd == tmp == home
    if isolated:  # the private folder is the program's /tmp
        assert cwd == "/tmp" and not os.path.exists(os.path.join("/tmp", name))
    else:  # a private folder under our temp folder
        assert os.path.basename(cwd).startswith("mars_hf_exec_")
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "mars_hf_exec_*", name))  # removed afterwards


def test_environment_is_emptied():
    os.environ["MARS_HF_SECRET_FOR_TEST"] = "leak"
    try:
        result = run_program(
            "import os\nprint(sorted(os.environ))\nassert 'MARS_HF_SECRET_FOR_TEST' not in os.environ\n"
        )
    finally:
        del os.environ["MARS_HF_SECRET_FOR_TEST"]
    assert result.passed, result.output


def test_network_namespace_blocks_even_the_raw_socket_module():
    """The in-process socket guard is bypassable (`import _socket`); the namespace is not."""
    _require("network_namespace", "the empty network namespace")
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


def test_runs_unprivileged_cannot_write_our_files_and_process_count_is_capped():
    """As nobody: our file outside the private views is visible but not writable; one under /tmp is not
    even visible (the program's /tmp is its own folder)."""
    _require("unprivileged_user", "running as nobody")
    _require("private_tmp_views", "the mount namespace's private /tmp")
    # A folder outside the program's private views: beside this file, or in our home when the checkout is in /tmp.
    here = os.path.dirname(os.path.abspath(__file__))
    private = any(here == view or here.startswith(view + "/") for view in code_execution.PRIVATE_VIEWS)
    outside = tempfile.mkdtemp(prefix="mars-hf-ours-", dir=os.path.expanduser("~") if private else here)
    inside = tempfile.mkdtemp(prefix="mars-hf-ours-", dir="/tmp")
    try:
        for folder, error in ((outside, "PermissionError"), (inside, "FileNotFoundError")):
            ours = os.path.join(folder, "ours.txt")
            with open(ours, "w") as handle:
                handle.write("keep")
            os.chmod(folder, 0o755)
            result = run_program(f"import os\nprint(os.getuid())\nopen({ours!r}, 'a').write('x')\n")
            assert not result.passed and error in result.output, (folder, result.output)
            assert result.output.splitlines()[0] == str(code_execution.NOBODY_UID)
            with open(ours) as handle:
                assert handle.read() == "keep"
    finally:
        shutil.rmtree(outside, ignore_errors=True)
        shutil.rmtree(inside, ignore_errors=True)
    fork = "import subprocess\nps = [subprocess.Popen(['sleep', '5']) for _ in range(40)]\n"
    result = run_program(fork, max_processes=8, timeout=20)
    assert not result.passed and (
        "BlockingIOError" in result.output or "Resource temporarily" in result.output
    )


@pytest.fixture
def no_namespaces(monkeypatch):
    """This machine as one where `unshare` gives nothing: only the fallbacks remain."""
    bare = dataclasses.replace(code_execution._isolation(), prefix=(), namespaces=frozenset())
    monkeypatch.setattr(code_execution, "_isolation", lambda: bare)
    monkeypatch.setenv(code_execution.WEAK_SANDBOX_ENV, "1")
    code_execution.log_guards.cache_clear()
    yield
    code_execution.log_guards.cache_clear()


def test_missing_namespaces_are_logged_as_warnings(no_namespaces, caplog):
    with caplog.at_level(logging.INFO, logger="mars_hf.evaluation.code_execution"):
        result = run_program(
            "import socket\ntry:\n    socket.socket()\nexcept OSError:\n    print('guarded')\n"
        )
    assert result.passed and "guarded" in result.output  # the fallback guard still works
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "No network namespace" in warnings and "No PID namespace" in warnings
    assert "No mount namespace" in warnings and "No IPC namespace" in warnings and "No /proc" in warnings
    guards = active_guards()
    assert guards["network"].startswith("in-process socket guard only") and not guards["pid_namespace"]
    assert guards["private_tmp_views"] == [] and "setsid survives" in guards["detached_processes"]
    assert not guards["ipc_namespace"] and not guards["own_proc"] and guards["disk_cap_mb"] is None


@pytest.mark.parametrize("main_sleeps", [True, False], ids=["program-times-out", "program-exits"])
def test_without_a_pid_namespace_the_wall_clock_bound_still_holds(no_namespaces, main_sleeps):
    """The detached grandchild survives there (said in the guards), but cannot hold the call up."""
    marker = f"mars-hf-detached-{uuid.uuid4().hex}"
    start = time.monotonic()
    try:
        result = run_program(_detaching_program(marker, main_sleeps), timeout=DETACHED_TIMEOUT[main_sleeps])
        took = time.monotonic() - start
        assert took < HANG_GUARD, f"took {took:.1f} s: the call waited for the detached grandchild"
        assert result.status == ("timed out" if main_sleeps else "passed"), result
    finally:
        for pid in _holders(marker):
            os.kill(pid, signal.SIGKILL)


def test_active_guards_reports_limits():
    guards = active_guards(ExecutionLimits(timeout=3, memory_mb=300, max_file_mb=5, max_disk_mb=40))
    assert guards["resource_limits"]["memory_mb"] == 300 and guards["resource_limits"]["cpu_seconds"] == 4
    assert guards["resource_limits"]["max_file_mb"] == 5 and guards["private_tmp"] is True
    assert guards["disk_cap_mb"] == guards["resource_limits"]["max_disk_mb"] == 40 and guards["missing"] == []
    with pytest.raises(ValueError, match="max_disk_mb"):
        ExecutionLimits(max_disk_mb=0)


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


_LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"


def _host_shm_keys() -> set[int]:
    """Keys of the SysV shared memory segments of our own IPC namespace (what `ipcs -m` lists)."""
    with open("/proc/sysvipc/shm") as handle:
        return {int(line.split()[0]) for line in handle.readlines()[1:]}


def test_sysv_shared_memory_dies_with_the_program_and_is_capped_by_memory_mb():
    """A segment left behind (never removed) is gone for the next program and was never the machine's;
    segments together cannot exceed ``memory_mb``."""
    _require("ipc_namespace", "the IPC namespace")
    key = 0x10000000 + uuid.uuid4().int % 0x0FFFFFF0
    create = _LIBC + (
        f"shmid = libc.shmget({key}, 2**20, 0o1666)  # IPC_CREAT | 0666\n"
        "assert shmid >= 0, os.strerror(ctypes.get_errno())\n"
        "ctypes.memmove(libc.shmat(shmid, None, 0), b'secret', 6)\n"
        f"first = libc.shmget({key + 1}, 80 * 2**20, 0o1600)\n"
        f"second = libc.shmget({key + 2}, 80 * 2**20, 0o1600)\n"
        "print('segments', first >= 0, second >= 0)\n"
    )
    read = _LIBC + (
        f"shmid = libc.shmget({key}, 0, 0)\n"
        "print('found' if shmid >= 0 else 'absent', os.strerror(ctypes.get_errno()))\n"
        "if shmid >= 0:\n"
        "    print(ctypes.string_at(libc.shmat(shmid, None, 0), 6))\n"
    )
    try:
        created = run_program(create, memory_mb=128)
        assert created.passed, created.output
        again = run_program(read)
        assert again.passed and "absent" in again.output and "secret" not in again.output, again.output
        assert not {key, key + 1, key + 2} & _host_shm_keys()  # never in the machine's namespace
        assert "segments True False" in created.output  # 80 + 80 MB > memory_mb
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        for leftover in {key, key + 1, key + 2} & _host_shm_keys():
            libc.shmctl(libc.shmget(leftover, 0, 0), 0, None)  # IPC_RMID


def test_proc_shows_only_the_programs_own_processes():
    """/proc is the program's PID namespace's: it and its child, not our process or its command line."""
    _require("own_proc", "the program's own /proc")
    program = (
        "import os, subprocess\n"
        "child = subprocess.Popen(['sleep', '5'])\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), sorted([os.getpid(), child.pid]))\n"
        "child.kill()\n"
        "try:\n"
        f"    print(open('/proc/{os.getpid()}/cmdline', 'rb').read())\n"
        "except OSError as error:\n"
        "    print('unreadable', type(error).__name__)\n"
    )
    result = run_program(program)
    assert result.passed, result.output
    seen, own = result.output.split("]")[:2]
    assert seen + "]" == own.strip() + "]", result.output  # exactly itself and its child
    assert "unreadable" in result.output and "pytest" not in result.output


def test_total_disk_cap_bounds_everything_the_program_writes():
    """30 files of max_file_mb each, spread over its folder, /var/tmp and /dev/shm: one capped tmpfs
    (not the machine's disk) stops them at max_disk_mb."""
    _require("disk_cap_mb", "the total disk cap")
    program = (
        "import os\n"
        "folders = ['.', '/var/tmp', '/dev/shm']\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(30):\n"
        "        with open(os.path.join(folders[i % 3], f'file{i}'), 'wb') as handle:\n"
        "            handle.write(b'0' * 2 * 2**20)\n"
        "        written += 2\n"
        "except OSError as error:\n"
        "    print('stopped', written, error.strerror)\n"
        "for folder in folders:\n"
        "    stat = os.statvfs(folder)\n"
        "    print('fs', stat.f_fsid, stat.f_blocks * stat.f_frsize // 2**20)\n"
    )
    result = run_program(program, max_file_mb=2, max_disk_mb=16)
    assert result.passed and "No space left on device" in result.output, result.output
    written = int(result.output.split("stopped")[1].split()[0])
    assert 12 <= written < 16, result.output  # the cap, not the 60 MB asked for
    filesystems = {line for line in result.output.splitlines() if line.startswith("fs ")}
    assert len(filesystems) == 1 and filesystems.pop().endswith(" 16"), result.output


@pytest.mark.parametrize("absent", code_execution.NAMESPACES)
def test_a_missing_namespace_is_refused_unless_opted_in(absent, monkeypatch, caplog):
    """No silently weaker sandbox: the error names what is missing and the opt-in; with the opt-in the
    program runs with a warning."""
    names = tuple(name for name in code_execution.NAMESPACES if name != absent)
    prefix = code_execution._unshare_prefix(shutil.which("unshare"), names, ())
    weaker = dataclasses.replace(code_execution._isolation(), prefix=prefix, namespaces=frozenset(names))
    monkeypatch.setattr(code_execution, "_isolation", lambda: weaker)
    monkeypatch.delenv(code_execution.WEAK_SANDBOX_ENV, raising=False)
    code_execution.log_guards.cache_clear()
    try:
        with pytest.raises(code_execution.SandboxUnavailableError) as refused:
            run_program("print('ran')\n")
        message = str(refused.value)
        assert f"no {code_execution.NAMESPACE_NAMES[absent]} namespace" in message
        assert "MARS_HF_ALLOW_WEAK_SANDBOX=1" in message and "allow_weak_sandbox=True" in message
        with caplog.at_level(logging.WARNING, logger="mars_hf.evaluation.code_execution"):
            result = run_program("print('ran')\n", allow_weak_sandbox=True)
        assert result.passed and "ran" in result.output, result.output
        warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert f"No {code_execution.NAMESPACE_NAMES[absent]} namespace" in warned
    finally:
        code_execution.log_guards.cache_clear()
