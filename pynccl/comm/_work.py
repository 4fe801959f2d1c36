"""Completion handles: :class:`Work`, what ``async_op=True`` and ``pynccl.group()`` leave.

A Work is backed by one CUDA event per stream it covers, recorded right after the
operation on the operation's stream with the communicator's device current (an event
belongs to the device it was made on; stream 0 means that device's default stream). Its
events come from a small per-device pool and go back to it when the Work is garbage, so a
handle costs one ``cudaEventRecord`` (and a ``cudaGetDevice`` on the default streams,
which are per device), no creation. An event handed out as :attr:`Work.event` is the
caller's from then on (destroyed when that :class:`~pynccl.cuda.Event` is).

Rules:

* inside a group (``async_op=True`` on a call between group start and end) there is no
  handle per call — the group's end launches the work: ``with pynccl.group(async_op=True) as
  g:`` and ``g.work`` (one event per distinct stream of the group);
* inside a CUDA-graph capture of the operation's stream no handle is made: the operation
  runs when the graph is launched, and an event recorded now would become a node of the
  graph, which no host wait can follow. ``async_op=True`` is refused there (before the
  operation is issued) with :class:`~pynccl.NcclInvalidUsage` naming the capture; wait
  for the graph's launch stream instead. A ``group(async_op=True)`` whose end finds one
  of its streams captured raises the same error there (its operations are captured, and
  the group is ended);
* ``wait(timeout)`` that runs out treats the operation as hung, exactly as the watchdog
  does (:meth:`Communicator.trip_hang`): the communicator is aborted (or revoked, with a
  watchdog started with ``on_hang="revoke"``), the error is recorded for its next call,
  and :class:`~pynccl.NcclTimeoutError` naming the operation from its flight record is
  raised.
"""

from __future__ import annotations

import time
from ctypes import byref, c_int, c_void_p

from .._adapt import as_stream
from .._limits import check_flag, check_timeout
from ..cuda._streamlike import CURRENT, current_stream
from ..enums import Result
from ..errors import NcclInvalidUsage, NcclTimeoutError
from . import _recorder

__all__ = [
    "POOL_LIMIT",
    "Work",
    "after",
    "group_work",
    "issue",
    "pooled_events",
    "record",
    "refuse",
    "stream_of",
]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..cuda import Event
    from ..typing import StreamLike
    from ._communicator import Communicator

    #: One stream a Work covers: (communicator, its last operation's seq, stream handle,
    #: device, cudaEvent_t or 0 once handed out as an Event).
    Part = list[Any]

_NOT_READY = 600  # cudaErrorNotReady
_DISABLE_TIMING = 0x2  # cudaEventDisableTiming
_SPECIAL = 3  # stream handles below this (0 legacy, 1 legacy, 2 per-thread) are per device
#: Free events kept per device for the next handles (more are destroyed).
POOL_LIMIT = 64
_POOL: dict[int, list[int]] = {}
_RT: list[Any] = [None, None, None, None, None]  # libcudart and its raw calls, bound once


def _rt() -> list[Any]:
    from ..library import cudart

    rt = cudart()
    if _RT[0] is not rt:
        _RT[:] = [rt, rt.raw("cudaGetDevice"), rt.raw("cudaSetDevice"),
                  rt.raw("cudaEventRecord"), rt.raw("cudaEventQuery")]  # fmt: skip
    return _RT


def pooled_events() -> int:
    """How many free events the pool holds (all devices): live, and not leaked."""
    return sum(len(p) for p in _POOL.values())


def record(device: int, stream: int) -> int:
    """A pooled (or new) event of ``device`` recorded on ``stream``: its handle. Switches to
    ``device`` (and back) where the stream handle is one of the per-device default ones or
    a new event must be made there."""
    rt, get_device, set_device, event_record, _ = _rt()
    pool = _POOL.get(device)
    if pool and stream >= _SPECIAL:  # a stream belongs to one device: no switch needed
        try:
            handle = pool.pop()
        except IndexError:  # another thread took the last one since: one is made below
            pass
        else:
            rc = event_record(handle, stream)
            if rc:
                _give_back(device, handle)
                raise _error(rt, rc, "cudaEventRecord")
            return handle
    current = c_int(-1)
    get_device(byref(current))
    switch = current.value != device
    if switch:
        rt.cudaSetDevice(device)
    try:
        handle = _take(pool)
        if not handle:
            out = c_void_p()
            rt.cudaEventCreateWithFlags(byref(out), _DISABLE_TIMING)
            handle = out.value or 0
        rc = event_record(handle, stream)
        if rc:
            _give_back(device, handle)
            raise _error(rt, rc, "cudaEventRecord")
        return handle
    finally:
        if switch and current.value >= 0:
            set_device(current.value)


