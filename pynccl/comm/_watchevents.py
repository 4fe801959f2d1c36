"""The watchdog's events (a part of :class:`~._watchdog.Watchdog`, its ``events``): one
CUDA event recorded after each operation on its stream, with the communicator's device
current, and the ledger of those still pending.

An operation issued inside a group is recorded once the outermost group end has launched
it, not at its call: NCCL enqueues nothing on the stream before that end, so an event
recorded at the call completes at once, and a grouped operation that then hangs — a send
whose peer never posts the matching recv — would never be seen. The group tells when it
has ended (:func:`pynccl.groups.after_launch`): launched, the operations are recorded
then; a non-blocking end that returned ncclInProgress launches from NCCL's thread once
the communicator is ready, and they are recorded then (:meth:`WatchEvents.launch_later`:
the watchdog's thread when it sees the communicator ready, or the communicator's next
call, which waited for it, before its own C call); a simulated group, or an end that
failed, launched nothing: nothing to watch.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from _thread import get_ident
from _warnings import warn as _warn
from ctypes import byref, c_int, c_void_p

from ..groups import OPEN as _OPEN
from ..groups import STATE as _GROUPS
from ..groups import after_launch

__all__ = ["WatchEvents"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .._capi.cudart import CudartLibrary
    from ._watchdog import Watched

_EVENT_DISABLE_TIMING = 0x2


class WatchEvents:
    """The events of the operations a watchdog watches (see the module's docstring)."""

    def __init__(self, comm: Watched, rt: CudartLibrary) -> None:
        self._rt = rt
        self._is_capturing = rt.raw("cudaStreamIsCapturing")
        self._get_device = rt.raw("cudaGetDevice")
        self._set_device = rt.raw("cudaSetDevice")
        self._comm = weakref.ref(comm)
        #: Set once the watchdog stops: nothing more is recorded.
        self.stopped = threading.Event()
        #: Guards the pending events between the issuing thread and the watchdog thread
        #: (reentrant: :meth:`launch_later` records under it, so nothing comes between).
        self.lock = threading.RLock()
        #: ``(seq, event, issued at)`` of the operations not known complete, oldest first.
        self.pending: collections.deque[tuple[int, int, float]] = collections.deque()
        #: Free events, for the next records.
        self.pool: list[int] = []
        #: Operations known complete: every one up to ``done`` (its event completed, and
        #: those before it); ``first``: the first operation watched (0: none yet).
        self.done = 0
        self.first = 0
        # Operations issued inside a group, by thread: recorded once its outermost end
        # launched them (after_launch calls _group_ended).
        self._grouped: dict[int, list[tuple[int, int]]] = {}
        #: ``(seq, stream)`` of a non-blocking group whose end returned ncclInProgress:
        #: recorded once the communicator is ready (:meth:`launch_later`).
        self.later: list[tuple[int, int]] = []

    def head(self, query: Any) -> tuple[int, int, float, int] | None:
        """Take in the events that completed, oldest first (``query``: cudaEventQuery);
        then the oldest one that did not, as ``(seq, event, issued at, query's result)``,
        or None when none is pending. Call it holding :attr:`lock`."""
        pending = self.pending
        while pending:
            seq, event, issued = pending[0]
            rc = query(event)
            if rc:
                return seq, event, issued, rc
            self.complete()
        return None

    def complete(self) -> None:
        """The oldest pending operation is over (completed, or past knowing): its event
        goes back to the pool. Call it holding :attr:`lock`."""
        seq, event, _ = self.pending.popleft()
        self.pool.append(event)
        self.done = max(self.done, seq)

    def free(self) -> None:
        """Destroy every event, pending or free, and forget what waits for a group."""
        with self.lock:
            events = [ev for _, ev, _ in self.pending] + self.pool
            self.pending.clear()
            self.pool = []
            self._grouped.clear()
            self.later = []
        destroy = self._rt.raw("cudaEventDestroy")
        for event in events:
            destroy(event)

    def enqueued(self, seq: int, stream: int) -> None:
        """Record a completion event for operation ``seq`` on ``stream``, with the
        communicator's device current (the caller's is restored).

        Inside a group of the calling thread, once the outermost end has launched it
        instead: NCCL enqueues nothing before, so an event recorded now would complete at
        once (a grouped send whose recv never comes would never be seen hung). Not while
        ``stream`` is being captured into a CUDA graph: the operation then runs only when
        the graph is replayed, and an event recorded now would become part of the graph.
        Never raises: the operation is already issued (an
        exception would invite issuing it again); an event that cannot be recorded
        leaves the operation unwatched, with a :class:`RuntimeWarning` saying so.
        """
        if _OPEN and _GROUPS.s.gid:
            return self._in_group(seq, stream)
        if self.later:  # ready (this operation waited for it): the group's came first
            self.launch_later()
        return self._record(seq, stream)

    def _in_group(self, seq: int, stream: int) -> None:
        """Operation ``seq`` was issued inside the calling thread's open group: remember
        it until the outermost end (the first one of the group asks to be told)."""
        comm = self._comm()
        if comm is None:
            return
        ident = get_ident()
        with self.lock:
            issued = self._grouped.get(ident)
            if issued is not None:
                issued.append((seq, stream))
                return
            self._grouped[ident] = [(seq, stream)]
        after_launch(comm, stream, lambda now, later: self._group_ended(ident, now, later))

    def _group_ended(self, ident: int, now: bool, later: bool) -> None:
        """The outermost end of thread ``ident``'s group returned: record its operations
        (``now``), once the communicator is ready (``later``), or forget them (nothing was
        launched: the end failed, or the group was simulated)."""
        with self.lock:
            issued = self._grouped.pop(ident, None)
            if issued is None or self.stopped.is_set():
                return
            if later:
                self.later.extend(issued)
                return
        if now:
            for seq, stream in issued:
                self._record(seq, stream)

    def launch_later(self) -> None:
        """A non-blocking group's operations (:attr:`later`) were launched: the
        communicator is ready. Record them now (in order, before any later operation)."""
        with self.lock:
            issued, self.later = self.later, []
            for seq, stream in issued:
                self._record(seq, stream)

    def _record(self, seq: int, stream: int) -> None:
        """:meth:`enqueued`'s record, for an operation already on its stream."""
        comm = self._comm()
        device = None if comm is None else comm.watch_device()
        if device is None:
            return
        rt = self._rt
        current = c_int(-1)
        self._get_device(byref(current))
        switch = current.value != device
        if switch and self._set_device(device):
            rt.raw("cudaGetLastError")()
            return self._unwatched(seq, "cudaSetDevice", device)
        try:
            capturing = c_int(0)
            if self._is_capturing(stream, byref(capturing)):
                # cudaErrorStreamCaptureImplicit (the legacy stream while a blocking
                # stream captures): recording there would invalidate the capture. The
                # error stays the thread's last CUDA error unless read: clear it.
                rt.raw("cudaGetLastError")()
                return None
            if capturing.value:
                return None
            with self.lock:
                if self.pool:
                    event = self.pool.pop()
                else:
                    handle = c_void_p()
                    if rt.raw("cudaEventCreateWithFlags")(byref(handle), _EVENT_DISABLE_TIMING):
                        rt.raw("cudaGetLastError")()
                        return self._unwatched(seq, "cudaEventCreateWithFlags", device)
                    event = int(handle.value or 0)
                if rt.raw("cudaEventRecord")(event, stream):
                    rt.raw("cudaGetLastError")()
                    self.pool.append(event)
                    return self._unwatched(seq, "cudaEventRecord", device)
                self.pending.append((seq, event, time.monotonic()))
                if not self.first:
                    self.first = seq
        finally:
            if switch and current.value >= 0:
                self._set_device(current.value)
        return None

    def _unwatched(self, seq: int, function: str, device: int) -> None:
        what = f"operation #{seq} was issued but is not watched: {function} failed"
        _warn(f"pynccl watchdog: {what} on device {device}", RuntimeWarning, stacklevel=4)
