"""The watchdog of a communicator: a daemon thread that aborts it when work hangs.

After each operation it has a CUDA event recorded on the operation's stream; when the
oldest event stays incomplete past the timeout, when the communicator reports an
asynchronous error, or when a non-blocking initialisation is still not done after the
timeout, it aborts the communicator (``ncclCommAbort`` releases work blocked on the GPU)
through the communicator's one teardown, recording why, so that the next call raises
that error. With ``on_hang="revoke"`` it revokes instead (``ncclCommRevoke``: the hung
work stops, the communicator stays for ``shrink``) — for a hang or an asynchronous
error; an initialisation that never completes is still aborted (there is nothing to
shrink yet). It talks to the communicator only through :class:`Watched`.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from ctypes import byref, c_int, c_void_p

from .._limits import ON_HANG, check_on_hang, check_timeout
from ..enums import Result
from ..errors import NcclTimeoutError

__all__ = ["ON_HANG", "Watchdog", "Watched", "check_on_hang"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    class Watched(Protocol):
        """What the watchdog needs from a communicator."""

        @property
        def rank(self) -> int: ...

        def watch_status(self) -> tuple[bool, bool, BaseException | None]:
            """``(alive, ready, asynchronous error or None)``."""

        def describe(self, seq: int) -> str: ...

        def format_flight_record(self) -> str: ...

        def watch_trip(self, reason: BaseException, revoke: bool = False) -> None: ...
else:
    Watched = object

#: What the watchdog may do to a hung communicator.

_EVENT_DISABLE_TIMING = 0x2
_NOT_READY = 600


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
        #: ``"abort"`` or ``"revoke"``: what a hang or an asynchronous error makes it do.
        self.on_hang = check_on_hang(on_hang)
        from ..library import cudart

        self._rt = cudart()
        self._is_capturing = self._rt.raw("cudaStreamIsCapturing")
        self._comm = weakref.ref(comm)
        self.timeout = seconds
        self.interval = min(max(self.timeout / 20, 0.005), 1.0) if interval is None else interval
        self._started = time.monotonic()
        #: Guards the pending events between the issuing thread and the watchdog thread.
        self.lock = threading.Lock()
        self._pending: collections.deque[tuple[int, int, float]] = collections.deque()
        self._pool: list[int] = []
        self._stop = threading.Event()
        self.reason: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"pynccl-watchdog-rank{comm.rank}", daemon=True
        )
        # At interpreter exit only ask the thread to stop: never join or touch CUDA there.
        atexit.register(self._stop.set)
        self._thread.start()

    # -- called by the communicator (the issuing thread, holding its gate) ---------------

    def enqueued(self, seq: int, stream: int) -> None:
        """Record a completion event for operation ``seq`` on ``stream``.

        Not while ``stream`` is being captured into a CUDA graph: the operation then
        runs only when the graph is replayed, and an event recorded now would
        become part of the graph.
        """
        capturing = c_int(0)
        rc = self._is_capturing(stream, byref(capturing))
        if rc or capturing.value:
            # An error too (cudaErrorStreamCaptureImplicit: the legacy stream while
            # another stream captures): recording there would invalidate the capture.
            return
        with self.lock:
            if self._pool:
                event = self._pool.pop()
            else:
                handle = c_void_p()
                self._rt.cudaEventCreateWithFlags(byref(handle), _EVENT_DISABLE_TIMING)
                event = int(handle.value or 0)
            self._rt.cudaEventRecord(event, stream)
            self._pending.append((seq, event, time.monotonic()))

    def stop(self) -> None:
        """Stop the thread (joins it unless called from it) and free its events."""
        self._stop.set()
        atexit.unregister(self._stop.set)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        with self.lock:
            events = [ev for _, ev, _ in self._pending] + self._pool
            self._pending.clear()
            self._pool = []
        destroy = self._rt.raw("cudaEventDestroy")
        for event in events:
            destroy(event)

    @property
    def running(self) -> bool:
        """True while the watchdog thread runs."""
        return self._thread.is_alive()

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        query = self._rt.raw("cudaEventQuery")
        while not self._stop.wait(self.interval):
            comm = self._comm()
            if comm is None:
                return
            alive, ready, error = comm.watch_status()
            if not alive:
                return
            if error is not None:
                self._trip(comm, error)
                return
            now = time.monotonic()
            if not ready:
                if now - self._started > self.timeout:
                    self._trip(
                        comm,
                        NcclTimeoutError(
                            Result.TIMEOUT,
                            "ncclCommGetAsyncError",
                            f"communicator rank {comm.rank} was not ready within "
                            f"{self.timeout:g} s; the watchdog aborted it",
                        ),
                        revoke=False,
                    )
                    return
                continue
            hung = self._oldest_hung(comm, query, now)
            if hung is not None:
                self._trip(comm, hung)
                return

    def _oldest_hung(self, comm: Watched, query: object, now: float) -> BaseException | None:
        with self.lock:
            while self._pending:
                seq, event, issued = self._pending[0]
                rc = query(event)  # type: ignore[operator]
                if rc == 0:
                    self._pending.popleft()
                    self._pool.append(event)
                    continue
                if rc != _NOT_READY:
                    return self._rt.make_error(rc, "cudaEventQuery")
                if now - issued > self.timeout:
                    return NcclTimeoutError(
                        Result.TIMEOUT,
                        comm.describe(seq),
                        f"operation #{seq} did not complete within {self.timeout:g} s; "
                        f"{self.verdict}. ",  # + the record (watch_trip)
                    )
                return None
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

    def _trip(self, comm: Watched, reason: BaseException, revoke: bool | None = None) -> None:
        self.reason = reason
        comm.watch_trip(reason, self.on_hang == "revoke" if revoke is None else revoke)
        self.stop()  # from this thread: no join, frees the events
