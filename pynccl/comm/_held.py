"""What ended groups kept alive, held until the streams their work ran on have passed it.

An operation queued in a group runs after ``ncclGroupEnd`` returns: its buffers must live
until it has *run* on its stream, not only until it was launched — a stream-ordered
caching allocator (torch's, CuPy's, cuda.core's) hands a freed block out again at once.
:func:`hold` records one event per stream the group used (after the end; for a
non-blocking group still in progress, once none of its communicators is in progress any
more: NCCL launches from its own thread) and :func:`release` lets the objects go once
every event has completed. Nothing waits and no thread of its own runs: group ends of
the same thread (:func:`pynccl.groups.release_done`) poll, oldest first.

Queries run with the thread in relaxed CUDA-graph capture mode
(``cudaThreadExchangeStreamCaptureMode``, restored after), so another thread's global
capture is never invalidated; where libcudart lacks the switch, nothing is queried while
a capture begun through :class:`pynccl.cuda.Graph` forbids it. Work captured into a
graph keeps its objects for good (the graph may replay it at any time).
"""

from __future__ import annotations

from ctypes import byref, c_int, c_void_p

from .. import library as _library
from ..cuda import DeviceBuffer
from ..cuda._graph import capturing_graphs
from ._collconfig import CollConfig
from ._window import Window

