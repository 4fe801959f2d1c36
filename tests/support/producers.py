"""Fake array and stream producers for the adaptation tests, over host memory.

Each producer exposes a numpy array's memory through one protocol
(``__cuda_array_interface__`` or DLPack) while claiming it is device memory,
which is all that pynccl's adaptation layer ever looks at. The DLPack
producer builds its ``DLManagedTensor`` / ``DLManagedTensorVersioned`` and
capsule with ctypes, from dlpack.h's layouts written out here independently
of pynccl's own, and counts deleter calls so tests can see nothing leaks.
"""

from __future__ import annotations

import ctypes
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

import numpy as np

# --- __cuda_array_interface__ -------------------------------------------------------------


def addr(a: np.ndarray) -> int:
    """The address of numpy array ``a``'s data."""
    return int(a.__array_interface__["data"][0])


def cai_dict(
    array: np.ndarray,
    *,
    version: int = 3,
    readonly: bool = False,
    strides: Any = "auto",
    **extra: Any,
) -> dict[str, Any]:
    """The interface a CUDA library would give for ``array`` were it in device memory.

    ``strides="auto"`` gives None for C-contiguous arrays (as CuPy does) and the
    real byte strides otherwise; ``strides="always"`` always gives the real ones.
    """
    if strides == "auto":
        strides = None if array.flags.c_contiguous else array.strides
    elif strides == "always":
        strides = array.strides
    cai: dict[str, Any] = {
        "shape": array.shape,
        "typestr": array.dtype.str,
        "data": (array.__array_interface__["data"][0], readonly),
        "strides": strides,
        "version": version,
    }
    if version >= 3:
        cai["stream"] = 1
    cai.update(extra)
    return cai


class CAIArray:
    """``__cuda_array_interface__`` as an instance attribute (Numba's style)."""

    def __init__(self, array: np.ndarray, **kw: Any) -> None:
        self.array = array  # keeps the memory alive, as a real producer would
        self.__cuda_array_interface__ = cai_dict(array, **kw)


class CAIProperty:
    """``__cuda_array_interface__`` as a property (CuPy's and torch's style)."""

    def __init__(self, array: np.ndarray, **kw: Any) -> None:
        self.array = array
        self._kw = kw

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return cai_dict(self.array, **self._kw)


class CAIWithDType(CAIArray):
    """A CAI array with its own ``.dtype``, as bfloat16/FP8 producers need."""

    def __init__(self, array: np.ndarray, dtype: Any, **kw: Any) -> None:
        super().__init__(array, **kw)
        self.dtype = dtype


class _TorchDevice:
    """Looks like ``torch.device``: ``.type`` and ``.index``."""

    def __init__(self, type: str, index: int | None) -> None:
        self.type = type
        self.index = index


class _CupyDevice:
    """Looks like ``cupy.cuda.Device``: ``.id``."""

    def __init__(self, ident: int) -> None:
        self.id = ident


class TorchLikeCAI(CAIArray):
    """A CAI array whose ``.device`` is torch-like."""

    def __init__(self, array: np.ndarray, type: str = "cuda", index: int | None = 1) -> None:
        super().__init__(array)
        self.device = _TorchDevice(type, index)


class CupyLikeCAI(CAIArray):
    """A CAI array whose ``.device`` is CuPy-like."""

    def __init__(self, array: np.ndarray, ident: int = 2) -> None:
        super().__init__(array)
        self.device = _CupyDevice(ident)


class CAIWithDLPackDevice(CAIArray):
    """A CAI array that also answers ``__dlpack_device__`` (CuPy, torch)."""

    def __init__(self, array: np.ndarray, device: tuple[int, int]) -> None:
        super().__init__(array)
        self._device = device

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


# --- DLPack ------------------------------------------------------------------------------
# dlpack.h v1.1 layouts.

kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 1, 2, 3, 13
kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLComplex, kDLBool = 0, 1, 2, 4, 5, 6
kDLFloat8_e4m3, kDLFloat8_e4m3fn, kDLFloat8_e5m2 = 8, 10, 12
FLAG_READ_ONLY, FLAG_IS_COPIED = 1, 2


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


DELETER = CFUNCTYPE(None, c_void_p)


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", DELETER)]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", DELETER),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


