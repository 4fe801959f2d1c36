"""Raw ``int`` device pointers: the caller gives ``count=`` and ``dtype=``."""

from __future__ import annotations

from .._limits import check_count, check_extent, check_pointer
from ..enums import DataType
from ._common import _datatype_lanes

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

    from ._common import BufferInfo


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
    lanes = 1
    if type(dtype) is DataType:
        dt = dtype
    else:
        dt, lanes = _datatype_lanes(dtype, name)
        n *= lanes  # complex: NCCL moves twice as many floats
    return check_pointer(obj, name, check_extent(n, dt.itemsize, name)), n, dt, None
