"""alltoallv's traffic: how many bytes each rank sends to each peer, as nccl-tests 2.19's
``alltoallv_perf`` defines it (``src/alltoallv.cu``).

Two modes, chosen by the environment (every rank reads the same):

* Generated (the default). A step of the sweep of ``S`` bytes gives each peer
  ``count = (S / itemsize / n)`` elements rounded down to 16 bytes, and a rank's total
  ``T = count * n * itemsize`` is spread over its peers by their distance in rank order,
  ``d = (dst - src) mod n``: ``(1 - spread) * T / n + spread * d * T / (n(n-1)/2)``
  bytes, rounded down to 16. ``NCCL_TESTS_ALLTOALLV_SPREAD`` (0.0 to 1.0, default 1.0):
  0 is a uniform all-to-all, 1 sends nothing to itself and most to the farthest rank.
  Every rank sends and receives the same total.
* A traffic matrix: ``NCCL_TESTS_ALLTOALLV_MATRIX_FILE`` names a file of whitespace-
  separated byte counts, one row per line, square, at least ``n`` wide (the first ``n``
  rows and columns are used); cell ``[i][j]`` is what rank ``i`` sends rank ``j``, times
  ``NCCL_TESTS_ALLTOALLV_MATRIX_SCALE`` (default 1.0), rounded down to 16 bytes. ``-b``
  must equal ``-e``, and ``-e`` must hold the busiest rank's total.

``NCCL_TESTS_ALLTOALLV_PRINT_SUMMARY=1`` prints each rank's totals and bandwidths after
each row. Unlike nccl-tests, a malformed value is refused rather than ignored.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from ._sweep import Counts, PerfError
from ._tests_env import finite_float

ENV_SPREAD = "NCCL_TESTS_ALLTOALLV_SPREAD"
ENV_MATRIX = "NCCL_TESTS_ALLTOALLV_MATRIX_FILE"
ENV_SCALE = "NCCL_TESTS_ALLTOALLV_MATRIX_SCALE"
ENV_SUMMARY = "NCCL_TESTS_ALLTOALLV_PRINT_SUMMARY"


def _cell(text: str) -> float:
    """One matrix value, as C's strtod reads it (decimal, or hexadecimal with 0x)."""
    try:
        return float(text)
    except ValueError:
        body = text.lstrip("+-")
        if body[:2].lower() != "0x":
            raise
        value = float.fromhex(body)
        return -value if text.startswith("-") else value


