"""Raw ``int`` device pointers: the caller gives ``count=`` and ``dtype=``."""

from __future__ import annotations

from ..enums import DataType
from ._common import _PTR_LIMIT, _check_count, _datatype_lanes, _type_words, check_pointer

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
