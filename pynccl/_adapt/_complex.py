"""Is a buffer complex? For callers that must refuse complex data where a pair of floats
would give a wrong result (prod, max, min)."""

from __future__ import annotations

from ..dtypes import complex_component
from ..enums import DataType
from ._common import _CACHE_LIMIT
from ._devbuf import _device_buffer_handler
from ._dlpack import _DL_COMPLEX, _capsule_tensor

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..typing import DTypeLike


def _complex_never(obj: Any) -> bool:
    return False


def _complex_device_buffer(obj: Any) -> bool:
    return getattr(obj, "_lanes", 1) == 2


def _complex_dlpack(obj: Any) -> bool:
    # Without arguments every producer answers, with a legacy capsule; read only its dtype.
    fields = _capsule_tensor(obj.__dlpack__(), "buffer", False)
    return (fields[4], fields[5]) in _DL_COMPLEX and fields[6] == 1


def _complex_array(obj: Any) -> bool:
    try:
        typestr = obj.__cuda_array_interface__["typestr"]
    except Exception:  # no CAI, or one the producer refuses here (torch CPU / bfloat16)
        typestr = None
    if type(typestr) is str:
        return complex_component(typestr) is not None
    declared = getattr(obj, "dtype", None)  # torch / CuPy / JAX arrays: cheaper than DLPack
    if declared is not None and complex_component(declared) is not None:
        return True
    return hasattr(type(obj), "__dlpack__") and _complex_dlpack(obj)


def _complex_probe(cls: type) -> Callable[[Any], bool]:
    if issubclass(cls, int):
        probe: Callable[[Any], bool] = _complex_never
    elif _device_buffer_handler(cls) is not None:
        probe = _complex_device_buffer
    else:
        probe = _complex_array
    if len(_COMPLEX_PROBES) < _CACHE_LIMIT:
        _COMPLEX_PROBES[cls] = probe
    return probe


_COMPLEX_PROBES: dict[type, Callable[[Any], bool]] = {int: _complex_never}


def is_complex(obj: object, dtype: DTypeLike | None = None) -> bool:
    """True if buffer ``obj`` (with the caller's ``dtype=``, if any) holds complex numbers,
    which :func:`as_buffer` hands out as pairs of floats.

    For callers that must refuse complex data where pairs of floats would give a wrong
    result (prod, max, min). Never raises: a buffer :func:`as_buffer` would refuse gives
    False here and its error there. The probe is chosen once per type.
    """
    if dtype is not None:
        return type(dtype) is not DataType and complex_component(dtype) is not None
    try:
        probe = _COMPLEX_PROBES[type(obj)]
    except KeyError:
        probe = _complex_probe(type(obj))
    try:
        return probe(obj)
    except Exception:
        return False
