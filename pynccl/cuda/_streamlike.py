"""Stream adaptation: whatever a caller passes as a stream becomes a ``cudaStream_t`` int.

Dispatch on ``type(obj)`` through a cache of handler functions, as for buffers
(:mod:`pynccl._adapt`): the first object of a type is probed, later ones go straight to
their handler; ints skip even that. Nothing here calls into CUDA.
"""

from __future__ import annotations

import sys

from .._limits import index_int, is_bool

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..typing import StreamLike

    StreamHandler = Callable[[Any], int]

__all__ = ["CURRENT", "as_stream", "current_stream"]

_PTR_LIMIT = 1 << 64
_CACHE_LIMIT = 512
_STREAM_FORMS = (
    "None, an int cudaStream_t handle, a pynccl.cuda.Stream, or an object with "
    "__cuda_stream__ (cuda.core), .cuda_stream (torch), .ptr (CuPy) or __int__ "
    "(cuda-python's cudaStream_t / CUstream)"
)


def _stream_error(obj: Any) -> TypeError:
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    hint = (
        " ('current' is taken by the collectives, send/recv and v-collectives, which read it "
        "from their arrays; here pass the stream itself)"
        if type(obj) is str and obj == CURRENT
        else ""
    )
    return TypeError(f"stream must be {_STREAM_FORMS}; got {kind} {obj!r}{hint}")


def _checked_handle(handle: Any, obj: Any, source: str) -> int:
    value = (
        handle if type(handle) is int else index_int(handle, f"stream {source}", "an int handle")
    )
    if value < 0 or value >= _PTR_LIMIT:
        raise ValueError(
            f"stream {source} is {value}; expected a cudaStream_t handle in [0, 2**64)"
        )
    return value


def _stream_from_int(obj: Any) -> int:
    if 0 <= obj < 1 << 64:
        return int(obj)
    raise ValueError(f"stream handle {int(obj)} is out of range; expected 0 <= handle < 2**64")


def _stream_from_protocol(obj: Any) -> int:
    try:
        info = obj.__cuda_stream__
    except AttributeError:
        return _redispatch(obj, _stream_from_protocol)
    if callable(info):
        info = info()
    try:
        _version, handle = info
    except (TypeError, ValueError):
        raise TypeError(
            f"{type(obj).__name__}.__cuda_stream__ gave {info!r}; expected (version, handle)"
        ) from None
    return _checked_handle(handle, obj, "__cuda_stream__ handle")


def _stream_from_cuda_stream(obj: Any) -> int:
    try:
        handle = obj.cuda_stream
    except AttributeError:
        return _redispatch(obj, _stream_from_cuda_stream)
    return _checked_handle(handle, obj, ".cuda_stream")


def _stream_from_ptr(obj: Any) -> int:
    try:
        handle = obj.ptr
    except AttributeError:
        return _redispatch(obj, _stream_from_ptr)
    return _checked_handle(handle, obj, ".ptr")


