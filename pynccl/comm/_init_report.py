"""Who a blocking ``ncclCommInitRank`` still waits for: while it blocks, a line on stderr
every ``PYNCCL_INIT_REPORT`` seconds (default 30, 0: none) saying how long this rank has
waited, for a communicator of which size, and which ranks have not arrived where that can
be known (the loopback libnccl answers ``pynccl_lb_init_missing``; real NCCL does not tell).

The lines come from a timer thread started just before the call and joined right after
it, whatever the call does: nothing is left running, and collectives cost nothing more.
Made of ``_thread`` locks (no ``threading``), and ``pynccl.bootstrap`` (whose
``PYNCCL_RENDEZVOUS_REPORT`` helpers parse the interval and write the lines) is imported
only when the variable is set or a line is due: a quick init imports nothing more.
"""

from __future__ import annotations

import _thread
import os
import time
from collections.abc import Callable
from ctypes import POINTER, c_char_p, c_int

__all__ = ["INIT_REPORT_ENV", "InitReport", "init_report"]

#: Seconds between "still waiting in ncclCommInitRank" lines (0: none).
INIT_REPORT_ENV = "PYNCCL_INIT_REPORT"

#: What a line says when the library cannot name the missing ranks.
UNKNOWN = "missing ranks unknown: NCCL does not tell; NCCL_RAS / `python -m pynccl ras` lists them"

_MAX_LISTED = 4096  # ranks asked of the loopback per line (the rest are counted)

DEFAULT_INTERVAL = 30.0

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import TracebackType

    from .._capi.nccl import NcclLibrary


def missing_query(L: NcclLibrary, uid: bytes) -> Callable[[], tuple[list[int], int] | None]:
    """A function answering ``(missing ranks, world size)`` for the world of ``uid``, or
    ``None`` when the library cannot say (real NCCL, or no such init in this process)."""
    fn = L.extension("pynccl_lb_init_missing")
    if fn is None:
        return lambda: None
    fn.restype = c_int
    fn.argtypes = [c_char_p, POINTER(c_int), c_int, POINTER(c_int)]
    out = (c_int * _MAX_LISTED)()
    size = c_int(0)

    def ask() -> tuple[list[int], int] | None:
        count = int(fn(uid, out, _MAX_LISTED, size))
        if count < 0:
            return None
        return list(out[: min(count, _MAX_LISTED)]), size.value

    return ask


def waiting_line(rank: int, size: int, waited: float, answer: tuple[list[int], int] | None) -> str:
    """``rank 0 has waited 30 s in ncclCommInitRank for a communicator of size 3; rank 2
    of 3 has not arrived; arrived: ranks 0-1`` (or :data:`UNKNOWN` for the missing)."""
    from ..bootstrap._common import ranks_phrase

    head = (
        f"rank {rank} has waited {waited:.0f} s in ncclCommInitRank for a communicator "
        f"of size {size}"
    )
    if answer is None:
        return f"{head}; {UNKNOWN}"
    missing, world = answer
    if not missing:
        return f"{head}; every rank has arrived (init is finishing)"
    verb = "has" if len(missing) == 1 else "have"
    arrived = sorted(set(range(world)) - set(missing))
    here = ranks_phrase(arrived) if arrived else "none"
    return f"{head}; {ranks_phrase(missing)} of {world} {verb} not arrived; arrived: {here}"


class InitReport:
    """A context manager around one blocking init call: a timer thread writes
    :func:`waiting_line` every ``interval`` seconds until the block exits."""

    def __init__(
        self, interval: float, rank: int, size: int,
        ask: Callable[[], tuple[list[int], int] | None],
    ) -> None:  # fmt: skip
        self._interval = interval
        self._rank = rank
        self._size = size
        self._ask = ask
        self._stop = _thread.allocate_lock()  # held while the call runs
        self._done = _thread.allocate_lock()  # held while the timer thread runs
        self._running = False
        self._start = 0.0

    def __enter__(self) -> InitReport:
        self._start = time.monotonic()
        if self._interval > 0:
            self._stop.acquire()
            self._done.acquire()
            try:
                _thread.start_new_thread(self._run, ())
            except BaseException:
                self._stop.release()
                self._done.release()
                raise
            self._running = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        if not self._running:
            return
        self._running = False
        self._stop.release()
        self._done.acquire()  # the thread has ended
        self._done.release()

    def _run(self) -> None:
        try:
            while not self._stop.acquire(timeout=self._interval):
                self._line()
            self._stop.release()
        finally:
            self._done.release()

    def _line(self) -> None:
        from ..bootstrap._progress import say

        try:
            answer = self._ask()
        except OSError:
            answer = None
        waited = time.monotonic() - self._start
        say(waiting_line(self._rank, self._size, waited, answer), stage="init")


def init_report(L: NcclLibrary, uid: bytes, rank: int, size: int) -> InitReport:
    """The report for one init of rank ``rank`` of ``size`` on the world of ``uid``; its
    interval from ``$PYNCCL_INIT_REPORT`` (``ValueError`` naming a malformed value)."""
    interval = DEFAULT_INTERVAL
    if os.environ.get(INIT_REPORT_ENV, "").strip():
        from ..bootstrap._progress import report_interval

        interval = report_interval(None, INIT_REPORT_ENV)
    ask = missing_query(L, uid) if interval > 0 else (lambda: None)
    return InitReport(interval, rank, size, ask)
