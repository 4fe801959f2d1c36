"""``__cuda_array_interface__`` (v2/v3: CuPy, Numba, PyTorch), and the device an array
reports (``.device`` or ``__dlpack_device__``)."""

from __future__ import annotations

import math
from types import FunctionType

from .._limits import check_extent, check_pointer
from ..dtypes import as_datatype, canonical_name, complex_component
from ..enums import DataType
from ._common import (
    _CACHE_LIMIT,
    _instance_has,
    _is_c_contiguous,
    _not_a_buffer,
    _override,
    _strided_error,
)
from ._dlpack import _DL_CUDA, _dlpack_device, _make_dlpack_handler

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

    from ._common import BufferHandler, BufferInfo, DeviceGetter


def _no_device(obj: Any, name: str) -> int | None:
    return None


def _device_from_dlpack_device(obj: Any, name: str) -> int | None:
    kind, index = _dlpack_device(obj, name)
    # Managed memory reports device_id 0 whatever device it was made on (dlpack.h).
    return index if kind == _DL_CUDA else None


def _device_from_attribute(obj: Any, name: str = "") -> int | None:
    device = getattr(obj, "device", None)
    if type(device) is int:  # pynccl DeviceBuffer and its likes
        return device
    if device is None or isinstance(device, bool):
        return None
    kind = getattr(device, "type", None)
    if isinstance(kind, str):  # torch.device: index is None for a bare "cuda"
        index = getattr(device, "index", None)
        return index if kind == "cuda" and isinstance(index, int) else None
    ident = getattr(device, "id", None)  # cupy.cuda.Device
    if isinstance(ident, int) and not isinstance(ident, bool):
        return ident
    if isinstance(device, int):
        return int(device)
    return None


def _device_getter(cls: type, obj: Any) -> DeviceGetter:
    # A recognisable .device first: torch's __dlpack_device__ is a Python method
    # doing an import on every call, several times dearer than reading .device.
    if _instance_has(obj, "device") and _device_from_attribute(obj) is not None:
        return _device_from_attribute
    if hasattr(cls, "__dlpack_device__"):
        return _device_from_dlpack_device
    if _instance_has(obj, "device"):
        return _device_from_attribute
    return _no_device


# --- __cuda_array_interface__ ---------------------------------------------------------------

# Numeric typestrs seen so far; void typestrs ("<V2") never enter.
_TYPESTR_CACHE: dict[str, DataType] = {}


def _cai_datatype(obj: Any, typestr: Any, name: str) -> DataType:
    if not isinstance(typestr, str):
        raise TypeError(f"{name}: __cuda_array_interface__ typestr {typestr!r} is not a str")
    if typestr[1:2] == "V" or typestr[1:] == "f1":
        # bfloat16 / FP8 have no typestr of their own (numpy shows ml_dtypes' as '<V2',
        # '<V1', or '<f1' for float8_e5m2): the array's own .dtype tells.
        declared = getattr(obj, "dtype", None)
        try:
            dt = as_datatype(declared)
        except TypeError:
            raise TypeError(
                f"{name} has typestr {typestr!r}, which names no NCCL type by itself, and no "
                f".dtype that maps to one (.dtype={declared!r}); bfloat16 and float8 arrays must "
                "carry a bfloat16/float8 .dtype"
            ) from None
        size = typestr[2:]
        if not size.isdigit() or int(size) != dt.itemsize:
            raise TypeError(
                f"{name} has typestr {typestr!r} but .dtype={declared!r} "
                f"({canonical_name(dt)}, {dt.itemsize} bytes): the item sizes disagree"
            )
        return dt
    try:
        dt = as_datatype(typestr)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    if len(_TYPESTR_CACHE) < _CACHE_LIMIT:
        _TYPESTR_CACHE[typestr] = dt
    return dt


def _cai_version(cai: dict[str, Any], name: str) -> None:
    """Refuse a ``version`` that is not an int from 0 to 3 (absent is tolerated: older
    producers omit it; every version pynccl reads has the same fields but ``stream``)."""
    if "version" not in cai:
        return
    version = cai["version"]
    if type(version) is not int:
        raise TypeError(
            f"{name}: __cuda_array_interface__ version {version!r} is not an int "
            f"({type(version).__name__}); expected 0, 1, 2 or 3"
        )
    if not 0 <= version <= 3:
        raise ValueError(
            f"{name}: __cuda_array_interface__ version={version} is out of range; pynccl "
            "reads versions 0 to 3"
        )