def _stream_from_dunder_int(obj: Any) -> int:
    # cuda-python's cudaStream_t / CUstream: int() is the handle. Their getPtr() is
    # the address where the handle is stored, not the handle, so it is never used.
    try:
        handle = int(obj)
    except Exception as exc:  # a broken __int__/__index__ is a bad argument, not our crash
        kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
        raise TypeError(
            f"stream must be {_STREAM_FORMS}; got {kind}, whose int() raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return _checked_handle(handle, obj, "int()")


def _is_number(obj: Any) -> bool:
    # float, Decimal, Fraction, numpy floats: int() of them is no stream handle.
    import numbers

    return isinstance(obj, (numbers.Number, str, bytes))


def _pick(cls: type, obj: Any) -> StreamHandler:
    """The handler for ``obj`` (of type ``cls``); ``TypeError`` if none fits."""
    stream_module = sys.modules.get(__package__ + "._stream")  # loaded with pynccl.cuda
    if issubclass(cls, bool) or is_bool(obj):  # numpy bools too: int() of them is 0 or 1
        raise _stream_error(obj)
    if issubclass(cls, int):
        return _stream_from_int
    if stream_module is not None and cls is getattr(stream_module, "Stream", None):
        return cls.handle.fget  # type: ignore[no-any-return]  # the property itself: one frame
    if hasattr(obj, "__cuda_stream__"):
        return _stream_from_protocol
    if hasattr(obj, "cuda_stream"):
        return _stream_from_cuda_stream
    if hasattr(obj, "ptr"):
        return _stream_from_ptr
    if hasattr(cls, "__index__"):  # numpy integers
        return _stream_from_dunder_int
    if hasattr(cls, "__int__") and not _is_number(obj):  # cuda-python, numba streams
        return _stream_from_dunder_int
    raise _stream_error(obj)


def _redispatch(obj: Any, failed: StreamHandler) -> int:
    """``obj`` lacks the attribute its type's cached handler reads (instances of one class
    may expose different protocols): pick again for this instance, without caching."""
    handler = _pick(type(obj), obj)
    if handler is failed:  # the attribute is there for hasattr but not for reading
        raise _stream_error(obj)
    return handler(obj)


def _stream_handler(cls: type, obj: Any) -> StreamHandler:
    """Pick (and cache) the handler for streams of type ``cls``; raise if none fits.

    The pick is made on the first instance seen; a later one that lacks what the cached
    handler reads is re-dispatched by that handler (:func:`_redispatch`)."""
    handler = _pick(cls, obj)
    if len(_STREAM_HANDLERS) < _CACHE_LIMIT:
        _STREAM_HANDLERS[cls] = handler
    return handler


_STREAM_HANDLERS: dict[type, StreamHandler] = {int: _stream_from_int}


def as_stream(obj: StreamLike) -> int:
    """The ``cudaStream_t`` of ``obj`` as an ``int``.

    ``None`` gives 0 (CUDA's legacy default stream); an ``int`` is taken as the
    handle; :class:`pynccl.cuda.Stream`, objects with ``__cuda_stream__``
    (cuda.core; a method returning ``(version, handle)``, or such a tuple),
    ``.cuda_stream`` (torch), ``.ptr`` (CuPy) or ``__int__`` (cuda-python handles)
    give theirs. Anything else raises ``TypeError`` naming its type.
    """
    if obj is None:
        return 0
    if type(obj) is int and 0 <= obj < 1 << 64:
        return obj
    try:
        handler = _STREAM_HANDLERS[type(obj)]
    except KeyError:
        handler = _stream_handler(type(obj), obj)
    return handler(obj)


#: ``stream="current"``: the array library's current stream (:func:`current_stream`).
CURRENT = "current"


def current_stream(arrays: tuple[object, ...], default: int) -> int:
    """``stream="current"``: the current stream of the library the first array of
    ``arrays`` comes from, found by its type's module and never imported here — torch
    (``torch.cuda.current_stream(tensor.device).cuda_stream``, for a CUDA tensor) or CuPy
    (``cupy.cuda.get_current_stream(array.device.id).ptr``: the array's device's); ``default``
    (the communicator's stream) for raw pointers, ``DeviceBuffer`` and other arrays, or when
    no array is given."""
    for obj in arrays:
        if obj is None or type(obj) is int:
            continue
        lib = type(obj).__module__.partition(".")[0]
        module = sys.modules.get(lib) if lib in ("torch", "cupy") else None
        if module is None:
            continue
        if lib == "cupy":  # the current stream of the array's device, not the current one's
            device_id = getattr(getattr(obj, "device", None), "id", None)
            get = module.cuda.get_current_stream
            stream = get(device_id) if type(device_id) is int else get()
            return _checked_handle(stream.ptr, obj, "of cupy")
        device = getattr(obj, "device", None)
        if getattr(device, "type", None) != "cuda":
            return default  # a host tensor: refused as on the host where it is read
        stream = module.cuda.current_stream(device)
        return _checked_handle(stream.cuda_stream, obj, "of torch")
    return default
