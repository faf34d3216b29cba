"""Run generated code (HumanEval completions and their tests) in a separate, limited process.

Every program runs in a fresh ``python -I`` process started through a small launcher that, before
the program starts, applies the guards this machine offers:

* **resource limits** (``resource.setrlimit``): address space, CPU seconds, number of processes,
  size of any file written, no core dumps;
* a **private temporary folder** (mode 0700) as working directory, ``HOME`` and ``TMPDIR``, removed
  afterwards, and an environment with nothing but ``PATH``;
* **no network**: a fresh, empty network namespace (``unshare --net``; ``--map-root-user`` when not
  root) where this machine allows one, probed once. Where it does not, only an in-process ``socket``
  guard remains, which the program itself can bypass: that fallback is logged as a warning and
  reported in :func:`active_guards`, never silent;
* an **unprivileged user** (``nobody``) when the evaluation runs as root, so the process cannot write
  the caller's files and the process limit counts only its own processes;
* its own session, so a timeout kills the program and everything it started.

This is a guard against accidents (an infinite loop, a runaway allocation, a stray ``rm`` or a
download), not a security sandbox for hostile code.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

NOBODY_UID = NOBODY_GID = 65534

_SOCKET_GUARD = """\
import socket as _socket


def _network_disabled(*args, **kwargs):
    raise OSError("network access is disabled while running generated code")


for _name in ("socket", "create_connection", "create_server", "getaddrinfo", "socketpair", "fromfd"):
    setattr(_socket, _name, _network_disabled)
