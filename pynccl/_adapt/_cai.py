"""``__cuda_array_interface__`` (v2/v3: CuPy, Numba, PyTorch), and the device an array
reports (``.device`` or ``__dlpack_device__``)."""

from __future__ import annotations

import math

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


_N_MAX = 1 << 30  # elements of at most 8 bytes: [ptr, ptr + n items) ends below 2**64
_P63 = 1 << 63


def _make_cai_handler(cls: type, obj: Any) -> tuple[BufferHandler, DeviceGetter | None]:
    """The handler for ``cls`` and its device getter (None: its arrays tell none).

    The handler reads the interface's common case — a dict describing a 1-D, C-contiguous,
    unmasked array of fewer than 2**30 elements of a typestr seen before, whose data pointer
    is an int in [1, 2**63), writable if it must be, whose version (if given) is 0 to 3 and
    whose producer stream (if given) is the consumer's, so that nothing is to be ordered —
    by value, straight through; anything else (a missing key, an odd value, count= or
    dtype=, another producer stream) gets the full reading, :func:`_from_cai`, which says
    what is wrong or orders the streams. An interface built afresh at every read (CuPy,
    Numba, PyTorch) costs the same as one kept."""
    device_of = _device_getter(cls, obj)
    getter = None if device_of is _no_device else device_of
    dlpack = _make_dlpack_handler(cls) if hasattr(cls, "__dlpack__") else None
    typestrs = _TYPESTR_CACHE

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

    def handler(
        obj: Any, count: Any, dtype: Any, name: str, writable: bool, stream: int | None
    ) -> BufferInfo:
        if count is None and dtype is None:
            try:  # a missing key or an odd value: the full reading says what
                cai = obj.__cuda_array_interface__
                (n,) = shape = cai["shape"]
                ptr, readonly = data = cai["data"]
                dt = typestrs[cai["typestr"]]
                version = cai.get("version", 3)
                producer = cai.get("stream")
                if (
                    type(cai) is dict
                    and type(shape) is tuple
                    and type(data) is tuple
                    and type(n) is int
                    and 0 <= n < _N_MAX
                    and type(ptr) is int
                    and 0 < ptr < _P63
                    and not (readonly and writable)
                    and cai.get("strides") is None
                    and "mask" not in cai
                    and type(version) is int
                    and 0 <= version <= 3
                    and (producer is None or (type(producer) is int and producer == (stream or 1)))
                ):
                    return ptr, n, dt, None if getter is None else getter(obj, name)
            except Exception:
                pass
        return full(obj, count, dtype, name, writable, stream)

    return handler, getter
