"""Fuzzing pynccl._adapt.as_buffer with malformed protocol objects (run by test_adapt_fuzz.py
in a child process, so that a crash is a failed test and not a dead pytest).

Each case builds a ``__cuda_array_interface__`` dict or a DLPack capsule (with ctypes, from
tests/support/producers.py) whose fields hypothesis picks from valid values, edge values and
garbage, and asserts what as_buffer promises: either a result that is a usable
``(ptr, count, DataType, device)`` whose byte range lies below 2**64, or ``TypeError`` /
``ValueError`` naming the buffer. Anything else, and any crash, fails.

The expectations are written from dlpack.h and the CUDA array interface, not from pynccl:
which (code, bits) pairs NCCL can move, what a C-contiguous layout is, where 2**64 lies.
"""

from __future__ import annotations

import ctypes
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

# Run as a script: tests/ (for the support package) and the repository importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import support.producers as P
from pynccl import DataType
from pynccl._adapt import as_buffer

NAME = "fuzzbuf"
U64 = 1 << 64
# (DLPack code, bits) -> bytes per element for the pairs NCCL can move (dlpack.h; complex as
# two floats). Written out independently of pynccl's table.
DL_OK = {
    (0, 8): 1,
    (1, 8): 1,
    (0, 32): 4,
    (1, 32): 4,
    (0, 64): 8,
    (1, 64): 8,
    (2, 16): 2,
    (2, 32): 4,
    (2, 64): 8,
    (4, 16): 2,
    (10, 8): 1,
    (12, 8): 1,
    (5, 32): 4,
    (5, 64): 8,
    (5, 128): 16,
}
TYPESTR_OK = {
    "|i1": 1,
    "|u1": 1,
    "<i4": 4,
    "<u4": 4,
    "<i8": 8,
    "<u8": 8,
    "<f2": 2,
    "<f4": 4,
    "<f8": 8,
    "<c8": 8,
    "<c16": 16,
}

SETTINGS = settings(
    max_examples=int(sys.argv[1]) if len(sys.argv) > 1 else 200,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)

ints64 = st.one_of(
    st.integers(-3, 3),
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.sampled_from([1 << 31, 1 << 32, 1 << 61, 1 << 62, (1 << 63) - 1, -(1 << 63)]),
)
any_int = st.one_of(ints64, st.sampled_from([U64 - 1, U64, U64 + 5, -1, 1 << 100]))
garbage = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.just(object())
)


def check_result(result: Any, elem: int | None = None) -> None:
    """A value as_buffer returned must be usable as is by a C call."""
    ptr, n, dt, device = result
    assert type(ptr) is int and type(n) is int and type(dt) is DataType, result
    assert 0 <= ptr < U64 and 0 <= n < U64, result
    assert ptr + n * dt.itemsize <= U64, result
    assert n == 0 or ptr != 0, result
    assert device is None or (type(device) is int and device >= 0), result


def check_refusal(exc: BaseException) -> None:
    """Refused as promised: TypeError/ValueError naming the buffer, or for a bad count=,
    the count (in _limits.check_count's words, the same for every buffer)."""
    assert type(exc) in (TypeError, ValueError), repr(exc)
    text = str(exc)
    assert NAME in text or text.startswith(("count=", "count must be")), repr(exc)


OUTCOMES: Counter[str] = Counter()  # "accepted" / exception type, per fuzz run


def call(obj: Any, **kw: Any) -> Any:
    try:
        result = as_buffer(obj, name=NAME, **kw)
    except Exception as exc:
        check_refusal(exc)
        OUTCOMES[type(exc).__name__] += 1
        return None
    check_result(result)
    OUTCOMES["accepted"] += 1
    return result


# --- __cuda_array_interface__ ------------------------------------------------------------

shapes = st.one_of(
    st.lists(st.one_of(st.integers(0, 6), any_int), max_size=4).map(tuple),
    st.lists(st.integers(0, 5), max_size=3),
    garbage,
    st.tuples(st.integers(0, 4), garbage),
)
typestrs = st.one_of(
    st.sampled_from(sorted(TYPESTR_OK)),
    st.sampled_from([">f4", "<V2", "|V1", "<f1", "|b1", "<i2", "<c32", "O", "<f16", ""]),
    garbage,
)
datas = st.one_of(
    st.tuples(any_int, st.booleans()),
    st.tuples(st.integers(1, 1 << 20).map(lambda k: k * 4096), st.booleans()),
    st.tuples(garbage, st.booleans()),
    st.tuples(any_int),
    garbage,
)
strides = st.one_of(
    st.none(), st.lists(st.one_of(st.integers(-8, 64), any_int), max_size=4).map(tuple), garbage
)


