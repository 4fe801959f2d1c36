"""The loaded libcudart and the cudaError_t values pynccl.cuda reacts to."""

from __future__ import annotations

from .. import library as _library
from .._limits import check_device_ordinal

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

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
    """A device ordinal for a C ``int`` (:func:`pynccl._limits.check_device_ordinal`: an
    integer in [0, 2**31), never bool or float, or a cuda.core ``Device``);
    ``cudaSetDevice`` and friends say whether that device exists."""
    return check_device_ordinal(value, name)