# Capsule names must outlive their capsules: module-level constants.
NAME_LEGACY = b"dltensor"
NAME_VERSIONED = b"dltensor_versioned"
NAME_USED = b"used_dltensor"
_NAMES = {NAME_LEGACY: NAME_LEGACY, NAME_VERSIONED: NAME_VERSIONED, NAME_USED: NAME_USED}

_DESTRUCTOR = CFUNCTYPE(None, c_void_p)
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, c_void_p, c_char_p, _DESTRUCTOR)(
    ("PyCapsule_New", ctypes.pythonapi)
)
_capsule_get_name = ctypes.PYFUNCTYPE(c_char_p, c_void_p)(("PyCapsule_GetName", ctypes.pythonapi))
_capsule_get_pointer = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

# address of a managed struct -> (struct, shape, strides, producer): alive until deleted
_LIVE: dict[int, tuple[Any, Any, Any, DLPackProducer]] = {}


def _deleter(address: int | None) -> None:
    entry = _LIVE.pop(address or 0, None)
    if entry is not None:
        entry[3].deleted += 1


_DELETER_FN = DELETER(_deleter)


def _destroy_capsule(capsule: int | None) -> None:
    # What a producer's capsule destructor does (python_spec.rst): call the
    # deleter only for a capsule nobody consumed.
    name = _capsule_get_name(capsule)
    address = _capsule_get_pointer(capsule, name)
    if name in (NAME_LEGACY, NAME_VERSIONED):
        struct_type = DLManagedTensorVersioned if name == NAME_VERSIONED else DLManagedTensor
        struct_type.from_address(address).deleter(address)
    else:
        _LIVE.pop(address or 0, None)  # test bookkeeping only: nobody will delete it


_DESTRUCTOR_FN = _DESTRUCTOR(_destroy_capsule)