def _cai_stream(cai: dict[str, Any], name: str) -> int | None:
    """The producer's stream of a v3 interface (None: absent or None, no order asked).
    1 is the legacy default stream, 2 the per-thread one; 0 is refused (the protocol
    forbids it: it could mean either default stream)."""
    producer = cai.get("stream")
    if producer is None:
        return None
    if type(producer) is not int:
        raise TypeError(
            f"{name}: __cuda_array_interface__ stream {producer!r} is not an int "
            f"({type(producer).__name__}); expected None, 1 (legacy default stream), 2 "
            "(per-thread default stream) or a cudaStream_t handle"
        )
    if producer == 0:
        raise ValueError(
            f"{name}: __cuda_array_interface__ stream=0 is disallowed by the protocol (it "
            "could mean either default stream); expected None, 1 (legacy), 2 (per-thread) "
            "or a cudaStream_t handle"
        )
    if not 0 < producer < 1 << 64:
        raise ValueError(
            f"{name}: __cuda_array_interface__ stream={producer} is out of range; expected a "
            "cudaStream_t handle in [1, 2**64)"
        )
    return producer


def _from_cai(
    obj: Any,
    cai: Any,
    count: Any,
    dtype: Any,
    name: str,
    writable: bool,
    device_of: DeviceGetter,
    stream: int | None = None,
) -> BufferInfo:
    """Read ``cai`` in full; with a ``stream`` entry, the consumer's ``stream`` (None: the
    legacy default stream, as for DLPack) is made to wait for the producer's."""
    try:
        if type(cai) is not dict:
            raise TypeError
        shape = cai["shape"]
        typestr = cai["typestr"]
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError):
        raise TypeError(
            f"{name} has a malformed __cuda_array_interface__ {cai!r}: expected a dict "
            "with 'shape', 'typestr' and 'data': (ptr, readonly)"
        ) from None
    _cai_version(cai, name)
    if not isinstance(ptr, int) or isinstance(ptr, bool):
        raise TypeError(f"{name}: __cuda_array_interface__ data pointer {ptr!r} is not an int")
    if type(typestr) is str and typestr[:1] not in ("<", ">", "|"):
        raise TypeError(
            f"{name}: __cuda_array_interface__ typestr {typestr!r} has no byte order; expected "
            "'<' (little-endian), '>' or '|' (not relevant) first, as in '<f4'"
        )
    dt = _TYPESTR_CACHE.get(typestr) if type(typestr) is str else None
    lanes = 1
    if dt is None:
        part = complex_component(typestr) if type(typestr) is str else None
        if part is not None:
            dt, lanes = part, 2
        else:
            dt = _cai_datatype(obj, typestr, name)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise TypeError(
            f"{name}: __cuda_array_interface__ shape {shape!r} is not a tuple of ints >= 0"
        )
    n = math.prod(shape)
    nbytes = check_extent(n, dt.itemsize * lanes, name)
    strides = cai.get("strides")
    if strides is not None:
        if not isinstance(strides, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in strides
        ):
            raise TypeError(
                f"{name}: __cuda_array_interface__ strides {strides!r} are neither None "
                "nor a tuple of ints"
            )
        if len(strides) != len(shape):  # malformed even when no element is addressed
            raise ValueError(
                f"{name}: __cuda_array_interface__ strides {tuple(strides)} have "
                f"{len(strides)} entries for the {len(shape)}-D shape {tuple(shape)}"
            )
        if n and not _is_c_contiguous(shape, strides, dt.itemsize * lanes):
            raise _strided_error(name, shape, strides, "bytes")
    if cai.get("mask") is not None:
        raise ValueError(f"{name} is a masked array (__cuda_array_interface__ 'mask' is set)")
    if readonly and writable:
        raise ValueError(
            f"{name} is read-only (__cuda_array_interface__ data=({ptr:#x}, True)); "
            "NCCL writes the result into it"
        )
    producer = _cai_stream(cai, name)
    ptr = check_pointer(ptr, f"{name}'s data pointer", nbytes)
    n *= lanes
    if count is not None or dtype is not None:
        n, dt = _override(n, dt, count, dtype, name, lanes)
    device = None if device_of is _no_device else device_of(obj, name)
    if producer is not None and producer != (stream or 1):
        from ..cuda._stream import wait_stream

        wait_stream(stream or 0, producer, device)
    return ptr, n, dt, device