class CAI:
    def __init__(self, cai: Any) -> None:
        self.__cuda_array_interface__ = cai


small_shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)
valid_data = st.tuples(st.integers(1, 1 << 20).map(lambda k: k * 4096), st.booleans())
# Each field: a valid value most of the time, else one of the edge or garbage values.
CAI_FIELDS = {
    "shape": (small_shapes, shapes),
    "typestr": (st.sampled_from(sorted(TYPESTR_OK)), typestrs),
    "data": (valid_data, datas),
    "strides": (st.none(), strides),
}


@st.composite
def cai_dicts(draw: Any) -> Any:
    bad = set(draw(st.lists(st.sampled_from([*CAI_FIELDS, "mask", "drop", "type"]), max_size=3)))
    cai: dict[str, Any] = {"version": 3}
    for key, (good, edge) in CAI_FIELDS.items():
        cai[key] = draw(edge if key in bad else good)
    if "mask" in bad:
        cai["mask"] = draw(garbage)
    if "drop" in bad:
        del cai[draw(st.sampled_from(sorted(cai)))]
    if "type" in bad:
        return draw(st.sampled_from([list(cai.items()), None, "cai", 3]))
    return cai


@SETTINGS
@given(cai=cai_dicts(), writable=st.booleans(), count=st.one_of(st.none(), any_int, garbage))
def fuzz_cai(cai: Any, writable: bool, count: Any) -> None:
    result = call(CAI(cai), writable=writable, count=count)
    if result is None or count is not None:
        return
    # Accepted: then the interface was well-formed, and the result is what it describes.
    shape, typestr = cai["shape"], cai["typestr"]
    assert typestr in TYPESTR_OK, cai
    lanes = 2 if typestr[1] == "c" else 1
    assert result[1] == math.prod(shape) * lanes, (cai, result)
    assert result[0] == cai["data"][0] or (result[1] == 0 and cai["data"][0] == 0), (cai, result)
    assert not (writable and cai["data"][1]), cai


# --- DLPack ------------------------------------------------------------------------------

_KEEP: list[Any] = []  # ctypes arrays the current case points into


def _array(values: list[int]) -> int:
    arr = (ctypes.c_int64 * max(len(values), 1))(*values)
    _KEEP.append(arr)
    return ctypes.addressof(arr)


@st.composite
def pointer_to(draw: Any, values: list[int], ndim: int) -> int | None:
    """A shape/strides pointer: NULL, misaligned, running past 2**64, or a real array.

    Never an aligned address of unmapped memory within range: no check short of a system
    call per read can tell that one from a real array, so as_buffer promises nothing there.
    Beyond 64 dimensions nothing may be read at all, so any value will do.
    """
    kind = draw(st.integers(0, 5))
    if ndim > 64 or ndim < 0:
        return draw(st.sampled_from([None, 8, U64 - 8, 0xDEAD0000]))
    if kind == 0:
        return None
    base = _array(values + [0] * (ndim - len(values)))
    if kind == 1:
        return base + draw(st.integers(1, 7))  # misaligned
    if kind == 2 and ndim >= 1:
        return U64 - 8 * ndim + 8  # its last int64 would end past 2**64
    return base


DL_FIELDS = ("ndim", "shape", "strides", "dtype", "data", "offset", "device", "header")


