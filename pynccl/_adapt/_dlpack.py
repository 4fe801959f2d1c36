"""DLPack producers (``__dlpack__`` / ``__dlpack_device__``), read with ctypes straight
from the capsule: legacy ``DLManagedTensor`` or DLPack >= 1.0 ``DLManagedTensorVersioned``."""

from __future__ import annotations

import ctypes
import math
import struct
import sys
from ctypes import c_char_p, c_int64, c_void_p

from .._limits import check_extent, check_pointer, index_int
from ..dtypes import canonical_name, complex_name
from ..enums import DataType
from ._common import _is_c_contiguous, _override, _strided_error

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

    from ._common import BufferHandler, BufferInfo


# DLDeviceType values (dlpack.h).
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_MANAGED = 13


# dlpack.h (v1.1) layouts as struct formats in native mode, which pads exactly as
# the C compiler does ('P' is a pointer). One string_at + unpack reads a whole
# struct several times faster than ctypes Structure field access.
#
#   typedef struct { void* data; DLDevice device /* {int32 device_type; int32 device_id} */;
#                    int32_t ndim; DLDataType dtype /* {uint8 code; uint8 bits; uint16 lanes} */;
#                    int64_t* shape; int64_t* strides; uint64_t byte_offset; } DLTensor;
#   typedef struct { DLTensor dl_tensor; void* manager_ctx; void (*deleter)(...); }
#       DLManagedTensor;
#   typedef struct { DLPackVersion version /* {uint32 major; uint32 minor} */; void* manager_ctx;
#                    void (*deleter)(...); uint64_t flags; DLTensor dl_tensor; }
#       DLManagedTensorVersioned;
_DL_TENSOR = struct.Struct("PiiiBBHPPQ")
_DL_VERSIONED = struct.Struct("IIPPQ" + "PiiiBBHPPQ")

# The process's address space as one read-only buffer, for unpack_from(_MEMORY, address):
# about half the cost of ctypes.string_at or a from_address array per read, and it reads
# only the bytes asked for, as they do. Like them it trusts the address: every read below
# comes after the checks that make it safe (a capsule's own pointer, or a shape pointer
# checked non-NULL and aligned). An address past sys.maxsize - size raises struct.error.
_MEMORY = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).toreadonly()

_FLAG_READ_ONLY = 1 << 0
_FLAG_IS_COPIED = 1 << 1
_REFUSED_IF_WRITTEN = _FLAG_IS_COPIED | _FLAG_READ_ONLY
_DLPACK_MAX_VERSION = (1, 1)

