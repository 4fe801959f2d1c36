"""Buffer and stream adaptation: whatever a caller passes becomes plain ints (layer 5).

:func:`as_buffer` turns a buffer argument into ``(ptr, nelems, DataType, device)``:

* a raw ``int`` device pointer, with ``count`` and ``dtype`` given;
* :class:`pynccl.cuda.DeviceBuffer`;
* anything exposing ``__cuda_array_interface__`` (v2/v3: CuPy, Numba, PyTorch, ...);
* anything exposing DLPack (``__dlpack__`` / ``__dlpack_device__``), read with
  ctypes straight from the capsule, legacy ``DLManagedTensor`` or DLPack >= 1.0
  ``DLManagedTensorVersioned``.

:func:`as_stream` turns a stream argument into a ``cudaStream_t`` int.

Both dispatch on ``type(obj)`` through a cache of handler functions: the first
object of a type is probed (``hasattr``), later ones of that type go straight to
their handler; raw ints skip even that. Nothing here calls into CUDA, so the
device an array lives on is what the array itself says (``None`` when it says
nothing), and the ``stream`` entry of a v3 ``__cuda_array_interface__`` (the
producer's stream, which a consumer should wait on) is not acted upon: callers
that mix streams must order them themselves.
"""

from __future__ import annotations

import ctypes
import math
import struct
import sys
from ctypes import c_char_p, c_int64, c_void_p

from .dtypes import as_datatype, canonical_name, complex_component, complex_name
from .enums import DataType

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Optional

    BufferInfo = tuple[int, int, DataType, Optional[int]]
    BufferHandler = Callable[[Any, Any, Any, str, bool, Optional[int]], BufferInfo]
    DeviceGetter = Callable[[Any], Optional[int]]
    StreamHandler = Callable[[Any], int]

__all__ = ["as_buffer", "as_stream", "check_device", "is_complex"]

# Pointers and stream handles are unsigned 64-bit. Hot paths spell it `1 << 64`,
# which the compiler folds into a constant (no global lookup).
_PTR_LIMIT = 1 << 64
# Handler caches stop growing here: classes made on the fly must not leak memory.
_CACHE_LIMIT = 512

_BUFFER_FORMS = (
    "an int device pointer (with count= and dtype=), a pynccl.cuda.DeviceBuffer, "
    "or an array exposing __cuda_array_interface__ or DLPack (__dlpack__) "
    "such as a CuPy array or a torch CUDA tensor"
)
_STREAM_FORMS = (
    "None, an int cudaStream_t handle, a pynccl.cuda.Stream, or an object with "
    "__cuda_stream__ (cuda.core), .cuda_stream (torch), .ptr (CuPy) or __int__ "
    "(cuda-python's cudaStream_t / CUstream)"
)


# --- shared checks ----------------------------------------------------------------------


def _check_count(count: Any, name: str) -> int:
    if type(count) is not int:
        if isinstance(count, bool) or not hasattr(count, "__index__"):
            raise TypeError(
                f"count for {name} must be an int, got {type(count).__name__} {count!r}"
            )
        count = count.__index__()  # numpy integers
    if count < 0:
        raise ValueError(f"count={count} for {name} must be >= 0")
    if count >= _PTR_LIMIT:  # ctypes would silently wrap a size_t this large
        raise ValueError(f"count={count} for {name} must be below 2**64")
    return count  # type: ignore[no-any-return]


def check_pointer(name: str, ptr: int, count: int) -> None:
    """Refuse a raw pointer NCCL must not see: NULL (unless nothing moves), negative, or
    2**64 and up (ctypes would silently wrap it into another address)."""
    if ptr < 0 or ptr >= _PTR_LIMIT:
        raise ValueError(f"{name}={ptr} is not a valid pointer (expected 0 < ptr < 2**64)")
    if ptr == 0 and count:
        raise ValueError(f"{name} is a NULL pointer but count={count}; expected ptr > 0")


def _datatype(dtype: Any, name: str) -> DataType:
    if type(dtype) is DataType:
        return dtype
    try:
        return as_datatype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype for {name}: {exc}") from None