@st.composite
def tensors(draw: Any) -> Any:
    """A DLPack producer whose tensor is valid except for a few fields drawn from edges."""
    _KEEP.clear()
    bad = set(draw(st.lists(st.sampled_from(DL_FIELDS), max_size=3)))
    ndim = draw(st.integers(0, 3))
    if "ndim" in bad:
        ndim = draw(
            st.one_of(
                st.integers(-(1 << 31), (1 << 31) - 1), st.sampled_from([-1, 4, 64, 65, 1 << 30])
            )
        )
    k = max(0, min(ndim, 4))
    extents = draw(st.lists(st.integers(0, 5), min_size=k, max_size=k))
    if "shape" in bad:
        extents = draw(st.lists(st.one_of(st.integers(0, 5), ints64), min_size=k, max_size=k))
    full = extents + [0] * (min(ndim, 64) - len(extents))  # what pointer_to points at
    c_steps = [math.prod(full[i + 1 :]) for i in range(len(full))]
    steps = draw(st.lists(st.one_of(st.integers(-2, 40), ints64), min_size=k, max_size=k))
    shape_p = draw(pointer_to(extents, ndim)) if "shape" in bad else _array(full)
    strides_p = None
    if "strides" in bad:
        strides_p = draw(st.one_of(st.none(), pointer_to(steps, ndim), pointer_to(c_steps, ndim)))
    elif ndim >= 0 and draw(st.booleans()):
        strides_p = _array(c_steps)
    code, bits = draw(st.sampled_from(sorted(DL_OK)))
    lanes = 1
    if "dtype" in bad:
        code, bits = draw(st.integers(0, 255)), draw(st.sampled_from([0, 1, 8, 16, 32, 64, 128]))
        lanes = draw(st.one_of(st.just(1), st.integers(0, 65535)))
    data = draw(st.integers(1, 1 << 20).map(lambda k: k * 256))
    offset = 0
    if "data" in bad:
        data = draw(st.one_of(st.integers(0, U64 - 1), st.sampled_from([0, U64 - 1, U64 - 16])))
    if "offset" in bad:
        offset = draw(st.one_of(st.integers(0, U64 - 1), st.sampled_from([U64 - 1, 1, 256])))
    device = (2, draw(st.integers(0, 3)))
    if "device" in bad:
        device = (
            draw(st.one_of(st.sampled_from([2, 13, 1, 3]), st.integers(-(1 << 31), 99))),
            draw(st.integers(-(1 << 31), (1 << 31) - 1)),
        )
    version, flags = (1, 1), 0
    if "header" in bad:
        version = draw(st.sampled_from([(1, 0), (1, 7), (0, 8), (2, 0)]))
        flags = draw(st.sampled_from([1, 2, 3, U64 - 1]))
    fields = dict(
        full=full,
        ndim=ndim,
        code=code,
        bits=bits,
        lanes=lanes,
        data=data,
        offset=offset,
        device=device,
        bad=sorted(bad),
    )

    def tamper(t: Any) -> None:
        t.ndim = ndim
        t.shape = ctypes.cast(shape_p, ctypes.POINTER(ctypes.c_int64)) if shape_p else None
        t.strides = ctypes.cast(strides_p, ctypes.POINTER(ctypes.c_int64)) if strides_p else None
        t.dtype = P.DLDataType(code, bits, lanes)
        t.data = data or None
        t.byte_offset = offset
        t.device = P.DLDevice(*device)

    fields.update(versioned=draw(st.booleans()), version=version, flags=flags)
    producer = P.DLPackProducer(
        np.zeros(1, np.float32),
        device=device,
        tamper=tamper,
        versioned=fields["versioned"],
        version=version,
        flags=flags,
    )
    return producer, fields


@SETTINGS
@given(case=tensors(), writable=st.booleans())
def fuzz_dlpack(case: Any, writable: bool) -> None:
    producer, f = case
    result = call(producer, writable=writable)
    if result is None:
        return
    # Accepted: every field was one NCCL can use, and the result is what they describe.
    assert (f["code"], f["bits"]) in DL_OK and f["lanes"] == 1, f
    assert f["device"][0] in (2, 13), f
    assert 0 <= f["ndim"] <= 64, f
    if f["versioned"]:  # DLPack 1.x header: no copy, and read-only only for reading
        assert f["version"][0] == 1 and not f["flags"] & 2, f
        assert not (writable and f["flags"] & 1), f
    n = math.prod(f["full"])
    assert result[1] * result[2].itemsize == n * DL_OK[(f["code"], f["bits"])], (f, result)
    if n:
        assert result[0] == f["data"] + f["offset"], (f, result)


# --- raw pointers ------------------------------------------------------------------------


@SETTINGS
@given(
    ptr=any_int,
    count=st.one_of(any_int, garbage, st.integers(0, 1 << 62).map(np.int64)),
    dtype=st.sampled_from(
        [
            "float32",
            "complex64",
            "complex128",
            DataType.UINT8,
            DataType.FLOAT64,
            "int16",
            3,
            True,
            None,
        ]
    ),
)
def fuzz_raw(ptr: int, count: Any, dtype: Any) -> None:
    call(ptr, count=count, dtype=dtype)


if __name__ == "__main__":
    # One line of JSON per fuzz: how many cases were accepted and refused, by type.
    for fuzz in (fuzz_cai, fuzz_dlpack, fuzz_raw):
        OUTCOMES.clear()
        fuzz()
        print(json.dumps({"fuzz": fuzz.__name__, **OUTCOMES}), flush=True)