def _take(pool: list[int] | None) -> int:
    """A free event from ``pool``, or 0 (none, or another thread took the last one
    between the look and the pop: the pool is shared by every thread)."""
    try:
        return pool.pop() if pool else 0
    except IndexError:
        return 0


def _error(rt: Any, rc: int, function: str) -> BaseException:
    error = rt.make_error(rc, function)
    rt.raw("cudaGetLastError")()  # not left as the thread's last error
    return error  # type: ignore[no-any-return]


def _give_back(device: int, handle: int) -> None:
    pool = _POOL.setdefault(device, [])
    if len(pool) < POOL_LIMIT:
        pool.append(handle)
    else:
        _rt()[0].raw("cudaEventDestroy")(handle)


class Work:
    """A completion handle: the operations issued before it on its stream(s) (one
    collective or send/recv with ``async_op=True``, or a whole ``pynccl.group()``).

    ``wait(timeout=None)`` blocks until done (raising the communicator's asynchronous error
    if one appears; after ``timeout`` seconds it treats the operation as hung, as the
    watchdog does, and raises :class:`~pynccl.NcclTimeoutError` naming it); ``test()`` and
    :attr:`done` never block; ``wait_stream(stream)`` makes another stream wait for it
    (``cudaStreamWaitEvent``); :attr:`event` is its :class:`pynccl.cuda.Event`."""

    __slots__ = ("__weakref__", "_done", "_parts")

    def __init__(self, parts: list[Part]) -> None:
        self._parts = parts
        self._done = not parts

    @classmethod
    def after(cls, comm: Communicator, stream: int) -> Work:
        """A handle for ``comm``'s last operation, issued on ``stream``."""
        device = comm.device
        return cls([[comm, comm.flight_seq, stream, device, record(device, stream)]])

    # -- completion ---------------------------------------------------------------------

    def test(self) -> bool:
        """True once every operation it covers has completed (never blocks). Raises the
        communicator's asynchronous error while not done, if one appeared."""
        if self._done:
            return True
        query = _rt()[4]
        for part in self._parts:
            if part[4] or part[5:]:
                rc = query(part[4] or part[5].handle)
                if rc == _NOT_READY:
                    part[0].raise_async_error()
                    return False
                if rc:
                    raise _error(_rt()[0], rc, "cudaEventQuery")
        self._done = True
        return True

    @property
    def done(self) -> bool:
        """:meth:`test` as a property."""
        return self.test()

    def wait(self, timeout: float | None = None) -> None:
        """Block until done. ``timeout`` (seconds, positive and finite; None: no limit):
        past it the first incomplete operation is treated as hung, as the watchdog treats
        one — the communicator is aborted (or revoked where its watchdog revokes) with the
        error recorded — and :class:`~pynccl.NcclTimeoutError` names the operation."""
        seconds = check_timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        from ..cuda._graph import relaxed_capture_mode

        delay = 0.0
        with relaxed_capture_mode():  # waiting never breaks another thread's capture
            while not self.test():
                if deadline is not None and time.monotonic() >= deadline:
                    error = self._hung(seconds or 0.0)
                    if error is not None:
                        raise error
                    continue  # it completed just now: test() says so
                time.sleep(delay)
                delay = min(delay * 2 or 0.0001, 0.005)

    def _hung(self, seconds: float) -> NcclTimeoutError | None:
        """The first incomplete operation is hung: trip its communicator as the watchdog
        would and return the error (also what that communicator's next call raises);
        None if every one has completed since :meth:`test` said otherwise."""
        query = _rt()[4]
        part = next((p for p in self._parts if query(p[4] or p[5].handle) == _NOT_READY), None)
        if part is None:
            return None
        comm, seq = part[0], part[1]
        line = next((_recorder.format_record(e) for e in comm.flight_record() if e[0] == seq),
                    f"#{seq}")  # fmt: skip
        error = NcclTimeoutError(
            Result.TIMEOUT,
            comm.describe(seq),
            f"operation {line} on rank {comm.rank}/{comm.size} did not complete within "
            f"{seconds:g} s (Work.wait); {comm.hang_verdict()}. ",
        )
        comm.trip_hang(error)
        return error

    def wait_stream(self, stream: StreamLike) -> None:
        """Make work queued later on ``stream`` wait for this one (``cudaStreamWaitEvent``
        per event; the host does not wait)."""
        handle = as_stream(stream)
        rt = _rt()[0]
        for part in self._parts:
            rt.cudaStreamWaitEvent(handle, part[4] or part[5].handle, 0)

    # -- the events ---------------------------------------------------------------------

    @property
    def events(self) -> tuple[Event, ...]:
        """One :class:`pynccl.cuda.Event` per stream covered (a group's Work may cover
        several); each is the caller's from now on (never reused by another Work)."""
        from ..cuda import Event

        for part in self._parts:
            if part[4]:
                part.append(Event.adopt(part[4], device=part[3]))
                part[4] = 0
        return tuple(p[5] for p in self._parts)

    @property
    def event(self) -> Event:
        """The :class:`pynccl.cuda.Event` recorded after the operation (a Work over one
        stream; see :attr:`events` for a group over several)."""
        events = self.events
        if len(events) != 1:
            raise ValueError(
                f"this Work covers {len(events)} streams, so it has {len(events)} events: "
                "use Work.events"
            )
        return events[0]

    @property
    def streams(self) -> tuple[int, ...]:
        """The stream handles it covers, in issue order."""
        return tuple(p[2] for p in self._parts)

    def __del__(self) -> None:
        try:
            for part in self._parts:
                if part[4]:
                    _give_back(part[3], part[4])
                    part[4] = 0
        except Exception:  # interpreter shutdown: nothing left to give back to
            pass

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<pynccl.Work {state}, {len(self._parts)} stream(s) {list(self.streams)}>"


