"""The DLPack handler's fast reading against its full reading, case by case.

A type's first export is read in full; later ones take a straight reading for the common
case (a 1-D, contiguous CUDA tensor of a real NCCL type). Each case here is read by a cold
handler (full reading) and by a warm one (fast reading where it applies) and must give the
same result or the same error; accepted cases are also checked against numpy (address,
size) and the type written out here. Cases the fast reading must take are asserted to
skip the full reading, so that the comparison is not vacuous.
"""

from __future__ import annotations

import copy
import ctypes
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from support import producers as P
from support.producers import addr
from support.reference import ML_TYPES, NUMPY_TYPES

from pynccl import DataType
from pynccl._adapt import _dlpack

TYPES = NUMPY_TYPES + ML_TYPES


@pytest.fixture
def full_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the handler's calls of the full capsule reading."""
    seen: list[int] = []
    real = _dlpack._read_capsule

    def counting(*args: Any) -> Any:
        seen.append(1)
        return real(*args)

    monkeypatch.setattr(_dlpack, "_read_capsule", counting)
    yield seen


def fresh_class(base: type = P.DLPackProducer) -> type:
    return type("Fresh" + base.__name__, (base,), {})


def outcome(call: Callable[[], Any]) -> Any:
    try:
        return ("ok", call())
    except Exception as exc:  # the same type and words are what is compared
        # but for addresses of per-export storage (a shape array)
        return (type(exc), re.sub(r"0x[0-9a-f]+", "0x...", str(exc)))


def both(
    make: Callable[[type], Any], *, versioned: bool = True, writable: bool = True,
    stream: int | None = 5,
) -> tuple[Any, Any, Any, Any]:  # fmt: skip
    """(full outcome, fast outcome, producer read in full, producer read warm)."""
    cls = fresh_class()
    cold = _dlpack._make_dlpack_handler(cls)
    warm = _dlpack._make_dlpack_handler(cls)
    # One good export of the same capsule kind teaches `warm` the fast reading.
    warm(cls(np.zeros(3, np.float32), versioned=versioned), None, None, "x", True, None)
    a = make(cls)
    b = copy.copy(a)  # the same array and fields
    b.calls = []
    full = outcome(lambda: cold(a, None, None, "recvbuf", writable, stream))
    fast = outcome(lambda: warm(b, None, None, "recvbuf", writable, stream))
    return full, fast, a, b


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize(("np_type", "expected"), TYPES)
def test_fast_reading_of_every_type(
    np_type: Any, expected: DataType, versioned: bool, full_reads: list[int]
) -> None:
    arr = np.zeros(37, np_type)
    make = lambda c: c(arr, versioned=versioned, device=(P.kDLCUDA, 3))  # noqa: E731
    full, fast, a, b = both(make, versioned=versioned)
    assert full == fast == ("ok", (addr(arr), 37, expected, 3))
    assert full_reads == [1, 1]  # the warm-up's and the cold handler's: not the fast one
    assert a.calls == b.calls == [{"stream": 5, "max_version": (1, 1)}]
    assert a.exported == b.exported == 0  # each capsule released, its deleter called