class DLPackProducer:
    """A DLPack producer over ``array``'s memory, claiming ``device``.

    ``dl_dtype=(code, bits, lanes)`` overrides the type derived from numpy;
    ``strides="auto"`` gives NULL for C-contiguous arrays and element strides
    otherwise ("always": always the element strides). ``versioned`` decides
    whether a ``max_version`` request gets a ``DLManagedTensorVersioned``.
    ``tamper(dl_tensor)``, if given, may overwrite any field of the exported tensor.
    ``calls`` records the keyword arguments of each ``__dlpack__`` call,
    ``deleted`` counts deleter calls.
    """

    def __init__(
        self,
        array: np.ndarray,
        *,
        device: tuple[int, int] = (kDLCUDA, 0),
        dl_dtype: tuple[int, int, int] | None = None,
        strides: Any = "auto",
        byte_offset: int = 0,
        versioned: bool = True,
        version: tuple[int, int] = (1, 1),
        flags: int = 0,
        capsule_name: bytes | None = None,
        null_data: bool = False,
        tamper: Any = None,
    ) -> None:
        self.array = array
        self.device = device
        self.dl_dtype = dl_dtype or _numpy_to_dl(array.dtype)
        self.strides = strides
        self.byte_offset = byte_offset
        self.versioned = versioned
        self.version = version
        self.flags = flags
        self.capsule_name = capsule_name
        self.null_data = null_data
        self.tamper = tamper  # tamper(dl_tensor): rewrite fields before export (fuzzing)
        self.calls: list[dict[str, Any]] = []
        self.deleted = 0

    @property
    def exported(self) -> int:
        """Managed tensors exported and not yet deleted."""
        return sum(1 for entry in _LIVE.values() if entry[3] is self)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> Any:
        self.calls.append({"stream": stream, "max_version": max_version})
        versioned = self.versioned and max_version is not None and max_version[0] >= 1
        return self._capsule(versioned)

    def _capsule(self, versioned: bool) -> Any:
        a = self.array
        ndim = a.ndim
        shape = (c_int64 * max(ndim, 1))(*a.shape)
        strides = None
        if self.strides == "always" or (self.strides == "auto" and not a.flags.c_contiguous):
            strides = (c_int64 * max(ndim, 1))(*(s // a.itemsize for s in a.strides))
        elif isinstance(self.strides, tuple):
            strides = (c_int64 * max(ndim, 1))(*self.strides)
        managed: Any = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        t = managed.dl_tensor
        data = 0 if self.null_data else a.__array_interface__["data"][0] - self.byte_offset
        t.data = data or None
        t.device = DLDevice(*self.device)
        t.ndim = ndim
        t.dtype = DLDataType(*self.dl_dtype)
        t.shape = ctypes.cast(shape, POINTER(c_int64))
        t.strides = ctypes.cast(strides, POINTER(c_int64)) if strides is not None else None
        t.byte_offset = self.byte_offset
        if self.tamper is not None:
            self.tamper(t)
        managed.deleter = _DELETER_FN
        if versioned:
            managed.version = DLPackVersion(*self.version)
            managed.flags = self.flags
        address = ctypes.addressof(managed)
        _LIVE[address] = (managed, shape, strides, self)
        default = NAME_VERSIONED if versioned else NAME_LEGACY
        name = _NAMES[self.capsule_name or default]
        return _capsule_new(address, name, _DESTRUCTOR_FN)


class StreamOnlyDLPack(DLPackProducer):
    """An older producer: ``__dlpack__(stream=None)`` only, legacy capsules."""

    def __dlpack__(self, stream: Any = None) -> Any:  # type: ignore[override]
        self.calls.append({"stream": stream})
        return self._capsule(False)


class BareDLPack(DLPackProducer):
    """The oldest producers: ``__dlpack__()`` with no arguments."""

    def __dlpack__(self) -> Any:  # type: ignore[override]
        self.calls.append({})
        return self._capsule(False)


class TorchCPULike:
    """Like a torch CPU tensor: the CAI property raises AttributeError, DLPack says CPU."""

    def __init__(self, array: np.ndarray) -> None:
        self.dl = DLPackProducer(array, device=(kDLCPU, 0))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor")

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.dl.__dlpack_device__()

    def __dlpack__(self, **kw: Any) -> Any:
        return self.dl.__dlpack__(**kw)


class TorchBF16Like:
    """Like a torch bfloat16 CUDA tensor: the CAI property raises KeyError, DLPack works."""

    def __init__(self, array: np.ndarray) -> None:
        self.dl = DLPackProducer(array)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        raise KeyError("torch.bfloat16")

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.dl.__dlpack_device__()

    def __dlpack__(self, **kw: Any) -> Any:
        return self.dl.__dlpack__(**kw)


def _numpy_to_dl(dtype: np.dtype) -> tuple[int, int, int]:
    name = dtype.name
    if name == "bfloat16":
        return (kDLBfloat, 16, 1)
    if name == "float8_e4m3fn":
        return (kDLFloat8_e4m3fn, 8, 1)
    if name == "float8_e5m2":
        return (kDLFloat8_e5m2, 8, 1)
    code = {"i": kDLInt, "u": kDLUInt, "f": kDLFloat, "c": kDLComplex, "b": kDLBool}[dtype.kind]
    return (code, dtype.itemsize * 8, 1)


# --- streams -------------------------------------------------------------------------------


class ProtocolStream:
    """cuda.core style: ``__cuda_stream__()`` returns ``(version, handle)``."""

    def __init__(self, handle: int, version: int = 0) -> None:
        self.handle = handle
        self.version = version

    def __cuda_stream__(self) -> tuple[int, int]:
        return (self.version, self.handle)


class ProtocolAttrStream:
    """``__cuda_stream__`` given as a tuple attribute rather than a method."""

    def __init__(self, handle: int) -> None:
        self.__cuda_stream__ = (0, handle)


class TorchLikeStream:
    """``torch.cuda.Stream`` style: ``.cuda_stream`` is the handle."""

    def __init__(self, handle: Any) -> None:
        self.cuda_stream = handle


class CupyLikeStream:
    """``cupy.cuda.Stream`` style: ``.ptr`` is the handle."""

    def __init__(self, handle: Any) -> None:
        self.ptr = handle


class CudaPythonLikeStream:
    """cuda-python ``cudaStream_t`` style: ``int()`` is the handle, ``getPtr()`` is not."""

    def __init__(self, handle: int) -> None:
        self._handle = handle
        self._storage = ctypes.c_void_p(handle)

    def __int__(self) -> int:
        return self._handle

    def getPtr(self) -> int:
        return ctypes.addressof(self._storage)