_EMPTY = Work([])


def issue(comm: Communicator, call: Callable[[], object], stream: StreamLike,
          async_op: object, arrays: tuple[object, ...] = ()) -> Work | None:  # fmt: skip
    """``call()`` (one operation of ``comm`` on ``stream``, as its caller passed it, over
    ``arrays``) with ``async_op=True``, and its handle: refused first where no handle can
    follow it. ``async_op`` is any other value than False: checked as every yes/no option
    is (:func:`pynccl._limits.check_flag`; a numpy False makes the plain call)."""
    if not check_flag(async_op, "async_op"):
        call()
        return None
    s = stream_of(comm, stream, arrays)
    from ..groups import group_depth

    refuse(comm, s, group_depth())
    call()
    return after(comm, s)


def stream_of(comm: Communicator, stream: StreamLike, arrays: tuple[object, ...]) -> int:
    """The handle a call of ``comm`` over ``arrays`` runs on: ``stream=None`` is
    ``comm.stream``, ``"current"`` the arrays' library's current stream
    (:func:`pynccl.cuda._streamlike.current_stream`), anything else its handle."""
    if stream is None:
        return comm.stream
    if type(stream) is str and stream == CURRENT:
        return current_stream(arrays, comm.stream)
    return as_stream(stream)


def after(comm: Communicator, stream: int) -> Work:
    """The handle of ``comm``'s last operation, issued on ``stream`` (a non-blocking
    communicator's call still in progress is waited for first: until NCCL says it is
    ready, the operation may not be on its stream yet)."""
    if comm.state == "initializing":
        comm.wait_ready()
    return Work.after(comm, stream)


def group_work(comms: list[tuple[Any, Any]], keep: list[tuple[Any, ...]]) -> Work:
    """The Work of an ended group (:attr:`pynccl.Group.work`): one event per distinct
    (device, stream) among the calls it issued — ``comms`` entries ``(communicator,
    stream)``, ``keep`` entries ``(communicator, stream, *objects)`` — on the first
    communicator seen there (whose operation a timeout names)."""
    if not comms and not keep:
        return _EMPTY
    seen: dict[tuple[int, int], Part] = {}
    for entry in (*comms, *keep):
        comm, s = entry[0], entry[1]
        if comm is None or s is None:
            continue
        s = s if type(s) is int else (s.value or 0)
        device = comm.device
        if (device, s) not in seen:
            seen[device, s] = [comm, comm.flight_seq, s, device, 0]
    parts = list(seen.values())
    from ..cuda import _capture_blocks

    for part in parts:
        if _capture_blocks(part[2]):
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "",
                f"pynccl.group(async_op=True) ended while stream {part[2]:#x} is being "
                "captured into a CUDA graph: its operations run when the graph is "
                "launched, so no host-side handle can follow them (they were captured, "
                "the capture is intact); use pynccl.group() there and wait for the "
                "graph's launch stream",
            )
    try:
        for part in parts:
            part[4] = record(part[3], part[2])
    except BaseException:  # the events recorded so far go back: no Work holds them
        for part in parts:
            if part[4]:
                _give_back(part[3], part[4])
        raise
    return Work(parts)


def refuse(comm: Communicator, stream: int, depth: int) -> None:
    """Why ``async_op=True`` is refused, before the operation is issued: inside a group,
    or on a stream being captured into a CUDA graph."""
    if depth > 0:
        raise NcclInvalidUsage(
            Result.INVALID_USAGE,
            "",
            "async_op=True inside a group: the group's end launches the operation, so it "
            "has no handle of its own; use `with pynccl.group(async_op=True) as g:` and "
            "g.work",
        )
    from ..cuda import _capture_blocks

    if _capture_blocks(stream):
        raise NcclInvalidUsage(
            Result.INVALID_USAGE,
            "",
            f"async_op=True while stream {stream:#x} is being captured into a CUDA graph: "
            "the operation runs when the graph is launched, so no host-side handle can "
            "follow it; issue it without async_op and wait for the graph's launch stream",
        )