def _datatype_lanes(dtype: Any, name: str) -> tuple[DataType, int]:
    """``dtype`` as ``(NCCL type, lanes)``: lanes is 2 for a complex type (two floats of the
    NCCL type per element), else 1."""
    if type(dtype) is DataType:
        return dtype, 1
    try:
        return as_datatype(dtype), 1
    except TypeError as exc:
        part = complex_component(dtype)
        if part is not None:
            return part, 2
        raise TypeError(f"dtype for {name}: {exc}") from None


def _type_words(dt: DataType, lanes: int) -> str:
    return canonical_name(dt) if lanes == 1 else complex_name(dt)


def _override(
    n: int, dt: DataType, count: Any, dtype: Any, name: str, lanes: int = 1
) -> tuple[int, DataType]:
    """Apply the caller's ``count`` / ``dtype`` to an array of ``n`` NCCL elements of ``dt``
    (``n // lanes`` of the array's own elements: ``count`` is counted in those)."""
    if dtype is not None:
        want, want_lanes = _datatype_lanes(dtype, name)
        if want is not dt or want_lanes != lanes:
            raise TypeError(
                f"dtype={_type_words(want, want_lanes)} does not match {name}, whose data "
                f"type is {_type_words(dt, lanes)}"
            )
    if count is not None:
        c = _check_count(count, name)
        if c * lanes > n:
            raise ValueError(
                f"count={c} is larger than {name}, which holds only {n // lanes} elements"
            )
        n = c * lanes
    return n, dt


def _is_c_contiguous(shape: Any, strides: Any, itemsize: int) -> bool:
    """True if ``strides`` (in units where one element is ``itemsize``) are C order.

    Dimensions of extent 1 may carry any stride: no two elements are ever
    separated by them (numpy and torch both report such views as contiguous).
    """
    if len(strides) != len(shape):
        return False
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def _strided_error(name: str, shape: Any, strides: Any, unit: str) -> ValueError:
    return ValueError(
        f"{name} is a strided/non-contiguous view (shape={tuple(shape)}, "
        f"strides={tuple(strides)} in {unit}); NCCL reads and writes one contiguous "
        "block: make it contiguous first (e.g. .contiguous() or ascontiguousarray())"
    )


def _is_bytes_like(obj: Any) -> bool:
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def _not_a_buffer(obj: Any, name: str) -> TypeError:
    text = f"{name} must be {_BUFFER_FORMS}; got {type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, bool):
        text += " (a bool is not a pointer)"
    elif _instance_has(obj, "__array_interface__") or _is_bytes_like(obj):
        text += " (this looks like host memory; NCCL needs device memory)"
    return TypeError(text)


# --- raw pointers -------------------------------------------------------------------------


def _from_pointer(
    obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
) -> BufferInfo:
    if count is None or dtype is None:
        missing = " and ".join(
            arg for arg, v in (("count=", count), ("dtype=", dtype)) if v is None
        )
        raise TypeError(
            f"{name} is a raw pointer ({int(obj):#x}), which carries no size or type: "
            f"{missing} must be given"
        )
    n = count if type(count) is int and 0 <= count < 1 << 64 else _check_count(count, name)
    if type(dtype) is DataType:
        dt = dtype
    else:
        dt, lanes = _datatype_lanes(dtype, name)
        if lanes != 1:  # complex: NCCL moves twice as many floats
            n *= lanes
            if n >= _PTR_LIMIT:
                raise ValueError(
                    f"count={count} for {name} of {_type_words(dt, lanes)} is "
                    f"{n} floats; expected fewer than 2**64"
                )
    ptr = int(obj)
    if not 0 < ptr < 1 << 64:
        check_pointer(name, ptr, n)
    return ptr, n, dt, None


# --- device of an array -------------------------------------------------------------------

# DLDeviceType values (dlpack.h).
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_MANAGED = 13


def _no_device(obj: Any) -> int | None:
    return None


def _device_from_dlpack_device(obj: Any) -> int | None:
    kind, index = obj.__dlpack_device__()
    # Managed memory reports device_id 0 whatever device it was made on (dlpack.h).
    return int(index) if kind == _DL_CUDA else None