CASES: dict[str, tuple[Callable[[type], Any], bool]] = {
    # name: (producer from its class, True if the fast reading must take it)
    "byte_offset": (lambda c: c(np.zeros(8, np.float32), byte_offset=64), True),
    "unit stride": (lambda c: c(np.zeros(8, np.float32), strides="always"), True),
    "one element, odd stride": (lambda c: c(np.zeros(1, np.float32), strides=(9,)), True),
    "empty": (lambda c: c(np.zeros(0, np.float32)), True),
    "read-only, written": (lambda c: c(np.zeros(4, np.float32), flags=P.FLAG_READ_ONLY), False),
    "copy": (lambda c: c(np.zeros(4, np.float32), flags=P.FLAG_IS_COPIED), False),
    "DLPack 2.0": (lambda c: c(np.zeros(4, np.float32), version=(2, 0)), False),
    "complex64": (lambda c: c(np.zeros(4, np.complex64)), False),
    "2-D": (lambda c: c(np.zeros((3, 4), np.float32)), True),
    "3-D, C strides given": (lambda c: c(np.zeros((2, 3, 4), np.float32), strides="always"), True),
    "3-D, extent 1 odd stride": (
        lambda c: c(np.zeros((3, 1, 4), np.float32), strides=(4, 77, 1)),
        True,
    ),
    "2-D, zero extent": (lambda c: c(np.zeros((0, 4), np.float32), strides=(9, 9)), True),
    "8-D": (lambda c: c(np.zeros((1, 2, 1, 2, 1, 2, 1, 2), np.float32)), True),
    "9-D": (lambda c: c(np.zeros((1, 2, 1, 2, 1, 2, 1, 2, 1), np.float32)), False),
    "transposed": (lambda c: c(np.zeros((3, 4), np.float32).T), False),
    "2-D, inner stride 2": (lambda c: c(np.zeros((3, 8), np.float32)[:, ::2]), False),
    "0-D": (lambda c: c(np.zeros((), np.float32)), False),
    "strided": (lambda c: c(np.zeros(8, np.float32)[::2]), False),
    "NULL data": (lambda c: c(np.zeros(3, np.float32), null_data=True), False),
    "NULL data, empty": (lambda c: c(np.zeros(0, np.float32), null_data=True), False),
    "managed": (lambda c: c(np.zeros(4, np.float32), device=(P.kDLCUDAManaged, 0)), False),
    "CPU": (lambda c: c(np.zeros(4, np.float32), device=(P.kDLCPU, 0)), False),
    "consumed": (lambda c: c(np.zeros(4, np.float32), capsule_name=P.NAME_USED), False),
    "legacy capsule": (lambda c: c(np.zeros(4, np.float32), versioned=False), False),
    "two lanes": (lambda c: c(np.zeros(4, np.float32), dl_dtype=(P.kDLFloat, 32, 2)), False),
    "bool": (lambda c: c(np.zeros(4, np.bool_), dl_dtype=(P.kDLBool, 8, 1)), False),
    "IntEnum device": (lambda c: c(np.zeros(4, np.float32), device=(IntDev.CUDA, 0)), True),
}


class IntDev:
    """A device type that is an int but not exactly `int` (torch answers an IntEnum)."""

    class _T(int):
        pass

    CUDA = _T(P.kDLCUDA)


def _tamper(**fields: Any) -> Callable[[type], Any]:
    def set_fields(t: Any) -> None:
        for key, value in fields.items():
            if key == "shape_off":  # shift the shape pointer: misaligned
                addr_ = ctypes.cast(t.shape, ctypes.c_void_p).value or 0
                t.shape = ctypes.cast(addr_ + value, ctypes.POINTER(ctypes.c_int64))
            elif key == "strides_off":
                addr_ = ctypes.cast(t.strides, ctypes.c_void_p).value or 0
                t.strides = ctypes.cast(addr_ + value, ctypes.POINTER(ctypes.c_int64))
            elif key == "device_id":
                t.device.device_id = value
            elif key == "device_type":  # the capsule disagrees with __dlpack_device__
                t.device.device_type = value
            elif key == "extent":
                t.shape[0] = value
            else:
                setattr(t, key, value)

    return lambda c: c(np.zeros(4, np.float32), strides="always", tamper=set_fields)


