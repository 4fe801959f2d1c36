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

__version__ = "0.1.0"

# Every public name is loaded on first access (PEP 562), so that `import pynccl` imports
# nothing but this module: not even `enum` (DataType and friends) or ctypes.
_LAZY: dict[str, str] = {
    "as_datatype": "dtypes",
    "DataType": "enums",
    "RedOp": "enums",
    "Result": "enums",
    "ScalarResidence": "enums",
    "CudaError": "errors",
    "LibraryNotFoundError": "errors",
    "NcclError": "errors",
    "NcclInProgress": "errors",
    "NcclInternalError": "errors",
    "NcclInvalidArgument": "errors",
    "NcclInvalidUsage": "errors",
    "NcclRemoteError": "errors",
    "NcclSystemError": "errors",
    "NcclTimeoutError": "errors",
    "NcclUnhandledCudaError": "errors",
    "NotSupportedError": "errors",
    "load_library": "library",
    "lib": "library",
    "load_cudart": "library",
    "cudart": "library",
    "version": "library",
    "CollConfig": "comm",
    "Communicator": "comm",
    "CommProperties": "comm",
    "Config": "comm",
    "PersistentOp": "comm",
    "UniqueId": "comm",
    "Registration": "comm",
    "SignalWait": "comm",
    "Window": "comm",
    "Work": "comm",
    "group": "groups",
    "group_start": "groups",
    "group_end": "groups",
    "DeviceBuffer": "cuda",
    "params": "comm",
    "Params": "comm",
    "Event": "cuda",
    "Stream": "cuda",
    "device_count": "cuda",
}
# Submodules that `import pynccl` used to import eagerly: `pynccl.errors.X` keeps working.
_SUBMODULES = frozenset({"dtypes", "enums", "errors"})

# `typing` costs milliseconds to import; mypy treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .comm import (
        CollConfig,
        Communicator,
        Config,
        PersistentOp,
        Registration,
        SignalWait,
        UniqueId,
        Window,
        Work,
    )
    from .comm._params import Params, params
    from .comm._properties import CommProperties
    from .cuda import DeviceBuffer, Event, Stream, device_count
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
    from .groups import group, group_end, group_start
    from .library import cudart, lib, load_cudart, load_library, version

__all__ = [
    "CollConfig",
    "CommProperties",
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
    "Params",
    "PersistentOp",
    "RedOp",
    "Registration",
    "Result",
    "ScalarResidence",
    "SignalWait",
    "Stream",
    "UniqueId",
    "Window",
    "Work",
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
    "params",
    "version",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        if name in _SUBMODULES:
            module, name = name, ""
        else:
            raise AttributeError(f"module 'pynccl' has no attribute {name!r}")
    # __import__ rather than importlib.import_module: the `importlib` package (and the
    # `warnings` it imports) stays out of the first use.
    submodule = getattr(__import__(f"{__name__}.{module}"), module)
    value = getattr(submodule, name) if name else submodule
    if name:
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