def _device_from_attribute(obj: Any) -> int | None:
    device = getattr(obj, "device", None)
    if type(device) is int:  # pynccl DeviceBuffer and its likes
        return device
    if device is None or isinstance(device, bool):
        return None
    kind = getattr(device, "type", None)
    if isinstance(kind, str):  # torch.device: index is None for a bare "cuda"
        index = getattr(device, "index", None)
        return index if kind == "cuda" and isinstance(index, int) else None
    ident = getattr(device, "id", None)  # cupy.cuda.Device
    if isinstance(ident, int) and not isinstance(ident, bool):
        return ident
    if isinstance(device, int):
        return int(device)
    return None


def _device_getter(cls: type, obj: Any) -> DeviceGetter:
    # A recognisable .device first: torch's __dlpack_device__ is a Python method
    # doing an import on every call, several times dearer than reading .device.
    if _instance_has(obj, "device") and _device_from_attribute(obj) is not None:
        return _device_from_attribute
    if hasattr(cls, "__dlpack_device__"):
        return _device_from_dlpack_device
    if _instance_has(obj, "device"):
        return _device_from_attribute
    return _no_device


# --- __cuda_array_interface__ ---------------------------------------------------------------

# Numeric typestrs seen so far; void typestrs ("<V2") never enter.
_TYPESTR_CACHE: dict[str, DataType] = {}


def _cai_datatype(obj: Any, typestr: Any, name: str) -> DataType:
    if not isinstance(typestr, str):
        raise TypeError(f"{name}: __cuda_array_interface__ typestr {typestr!r} is not a str")
    if typestr[1:2] == "V" or typestr[1:] == "f1":
        # bfloat16 / FP8 have no typestr of their own (numpy shows ml_dtypes' as '<V2',
        # '<V1', or '<f1' for float8_e5m2): the array's own .dtype tells.
        declared = getattr(obj, "dtype", None)
        try:
            dt = as_datatype(declared)
        except TypeError:
            raise TypeError(
                f"{name} has typestr {typestr!r}, which names no NCCL type by itself, and no "
                f".dtype that maps to one (.dtype={declared!r}); bfloat16 and float8 arrays must "
                "carry a bfloat16/float8 .dtype"
            ) from None
        size = typestr[2:]
        if not size.isdigit() or int(size) != dt.itemsize:
            raise TypeError(
                f"{name} has typestr {typestr!r} but .dtype={declared!r} "
                f"({canonical_name(dt)}, {dt.itemsize} bytes): the item sizes disagree"
            )
        return dt
    try:
        dt = as_datatype(typestr)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    if len(_TYPESTR_CACHE) < _CACHE_LIMIT:
        _TYPESTR_CACHE[typestr] = dt
    return dt


def _from_cai(
    obj: Any,
    cai: Any,
    count: Any,
    dtype: Any,
    name: str,
    writable: bool,
    device_of: DeviceGetter,
) -> BufferInfo:
    try:
        shape = cai["shape"]
        typestr = cai["typestr"]
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError):
        raise TypeError(
            f"{name} has a malformed __cuda_array_interface__ {cai!r}: expected a dict "
            "with 'shape', 'typestr' and 'data': (ptr, readonly)"
        ) from None
    dt = _TYPESTR_CACHE.get(typestr) if type(typestr) is str else None
    lanes = 1
    if dt is None:
        part = complex_component(typestr) if type(typestr) is str else None
        if part is not None:
            dt, lanes = part, 2
        else:
            dt = _cai_datatype(obj, typestr, name)
    try:
        n = shape[0] if len(shape) == 1 else math.prod(shape)
        if type(n) is not int or n < 0 or (len(shape) > 1 and min(shape) < 0):
            raise ValueError
    except (TypeError, ValueError):
        raise TypeError(
            f"{name}: __cuda_array_interface__ shape {shape!r} is not a tuple of ints >= 0"
        ) from None
    strides = cai.get("strides")
    if strides is not None and n and not _is_c_contiguous(shape, strides, dt.itemsize * lanes):
        raise _strided_error(name, shape, strides, "bytes")
    if cai.get("mask") is not None:
        raise ValueError(f"{name} is a masked array (__cuda_array_interface__ 'mask' is set)")
    if readonly and writable:
        raise ValueError(
            f"{name} is read-only (__cuda_array_interface__ data=({ptr:#x}, True)); "
            "NCCL writes the result into it"
        )
    if type(ptr) is not int or ptr < 0 or ptr >= _PTR_LIMIT or (ptr == 0 and n):
        raise ValueError(
            f"{name}: __cuda_array_interface__ data pointer {ptr!r} is not a valid "
            f"device address for {n} elements"
        )
    n *= lanes
    if count is not None or dtype is not None:
        n, dt = _override(n, dt, count, dtype, name, lanes)
    return ptr, n, dt, None if device_of is _no_device else device_of(obj)


