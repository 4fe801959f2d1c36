"""The launcher's supervisor: the local ranks as child processes (each in its own process
group, each dying with the launcher), their output prefixed line by line, failures,
signals and timeouts turned into one exit code, and nothing left behind."""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO

__all__ = ["Job"]

_MAX_LINE = 1 << 20  # longer lines are split (each piece still prefixed and whole)
_POLL = 0.05  # seconds between checks of the children
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# The keeper: a tiny process outside the ranks' groups that outlives a killed launcher just
# long enough to SIGKILL the ranks' whole process groups (what the ranks started, too; the
# parent-death signal reaches the ranks only). It reads its stdin, which only the launcher
# holds open, until EOF: "done" first means the launcher stopped the ranks itself.
_KEEPER = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
said = b""
while True:
    chunk = os.read(0, 16)
    if not chunk:
        break
    said += chunk
if said != b"done":
    for group in sys.argv[1:]:
        try:
            os.killpg(int(group), signal.SIGKILL)
        except OSError:
            pass
"""


def _die_with_launcher() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies,
    however it dies; ``None`` where ``prctl`` is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    launcher = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec: nothing that locks
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)  # exec would give a rank that may outlive us
        if os.getppid() != launcher:  # we died before the request took effect
            os._exit(126)

    return preexec


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Sink:
    """One of the launcher's own output streams, written whole lines at a time."""

    def __init__(self, stream: IO[str]) -> None:
        self._text = stream
        self._binary: IO[bytes] | None = getattr(stream, "buffer", None)
        self.broken = False

    def write(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            if self._binary is not None:
                self._binary.write(data)
            else:
                self._text.write(data.decode("utf-8", "replace"))
        except OSError:  # our reader went away (| head): keep supervising silently
            self.broken = True

    def flush(self) -> None:
        if self.broken:
            return
        try:
            if self._binary is not None:
                self._binary.flush()
            self._text.flush()
        except OSError:
            self.broken = True


class _Stream:
    __slots__ = ("buf", "fd", "pipe", "prefix", "sink")

    def __init__(self, pipe: IO[bytes], prefix: bytes, sink: _Sink) -> None:
        self.pipe = pipe  # closed through its file object, which owns the descriptor
        self.fd = pipe.fileno()
        self.prefix = prefix
        self.sink = sink
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data
        start = 0
        while True:
            nl = self.buf.find(b"\n", start)
            if nl < 0:
                break
            self.sink.write(self.prefix + bytes(self.buf[start : nl + 1]))
            start = nl + 1
        del self.buf[:start]
        while len(self.buf) >= _MAX_LINE:
            self.sink.write(self.prefix + bytes(self.buf[:_MAX_LINE]) + b"\n")
            del self.buf[:_MAX_LINE]

    def finish(self) -> None:
        if self.buf:
            self.sink.write(self.prefix + bytes(self.buf) + b"\n")
            self.buf.clear()


class Job:
    def __init__(
        self, cmd: list[str], envs: list[dict[str, str]], grace: float, timeout: float | None
    ) -> None:
        self.cmd = cmd
        self.envs = envs
        self.ranks = [int(env["RANK"]) for env in envs]  # global ranks; lists index local ones
        self.grace = grace
        self.timeout = timeout
        self.out = _Sink(sys.stdout)
        self.err = _Sink(sys.stderr)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.codes: dict[int, int] = {}
        self.sel = selectors.DefaultSelector()
        self.streams: dict[int, _Stream] = {}
        self.failure: tuple[int, int] | None = None
        self.signalled: int | None = None
        self.timed_out = False
        self.kill_at: float | None = None
        self.wake_r, self.wake_w = socket.socketpair()
        self.preexec = _die_with_launcher()
        self.keeper: subprocess.Popen[bytes] | None = None

    def say(self, text: str) -> None:
        self.err.write(f"pynccl launch: {text}\n".encode())
        self.err.flush()

    # -- process groups ---------------------------------------------------------------

    def _signal_group(self, rank: int, sig: int) -> None:
        try:
            os.killpg(self.procs[rank].pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def _group_alive(self, rank: int) -> bool:
        try:
            os.killpg(self.procs[rank].pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def stop_all(self, sig: int) -> None:
        """Send ``sig`` to every group still alive and arm the SIGKILL deadline."""
        for rank in range(len(self.procs)):
            self._signal_group(rank, sig)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace

    def kill_all(self) -> None:
        for rank in range(len(self.procs)):
            self._signal_group(rank, signal.SIGKILL)

    # -- main loop ----------------------------------------------------------------------

    def start(self) -> None:
        for rank, env in enumerate(self.envs):
            proc = subprocess.Popen(
                self.cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own process group: signals reach grandchildren
                close_fds=True,
                preexec_fn=self.preexec,  # dies with the launcher
            )
            self.procs.append(proc)
            prefix = f"[rank {self.ranks[rank]}] ".encode()
            for pipe, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
                assert pipe is not None
                stream = _Stream(pipe, prefix, sink)
                os.set_blocking(stream.fd, False)
                self.streams[stream.fd] = stream
                self.sel.register(stream.fd, selectors.EVENT_READ, stream)
        try:
            self.keeper = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _KEEPER, *(str(p.pid) for p in self.procs)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # not in our group: a kill aimed at us leaves it be
                close_fds=True,
            )
        except OSError as e:  # the ranks still die with us; only what they start might not
            self.say(f"warning: could not start the keeper of the ranks' process groups: {e}")

    def _pump(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            stream = key.data
            if stream is None:
                try:
                    while self.wake_r.recv(256):
                        pass
                except BlockingIOError:
                    pass
                continue
            assert isinstance(stream, _Stream)
            try:
                data = os.read(stream.fd, 65536)
            except BlockingIOError:
                continue
            if data:
                stream.feed(data)
            else:
                self._close_stream(stream)
        self.out.flush()
        self.err.flush()

    def _close_stream(self, stream: _Stream) -> None:
        stream.finish()
        self.sel.unregister(stream.fd)
        del self.streams[stream.fd]
        stream.pipe.close()

    def on_signal(self, signum: int) -> None:
        if self.signalled is None:
            self.signalled = signum
            self.say(f"received {signal.Signals(signum).name}; forwarding it to the ranks")
            for rank in range(len(self.procs)):
                if rank not in self.codes:
                    self._signal_group(rank, signum)
            if self.kill_at is None:
                self.kill_at = time.monotonic() + self.grace
        else:
            self.say(f"received {signal.Signals(signum).name} again; killing the ranks")
            self.kill_all()

    def run(self, pending_signals: list[int]) -> int:
        started = time.monotonic()
        self.sel.register(self.wake_r, selectors.EVENT_READ, None)
        reaped_all_at: float | None = None
        while True:
            while pending_signals:
                self.on_signal(pending_signals.pop(0))
            for rank, proc in enumerate(self.procs):
                if rank in self.codes:
                    continue
                code = proc.poll()
                if code is None:
                    continue
                self.codes[rank] = code
                if (
                    code != 0
                    and self.failure is None
                    and self.signalled is None
                    and not self.timed_out
                ):
                    self.failure = (rank, code)
                    self.say(
                        f"rank {self.ranks[rank]} failed ({_describe(code)}); stopping the "
                        "other ranks"
                    )
                    self.stop_all(signal.SIGTERM)
            now = time.monotonic()
            if (
                self.timeout is not None
                and not self.timed_out
                and self.failure is None
                and now - started >= self.timeout
                and len(self.codes) < len(self.procs)
            ):
                self.timed_out = True
                self.say(f"timed out after {self.timeout:g} s; stopping the ranks")
                self.stop_all(signal.SIGTERM)
            if self.kill_at is not None and now >= self.kill_at:
                self.kill_all()
                self.kill_at = now + 3600.0  # once; the groups are gone after SIGKILL
            if len(self.codes) == len(self.procs):
                # the ranks are gone: stop whatever they left behind in their groups
                if reaped_all_at is None:
                    reaped_all_at = now
                    if any(self._group_alive(r) for r in range(len(self.procs))):
                        for r in range(len(self.procs)):
                            self._signal_group(r, signal.SIGTERM)
                if now - reaped_all_at >= min(self.grace, 2.0):
                    self.kill_all()
                if not self.streams:
                    break
                if now - reaped_all_at >= min(self.grace, 2.0) + 5.0:
                    for stream in list(self.streams.values()):
                        self._close_stream(stream)  # a descendant escaped its group
                    break
            self._pump(_POLL)
        return self.exit_code()

    def exit_code(self) -> int:
        if self.failure is not None:
            rank, code = self.failure
            others = sorted(r for r in self.codes if r != rank)
            stopped = ", ".join(f"{self.ranks[r]}: {_describe(self.codes[r])}" for r in others)
            self.say(
                f"rank {self.ranks[rank]} failed with {_describe(code)}"
                + (f" (others: {stopped})" if stopped else "")
            )
            return code if code > 0 else 128 + (-code)
        if self.signalled is not None:
            return 128 + self.signalled
        if self.timed_out:
            return 124
        return 0

    def cleanup(self) -> None:
        """Nothing survives the launcher: no child, zombie, pipe or descriptor."""
        if self.procs:
            self.kill_all()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.keeper is not None:  # the ranks' groups are stopped: the keeper may go
            assert self.keeper.stdin is not None
            try:
                self.keeper.stdin.write(b"done")
                self.keeper.stdin.close()
            except OSError:
                pass  # it died: nothing to release
            try:
                self.keeper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.keeper.kill()
                self.keeper.wait()
        for stream in list(self.streams.values()):
            self._close_stream(stream)
        self.out.flush()
        self.err.flush()
        self.sel.close()
        self.wake_r.close()
        self.wake_w.close()
