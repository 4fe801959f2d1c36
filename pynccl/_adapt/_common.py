"""What every buffer parser shares: result types, the count/dtype override, contiguity,
and the wording of refusals."""

from __future__ import annotations

from .. import _limits
from ..dtypes import as_datatype, canonical_name, complex_component, complex_name
from ..enums import DataType

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Optional

    BufferInfo = tuple[int, int, DataType, Optional[int]]
    BufferHandler = Callable[[Any, Any, Any, str, bool, Optional[int]], BufferInfo]
    DeviceGetter = Callable[[Any, str], Optional[int]]


# Pointers and stream handles are unsigned 64-bit. Hot paths spell it `1 << 64`,
# which the compiler folds into a constant (no global lookup).
_PTR_LIMIT = 1 << 64
# Handler caches stop growing here: classes made on the fly must not leak memory.
_CACHE_LIMIT = 512

_BUFFER_FORMS = (
    "an int device pointer (with count= and dtype=), a pynccl.cuda.DeviceBuffer, "
    "or an array exposing __cuda_array_interface__ or DLPack (__dlpack__) "
    "such as a CuPy array or a torch CUDA tensor"
)


def check_pointer(name: str, ptr: int, count: int) -> None:
    """Refuse a raw pointer NCCL must not see: NULL (unless nothing moves), negative, or
    2**64 and up (ctypes would silently wrap it into another address).

    The old check, kept with its wording for the callers of this signature;
    :func:`pynccl._limits.check_pointer` is the rule (``as_buffer`` uses it), which also
    refuses a range ``[ptr, ptr + nbytes)`` passing 2**64.
    """
    if ptr < 0 or ptr >= _PTR_LIMIT:
        raise ValueError(f"{name}={ptr} is not a valid pointer (expected 0 < ptr < 2**64)")
    if ptr == 0 and count:
        raise ValueError(f"{name} is a NULL pointer but count={count}; expected ptr > 0")


def _datatype(dtype: Any, name: str) -> DataType:
    if type(dtype) is DataType:
        return dtype
    try:
        return as_datatype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype for {name}: {exc}") from None


def _datatype_lanes(dtype: Any, name: str) -> tuple[DataType, int]:
    """``dtype`` as ``(NCCL type, lanes)``: lanes is 2 for a complex type (two floats of the
    NCCL type per element), else 1."""
    if type(dtype) is DataType:
        return dtype, 1
    try:
        return as_datatype(dtype), 1
    except TypeError as exc:
        part = complex_component(dtype)
        if part is not None:
            return part, 2
        raise TypeError(f"dtype for {name}: {exc}") from None


def _type_words(dt: DataType, lanes: int) -> str:
    return canonical_name(dt) if lanes == 1 else complex_name(dt)


def _override(
    n: int, dt: DataType, count: Any, dtype: Any, name: str, lanes: int = 1
) -> tuple[int, DataType]:
    """Apply the caller's ``count`` / ``dtype`` to an array of ``n`` NCCL elements of ``dt``
    (``n // lanes`` of the array's own elements: ``count`` is counted in those)."""
    if dtype is not None:
        want, want_lanes = _datatype_lanes(dtype, name)
        if want is not dt or want_lanes != lanes:
            raise TypeError(
                f"dtype={_type_words(want, want_lanes)} does not match {name}, whose data "
                f"type is {_type_words(dt, lanes)}"
            )
    if count is not None:
        c = _limits.check_count(count)
        if c * lanes > n:
            raise ValueError(
                f"count={c} is larger than {name}, which holds only {n // lanes} elements"
            )
        n = c * lanes
    return n, dt


def _is_c_contiguous(shape: Any, strides: Any, itemsize: int) -> bool:
    """True if ``strides`` (in units where one element is ``itemsize``) are C order.

    Dimensions of extent 1 may carry any stride: no two elements are ever
    separated by them (numpy and torch both report such views as contiguous).
    """
    if len(strides) != len(shape):
        return False
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def _strided_error(name: str, shape: Any, strides: Any, unit: str) -> ValueError:
    return ValueError(
        f"{name} is a strided/non-contiguous view (shape={tuple(shape)}, "
        f"strides={tuple(strides)} in {unit}); NCCL reads and writes one contiguous "
        "block: make it contiguous first (e.g. .contiguous() or ascontiguousarray())"
    )


def _is_bytes_like(obj: Any) -> bool:
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def _not_a_buffer(obj: Any, name: str) -> TypeError:
    text = f"{name} must be {_BUFFER_FORMS}; got {type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, bool):
        text += " (a bool is not a pointer)"
    elif _instance_has(obj, "__array_interface__") or _is_bytes_like(obj):
        text += " (this looks like host memory; NCCL needs device memory)"
    return TypeError(text)


def _instance_has(obj: Any, attr: str) -> bool:
    try:
        return hasattr(obj, attr)
    except Exception:  # a __getattr__ raising something else: not a usable attribute
        return False
