"""The loaded libcudart and the cudaError_t values pynccl.cuda reacts to."""

from __future__ import annotations

from typing import Any

from .. import library as _library

_ERR_INITIALIZATION = 3
_ERR_STUB_LIBRARY = 34
_ERR_INSUFFICIENT_DRIVER = 35
_ERR_NO_DEVICE = 100
_ERR_NOT_READY = 600
_ERR_CAPTURE_IMPLICIT = 906  # cudaErrorStreamCaptureImplicit
#: Errors that mean "no usable GPU here" rather than a failed operation.
_NO_GPU = frozenset(
    {_ERR_INITIALIZATION, _ERR_STUB_LIBRARY, _ERR_INSUFFICIENT_DRIVER, _ERR_NO_DEVICE}
)


def _rt() -> Any:
    return _library.cudart()


def _check_index(name: str, value: object) -> int:
    # bool is an int subclass, but set_device(True) is surely a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value


#: Anything accepted where a stream is expected: ``None`` (the default stream),
#: an ``int`` handle, a :class:`Stream`, or an object with ``__cuda_stream__``
#: (cuda.core, CuPy >= 13), ``.cuda_stream`` (torch) or ``.ptr`` (CuPy).
StreamLike = Any
