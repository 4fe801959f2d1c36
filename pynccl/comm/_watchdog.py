"""The watchdog of a communicator: a daemon thread that aborts it when work hangs.

After each operation it has a CUDA event recorded on the operation's stream (with the
communicator's device current: an event belongs to the device it was made on, and
stream 0 means that device's default stream; inside a group, once the outermost end has
launched it: :mod:`._watchevents`); when the oldest event stays incomplete
past the timeout, when the communicator reports an asynchronous error, or when a
non-blocking call stays in progress past the timeout, it aborts the communicator
(``ncclCommAbort`` releases work blocked on the GPU) through the communicator's one
teardown, recording why, so that the next call raises that error. With
``on_hang="revoke"`` it revokes instead (``ncclCommRevoke``: the hung work stops, the
communicator stays for ``shrink``) — for a hang or an asynchronous error; an
initialisation that never completes is still aborted (there is nothing to shrink yet).
It talks to the communicator only through :class:`Watched`.

Two rules keep it from doing harm, as PyTorch's watchdog learned:

* its thread switches itself to ``cudaStreamCaptureModeRelaxed``
  (``cudaThreadExchangeStreamCaptureMode``) before any query, so that its
  ``cudaEventQuery`` never breaks another thread's global-mode CUDA-graph capture
  (torch.cuda.graph's default); where libcudart lacks that call it skips its queries
  while a :class:`pynccl.cuda.Graph` global capture is under way, and an error of the
  capture family from a query is never read as the communicator's failure;
* it reads ``ncclCommGetAsyncError`` without the communicator's gate (NCCL allows it from
  any thread at any time), so a call blocked inside NCCL — a finalize, a first
  collective, a full work queue — never keeps it from seeing a hang.

An unexpected exception in its thread is reported (a :class:`RuntimeWarning`, and
:attr:`Watchdog.failure`) and the thread goes on watching: it never dies silently.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from _warnings import warn as _warn

from .._limits import ON_HANG, check_on_hang, check_timeout
from ..enums import Result
from ..errors import NcclTimeoutError
from ._watchevents import WatchEvents

__all__ = ["ON_HANG", "Watchdog", "Watched", "check_on_hang", "trip"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

    from ..groups import GroupMember

    class Watched(GroupMember, Protocol):
        """What the watchdog needs from a communicator (inside a group, it joins it)."""

        @property
        def rank(self) -> int: ...

        def watch_status(self) -> tuple[bool, bool, BaseException | None]:
            """``(alive, ready, asynchronous error or None)``, without the gate."""

        def watch_device(self) -> int | None:
            """The communicator's CUDA device (None once it is gone)."""

        def describe(self, seq: int) -> str: ...

        def format_flight_record(self, last: int = 0) -> str: ...

        def watch_trip(self, reason: BaseException, revoke: bool = False) -> None: ...

        def watch_tripped(self, reason: BaseException) -> None: ...
else:
    Watched = object

#: The last watchdog started on each communicator (weakly): read by flight-record dumps.
WATCHED: weakref.WeakKeyDictionary[Any, Watchdog] = weakref.WeakKeyDictionary()

_NOT_READY = 600


def default_interval(timeout: float) -> float:
    """How often the watchdog looks when not told: a 20th of the timeout, in [5 ms, 1 s]."""
    return min(max(timeout / 20, 0.005), 1.0)