del _name, _socket
"""

# Runs first in the child (one thread, nothing imported but the standard library): limits, then the
# privilege drop, then exec of the program itself (limits survive exec).
_LAUNCHER = """\
import json, os, resource, sys
settings = json.loads(sys.argv[1])
for name, value in settings["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if settings["drop_to"] is not None:
    uid, gid = settings["drop_to"]
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
interpreter = settings["interpreter"]
if settings["program"] == "-c":  # the probe: can this user start this interpreter?
    os.execv(interpreter, [interpreter, "-I", "-c", "pass"])
os.execv(interpreter, [interpreter, "-I", "-B", settings["program"]])
"""


@dataclasses.dataclass(frozen=True)
class ExecutionLimits:
    """Limits for one program. ``cpu_seconds=None`` means ``ceil(timeout) + 1``."""

    timeout: float = 10.0
    memory_mb: int = 2048
    cpu_seconds: int | None = None
    max_processes: int = 32
    max_file_mb: int = 64

    def rlimits(self) -> dict[str, int]:
        cpu = self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout) + 1
        return {
            "RLIMIT_AS": self.memory_mb * 2**20,
            "RLIMIT_CPU": int(cpu),
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_FSIZE": self.max_file_mb * 2**20,
            "RLIMIT_CORE": 0,
        }


@dataclasses.dataclass
class ProgramResult:
    passed: bool
    status: str  # "passed", "failed", "timed out"
    output: str = ""
    returncode: int | None = None


@functools.lru_cache(maxsize=1)
def _network_namespace_prefix() -> tuple[str, ...]:
    """The ``unshare`` command that gives a child an empty network namespace here, or ``()`` (probed once)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    candidates = [(unshare, "--net")] if os.geteuid() == 0 else []
    candidates.append((unshare, "--net", "--map-root-user"))
    for prefix in candidates:
        try:
            probe = subprocess.run(
                [*prefix, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return prefix
    return ()


@functools.lru_cache(maxsize=1)
def _unprivileged_interpreter() -> tuple[tuple[int, int] | None, str]:
    """``(uid/gid to switch to, interpreter)``: as root, run as ``nobody`` with a Python it can execute.

    Our own interpreter may live where ``nobody`` cannot read (e.g. under ``/root``); the system
    ``python3`` then serves (generated code needs only the standard library). Probed once; ``(None,
    sys.executable)`` when we are not root or no interpreter runs as ``nobody``.
    """
    if os.geteuid() != 0:
        return None, sys.executable
    drop = (NOBODY_UID, NOBODY_GID)
    candidates = [sys.executable, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")]
    for interpreter in dict.fromkeys(c for c in candidates if c):
        settings = {"limits": {}, "drop_to": drop, "program": "-c", "interpreter": interpreter}
        command = [interpreter, "-I", "-c", _LAUNCHER, json.dumps(settings)]
        try:
            probe = subprocess.run(command, capture_output=True, timeout=10, cwd="/")
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return drop, interpreter
    return None, sys.executable


def active_guards(limits: ExecutionLimits | None = None) -> dict:
    """Which guards generated code runs under on this machine (what :func:`run_program` applies)."""
    limits = limits or ExecutionLimits()
    netns = _network_namespace_prefix()
    drop, interpreter = _unprivileged_interpreter()
    rlimits = limits.rlimits()
    return {
        "network_namespace": bool(netns),
        "network": "empty network namespace" if netns else "in-process socket guard only (bypassable)",
        "unprivileged_user": "nobody" if drop else None,
        "resource_limits": {
            "memory_mb": limits.memory_mb,
            "cpu_seconds": rlimits["RLIMIT_CPU"],
            # RLIMIT_NPROC does not bind root: only counted when the program runs as nobody.
            "max_processes": limits.max_processes if drop or os.geteuid() != 0 else None,
            "max_file_mb": limits.max_file_mb,
        },
        "private_tmp": True,
        "interpreter": interpreter,
        "timeout_seconds": limits.timeout,
    }


@functools.lru_cache(maxsize=1)
def log_guards() -> None:
    """Say once which guards are active; the missing network namespace is a warning."""
    guards = active_guards()
    limits = guards["resource_limits"]
    logger.info(
        "Generated code runs in a separate process: %s; user %s; limits: %d MB memory, %d s CPU, %s processes, "
        "%d MB per file; private temporary folder.",
        guards["network"],
        guards["unprivileged_user"] or "unchanged (not root)",
        limits["memory_mb"],
        limits["cpu_seconds"],
        limits["max_processes"] if limits["max_processes"] is not None else "unlimited (root)",
        limits["max_file_mb"],
    )
    if guards["unprivileged_user"] is None and os.geteuid() == 0:
        logger.warning(
            "Generated code runs as root: no Python interpreter could be started as `nobody`, so the "
            "process limit does not bind and the program can write wherever root can."
        )
    if not guards["network_namespace"]:
        logger.warning(
            "No network namespace for generated code on this machine (`unshare --net` failed or is missing): "
            "only an in-process socket guard is active, which the program can bypass."
        )


def run_program(program: str, limits: ExecutionLimits | None = None, **overrides) -> ProgramResult:
    """Run ``program``; it passes when it exits with status 0 within the timeout.

    ``limits`` (or keyword overrides such as ``timeout=5``) set the resource limits; see the module
    docstring for the guards.
    """
    limits = dataclasses.replace(limits or ExecutionLimits(), **overrides)
    log_guards()
    drop, interpreter = _unprivileged_interpreter()
    folder = Path(tempfile.mkdtemp(prefix="mars_hf_exec_"))
    try:
        if drop is not None:
            os.chown(folder, *drop)
        path = folder / "candidate.py"
        path.write_text(_SOCKET_GUARD + "\n" + program, encoding="utf-8")
        settings = {
            "limits": limits.rlimits(),
            "drop_to": drop,
            "program": str(path),
            "interpreter": interpreter,
        }
        command = [*_network_namespace_prefix(), interpreter, "-I", "-c", _LAUNCHER, json.dumps(settings)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(folder), "TMPDIR": str(folder)}
        env.update({"PYTHONHASHSEED": "0", "no_proxy": "*"})
        process = subprocess.Popen(
            command,
            cwd=folder,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=limits.timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.communicate()
            return ProgramResult(False, "timed out", returncode=process.returncode)
        text = output.decode("utf-8", errors="replace")[-2000:]
        passed = process.returncode == 0
        return ProgramResult(passed, "passed" if passed else "failed", text, process.returncode)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