def _make_cai_handler(cls: type, obj: Any) -> BufferHandler:
    device_of = _device_getter(cls, obj)
    dlpack = _make_dlpack_handler(cls) if hasattr(cls, "__dlpack__") else None

    def handler(
        obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
    ) -> BufferInfo:
        try:
            cai = obj.__cuda_array_interface__
        except (AttributeError, KeyError, TypeError):
            # torch.Tensor has the property on the class but raises AttributeError for
            # CPU tensors and KeyError for bfloat16 ones: DLPack handles the latter and
            # says clearly where the former live.
            if dlpack is not None:
                return dlpack(obj, count, dtype, name, writable, stream)
            if hasattr(type(obj), "__cuda_array_interface__"):
                raise  # the producer's own reason
            raise _not_a_buffer(obj, name) from None
        # The common case without a second frame: a dict describing a 1-D, C-contiguous,
        # unmasked, writable-as-needed array of a known typestr; the rest goes to _from_cai.
        if (
            count is None
            and dtype is None
            and device_of is _no_device
            and type(cai) is dict
            and cai.get("strides") is None
            and "mask" not in cai
        ):
            try:  # subscripts and unpacking: a missing key or odd value takes the slow path
                (n,) = shape = cai["shape"]  # 1-D only
                ptr, readonly = cai["data"]
                dt = _TYPESTR_CACHE[cai["typestr"]]
            except (KeyError, TypeError, ValueError):
                pass
            else:
                if (
                    type(shape) is tuple
                    and type(n) is int
                    and n >= 0
                    and type(ptr) is int
                    and 0 < ptr < _PTR_LIMIT
                    and not (readonly and writable)
                ):
                    return ptr, n, dt, None
        return _from_cai(obj, cai, count, dtype, name, writable, device_of)

    return handler


# --- pynccl.cuda.DeviceBuffer -----------------------------------------------------------------


_ITEMSIZE = {dt: dt.itemsize for dt in DataType}
# DeviceBuffer's slots read by the fast handler; its public properties cost about
# four times as much on this path. Checked once against the class (see below).
_DEVICE_BUFFER_SLOTS = frozenset({"_ptr", "_freed", "_nbytes", "_dtype", "_device", "_lanes"})


def _from_device_buffer(
    obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
) -> BufferInfo:
    if obj._freed:
        raise ValueError(f"{name} is a DeviceBuffer that has been freed")
    dt = obj._dtype
    n = obj._nbytes // _ITEMSIZE[dt]  # a complex buffer: 2 floats per element, as NCCL counts
    if count is not None or dtype is not None:
        n, dt = _override(n, dt, count, dtype, name, obj._lanes)
    return obj._ptr, n, dt, obj._device


def _from_device_buffer_public(
    obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
) -> BufferInfo:
    # The same through the public properties, should DeviceBuffer's slots change.
    if obj.closed:
        raise ValueError(f"{name} is a DeviceBuffer that has been freed")
    lanes = 2 if obj.is_complex else 1
    n = obj.size * lanes
    dt = obj.dtype
    if count is not None or dtype is not None:
        n, dt = _override(n, dt, count, dtype, name, lanes)
    return obj.ptr, n, dt, obj.device


def _device_buffer_handler(cls: type) -> BufferHandler | None:
    """The handler for pynccl.cuda.DeviceBuffer if ``cls`` is it, else None."""
    # pynccl.cuda loads libcudart on use, not on import; a DeviceBuffer can only
    # exist once it is imported, so there is nothing to import here.
    cuda = sys.modules.get(__package__ + ".cuda")
    if cuda is None or cls is not getattr(cuda, "DeviceBuffer", None):
        return None
    if _DEVICE_BUFFER_SLOTS <= set(getattr(cls, "__slots__", ())):
        return _from_device_buffer
    return _from_device_buffer_public


# --- DLPack -----------------------------------------------------------------------------------
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

