"""The few CUDA runtime objects pynccl needs: devices, :class:`Stream`, :class:`Event`,
:class:`DeviceBuffer`, :class:`Graph`.

Layer 4, over :func:`pynccl.library.cudart` (libcudart, or the loopback stand-in
when testing without a GPU). Every failing call raises :class:`~pynccl.CudaError`
with CUDA's error name and text, except :func:`device_count`, which answers 0
where there is no usable GPU. numpy is optional: only the methods that take or
return arrays import it.

Ownership follows cuda.core: an object made here owns its handle and
``close()`` destroys it; an object that wraps a handle made elsewhere
(:meth:`Stream.wrap`) only borrows it, and ``close()`` leaves it alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from ctypes import byref, c_float, c_int, c_void_p
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from . import library as _library
from ._adapt import as_stream
from .dtypes import as_datatype, canonical_name, complex_component, complex_name, to_numpy_dtype
from .enums import DataType
from .errors import CudaError, LibraryNotFoundError

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "CaptureMode",
    "DeviceBuffer",
    "Event",
    "Graph",
    "MemoryType",
    "Stream",
    "StreamLike",
    "device_count",
    "driver_version",
    "get_device",
    "is_capturing",
    "pointer_attributes",
    "runtime_version",
    "set_device",
    "stream_handle",
    "synchronize",
]

# cudaError_t values this module reacts to.
_ERR_INITIALIZATION = 3
_ERR_STUB_LIBRARY = 34
_ERR_INSUFFICIENT_DRIVER = 35
_ERR_NO_DEVICE = 100
_ERR_NOT_READY = 600
_ERR_CAPTURE_IMPLICIT = 906  # cudaErrorStreamCaptureImplicit
#: Errors that mean "no usable GPU here" rather than a failed operation.
_NO_GPU = frozenset(
    {_ERR_INITIALIZATION, _ERR_STUB_LIBRARY, _ERR_INSUFFICIENT_DRIVER, _ERR_NO_DEVICE}
)

# cudaMemcpyKind
_H2D = 1
_D2H = 2
_D2D = 3

# Special stream handles of cuda_runtime_api.h.
_STREAM_LEGACY = 0x1
_STREAM_PER_THREAD = 0x2

# cudaStreamNonBlocking; cudaEventBlockingSync, cudaEventDisableTiming.
_STREAM_NON_BLOCKING = 0x1
_EVENT_BLOCKING_SYNC = 0x1
_EVENT_DISABLE_TIMING = 0x2

#: Anything accepted where a stream is expected: ``None`` (the default stream),
#: an ``int`` handle, a :class:`Stream`, or an object with ``__cuda_stream__``
#: (cuda.core, CuPy >= 13), ``.cuda_stream`` (torch) or ``.ptr`` (CuPy).
StreamLike = Any


def _rt() -> Any:
    return _library.cudart()


def _check_index(name: str, value: object) -> int:
    # bool is an int subclass, but set_device(True) is surely a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value


# --- devices ------------------------------------------------------------------------


def device_count() -> int:
    """Number of visible CUDA devices; 0 where there is no usable GPU.

    0 covers "no NVIDIA driver" (``cudaErrorInsufficientDriver``), "no device"
    (``cudaErrorNoDevice``) and "no libcudart found at all": code that only asks
    whether GPUs exist needs no ``try``. ``python -m pynccl info`` says which.
    Other errors propagate as :class:`CudaError`.
    """
    try:
        rt = _rt()
    except LibraryNotFoundError:
        return 0
    n = c_int(0)
    try:
        rt.cudaGetDeviceCount(byref(n))
    except CudaError as e:
        if e.code in _NO_GPU:
            return 0
        raise
    return n.value


def get_device() -> int:
    """The calling thread's current device (``cudaGetDevice``)."""
    d = c_int(-1)
    _rt().cudaGetDevice(byref(d))
    return d.value


