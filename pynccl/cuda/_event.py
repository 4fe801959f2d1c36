"""CUDA events: record on a stream, wait for one, time between two."""

from __future__ import annotations

from ctypes import byref, c_float, c_void_p

from .._closable import Closable
from . import _runtime
from ._device import _DeviceScope, get_device
from ._runtime import _ERR_NOT_READY
from ._streamlike import as_stream as stream_handle

TYPE_CHECKING = False  # not imported from typing: mypy reads it as true
if TYPE_CHECKING:
    from ..typing import DeviceLike, StreamLike

# cudaEventBlockingSync, cudaEventDisableTiming.
_EVENT_BLOCKING_SYNC = 0x1
_EVENT_DISABLE_TIMING = 0x2


class Event(Closable):
    """A CUDA event (owned): record on a stream, wait for it, time between two.

    ``timing=False`` makes a lighter event that cannot be used with
    :meth:`elapsed_time`; ``blocking=True`` makes :meth:`synchronize` sleep
    rather than spin. ``device`` (default: the current one) is the device the event
    belongs to: it can be recorded only on that device's streams (CUDA's rule), and any
    device's stream may wait for it. The calling thread's current device is restored.
    """

    __slots__ = ("__weakref__", "_device", "_handle")

    _handle: int
    _device: int

    def __init__(
        self, *, timing: bool = True, blocking: bool = False, device: DeviceLike | None = None
    ) -> None:
        self._handle = 0
        flags = (0 if timing else _EVENT_DISABLE_TIMING) | (_EVENT_BLOCKING_SYNC if blocking else 0)
        out = c_void_p()
        with _DeviceScope(device) as used:
            _runtime._rt().cudaEventCreateWithFlags(byref(out), flags)
            if used < 0:
                used = get_device()
        self._handle = out.value or 0
        self._device = used

    @classmethod
    def adopt(cls, handle: int, *, device: int) -> Event:
        """An Event that takes ownership of the ``cudaEvent_t`` ``handle`` of ``device``
        (destroyed when the Event is closed or garbage), as :class:`pynccl.Work` hands out
        its event."""
        if type(handle) is not int or handle <= 0:
            raise ValueError(f"handle must be a live cudaEvent_t (a positive int), got {handle!r}")
        event = cls.__new__(cls)
        event._handle = handle
        event._device = device
        return event

    @property
    def device(self) -> int:
        """The device this event belongs to."""
        return self._device

    @property
    def handle(self) -> int:
        """The ``cudaEvent_t`` as an ``int``."""
        return self._handle

    def _live(self) -> int:
        if not self._handle:
            raise ValueError("this Event is closed")
        return self._handle

    def record(self, stream: StreamLike = None) -> Event:
        """Record the event on ``stream`` (default stream for ``None``); returns ``self``."""
        _runtime._rt().cudaEventRecord(self._live(), stream_handle(stream))
        return self

    def synchronize(self) -> None:
        """Wait until the work before the last :meth:`record` has finished."""
        _runtime._rt().cudaEventSynchronize(self._live())

    def query(self) -> bool:
        """True if the work before the last :meth:`record` has finished (never blocks)."""
        return int(_runtime._rt().cudaEventQuery(self._live())) != _ERR_NOT_READY

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded, both with timing)."""
        if not isinstance(end, Event):
            raise TypeError(f"end must be a pynccl.cuda.Event, got {type(end).__name__}")
        ms = c_float(0.0)
        _runtime._rt().cudaEventElapsedTime(byref(ms), self._live(), end._live())
        return float(ms.value)

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        handle, self._handle = self._handle, 0
        if handle:
            _runtime._rt().cudaEventDestroy(handle)

    def _held(self) -> bool:
        return bool(getattr(self, "_handle", 0))

    def __repr__(self) -> str:
        return f"<pynccl.cuda.Event {self._handle:#x}>"
