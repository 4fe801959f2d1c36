"""``__cuda_array_interface__`` (v2/v3: CuPy, Numba, PyTorch), and the device an array
reports (``.device`` or ``__dlpack_device__``)."""

from __future__ import annotations

import math

from .._limits import check_extent, check_pointer
from ..dtypes import as_datatype, canonical_name, complex_component
from ..enums import DataType
from ._common import (
    _CACHE_LIMIT,
    _instance_has,
    _is_c_contiguous,
    _not_a_buffer,
    _override,
    _strided_error,
)
from ._dlpack import _DL_CUDA, _dlpack_device, _make_dlpack_handler

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

    from ._common import BufferHandler, BufferInfo, DeviceGetter


def _no_device(obj: Any, name: str) -> int | None:
    return None


def _device_from_dlpack_device(obj: Any, name: str) -> int | None:
    kind, index = _dlpack_device(obj, name)
    # Managed memory reports device_id 0 whatever device it was made on (dlpack.h).
    return index if kind == _DL_CUDA else None


def _device_from_attribute(obj: Any, name: str = "") -> int | None:
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
        if type(cai) is not dict:
            raise TypeError
        shape = cai["shape"]
        typestr = cai["typestr"]
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError):
        raise TypeError(
            f"{name} has a malformed __cuda_array_interface__ {cai!r}: expected a dict "
            "with 'shape', 'typestr' and 'data': (ptr, readonly)"
        ) from None
    if not isinstance(ptr, int) or isinstance(ptr, bool):
        raise TypeError(f"{name}: __cuda_array_interface__ data pointer {ptr!r} is not an int")
    dt = _TYPESTR_CACHE.get(typestr) if type(typestr) is str else None
    lanes = 1
    if dt is None:
        part = complex_component(typestr) if type(typestr) is str else None
        if part is not None:
            dt, lanes = part, 2
        else:
            dt = _cai_datatype(obj, typestr, name)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise TypeError(
            f"{name}: __cuda_array_interface__ shape {shape!r} is not a tuple of ints >= 0"
        )
    n = math.prod(shape)
    nbytes = check_extent(n, dt.itemsize * lanes, name)
    strides = cai.get("strides")
    if strides is not None:
        if not isinstance(strides, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in strides
        ):
            raise TypeError(
                f"{name}: __cuda_array_interface__ strides {strides!r} are neither None "
                "nor a tuple of ints"
            )
        if n and not _is_c_contiguous(shape, strides, dt.itemsize * lanes):
            raise _strided_error(name, shape, strides, "bytes")
    if cai.get("mask") is not None:
        raise ValueError(f"{name} is a masked array (__cuda_array_interface__ 'mask' is set)")
    if readonly and writable:
        raise ValueError(
            f"{name} is read-only (__cuda_array_interface__ data=({ptr:#x}, True)); "
            "NCCL writes the result into it"
        )
    ptr = check_pointer(ptr, f"{name}'s data pointer", nbytes)
    n *= lanes
    if count is not None or dtype is not None:
        n, dt = _override(n, dt, count, dtype, name, lanes)
    return ptr, n, dt, None if device_of is _no_device else device_of(obj, name)


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
                    # no item is over 8 bytes: [ptr, ptr + n items) lies below 2**64
                    and 0 < ptr < (1 << 64) - (n << 3)
                    and not (readonly and writable)
                ):
                    return ptr, n, dt, None
        return _from_cai(obj, cai, count, dtype, name, writable, device_of)

    return handler