def common_case(
    obj: str,
    writable: str,
    out: tuple[str, str, str],
    ok: list[str],
    ptr_checked: bool = True,
    parts: tuple[str, str, str] = ("shape", "data", "typestr"),
    stream: str = "stream",
) -> list[str]:
    """Source lines reading ``obj``'s ``__cuda_array_interface__`` in its common case — a
    dict describing a 1-D, C-contiguous, unmasked array of fewer than 2**30 elements of a
    typestr seen before, whose data pointer is an int (in [1, 2**63) unless
    ``ptr_checked`` is False: then ``ok`` must check it), which is writable if
    ``writable`` (a source expression, or the constants ``"True"``/``"False"``), whose
    version (if given) is an int from 0 to 3 and whose producer stream (if given) is the
    consumer's, the expression ``stream`` (a handle; None, 0 and 1 are the legacy default
    stream), so that nothing is to be ordered — into the names ``out`` (pointer, element
    count, DataType), then the lines ``ok``; in any other case ``cai`` is None and nothing
    else is bound (the full reading, :func:`_from_cai` through the type's handler, says
    what is wrong, or makes the consumer's stream wait for the producer's).

    The dict's own ``shape``, ``data`` and ``typestr`` objects are bound to the names
    ``parts``, its version (3 when absent) and stream objects to ``v_<ptr>`` and
    ``ps_<ptr>`` (``<ptr>`` the first name of ``out``): the result depends on nothing else
    of the dict but the consumer's stream (see :func:`same_case`).

    The one definition of the common case: the handlers run it (:func:`_make_cai_handler`)
    and the Communicator's generated methods inline it, in the namespace of
    :func:`common_case_globals`.
    """
    ptr, n, dt = out
    shape, data, typestr = parts
    version, pstream = f"v_{ptr}", f"ps_{ptr}"
    # Items are at most 8 bytes (complex typestrs take the full reading): with fewer than
    # 2**30 of them, [ptr, ptr + n items) ends below 2**64. The bound is a one-digit int,
    # which the interpreter compares with a specialised instruction.
    conds = ["type(cai) is dict", f"type({shape}) is tuple", f"type({n}) is int",
             f"0 <= {n} < _CAI_N", f"type({ptr}) is int"]  # fmt: skip
    if ptr_checked:
        conds.append(f"0 < {ptr} < _CAI_P63")
    if writable == "True":
        conds.append("not readonly")
    elif writable != "False":
        conds.append(f"not (readonly and {writable})")
    conds += ["cai.get('strides') is None", "'mask' not in cai",
              _version_ok(version), _stream_ok(pstream, stream)]  # fmt: skip
    return [
        "try:  # a missing key or an odd value: the full reading",
        f"    cai = {obj}.__cuda_array_interface__",
        f"    ({n},) = {shape} = cai['shape']",
        f"    {ptr}, readonly = {data} = cai['data']",
        f"    {dt} = _CAI_TYPESTRS[{typestr} := cai['typestr']]",
        f"    {version} = cai.get('version', 3)",
        f"    {pstream} = cai.get('stream')",
        "except Exception:",
        "    cai = None",
        "if " + " and ".join(conds) + ":",
        *["    " + line for line in ok],
        "else:",
        "    cai = None",
    ]


def _version_ok(version: str) -> str:
    """The source test that the version bound to ``version`` is an int from 0 to 3; the
    common ones (3: CuPy, Numba; 2: PyTorch) by identity first, a few times cheaper than
    the type test (CPython's small ints are single objects; anything else, an int
    subclass included, takes the exact test)."""
    return (f"({version} is _CAI_V3 or {version} is _CAI_V2 or type({version}) is int and "
            f"0 <= {version} <= 3)")  # fmt: skip


def _stream_ok(pstream: str, stream: str) -> str:
    """The source test that the producer's stream bound to ``pstream`` asks for no order
    on the consumer's, whose handle is the expression ``stream`` (None, 0 and 1 all
    legacy): none given, or the same stream (the legacy one's 1 against 0 by identity
    first)."""
    return (f"({pstream} is None or {pstream} is _CAI_V1 and not {stream} or "
            f"type({pstream}) is int and {pstream} == ({stream} or 1))")  # fmt: skip