def set_device(device: int) -> None:
    """Make ``device`` current for the calling thread (``cudaSetDevice``).

    Raises ``TypeError``/``ValueError`` for a non-int or negative index, and
    :class:`CudaError` (``cudaErrorInvalidDevice``) for one that does not exist.
    """
    index = _check_index("device", device)
    _rt().cudaSetDevice(index)


def synchronize() -> None:
    """Wait for all work on the current device (``cudaDeviceSynchronize``)."""
    _rt().cudaDeviceSynchronize()


def _decode_cuda_version(code: int) -> tuple[int, int]:
    return code // 1000, (code % 1000) // 10


def runtime_version() -> tuple[int, int]:
    """``(major, minor)`` of the loaded CUDA runtime, e.g. ``(13, 0)``; needs no driver."""
    v = c_int(0)
    _rt().cudaRuntimeGetVersion(byref(v))
    return _decode_cuda_version(v.value)


def driver_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the CUDA version the driver supports; ``None`` without a driver."""
    v = c_int(0)
    try:
        _rt().cudaDriverGetVersion(byref(v))
    except CudaError as e:
        if e.code in _NO_GPU:
            return None
        raise
    return _decode_cuda_version(v.value) if v.value > 0 else None


class _DeviceScope:
    """Make ``device`` current inside a ``with`` block, restoring the previous one."""

    __slots__ = ("_device", "_previous")

    def __init__(self, device: int | None) -> None:
        self._device = None if device is None else _check_index("device", device)
        self._previous = -1

    def __enter__(self) -> int:
        # Returns the device in use, or -1 when none was asked for (no call made).
        if self._device is None:
            return -1
        current = get_device()
        if self._device != current:
            self._previous = current
            set_device(self._device)
        return self._device

    def __exit__(self, *exc: object) -> None:
        if self._previous >= 0:
            set_device(self._previous)


# --- streams ------------------------------------------------------------------------


def stream_handle(stream: StreamLike) -> int:
    """The ``cudaStream_t`` of ``stream`` as an ``int`` (0 for ``None``: the default stream).

    Accepts an ``int``, a :class:`Stream`, or any object with ``__cuda_stream__()``
    (returning ``(version, handle)``), ``.cuda_stream`` (torch), ``.ptr`` (CuPy) or
    ``__int__`` (cuda-python); the one stream adapter of pynccl,
    :func:`pynccl._adapt.as_stream`.
    """
    return as_stream(stream)


class Stream:
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

    def __init__(self, *, non_blocking: bool = False, device: int | None = None) -> None:
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
            _rt().cudaStreamCreateWithFlags(byref(out), flags)
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
        _rt().cudaStreamSynchronize(self.handle)

    def query(self) -> bool:
        """True if all work queued on this stream has finished (never blocks)."""
        return int(_rt().cudaStreamQuery(self.handle)) != _ERR_NOT_READY

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (``cudaStreamWaitEvent``)."""
        if not isinstance(event, Event):
            raise TypeError(f"event must be a pynccl.cuda.Event, got {type(event).__name__}")
        _rt().cudaStreamWaitEvent(self.handle, event._live(), 0)

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
            _rt().cudaStreamDestroy(handle)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_owned", False):
            try:
                self.close()
            except Exception:  # interpreter shutdown or a dead context: nothing to report to
                pass

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
    _rt().cudaStreamIsCapturing(stream_handle(stream), byref(status))
    return status.value != 0


def _capture_blocks(handle: int) -> bool:
    """True if work that cannot be captured must not be issued on stream ``handle`` now:
    it is being captured (or its capture was invalidated), or it is the legacy default
    stream while a blocking stream of its device is capturing (CUDA then answers
    ``cudaErrorStreamCaptureImplicit``). Never raises, never disturbs a capture."""
    status = c_int(0)
    rc = _rt().raw("cudaStreamIsCapturing")(handle, byref(status))
    return rc == _ERR_CAPTURE_IMPLICIT or (rc == 0 and status.value != 0)


# --- graphs ---------------------------------------------------------------------------


class CaptureMode(IntEnum):
    """``cudaStreamCaptureMode``: which unsafe calls (synchronisation, allocation) other
    threads may make during a capture."""

    GLOBAL = 0
    THREAD_LOCAL = 1
    RELAXED = 2


