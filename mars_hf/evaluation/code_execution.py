"""Run generated code (HumanEval completions and their tests) in a separate, limited process.

Every program runs in a fresh ``python -I`` process started through a small launcher that, before
the program starts, applies the guards below (probed once, reported by :func:`active_guards`):

* **resource limits** (``resource.setrlimit``): address space, CPU seconds, number of processes,
  size of any file written, no core dumps;
* a **private folder** (mode 0700), removed afterwards: working directory, ``HOME`` and ``TMPDIR``,
  and an environment with nothing but ``PATH``;
* **its own namespaces** through ``unshare`` (as root; ``--map-root-user`` otherwise):

  - *network*: empty, so no connection leaves. Without it only an in-process ``socket`` guard
    remains, which the program can bypass (``import _socket``).
  - *PID*: the program is the namespace's first process, so at the timeout (or when it exits) the
    kernel kills every process it started, however they detached (``setsid``, double fork, a
    daemon that keeps stdout open); ``/proc`` is mounted for that namespace, so the program sees
    only its own processes. Without it only the program's process group is killed (a child that
    called ``setsid`` survives), and the machine's processes and command lines are visible.
  - *mount*: a tmpfs of ``max_disk_mb`` is the private folder as the program sees it, and
    ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/run/lock`` (the world-writable folders) are views of
    it: everything it writes is capped in total and gone with it. Without it those writes land in
    the machine's real folders, uncapped, and stay there.
  - *IPC*: SysV shared memory, semaphores and message queues are the namespace's own (shared
    memory capped at ``memory_mb``) and die with it. Without it a segment outlives the program, and
    the next program can read it.

* an **unprivileged user** (``nobody``) when the evaluation runs as root, so the process cannot write
  the caller's files and the process limit counts only its own processes.

Where a namespace is missing, :func:`run_program` refuses (:class:`SandboxUnavailableError`, naming
what is missing) unless the caller opts in to the weaker sandbox (``allow_weak_sandbox=True`` or
``MARS_HF_ALLOW_WEAK_SANDBOX=1``); it then runs with a warning for each missing guard.

The wall-clock bound holds in every case: output is read with a deadline, never until the pipe
closes, so a detached process that keeps stdout open cannot hold the call up.

This is a guard against accidents (an infinite loop, a runaway allocation, a stray ``rm`` or a
download), not a security sandbox for hostile code.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

NOBODY_UID = NOBODY_GID = 65534
NAMESPACES = ("net", "pid", "mount", "ipc")
NAMESPACE_NAMES = {"net": "network", "pid": "PID", "mount": "mount", "ipc": "IPC"}
# Opt-in to run generated code with fewer guards than the full set when this machine cannot give them.
WEAK_SANDBOX_ENV = "MARS_HF_ALLOW_WEAK_SANDBOX"
# Files the private tmpfs holds at most: each costs kernel memory that its size cap does not count.
MAX_FILES = 16384
_PAGE = os.sysconf("SC_PAGE_SIZE")
# The world-writable folders a program could leave files in; with a mount namespace each is a view of
# the private folder (those that exist here as real folders, not links).
PRIVATE_VIEWS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
EXIT_GRACE_SECONDS = 0.5  # after the program exits: how long to read what a leftover process still writes
KILL_GRACE_SECONDS = 2.0  # for the PID namespace to empty after its first process is killed
OUTPUT_KEEP = 2000  # characters of output kept (the end)

_SOCKET_GUARD = """\
import socket as _socket


def _network_disabled(*args, **kwargs):
    raise OSError("network access is disabled while running generated code")


for _name in ("socket", "create_connection", "create_server", "getaddrinfo", "socketpair", "fromfd"):
    setattr(_socket, _name, _network_disabled)
