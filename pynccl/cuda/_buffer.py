"""DeviceBuffer: an owned, C-contiguous device allocation, with numpy interop."""

from __future__ import annotations

import _thread
import sys
import time
from ctypes import byref, c_int, c_void_p

from .._capi._binding import ptr_arg
from .._closable import Closable
from .._limits import check_extent, index_int
from ..dtypes import as_element_type, canonical_name, complex_name, to_numpy_dtype
from ..enums import DataType
from . import _runtime
from ._device import _DeviceScope, get_device
from ._streamlike import as_stream as stream_handle

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    import numpy as np

    from ..typing import DeviceLike, DTypeLike, IndexLike, StreamLike

#: The allocations that DeviceBuffer finalizers dropped, freed by :func:`_reap` on a thread
#: of its own: ``cudaFree`` / ``ncclMemFree`` wait for the device, and a finalizer runs
#: wherever the garbage collector does — possibly on another rank's thread, whose peers
#: cannot finish the work that device waits for until that thread returns (a deadlock on
#: a GPU as on the loopback). ``(ptr, nccl)`` pairs; list append/pop are atomic.
_DROPPED: list[tuple[int, bool]] = []
_REAPER: list[object] = []  # the running reaper thread, if any (at most one)
_REAPER_LOCK = _thread.allocate_lock()
_RELAXED = 2  # cudaStreamCaptureModeRelaxed


def _drop(ptr: int, nccl: bool) -> None:
    """Free ``ptr`` later, on the reaper thread (started when needed; it ends once idle)."""
    _DROPPED.append((ptr, nccl))
    with _REAPER_LOCK:
        if not _REAPER:
            _REAPER.append(_thread.start_new_thread(_reap, ()))


def _reap() -> None:
    # Relaxed capture mode: a free here must not break another thread's global capture.
    rt = _runtime._rt()
    if rt.has("cudaThreadExchangeStreamCaptureMode"):
        rt.raw("cudaThreadExchangeStreamCaptureMode")(byref(c_int(_RELAXED)))
    while True:
        with _REAPER_LOCK:
            if not _DROPPED:
                _REAPER.clear()
                return
            ptr, nccl = _DROPPED.pop()
        try:
            if nccl:
                from .. import library

                library.lib().raw("ncclMemFree")(ptr)
            else:
                rt.raw("cudaFree")(ptr)
        except Exception:  # interpreter shutdown: nothing to report to
            pass