class Graph:
    """Work captured from a stream into a CUDA graph, replayed as one launch.

    ::

        graph = Graph()
        with graph.capture(stream):   # cudaStreamBeginCapture ... cudaStreamEndCapture
            comm.all_reduce(x)        # recorded, not run
        graph.replay()                # cudaGraphLaunch: runs it, reading x as it is now
        graph.close()

    Only the executable graph is kept (the captured graph is freed once
    instantiated). Capturing again replaces it. Usable as a context manager, which
    closes it on exit. Collectives of several ranks must be captured, and replayed,
    by every rank.
    """

    __slots__ = ("__weakref__", "_capturing", "_exec", "_stream")

    _exec: int
    _stream: Stream | None
    _capturing: bool

    def __init__(self) -> None:
        self._exec = 0
        self._stream = None
        self._capturing = False

    @contextlib.contextmanager
    def capture(
        self, stream: StreamLike, mode: CaptureMode | str = CaptureMode.GLOBAL
    ) -> Iterator[Graph]:
        """Capture the work the body issues on ``stream`` (not the legacy default stream).

        ``mode``: :class:`CaptureMode` or its name (``"global"``, the default as in
        PyTorch, ``"thread_local"``, ``"relaxed"``). If the body raises, the capture
        is ended and discarded and the body's exception propagates; a capture that
        CUDA invalidated (the body synchronised, allocated, ...) raises
        :class:`~pynccl.CudaError` on exit.
        """
        if isinstance(mode, str):
            try:
                mode = CaptureMode[mode.upper()]
            except KeyError:
                raise ValueError(
                    f"mode={mode!r}: expected 'global', 'thread_local' or 'relaxed'"
                ) from None
        elif not isinstance(mode, CaptureMode):
            raise TypeError(f"mode must be a CaptureMode or its name, got {mode!r}")
        if self._capturing:
            raise RuntimeError("this Graph is already capturing")
        wrapped = Stream.wrap(stream)
        handle = wrapped.handle
        if handle in (0, _STREAM_LEGACY):
            raise ValueError(
                "the legacy default stream cannot be captured; capture on a Stream() "
                "(or another stream you created)"
            )
        rt = _rt()
        rt.cudaStreamBeginCapture(handle, int(mode))
        self._capturing = True
        graph = c_void_p()
        try:
            yield self
        except BaseException:
            # End the capture so the stream is usable again; what it holds is discarded.
            rt.raw("cudaStreamEndCapture")(handle, byref(graph))
            if graph.value:
                rt.raw("cudaGraphDestroy")(graph)
            raise
        finally:
            self._capturing = False
        rt.cudaStreamEndCapture(handle, byref(graph))
        try:
            exe = c_void_p()
            rt.cudaGraphInstantiate(byref(exe), graph, 0)
        finally:
            rt.cudaGraphDestroy(graph)
        self.close()
        self._exec = exe.value or 0
        self._stream = wrapped

    def replay(self, stream: StreamLike = None) -> None:
        """Launch the graph on ``stream`` (default: the stream it was captured from)."""
        if not self._exec:
            raise ValueError("this Graph holds nothing to replay: capture first (or closed)")
        target = self._stream if stream is None else stream
        _rt().cudaGraphLaunch(self._exec, stream_handle(target))

    @property
    def captured(self) -> bool:
        """True once a capture completed and until :meth:`close`."""
        return bool(self._exec)

    def close(self) -> None:
        """Destroy the executable graph (idempotent)."""
        exe, self._exec = self._exec, 0
        self._stream = None
        if exe:
            _rt().cudaGraphExecDestroy(exe)

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_exec", 0):
            try:
                self.close()
            except Exception:  # interpreter shutdown or a dead context
                pass

    def __repr__(self) -> str:
        state = "capturing" if self._capturing else "captured" if self._exec else "empty"
        return f"<pynccl.cuda.Graph ({state})>"


# --- events ---------------------------------------------------------------------------


