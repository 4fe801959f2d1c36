"""The loaded libcudart and the cudaError_t values pynccl.cuda reacts to."""

from __future__ import annotations

from typing import Any

from .. import library as _library
from .._limits import check_c_int

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
    """A device index for a C ``int``: an integer in [0, 2**31) (never bool or float), in
    the words of :func:`pynccl._limits.check_c_int`; ``cudaSetDevice`` and friends say
    whether that device exists."""
    return check_c_int(value, name, 0)
