"""pynccl._limits: the one module of argument rules, checked against ctypes itself.

The oracle for "in range" is whether ctypes carries the value to C unchanged (it wraps
silently otherwise), and numpy/ctypes types stand for the integer-like objects callers pass.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pynccl import _limits as L

edges = st.sampled_from(
    [0, 1, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**63, 2**64 - 1, 2**64, 2**100]
)
ints = st.one_of(st.integers(), edges)


@settings(max_examples=150, deadline=None)
@given(value=ints)
def test_check_count_accepts_exactly_what_size_t_carries(value: int) -> None:
    carried = ctypes.c_size_t(value).value == value
    if carried:
        assert L.check_count(value) == value
        assert L.check_count(np.uint64(value)) == value
    else:
        with pytest.raises(ValueError, match=rf"^count={value} is out of range; expected 0 <="):
            L.check_count(value)


@settings(max_examples=150, deadline=None)
@given(value=ints)
def test_check_c_int_accepts_exactly_what_c_int_carries(value: int) -> None:
    if ctypes.c_int(value).value == value:
        assert L.check_c_int(value, "root") == value
    else:
        with pytest.raises(ValueError, match=rf"^root={value} is out of range"):
            L.check_c_int(value, "root")


@settings(max_examples=150, deadline=None)
@given(value=ints, nbytes=st.one_of(st.integers(0, 64), st.sampled_from([2**63, 2**64])))
def test_check_pointer_range(value: int, nbytes: int) -> None:
    # Accepted iff c_void_p carries the address unchanged, it is not NULL where bytes are
    # needed, and the last byte lies below 2**64.
    carried = ctypes.c_void_p(value).value == (value or None)
    ok = carried and (value != 0 or nbytes == 0) and value + nbytes <= 2**64
    if ok:
        assert L.check_pointer(value, "buf", nbytes) == value
    else:
        with pytest.raises(ValueError, match=r"^buf"):
            L.check_pointer(value, "buf", nbytes)


@pytest.mark.parametrize(
    "bad", [True, False, 1.0, 2.5, np.float64(3.0), "3", None, b"3", 3 + 0j, [1], object()]
)
def test_integers_are_never_bools_floats_or_strings(bad: Any) -> None:
    for call in (
        lambda: L.check_count(bad),
        lambda: L.check_c_int(bad, "rank"),
        lambda: L.check_index(bad, "peer", 4),
        lambda: L.check_pointer(bad, "buf"),
        lambda: L.index_int(bad, "x"),
    ):
        with pytest.raises(TypeError, match=rf"got {type(bad).__name__} "):
            call()


@pytest.mark.parametrize("good", [np.int64(3), np.uint8(3), np.int32(3), ctypes.c_int(3).value])
def test_index_integers_are_ints(good: Any) -> None:
    assert L.check_count(good) == 3 and type(L.check_count(good)) is int
    assert L.check_c_int(good, "rank") == 3
    assert L.check_index(good, "peer", 4) == 3


def test_broken_index_is_a_type_error() -> None:
    class Broken:
        def __index__(self) -> int:
            raise RuntimeError("no")

    with pytest.raises(TypeError, match=r"^count must be a non-negative int, got Broken .*\(no\)"):
        L.check_count(Broken())


def test_check_index_words_its_bound() -> None:
    assert L.check_index(3, "root", 4) == 3
    with pytest.raises(
        ValueError, match=r"^root=4 is out of range; expected 0 <= root < 4 for 4 ranks$"
    ):
        L.check_index(4, "root", 4, "for 4 ranks")
    with pytest.raises(ValueError, match=r"^root=-1 is out of range"):
        L.check_index(-1, "root", 4)


@settings(max_examples=100, deadline=None)
@given(count=st.integers(0, 2**66), itemsize=st.sampled_from([1, 2, 4, 8, 16]))
def test_check_extent(count: int, itemsize: int) -> None:
    if count * itemsize < 2**64:
        assert L.check_extent(count, itemsize, "buf") == count * itemsize
    else:
        with pytest.raises(ValueError, match=rf"^buf spans {count} elements of {itemsize} bytes"):
            L.check_extent(count, itemsize, "buf")


@pytest.mark.parametrize(
    ("value", "exc"),
    [(True, TypeError), ("1", TypeError), (b"1", TypeError), (object(), TypeError),
     (0, ValueError), (-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError)],
)  # fmt: skip
def test_check_timeout_refusals(value: Any, exc: type) -> None:
    with pytest.raises(exc, match=r"^timeout"):
        L.check_timeout(value)


def test_check_timeout_accepts() -> None:
    assert L.check_timeout(None) is None
    assert L.check_timeout(2) == 2.0
    assert L.check_timeout(np.float32(0.5)) == 0.5