class Event:
    """A CUDA event (owned): record on a stream, wait for it, time between two.

    ``timing=False`` makes a lighter event that cannot be used with
    :meth:`elapsed_time`; ``blocking=True`` makes :meth:`synchronize` sleep
    rather than spin.
    """

    __slots__ = ("__weakref__", "_handle")

    _handle: int

    def __init__(self, *, timing: bool = True, blocking: bool = False) -> None:
        self._handle = 0
        flags = (0 if timing else _EVENT_DISABLE_TIMING) | (_EVENT_BLOCKING_SYNC if blocking else 0)
        out = c_void_p()
        _rt().cudaEventCreateWithFlags(byref(out), flags)
        self._handle = out.value or 0

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
        _rt().cudaEventRecord(self._live(), stream_handle(stream))
        return self

    def synchronize(self) -> None:
        """Wait until the work before the last :meth:`record` has finished."""
        _rt().cudaEventSynchronize(self._live())

    def query(self) -> bool:
        """True if the work before the last :meth:`record` has finished (never blocks)."""
        return int(_rt().cudaEventQuery(self._live())) != _ERR_NOT_READY

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded, both with timing)."""
        if not isinstance(end, Event):
            raise TypeError(f"end must be a pynccl.cuda.Event, got {type(end).__name__}")
        ms = c_float(0.0)
        _rt().cudaEventElapsedTime(byref(ms), self._live(), end._live())
        return float(ms.value)

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        handle, self._handle = self._handle, 0
        if handle:
            _rt().cudaEventDestroy(handle)

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_handle", 0):
            try:
                self.close()
            except Exception:  # interpreter shutdown or a dead context
                pass

    def __repr__(self) -> str:
        return f"<pynccl.cuda.Event {self._handle:#x}>"


# --- memory ---------------------------------------------------------------------------


class MemoryType(IntEnum):
    """``cudaMemoryType``: where a pointer lives."""

    UNREGISTERED = 0
    HOST = 1
    DEVICE = 2
    MANAGED = 3


def pointer_attributes(ptr: int) -> tuple[MemoryType, int]:
    """``(memory type, device)`` of ``ptr`` (``cudaPointerGetAttributes``).

    Plain host memory gives ``(MemoryType.UNREGISTERED, -2)`` (device is
    whatever CUDA reports; -2 is its "no device" value for such memory).
    """
    from ._capi.structs import cudaPointerAttributes

    if not isinstance(ptr, int) or isinstance(ptr, bool):
        raise TypeError(f"ptr must be an int address, got {type(ptr).__name__}")
    attrs = cudaPointerAttributes()
    _rt().cudaPointerGetAttributes(byref(attrs), ptr)
    try:
        kind = MemoryType(attrs.type)
    except ValueError:
        raise CudaError(
            0, "cudaPointerGetAttributes", "", f"unknown cudaMemoryType {attrs.type}"
        ) from None
    return kind, int(attrs.device)


def _shape_of(shape: int | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"shape={shape!r}: every dimension must be an int >= 0")
    return dims


# numpy's typestr for each type. bfloat16 and FP8 have none: opaque void items of
# their size (ml_dtypes itself is inconsistent: '<V2', '<V1' but '<f1' for e5m2).
_TYPESTR = {
    DataType.INT8: "|i1",
    DataType.UINT8: "|u1",
    DataType.INT32: "<i4",
    DataType.UINT32: "<u4",
    DataType.INT64: "<i8",
    DataType.UINT64: "<u8",
    DataType.FLOAT16: "<f2",
    DataType.FLOAT32: "<f4",
    DataType.FLOAT64: "<f8",
    DataType.BFLOAT16: "<V2",
    DataType.FLOAT8_E4M3: "|V1",
    DataType.FLOAT8_E5M2: "|V1",
}


# Complex element types a DeviceBuffer holds, by the float type of each half, and their
# typestrs (numpy has no complex32, so that one has no typestr and is not offered).
_COMPLEX_TYPESTR = {DataType.FLOAT32: "<c8", DataType.FLOAT64: "<c16"}


def _element_type(dtype: Any) -> tuple[DataType, int]:
    """``dtype`` as ``(NCCL type, lanes)``: a complex type is 2 lanes of its float type."""
    try:
        return as_datatype(dtype), 1
    except TypeError:
        part = complex_component(dtype)
        if part is None:
            raise
        if part not in _COMPLEX_TYPESTR:
            raise TypeError(
                f"data type {dtype!r} ({complex_name(part)}) has no array-interface typestr; "
                "a DeviceBuffer holds complex64 or complex128"
            ) from None
        return part, 2


def _element_name(dtype: DataType, lanes: int) -> str:
    return complex_name(dtype) if lanes == 2 else canonical_name(dtype)


class DeviceBuffer:
    """An owned, C-contiguous device allocation (``cudaMalloc``) of ``shape`` and ``dtype``.

    ``DeviceBuffer(shape, dtype="float32", device=None)`` allocates (contents
    undefined: see :meth:`fill_zero`); :meth:`from_numpy` copies an array in.
    ``ptr`` is the device address (an ``int``), ``dtype`` a :class:`~pynccl.DataType`.
    A complex64 / complex128 buffer (:attr:`is_complex`) has the float type of each half
    as its ``dtype``; collectives move it as twice as many floats.

    ``__cuda_array_interface__`` (v3) exports it to CuPy, Numba, torch and to
    pynccl's own collectives. Its ``typestr`` is numpy's for the type. bfloat16
    and the FP8 types have no typestr of their own: they are given as opaque
    items of the right size, ``<V2`` (what numpy reports for ml_dtypes'
    bfloat16) and ``|V1``, so consumers that move bytes work, and pynccl reads
    the real type from ``dtype`` (a :class:`~pynccl.DataType`).

    The allocation is freed by :meth:`close` (alias :meth:`free`), at the end of
    a ``with`` block, or quietly when the object is garbage-collected.
    """

    __slots__ = (
        "__weakref__",
        "_device",
        "_dtype",
        "_freed",
        "_lanes",
        "_nbytes",
        "_ptr",
        "_shape",
    )

    _ptr: int
    _freed: bool
    _nbytes: int
    _device: int
    _dtype: DataType
    _lanes: int  # 2 for complex (two _dtype floats per element), else 1
    _shape: tuple[int, ...]

    def __init__(
        self,
        shape: int | tuple[int, ...] | list[int],
        dtype: Any = DataType.FLOAT32,
        device: int | None = None,
    ) -> None:
        self._ptr = 0
        self._freed = False
        self._shape = _shape_of(shape)
        self._dtype, self._lanes = _element_type(dtype)
        size = 1
        for d in self._shape:
            size *= d
        self._nbytes = size * self._dtype.itemsize * self._lanes
        out = c_void_p()
        with _DeviceScope(device) as dev:
            if dev < 0:
                dev = get_device()
            if self._nbytes:  # cudaMalloc(0) gives NULL anyway; skip the call
                _rt().cudaMalloc(byref(out), self._nbytes)
        self._device = dev
        self._ptr = out.value or 0

    # -- properties

    @property
    def ptr(self) -> int:
        """The device address (0 for an empty or freed buffer)."""
        return self._ptr

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self._nbytes

    @property
    def device(self) -> int:
        """The device the allocation lives on."""
        return self._device

    @property
    def dtype(self) -> DataType:
        """The element type, as a :class:`~pynccl.DataType` (for a complex buffer, the
        float type of each half)."""
        return self._dtype

    @property
    def is_complex(self) -> bool:
        """True for a complex64 / complex128 buffer."""
        return self._lanes == 2

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape (C order)."""
        return self._shape

    @property
    def size(self) -> int:
        """Number of elements."""
        return self._nbytes // (self._dtype.itemsize * self._lanes)

    @property
    def closed(self) -> bool:
        """True once the allocation has been freed."""
        return self._freed

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        self._check_open()
        return {
            "shape": self._shape,
            "typestr": _COMPLEX_TYPESTR[self._dtype] if self._lanes == 2 else _TYPESTR[self._dtype],
            "data": (self._ptr, False),
            "strides": None,
            "version": 3,
        }

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this DeviceBuffer has been freed")

    # -- numpy interop

    @classmethod
    def from_numpy(
        cls, array: Any, device: int | None = None, stream: StreamLike = None
    ) -> DeviceBuffer:
        """A new buffer holding a copy of ``array`` (any array-like numpy accepts).

        With ``stream`` the copy is queued on it and the stream is synchronized
        before returning, so ``array`` may be modified right away.
        """
        import numpy as np

        arr = np.ascontiguousarray(array)
        buf = cls(arr.shape, arr.dtype, device)
        try:
            buf._copy(buf._ptr, arr.ctypes.data, _H2D, stream)
        except BaseException:
            buf.close()
            raise
        return buf

    def to_numpy(self, stream: StreamLike = None) -> np.ndarray:
        """A host copy as a numpy array of :attr:`shape` (ml_dtypes for bf16/FP8).

        With ``stream`` the copy is ordered after the work queued on it;
        this returns once the copy has finished.
        """
        import numpy as np

        self._check_open()
        if self._lanes == 2:
            host_type = np.dtype(complex_name(self._dtype))
        else:
            host_type = to_numpy_dtype(self._dtype)
        out = np.empty(self._shape, dtype=host_type)
        self._copy(out.ctypes.data, self._ptr, _D2H, stream)
        return out

    def copy_from(self, source: Any, stream: StreamLike = None) -> None:
        """Overwrite the contents from a host array or another :class:`DeviceBuffer`.

        ``source`` must have the same element type and number of elements
        (its shape may differ). Returns once the copy has finished.
        """
        self._check_open()
        if isinstance(source, DeviceBuffer):
            source._check_open()
            self._check_match((source._dtype, source._lanes), source.size)
            self._copy(self._ptr, source.ptr, _D2D, stream)
            return
        import numpy as np

        arr = np.ascontiguousarray(source)
        self._check_match(_element_type(arr.dtype), arr.size)
        self._copy(self._ptr, arr.ctypes.data, _H2D, stream)

    def _check_match(self, element: tuple[DataType, int], size: int) -> None:
        if element != (self._dtype, self._lanes):
            raise ValueError(
                f"source dtype {_element_name(*element)} does not match the buffer's "
                f"{_element_name(self._dtype, self._lanes)}"
            )
        if size != self.size:
            raise ValueError(f"source has {size} elements; the buffer holds {self.size}")

    def _copy(self, dst: int, src: int, kind: int, stream: StreamLike) -> None:
        if not self._nbytes:
            return
        rt = _rt()
        if stream is None:
            rt.cudaMemcpy(dst, src, self._nbytes, kind)
            return
        # Pageable host memory: wait, so the caller may reuse the host array at once.
        handle = stream_handle(stream)
        rt.cudaMemcpyAsync(dst, src, self._nbytes, kind, handle)
        rt.cudaStreamSynchronize(handle)

    def fill_zero(self, stream: StreamLike = None) -> None:
        """Set every byte to 0; queued on ``stream`` when one is given (not waited for)."""
        self._check_open()
        if not self._nbytes:
            return
        if stream is None:
            _rt().cudaMemset(self._ptr, 0, self._nbytes)
        else:
            _rt().cudaMemsetAsync(self._ptr, 0, self._nbytes, stream_handle(stream))

    # -- lifetime

    def close(self) -> None:
        """Free the allocation (idempotent). Work still queued on it must have finished."""
        ptr, self._ptr = self._ptr, 0
        self._freed = True
        if ptr:
            _rt().cudaFree(ptr)

    free = close

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_ptr", 0):
            try:
                self.close()
            except Exception:  # interpreter shutdown or a dead context
                pass

    def __repr__(self) -> str:
        state = "freed" if self.closed else f"ptr={self._ptr:#x}"
        return (
            f"<pynccl.cuda.DeviceBuffer shape={self._shape} "
            f"dtype={_element_name(self._dtype, self._lanes)} "
            f"device={self._device} {state}>"
        )
