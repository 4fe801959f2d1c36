"""CUDA streams: :class:`Stream` (owned or borrowed), capture state, and the two stream
orderings the layers above need: one stream waiting for another (:func:`wait_stream`, for
``__cuda_array_interface__`` v3's ``stream``), and objects kept alive until the work queued
so far on some streams has run (:func:`keep_until_done`)."""

from __future__ import annotations

from _thread import _local, allocate_lock
from ctypes import byref, c_int, c_void_p

from .._closable import Closable
from . import _runtime
from ._device import _DeviceScope, get_device
from ._event import Event
from ._runtime import _ERR_CAPTURE_IMPLICIT, _ERR_NOT_READY
from ._streamlike import as_stream

TYPE_CHECKING = False  # not imported from typing: mypy reads it as true
if TYPE_CHECKING:
    from ..typing import DeviceLike, StreamLike

# Special stream handles of cuda_runtime_api.h.
_STREAM_LEGACY = 0x1
_STREAM_PER_THREAD = 0x2

# cudaStreamNonBlocking; cudaEventBlockingSync, cudaEventDisableTiming.
_STREAM_NON_BLOCKING = 0x1


def stream_handle(stream: StreamLike) -> int:
    """The ``cudaStream_t`` of ``stream`` as an ``int`` (0 for ``None``: the default stream).

    Accepts an ``int``, a :class:`Stream`, or any object with ``__cuda_stream__()``
    (returning ``(version, handle)``), ``.cuda_stream`` (torch), ``.ptr`` (CuPy) or
    ``__int__`` (cuda-python); the one stream adapter of pynccl,
    :func:`pynccl._adapt.as_stream`.
    """
    return as_stream(stream)