_FLAG_READ_ONLY = 1 << 0
_FLAG_IS_COPIED = 1 << 1
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


def _check_dl_device(kind: Any, name: str) -> None:
    if kind != _DL_CUDA and kind != _DL_CUDA_MANAGED:
        words = _DL_DEVICE_WORDS.get(int(kind), f"on DLPack device type {int(kind)}")
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
    shape = _int64s(shape_p, ndim) if ndim > 0 else []
    n = shape[0] if ndim == 1 else math.prod(shape)
    if n < 0 or (ndim > 1 and min(shape) < 0):
        raise ValueError(f"{name}: DLPack shape {tuple(shape)} has a negative extent")
    if strides_p and n:
        strides = _int64s(strides_p, ndim)
        if not _is_c_contiguous(shape, strides, 1):
            raise _strided_error(name, shape, strides, "elements")
    ptr = (data or 0) + byte_offset
    if ptr == 0 and n:
        raise ValueError(f"{name}: DLPack data pointer is NULL for {n} elements")
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


def _int64s(address: int, count: int) -> list[int]:
    array_type = _INT64_ARRAYS.get(count)
    if array_type is None:
        array_type = _INT64_ARRAYS[count] = c_int64 * count
    return array_type.from_address(address)[:]


def _dlpack_stream(stream: int | None) -> int | None:
    # The DLPack spec forbids 0 (ambiguous); CUDA's handle 0 is the legacy default
    # stream, which DLPack spells 1.
    return 1 if stream == 0 else stream


def _make_dlpack_handler(cls: type) -> BufferHandler:
    # How this type's __dlpack__ is called; found on first use. Older producers
    # take no max_version= (pre-2023 array API), some not even stream=.
    style = [0]
    has_device = hasattr(cls, "__dlpack_device__")

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

    def handler(
        obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
    ) -> BufferInfo:
        if has_device:
            # Ask first: a CPU producer may refuse stream= before we could say why.
            _check_dl_device(obj.__dlpack_device__()[0], name)
        return _read_capsule(export(obj, stream), count, dtype, name, writable)

    return handler


# --- dispatch ---------------------------------------------------------------------------------


def _instance_has(obj: Any, attr: str) -> bool:
    try:
        return hasattr(obj, attr)
    except Exception:  # a __getattr__ raising something else: not a usable attribute
        return False


def _buffer_handler(cls: type, obj: Any, name: str) -> BufferHandler:
    """Pick (and cache) the handler for buffers of type ``cls``; raise if none fits."""
    if issubclass(cls, int):
        if issubclass(cls, bool):
            raise _not_a_buffer(obj, name)
        handler: BufferHandler = _from_pointer
    elif (fast := _device_buffer_handler(cls)) is not None:
        handler = fast
    elif hasattr(cls, "__cuda_array_interface__") or _instance_has(obj, "__cuda_array_interface__"):
        # Decided on the class where possible: evaluating the property may raise
        # for this instance (a torch CPU or bfloat16 tensor) and not for the next.
        handler = _make_cai_handler(cls, obj)
    elif hasattr(cls, "__dlpack__"):
        handler = _make_dlpack_handler(cls)
    else:
        raise _not_a_buffer(obj, name)
    if len(_BUFFER_HANDLERS) < _CACHE_LIMIT:
        _BUFFER_HANDLERS[cls] = handler
    return handler


_BUFFER_HANDLERS: dict[type, BufferHandler] = {int: _from_pointer}


def buffer_handler(obj: Any, name: str) -> BufferHandler:
    """The handler that reads buffers of ``type(obj)``: ``handler(obj, count, dtype, name,
    writable, stream) -> (ptr, nelems, datatype, device)``, as :func:`as_buffer` calls it.

    For hot paths that look the type up in ``_BUFFER_HANDLERS`` themselves and
    call this only on a miss. Raises ``TypeError`` naming ``name`` if no handler fits.
    """
    handler = _BUFFER_HANDLERS.get(type(obj))
    return handler if handler is not None else _buffer_handler(type(obj), obj, name)


