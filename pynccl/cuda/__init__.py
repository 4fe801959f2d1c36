"""The few CUDA runtime objects pynccl needs: devices, :class:`Stream`, :class:`Event`,
:class:`DeviceBuffer`, :class:`Graph` (layer 4).

Over :func:`pynccl.library.cudart` (libcudart, or the loopback stand-in when testing
without a GPU). Every failing call raises :class:`~pynccl.CudaError` with CUDA's error
name and text, except :func:`device_count`, which answers 0 where there is no usable
GPU. numpy is optional: only the methods that take or return arrays import it.

Ownership follows cuda.core: an object made here owns its handle and ``close()``
destroys it; an object that wraps a handle made elsewhere (:meth:`Stream.wrap`) only
borrows it, and ``close()`` leaves it alone.

One module per kind: ``_device`` (devices, pointer attributes), ``_stream``, ``_event``,
``_graph``, ``_buffer`` (DeviceBuffer), ``_streamlike`` (stream adaptation: any
stream-like object to a ``cudaStream_t`` int), ``_runtime`` (the loaded libcudart).
"""

from __future__ import annotations

TYPE_CHECKING = False  # not imported from typing: keeps this import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

    from ..typing import StreamLike
    from ._buffer import DeviceBuffer
    from ._device import (
        MemoryType,
        device_count,
        driver_version,
        get_device,
        pointer_attributes,
        runtime_version,
        set_device,
        synchronize,
    )
    from ._event import Event
    from ._graph import CaptureMode, Graph
    from ._graph import _unsafe_calls_prohibited as _unsafe_calls_prohibited
    from ._runtime import _rt as _rt
    from ._stream import Stream, is_capturing, stream_handle
    from ._stream import _capture_blocks as _capture_blocks

__all__ = [
    "CaptureMode",
    "DeviceBuffer",
    "Event",
    "Graph",
    "MemoryType",
    "Stream",
    "StreamLike",
    "device_count",
    "driver_version",
    "get_device",
    "is_capturing",
    "pointer_attributes",
    "runtime_version",
    "set_device",
    "stream_handle",
    "synchronize",
]

# Public name -> the submodule defining it. Loaded on first use, so that the adaptation
# layer (which needs only ._streamlike) and `import pynccl` stay cheap.
_LAZY = {
    "DeviceBuffer": "._buffer",
    "MemoryType": "._device",
    "device_count": "._device",
    "driver_version": "._device",
    "get_device": "._device",
    "pointer_attributes": "._device",
    "runtime_version": "._device",
    "set_device": "._device",
    "synchronize": "._device",
    "Event": "._event",
    "CaptureMode": "._graph",
    "Graph": "._graph",
    "_unsafe_calls_prohibited": "._graph",
    "StreamLike": "..typing",
    "_rt": "._runtime",
    "Stream": "._stream",
    "is_capturing": "._stream",
    "stream_handle": "._stream",
    "_capture_blocks": "._stream",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    level = len(module) - len(module.lstrip("."))  # "._buffer": 1, "..typing": 2
    value = getattr(__import__(module[level:], globals(), None, [name], level), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