def read_matrix(path: str, scale: float = 1.0) -> list[list[int]]:
    """The traffic matrix in ``path``: bytes per (sender, receiver), scaled, rounded down
    to 16. Raises :class:`PerfError` naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise PerfError(f"{ENV_MATRIX}={path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise PerfError(f"{ENV_MATRIX}={path}: not a text file") from None
    rows: list[list[int]] = []
    for lineno, line in enumerate(lines, 1):
        cells = line.split()
        if not cells:
            continue  # blank lines separate nothing (nccl-tests skips them too)
        row = []
        for col, text in enumerate(cells):
            try:
                value = _cell(text)
            except ValueError:
                raise PerfError(
                    f"{ENV_MATRIX}={path}: line {lineno}, column {col + 1}: {text!r} is not "
                    "a number of bytes"
                ) from None
            if not math.isfinite(value) or value < 0:
                raise PerfError(
                    f"{ENV_MATRIX}={path}: line {lineno}, column {col + 1}: {text!r}; expected "
                    "a finite number of bytes >= 0"
                )
            row.append(int(value * scale) & ~15)  # 16-byte aligned, as the other tests
        if rows and len(row) != len(rows[0]):
            raise PerfError(
                f"{ENV_MATRIX}={path}: line {lineno} has {len(row)} values, the first row "
                f"{len(rows[0])}: the matrix must be square"
            )
        rows.append(row)
    if not rows:
        raise PerfError(f"{ENV_MATRIX}={path}: the file is empty")
    if len(rows) != len(rows[0]):
        raise PerfError(
            f"{ENV_MATRIX}={path}: {len(rows)} rows of {len(rows[0])} values: the matrix "
            "must be square"
        )
    return rows


class Traffic:
    """alltoallv's per-peer byte counts, generated or from a matrix (see the module)."""

    __slots__ = ("matrix", "path", "scale", "spread", "summary")

    def __init__(
        self,
        spread: float = 1.0,
        matrix: list[list[int]] | None = None,
        *,
        path: str | None = None,
        scale: float = 1.0,
        summary: bool = False,
    ) -> None:
        if not 0.0 <= spread <= 1.0:
            raise PerfError(f"{ENV_SPREAD}={spread:g}: expected 0.0 (uniform) to 1.0")
        self.spread = spread
        self.matrix = matrix
        self.path = path
        self.scale = scale
        self.summary = summary

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Traffic:
        """The pattern ``NCCL_TESTS_ALLTOALLV_*`` asks for (the matrix file read now)."""
        env = os.environ if environ is None else environ
        spread = finite_float(ENV_SPREAD, env[ENV_SPREAD]) if env.get(ENV_SPREAD) else 1.0
        scale = finite_float(ENV_SCALE, env[ENV_SCALE]) if env.get(ENV_SCALE) else 1.0
        if scale < 0:
            raise PerfError(f"{ENV_SCALE}={env[ENV_SCALE]}: expected a scale >= 0")
        summary = False
        if env.get(ENV_SUMMARY):
            try:
                summary = int(env[ENV_SUMMARY], 10) != 0
            except ValueError:
                raise PerfError(f"{ENV_SUMMARY}={env[ENV_SUMMARY]!r}: expected 0 or 1") from None
        path = env.get(ENV_MATRIX) or None
        matrix = None if path is None else read_matrix(path, scale)
        return cls(spread, matrix, path=path, scale=scale, summary=summary)

    @property
    def generated(self) -> bool:
        return self.matrix is None

    def peer_bytes(self, src: int, dst: int, nranks: int, total_bytes: int) -> int:
        """Bytes ``src`` sends ``dst`` when each rank sends ``total_bytes`` in all
        (generated; a matrix ignores ``total_bytes``)."""
        if self.matrix is not None:
            return self.matrix[src][dst]
        if nranks == 1:
            return total_bytes & ~15
        distance = (dst - src + nranks) % nranks
        pairs = nranks * (nranks - 1) // 2
        uniform = total_bytes / nranks
        weighted = distance * total_bytes / pairs
        # The same double arithmetic as nccl-tests, truncated, then 16-byte aligned.
        return int((1.0 - self.spread) * uniform + self.spread * weighted) & ~15

    def sends(self, rank: int, nranks: int, param: int, itemsize: int) -> list[int]:
        """Elements ``rank`` sends each peer, in peer order, for ``param`` per peer."""
        total = param * nranks * itemsize
        return [self.peer_bytes(rank, r, nranks, total) // itemsize for r in range(nranks)]

    def recvs(self, rank: int, nranks: int, param: int, itemsize: int) -> list[int]:
        """Elements ``rank`` receives from each peer, in peer order."""
        total = param * nranks * itemsize
        return [self.peer_bytes(r, rank, nranks, total) // itemsize for r in range(nranks)]

    def counts_of(self, param: int, itemsize: int, nranks: int) -> Counts:
        """Counts for ``param`` elements per peer: the buffers hold the busiest rank's
        send and receive totals (nccl-tests' AlltoAllvComputeMaxCounts)."""
        if self.generated:  # symmetric: every rank's totals are rank 0's
            most_sent = most_received = sum(self.sends(0, nranks, param, itemsize))
        else:
            most_sent = max(sum(self.sends(r, nranks, param, itemsize)) for r in range(nranks))
            most_received = max(sum(self.recvs(r, nranks, param, itemsize)) for r in range(nranks))
        return Counts(most_sent, most_received, param, 0, 0)

    def counts(self, count: int, itemsize: int, nranks: int) -> Counts:
        """Counts for a sweep step of ``count`` elements (a matrix's ``param`` is 0)."""
        param = (count // nranks) & ~(max(16 // itemsize, 1) - 1) if self.generated else 0
        return self.counts_of(param, itemsize, nranks)

    def check(self, nranks: int, minbytes: int, maxbytes: int) -> None:
        """Refuse, before any rank starts, what nccl-tests refuses for a matrix."""
        if self.matrix is None:
            return
        if len(self.matrix) < nranks:
            raise PerfError(
                f"{ENV_MATRIX}={self.path}: a {len(self.matrix)}x{len(self.matrix)} matrix "
                f"cannot describe {nranks} ranks"
            )
        if minbytes != maxbytes:
            raise PerfError(
                f"-b {minbytes} -e {maxbytes}: with {ENV_MATRIX} the sizes come from the "
                "matrix, so -b and -e must be equal (e.g. -b 32M -e 32M)"
            )
        c = self.counts_of(0, 1, nranks)
        need = max(c.send, c.recv)
        if maxbytes < need:
            raise PerfError(
                f"-e {maxbytes}: the matrix in {self.path} has a rank moving {need} bytes; "
                f"-e must be at least {need}"
            )

    def summary_lines(self, nranks: int, param: int, itemsize: int, seconds: float) -> list[str]:
        """nccl-tests' per-rank summary (``NCCL_TESTS_ALLTOALLV_PRINT_SUMMARY``)."""
        total = param * nranks * itemsize
        usec = seconds * 1.0e6
        if self.generated:
            head = (
                f"mode=generated nranks={nranks} total_bytes={total} "
                f"spread={self.spread:.3f} time_usec={usec:.2f}"
            )
        else:
            dim = len(self.matrix or [])
            head = (
                f"mode=matrix nranks={nranks} matrix_dim={dim} scale={self.scale:.3f} "
                f"time_usec={usec:.2f}"
            )
        lines = [f"# {ENV_SUMMARY}: {head}"]
        factor = (nranks - 1) / nranks
        for rank in range(nranks):
            sent = sum(self.peer_bytes(rank, p, nranks, total) for p in range(nranks))
            received = sum(self.peer_bytes(p, rank, nranks, total) for p in range(nranks))
            algbw = max(sent, received) / 1.0e9 / seconds if seconds > 0 else 0.0
            lines.append(
                f"#   rank={rank} send_bytes={sent} recv_bytes={received} "
                f"alg_bw={algbw:.2f} bus_bw={algbw * factor:.2f}"
            )
        return lines
