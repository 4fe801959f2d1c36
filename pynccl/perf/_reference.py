"""Host reference data for ``-c``: deterministic per-rank inputs and what each rank should
receive, computed with numpy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..enums import DataType
from ._sweep import Collective, Counts
from ._traffic import Traffic

# --------------------------------------------------------------------------------------
# Host reference data (numpy)

_EPS = {
    DataType.FLOAT16: 2.0**-10,
    DataType.BFLOAT16: 2.0**-7,
    DataType.FLOAT32: 2.0**-23,
    DataType.FLOAT64: 2.0**-52,
    DataType.FLOAT8_E4M3: 2.0**-3,
    DataType.FLOAT8_E5M2: 2.0**-2,
}
# Largest n such that every integer in [-n, n] is exact in the type.
_EXACT_INT = {
    DataType.FLOAT16: 2048,
    DataType.BFLOAT16: 256,
    DataType.FLOAT32: 1 << 24,
    DataType.FLOAT64: 1 << 53,
    DataType.FLOAT8_E4M3: 16,
    DataType.FLOAT8_E5M2: 8,
}
_CHUNK = 1 << 22  # elements per host-side piece of a check (bounded host memory)


_PERIOD = 65521  # elements: the inputs repeat with this (prime) period, see _Data


def _hash_indices(np: Any, group: int, m: int) -> Any:
    """Base indices in [0, m) of the ``_PERIOD`` elements of a rank group's pattern: a
    32-bit integer hash (lowbias32) of the element index, reduced by multiply-shift."""
    dt = np.uint32
    z = np.arange(_PERIOD, dtype=dt)
    z *= dt(0x9E3779B1)
    z += dt((0x85EBCA77 * (group + 1) + 0x165667B1) & 0xFFFFFFFF)
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        z ^= z >> dt(shift)
        z *= dt(mul)
    z ^= z >> dt(16)
    z >>= dt(16)
    z *= dt(m)
    z >>= dt(16)
    return z.astype(np.intp)


def _periodic(np: Any, pattern: Any, lo: int, hi: int, out: Any = None) -> Any:
    """Elements ``lo..hi`` of ``pattern`` repeated forever: one rotated period, then
    doubling block copies (memcpy speed, no per-element arithmetic); into ``out``
    (``hi - lo`` elements of the pattern's type) when given."""
    period, n = len(pattern), hi - lo
    start = lo % period
    if out is None:
        out = np.empty(n, dtype=pattern.dtype)
    if start + n <= period:
        out[:] = pattern[start : start + n]
        return out
    first = min(n, period)
    head = min(first, period - start)
    out[:head] = pattern[start : start + head]
    out[head:first] = pattern[: first - head]
    filled = first
    while filled < n:  # out[i + filled] == out[i]: filled is a multiple of the period
        step = min(filled, n - filled)
        out[filled : filled + step] = out[:step]
        filled += step
    return out


class _Data:
    """Deterministic per-rank inputs and their numpy references.

    Rank ``r``'s send buffer repeats a pattern of ``_PERIOD`` (a prime) elements;
    element ``i`` of the pattern is ``table[(b_g(i) + o + rep) % m]``, where ranks come
    in groups ``g = r // size`` of ``size < m`` ranks (``o = r % size``), ``b_g`` is a
    hash of ``(g, i)`` and ``rep`` numbers the check. So any slice of any rank's data
    can be produced on its own (a rank computes only what it checks), by copying, and
    stale data from an earlier check never passes; the reduction over the ranks is a
    pattern too, computed once per check from a table of ``m`` entries per group. A
    misplaced block is caught unless it moved by a multiple of the prime period.
    Values are small integers (powers of two for ``prod``), exact in every type, so
    float results are exact (compared bit for bit) wherever the sums stay within the
    type's integer range, and within a stated tolerance elsewhere (float averages, fp8
    across many ranks). Integer ``avg`` is NCCL's: the sum divided by the ranks,
    truncated toward zero.
    """

    def __init__(self, np: Any, dtype: DataType, op: str | None, nranks: int, rep: int) -> None:
        from ..dtypes import to_numpy_dtype

        self.np = np
        self.dtype = dtype
        self.op = op
        self.nranks = nranks
        self.rep = rep
        self.np_dtype = to_numpy_dtype(dtype)
        self.bits = np.dtype(f"u{dtype.itemsize}")
        scale_max = 2 if op == "mulsum" else 1
        if op == "prod":
            self.table = [-1.0, 1.0, 2.0, 0.5] if nranks <= 8 else [-1.0, 1.0]
            if dtype.is_integer:
                self.table = [1.0, 2.0, 3.0] if dtype in _UNSIGNED else [-2.0, -1.0, 1.0, 2.0]
        else:
            k = 8
            if dtype.is_float and op in ("sum", "avg", "mulsum"):
                k = max(1, min(8, _EXACT_INT[dtype] // (nranks * scale_max)))
            if dtype.is_integer and op == "avg":  # no wrap-around before the division
                top = (1 << (8 * dtype.itemsize - (0 if dtype in _UNSIGNED else 1))) - 1
                k = max(1, min(8, top // nranks))
            low = 0 if dtype in _UNSIGNED else -k
            self.table = [float(v) for v in range(low, k + 1)]
        self.m = len(self.table)
        self.group = max(1, self.m // 2)  # < m ranks per group: the sums are not constant
        self.vmax = max(abs(v) for v in self.table) * scale_max
        # Float results are exact where every partial sum is an integer the type holds.
        self.exact = dtype.is_integer or (
            op != "avg" and (op == "prod" or self.vmax * nranks <= _EXACT_INT[dtype])
        )
        self.values_table = np.array(self.table, dtype=np.float64).astype(self.np_dtype)
        self._patterns: dict[int, Any] = {}
        self._reference: Any = None

    def _pattern(self, rank: int) -> Any:
        """One period of ``rank``'s input, in the element type."""
        pattern = self._patterns.get(rank)
        if pattern is None:
            shift = (rank % self.group + self.rep) % self.m
            table = self.np.roll(self.values_table, -shift)
            pattern = table.take(_bases(self.np, rank // self.group, self.m))
            self._patterns[rank] = pattern
        return pattern

    def _fold(self, acc: Any, x: Any) -> Any:
        np = self.np
        if self.op in ("sum", "avg", "mulsum"):
            return np.add(acc, x, out=acc)
        if self.op == "prod":
            return np.multiply(acc, x, out=acc)
        if self.op == "max":
            return np.maximum(acc, x, out=acc)
        return np.minimum(acc, x, out=acc)

    def _reduced(self) -> Any:
        """One period of the op over every rank: in the element type for integers
        (wrapping as the hardware does), else in float64 (then in the element type
        where that is exact)."""
        if self._reference is not None:
            return self._reference
        np = self.np
        acc = None
        for r in range(self.nranks):
            x = self._pattern(r)
            x = x.copy() if self.dtype.is_integer else x.astype(np.float64)
            if self.op == "mulsum":
                x = x * np.array(_mulsum_scale(r), dtype=x.dtype)
            acc = x if acc is None else self._fold(acc, x)
        assert acc is not None
        n = self.nranks
        if self.dtype.is_integer and self.op == "avg":  # NCCL's: truncated toward zero
            wide = acc.astype(np.int64)
            acc = (np.sign(wide) * (np.abs(wide) // n)).astype(self.np_dtype)
        elif self.op == "avg":
            acc = acc / n
        if self.exact and not self.dtype.is_integer:
            acc = acc.astype(self.np_dtype)
        self._reference = acc
        return acc

    def values(self, rank: int, lo: int, hi: int, out: Any = None) -> Any:
        """Elements ``lo..hi`` of ``rank``'s send buffer, in the element type (written
        into ``out`` when given)."""
        return _periodic(self.np, self._pattern(rank), lo, hi, out)

    def reduce(self, lo: int, hi: int, out: Any = None) -> tuple[Any, float | None]:
        """op over every rank of elements ``lo..hi``: (reference, tolerance or None if exact);
        an exact reference is written into ``out`` when given (else float64, new)."""
        ref = _periodic(self.np, self._reduced(), lo, hi, out if self.exact else None)
        if self.exact:
            return ref, None
        # Rounding of each partial result, in any reduction order.
        n = self.nranks
        return ref, _EPS[self.dtype] * (n + 2) * n * self.vmax

    def compare(self, got: Any, expected: Any, tol: float | None) -> int:
        """Number of elements of ``got`` that differ from ``expected`` (beyond ``tol``)."""
        np = self.np
        if tol is None:  # exact: compare the bits (also right for -0.0 and NaN payloads)
            return int(np.count_nonzero(got.view(self.bits) != expected.view(self.bits)))
        diff = np.abs(got.astype(np.float64) - expected)
        return int(np.count_nonzero(~(diff <= tol)))  # NaN counts as wrong


_BASES: dict[tuple[int, int], Any] = {}


def _bases(np: Any, group: int, m: int) -> Any:
    """:func:`_hash_indices`, cached for the process (a few KiB per group and table size)."""
    key = (group, m)
    have = _BASES.get(key)
    if have is None:
        if len(_BASES) > 256:
            _BASES.clear()
        have = _BASES[key] = _hash_indices(np, group, m)
    return have


_UNSIGNED = frozenset({DataType.UINT8, DataType.UINT32, DataType.UINT64})


def _mulsum_scale(rank: int) -> int:
    """The ``mulsum`` (PreMulSum) scalar of ``rank``: each rank scales its own input by
    its own scalar, as in NCCL; powers of two keep the sums exact."""
    return 2 if rank % 2 else 1


_Expect = Callable[[int, int, Any], "tuple[Any, float | None]"]


def _expected(
    coll: Collective,
    data: _Data,
    rank: int,
    root: int,
    c: Counts,
    traffic: Traffic | None = None,
) -> _Expect | None:
    """What ``rank`` should receive: a function giving elements ``lo..hi`` of its result
    (and the tolerance, None for exact), so big results are checked a chunk at a time,
    written into its third argument where the result is exact (a reused host buffer of
    ``hi - lo`` elements); ``None`` where the result is undefined (reduce and gather off
    the root). ``traffic``: alltoallv's pattern (by default its generated one)."""
    n, p, name = data.nranks, c.param, coll.name

    def blocks(source: Callable[[int], tuple[int, int]]) -> _Expect:
        # A result made of n blocks of p elements; block j is elements a..a+p of rank
        # source(j)[0]'s input, where a = source(j)[1].
        def expect(lo: int, hi: int, out: Any) -> tuple[Any, float | None]:
            at = 0
            while lo < hi:
                j, a = divmod(lo, p)
                b = min(p, a + hi - lo)
                who, first = source(j)
                data.values(who, first + a, first + b, out[at : at + b - a])
                at += b - a
                lo += b - a
            return out, None

        return expect

    if name in ("all_reduce", "reduce"):
        if name == "reduce" and rank != root:
            return None
        return data.reduce
    if name == "reduce_scatter":
        return lambda lo, hi, out: data.reduce(rank * p + lo, rank * p + hi, out)
    if name == "broadcast":
        return lambda lo, hi, out: (data.values(root, lo, hi, out), None)
    if name == "scatter":
        return lambda lo, hi, out: (data.values(root, rank * p + lo, rank * p + hi, out), None)
    if name == "sendrecv":  # from the previous rank of the ring
        return lambda lo, hi, out: (data.values((rank - 1) % n, lo, hi, out), None)
    if name == "all_to_all":  # block j: rank j's block for this rank
        return blocks(lambda j: (j, rank * p))
    if name == "gather" and rank != root:
        return None
    if name == "alltoallv":
        return _alltoallv_expected(data, rank, c, traffic or Traffic())
    return blocks(lambda j: (j, 0))  # all_gather, hypercube, gather on the root


def _alltoallv_expected(data: _Data, rank: int, c: Counts, traffic: Traffic) -> _Expect:
    """alltoallv's result on ``rank``: for each source in rank order, the part of its
    input it sends this rank (its input after what it sends lower ranks), packed; zeros
    after them up to the buffer's ``c.recv`` elements (the busiest rank's total)."""
    n, size = data.nranks, data.dtype.itemsize
    segments = []  # (first element here, elements, source, first element there)
    at = 0
    for src in range(n):
        sends = traffic.sends(src, n, c.param, size)
        if sends[rank]:
            segments.append((at, sends[rank], src, sum(sends[:rank])))
            at += sends[rank]

    def expect(lo: int, hi: int, out: Any) -> tuple[Any, float | None]:
        out[: hi - lo] = 0
        for first, count, src, offset in segments:
            a, b = max(lo, first), min(hi, first + count)
            if a < b:
                data.values(src, offset + a - first, offset + b - first, out[a - lo : b - lo])
        return out, None

    return expect