def same_case(cai: str, parts: tuple[str, str, str, str]) -> str:
    """A source condition: the dict ``cai`` is in the common case whose ``shape``,
    ``data``, ``typestr`` and producer's stream objects were ``parts`` (bound by
    :func:`common_case`: the first three to its ``parts``, the stream to ``ps_<ptr>``;
    remembered since, for the same consumer stream). Those objects being the very same
    ones (tuples of ints, a str, an int or None: immutable), and strides and mask still
    absent, :func:`common_case` would read the same result again, for any object of the
    same array type. (The version, which changes no result, is not read again: a kept
    interface keeps its format.)"""
    shape, data, typestr, pstream = parts
    return (
        f"type({cai}) is dict and {cai}['data'] is {data} and {cai}['shape'] is {shape} and "
        f"{cai}['typestr'] is {typestr} and {cai}.get('strides') is None and "
        f"'mask' not in {cai} and {cai}.get('stream') is {pstream}"
    )


def common_case_globals() -> dict[str, object]:
    """The names :func:`common_case`'s lines use."""
    return {
        "_CAI_TYPESTRS": _TYPESTR_CACHE,
        "_CAI_N": 1 << 30,
        "_CAI_P63": 1 << 63,
        "_CAI_V1": 1,
        "_CAI_V2": 2,
        "_CAI_V3": 3,
    }


#: The types read through a ``__cuda_array_interface__`` handler: each one's device
#: getter; None when its arrays tell no device and keep their interface (the same dict at
#: every read), NO_DEVICE when they tell none but build it afresh (see
#: :func:`inline_device_getter`). Generated code inlines :func:`common_case` for these.
CAI_TYPES: dict[type, DeviceGetter | None] = {}

#: :data:`CAI_TYPES`' getter of arrays that tell no device and build their interface
#: afresh at every read.
NO_DEVICE: DeviceGetter = _no_device


def inline_device_getter(getter: DeviceGetter | None, obj: Any) -> DeviceGetter | None:
    """What :data:`CAI_TYPES` holds for the type of ``obj`` whose handler's device getter
    is ``getter`` (None: its arrays tell no device). The generated methods' interface memo
    remembers only arrays whose type maps to None: those that tell no device and keep
    their interface, as ``obj`` does (an attribute, or a property that caches it); arrays
    that build theirs afresh (CuPy, Numba, PyTorch) could never match a remembered one."""
    if getter is not None:
        return getter
    try:
        kept = obj.__cuda_array_interface__ is obj.__cuda_array_interface__
    except Exception:  # this instance cannot say (a torch CPU tensor): the next may
        kept = False
    return None if kept else NO_DEVICE


def _handler_code() -> Any:
    ok = ["return ptr, n, dt, None if device_of is None else device_of(obj, name)"]
    lines = [
        "def handler(obj, count, dtype, name, writable, stream):",
        "    if count is None and dtype is None:",
        *["        " + line for line in common_case("obj", "writable", ("ptr", "n", "dt"), ok)],
        "    return full(obj, count, dtype, name, writable, stream)",
    ]
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(lines) + "\n", __file__ + ":common_case", "exec"), namespace)
    return namespace["handler"].__code__


_HANDLER_CODE: Any = None


def _make_cai_handler(cls: type, obj: Any) -> tuple[BufferHandler, DeviceGetter | None]:
    """The handler for ``cls`` and its device getter (None: none); the handler runs
    :func:`common_case`, then the full reading."""
    global _HANDLER_CODE
    device_of = _device_getter(cls, obj)
    dlpack = _make_dlpack_handler(cls) if hasattr(cls, "__dlpack__") else None

    def full(
        obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
    ) -> BufferInfo:
        try:
            cai = obj.__cuda_array_interface__
        except (AttributeError, KeyError, TypeError):
            # torch.Tensor has the property on the class but raises AttributeError for
            # CPU tensors and KeyError for bfloat16 ones: DLPack handles the latter and
            # says clearly where the former live.
            if dlpack is not None:
                return dlpack(obj, count, dtype, name, writable, stream)
            if hasattr(type(obj), "__cuda_array_interface__"):
                raise  # the producer's own reason
            raise _not_a_buffer(obj, name) from None
        return _from_cai(obj, cai, count, dtype, name, writable, device_of, stream)

    if _HANDLER_CODE is None:
        _HANDLER_CODE = _handler_code()
    getter = None if device_of is _no_device else device_of
    namespace = {**common_case_globals(), "device_of": getter, "full": full}
    handler: BufferHandler = FunctionType(_HANDLER_CODE, namespace, "handler")
    return handler, getter