class Stream(Closable):
    """A CUDA stream: ``Stream()`` creates (and owns) one; :meth:`wrap` borrows one.

    ``handle`` is the ``cudaStream_t`` as an ``int``; ``__cuda_stream__()``
    returns ``(0, handle)`` so other libraries accept a ``Stream`` directly.
    Usable as a context manager, which closes an owned stream on exit.
    """

    __slots__ = ("__weakref__", "_closed", "_device", "_handle", "_owned", "_owner")

    _handle: int
    _closed: bool
    _owned: bool
    _owner: object
    _device: int | None  # the device it was created on; None: borrowed (not known)

    def __init__(self, *, non_blocking: bool = False, device: DeviceLike | None = None) -> None:
        """Create a stream on ``device`` (default: the current one).

        ``non_blocking=True`` gives ``cudaStreamNonBlocking`` (no implicit
        synchronization with the legacy default stream).
        """
        self._handle = 0
        self._closed = False
        self._owned = False
        self._owner = None
        self._device = None
        out = c_void_p()
        flags = _STREAM_NON_BLOCKING if non_blocking else 0
        with _DeviceScope(device) as used:
            _runtime._rt().cudaStreamCreateWithFlags(byref(out), flags)
            self._device = used if used >= 0 else get_device()
        self._handle = out.value or 0
        self._owned = True

    @classmethod
    def _borrow(cls, handle: int, owner: object) -> Stream:
        self = cls.__new__(cls)
        self._handle = handle
        self._closed = False
        self._owned = False
        self._owner = owner
        self._device = None
        return self

    @classmethod
    def wrap(cls, stream: StreamLike, owner: object = None) -> Stream:
        """A borrowed :class:`Stream` for ``stream`` (see :func:`stream_handle`).

        ``close()`` never destroys a borrowed stream. ``owner`` (default: the
        wrapped object itself, when it is not an ``int``) is kept alive as long
        as this wrapper, so the stream it owns is not destroyed underneath.
        """
        if isinstance(stream, Stream):
            return stream
        handle = stream_handle(stream)
        if owner is None and not isinstance(stream, int):
            owner = stream
        return cls._borrow(handle, owner)

    @classmethod
    def legacy_default(cls) -> Stream:
        """The legacy default stream (``cudaStreamLegacy``), which syncs with blocking streams."""
        return cls._borrow(_STREAM_LEGACY, None)

    @classmethod
    def per_thread_default(cls) -> Stream:
        """The calling thread's default stream (``cudaStreamPerThread``)."""
        return cls._borrow(_STREAM_PER_THREAD, None)

    @property
    def handle(self) -> int:
        """The ``cudaStream_t`` as an ``int``; ``ValueError`` once closed."""
        if self._closed:
            raise ValueError("this Stream is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def owned(self) -> bool:
        """True if :meth:`close` destroys the stream (it was created here)."""
        return self._owned

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    def synchronize(self) -> None:
        """Wait until all work queued on this stream has finished."""
        _runtime._rt().cudaStreamSynchronize(self.handle)
        if _KEPT:
            release_done()

    def query(self) -> bool:
        """True if all work queued on this stream has finished (never blocks)."""
        return int(_runtime._rt().cudaStreamQuery(self.handle)) != _ERR_NOT_READY

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (``cudaStreamWaitEvent``)."""
        if not isinstance(event, Event):
            raise TypeError(f"event must be a pynccl.cuda.Event, got {type(event).__name__}")
        _runtime._rt().cudaStreamWaitEvent(self.handle, event._live(), 0)

    def wait(self, other: StreamLike) -> None:
        """Make later work on this stream wait for the work queued so far on ``other``
        (which may be on another device: the event is made on ``other``'s device when it
        is a :class:`Stream` created here, else on the current device)."""
        device = other._device if isinstance(other, Stream) else None
        with Event(timing=False, device=device) as e:
            e.record(other)
            self.wait_event(e)

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one by default) on this stream and return it."""
        event = Event() if event is None else event
        return event.record(self)

    def is_capturing(self) -> bool:
        """True while this stream is being captured into a CUDA graph."""
        return is_capturing(self)

    def close(self) -> None:
        """Destroy the stream if owned (idempotent); a borrowed one is only released."""
        handle, owned = self._handle, self._owned
        self._closed = True
        self._owned = False
        self._owner = None
        self._handle = 0
        if owned and handle:
            _runtime._rt().cudaStreamDestroy(handle)

    def _held(self) -> bool:
        return bool(getattr(self, "_owned", False))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stream):
            return NotImplemented
        return self._handle == other._handle

    def __hash__(self) -> int:
        return hash(self._handle)

    def __repr__(self) -> str:
        kind = "closed" if self._closed else "owned" if self._owned else "borrowed"
        return f"<pynccl.cuda.Stream {self._handle:#x} ({kind})>"


def is_capturing(stream: StreamLike = None) -> bool:
    """True if ``stream`` is being captured into a CUDA graph (active or invalidated)."""
    status = c_int(0)
    _runtime._rt().cudaStreamIsCapturing(stream_handle(stream), byref(status))
    return status.value != 0


def _capture_blocks(handle: int) -> bool:
    """True if work that cannot be captured must not be issued on stream ``handle`` now:
    it is being captured (or its capture was invalidated), or it is the legacy default
    stream while a blocking stream of its device is capturing (CUDA then answers
    ``cudaErrorStreamCaptureImplicit``). Never raises, never disturbs a capture."""
    status = c_int(0)
    rt = _runtime._rt()
    rc = rt.raw("cudaStreamIsCapturing")(handle, byref(status))
    if rc:  # e.g. 906 for the legacy stream: not left as the thread's last CUDA error
        rt.raw("cudaGetLastError")()
    return rc == _ERR_CAPTURE_IMPLICIT or (rc == 0 and status.value != 0)


# -- one stream waiting for another ---------------------------------------------------------

# Each thread's event per device for wait_stream: recorded, waited on at once, reused (a
# wait takes the event's state when it is issued, so reuse is safe within one thread; two
# threads sharing one could make a stream wait for the other thread's producer instead).
_WAIT_EVENTS = _local()  # threading.local, without importing threading (~0.6 ms)


