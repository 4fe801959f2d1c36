"""pynccl.cuda.DeviceBuffer, read from its slots (the fast path) or its properties."""

from __future__ import annotations

import sys

from ._common import _override

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

    from ._common import BufferHandler, BufferInfo


# DeviceBuffer's slots read by the fast handler; its public properties cost about
# four times as much on this path. Checked once against the class (see below).
_DEVICE_BUFFER_SLOTS = frozenset({"_info", "_lanes"})


def _from_device_buffer(
    obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
) -> BufferInfo:
    # (ptr, count as NCCL counts it: 2 floats per complex element, dtype, device), kept by
    # the buffer from its allocation to its free
    info: BufferInfo | None = obj._info
    if info is None:  # freed
        raise ValueError(f"{name} is a DeviceBuffer that has been freed")
    if count is None and dtype is None:
        return info
    ptr, n, dt, device = info
    n, dt = _override(n, dt, count, dtype, name, obj._lanes)
    return ptr, n, dt, device


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


_BUFFER_MODULE = __package__.rpartition(".")[0] + ".cuda._buffer"


def _device_buffer_handler(cls: type) -> BufferHandler | None:
    """The handler for pynccl.cuda.DeviceBuffer if ``cls`` is it, else None."""
    # pynccl.cuda loads libcudart on use, not on import; a DeviceBuffer can only
    # exist once it is imported, so there is nothing to import here.
    buffer_module = sys.modules.get(_BUFFER_MODULE)
    if buffer_module is None or cls is not getattr(buffer_module, "DeviceBuffer", None):
        return None
    if _DEVICE_BUFFER_SLOTS <= set(getattr(cls, "__slots__", ())):
        return _from_device_buffer
    return _from_device_buffer_public
