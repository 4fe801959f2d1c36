"""Arrays pynccl hands out over device memory it does not own: :class:`PeerArray`, with
``__cuda_array_interface__`` (v3) and DLPack (``__dlpack__`` / ``__dlpack_device__``,
legacy ``DLManagedTensor`` or, for consumers that ask for DLPack >= 1.0,
``DLManagedTensorVersioned``), built with ctypes (no C extension).

The capsule's ``manager_ctx`` keeps the view (and so its owner) alive until the consumer
calls the deleter, or until an unconsumed capsule is collected.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char_p,
    c_int32,
    c_int64,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)
from typing import Any

from .._limits import check_extent
from ..cuda._buffer import _COMPLEX_TYPESTR, _TYPESTR, _element_type, _shape_of
from ..enums import DataType, Result
from ..errors import NcclInvalidUsage
from ._dlpack import _DL_COMPLEX, _DL_TYPES

__all__ = ["PeerArray"]

_DL_CUDA = 2
_DL_CODE = {dt: code_bits for code_bits, dt in _DL_TYPES.items()}
_DL_COMPLEX_CODE = {dt: code_bits for code_bits, dt in _DL_COMPLEX.items()}
_LEGACY = b"dltensor"
_VERSIONED = b"dltensor_versioned"


class _DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class _DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class _DLTensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", _DLDevice),
        ("ndim", c_int32),
        ("dtype", _DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


_Deleter = CFUNCTYPE(None, c_void_p)


class _Managed(Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", c_void_p), ("deleter", _Deleter)]


class _Versioned(Structure):
    _fields_ = [
        ("major", c_uint32),
        ("minor", c_uint32),
        ("manager_ctx", c_void_p),
        ("deleter", _Deleter),
        ("flags", c_uint64),
        ("dl_tensor", _DLTensor),
    ]


#: Exported tensors not released yet: struct address -> (struct, shape array, view).
_LIVE: dict[int, tuple[Any, Any, PeerArray]] = {}
_LIVE_LOCK = threading.Lock()


def _release(address: int | None) -> None:
    with _LIVE_LOCK:
        entry = _LIVE.pop(address or 0, None)
    # Dropped outside the lock: the view, its owner and whatever their finalizers set off
    # (a collection releasing another capsule, which takes the lock) go after it.
    del entry


_DELETER = _Deleter(_release)
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, c_void_p, c_char_p, c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi)
)
_capsule_name = ctypes.PYFUNCTYPE(c_char_p, c_void_p)(("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def _capsule_gone(capsule: int | None) -> None:
    """A capsule was collected: if no consumer took it (its name unchanged), release it."""
    try:
        name = _capsule_name(capsule)
        if name in (_LEGACY, _VERSIONED):
            _release(_capsule_pointer(capsule, name))
    except Exception:  # never raise into the collector; the view then stays referenced
        pass


_DESTRUCTOR = CFUNCTYPE(None, c_void_p)(_capsule_gone)
_DESTRUCTOR_PTR = ctypes.cast(_DESTRUCTOR, c_void_p)


def _check_stream(stream: object) -> None:
    """``__dlpack__``'s ``stream`` for a CUDA array (the array API): None, -1, 1, 2 or a
    ``cudaStream_t`` handle; 0 is ambiguous and refused, as anything that is no handle."""
    if stream is None:
        return
    if type(stream) is not int:
        raise TypeError(
            f"stream must be None or an int (DLPack's stream for a CUDA array), got "
            f"{type(stream).__name__} {stream!r}"
        )
    if stream == 0 or not (stream == -1 or 0 < stream < 1 << 64):
        raise ValueError(
            f"stream={stream} is out of range; expected None, -1, 1 (legacy default), 2 "
            "(per-thread default) or a CUDA stream handle below 2**64 (0 is ambiguous)"
        )


def _pair(value: Any, name: str, what: str) -> tuple[int, int] | None:
    """``max_version`` / ``dl_device`` of ``__dlpack__``: None or a pair of ints."""
    if value is None:
        return None
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise TypeError(f"{name} must be None or a {what} tuple of two ints, got {value!r}")
    return (int(value[0]), int(value[1]))


class PeerArray:
    """A C-contiguous array over device memory pynccl does not own (another rank's window:
    :meth:`~pynccl.Window.peer_array`). It exposes ``__cuda_array_interface__`` v3 and
    DLPack on device ``(kDLCUDA, device)``, so ``cupy.asarray(view)``,
    ``torch.from_dlpack(view)`` and pynccl's array adapters read it without a copy (a
    collective refuses it as a buffer, as NCCL does a peer's address: copy it first). It
    keeps its ``owner`` (the window) referenced; the memory is valid while the owner is
    open, and once it is closed the view refuses to export its address
    (``NcclInvalidUsage``). It carries no stream: nothing this process queued produces
    it (order the peer's writes with a barrier or a signal), so its array interface says
    ``stream: None``."""

    __slots__ = ("_dtype", "_lanes", "_nbytes", "_owner", "_ptr", "_shape", "device")

    def __init__(self, ptr: int, shape: Any, dtype: Any, device: int, owner: object) -> None:
        self._shape = _shape_of(shape)
        self._dtype, self._lanes = _element_type(dtype)
        size = 1
        for d in self._shape:
            size *= d
        self._nbytes = check_extent(size, self._dtype.itemsize * self._lanes, "shape")
        self._ptr = ptr
        #: The device the memory is reachable from (this rank's).
        self.device = device
        self._owner = owner

    ptr = property(lambda self: self._ptr, doc="The device address (an ``int``).")
    shape = property(lambda self: self._shape, doc="The shape (C order).")
    nbytes = property(lambda self: self._nbytes, doc="Size in bytes.")
    owner = property(lambda self: self._owner, doc="What keeps the memory valid (the window).")

    @property
    def dtype(self) -> DataType:
        """The element type (for complex, the float type of each half, as DeviceBuffer)."""
        return self._dtype

    def _check_owner(self) -> None:
        """Refuse to hand the address out once the owner (the window) is closed: the peer's
        memory is valid only while the window is registered (NCCL deregisters its mapping)."""
        if getattr(self._owner, "closed", False):
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "",
                f"{self!r} views {self._owner!r}, which is closed; it cannot be used any more",
            )

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        self._check_owner()
        typestr = _COMPLEX_TYPESTR[self._dtype] if self._lanes == 2 else _TYPESTR[self._dtype]
        return {
            "shape": self._shape,
            "typestr": typestr,
            "data": (self._ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DL_CUDA, self.device)

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule over the memory (versioned if ``max_version`` >= (1, 0)).
        ``stream``: the consumer's; nothing is pending here, so nothing is ordered
        (0 is refused, as DLPack does for CUDA). ``copy=True`` or another ``dl_device``
        raise ``BufferError``: a peer view is never copied."""
        _check_stream(stream)
        max_version = _pair(max_version, "max_version", "(major, minor)")
        dl_device = _pair(dl_device, "dl_device", "(device_type, device_id)")
        if copy:
            raise BufferError("copy=True: a PeerArray is a view of a peer's memory, never copied")
        if dl_device is not None and dl_device != (_DL_CUDA, self.device):
            raise BufferError(
                f"dl_device={dl_device!r}: this PeerArray is on {(_DL_CUDA, self.device)}"
                " and cannot be copied elsewhere"
            )
        self._check_owner()
        versioned = max_version is not None and max_version >= (1, 0)
        return self._capsule(versioned)

    def _capsule(self, versioned: bool) -> Any:
        ndim = len(self._shape)
        shape = (c_int64 * max(ndim, 1))(*self._shape)
        if self._lanes == 2:
            code, bits = _DL_COMPLEX_CODE[self._dtype]
        else:
            code, bits = _DL_CODE[self._dtype]
        managed: Any = _Versioned() if versioned else _Managed()
        t = managed.dl_tensor
        t.data = self._ptr or None
        t.device = _DLDevice(_DL_CUDA, self.device)
        t.ndim = ndim
        t.dtype = _DLDataType(code, bits, 1)
        t.shape = ctypes.cast(shape, POINTER(c_int64))
        t.strides = None  # compact row-major
        managed.deleter = _DELETER
        if versioned:
            managed.major, managed.minor = 1, 0
        address = ctypes.addressof(managed)
        managed.manager_ctx = address
        entry = (managed, shape, self)  # made outside the lock: an allocation may collect
        with _LIVE_LOCK:
            _LIVE[address] = entry
        try:
            return _capsule_new(address, _VERSIONED if versioned else _LEGACY, _DESTRUCTOR_PTR)
        except BaseException:
            _release(address)
            raise

    def __repr__(self) -> str:
        return (
            f"<pynccl.PeerArray shape={self._shape} dtype={self._dtype.name.lower()} "
            f"ptr={self._ptr:#x} device={self.device}>"
        )