__all__ = ["HOLDERS", "Held", "hold", "needs_order", "release"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..groups import GroupMember

# cudaEventDisableTiming; cudaErrorNotReady; the capture errors (900..908: a query refused
# because of a capture, not an answer about the work); cudaStreamCaptureModeRelaxed.
_EVENT_DISABLE_TIMING = 0x2
_NOT_READY = 600
_CAPTURE_ERRORS = range(900, 909)
_RELAXED = 2
#: Free events per device (handles), reused: a group end records one per stream it used.
_POOL: dict[int, list[int]] = {}
#: Objects whose work was captured into a CUDA graph: a graph may replay it at any time.
_FOREVER: list[object] = []
#: Types whose objects can go once NCCL has launched the work (see needs_order).
_SAFE: set[type] = {type(None), int, str, CollConfig, Window}
#: Types whose objects keep others alive and say which (``kept``: None once closed, when
#: their close kept them itself): pynccl.PersistentOp registers itself here.
HOLDERS: set[type] = set()


class _Runtime:
    """The libcudart functions a hold and a release call, bound once per library (a group
    end makes five or six of these calls: looking each up by name costs as much again)."""

    __slots__ = (
        "create", "exchange", "get_device", "is_capturing", "last_error", "lib", "query",
        "record", "set_device",
    )  # fmt: skip

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        raw = lib.raw
        self.get_device, self.is_capturing = raw("cudaGetDevice"), raw("cudaStreamIsCapturing")
        self.record, self.query = raw("cudaEventRecord"), raw("cudaEventQuery")
        self.last_error = raw("cudaGetLastError")
        self.set_device, self.create = lib.cudaSetDevice, lib.cudaEventCreateWithFlags
        # None where libcudart lacks the switch (then see release).
        has = lib.has("cudaThreadExchangeStreamCaptureMode")
        self.exchange = raw("cudaThreadExchangeStreamCaptureMode") if has else None


_RT: _Runtime | None = None


def _runtime() -> _Runtime:
    global _RT
    lib = _library.cudart()
    rt = _RT
    if rt is None or rt.lib is not lib:  # first use, or the process's libcudart replaced
        rt = _RT = _Runtime(lib)
    return rt


class Held:
    """One ended group's kept objects, let go once an event recorded after the group on
    each stream it used (``streams``: (device, handle, a communicator that issued
    there); device -1: the current one) has completed. ``waiting``: the communicators of
    a non-blocking group still in progress (the events are recorded once none of them is
    in progress any more)."""

    __slots__ = ("events", "objs", "streams", "waiting")

    def __init__(
        self, objs: object, streams: list[tuple[int, int, Any]], waiting: list[GroupMember]
    ) -> None:
        self.objs = objs
        self.streams = streams
        self.waiting = waiting
        self.events: list[tuple[int, int]] = []


def hold(held: list[Held], keep: list[tuple[Any, ...]], waiting: list[GroupMember]) -> bool:
    """Hold what an ended group kept (``keep``: (communicator, stream, *objects) entries)
    until every stream it used has passed the group, appending to ``held``; True if
    ``keep`` was taken (else the caller may let it go now). Once NCCL has launched, only
    objects whose memory a free could hand out while the work runs need that (see
    :func:`needs_order`); while a non-blocking group is in progress (``waiting``) nothing
    is on the streams yet, so everything waits. One pass over the entries: per entry that
    needs order one entry per distinct stream (a send+recv pair's second entry, of the
    same communicator and stream, is skipped)."""
    streams: list[tuple[int, int, Any]] = []  # (device, handle, a communicator) each once
    last_comm = last_stream = None  # the last entry that needed order
    for entry in keep:
        comm, stream = entry[0], entry[1]
        if comm is None or stream is None:  # nothing issued on a stream, or nothing to keep
            continue
        if comm is last_comm and stream is last_stream:
            continue  # its stream is among `streams` already (a send+recv pair's second)
        if not waiting and not needs_order(entry[2:]):
            continue
        last_comm, last_stream = comm, stream
        handle = stream if type(stream) is int else (stream.value or 0)
        device = comm.watch_device()  # known, or asked without the gate
        if device is None:
            device = -1
        for known in streams:
            if known[0] == device and known[1] == handle:
                break
        else:
            streams.append((device, handle, comm))
    if not streams and not waiting:
        return False  # nothing stream-ordered to wait for
    item = Held(keep, streams, waiting)
    if waiting or _record(item):
        held.append(item)
    return True


def needs_order(objs: tuple[Any, ...]) -> bool:
    """Whether ``objs`` must outlive the work queued on them. A ``DeviceBuffer`` from
    ``cudaMalloc`` need not (``cudaFree`` waits for the device), nor a config (read at
    the launch) or a window (its communicator holds it); anything else may be memory of
    a stream-ordered caching allocator, and a persistent operation is as the buffers it
    holds (closed: its close kept them itself)."""
    for obj in objs:
        kind = type(obj)
        if kind in _SAFE or (kind is DeviceBuffer and obj.allocator == "cuda"):
            continue
        if kind in HOLDERS and ((kept := obj.kept) is None or not needs_order(kept)):
            continue
        return True
    return False


def _record(item: Held) -> bool:
    """Record an event on each stream of ``item``; False when there is nothing to wait
    for. Events come from a per-device pool and go back to it only once completed (see
    :func:`_release`), so a reused event never stands for work it was recorded after
    before. Work captured into a CUDA graph runs when the graph is launched, any number
    of times: the capturing :class:`pynccl.cuda.Graph` keeps the objects until it is
    closed (a capture pynccl did not begin: kept for good). A stream's device is made
    current where that matters: for the per-device default streams (0, 1, 2), and to
    make an event there."""
    rt = _runtime()
    current = now = -2  # not asked yet
    forever, status = False, c_int(0)
    ref = byref(status)
    try:
        for device, handle, comm in item.streams:
            free = _POOL.get(device)
            try:  # another thread may take the last one first: then make one
                event = free.pop() if free else 0
            except IndexError:
                event = 0
            if device >= 0 and device != now and (handle <= 2 or not event):
                if current == -2:
                    status.value = -1
                    rt.get_device(ref)
                    current = now = status.value
                if device != now:
                    rt.set_device(device)
                    now = device
            # 906 (the legacy stream while a blocking stream of the device captures):
            # the work went into that capture too.
            rc = rt.is_capturing(handle, ref)
            if rc or status.value:
                if rc:
                    rt.last_error()
                if event:
                    _POOL.setdefault(device, []).append(event)
                graphs = capturing_graphs(handle)
                for graph in graphs:
                    graph._captured(comm, (item.objs,))
                forever = forever or not graphs
                continue
            if not event:
                out = c_void_p()
                rt.create(byref(out), _EVENT_DISABLE_TIMING)
                event = out.value or 0
            if rt.record(event, handle):  # a stream gone or broken: nothing left to wait for
                rt.last_error()
                _POOL.setdefault(device, []).append(event)
            else:
                item.events.append((device, event))
    finally:
        if now != current:
            rt.set_device(current)
    if forever:
        _FOREVER.append(item.objs)
    return bool(item.events)


def release(held: list[Held]) -> None:
    """One pass over ``held``, oldest first, in relaxed capture mode: a group that was in
    progress is recorded once ready; recorded ones are let go once their events have
    completed."""
    rt = _runtime()
    exchange = rt.exchange
    mode = c_int(_RELAXED)
    ref = byref(mode)
    if exchange is None or exchange(ref):
        if exchange is not None:
            rt.last_error()
        from ..cuda import _unsafe_calls_prohibited

        if _unsafe_calls_prohibited():
            return
        _release(rt, held)
        return
    try:
        _release(rt, held)
    finally:
        if mode.value != _RELAXED:
            exchange(ref)


def _release(rt: _Runtime, held: list[Held]) -> None:
    query = rt.query
    done: list[Held] = []
    for item in held:
        if item.waiting:
            # Ready (its wait_ready ran: the next call or synchronize) or torn down.
            if any(comm.state == "initializing" for comm in item.waiting):
                continue
            item.waiting = []
            if not _record(item):
                done.append(item)
            continue  # just recorded: asked at a later pass
        for _, event in item.events:
            rc = query(event)
            if rc:
                if rc == _NOT_READY or rc in _CAPTURE_ERRORS:
                    if rc != _NOT_READY:
                        rt.last_error()
                    break
                rt.last_error()  # an error leaves nothing of that stream to run
        else:
            done.append(item)
            continue
        break  # the thread's later groups are behind this one on its streams
    for item in done:
        held.remove(item)
        for device, event in item.events:
            _POOL.setdefault(device, []).append(event)
        item.events = []
        item.objs = None  # the last reference: a buffer's memory may go now
