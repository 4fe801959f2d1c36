"""The launcher's keeper: the process that starts the ranks, stays their parent, and
stops everything they started when the launcher goes, however it goes.

Why a separate process: SIGKILL of the launcher cannot be caught, so whatever cleans
up after it must be another process that survives it, and it must be able to find
every descendant of the ranks. A rank's child that calls ``setsid()`` leaves the
rank's process group, and when its parent dies it is re-parented, normally to init,
where nothing can tell it came from the job. The keeper makes itself a *child
subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux >= 3.4): orphaned descendants
of the ranks are re-parented to it instead, so the keeper's process tree always
holds all of them. It runs in its own session (a kill aimed at the launcher's group
leaves it be) and watches its stdin, which only the launcher holds open: end of file
without a prior ``stop`` means the launcher died, and the keeper SIGKILLs every
descendant at once, round after round (each round's victims hand their children to
the keeper) until it has no child left.

Each rank is its own process group and session (signals reach what it starts) and
gets SIGKILL from the kernel if the keeper dies (``PR_SET_PDEATHSIG``).

Protocol (lines, UTF-8). Launcher to keeper: first one JSON object
``{"cmd": [...], "envs": [{...}, ...], "fds": [[out, err], ...], "grace": s}``
(``fds``: the write ends of each rank's stdout/stderr pipes, inherited by number);
then commands: ``term`` (SIGTERM every descendant), ``kill`` (SIGKILL every
descendant until none is left), ``stop`` (the launcher is finishing: at end of file,
SIGTERM what is left, SIGKILL it after ``grace`` seconds). Keeper to launcher:
``pid <i> <pid>`` or ``fail <i> <reason>`` per rank in order, then ``exit <i>
<code>`` as each rank ends (``code`` as ``Popen.returncode``: negative for a signal).

Run as a script (``python -I -S _keeper.py``); imports only the standard library.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36
_POLL = 0.05  # seconds between looks at the children
_SWEEP_LIMIT = 10.0  # a process that cannot be killed (another user's) is left after this

_Prctl = Callable[[int, int, int, int, int], int]


def _prctl() -> _Prctl | None:
    """``prctl(2)`` through ctypes; ``None`` where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    result: _Prctl = fn
    return result


def descendants(root: int) -> list[int]:
    """Every process below ``root`` in the process tree (from /proc; ``[]`` without it)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) >= 2:
            children.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except OSError:  # gone already, or not ours to signal
        pass


class Keeper:
    def __init__(self, prctl: _Prctl | None) -> None:
        self.prctl = prctl
        self.me = os.getpid()
        self.ranks: list[int] = []  # pids, which are also the ranks' process group ids
        self.rank_of: dict[int, int] = {}
        self.grace = 2.0
        self.stopping = False  # the launcher said "stop": end gently
        self.launcher_gone = False

    def say(self, line: str) -> None:
        if self.launcher_gone:
            return
        try:
            os.write(1, (line + "\n").encode())
        except OSError:  # the launcher died: nobody to tell, the sweep follows
            self.launcher_gone = True

    # -- starting the ranks ---------------------------------------------------------------

    def _preexec(self) -> Callable[[], None] | None:
        prctl, keeper = self.prctl, self.me
        if prctl is None:
            return None

        def preexec() -> None:  # in the child between fork and exec: nothing that locks
            if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
                os._exit(126)  # exec would give a rank that may outlive the keeper
            if os.getppid() != keeper:  # the keeper died before the request took effect
                os._exit(126)

        return preexec

    def start(self, spec: dict[str, Any]) -> None:
        self.grace = float(spec.get("grace", 2.0))
        preexec = self._preexec()
        fds: list[list[int]] = spec["fds"]
        failed = False
        for i, env in enumerate(spec["envs"]):
            out, err = fds[i]
            if not failed:
                try:
                    proc = subprocess.Popen(
                        spec["cmd"],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,  # own group and session
                        close_fds=True,  # no other rank's pipes, not our stdin
                        preexec_fn=preexec,
                    )
                except OSError as e:
                    failed = True
                    self.say(f"fail {i} {e}".replace("\n", " "))
                else:
                    # reaped by waitpid(-1) below; the Popen object is not needed
                    proc.returncode = 0  # so that its finalizer never waits for it
                    self.ranks.append(proc.pid)
                    self.rank_of[proc.pid] = i
                    self.say(f"pid {i} {proc.pid}")
            os.close(out)  # the rank holds its copies; EOF comes when all its writers end
            os.close(err)

    # -- children -------------------------------------------------------------------------

    def reap(self) -> bool:
        """Collect every child that ended (reporting ranks); False once none is left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            rank = self.rank_of.pop(pid, None)
            if rank is not None:
                self.say(f"exit {rank} {os.waitstatus_to_exitcode(status)}")

    def signal_all(self, sig: int) -> None:
        for pid in self.ranks:
            _signal(pid, sig, group=True)
        for pid in descendants(self.me):
            _signal(pid, sig)

    def sweep(self) -> None:
        """SIGKILL every descendant, round after round, until the keeper has no child.

        Killing a process hands its children to the keeper (the subreaper): no child
        of ours left means no descendant left. Without the subreaper (not Linux), the
        ranks' process groups are what can be reached.
        """
        deadline = time.monotonic() + _SWEEP_LIMIT
        while True:
            self.signal_all(signal.SIGKILL)
            if not self.reap() or time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def finish(self) -> None:
        """The launcher is gone or done: nothing the ranks started may stay."""
        if self.stopping and not self.launcher_gone:
            # a normal end: what is left gets SIGTERM and the grace period first
            self.signal_all(signal.SIGTERM)
            deadline = time.monotonic() + self.grace
            while self.reap() and time.monotonic() < deadline:
                time.sleep(0.02)
        self.sweep()


class _Lines:
    """Whole lines from a file descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.eof = False

    def read(self) -> list[str]:
        data = os.read(self.fd, 65536)
        if not data:
            self.eof = True
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return [line.decode() for line in lines]


def main() -> int:
    # (SIGINT is left alone: the keeper's own session keeps a terminal's ^C away, and an
    # ignored signal would stay ignored in the ranks across exec)
    stop_now: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGHUP):  # asked to go: take the ranks along
        signal.signal(sig, lambda s, _f: stop_now.append(s))
    # A child's end wakes the loop at once (the launcher learns of it without a poll's delay)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda _s, _f: None)
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    keeper = Keeper(prctl)
    stdin = _Lines(0)
    pending: list[str] = []
    while not pending:
        pending = stdin.read()
        if stdin.eof and not pending:
            return 0  # the launcher died before it said what to run
    keeper.start(json.loads(pending.pop(0)))
    while True:
        for command in pending:
            if command == "term":
                keeper.signal_all(signal.SIGTERM)
            elif command == "kill":
                keeper.sweep()
            elif command == "stop":
                keeper.stopping = True
        pending = []
        if stdin.eof or stop_now:
            keeper.launcher_gone = keeper.launcher_gone or not keeper.stopping
            keeper.finish()
            return 0
        readable, _, _ = select.select([0, wake_r], [], [], _POLL)
        if wake_r in readable:
            os.read(wake_r, 4096)
        if 0 in readable:
            pending = stdin.read()
        keeper.reap()


if __name__ == "__main__":
    sys.exit(main())
