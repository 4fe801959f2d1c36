"""nccl-tests' rules: the benchmarked collectives, their counts and bus-bandwidth factors,
and the size sweep."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..comm._spec import COLLECTIVES as _SPEC
from ..comm._spec import Extent, InPlace, Where

if TYPE_CHECKING:
    from ._traffic import Traffic

_GB = 1.0e9  # nccl-tests' GB/s are 1e9 bytes per second
_MAX_SIZES = 10_000


class PerfError(Exception):
    """A problem with the request (a bad flag or flag combination): exit status 2."""


# --------------------------------------------------------------------------------------
# Collectives: counts and bandwidth, as nccl-tests computes them


@dataclass(frozen=True)
class Counts:
    """Element counts of one operation (nccl-tests' ``getCollByteCount``).

    ``param`` is the count passed to NCCL; ``send``/``recv`` the elements each
    buffer holds; ``send_offset``/``recv_offset`` the in-place offsets, in elements
    per rank (the in-place send buffer is ``recvbuf + send_offset * rank``).
    """

    send: int
    recv: int
    param: int
    send_offset: int
    recv_offset: int


@dataclass(frozen=True)
class Collective:
    """One benchmarked operation and nccl-tests' rules for its sizes and bandwidths."""

    name: str
    #: "flat" (count each side), "gather" (count in, count*n out), "scatter" (the
    #: reverse), "alltoall" (count per peer, count*n each side) or "alltoallv" (per-peer
    #: sizes from a traffic pattern, :class:`~pynccl.perf._traffic.Traffic`).
    layout: str
    #: Bus-bandwidth factor: "2(n-1)/n", "(n-1)/n" or "1".
    bus: str
    reduces: bool = False
    rooted: bool = False
    #: False where NCCL defines no in-place form (all-to-all, send/recv): nccl-tests
    #: still times them with one buffer, but checks nothing there (``N/A``).
    in_place: bool = True
    #: Bytes of one operation in the algorithm bandwidth (nccl-tests' ``*GetBw``):
    #: "count" (flat), "count*n" (gather, scatter, all-to-all), "count*(n-1)" (hypercube:
    #: what each rank receives) or "max" (alltoallv: the busiest rank's larger total);
    #: empty for the layout's own rule.
    volume: str = ""
    #: What nccl-tests prints in the redop column of a collective without an op.
    no_op: str = "none"
    #: Runs only on a power-of-two number of ranks (nccl-tests skips it otherwise).
    power_of_two: bool = False
    #: The nccl-tests program, where it is not ``name + "_perf"``.
    program: str = ""

    @property
    def tests_binary(self) -> str:
        """The nccl-tests program measuring the same thing, e.g. ``all_reduce_perf``."""
        return self.program or self.name + "_perf"

    def counts(
        self, nbytes: int, itemsize: int, nranks: int, traffic: Traffic | None = None
    ) -> Counts:
        """The counts nccl-tests uses for a ``nbytes`` step of its sweep (alltoallv:
        under ``traffic``, by default nccl-tests' generated pattern)."""
        count = nbytes // itemsize
        if self.layout == "flat":
            return Counts(count, count, count, 0, 0)
        if self.layout == "alltoallv":
            from ._traffic import Traffic

            return (traffic or Traffic()).counts(count, itemsize, nranks)
        # Per-rank blocks rounded down to 16 bytes, as nccl-tests >= 2.17 does.
        base = (count // nranks) & ~(max(16 // itemsize, 1) - 1)
        if self.layout == "gather":
            return Counts(base, base * nranks, base, base, 0)
        if self.layout == "scatter":
            return Counts(base * nranks, base, base, 0, base)
        return Counts(base * nranks, base * nranks, base, 0, 0)

    def bus_factor(self, nranks: int) -> float:
        """Bus bandwidth / algorithm bandwidth for ``nranks`` ranks."""
        if self.bus == "2(n-1)/n":
            return 2.0 * (nranks - 1) / nranks
        if self.bus == "(n-1)/n":
            return (nranks - 1) / nranks
        return 1.0

    def volume_bytes(self, c: Counts, itemsize: int, nranks: int) -> int:
        """Bytes of one operation of counts ``c`` in the algorithm bandwidth."""
        rule = self.volume or ("count" if self.layout == "flat" else "count*n")
        if rule == "count":
            return c.param * itemsize
        if rule == "count*(n-1)":
            return c.param * itemsize * (nranks - 1)
        if rule == "max":
            return max(c.send, c.recv) * itemsize
        return c.param * itemsize * nranks

    def bandwidths(
        self,
        param: int,
        itemsize: int,
        seconds: float,
        nranks: int,
        counts: Counts | None = None,
    ) -> tuple[float, float]:
        """``(algbw, busbw)`` in GB/s for one operation of ``param`` elements taking
        ``seconds`` (``counts``: the operation's counts, where ``param`` alone does not
        say the volume: alltoallv; by default those of its generated pattern)."""
        if counts is None:
            counts = Counts(0, 0, param, 0, 0)
            if self.volume == "max":
                from ._traffic import Traffic

                counts = Traffic().counts_of(param, itemsize, nranks)
        moved = self.volume_bytes(counts, itemsize, nranks)
        algbw = moved / _GB / seconds if seconds > 0 else 0.0
        return algbw, algbw * self.bus_factor(nranks)


# The benchmarked operations are the object API's collectives (its spec table, the one list
# of them) plus nccl-tests' sendrecv (a send and a recv in one group). What perf adds to a
# row is nccl-tests' bus-bandwidth rule; the layout, op and root come from the row.
_LAYOUTS = {
    (Extent.COUNT, Extent.COUNT): "flat",
    (Extent.COUNT, Extent.PER_RANK): "gather",
    (Extent.PER_RANK, Extent.COUNT): "scatter",
    (Extent.PER_RANK, Extent.PER_RANK): "alltoall",
}
_BUS_RULES = {
    "all_reduce": "2(n-1)/n",
    "all_gather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "broadcast": "1",
    "reduce": "1",
    "gather": "(n-1)/n",
    "scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
}
COLLECTIVES: dict[str, Collective] = {
    row.method: Collective(
        row.method,
        _LAYOUTS[(row.send, row.recv)],
        _BUS_RULES[row.method],
        reduces=row.has_op,
        rooted=row.where is Where.ROOT,
        in_place=row.in_place is not InPlace.NONE,
    )
    for row in _SPEC
    if row.where is not Where.PEER
}
COLLECTIVES["all_to_all"] = replace(COLLECTIVES["all_to_all"], program="alltoall_perf")
COLLECTIVES["sendrecv"] = Collective("sendrecv", "flat", "1", in_place=False)
# nccl-tests 2.19's two collectives built from sends and receives: an all-gather by
# recursive doubling, and an all-to-all with a different size for each peer.
COLLECTIVES["hypercube"] = Collective(
    "hypercube", "gather", "1", volume="count*(n-1)", no_op="", power_of_two=True
)
COLLECTIVES["alltoallv"] = Collective(
    "alltoallv", "alltoallv", "(n-1)/n", in_place=False, volume="max"
)

# Spellings of the collectives people type: nccl-tests' binaries, NCCL's names.
_COLL_ALIASES = {re.sub(r"[_\-]", "", name): name for name in COLLECTIVES} | {
    "alltoall": "all_to_all",
    "bcast": "broadcast",
    "p2p": "sendrecv",
}


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``collective`` for ``nranks`` ranks."""
    return _collective(collective).bus_factor(nranks)


def _collective(name: str) -> Collective:
    key = re.sub(r"[_\-]", "", name.lower())
    key = key[: -len("perf")] if key.endswith("perf") else key
    try:
        return COLLECTIVES[_COLL_ALIASES[key]]
    except KeyError:
        raise ValueError(
            f"unknown collective {name!r}; expected one of {', '.join(COLLECTIVES)}"
        ) from None


# --------------------------------------------------------------------------------------
# Sizes

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from nccl-tests' notation: ``8``, ``64K``, ``1.5M``, ``32M``, ``1G`` (powers of 1024).

    A trailing ``B``/``iB`` is accepted (``64KiB``). Raises ``ValueError`` for
    anything else, naming the text.
    """
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: expected a byte count with an optional K, M or G "
            "suffix (powers of 1024), e.g. 8, 64K, 32M, 1G"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def sweep_sizes(minbytes: int, maxbytes: int, factor: int, step: int) -> list[int]:
    """The sizes nccl-tests visits: from ``minbytes`` times ``factor`` (or plus ``step``
    when ``factor`` is 1) while not above ``maxbytes``."""
    if minbytes > maxbytes:
        raise PerfError(f"minimum size {minbytes} B is above the maximum {maxbytes} B (-b > -e)")
    if factor > 1 and minbytes == 0:
        raise PerfError("-b 0 with a step factor (-f) never grows: start at 1 byte or more")
    if factor <= 1 and step <= 0:
        raise PerfError(f"-i {step}: the step must be at least 1 byte when -f is 1")
    out: list[int] = []
    size = minbytes
    while size <= maxbytes:
        out.append(size)
        if len(out) > _MAX_SIZES:
            raise PerfError(
                f"-b {minbytes} -e {maxbytes} with step {'x' + str(factor) if factor > 1 else step}"
                f" gives more than {_MAX_SIZES} sizes; use a larger -f or -i"
            )
        size = size * factor if factor > 1 else size + step
    return out


def _doubling(minbytes: int, maxbytes: int) -> list[int]:
    """nccl-tests' warm-up sizes: ``minbytes`` doubling up to ``maxbytes``."""
    out, size = [], max(minbytes, 1)
    while size <= maxbytes:
        out.append(size)
        size *= 2
    return out or [minbytes]