def as_buffer(
    obj: Any,
    count: Any = None,
    dtype: Any = None,
    *,
    name: str = "sendbuf",
    writable: bool = False,
    stream: int | None = None,
) -> BufferInfo:
    """``(ptr, nelems, datatype, device)`` for a buffer argument called ``name``.

    ``obj`` is an ``int`` device pointer (then ``count`` and ``dtype`` are
    required), a :class:`pynccl.cuda.DeviceBuffer`, or an array exposing
    ``__cuda_array_interface__`` or DLPack. For an array, ``count`` (if given)
    must not exceed its element count and is what is returned, and ``dtype`` (if
    given) must be the array's type. ``writable=True`` refuses read-only arrays
    (for receive buffers). ``stream`` is the stream the caller will use, passed
    to ``__dlpack__`` so that the producer can order its pending work before it.
    ``device`` is the CUDA device the array reports, ``None`` if it reports none
    (raw pointers, managed memory).

    Only C-contiguous, unmasked arrays of an NCCL data type are accepted:
    others raise ``TypeError`` (wrong kind or type) or ``ValueError`` (wrong
    layout, size, location or pointer), naming ``name`` and the values.
    """
    if (
        type(obj) is int
        and type(count) is int
        and type(dtype) is DataType
        and 0 < obj < 1 << 64
        and 0 <= count < 1 << 64
    ):
        return obj, count, dtype, None  # the raw path, checked in full: nothing more to do
    return buffer_handler(obj, name)(obj, count, dtype, name, writable, stream)


# --- complex data -----------------------------------------------------------------------------


def _complex_never(obj: Any) -> bool:
    return False


def _complex_device_buffer(obj: Any) -> bool:
    return getattr(obj, "_lanes", 1) == 2


def _complex_dlpack(obj: Any) -> bool:
    # Without arguments every producer answers, with a legacy capsule; read only its dtype.
    fields = _capsule_tensor(obj.__dlpack__(), "buffer", False)
    return (fields[4], fields[5]) in _DL_COMPLEX and fields[6] == 1


def _complex_array(obj: Any) -> bool:
    try:
        typestr = obj.__cuda_array_interface__["typestr"]
    except Exception:  # no CAI, or one the producer refuses here (torch CPU / bfloat16)
        typestr = None
    if type(typestr) is str:
        return complex_component(typestr) is not None
    declared = getattr(obj, "dtype", None)  # torch / CuPy / JAX arrays: cheaper than DLPack
    if declared is not None and complex_component(declared) is not None:
        return True
    return hasattr(type(obj), "__dlpack__") and _complex_dlpack(obj)


def _complex_probe(cls: type) -> Callable[[Any], bool]:
    if issubclass(cls, int):
        probe: Callable[[Any], bool] = _complex_never
    elif _device_buffer_handler(cls) is not None:
        probe = _complex_device_buffer
    else:
        probe = _complex_array
    if len(_COMPLEX_PROBES) < _CACHE_LIMIT:
        _COMPLEX_PROBES[cls] = probe
    return probe


_COMPLEX_PROBES: dict[type, Callable[[Any], bool]] = {int: _complex_never}


def is_complex(obj: Any, dtype: Any = None) -> bool:
    """True if buffer ``obj`` (with the caller's ``dtype=``, if any) holds complex numbers,
    which :func:`as_buffer` hands out as pairs of floats.

    For callers that must refuse complex data where pairs of floats would give a wrong
    result (prod, max, min). Never raises: a buffer :func:`as_buffer` would refuse gives
    False here and its error there. The probe is chosen once per type.
    """
    if dtype is not None:
        return type(dtype) is not DataType and complex_component(dtype) is not None
    try:
        probe = _COMPLEX_PROBES[type(obj)]
    except KeyError:
        probe = _complex_probe(type(obj))
    try:
        return probe(obj)
    except Exception:
        return False


def check_device(device: int | None, expected: int | None, name: str) -> None:
    """Raise ``ValueError`` if buffer ``name`` is on ``device`` rather than ``expected``.

    ``None`` on either side (a raw pointer, managed memory, a communicator whose
    device is unknown) skips the check.
    """
    if device is not None and expected is not None and device != expected:
        raise ValueError(
            f"{name} is on device {device} but the communicator is on device {expected}"
        )


# --- streams ----------------------------------------------------------------------------------


def _stream_error(obj: Any) -> TypeError:
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    return TypeError(f"stream must be {_STREAM_FORMS}; got {kind} {obj!r}")


