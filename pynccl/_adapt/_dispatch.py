"""Which parser reads a buffer: chosen once per type, cached; :func:`as_buffer`."""

from __future__ import annotations

from ..enums import DataType
from ._cai import _make_cai_handler
from ._common import _CACHE_LIMIT, _instance_has, _not_a_buffer
from ._devbuf import _device_buffer_handler
from ._dlpack import _make_dlpack_handler
from ._pointer import _from_pointer, _special_handler

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

    from ..typing import BufferLike, DTypeLike, IndexLike
    from ._common import BufferHandler, BufferInfo


def _buffer_handler(cls: type, obj: Any, name: str) -> BufferHandler:
    """Pick (and cache) the handler for buffers of type ``cls``; raise if none fits."""
    if issubclass(cls, int):
        if issubclass(cls, bool):
            raise _not_a_buffer(obj, name)
        handler: BufferHandler = _from_pointer
    elif (fast := _device_buffer_handler(cls)) is not None:
        handler = fast
    elif (special := _special_handler(cls)) is not None:  # before DLPack: Buffer has it
        handler = special
    elif hasattr(cls, "__cuda_array_interface__") or _instance_has(obj, "__cuda_array_interface__"):
        # Decided on the class where possible: evaluating the property may raise
        # for this instance (a torch CPU or bfloat16 tensor) and not for the next.
        handler, _ = _make_cai_handler(cls, obj)
    elif hasattr(cls, "__dlpack__"):
        handler = _make_dlpack_handler(cls)
    else:
        raise _not_a_buffer(obj, name)
    if len(_BUFFER_HANDLERS) < _CACHE_LIMIT:
        _BUFFER_HANDLERS[cls] = handler
    return handler


_BUFFER_HANDLERS: dict[type, BufferHandler] = {int: _from_pointer}


def buffer_handler(obj: object, name: str) -> BufferHandler:
    """The handler that reads buffers of ``type(obj)``: ``handler(obj, count, dtype, name,
    writable, stream) -> (ptr, nelems, datatype, device)``, as :func:`as_buffer` calls it.

    For hot paths that look the type up in ``_BUFFER_HANDLERS`` themselves and
    call this only on a miss. Raises ``TypeError`` naming ``name`` if no handler fits.
    """
    handler = _BUFFER_HANDLERS.get(type(obj))
    return handler if handler is not None else _buffer_handler(type(obj), obj, name)


def as_buffer(
    obj: BufferLike,
    count: IndexLike | None = None,
    dtype: DTypeLike | None = None,
    *,
    name: str = "sendbuf",
    writable: bool = False,
    stream: int | None = None,
) -> BufferInfo:
    """``(ptr, nelems, datatype, device)`` for a buffer argument called ``name``.

    ``obj`` is an ``int`` device pointer or a cuda.bindings ``CUdeviceptr`` (then
    ``count`` and ``dtype`` are required), a :class:`pynccl.cuda.DeviceBuffer`, a cuda.core
    ``Buffer`` (untyped bytes: uint8, or elements of ``dtype`` when its size is a whole
    number of them), or an array exposing ``__cuda_array_interface__`` or DLPack. For an
    array, ``count`` (if given)
    must not exceed its element count and is what is returned, and ``dtype`` (if
    given) must be the array's type. ``writable=True`` refuses read-only arrays
    (for receive buffers). ``stream`` is the stream the caller will use, passed
    to ``__dlpack__`` so that the producer can order its pending work before it.
    ``device`` is the CUDA device the array reports, ``None`` if it reports none
    (raw pointers, managed memory).

    A complex array (complex64 / complex128, DLPack's complex32; for a raw pointer,
    ``dtype="complex64"`` and the like) comes back as twice as many floats of its halves'
    type; ``count`` is still counted in complex elements. See :func:`is_complex`.

    Only C-contiguous, unmasked arrays of an NCCL data type are accepted:
    others raise ``TypeError`` (wrong kind or type) or ``ValueError`` (wrong
    layout, size, location or pointer), naming ``name`` and the values. Counts,
    pointers and extents follow :mod:`pynccl._limits` (same exceptions, same words as
    the object API): a count is an int or ``__index__`` integer in [0, 2**64), never a
    bool or float; ``[ptr, ptr + count * itemsize)`` must lie below 2**64.
    """
    if (
        type(obj) is int
        and type(count) is int
        and type(dtype) is DataType
        and 0 <= count < 1 << 60
        and 0 < obj < 1 << 63
    ):
        # The raw path, checked in full with constant bounds only: no item is over 8
        # bytes, so [obj, obj + count items) ends below 2**63 + 2**63 = 2**64. The rest
        # (huge counts, pointers in the top half) gets the exact checks of _from_pointer.
        return obj, count, dtype, None
    return buffer_handler(obj, name)(obj, count, dtype, name, writable, stream)


def check_device(device: int | None, expected: int | None, name: str) -> None:
    """Raise ``ValueError`` if buffer ``name`` is on ``device`` rather than ``expected``.

    ``None`` on either side (a raw pointer, managed memory, a communicator whose
    device is unknown) skips the check.
    """
    if device is not None and expected is not None and device != expected:
        raise ValueError(
            f"{name} is on device {device} but the communicator is on device {expected}"
        )