TAMPERED: dict[str, Callable[[type], Any]] = {
    "negative device id": _tamper(device_id=-1),
    "capsule says managed": _tamper(device_type=P.kDLCUDAManaged),
    "capsule says CPU": _tamper(device_type=P.kDLCPU),
    "negative extent": _tamper(extent=-4),
    "2-D, negative extent": lambda c: c(
        np.zeros((2, 2), np.float32), tamper=lambda t: t.shape.__setitem__(1, -2)
    ),
    "2-D, two negative extents": lambda c: c(
        np.zeros((2, 2), np.float32),
        tamper=lambda t: (t.shape.__setitem__(0, -2), t.shape.__setitem__(1, -2)),
    ),
    "2-D, extents overflow": lambda c: c(
        np.zeros((2, 2), np.float32), tamper=lambda t: t.shape.__setitem__(1, 1 << 62)
    ),
    "misaligned shape": _tamper(shape_off=4),
    "misaligned strides": _tamper(strides_off=4),
    "NULL shape": _tamper(shape=None),
    "ends at 2**64": _tamper(data=(1 << 64) - 16),  # accepted by both: 4 x 4 bytes
    "passes 2**64": _tamper(data=(1 << 64) - 8),
    "offset passes 2**64": _tamper(data=(1 << 64) - 8, byte_offset=16),
    "ndim 65": _tamper(ndim=65),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("writable", [True, False])
def test_fast_reading_matches_full(case: str, writable: bool, full_reads: list[int]) -> None:
    make, fast_takes = CASES[case]
    full, fast, a, b = both(make, writable=writable)
    assert fast == full
    assert len(a.calls) == len(b.calls) <= 1  # an export at most, each
    if fast_takes and full[0] == "ok":
        assert full_reads == [1, 1], "the fast reading did not take a common case"
        arr = a.array
        assert full[1] == (addr(arr) + 0, arr.size, DataType.FLOAT32, 0)
    elif case == "CPU":
        assert a.calls == b.calls == []  # refused before any export, as the full reading
    assert a.exported == b.exported == 0


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_fast_reading_matches_full_on_odd_fields(case: str) -> None:
    full, fast, _, _ = both(TAMPERED[case])
    assert fast == full


def test_read_only_read_is_fast(full_reads: list[int]) -> None:
    arr = np.zeros(4, np.float32)
    full, fast, _, _ = both(lambda c: c(arr, flags=P.FLAG_READ_ONLY), writable=False)
    assert full == fast == ("ok", (addr(arr), 4, DataType.FLOAT32, 0))
    assert full_reads == [1, 1]


def test_stream_as_dlpack_spells_it(full_reads: list[int]) -> None:
    # CUDA's handle 0 (legacy default stream) is DLPack's 1; the fast export says so too.
    for stream, asked in ((0, 1), (None, None), (7, 7)):
        _, fast, _, b = both(lambda c: c(np.zeros(4, np.float32)), stream=stream)
        assert fast[0] == "ok" and b.calls == [{"stream": asked, "max_version": (1, 1)}]


@pytest.mark.parametrize("producer", [P.StreamOnlyDLPack, P.BareDLPack])
def test_older_producers_fast(producer: type, full_reads: list[int]) -> None:
    cls = fresh_class(producer)
    handler = _dlpack._make_dlpack_handler(cls)
    arrays = [np.arange(n, dtype=np.int32) for n in (2, 5, 9)]
    objs = [cls(a) for a in arrays]
    got = [handler(o, None, None, "sendbuf", False, 3) for o in objs]
    assert got == [(addr(a), a.size, DataType.INT32, 0) for a in arrays]
    assert full_reads == [1]  # the first export only: the older styles are fast too
    expected = {"stream": 3} if producer is P.StreamOnlyDLPack else {}
    assert all(o.calls == [expected] for o in objs)


def test_failed_export_is_explained_by_the_device() -> None:
    # A type first seen on the GPU, then a CPU instance that refuses stream=: the fast path
    # gives it the full reading's words (asked of __dlpack_device__ before any export).
    cls = fresh_class()
    handler = _dlpack._make_dlpack_handler(cls)
    handler(cls(np.zeros(2, np.float32)), None, None, "x", False, 1)
    cpu = cls(np.zeros(2, np.float32), device=(P.kDLCPU, 0))
    with pytest.raises(ValueError, match=r"sendbuf is a CPU array \(kDLCPU\)"):
        handler(cpu, None, None, "sendbuf", False, 1)
    assert cpu.calls == []


@pytest.mark.parametrize("versioned", [True, False])
def test_capsule_fields_read_as_the_c_api_gives_them(versioned: bool) -> None:
    # The fast reading takes a capsule's pointer and name from its C fields: what it learns
    # from a first export must be what PyCapsule_GetPointer / PyCapsule_GetName give.
    capsule = P.DLPackProducer(np.zeros(3, np.float32), versioned=versioned).__dlpack__(
        max_version=(1, 1)
    )
    name = P.NAME_VERSIONED if versioned else P.NAME_LEGACY
    get_name = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(
        ("PyCapsule_GetName", ctypes.pythonapi)
    )
    assert ctypes.string_at(get_name(capsule)) == name
    assert _dlpack._learn(capsule) == (type(capsule), get_name(capsule), versioned)


def test_other_capsule_layout_reads_every_export_in_full(
    monkeypatch: pytest.MonkeyPatch, full_reads: list[int]
) -> None:
    # Fields that do not read as the C API gives them (another interpreter's layout): never
    # the fast reading, and every export still read right.
    monkeypatch.setattr(_dlpack, "_HEAD", _dlpack._HEAD + 8)
    cls = fresh_class()
    handler = _dlpack._make_dlpack_handler(cls)
    arrays = [np.arange(n, dtype=np.float64) for n in (3, 4, 5)]
    got = [handler(cls(a), None, None, "recvbuf", True, 1) for a in arrays]
    assert got == [(addr(a), a.size, DataType.FLOAT64, 0) for a in arrays]
    assert full_reads == [1, 1, 1]


def test_numpy_capsules_keep_their_name_address() -> None:
    # A real producer's capsules (numpy's own __dlpack__): every export names itself with
    # the same C string, so what the first export teaches holds for the next ones.
    arr = np.zeros(5, np.float32)
    learnt = {_dlpack._learn(arr.__dlpack__(max_version=(1, 1))) for _ in range(3)}
    assert len(learnt) == 1 and None not in learnt
    ((_, address, versioned),) = learnt
    assert versioned and ctypes.string_at(address) == b"dltensor_versioned"
