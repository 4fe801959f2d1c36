"""The flight recorder and the watchdog of a :class:`~pynccl.Communicator`.

The flight recorder keeps the last operations issued on a communicator
(a fixed ring, filled on the hot path with one tuple store). The watchdog is
an optional daemon thread: after each operation it has a CUDA event recorded
on the operation's stream; when the oldest event stays incomplete past the
timeout, or the communicator reports an asynchronous error, it aborts the
communicator (``ncclCommAbort`` releases work blocked on the GPU) and records
why, so that the next call on the communicator raises that error.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from ctypes import byref, c_int, c_void_p
from typing import TYPE_CHECKING, Any

from .enums import DataType, Result
from .errors import NcclError, NcclTimeoutError

if TYPE_CHECKING:
    from .comm import Communicator

__all__ = ["FlightRecord", "Watchdog", "format_record"]

#: Entries kept by the flight recorder (a power of two: the index is ``seq & mask``).
RING_SIZE = 64
RING_MASK = RING_SIZE - 1

#: ``(seq, C function, root or peer (-1: none), the C call's arguments)``
FlightRecord = tuple[int, str, int, tuple[Any, ...]]
_P2P = ("ncclSend", "ncclRecv")

_EVENT_DISABLE_TIMING = 0x2
_NOT_READY = 600


def format_record(entry: FlightRecord) -> str:
    """One flight-recorder entry as a line of text."""
    seq, name, where, args = entry
    # Collectives: (send, recv, count, datatype, ...); send/recv: (buf, count, datatype, ...).
    count, dtype = (args[1], args[2]) if name in _P2P else (args[2], args[3])
    text = f"#{seq} {name} count={count} dtype={DataType(dtype).c_name}"
    if where >= 0:
        text += f" {'peer' if name in _P2P else 'root'}={where}"
    return text + f" stream={args[-1]:#x}"


class Watchdog:
    """Watches one communicator's enqueued work and asynchronous errors (see module doc)."""

    def __init__(self, comm: Communicator, timeout: float, interval: float | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout!r}")
        from .library import cudart

        self._rt = cudart()
        self._is_capturing = self._rt.raw("cudaStreamIsCapturing")
        self._comm = weakref.ref(comm)
        self.timeout = float(timeout)
        self.interval = min(max(self.timeout / 20, 0.005), 1.0) if interval is None else interval
        #: Held by the communicator around each enqueue, and by the watchdog around abort,
        #: so an abort never frees the handle under a call that is passing it to NCCL.
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

    # -- called by the communicator (user thread, under self.lock) ----------------------

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
            if comm is None or comm._handle is None:
                return
            handle = comm._handle
            error = _async_error(comm, handle)
            if error is not None:
                self._trip(comm, error)
                return
            now = time.monotonic()
            with self.lock:
                while self._pending:
                    seq, event, issued = self._pending[0]
                    rc = query(event)
                    if rc == 0:
                        self._pending.popleft()
                        self._pool.append(event)
                        continue
                    if rc != _NOT_READY:
                        hung: BaseException | None = self._rt.make_error(rc, "cudaEventQuery")
                    elif now - issued > self.timeout:
                        hung = NcclTimeoutError(
                            Result.TIMEOUT,
                            comm._describe(seq),
                            f"operation #{seq} did not complete within {self.timeout:g} s; "
                            "the watchdog aborted the communicator. " + comm.format_flight_record(),
                        )
                    else:
                        hung = None
                    break
                else:
                    hung = None
            if hung is not None:
                self._trip(comm, hung)
                return

    def _trip(self, comm: Communicator, reason: BaseException) -> None:
        self.reason = reason
        # An enqueue that hangs inside NCCL holds the lock: abort anyway after a while,
        # since releasing hung calls is what abort is for.
        acquired = self.lock.acquire(timeout=max(self.timeout, 1.0))
        try:
            comm._abort_with(reason)
        finally:
            if acquired:
                self.lock.release()
        self.stop()  # from this thread: no join, frees the events


def _async_error(comm: Communicator, handle: int) -> NcclError | None:
    value = c_int(0)
    rc = comm._lib.raw("ncclCommGetAsyncError")(handle, byref(value))
    code = value.value if rc == 0 else rc
    if code in (Result.SUCCESS, Result.IN_PROGRESS):
        return None
    err = comm._lib.make_error(code, "ncclCommGetAsyncError")
    err.message += "; the watchdog aborted the communicator. " + comm.format_flight_record()
    return err
