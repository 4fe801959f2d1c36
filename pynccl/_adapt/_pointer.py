"""Raw device pointers (an ``int``, or cuda.bindings' ``CUdeviceptr``): the caller gives
``count=`` and ``dtype=``; and cuda.core's untyped ``Buffer`` (bytes, typed by ``dtype=``)."""

from __future__ import annotations

from .._limits import check_count, check_extent, check_pointer, index_int, pointer_int
from ..enums import DataType
from ._common import _datatype_lanes, _type_words

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

    from ._common import BufferHandler, BufferInfo


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
    n = count if type(count) is int and 0 <= count < 1 << 64 else check_count(count)
    if type(dtype) is DataType:
        dt = dtype
    else:
        dt, lanes = _datatype_lanes(dtype, name)
        n *= lanes  # complex: NCCL moves twice as many floats
    return check_pointer(obj, name, check_extent(n, dt.itemsize, name)), n, dt, None


def _from_pointer_object(
    obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
) -> BufferInfo:
    """A cuda.bindings ``CUdeviceptr``: the raw pointer its ``__int__`` gives."""
    return _from_pointer(pointer_int(obj, name), count, dtype, name, writable, stream)


def _byte_buffer_device(obj: Any) -> int | None:
    try:
        device = obj.device_id
    except Exception:  # no CUDA driver (the loopback): the device is unknown, not checked
        return None
    return device if type(device) is int and device >= 0 else None


def _from_byte_buffer(
    obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
) -> BufferInfo:
    """A cuda.core ``Buffer``: ``size`` untyped bytes at ``handle``. Without ``dtype=`` it
    is that many uint8; with it, ``size`` must be a whole number of its elements."""
    if getattr(obj, "is_closed", False):
        raise ValueError(f"{name} is a cuda.core Buffer that has been closed")
    nbytes = index_int(obj.size, f"{name}.size")
    ptr = pointer_int(obj.handle, f"{name}.handle")
    if dtype is None:
        dt, lanes = DataType.UINT8, 1
    elif type(dtype) is DataType:
        dt, lanes = dtype, 1
    else:
        dt, lanes = _datatype_lanes(dtype, name)
    item = dt.itemsize * lanes
    if nbytes % item:
        raise ValueError(
            f"{name} is a byte buffer of {nbytes} bytes, not a whole number of "
            f"{_type_words(dt, lanes)} elements ({item} bytes each)"
        )
    n = nbytes // item
    if count is not None:
        c = check_count(count)
        if c > n:
            raise ValueError(f"count={c} is larger than {name}, which holds only {n} elements")
        n = c
    n *= lanes
    check_pointer(ptr, name, check_extent(n, dt.itemsize, name))
    return ptr, n, dt, _byte_buffer_device(obj)


def _special_handler(cls: type) -> BufferHandler | None:
    """The handler for cuda-python's types (recognised by name: nothing is imported):
    ``CUdeviceptr`` as a raw pointer, a cuda.core ``Buffer`` as typed bytes."""
    module = cls.__module__
    if cls.__name__ == "CUdeviceptr" and module.startswith("cuda.bindings"):
        return _from_pointer_object
    if cls.__name__ == "Buffer" and module.startswith("cuda.core"):
        return _from_byte_buffer
    return None