def wait_dropped(timeout: float = 30.0) -> bool:
    """Wait until what finalizers dropped has been freed; False after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while _REAPER or _DROPPED:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


# cudaMemcpyKind
_H2D = 1
_D2H = 2
_D2D = 3


def _shape_of(shape: IndexLike | Sequence[IndexLike]) -> tuple[int, ...]:
    """``shape`` as a tuple of ints >= 0 (an int is one dimension)."""
    if isinstance(shape, (tuple, list)):
        dims = tuple(index_int(d, "shape", "an int or a tuple of ints") for d in shape)
    else:
        dims = (index_int(shape, "shape", "an int or a tuple of ints"),)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape={shape!r} is out of range: every dimension must be >= 0")
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
    """``dtype`` as ``(NCCL type, lanes)`` (:func:`pynccl.dtypes.as_element_type`), for the
    complex types a typestr can describe."""
    dt, lanes = as_element_type(dtype)
    if lanes == 2 and dt not in _COMPLEX_TYPESTR:
        raise TypeError(
            f"data type {dtype!r} ({complex_name(dt)}) has no array-interface typestr; "
            "a DeviceBuffer holds complex64 or complex128"
        )
    return dt, lanes


def _element_name(dtype: DataType, lanes: int) -> str:
    return complex_name(dtype) if lanes == 2 else canonical_name(dtype)


class DeviceBuffer(Closable):
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

    ``allocator="nccl"`` allocates with ``ncclMemAlloc`` (NCCL >= 2.19; memory NCCL can
    register and map for its peers: symmetric windows, one-sided puts) and frees with
    ``ncclMemFree``; the default ``"cuda"`` uses ``cudaMalloc`` / ``cudaFree``.

    The allocation is freed by :meth:`close` (alias :meth:`free`), at the end of
    a ``with`` block, or quietly when the object is garbage-collected.

    Ordering: :meth:`from_numpy`, :meth:`to_numpy` and :meth:`copy_from` run their copy on
    ``stream`` (default: the legacy default stream, which on a GPU also waits for the work
    queued before on the device's blocking streams) and return once it has finished, so
    the data is in place for work on any stream. :meth:`fill_zero` without a stream does
    the same; with one it is only queued there (stream-ordered: later work on that stream
    sees zeros, work on other streams must wait for it).
    """

    __slots__ = (
        "__weakref__",
        "_count",
        "_device",
        "_dtype",
        "_info",
        "_lanes",
        "_nbytes",
        "_nccl",
        "_ptr",
        "_shape",
    )

    _ptr: int
    #: What its buffer handler returns as it is (pynccl._adapt._devbuf): ``(pointer, count,
    #: dtype, device)``; None once freed (or before the allocation succeeded).
    _info: tuple[int, int, DataType, int] | None
    _nccl: bool  # allocated by ncclMemAlloc (freed by ncclMemFree)
    _nbytes: int
    _count: int  # elements as NCCL counts them (2 floats per complex element)
    _device: int
    _dtype: DataType
    _lanes: int  # 2 for complex (two _dtype floats per element), else 1
    _shape: tuple[int, ...]

    def __init__(
        self,
        shape: IndexLike | Sequence[IndexLike],
        dtype: DTypeLike = DataType.FLOAT32,
        device: DeviceLike | None = None,
        *,
        allocator: str = "cuda",
    ) -> None:
        self._ptr = 0
        self._info = None
        self._nccl = False
        if allocator not in ("cuda", "nccl"):
            raise ValueError(f"allocator must be 'cuda' or 'nccl', got {allocator!r}")
        self._shape = _shape_of(shape)
        self._dtype, self._lanes = _element_type(dtype)
        size = 1
        for d in self._shape:
            size *= d
        self._nbytes = check_extent(size, self._dtype.itemsize * self._lanes, "DeviceBuffer")
        self._count = size * self._lanes
        out = c_void_p()
        with _DeviceScope(device) as dev:
            if dev < 0:
                dev = get_device()
            if allocator == "nccl":
                self._nccl_alloc(out)
            elif self._nbytes:  # cudaMalloc(0) gives NULL anyway; skip the call
                _runtime._rt().cudaMalloc(byref(out), self._nbytes)
        self._device = dev
        self._ptr = out.value or 0
        ptr_arg(self._ptr)  # its shared pointer argument made now, not in its first call
        self._info = (self._ptr, self._count, self._dtype, dev)

    def _nccl_alloc(self, out: c_void_p) -> None:
        """``ncclMemAlloc`` of :attr:`nbytes` into ``out`` (nothing for 0 bytes, which
        ncclMemAlloc refuses: an empty buffer holds no memory, as with cudaMalloc)."""
        from .. import library

        L = library.lib()
        L.require("DeviceBuffer(allocator='nccl') (ncclMemAlloc)", (2, 19, 1))
        self._nccl = True
        if self._nbytes:
            L.ncclMemAlloc(byref(out), self._nbytes)

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
    def allocator(self) -> str:
        """``"nccl"`` (``ncclMemAlloc``, NCCL >= 2.19) or ``"cuda"`` (``cudaMalloc``): how it
        was allocated."""
        return "nccl" if self._nccl else "cuda"

    @property
    def closed(self) -> bool:
        """True once the allocation has been freed."""
        return self._info is None

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
        cls,
        array: Any,
        device: DeviceLike | None = None,
        stream: StreamLike = None,
        *,
        allocator: str = "cuda",
    ) -> DeviceBuffer:
        """A new buffer holding a copy of ``array`` (any array-like numpy accepts).

        The copy runs on ``stream`` (default: the legacy default stream) and has finished
        when this returns: the buffer may be used on any stream, and ``array`` modified,
        right away. ``allocator`` as for the constructor.
        """
        import numpy as np

        arr = np.ascontiguousarray(array)
        buf = cls(arr.shape, arr.dtype, device, allocator=allocator)
        try:
            buf._copy(buf._ptr, arr.ctypes.data, _H2D, stream)
        except BaseException:
            buf.close()
            raise
        return buf

    def to_numpy(self, stream: StreamLike = None) -> np.ndarray:
        """A host copy as a numpy array of :attr:`shape` (ml_dtypes for bf16/FP8).

        The copy runs on ``stream`` (default: the legacy default stream), ordered after the
        work queued there before; this returns once the copy has finished.
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
        (its shape may differ). The copy runs on ``stream`` (default: the legacy default
        stream), ordered after the work queued there before, and has finished when this
        returns (for a device-to-device copy too, which CUDA would otherwise leave
        running).
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
        """Copy :attr:`nbytes` on ``stream`` (None: the legacy default stream) and wait for
        it: cudaMemcpy alone returns before a device-to-device copy (and the DMA of a
        pageable host-to-device one) has finished on a GPU."""
        if not self._nbytes:
            return
        rt = _runtime._rt()
        if stream is None:
            # The synchronous call (refused, as CUDA refuses it, inside a global-mode
            # capture), then the wait it leaves out.
            rt.cudaMemcpy(dst, src, self._nbytes, kind)
            rt.cudaStreamSynchronize(0)
            return
        handle = stream_handle(stream)
        rt.cudaMemcpyAsync(dst, src, self._nbytes, kind, handle)
        # Waiting also lets the caller reuse or free pageable host memory at once.
        rt.cudaStreamSynchronize(handle)

    def fill_zero(self, stream: StreamLike = None) -> None:
        """Set every byte to 0. With ``stream`` it is queued there and not waited for
        (stream-ordered: later work on ``stream`` sees zeros); without, it runs on the
        legacy default stream and has finished when this returns (cudaMemset alone
        would return first on a GPU)."""
        self._check_open()
        if not self._nbytes:
            return
        rt = _runtime._rt()
        if stream is None:
            rt.cudaMemset(self._ptr, 0, self._nbytes)
            rt.cudaStreamSynchronize(0)
        else:
            rt.cudaMemsetAsync(self._ptr, 0, self._nbytes, stream_handle(stream))

    # -- lifetime

    def close(self) -> None:
        """Free the allocation (idempotent). Work still queued on it must have finished."""
        ptr, self._ptr = self._ptr, 0
        self._info = None
        if ptr and self._nccl:
            from .. import library

            library.lib().ncclMemFree(ptr)
        elif ptr:
            _runtime._rt().cudaFree(ptr)

    free = close

    def _held(self) -> bool:
        return bool(getattr(self, "_ptr", 0))

    def __del__(
        self,
        _drop: Callable[[int, bool], None] = _drop,
        _exiting: Callable[[], bool] = sys.is_finalizing,
    ) -> None:
        # Never wait for a device here (see _DROPPED): the free happens on the reaper. At
        # interpreter exit (a buffer outlives the modules' globals, as on free-threaded 3.13,
        # so both helpers are bound here) no thread can start: the process's end frees it.
        ptr = getattr(self, "_ptr", 0)
        if ptr:
            self._ptr = 0
            self._info = None
            if not _exiting():
                _drop(ptr, self._nccl)

    def __repr__(self) -> str:
        state = "freed" if self.closed else f"ptr={self._ptr:#x}"
        return (
            f"<pynccl.cuda.DeviceBuffer shape={self._shape} "
            f"dtype={_element_name(self._dtype, self._lanes)} "
            f"device={self._device}{' nccl' if self._nccl else ''} {state}>"
        )