class Watchdog:
    """Watches one communicator's enqueued work and asynchronous errors (see module doc)."""

    def __init__(
        self,
        comm: Watched,
        timeout: float,
        interval: float | None = None,
        on_hang: str = "abort",
    ) -> None:
        seconds = check_timeout(timeout, "watchdog timeout")
        if seconds is None:
            raise ValueError("watchdog timeout must be a number of seconds, got None")
        # The same rule as every timeout: a positive, finite number of seconds (0, a
        # negative or nan one would spin; inf, a str or an object killed the thread).
        every = check_timeout(interval, "interval")
        #: ``"abort"`` or ``"revoke"``: what a hang or an asynchronous error makes it do.
        self.on_hang = check_on_hang(on_hang)
        from ..library import cudart

        rt = cudart()
        self._rt = rt
        self._comm = weakref.ref(comm)
        #: The events of the operations it watches, and their ledger.
        self.events = events = WatchEvents(comm, rt)
        self._stop = events.stopped
        #: Called after each operation is issued (see :meth:`WatchEvents.enqueued`).
        self.enqueued = events.enqueued
        self.timeout = seconds
        self.interval = default_interval(seconds) if every is None else every
        self.reason: BaseException | None = None
        #: The last unexpected exception of the thread (reported, never fatal), if any.
        self.failure: BaseException | None = None
        self._unready_since: float | None = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"pynccl-watchdog-rank{comm.rank}", daemon=True
        )
        # At interpreter exit only ask the thread to stop: never join or touch CUDA there.
        atexit.register(self._stop.set)
        WATCHED[comm] = self  # what a flight-record dump reads, also after a trip
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (joins it unless called from it) and free its events."""
        self._halt()
        self.events.free()

    @property
    def done(self) -> int:
        """Every operation up to this one is known complete."""
        return self.events.done

    def _halt(self) -> None:
        self._stop.set()
        atexit.unregister(self._stop.set)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def drain(self) -> tuple[int, float] | None:
        """Stop the thread, then wait for the operations it watches to complete, each at
        most until its own deadline (issued + timeout). Returns ``(seq, seconds waited
        past its issue)`` of the first one still incomplete at its deadline, or None when
        all completed. Frees the events either way. For a bounded ``destroy()``."""
        from ..cuda._graph import CaptureMode, exchange_capture_mode

        self._halt()
        previous = exchange_capture_mode(CaptureMode.RELAXED)
        try:
            query = self._rt.raw("cudaEventQuery")
            events = self.events
            delay = 1e-4
            while True:
                with events.lock:
                    head = events.head(query)
                    if head is None:
                        return None
                    seq, _, issued, rc = head
                    if rc != _NOT_READY:  # not knowable: not hung
                        self._rt.raw("cudaGetLastError")()
                        events.complete()
                        continue
                now = time.monotonic()
                if now - issued > self.timeout:
                    return seq, now - issued
                time.sleep(min(delay, max(issued + self.timeout - now, 0.0)))
                delay = min(delay * 2, 0.01)
        finally:
            if previous is not None:
                exchange_capture_mode(previous)
            self.events.free()

    @property
    def running(self) -> bool:
        """True while the watchdog thread runs."""
        return self._thread.is_alive()

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        from ..cuda._graph import CaptureMode, exchange_capture_mode

        try:
            # Before any query: this thread's queries never break another thread's capture.
            relaxed = exchange_capture_mode(CaptureMode.RELAXED) is not None
        except Exception as exc:  # reported; the fallback below still protects captures
            self._report(exc)
            relaxed = False
        query = self._rt.raw("cudaEventQuery")
        while not self._stop.wait(self.interval):
            try:
                if self._poll(query, relaxed):
                    return
            except Exception as exc:  # never die silently: say so, and go on watching
                self._report(exc)

    def _report(self, exc: BaseException) -> None:
        self.failure = exc
        comm = self._comm()
        rank = "?" if comm is None else comm.rank
        _warn(
            f"pynccl watchdog of rank {rank}: unexpected {type(exc).__name__}: {exc} "
            "(it goes on watching)",
            RuntimeWarning,
            stacklevel=2,
        )

    def _poll(self, query: Any, relaxed: bool) -> bool:
        """One look; True when the watchdog is done (tripped, or nothing left to watch)."""
        comm = self._comm()
        if comm is None:
            return True
        alive, ready, error = comm.watch_status()
        if not alive:
            return True
        if error is not None:
            trip(comm, error, self)
            return True
        now = time.monotonic()
        if not ready:  # a non-blocking init or call still in progress: bounded too
            since = self._unready_since
            if since is None:
                self._unready_since = now
            elif now - since > self.timeout:
                late = f"communicator rank {comm.rank} was not ready within {self.timeout:g} s"
                error = NcclTimeoutError(Result.TIMEOUT, "ncclCommGetAsyncError",
                                         late + "; the watchdog aborted it")  # fmt: skip
                trip(comm, error, self, revoke=False)
                return True
            return False
        self._unready_since = None
        if not relaxed:
            from ..cuda._graph import _unsafe_calls_prohibited

            if _unsafe_calls_prohibited():  # a query now would break that capture
                return False
        if self.events.later:  # ready: a non-blocking group's end has launched its operations
            self.events.launch_later()
        hung = self._oldest_hung(comm, query, now)
        if hung is not None:
            trip(comm, hung, self)
            return True
        return False

    def _oldest_hung(self, comm: Watched, query: Any, now: float) -> BaseException | None:
        from ..cuda._graph import is_capture_error

        with self.events.lock:
            head = self.events.head(query)
        if head is None:
            return None
        seq, _, issued, rc = head
        if rc != _NOT_READY:
            self._rt.raw("cudaGetLastError")()
            if is_capture_error(rc):  # about a capture, not about this work
                return None
            return self._rt.make_error(rc, "cudaEventQuery")
        if now - issued > self.timeout:
            return NcclTimeoutError(
                Result.TIMEOUT,
                comm.describe(seq),
                f"operation #{seq} did not complete within {self.timeout:g} s; "
                f"{self.verdict}. ",  # + the record (watch_trip)
            )
        return None

    @property
    def verdict(self) -> str:
        """What the watchdog did, as the errors it records say it."""
        if self.on_hang == "revoke":
            return (
                "the watchdog revoked the communicator (shrink(), destroy() or abort() "
                "are possible)"
            )
        return "the watchdog aborted the communicator"

    def refresh(self) -> None:
        """Take in the events that completed since the thread last looked (for a dump:
        states as of now). Queries in relaxed capture mode, as the thread does."""
        from ..cuda._graph import CaptureMode, exchange_capture_mode

        previous = exchange_capture_mode(CaptureMode.RELAXED)
        try:
            query = self._rt.raw("cudaEventQuery")
            with self.events.lock:
                head = self.events.head(query)
                if head is not None and head[3] != _NOT_READY:
                    self._rt.raw("cudaGetLastError")()
        finally:
            if previous is not None:
                exchange_capture_mode(previous)

    def state(self, seq: int) -> str:
        """Operation ``seq`` as the events tell: ``"completed"`` (its event, and every
        earlier one, completed), ``"started"`` (every earlier watched operation completed:
        its stream is in it), else ``"issued"`` (also when not watched)."""
        first, done = self.events.first, self.events.done
        if not first or seq < first:
            return "issued"
        if seq <= done:
            return "completed"
        return "started" if seq == max(done + 1, first) else "issued"


def trip(comm: Watched, reason: BaseException, watch: Watchdog | None,
         revoke: bool | None = None) -> None:  # fmt: skip
    """What a hang does (the watchdog's trip, and :meth:`pynccl.Work.wait`'s): abort
    ``comm`` (revoke it, as ``watch.on_hang`` or ``revoke`` says) recording ``reason``, stop
    ``watch`` (joined unless from its own thread), then dump the flight record if asked."""
    if watch is not None:
        watch.reason = reason
        revoke = watch.on_hang == "revoke" if revoke is None else revoke
    comm.watch_trip(reason, bool(revoke))
    if watch is not None:
        watch.stop()
    comm.watch_tripped(reason)
