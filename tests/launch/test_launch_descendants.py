"""What a rank starts goes with the launcher, even a process that left the rank's process
group (``setsid()``): the README's promise for ``python -m pynccl launch``.

Each test starts the launcher in a subprocess; the ranks write the pids of what they
started to files, and every check is by pid (``/proc/<pid>/stat``), never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the subreaper and /proc are Linux's"
)


# A rank that starts `sleep 300` in a session of its own (setsid: a new process group
# too, so no signal aimed at the rank's group reaches it), in one of three shapes:
#   child    - the rank's own child;
#   orphan   - a double fork: its parent exits at once, so it is orphaned while the rank runs;
#   deep     - the setsid child starts its own child and waits for it.
RANK = """
import os, subprocess, sys, time
shape, out = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
if shape == "child":
    p = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL)
    pids = [p.pid]
elif shape == "orphan":
    r, w = os.pipe()
    mid = os.fork()
    if mid == 0:
        os.close(r)
        p = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL)
        os.write(w, str(p.pid).encode())
        os._exit(0)
    os.close(w)
    pids = [int(os.read(r, 64))]
    os.waitpid(mid, 0)
else:
    p = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys; c = subprocess.Popen(['sleep', '300']); "
         "print(c.pid, flush=True); c.wait()"],
        start_new_session=True, stdout=subprocess.PIPE, text=True)
    pids = [p.pid, int(p.stdout.readline())]
with open(os.path.join(out, f"pids-{rank}.tmp"), "w") as f:
    f.write(" ".join(map(str, [os.getpid(), *pids])))
os.rename(os.path.join(out, f"pids-{rank}.tmp"), os.path.join(out, f"pids-{rank}"))
print("ready", flush=True)
if os.environ.get("RANK_EXITS") != "1":
    time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie is dead, whoever has yet to reap it


def _session(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[3])  # state ppid pgrp session


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "PYNCCL_"))}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


@pytest.fixture
def started() -> Iterator[list[int]]:
    """Pids to SIGKILL at the end of the test whatever happens (by pid, never by name)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _start(tmp_path: Path, shape: str, n: int, **env: str) -> subprocess.Popen[bytes]:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pynccl",
            "launch",
            "-n",
            str(n),
            "--grace",
            "1",
            str(script),
            shape,
            str(tmp_path),
        ],
        env=_env(**env),
        cwd=str(ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for_pids(tmp_path: Path, n: int, launcher: subprocess.Popen[bytes]) -> list[list[int]]:
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pids-[0-9]"))) < n:
        assert launcher.poll() is None or launcher.returncode == 0, launcher.stderr
        assert time.monotonic() < deadline, "the ranks never wrote their pids"
        time.sleep(0.05)
    return [[int(x) for x in p.read_text().split()] for p in sorted(tmp_path.glob("pids-[0-9]"))]


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if _alive(p)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["child", "orphan", "deep"])
def test_setsid_descendants_die_with_a_sigkilled_launcher(
    tmp_path: Path, shape: str, started: list[int]
) -> None:
    n = 2
    launcher = _start(tmp_path, shape, n)
    started.append(launcher.pid)
    rows = _wait_for_pids(tmp_path, n, launcher)
    ranks = [row[0] for row in rows]
    escaped = [pid for row in rows for pid in row[1:]]
    started.extend(ranks + escaped)
    # the premise: they are alive, and out of the ranks' sessions and process groups
    assert all(_alive(p) for p in ranks + escaped)
    assert not {_session(p) for p in escaped} & {_session(p) for p in ranks}
    os.kill(launcher.pid, signal.SIGKILL)  # what a scheduler does: nothing can catch it
    launcher.wait(timeout=10)
    assert _gone_within(ranks + escaped, 8.0) == [], "outlived the SIGKILLed launcher"


def test_setsid_descendants_of_finished_ranks_are_stopped(
    tmp_path: Path, started: list[int]
) -> None:
    # The ranks exit 0 at once, leaving a setsid'd child: the launcher ends (exit 0),
    # and it does not leave that child behind.
    n = 2
    launcher = _start(tmp_path, "orphan", n, RANK_EXITS="1")
    started.append(launcher.pid)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    rows = _wait_for_pids(tmp_path, n, launcher)
    escaped = [pid for row in rows for pid in row[1:]]
    started.extend(escaped)
    assert _gone_within(escaped, 8.0) == [], "outlived the launcher that finished"


def test_keeper_dies_with_the_launcher_and_leaves_no_zombie(
    tmp_path: Path, started: list[int]
) -> None:
    # The keeper (the ranks' parent) is found by the ranks' parent pid; after the
    # launcher's SIGKILL it ends too, having reaped everything.
    n = 1
    launcher = _start(tmp_path, "deep", n)
    started.append(launcher.pid)
    ((rank, *escaped),) = _wait_for_pids(tmp_path, n, launcher)
    with open(f"/proc/{rank}/stat") as f:
        keeper = int(f.read().rsplit(")", 1)[1].split()[1])
    started.extend([rank, *escaped, keeper])
    assert keeper != launcher.pid and _alive(keeper)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    assert _gone_within([rank, *escaped, keeper], 8.0) == []


SIGNAL_MASKS = """
import sys
fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("masks", *(fields[k].strip() for k in ("SigIgn", "SigBlk")))
"""


@pytest.mark.slow
def test_ranks_start_with_the_signal_dispositions_of_a_plain_child(tmp_path: Path) -> None:
    # The keeper stands between the launcher and the ranks: nothing it ignores or blocks
    # may leak into them (an ignored SIGINT would survive exec and make ^C a no-op).
    script = tmp_path / "masks.py"
    script.write_text(SIGNAL_MASKS)
    direct = subprocess.run(
        [sys.executable, str(script)], env=_env(), capture_output=True, text=True, check=True
    ).stdout.split()
    proc = subprocess.run(
        [sys.executable, "-m", "pynccl", "launch", "-n", "2", str(script)],
        env=_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = sorted(line.split()[2:] for line in proc.stdout.splitlines())
    assert rows == [direct, direct]
