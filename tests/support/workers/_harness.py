"""Test-side helpers for the multi-process tests that run the scripts in this directory.

Used by ``tests/launch/test_launch_e2e.py`` and ``tests/comm/test_failure.py``: environments for
child processes on the loopback libraries (with every launcher's variables removed,
so that only the convention a test fakes is seen), bounded waits on output files,
and the checks that a job left nothing behind (processes, process groups, shared
memory). Everything here reads ``/proc``; nothing needs psutil.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
WORKERS = Path(__file__).resolve().parent
#: Upper bound on any one wait for a child process or its output (seconds).
WAIT = 90.0

# Variables through which some launcher could describe a job: none may reach a child
# unless the test sets it on purpose.
_LAUNCHER_PREFIXES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_",
    "TORCHELASTIC_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "SLURM_",
    "CUDA_VISIBLE_DEVICES",
    "PYNCCL_LAUNCHER",
    "PYNCCL_RENDEZVOUS_KEY",
    "PYNCCL_LOOPBACK_",
    "NCCL_",
)

_MARKER = re.compile(r"^(?:\[rank (\d+)\] )?(\S+)((?: \w+=\S*)*)\s*$")


def loopback_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without launcher variables, plus the loopback libraries and ``extra``.

    Skips the calling test when the loopback libraries cannot be built here.
    """
    from pynccl.testing import loopback

    try:
        lb = loopback.env()
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"the loopback libraries cannot be built here: {exc}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(lb)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def new_key() -> str:
    """A fresh rendezvous key (what a launcher would generate per job)."""
    return secrets.token_hex(16)


def worker(name: str) -> str:
    """Path of the worker script ``name`` (``"collectives.py"``, ...)."""
    path = WORKERS / name
    if not path.is_file():
        raise FileNotFoundError(path)
    return str(path)


# -- markers --------------------------------------------------------------------------------


def markers(text: str, tag: str) -> dict[int, dict[str, str]]:
    """Lines ``[rank k] TAG key=value ...`` (or without the prefix) -> ``{rank: fields}``.

    The rank is the ``rank=`` field when present, else the launcher's prefix. A
    rank reporting the same tag twice is an error (the test would hide it).
    """
    out: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        m = _MARKER.match(line)
        if m is None or m.group(2) != tag:
            continue
        fields = dict(item.split("=", 1) for item in m.group(3).split())
        rank = int(fields.get("rank", m.group(1) if m.group(1) is not None else -1))
        if m.group(1) is not None and "rank" in fields:
            assert int(m.group(1)) == rank, f"prefix and rank= disagree in {line!r}"
        assert rank not in out, f"rank {rank} reported {tag} twice:\n{text}"
        out[rank] = fields
    return out


def wait_for_output(
    path: Path,
    done: Callable[[str], bool],
    *,
    timeout: float = WAIT,
    procs: Sequence[subprocess.Popen[bytes]] = (),
) -> str:
    """Poll the file ``path`` until ``done(text)``; fail if ``timeout`` passes or every
    process of ``procs`` has exited without it."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        if done(text):
            return text
        if procs and all(p.poll() is not None for p in procs):
            text = path.read_text(errors="replace") if path.exists() else ""
            if done(text):
                return text
            pytest.fail(f"the processes exited before the expected output appeared:\n{text}")
        if time.monotonic() >= deadline:
            pytest.fail(f"no expected output within {timeout:g} s:\n{text}")
        time.sleep(0.05)


# -- processes -------------------------------------------------------------------------------


def start(
    argv: Sequence[str], env: Mapping[str, str], out: Path, err: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own (so its whole group can be stopped), with
    stdout to ``out`` and stderr to ``err`` (default: the same file)."""
    with open(out, "ab") as fout, open(err if err is not None else out, "ab") as ferr:
        return subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=fout,
            stderr=ferr,
            start_new_session=True,
        )


def python(script: str, *args: str) -> list[str]:
    """The command line running ``script`` with this interpreter."""
    return [sys.executable, "-u", script, *args]


def launch(nproc: int, script: str, *args: str, grace: float | None = None) -> list[str]:
    """The command line of ``python -m pynccl launch -n nproc --loopback script args``."""
    argv = [sys.executable, "-m", "pynccl", "launch", "-n", str(nproc), "--loopback"]
    if grace is not None:
        argv += ["--grace", str(grace)]
    return [*argv, script, *args]


def wait_all(procs: Iterable[subprocess.Popen[bytes]], timeout: float = WAIT) -> list[int]:
    """Exit codes of ``procs``, waiting at most ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {p.pid} {p.args!r} still runs after {timeout:g} s")
    return codes


def stop(procs: Iterable[subprocess.Popen[bytes]], groups: Iterable[int] = ()) -> None:
    """Kill ``procs`` and every process in their groups and in ``groups``; reap ``procs``.

    Meant for ``finally`` blocks: never raises for processes that are already gone.
    """
    procs = list(procs)
    for pgid in {p.pid for p in procs} | set(groups):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/pid/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is dead: it only waits to be reaped)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def members(pgids: Iterable[int]) -> list[int]:
    """Live processes (not zombies) whose process group is one of ``pgids``."""
    wanted = set(pgids)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) in wanted:
            found.append(int(entry))
    return found


def assert_nothing_running(pids: Iterable[int], *, within: float = 20.0) -> None:
    """No process of ``pids`` and none in their process groups (each worker leads its own
    group) is alive, waiting up to ``within`` seconds for them to go."""
    pids = set(pids)
    deadline = time.monotonic() + within
    while True:
        left = sorted({p for p in pids if alive(p)} | set(members(pids)))
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert left == [], f"processes left running: {left}"


def mapped_shm(pid: int) -> set[str]:
    """Names of the ``/dev/shm/pynccl*`` segments mapped by process ``pid``."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.split(maxsplit=5)[5:]
                # a loopback world: a memfd (older builds: a /dev/shm file)
                if path and path[0].startswith(("/dev/shm/pynccl", "/memfd:pynccl")):
                    names.add(path[0].split()[0].rsplit("/", 1)[1].removeprefix("memfd:"))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return names


def assert_no_shm(names: Iterable[str], *, within: float = 10.0) -> None:
    """None of the shared-memory segments ``names`` is still in ``/dev/shm``."""
    names = set(names)
    deadline = time.monotonic() + within
    while True:
        left = sorted(n for n in names if os.path.exists(f"/dev/shm/{n}"))
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert left == [], f"shared memory left in /dev/shm: {left}"
