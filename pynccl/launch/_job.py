"""The launcher's supervisor: the local ranks (started by the keeper, each in its own
process group), their output prefixed line by line, failures, signals and timeouts turned
into one exit code, and nothing left behind (see ``_keeper`` for how, and for the limits)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO

from . import _keeper

__all__ = ["Job"]

_MAX_LINE = 1 << 20  # longer lines are split (each piece still prefixed and whole)
_POLL = 0.05  # seconds between checks of the children
_START_LIMIT = 60.0  # seconds for the keeper to start the ranks


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
    """One rank's stdout or stderr: the read end of its pipe, cut into prefixed lines."""

    __slots__ = ("buf", "fd", "prefix", "sink")

    def __init__(self, fd: int, prefix: bytes, sink: _Sink) -> None:
        self.fd = fd  # owned: closed by Job._close_stream
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


class _KeeperLink:
    """The launcher's end of the keeper: commands out, ``pid``/``fail``/``exit`` lines in."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self.fd = proc.stdout.fileno()
        self.buf = b""
        self.eof = False

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command.encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # it died (or its stdin is closed): nothing to tell
            pass

    def lines(self, timeout: float | None = None) -> list[list[str]]:
        """The complete lines that arrived (split into words); waits up to ``timeout`` for some."""
        if timeout is not None:
            ready = selectors.DefaultSelector()
            try:
                ready.register(self.fd, selectors.EVENT_READ)
                if not ready.select(timeout):
                    return []
            finally:
                ready.close()
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        if not data:
            self.eof = True
        self.buf += data
        *done, self.buf = self.buf.split(b"\n")
        return [line.decode("utf-8", "replace").split(" ", 2) for line in done if line]


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
        self.pids: list[int] = []  # of the ranks started; each is also its process group id
        self.codes: dict[int, int] = {}
        self.sel = selectors.DefaultSelector()
        self.streams: dict[int, _Stream] = {}
        self.failure: tuple[int, int] | None = None
        self.signalled: int | None = None
        self.timed_out = False
        self.kill_at: float | None = None
        self.wake_r, self.wake_w = socket.socketpair()
        self.keeper: _KeeperLink | None = None
        #: Seconds the ranks get to dump their flight records (SIGUSR1) before a failed or
        #: timed-out job is terminated; None: no dump phase. ``dumped()``: all are on disk.
        self.dump_grace: float | None = None
        self.dumped: Callable[[float], bool] = lambda since: False
        self.term_at: tuple[float, float] | None = None  # (asked at, terminate at)

    def say(self, text: str) -> None:
        self.err.write(f"pynccl launch: {text}\n".encode())
        self.err.flush()

    # -- process groups ---------------------------------------------------------------

    def _signal_group(self, rank: int, sig: int) -> None:
        try:
            os.killpg(self.pids[rank], sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def _group_alive(self, rank: int) -> bool:
        try:
            os.killpg(self.pids[rank], 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def stop_all(self, sig: int) -> None:
        """Send ``sig`` to every group still alive and arm the SIGKILL deadline."""
        for rank in range(len(self.pids)):
            self._signal_group(rank, sig)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace

    def stop_failed(self) -> None:
        """Stop a failed or timed-out job: with a dump phase, SIGUSR1 to each rank first
        (its flight record), SIGTERM once all dumped or after ``dump_grace``."""
        if self.dump_grace is None or self.term_at is not None:
            return self.stop_all(signal.SIGTERM)
        now = time.time()
        for rank, pid in enumerate(self.pids):
            if rank not in self.codes:
                try:
                    os.kill(pid, signal.SIGUSR1)  # the rank only: its children keep theirs
                except (ProcessLookupError, PermissionError):
                    pass
        self.say(f"asking the ranks for their flight records (SIGUSR1, {self.dump_grace:g} s)")
        self.term_at = (now, time.monotonic() + self.dump_grace)
        return None

    def kill_all(self) -> None:
        """SIGKILL the ranks' groups, and (through the keeper) every descendant outside them."""
        for rank in range(len(self.pids)):
            self._signal_group(rank, signal.SIGKILL)
        if self.keeper is not None:
            self.keeper.send("kill")

    # -- main loop ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the keeper, which starts the ranks; raises ``OSError`` if one cannot start."""
        pipes: list[tuple[int, int, int, int]] = []
        try:
            for rank in range(len(self.envs)):
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                pipes.append((out_r, out_w, err_r, err_w))
                prefix = f"[rank {self.ranks[rank]}] ".encode()
                for fd, sink in ((out_r, self.out), (err_r, self.err)):
                    os.set_blocking(fd, False)
                    self.streams[fd] = _Stream(fd, prefix, sink)
                    self.sel.register(fd, selectors.EVENT_READ, self.streams[fd])
            writers = [fd for p in pipes for fd in (p[1], p[3])]
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _keeper.__file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,  # not in our group: a kill aimed at us leaves it be
                close_fds=True,
                pass_fds=writers,
            )
        finally:
            for p in pipes:  # the keeper (and then each rank) holds the write ends
                os.close(p[1])
                os.close(p[3])
        self.keeper = keeper = _KeeperLink(proc)
        spec = {
            "cmd": self.cmd,
            "envs": self.envs,
            "fds": [[p[1], p[3]] for p in pipes],
            "grace": min(self.grace, 2.0),
        }
        keeper.send(json.dumps(spec))
        deadline = time.monotonic() + _START_LIMIT
        while len(self.pids) < len(self.envs):
            for words in keeper.lines(max(0.0, deadline - time.monotonic())):
                if words[0] == "pid":
                    self.pids.append(int(words[2]))
                elif words[0] == "fail":
                    raise OSError(words[2] if len(words) > 2 else "unknown error")
                else:
                    self._on_keeper(words)
            if keeper.eof or time.monotonic() >= deadline:
                raise OSError("the keeper process ended before it started every rank")
        os.set_blocking(keeper.fd, False)
        self.sel.register(keeper.fd, selectors.EVENT_READ, keeper)

    def _on_keeper(self, words: list[str]) -> None:
        if words[0] == "exit" and len(words) == 3:
            self._on_exit(int(words[1]), int(words[2]))

    def _on_exit(self, rank: int, code: int) -> None:
        if rank in self.codes:
            return
        self.codes[rank] = code
        if code != 0 and self.failure is None and self.signalled is None and not self.timed_out:
            self.failure = (rank, code)
            what = _describe(code)
            self.say(f"rank {self.ranks[rank]} failed ({what}); stopping the other ranks")
            self.stop_failed()

    def _keeper_lost(self) -> None:
        """The keeper ended on its own (killed): the ranks die with it (parent-death signal)."""
        assert self.keeper is not None
        self.sel.unregister(self.keeper.fd)
        missing = [r for r in range(len(self.pids)) if r not in self.codes]
        if missing:
            self.say("the keeper process of the ranks died; stopping the ranks")
            for rank in missing:
                self._signal_group(rank, signal.SIGKILL)
                self._on_exit(rank, -signal.SIGKILL)

    def _pump(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            source = key.data
            if source is None:
                try:
                    while self.wake_r.recv(256):
                        pass
                except BlockingIOError:
                    pass
                continue
            if isinstance(source, _KeeperLink):
                for words in source.lines():
                    self._on_keeper(words)
                if source.eof:
                    self._keeper_lost()
                continue
            assert isinstance(source, _Stream)
            try:
                data = os.read(source.fd, 65536)
            except BlockingIOError:
                continue
            if data:
                source.feed(data)
            else:
                self._close_stream(source)
        self.out.flush()
        self.err.flush()

    def _close_stream(self, stream: _Stream) -> None:
        stream.finish()
        self.sel.unregister(stream.fd)
        del self.streams[stream.fd]
        os.close(stream.fd)

    def on_signal(self, signum: int) -> None:
        if self.signalled is None:
            self.signalled = signum
            self.say(f"received {signal.Signals(signum).name}; forwarding it to the ranks")
            for rank in range(len(self.pids)):
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
        killed_leftovers = False
        while True:
            while pending_signals:
                self.on_signal(pending_signals.pop(0))
            now = time.monotonic()
            if (
                self.timeout is not None
                and not self.timed_out
                and self.failure is None
                and now - started >= self.timeout
                and len(self.codes) < len(self.pids)
            ):
                self.timed_out = True
                self.say(f"timed out after {self.timeout:g} s; stopping the ranks")
                self.stop_failed()
            term = self.term_at
            if term is not None and self.kill_at is None and (
                now >= term[1] or self.dumped(term[0])
            ):
                self.stop_all(signal.SIGTERM)
            if self.kill_at is not None and now >= self.kill_at:
                self.kill_all()
                self.kill_at = now + 3600.0  # once; the groups are gone after SIGKILL
            if len(self.codes) == len(self.pids):
                # the ranks are gone: stop whatever they left behind, in their groups or
                # (through the keeper) outside them
                if reaped_all_at is None:
                    reaped_all_at = now
                    if self.streams or any(self._group_alive(r) for r in range(len(self.pids))):
                        for r in range(len(self.pids)):
                            self._signal_group(r, signal.SIGTERM)
                        if self.keeper is not None:
                            self.keeper.send("term")
                if now - reaped_all_at >= min(self.grace, 2.0) and not killed_leftovers:
                    killed_leftovers = True
                    self.kill_all()
                if not self.streams:
                    break
                if now - reaped_all_at >= min(self.grace, 2.0) + 5.0:
                    for stream in list(self.streams.values()):
                        self._close_stream(stream)  # a descendant out of reach holds them
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
        for rank in range(len(self.pids)):
            self._signal_group(rank, signal.SIGKILL)
        if self.keeper is not None:
            # "stop", then end of file: the keeper gives what is left outside the groups
            # SIGTERM and a grace period, SIGKILLs the rest, reaps everything and ends
            keeper = self.keeper.proc
            self.keeper.send("stop")
            assert keeper.stdin is not None and keeper.stdout is not None
            try:
                keeper.stdin.close()
            except OSError:
                pass  # it died: nothing to release
            try:
                keeper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                keeper.kill()
                keeper.wait()
            keeper.stdout.close()
        for stream in list(self.streams.values()):
            self._close_stream(stream)
        self.out.flush()
        self.err.flush()
        self.sel.close()
        self.wake_r.close()
        self.wake_w.close()
