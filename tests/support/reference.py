"""The one numpy reference for what a collective must produce, and the data the tests feed it.

What the loopback libnccl promises (and NCCL computes on one GPU): integers wrap around;
floats fold in rank order ``((x0 op x1) op x2) ...`` in the type's own arithmetic, with
float16 / bfloat16 / float8 computed in float32 and rounded to the type after every step;
``avg`` on integers is the wrapped sum divided by the number of ranks as C divides
(truncating toward zero), on floats a pre-multiplied sum with the scalar ``1/n`` rounded to
the type. Types are given as a :class:`pynccl.DataType` or anything ``numpy.dtype`` takes
(ml_dtypes for bfloat16 and float8); ops by name or by their ``ncclRedOp_t`` value.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any, Union

import ml_dtypes
import numpy as np

from pynccl.dtypes import to_numpy_dtype
from pynccl.enums import DataType

__all__ = [
    "OPS",
    "assert_matches",
    "assert_same",
    "expected",
    "make_input",
    "np_dtype",
    "rank_data",
    "ref_reduce",
    "same_bits",
    "sizes",
    "small_ints",
]

#: Anything the reference takes as a type.
DType = Union[DataType, np.dtype, type, str]

#: ncclRedOp_t values of the built-in ops (nccl.h), by name.
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_OP_NAMES = {code: name for name, code in OPS.items()}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def np_dtype(dt: DType) -> np.dtype[Any]:
    """The numpy dtype of ``dt`` (a DataType through pynccl's map, checked by test_vocabulary)."""
    if isinstance(dt, DataType):
        return np.dtype(to_numpy_dtype(dt))
    return np.dtype(dt)


def _is_int(npdt: np.dtype[Any]) -> bool:
    return npdt.kind in "iu"


def _small_float(npdt: np.dtype[Any]) -> bool:
    """float16, bfloat16 and the float8s: computed in float32, rounded after every step."""
    return not _is_int(npdt) and npdt.itemsize <= 2


def _random_bytes(rng: np.random.Generator, n: int, npdt: np.dtype[Any]) -> np.ndarray:
    raw = rng.integers(0, 256, size=n * npdt.itemsize, dtype=np.uint8)
    return raw.view(npdt)


def rank_data(seed: int, rank: int, n: int, dt: DType, purpose: str) -> np.ndarray:
    """Rank ``rank``'s input of ``n`` elements of ``dt``, the same in every process.

    ``purpose``: ``"bytes"`` (any bit pattern: data movement only), or a reduction
    op; integers then take any value (to wrap around), floats values that keep the
    result finite for up to 8 ranks while still rounding.
    """
    npdt = np_dtype(dt)
    code = int(dt) if isinstance(dt, DataType) else zlib.crc32(npdt.name.encode())
    rng = np.random.default_rng([seed, rank, n, code, zlib.crc32(purpose.encode())])
    if purpose == "bytes" or _is_int(npdt):
        return _random_bytes(rng, n, npdt)
    if purpose == "prod":
        mag = rng.uniform(0.5, 1.9, size=n) * rng.choice([-1.0, 1.0], size=n)
    else:
        scale = 4.0 if npdt.itemsize == 1 else 100.0
        mag = rng.normal(0.0, scale, size=n)
    return mag.astype(np.float32).astype(npdt)


def _fold(
    inputs: Sequence[np.ndarray], step: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> np.ndarray:
    acc = inputs[0].copy()
    for x in inputs[1:]:
        acc = step(acc, x)
    return acc


def ref_reduce(
    inputs: Sequence[np.ndarray],
    dt: DType | None = None,
    op: str | int = "sum",
    scalar: float | None = None,
) -> np.ndarray:
    """``inputs[0] op inputs[1] op ...`` as the loopback computes it (module docstring).

    ``dt``: the element type (default: the inputs'). ``op="premulsum"`` is
    sum(scalar * x); ``avg`` on floats is premulsum with 1/n.
    """
    n = len(inputs)
    npdt = inputs[0].dtype if dt is None else np_dtype(dt)
    if not isinstance(op, str):
        op = _OP_NAMES[int(op)]
    if _is_int(npdt):
        u = _UNSIGNED[npdt.itemsize]
        xs = [x.view(u) for x in inputs]
        if op in ("max", "min"):
            f = np.maximum if op == "max" else np.minimum
            return _fold(list(inputs), lambda a, b: f(a, b))
        if op == "sum":
            return _fold(xs, lambda a, b: a + b).view(npdt)
        if op == "prod":
            return _fold(xs, lambda a, b: a * b).view(npdt)
        if op == "premulsum":
            sc = np.array([scalar], dtype=npdt).view(u)[0]
            return _fold([x * sc for x in xs], lambda a, b: a + b).view(npdt)
        if op == "avg":
            # NCCL's SumPostDiv: the wrapped sum in the type, divided by the number of
            # ranks as C divides (truncating toward zero), in Python ints.
            total = _fold(xs, lambda a, b: a + b).view(npdt)
            quot = [int(v) // n if v >= 0 else -(-int(v) // n) for v in total.tolist()]
            return np.array(quot, dtype=npdt)
        raise ValueError(f"no integer reference for op {op!r}")
    if op == "avg":
        op, scalar = "premulsum", 1.0 / n
    if _small_float(npdt):
        dec: Callable[[np.ndarray], np.ndarray] = lambda a: a.astype(np.float32)  # noqa: E731
        enc: Callable[[np.ndarray], np.ndarray] = lambda f: f.astype(npdt)  # noqa: E731
    else:
        dec = enc = lambda a: a
    with np.errstate(all="ignore"):
        if op == "sum":
            return _fold(list(inputs), lambda a, b: enc(dec(a) + dec(b)))
        if op == "prod":
            return _fold(list(inputs), lambda a, b: enc(dec(a) * dec(b)))
        if op in ("max", "min"):

            def pick(a: np.ndarray, b: np.ndarray) -> np.ndarray:
                fa, fb = dec(a), dec(b)
                take = (fb > fa if op == "max" else fb < fa) | np.isnan(fb)
                return np.where(take, b, a)

            return _fold(list(inputs), pick)
        if op == "premulsum":
            # The scalar stored in the type (C: double for float64, else (float)v then
            # rounded to the type), then used in the type's arithmetic.
            wide = np.float64(scalar) if npdt.itemsize == 8 else np.float32(scalar)
            sc = dec(np.array([wide], dtype=npdt))[0]
            first = enc(dec(inputs[0]) * sc)
            if _small_float(npdt):
                terms = [enc(dec(x) * sc) for x in inputs[1:]]
            else:
                terms = [x * sc for x in inputs[1:]]
            return _fold([first, *terms], lambda a, b: enc(dec(a) + dec(b)))
    raise ValueError(f"no float reference for op {op!r}")


def small_ints(seed: int, rank: int, count: int, dtype: Any = np.float32) -> np.ndarray:
    """Rank ``rank``'s ``count`` inputs: integers below 100 in magnitude, as ``dtype``. Float
    sums of them are exact in any order (up to 2**24 / 100 ranks), so numpy's sum is the
    reference whatever order a collective adds them in."""
    return np.random.default_rng([seed, rank, count]).integers(-100, 100, count).astype(dtype)


# --- the C collectives' results (raw ctypes tests: nccl.h's names) -------------------------------


def make_input(dtype: DType, count: int, rank: int, seed: int) -> np.ndarray:
    """Deterministic input of the raw tests for ``rank``: full-range integers (to exercise
    wrap-around); for the small float types, values that every op keeps exact and finite
    (so that the 1-ulp tolerance of :func:`assert_matches` is never needed in practice)."""
    rng = np.random.default_rng(seed * 1009 + rank)
    dt = np_dtype(dtype)
    if _is_int(dt):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, endpoint=True, dtype=dt)
    if _small_float(dt):
        choices = np.array([-2.0, -1.5, -1.0, -0.5, 0.25, 0.5, 1.0, 1.5, 2.0])
        return rng.choice(choices, size=count).astype(dt)
    return rng.standard_normal(count).astype(dt)


def expected(
    kind: str,
    sends: Sequence[np.ndarray],
    count: int,
    op: str | int,
    root: int,
    rank: int,
    scalar: Any = None,
) -> np.ndarray | None:
    """What ``rank`` receives from ``nccl<kind>``; None when it receives nothing (off-root
    Reduce/Gather). ``scalar`` given: the op is a PreMulSum of it (whatever ``op`` says)."""
    red = "premulsum" if scalar is not None else op

    def reduce(arrays: Sequence[np.ndarray]) -> np.ndarray:
        return ref_reduce(arrays, None, red, scalar)

    if kind == "AllReduce":
        return reduce(sends)
    if kind in ("Broadcast", "Bcast"):
        return sends[root]
    if kind == "Reduce":
        return reduce(sends) if rank == root else None
    if kind == "AllGather":
        return np.concatenate(sends)
    if kind == "ReduceScatter":
        return reduce([s[rank * count : (rank + 1) * count] for s in sends])
    if kind == "AlltoAll":
        return np.concatenate([s[rank * count : (rank + 1) * count] for s in sends])
    if kind == "Gather":
        return np.concatenate(sends) if rank == root else None
    if kind == "Scatter":
        return sends[root][rank * count : (rank + 1) * count]
    raise ValueError(f"unknown collective {kind!r}")


def sizes(kind: str, count: int, n: int) -> tuple[int, int]:
    """(send elements, receive elements) per rank of ``nccl<kind>`` over ``n`` ranks."""
    return {
        "AllGather": (count, n * count),
        "ReduceScatter": (n * count, count),
        "AlltoAll": (n * count, n * count),
        "Gather": (count, n * count),
        "Scatter": (n * count, count),
    }.get(kind, (count, count))


# --- comparing ------------------------------------------------------------------------------------


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Element-wise identical bit patterns (any NaN equals any NaN)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    u = _UNSIGNED[got.dtype.itemsize]
    equal = got.view(u) == want.view(u)
    if got.dtype.kind not in "iu" and not equal.all():
        with np.errstate(invalid="ignore"):
            equal |= np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
    return bool(equal.all())


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """``got`` has exactly ``want``'s bits (any NaN equals any NaN)."""
    if same_bits(got, want):
        return
    u = _UNSIGNED[want.dtype.itemsize]
    bad = np.flatnonzero(got.view(u) != want.view(u)) if got.shape == want.shape else []
    first = int(bad[0]) if len(bad) else -1
    detail = (
        f"{len(bad)} of {want.size} elements differ; first at [{first}]: "
        f"got {got[first]!r}, expected {want[first]!r}"
        if first >= 0
        else f"got shape {got.shape} {got.dtype}, expected {want.shape} {want.dtype}"
    )
    raise AssertionError(f"{what}: {detail}")


def assert_matches(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Integers and float32/64 exactly; half, bfloat16 and float8 within one unit in the
    last place of the type (numpy's SIMD float16 may round directly, not via float)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype.kind in "iu" or got.dtype.itemsize >= 4:
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    eps = float(ml_dtypes.finfo(got.dtype).eps)
    tiny = float(ml_dtypes.finfo(got.dtype).smallest_subnormal)
    np.testing.assert_allclose(g, w, rtol=eps, atol=tiny, err_msg=what)


#: numpy dtype -> the NCCL type it must map to (written out, not derived).
NUMPY_TYPES = [
    (np.int8, DataType.INT8),
    (np.uint8, DataType.UINT8),
    (np.int32, DataType.INT32),
    (np.uint32, DataType.UINT32),
    (np.int64, DataType.INT64),
    (np.uint64, DataType.UINT64),
    (np.float16, DataType.FLOAT16),
    (np.float32, DataType.FLOAT32),
    (np.float64, DataType.FLOAT64),
]
#: ml_dtypes' types -> theirs.
ML_TYPES = [
    (ml_dtypes.bfloat16, DataType.BFLOAT16),
    (ml_dtypes.float8_e4m3fn, DataType.FLOAT8_E4M3),
    (ml_dtypes.float8_e5m2, DataType.FLOAT8_E5M2),
]
