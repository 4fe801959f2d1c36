"""pynccl: a pure-ctypes binding to NVIDIA NCCL.

Two layers:

* the low-level layer, :func:`lib` — the loaded libnccl with every NCCL
  function under its C name (``lib().ncclAllReduce(...)``), checked,
  version-aware (``NotSupportedError`` for what the loaded release lacks);
* the object layer — :class:`Communicator`, :class:`UniqueId`,
  :func:`group`, over raw device pointers or any array exposing
  ``__cuda_array_interface__`` or DLPack.

Importing pynccl loads no library and imports no third-party package; the
libraries are found and loaded on first use (see ``python -m pynccl info``).
"""

from __future__ import annotations

from .dtypes import as_datatype
from .enums import DataType, RedOp, Result, ScalarResidence
from .errors import (
    CudaError,
    LibraryNotFoundError,
    NcclError,
    NcclInProgress,
    NcclInternalError,
    NcclInvalidArgument,
    NcclInvalidUsage,
    NcclRemoteError,
    NcclSystemError,
    NcclTimeoutError,
    NcclUnhandledCudaError,
    NotSupportedError,
)

__version__ = "0.1.0"

# Public names that live in modules importing ctypes: loaded on first access (PEP 562)
# so that `import pynccl` stays cheap.
_LAZY: dict[str, str] = {
    "load_library": "library",
    "lib": "library",
    "load_cudart": "library",
    "cudart": "library",
    "version": "library",
    "CollConfig": "comm",
    "Communicator": "comm",
    "Config": "comm",
    "PersistentOp": "comm",
    "UniqueId": "comm",
    "group": "groups",
    "group_start": "groups",
    "group_end": "groups",
    "DeviceBuffer": "cuda",
    "Event": "cuda",
    "Stream": "cuda",
    "device_count": "cuda",
}

# `typing` costs milliseconds to import; mypy treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .comm import CollConfig, Communicator, Config, PersistentOp, UniqueId
    from .cuda import DeviceBuffer, Event, Stream, device_count
    from .groups import group, group_end, group_start
    from .library import cudart, lib, load_cudart, load_library, version

__all__ = [
    "CollConfig",
    "Communicator",
    "Config",
    "CudaError",
    "DataType",
    "DeviceBuffer",
    "Event",
    "LibraryNotFoundError",
    "NcclError",
    "NcclInProgress",
    "NcclInternalError",
    "NcclInvalidArgument",
    "NcclInvalidUsage",
    "NcclRemoteError",
    "NcclSystemError",
    "NcclTimeoutError",
    "NcclUnhandledCudaError",
    "NotSupportedError",
    "PersistentOp",
    "RedOp",
    "Result",
    "ScalarResidence",
    "Stream",
    "UniqueId",
    "__version__",
    "as_datatype",
    "cudart",
    "device_count",
    "group",
    "group_end",
    "group_start",
    "lib",
    "load_cudart",
    "load_library",
    "version",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pynccl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
