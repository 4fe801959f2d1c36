"""Host reference data for ``-c``: deterministic per-rank inputs and what each rank should
receive, computed with numpy."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..enums import DataType
from ._sweep import Collective, Counts

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


_BASE_BUDGET = 1 << 27  # bytes of cached base indices (all groups), see _bases()
_BASE_CAP = 1 << 26  # elements cached per group; beyond this they are hashed per call
_BASES: OrderedDict[tuple[int, int], Any] = OrderedDict()


def _hash_indices(np: Any, group: int, m: int, lo: int, hi: int) -> Any:
    """Base indices in [0, m) of elements ``lo..hi`` of a rank group: a 32-bit integer
    hash (lowbias32) of the element index, reduced to [0, m) by multiply-shift."""
    dt = np.uint32
    if hi <= 1 << 32:
        z = np.arange(lo, hi, dtype=dt)
    else:  # the index modulo 2**32 (a period no check can confuse with a real offset)
        z = np.arange(lo, hi, dtype=np.uint64).astype(dt)
    z *= dt(0x9E3779B1)
    z += dt((0x85EBCA77 * (group + 1) + 0x165667B1) & 0xFFFFFFFF)
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        z ^= z >> dt(shift)
        z *= dt(mul)
    z ^= z >> dt(16)
    z >>= dt(16)
    z *= dt(m)
    z >>= dt(16)
    return z.astype(np.uint8)


def _bases(np: Any, group: int, m: int, lo: int, hi: int) -> Any:
    """:func:`_hash_indices`, cached process-wide (one array per group and table size,
    grown on demand up to ``_BASE_CAP`` elements, least recently used dropped first):
    the hash is computed once per run, not once per check and rank."""
    if hi > _BASE_CAP:
        return _hash_indices(np, group, m, lo, hi)
    key = (group, m)
    have = _BASES.pop(key, None)
    if have is None or len(have) < hi:
        n = min(_BASE_CAP, max(hi, 2 * (0 if have is None else len(have)), 1 << 16))
        start = 0 if have is None else len(have)
        more = _hash_indices(np, group, m, start, n)
        have = more if have is None else np.concatenate((have, more))
    _BASES[key] = have
    total = sum(len(a) for a in _BASES.values())
    while total > _BASE_BUDGET and len(_BASES) > 1:
        total -= len(_BASES.popitem(last=False)[1])
    return have[lo:hi]


class _Data:
    """Deterministic per-rank inputs and their numpy references.

    Element ``i`` of rank ``r``'s send buffer is ``table[(b_g(i) + o + rep) % m]``: ranks
    come in groups ``g = r // size`` of ``size < m`` ranks (``o = r % size``), ``b_g`` is a
    hash of ``(g, i)`` and ``rep`` numbers the check, so any slice of any rank's data
    can be produced on its own (a rank computes only what it checks), stale data from
    an earlier check never passes, and the reduction over the ranks is a function of
    the group hashes alone: a table of ``m`` entries per group, looked up, instead of
    every rank's data regenerated. The hashes are cached, so a check costs a few table
    look-ups per element. Values are small integers (powers of two for ``prod``), exact
    in every type, so float results are exact wherever the sums stay within the type's
    integer range and within a stated tolerance elsewhere (averages, fp8 across many
    ranks). Integer ``avg`` is NCCL's: the sum divided by the ranks, truncated toward 0.
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
        self.values_table = np.array(self.table, dtype=np.float64).astype(self.np_dtype)
        self._rolled: dict[int, Any] = {}
        self._sums = [self._group_table(g) for g in range(-(-nranks // self.group))]

    def _shift(self, rank: int) -> int:
        return (rank % self.group + self.rep) % self.m

    def _table(self, rank: int) -> Any:
        """``T`` with ``T[b]`` = rank's value where its group's base index is ``b``."""
        shift = self._shift(rank)
        table = self._rolled.get(shift)
        if table is None:
            table = self._rolled[shift] = self.np.roll(self.values_table, -shift)
        return table

    def _group_table(self, g: int) -> Any:
        """op over the ranks of group ``g``, for each base index ``b`` in [0, m): in the
        element type for integers (wrapping as the hardware does), else in float64."""
        np = self.np
        acc = None
        for r in range(g * self.group, min(self.nranks, (g + 1) * self.group)):
            x = self._table(r)
            x = x.copy() if self.dtype.is_integer else x.astype(np.float64)
            if self.op == "mulsum":
                x = x * np.array(_mulsum_scale(r), dtype=x.dtype)
            acc = x if acc is None else self._fold(acc, x)
        return acc

    def _fold(self, acc: Any, x: Any) -> Any:
        np = self.np
        if self.op in ("sum", "avg", "mulsum"):
            return np.add(acc, x, out=acc)
        if self.op == "prod":
            return np.multiply(acc, x, out=acc)
        if self.op == "max":
            return np.maximum(acc, x, out=acc)
        return np.minimum(acc, x, out=acc)

    def values(self, rank: int, lo: int, hi: int) -> Any:
        """Elements ``lo..hi`` of ``rank``'s send buffer, in the element type."""
        base = _bases(self.np, rank // self.group, self.m, lo, hi)
        return self._table(rank).take(base)

    def reduce(self, lo: int, hi: int) -> tuple[Any, float | None]:
        """op over every rank of elements ``lo..hi``: (reference, tolerance or None if exact)."""
        np = self.np
        acc = None
        for g, sums in enumerate(self._sums):
            part = sums.take(_bases(np, g, self.m, lo, hi))
            acc = part if acc is None else self._fold(acc, part)
        assert acc is not None
        n = self.nranks
        if self.dtype.is_integer:
            if self.op == "avg":  # NCCL's integer avg: truncated toward zero
                wide = acc.astype(np.int64)
                acc = (np.sign(wide) * (np.abs(wide) // n)).astype(self.np_dtype)
            return acc, None
        if self.op == "avg":
            acc = acc / n
        # Rounding of each partial result, in any reduction order.
        tol = _EPS[self.dtype] * (n + 2) * n * self.vmax
        return acc, tol

    def compare(self, got: Any, expected: Any, tol: float | None) -> int:
        """Number of elements of ``got`` that differ from ``expected`` (beyond ``tol``)."""
        np = self.np
        if tol is None:  # exact: compare the bits (also right for -0.0 and NaN payloads)
            return int(np.count_nonzero(got.view(self.bits) != expected.view(self.bits)))
        diff = np.abs(got.astype(np.float64) - expected)
        return int(np.count_nonzero(~(diff <= tol)))  # NaN counts as wrong


_UNSIGNED = frozenset({DataType.UINT8, DataType.UINT32, DataType.UINT64})


def _mulsum_scale(rank: int) -> int:
    """The ``mulsum`` (PreMulSum) scalar of ``rank``: each rank scales its own input by
    its own scalar, as in NCCL; powers of two keep the sums exact."""
    return 2 if rank % 2 else 1


_Expect = Callable[[int, int], "tuple[Any, float | None]"]


def _expected(coll: Collective, data: _Data, rank: int, root: int, c: Counts) -> _Expect | None:
    """What ``rank`` should receive: a function giving elements ``lo..hi`` of its result
    (and the tolerance, None for exact), so big results are checked a chunk at a time;
    ``None`` where the result is undefined (reduce and gather off the root)."""
    n, p, name = data.nranks, c.param, coll.name

    def blocks(piece: Callable[[int, int, int], Any]) -> _Expect:
        # A result made of n blocks of p elements; block j, elements a..b is piece(j, a, b).
        def expect(lo: int, hi: int) -> tuple[Any, float | None]:
            parts = []
            while lo < hi:
                j, a = divmod(lo, p)
                b = min(p, a + hi - lo)
                parts.append(piece(j, a, b))
                lo += b - a
            return data.np.concatenate(parts), None

        return expect

    if name in ("all_reduce", "reduce"):
        if name == "reduce" and rank != root:
            return None
        return data.reduce
    if name == "reduce_scatter":
        return lambda lo, hi: data.reduce(rank * p + lo, rank * p + hi)
    if name == "broadcast":
        return lambda lo, hi: (data.values(root, lo, hi), None)
    if name == "scatter":
        return lambda lo, hi: (data.values(root, rank * p + lo, rank * p + hi), None)
    if name == "sendrecv":  # from the previous rank of the ring
        return lambda lo, hi: (data.values((rank - 1) % n, lo, hi), None)
    if name == "all_to_all":  # block j: rank j's block for this rank
        return blocks(lambda j, a, b: data.values(j, rank * p + a, rank * p + b))
    if name == "gather" and rank != root:
        return None
    return blocks(lambda j, a, b: data.values(j, a, b))  # all_gather, gather on the root