def _checked_handle(handle: Any, obj: Any, source: str) -> int:
    if type(handle) is not int:
        if isinstance(handle, bool) or not hasattr(handle, "__index__"):
            raise TypeError(
                f"stream {source} is {type(handle).__name__} {handle!r}; expected an int handle"
            )
        handle = handle.__index__()
    if handle < 0 or handle >= _PTR_LIMIT:
        raise ValueError(
            f"stream {source} is {handle}; expected a cudaStream_t handle in [0, 2**64)"
        )
    return handle  # type: ignore[no-any-return]


def _stream_from_int(obj: Any) -> int:
    if 0 <= obj < 1 << 64:
        return int(obj)
    raise ValueError(f"stream handle {int(obj)} is out of range; expected 0 <= handle < 2**64")


def _stream_from_protocol(obj: Any) -> int:
    info = obj.__cuda_stream__
    if callable(info):
        info = info()
    try:
        _version, handle = info
    except (TypeError, ValueError):
        raise TypeError(
            f"{type(obj).__name__}.__cuda_stream__ gave {info!r}; expected (version, handle)"
        ) from None
    return _checked_handle(handle, obj, "__cuda_stream__ handle")


def _stream_from_cuda_stream(obj: Any) -> int:
    try:
        handle = obj.cuda_stream
    except AttributeError:
        raise _stream_error(obj) from None
    return _checked_handle(handle, obj, ".cuda_stream")


def _stream_from_ptr(obj: Any) -> int:
    try:
        handle = obj.ptr
    except AttributeError:
        raise _stream_error(obj) from None
    return _checked_handle(handle, obj, ".ptr")


def _stream_from_dunder_int(obj: Any) -> int:
    # cuda-python's cudaStream_t / CUstream: int() is the handle. Their getPtr() is
    # the address where the handle is stored, not the handle, so it is never used.
    return _checked_handle(int(obj), obj, "int()")


def _is_number(obj: Any) -> bool:
    # float, Decimal, Fraction, numpy floats: int() of them is no stream handle.
    import numbers

    return isinstance(obj, (numbers.Number, str, bytes))


def _stream_from_pynccl(obj: Any) -> int:
    return obj.handle  # type: ignore[no-any-return]


def _stream_handler(cls: type, obj: Any) -> StreamHandler:
    """Pick (and cache) the handler for streams of type ``cls``; raise if none fits."""
    cuda = sys.modules.get(__package__ + ".cuda")
    if issubclass(cls, bool):
        raise _stream_error(obj)
    if issubclass(cls, int):
        handler: StreamHandler = _stream_from_int
    elif cuda is not None and cls is getattr(cuda, "Stream", None):
        handler = _stream_from_pynccl
    elif hasattr(obj, "__cuda_stream__"):
        handler = _stream_from_protocol
    elif hasattr(obj, "cuda_stream"):
        handler = _stream_from_cuda_stream
    elif hasattr(obj, "ptr"):
        handler = _stream_from_ptr
    elif hasattr(cls, "__index__"):  # numpy integers
        handler = _stream_from_dunder_int
    elif hasattr(cls, "__int__") and not _is_number(obj):  # cuda-python, numba streams
        handler = _stream_from_dunder_int
    else:
        raise _stream_error(obj)
    if len(_STREAM_HANDLERS) < _CACHE_LIMIT:
        _STREAM_HANDLERS[cls] = handler
    return handler


_STREAM_HANDLERS: dict[type, StreamHandler] = {int: _stream_from_int}


def as_stream(obj: Any) -> int:
    """The ``cudaStream_t`` of ``obj`` as an ``int``.

    ``None`` gives 0 (CUDA's legacy default stream); an ``int`` is taken as the
    handle; :class:`pynccl.cuda.Stream`, objects with ``__cuda_stream__``
    (cuda.core; a method returning ``(version, handle)``, or such a tuple),
    ``.cuda_stream`` (torch), ``.ptr`` (CuPy) or ``__int__`` (cuda-python handles)
    give theirs. Anything else raises ``TypeError`` naming its type.
    """
    if obj is None:
        return 0
    if type(obj) is int and 0 <= obj < 1 << 64:
        return obj
    try:
        handler = _STREAM_HANDLERS[type(obj)]
    except KeyError:
        handler = _stream_handler(type(obj), obj)
    return handler(obj)