def wait_stream(consumer: int, producer: int, device: int | None = None) -> None:
    """Make work queued later on stream ``consumer`` wait for the work queued so far on
    stream ``producer`` (handles; 0 and 1 are the legacy default stream, 2 the per-thread
    one): an event recorded on ``producer``, ``cudaStreamWaitEvent`` on ``consumer``. Nothing
    is done when both name the same stream. ``device``: where ``producer`` lives (default:
    the current device; the special handles mean that device's streams).

    Inside a CUDA-graph capture the order is a capture's own: when both streams are being
    captured the wait joins them in the graph; when only one is, nothing is done (a wait
    on work outside the capture would invalidate it, and the graph runs when replayed)."""
    if (consumer or 1) == (producer or 1):
        return
    rt = _runtime._rt()
    with _DeviceScope(device) as dev:
        captured = _capture_blocks(consumer)
        if captured != _capture_blocks(producer):
            return
        events = getattr(_WAIT_EVENTS, "events", None)
        if events is None:
            events = _WAIT_EVENTS.events = {}
        if dev < 0:
            dev = get_device()
        event = events.get(dev)
        if event is None:
            event = events[dev] = Event(timing=False)
        rt.cudaEventRecord(event._live(), producer)
        rt.cudaStreamWaitEvent(consumer, event._live(), 0)


# -- keeping objects until streams have passed ------------------------------------------------

# (events, objects): released once every event has completed. Objects whose stream was
# being captured are never released (a graph may replay that work at any time).
_KEPT: list[tuple[list[Event], object]] = []
_KEPT_FOREVER: list[object] = []
_KEPT_LOCK = allocate_lock()


def keep_until_done(objs: object, streams: object, device: int | None = None) -> None:
    """Keep ``objs`` referenced until the work queued so far on every stream of ``streams``
    (an iterable of handles) has finished, without waiting for it here: an event is
    recorded on each, and ``objs`` dropped by a later :func:`release_done` (each call of
    this function, and :meth:`Stream.synchronize`, makes one) once all have completed.

    What a stream-ordered caching allocator (torch's, CuPy's, cuda.core's) needs of a
    buffer handed to queued work: it reuses a freed block at once. A stream that cannot
    take a record (destroyed, or broken) has nothing left to wait for; one being captured
    into a CUDA graph keeps ``objs`` for good (the graph may replay the work at any time).
    ``device``: the device of the streams (their events must be made there)."""
    rt = _runtime._rt()
    record = rt.raw("cudaEventRecord")
    events: list[Event] = []
    forever = False
    with _DeviceScope(device):
        for handle in dict.fromkeys(streams):  # type: ignore[call-overload]
            if _capture_blocks(handle):
                forever = True
                continue
            event = Event(timing=False)
            if record(event._live(), handle):
                event.close()  # a stream gone or broken: nothing of it left to wait for
                rt.raw("cudaGetLastError")()
            else:
                events.append(event)
    with _KEPT_LOCK:
        if forever:
            _KEPT_FOREVER.append(objs)
        elif events:
            _KEPT.append((events, objs))
    release_done()


def release_done() -> int:
    """Drop what :func:`keep_until_done` keeps whose streams have passed; how many sets
    of objects are still kept. Polls nothing while a CUDA-graph capture forbids this
    thread to query events (it would invalidate the capture)."""
    from ._graph import _unsafe_calls_prohibited

    if not _KEPT or _unsafe_calls_prohibited():
        return len(_KEPT)
    query = _runtime._rt().raw("cudaEventQuery")
    done: list[tuple[list[Event], object]] = []
    with _KEPT_LOCK:
        for item in list(_KEPT):
            # Not ready (600) keeps waiting; any other answer (success, or an error that
            # leaves nothing to run) releases.
            if all(query(e._live()) != _ERR_NOT_READY for e in item[0]):
                _KEPT.remove(item)
                done.append(item)
        left = len(_KEPT)
    for events, _objs in done:  # outside the lock: dropping objects may free memory
        for event in events:
            event.close()
    done.clear()
    return left
