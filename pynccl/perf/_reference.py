"""Host reference data for ``-c``: deterministic per-rank inputs and what each rank should
receive, computed with numpy."""

from __future__ import annotations

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
_M64 = (1 << 64) - 1
_CHUNK = 1 << 22  # elements per host-side piece of a check (bounded host memory)


class _Data:
    """Deterministic per-rank inputs and their numpy references.

    Element ``i`` of rank ``r``'s send buffer is a hash of ``(r, i, rep)``, so any
    slice of any rank's data can be produced on its own (a rank computes only what
    it checks), and stale data from an earlier check never passes. Values are
    small integers (powers of two for ``prod``), exact in every type, so float
    results are exact wherever the sums stay within the type's integer range and
    within a stated tolerance elsewhere (averages, fp8 across many ranks).
    """

    def __init__(self, np: Any, dtype: DataType, op: str | None, nranks: int, rep: int) -> None:
        from ..dtypes import to_numpy_dtype

        self.np = np
        self.dtype = dtype
        self.op = op
        self.nranks = nranks
        self.seed = (rep * 0x94D049BB133111EB + 0x2545F4914F6CDD1D) & _M64
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
            low = 0 if dtype in _UNSIGNED else -k
            self.table = [float(v) for v in range(low, k + 1)]
        self.vmax = max(abs(v) for v in self.table) * scale_max
        self.values_table = np.array(self.table, dtype=np.float64).astype(self.np_dtype)

    def values(self, rank: int, lo: int, hi: int) -> Any:
        """Elements ``lo..hi`` of ``rank``'s send buffer, in the element type."""
        np = self.np
        z = np.arange(lo, hi, dtype=np.uint64)
        z *= np.uint64(0x9E3779B97F4A7C15)
        z += np.uint64((self.seed + (rank + 1) * 0xD1B54A32D192ED03) & _M64)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        return self.values_table[z % np.uint64(len(self.table))]

    def reduce(self, lo: int, hi: int) -> tuple[Any, float | None]:
        """op over every rank of elements ``lo..hi``: (reference, tolerance or None if exact)."""
        np = self.np
        n = self.nranks
        if self.dtype.is_integer:
            acc = None
            for r in range(n):
                x = self.values(r, lo, hi)
                if self.op == "mulsum":
                    x = np.multiply(x, np.array(_mulsum_scale(r), dtype=self.np_dtype))
                if acc is None:
                    acc = x.copy()
                elif self.op in ("sum", "mulsum"):
                    np.add(acc, x, out=acc)
                elif self.op == "prod":
                    np.multiply(acc, x, out=acc)
                elif self.op == "max":
                    np.maximum(acc, x, out=acc)
                else:
                    np.minimum(acc, x, out=acc)
            return acc, None
        acc64 = None
        for r in range(n):
            x = self.values(r, lo, hi).astype(np.float64)
            if self.op == "mulsum":
                x *= _mulsum_scale(r)
            if acc64 is None:
                acc64 = x
            elif self.op in ("sum", "avg", "mulsum"):
                acc64 += x
            elif self.op == "prod":
                acc64 *= x
            elif self.op == "max":
                np.maximum(acc64, x, out=acc64)
            else:
                np.minimum(acc64, x, out=acc64)
        assert acc64 is not None
        if self.op == "avg":
            acc64 /= n
        # Rounding of each partial result, in any reduction order.
        tol = _EPS[self.dtype] * (n + 2) * n * self.vmax
        return acc64, tol

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