# Private prototypes: setting argtypes on ctypes.pythonapi's shared function
# objects could clash with another library doing the same.
_capsule_name = ctypes.PYFUNCTYPE(c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi)
)
_capsule_pointer = ctypes.PYFUNCTYPE(c_void_p, ctypes.py_object, c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

# (DLDataTypeCode, bits) -> NCCL type. Codes 10 and 12 are DLPack 1.1's
# kDLFloat8_e4m3fn and kDLFloat8_e5m2.
_DL_TYPES: dict[tuple[int, int], DataType] = {
    (0, 8): DataType.INT8,
    (1, 8): DataType.UINT8,
    (0, 32): DataType.INT32,
    (1, 32): DataType.UINT32,
    (0, 64): DataType.INT64,
    (1, 64): DataType.UINT64,
    (2, 16): DataType.FLOAT16,
    (2, 32): DataType.FLOAT32,
    (2, 64): DataType.FLOAT64,
    (4, 16): DataType.BFLOAT16,
    (10, 8): DataType.FLOAT8_E4M3,
    (12, 8): DataType.FLOAT8_E5M2,
}
# kDLComplex (code 5) by total bits -> the NCCL float type of each half.
_DL_COMPLEX: dict[tuple[int, int], DataType] = {
    (5, 32): DataType.FLOAT16,
    (5, 64): DataType.FLOAT32,
    (5, 128): DataType.FLOAT64,
}
_SUPPORTED_WORDS = ", ".join(
    [canonical_name(t) for t in DataType] + [complex_name(t) for t in _DL_COMPLEX.values()]
)
_DL_CODE_NAMES = {
    0: "int",
    1: "uint",
    2: "float",
    3: "opaque handle",
    4: "bfloat",
    5: "complex",
    6: "bool",
    7: "float8_e3m4",
    8: "float8_e4m3 (IEEE-style; NCCL's FP8 is float8_e4m3fn)",
    9: "float8_e4m3b11fnuz",
    10: "float8_e4m3fn",
    11: "float8_e4m3fnuz",
    12: "float8_e5m2",
    13: "float8_e5m2fnuz",
    14: "float8_e8m0fnu",
    15: "float6_e2m3fn",
    16: "float6_e3m2fn",
    17: "float4_e2m1fn",
}
_DL_DEVICE_WORDS = {
    1: "a CPU array (kDLCPU)",
    3: "in pinned host memory (kDLCUDAHost)",
    4: "an OpenCL buffer (kDLOpenCL)",
    7: "a Vulkan buffer (kDLVulkan)",
    8: "a Metal buffer (kDLMetal)",
    9: "a VPI buffer (kDLVPI)",
    10: "a ROCm array (kDLROCM)",
    11: "in pinned ROCm host memory (kDLROCMHost)",
    12: "on an extension device (kDLExtDev)",
    14: "a oneAPI array (kDLOneAPI)",
    15: "a WebGPU buffer (kDLWebGPU)",
    16: "a Hexagon DSP buffer (kDLHexagon)",
    17: "a MAIA array (kDLMAIA)",
    18: "a Trainium array (kDLTrn)",
}


def _dlpack_device(obj: Any, name: str) -> tuple[int, int]:
    """``obj.__dlpack_device__()`` as two ints ``(device_type, device_id)``, or TypeError."""
    answer = obj.__dlpack_device__()
    try:
        kind, index = answer
        if type(kind) is not int:
            kind = index_int(kind, "device_type")
        if type(index) is not int:
            index = index_int(index, "device_id")
    except (TypeError, ValueError):
        raise TypeError(
            f"{name}.__dlpack_device__() gave {answer!r}; expected (device_type, device_id), "
            "two ints"
        ) from None
    return kind, index


def _check_dl_device(kind: int, name: str) -> None:
    if kind != _DL_CUDA and kind != _DL_CUDA_MANAGED:
        words = _DL_DEVICE_WORDS.get(kind, f"on DLPack device type {kind}")
        hint = (
            " (copy it to the GPU first, e.g. DeviceBuffer.from_numpy)" if kind == _DL_CPU else ""
        )
        raise ValueError(
            f"{name} is {words}; NCCL needs device memory (kDLCUDA or kDLCUDAManaged){hint}"
        )


def _dl_datatype(code: int, bits: int, lanes: int, name: str) -> DataType:
    dt = _DL_TYPES.get((code, bits))
    if dt is None or lanes != 1:
        what = _DL_CODE_NAMES.get(code, f"type code {code}")
        if lanes != 1:
            why = f"a vector type ({lanes} lanes)"
        else:
            why = f"{what} of {bits} bits, which NCCL does not support"
        raise TypeError(
            f"{name} has DLPack dtype (code={code}, bits={bits}, lanes={lanes}): {why}; "
            f"supported: {_SUPPORTED_WORDS}"
        )
    return dt


def _read_capsule(capsule: Any, count: Any, dtype: Any, name: str, writable: bool) -> BufferInfo:
    """Read a DLPack capsule without consuming it (see :func:`_capsule_tensor`)."""
    fields = _capsule_tensor(capsule, name, writable)
    data, kind, device_id, ndim, code, bits, lanes, shape_p, strides_p, byte_offset = fields
    _check_dl_device(kind, name)
    pair = 1
    dt = _DL_TYPES.get((code, bits)) if lanes == 1 else None
    if dt is None:
        part = _DL_COMPLEX.get((code, bits)) if lanes == 1 else None
        if part is not None:
            dt, pair = part, 2
        else:
            dt = _dl_datatype(code, bits, lanes, name)
    if not 0 <= ndim <= _MAX_NDIM:
        raise ValueError(
            f"{name}: DLPack ndim={ndim} is out of range; expected 0 <= ndim <= {_MAX_NDIM}"
        )
    shape = _dims(shape_p, ndim, name, "shape") if ndim else []
    if ndim and min(shape) < 0:
        raise ValueError(f"{name}: DLPack shape {tuple(shape)} has a negative extent")
    n = math.prod(shape)
    nbytes = check_extent(n, dt.itemsize * pair, name)
    if strides_p and n:
        strides = _dims(strides_p, ndim, name, "strides")
        if not _is_c_contiguous(shape, strides, 1):
            raise _strided_error(name, shape, strides, "elements")
    if kind == _DL_CUDA and device_id < 0:
        raise ValueError(f"{name}: DLPack device_id={device_id} is negative")
    if not data and nbytes:
        raise ValueError(f"{name}: DLPack data pointer is NULL for {n} elements")
    ptr = (data or 0) + byte_offset
    if ptr >= 1 << 64:
        raise ValueError(
            f"{name}: DLPack data {data or 0:#x} + byte_offset {byte_offset:#x} = {ptr:#x} "
            "passes the end of the address space (2**64)"
        )
    ptr = check_pointer(ptr, f"{name}'s data pointer", nbytes)
    n *= pair
    if count is not None or dtype is not None:
        n, dt = _override(n, dt, count, dtype, name, pair)
    return ptr, n, dt, (device_id if kind == _DL_CUDA else None)


def _capsule_tensor(capsule: Any, name: str, writable: bool) -> list[Any]:
    """The ``DLTensor`` fields of a DLPack capsule, read without consuming it.

    The capsule keeps its name ("dltensor" / "dltensor_versioned"), so when the
    last reference to it goes, its own destructor calls the producer's deleter,
    exactly as for a capsule nobody asked for. That is safe because the deleter
    only releases what the export made (shape/strides storage, a reference to
    the array): the memory the returned pointer addresses belongs to the array
    object itself, which the caller holds for the whole collective call, as with
    any other buffer form. The one case where the export would own the memory,
    a producer-made copy (DLPACK_FLAG_BITMASK_IS_COPIED), is refused.
    """
    if type(capsule).__name__ != "PyCapsule":
        raise TypeError(
            f"{name}.__dlpack__() returned {type(capsule).__name__}, not a DLPack capsule"
        )
    label = _capsule_name(capsule)
    if label == b"dltensor_versioned":
        (major, minor, _ctx, _deleter, flags, *fields) = _DL_VERSIONED.unpack(
            ctypes.string_at(_capsule_pointer(capsule, label), _DL_VERSIONED.size)
        )
        if major != 1:  # the layout past `deleter` may differ: read nothing more
            raise ValueError(
                f"{name} was exported as DLPack {major}.{minor}; pynccl reads DLPack 1.x"
            )
        if flags & _FLAG_IS_COPIED:
            raise ValueError(
                f"{name}: the DLPack producer exported a copy, not the array's own memory"
            )
        if flags & _FLAG_READ_ONLY and writable:
            raise ValueError(
                f"{name} is read-only (DLPack read-only flag); NCCL writes the result into it"
            )
    elif label == b"dltensor":
        fields = list(
            _DL_TENSOR.unpack(ctypes.string_at(_capsule_pointer(capsule, label), _DL_TENSOR.size))
        )
    else:
        raise ValueError(
            f"{name}.__dlpack__() returned a capsule named {label!r}; expected "
            "'dltensor' or 'dltensor_versioned' (an already consumed capsule?)"
        )
    return list(fields)


# ctypes array types by length, for reading shape / strides.
_INT64_ARRAYS: dict[int, Any] = {}
# No producer makes more dimensions (numpy's and torch's limit); a larger ndim is garbage,
# and reading that many int64s from the shape pointer could run off mapped memory.
_MAX_NDIM = 64


def _dims(address: int | None, ndim: int, name: str, what: str) -> list[int]:
    """The ``ndim`` int64s at ``address`` (a DLTensor's shape or strides), once the address
    is known to be a plausible array of them: not NULL, 8-byte aligned, below 2**64."""
    if not address:
        raise ValueError(f"{name}: DLPack {what} pointer is NULL for ndim={ndim}")
    if address % 8 or address + 8 * ndim > 1 << 64:
        raise ValueError(
            f"{name}: DLPack {what} pointer {address:#x} is not an aligned array of {ndim} int64s"
        )
    return _int64s(address, ndim)


def _int64s(address: int, count: int) -> list[int]:
    array_type = _INT64_ARRAYS.get(count)
    if array_type is None:
        array_type = _INT64_ARRAYS[count] = c_int64 * count
    return array_type.from_address(address)[:]


def _dlpack_stream(stream: int | None) -> int | None:
    # The DLPack spec forbids 0 (ambiguous); CUDA's handle 0 is the legacy default
    # stream, which DLPack spells 1.
    return 1 if stream == 0 else stream


# The fast reading's layouts: the same structs, with the fields it does not look at skipped
# ('x': minor version, manager_ctx, deleter) and DLDataType read as one uint32 word.
_FAST_VERSIONED = struct.Struct("I20xQ" + "PiiiIPPQ")
_FAST_TENSOR = struct.Struct("PiiiIPPQ")
_read_versioned = _FAST_VERSIONED.unpack_from
_read_tensor = _FAST_TENSOR.unpack_from
_read_int64 = struct.Struct("q").unpack_from
# Shapes (and strides) of 2 to _FAST_NDIM dimensions, each read in one go; more take the
# full reading.
_FAST_NDIM = 8
_READ_DIMS = [struct.Struct(f"{k}q").unpack_from for k in range(_FAST_NDIM + 1)]
# DLDataType word of one lane (packed natively, so any byte order) -> (NCCL type, bytes per
# element): the real types of _DL_TYPES; complex and vector types take the full reading.
_FAST_TYPES: dict[int, tuple[DataType, int]] = {
    struct.unpack("I", struct.pack("BBH", code, bits, 1))[0]: (dt, bits >> 3)
    for (code, bits), dt in _DL_TYPES.items()
}
_VERSIONED_NAME = b"dltensor_versioned"
# A capsule's own C fields (CPython's PyCapsule: the object header, then ``void *pointer;
# const char *name; ...``), read as the rest of the tensor is: what PyCapsule_GetPointer
# returns, without a ctypes call (which costs as much as the producer's whole export).
# Trusted only once the full reading has checked it against the C API for a type's first
# export (see _learn): on any other layout the fast reading is never taken.
_HEAD = object.__basicsize__
_read_capsule_fields = struct.Struct("PP").unpack_from


def _learn(capsule: Any) -> tuple[type, int, bool] | None:
    """What the fast reading of later exports compares a capsule with, from one the full
    reading has just read: ``(its type, the address of its name, versioned)``. The name's
    address is that of the producer's name string (a C literal for every producer known):
    a capsule renamed since (``used_dltensor``) or of another name has another, and is read
    in full. None if reading the capsule's fields does not give what PyCapsule_GetPointer
    gives (a layout other than CPython's): then every export is read in full."""
    label = _capsule_name(capsule)
    address, name = _read_capsule_fields(_MEMORY, id(capsule) + _HEAD)
    if address != _capsule_pointer(capsule, label) or not name:
        return None
    return type(capsule), name, label == _VERSIONED_NAME


def _make_dlpack_handler(cls: type) -> BufferHandler:
    # How this type's __dlpack__ is called; found on first use. Older producers
    # take no max_version= (pre-2023 array API), some not even stream=.
    style = [0]
    has_device = hasattr(cls, "__dlpack_device__")
    # What this type's first export read in full without error told (_learn; None until
    # then): from then on, `handler` takes its fast reading.
    learnt: list[tuple[type, int, bool] | None] = [None]

    def export(obj: Any, stream: int | None) -> Any:
        s = _dlpack_stream(stream)
        if style[0] == 1:
            return obj.__dlpack__(stream=s)
        if style[0] == 2:
            return obj.__dlpack__()
        try:
            return obj.__dlpack__(stream=s, max_version=_DLPACK_MAX_VERSION)
        except TypeError:
            pass  # not kept: a saved exception's frames would keep capsules alive
        try:
            capsule = obj.__dlpack__(stream=s)
            style[0] = 1
            return capsule
        except TypeError:
            pass
        try:
            capsule = obj.__dlpack__()
            style[0] = 2
            return capsule
        except TypeError:
            pass
        # None fits: call again as the array API asks, to raise the producer's own error.
        return obj.__dlpack__(stream=s, max_version=_DLPACK_MAX_VERSION)

    def full(
        obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
    ) -> BufferInfo:
        if has_device:
            # Ask first: a CPU producer may refuse stream= before we could say why.
            _check_dl_device(_dlpack_device(obj, name)[0], name)
        capsule = export(obj, stream)
        info = _read_capsule(capsule, count, dtype, name, writable)
        if learnt[0] is None:
            learnt[0] = _learn(capsule)
        return info

    def handler(
        obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
    ) -> BufferInfo:
        """The common case read straight: once the type's first export has passed the full
        reading, a CUDA device from ``__dlpack_device__`` (two ints), an export that does not
        fail, whose capsule is of the type and name learnt then and holds a DLPack 1.x (or
        legacy) CUDA tensor of 1 to 8 dimensions of a real NCCL type, C-contiguous, from a
        non-NULL address whose range ends below 2**64, not a copy, not read-only if written.
        Anything else gets the full reading, which says what is wrong."""
        known = learnt[0]
        capsule = None
        if known is not None and count is None and dtype is None:
            try:
                # The device is asked before every export, as the array API asks of
                # consumers: the stream given to a producer is a CUDA one, and a CPU producer
                # must get none (the full reading then says where the array lives first).
                kind, index = obj.__dlpack_device__() if has_device else (_DL_CUDA, 0)
                # an int or an IntEnum (torch's), as the full reading takes them
                if kind == _DL_CUDA and type(index) is int and isinstance(kind, int):
                    s = 1 if stream == 0 else stream  # see _dlpack_stream
                    st = style[0]
                    capsule = (
                        obj.__dlpack__(stream=s, max_version=_DLPACK_MAX_VERSION)
                        if st == 0
                        else obj.__dlpack__(stream=s)
                        if st == 1
                        else obj.__dlpack__()
                    )
            except Exception:
                capsule = None  # the full reading asks again and raises the producer's error
        if capsule is None:
            return full(obj, count, dtype, name, writable, stream)
        capsule_type, label, versioned = known  # type: ignore[misc]  # known is set
        try:
            # Another type or name (a consumed capsule): the full reading names them.
            p, at = (
                _read_capsule_fields(_MEMORY, id(capsule) + _HEAD)
                if type(capsule) is capsule_type
                else (0, 0)
            )
            if at == label:
                if versioned:
                    (major, flags, data, kind, device, ndim, word, shape_p, strides_p,
                     offset) = _read_versioned(_MEMORY, p)  # fmt: skip
                    # never a copy; a read-only array only where nothing is written
                    fine = major == 1 and not flags & (
                        _REFUSED_IF_WRITTEN if writable else _FLAG_IS_COPIED
                    )
                else:
                    data, kind, device, ndim, word, shape_p, strides_p, offset = _read_tensor(
                        _MEMORY, p
                    )
                    fine = True
                real = _FAST_TYPES.get(word)
                # Checked before the shape (and strides) are read: ndim aligned int64s each.
                if (
                    fine
                    and real is not None
                    and kind == _DL_CUDA
                    and 0 < ndim <= _FAST_NDIM
                    and device >= 0
                    and data
                    and shape_p
                    and not shape_p & 7
                    and not strides_p & 7
                ):
                    if ndim == 1:
                        n = _read_int64(_MEMORY, shape_p)[0]
                        dense = not strides_p or n <= 1 or _read_int64(_MEMORY, strides_p)[0] == 1
                    else:
                        read = _READ_DIMS[ndim]
                        shape = read(_MEMORY, shape_p)
                        n = math.prod(shape) if min(shape) >= 0 else -1
                        dense = (
                            not strides_p
                            or n <= 0
                            or _is_c_contiguous(shape, read(_MEMORY, strides_p), 1)
                        )
                    ptr = data + offset
                    if n >= 0 and dense and ptr + n * real[1] < 1 << 64:
                        return ptr, n, real[0], device
        except struct.error:  # an address past sys.maxsize: the full reading
            pass
        return _read_capsule(capsule, count, dtype, name, writable)

    return handler