del _name, _socket
"""

# Runs first in the child (one thread, nothing imported but the standard library), inside the
# namespaces. With a mount namespace: a size-capped tmpfs on the first world-writable folder (the
# program copied in from the private folder), bound onto the others, and a fresh mqueue file system; with a PID
# namespace, a fork, so that the program is the namespace's first process while this one waits and ends
# as it ended (the signal included; `unshare --fork` reports signals wrongly in util-linux 2.38), and
# /proc mounted for that namespace; with an IPC namespace, its SysV shared memory capped. Then limits,
# the privilege drop, and exec of the program itself (limits survive exec).
_LAUNCHER = """\
import ctypes, json, os, resource, signal, sys
settings = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target, kind, flags, options=None):
    encode = lambda text: None if text is None else text.encode()
    if libc.mount(encode(source), encode(target), encode(kind), flags, encode(options)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot mount {kind or source} on {target}: {os.strerror(error)}")


if settings["tmpfs"] is not None:
    home = (settings["views"] or [os.getcwd()])[0]
    program = open("candidate.py", "rb").read() if os.path.exists("candidate.py") else None
    mount("tmpfs", home, "tmpfs", 2 | 4, settings["tmpfs"])  # MS_NOSUID | MS_NODEV
    os.chdir(home)
    if program is not None:
        with open("candidate.py", "wb") as handle:
            handle.write(program)
    for view in settings["views"][1:]:
        mount(home, view, None, 4096)  # MS_BIND
    if settings["mqueue"]:  # a mqueue mount belongs to the IPC namespace it was made in
        mount("mqueue", "/dev/mqueue", "mqueue", 2 | 4 | 8)
if settings["pid_namespace"]:
    child = os.fork()
    if child:
        status = os.waitpid(child, 0)[1]
        if os.WIFSIGNALED(status):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if os.WTERMSIG(status) != signal.SIGKILL:
                signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
            os._exit(128 + os.WTERMSIG(status))
        os._exit(os.waitstatus_to_exitcode(status) % 256)
    if settings["own_proc"]:  # only the namespace's processes (in the namespace's first process)
        mount("proc", "/proc", "proc", 2 | 4 | 8)  # MS_NOSUID | MS_NODEV | MS_NOEXEC
for name, value in settings["ipc_limits"].items():  # per IPC namespace
    with open(f"/proc/sys/kernel/{name}", "w") as handle:
        handle.write(str(value))
for name, value in settings["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if settings["drop_to"] is not None:
    uid, gid = settings["drop_to"]
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
if settings["pid_namespace"]:  # after the drop, which clears it: end with the waiting parent
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
interpreter = settings["interpreter"]
if settings["program"] == "-c":  # the probe: can this user start this interpreter here?
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
    max_disk_mb: int = 256

    def __post_init__(self):
        if self.max_disk_mb < 1:
            raise ValueError(f"max_disk_mb must be at least 1 (MB), got {self.max_disk_mb!r}")

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


@dataclasses.dataclass(frozen=True)
class Isolation:
    """How programs start on this machine: the ``unshare`` prefix and the namespaces it gives, the
    user to switch to (``None``: unchanged) and the interpreter that user can run."""

    prefix: tuple[str, ...]
    namespaces: frozenset[str]
    drop: tuple[int, int] | None
    interpreter: str

    def views(self) -> list[str]:
        """The world-writable folders that become views of the private folder (mount namespace only)."""
        if "mount" not in self.namespaces:
            return []
        return [v for v in PRIVATE_VIEWS if os.path.isdir(v) and not os.path.islink(v)]

    def own_proc(self) -> bool:
        """/proc shows only the program's processes: needs its PID namespace and a mount namespace for /proc."""
        return {"pid", "mount"} <= self.namespaces

    def missing(self) -> list[str]:
        """The guards a full sandbox has and this one lacks, in words."""
        missing = [f"{NAMESPACE_NAMES[name]} namespace" for name in NAMESPACES if name not in self.namespaces]
        if "mount" not in self.namespaces:
            missing += ["private /tmp views", "total disk cap"]
        if not self.own_proc():
            missing.append("own /proc")
        return missing

    def settings(self, limits: ExecutionLimits, program: str) -> dict:
        """What the launcher applies for ``program`` (``"-c"``: the probe)."""
        tmpfs = None
        if "mount" in self.namespaces:
            tmpfs = f"size={limits.max_disk_mb}m,nr_inodes={MAX_FILES},mode=0700"
            if self.drop is not None:
                tmpfs += f",uid={self.drop[0]},gid={self.drop[1]}"
        ipc_limits = {}
        if "ipc" in self.namespaces:  # SysV shared memory counts against the memory limit
            ipc_limits = {"shmmax": limits.memory_mb * 2**20, "shmall": limits.memory_mb * 2**20 // _PAGE}
        return {
            "limits": limits.rlimits() if program != "-c" else {},
            "drop_to": self.drop,
            "program": program,
            "interpreter": self.interpreter,
            "views": self.views(),
            "tmpfs": tmpfs,
            "mqueue": {"mount", "ipc"} <= self.namespaces and os.path.isdir("/dev/mqueue"),
            "pid_namespace": "pid" in self.namespaces,
            "own_proc": self.own_proc(),
            "ipc_limits": ipc_limits,
        }


class SandboxUnavailableError(RuntimeError):
    """This machine cannot give generated code the full sandbox, and no one opted in to a weaker one."""


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
        if _launches((), Isolation((), frozenset(), drop, interpreter)):
            return drop, interpreter
    return None, sys.executable


def _launches(prefix: tuple[str, ...], isolation: Isolation) -> bool:
    """Whether the launcher starts an interpreter under ``prefix`` with ``isolation``'s user and views."""
    folder = tempfile.mkdtemp(prefix="mars_hf_probe_")
    try:
        if isolation.drop is not None:
            os.chown(folder, *isolation.drop)
        settings = isolation.settings(ExecutionLimits(), "-c")
        command = [*prefix, isolation.interpreter, "-I", "-c", _LAUNCHER, json.dumps(settings)]
        probe = subprocess.run(command, capture_output=True, timeout=10, cwd=folder)
        return probe.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _unshare_prefix(unshare: str, names: tuple[str, ...], flavour: tuple[str, ...]) -> tuple[str, ...]:
    prefix = [unshare, *flavour]
    if "net" in names:
        prefix.append("--net")
    if "pid" in names:  # the launcher's child (the program) becomes the namespace's first process
        prefix.append("--pid")
    if "mount" in names:  # unshare makes the new namespace's mounts private (nothing propagates back)
        prefix.append("--mount")
    if "ipc" in names:  # SysV shared memory, semaphores and message queues die with the namespace
        prefix.append("--ipc")
    return tuple(prefix)


@functools.lru_cache(maxsize=1)
def _isolation() -> Isolation:
    """The most namespaces this machine gives a program (all four, then three, ...), probed once."""
    drop, interpreter = _unprivileged_interpreter()
    unshare = shutil.which("unshare")
    if unshare is not None:
        flavours = [()] if os.geteuid() == 0 else []
        flavours.append(("--map-root-user",))
        for size in range(len(NAMESPACES), 0, -1):
            for names in itertools.combinations(NAMESPACES, size):
                for flavour in flavours:
                    prefix = _unshare_prefix(unshare, names, flavour)
                    isolation = Isolation(prefix, frozenset(names), drop, interpreter)
                    if _launches(prefix, isolation):
                        return isolation
    return Isolation((), frozenset(), drop, interpreter)


def active_guards(limits: ExecutionLimits | None = None) -> dict:
    """Which guards generated code runs under on this machine (what :func:`run_program` applies)."""
    limits = limits or ExecutionLimits()
    isolation = _isolation()
    netns = "net" in isolation.namespaces
    pidns = "pid" in isolation.namespaces
    ipcns = "ipc" in isolation.namespaces
    rlimits = limits.rlimits()
    return {
        "network_namespace": netns,
        "network": "empty network namespace" if netns else "in-process socket guard only (bypassable)",
        "pid_namespace": pidns,
        "detached_processes": "killed with the PID namespace"
        if pidns
        else "only the process group is killed: a child that calls setsid survives",
        "private_tmp_views": isolation.views(),
        "ipc_namespace": ipcns,
        "sysv_ipc": f"private, shared memory capped at {limits.memory_mb} MB"
        if ipcns
        else "the machine's: segments outlive the program and other programs can read them",
        "own_proc": isolation.own_proc(),
        "disk_cap_mb": limits.max_disk_mb if "mount" in isolation.namespaces else None,
        "missing": isolation.missing(),
        "unprivileged_user": "nobody" if isolation.drop else None,
        "resource_limits": {
            "memory_mb": limits.memory_mb,
            "cpu_seconds": rlimits["RLIMIT_CPU"],
            # RLIMIT_NPROC does not bind root: only counted when the program runs as nobody.
            "max_processes": limits.max_processes if isolation.drop or os.geteuid() != 0 else None,
            "max_file_mb": limits.max_file_mb,
            "max_disk_mb": limits.max_disk_mb if "mount" in isolation.namespaces else None,
        },
        "private_tmp": True,
        "interpreter": isolation.interpreter,
        "timeout_seconds": limits.timeout,
    }


@functools.lru_cache(maxsize=1)
def log_guards() -> None:
    """Say once which guards are active; each missing namespace (or user switch) is a warning."""
    guards = active_guards()
    limits = guards["resource_limits"]
    logger.info(
        "Generated code runs in a separate process: %s; %s%s; SysV IPC %s; private views of %s (%s); user %s; "
        "limits: %d MB memory, %d s CPU, %s processes, %d MB per file; private folder.",
        guards["network"],
        "own PID namespace" if guards["pid_namespace"] else "no PID namespace",
        " and /proc" if guards["own_proc"] else "",
        guards["sysv_ipc"],
        ", ".join(guards["private_tmp_views"]) or "nothing",
        f"{guards['disk_cap_mb']} MB in all" if guards["disk_cap_mb"] else "no disk cap",
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
    if not guards["pid_namespace"]:
        logger.warning(
            "No PID namespace for generated code on this machine (`unshare --pid` failed or is "
            "missing): a timeout kills the program's process group, but a child that calls setsid survives."
        )
    if not guards["private_tmp_views"]:
        logger.warning(
            "No mount namespace for generated code on this machine (`unshare --mount` failed or is missing): "
            "files it writes to /tmp, /var/tmp or /dev/shm stay there, and no cap bounds the disk it fills."
        )
    if not guards["ipc_namespace"]:
        logger.warning(
            "No IPC namespace for generated code on this machine (`unshare --ipc` failed or is missing): "
            "SysV shared memory it leaves behind stays allocated, and later programs can read it."
        )
    if not guards["own_proc"]:
        logger.warning(
            "No /proc of its own for generated code on this machine (needs the PID and mount namespaces): "
            "it sees every process of the machine and their command lines."
        )


def _refuse_weaker(isolation: Isolation) -> None:
    """Raise unless the full sandbox is here or the caller opted in to what this machine gives."""
    missing = isolation.missing()
    if not missing:
        return
    if shutil.which("unshare") is None:
        cause = "the `unshare` command (util-linux) is missing"
    elif os.geteuid() != 0:
        cause = "`unshare` failed: run as root, or enable unprivileged user namespaces"
    else:
        cause = "`unshare` failed as root (a container without CAP_SYS_ADMIN or a seccomp filter?)"
    raise SandboxUnavailableError(
        f"Refusing to run generated code in a weaker sandbox: no {', no '.join(missing)} on this machine "
        f"({cause}). To run it anyway with only the guards this machine has (active_guards() lists them), "
        f"set {WEAK_SANDBOX_ENV}=1 or pass allow_weak_sandbox=True to run_program."
    )


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (with a PID namespace: the namespace's first process)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except OSError:
        pass
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return children


def _read_until_exit(process: subprocess.Popen, deadline: float) -> tuple[bytes, bool]:
    """The program's output, and whether it exited by ``deadline``.

    Reads until the program exits, then what is still in the pipe (until EOF or a short grace), never
    past the deadline: a process that detached and keeps stdout open cannot hold the call up.
    """
    output = bytearray()
    fd = process.stdout.fileno()
    os.set_blocking(fd, False)
    exited_at = None
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        eof = False
        while True:
            now = time.monotonic()
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and (eof or now >= exited_at + EXIT_GRACE_SECONDS):
                break
            if now >= deadline:
                break
            if eof:  # stdout closed but the program runs on: wait for it, not for the pipe
                try:
                    process.wait(timeout=deadline - now)
                except subprocess.TimeoutExpired:
                    pass
                continue
            end = deadline if exited_at is None else min(deadline, exited_at + EXIT_GRACE_SECONDS)
            if selector.select(min(end - now, 0.05)):
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    eof = True
                    continue
                output += chunk
                if len(output) > 4 * OUTPUT_KEEP:
                    del output[: -4 * OUTPUT_KEEP]
    return bytes(output), exited_at is not None


def _kill_everything(process: subprocess.Popen, pid_namespace: bool) -> None:
    """Kill the program and all it started; wait for them where a PID namespace makes that possible."""
    if process.poll() is None and pid_namespace:
        # Killing the namespace's first process makes the kernel kill the rest, and the launcher (its
        # parent, which waits for it) exits once the namespace is empty.
        for child in _children(process.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            process.wait(timeout=KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    try:  # the session's group: the launcher, or without a PID namespace the program and its undetached children
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    process.stdout.close()


def run_program(
    program: str,
    limits: ExecutionLimits | None = None,
    *,
    allow_weak_sandbox: bool | None = None,
    **overrides,
) -> ProgramResult:
    """Run ``program``; it passes when it exits with status 0 within the timeout.

    ``limits`` (or keyword overrides such as ``timeout=5``) set the resource limits; see the module
    docstring for the guards. Returns by ``timeout`` (plus the moment killing takes) in every case.
    Raises :class:`SandboxUnavailableError` where this machine lacks a guard, unless
    ``allow_weak_sandbox`` (default: the ``MARS_HF_ALLOW_WEAK_SANDBOX`` environment variable is ``1``).
    """
    limits = dataclasses.replace(limits or ExecutionLimits(), **overrides)
    isolation = _isolation()
    if allow_weak_sandbox is None:
        allow_weak_sandbox = os.environ.get(WEAK_SANDBOX_ENV, "").lower() in ("1", "true", "yes")
    if not allow_weak_sandbox:
        _refuse_weaker(isolation)
    log_guards()
    folder = Path(tempfile.mkdtemp(prefix="mars_hf_exec_"))
    try:
        if isolation.drop is not None:
            os.chown(folder, *isolation.drop)
        (folder / "candidate.py").write_text(_SOCKET_GUARD + "\n" + program, encoding="utf-8")
        views = isolation.views()
        inside = views[0] if views else str(folder)  # the private folder as the program sees it
        settings = isolation.settings(limits, f"{inside}/candidate.py")
        command = [*isolation.prefix, isolation.interpreter, "-I", "-c", _LAUNCHER, json.dumps(settings)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": inside, "TMPDIR": inside}
        env.update({"PYTHONHASHSEED": "0", "no_proxy": "*"})
        deadline = time.monotonic() + limits.timeout
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
            output, exited = _read_until_exit(process, deadline)
        finally:
            _kill_everything(process, "pid" in isolation.namespaces)
        text = output.decode("utf-8", errors="replace")[-OUTPUT_KEEP:]
        if not exited:
            return ProgramResult(False, "timed out", text, process.returncode)
        passed = process.returncode == 0
        return ProgramResult(passed, "passed" if passed else "failed", text, process.returncode)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
