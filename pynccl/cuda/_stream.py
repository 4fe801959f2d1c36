"""CUDA streams: :class:`Stream` (owned or borrowed), capture state."""

from __future__ import annotations

from ctypes import byref, c_int, c_void_p

from .._closable import Closable
from . import _runtime
from ._device import _DeviceScope
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

    __slots__ = ("__weakref__", "_closed", "_handle", "_owned", "_owner")

    _handle: int
    _closed: bool
    _owned: bool
    _owner: object

    def __init__(self, *, non_blocking: bool = False, device: DeviceLike | None = None) -> None:
        """Create a stream on ``device`` (default: the current one).

        ``non_blocking=True`` gives ``cudaStreamNonBlocking`` (no implicit
        synchronization with the legacy default stream).
        """
        self._handle = 0
        self._closed = False
        self._owned = False
        self._owner = None
        out = c_void_p()
        flags = _STREAM_NON_BLOCKING if non_blocking else 0
        with _DeviceScope(device):
            _runtime._rt().cudaStreamCreateWithFlags(byref(out), flags)
        self._handle = out.value or 0
        self._owned = True

    @classmethod
    def _borrow(cls, handle: int, owner: object) -> Stream:
        self = cls.__new__(cls)
        self._handle = handle
        self._closed = False
        self._owned = False
        self._owner = owner
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

    def query(self) -> bool:
        """True if all work queued on this stream has finished (never blocks)."""
        return int(_runtime._rt().cudaStreamQuery(self.handle)) != _ERR_NOT_READY

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (``cudaStreamWaitEvent``)."""
        if not isinstance(event, Event):
            raise TypeError(f"event must be a pynccl.cuda.Event, got {type(event).__name__}")
        _runtime._rt().cudaStreamWaitEvent(self.handle, event._live(), 0)

    def wait(self, other: StreamLike) -> None:
        """Make later work on this stream wait for the work queued so far on ``other``."""
        with Event(timing=False) as e:
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
    rc = _runtime._rt().raw("cudaStreamIsCapturing")(handle, byref(status))
    return rc == _ERR_CAPTURE_IMPLICIT or (rc == 0 and status.value != 0)
