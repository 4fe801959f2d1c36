"""How much of each buffer every collective may touch, as the loopback's strict checks see it.

The loopback derives these extents from one table (``nccl/collectives.h``); here they are
written out independently, from nccl.h's documentation of each collective: a buffer
that ends exactly where the extent does is accepted, one element short is refused with
``ncclInvalidArgument`` naming the buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support.clib import INVALID_ARG, SUM, GroupWorld, Lib, call_collective

N, COUNT, FLOAT32, E = 2, 4, 7, 4
ROOT = 0
ALLOC = 256  # bytes per allocation: more than any extent below

#: kind -> elements of (sendbuff, recvbuff) on the root, then on the other ranks
#: (for collectives without a root, both pairs are the same).
EXTENTS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "AllReduce": ((COUNT, COUNT), (COUNT, COUNT)),
    "Broadcast": ((COUNT, COUNT), (0, COUNT)),
    "Reduce": ((COUNT, COUNT), (COUNT, 0)),
    "AllGather": ((COUNT, N * COUNT), (COUNT, N * COUNT)),
    "ReduceScatter": ((N * COUNT, COUNT), (N * COUNT, COUNT)),
    "AlltoAll": ((N * COUNT, N * COUNT), (N * COUNT, N * COUNT)),
    "Gather": ((COUNT, N * COUNT), (COUNT, 0)),
    "Scatter": ((N * COUNT, COUNT), (0, COUNT)),
}


@pytest.fixture
def world(lib: Lib) -> Iterator[GroupWorld]:
    w = GroupWorld(lib, N)
    yield w
    w.close()


def _extent(kind: str, rank: int) -> tuple[int, int]:
    return EXTENTS[kind][0 if rank == ROOT else 1]


def _ending(w: GroupWorld, rank: int, nbytes: int) -> int:
    """A pointer into a fresh allocation of rank's device with nbytes left before its end."""
    return w.alloc(rank, ALLOC) + ALLOC - nbytes


def _call(lib: Lib, w: GroupWorld, kind: str, rank: int, sbuf: int, rbuf: int) -> int:
    return call_collective(
        lib, kind, w.comms[rank], w.streams[rank], sbuf, rbuf, COUNT, FLOAT32, SUM, ROOT
    )


@pytest.mark.parametrize("kind", sorted(EXTENTS))
def test_buffers_ending_at_the_extent_are_accepted(lib: Lib, world: GroupWorld, kind: str) -> None:
    bufs = []
    for r in range(N):
        s_elems, r_elems = _extent(kind, r)
        bufs.append((_ending(world, r, s_elems * E), _ending(world, r, r_elems * E)))
    codes = world.run(lambda r: _call(lib, world, kind, r, *bufs[r]))
    assert codes == [0] * N, (codes, lib.last_error())


@pytest.mark.parametrize("kind", sorted(EXTENTS))
@pytest.mark.parametrize("rank", [ROOT, 1])
@pytest.mark.parametrize("which", ["sendbuff", "recvbuff"])
def test_one_element_short_is_refused(
    lib: Lib, world: GroupWorld, kind: str, rank: int, which: str
) -> None:
    s_elems, r_elems = _extent(kind, rank)
    need = s_elems if which == "sendbuff" else r_elems
    if need == 0:
        pytest.skip(f"{kind}'s {which} is not used on rank {rank}")
    short = (need - 1) * E
    sbuf = _ending(world, rank, short if which == "sendbuff" else s_elems * E)
    rbuf = _ending(world, rank, short if which == "recvbuff" else r_elems * E)
    rc = _call(lib, world, kind, rank, sbuf, rbuf)
    if rc != INVALID_ARG:  # accepted: the op waits for the other ranks; do not hang on it
        for c in world.comms:
            lib.ncclCommAbort(c)
        world.comms = []
    assert rc == INVALID_ARG, f"{kind} on rank {rank} took a {which} one element short"
    error: Any = lib.last_error()
    assert which in error and "does not lie inside" in error, error
    assert f"({need * E} bytes)" in error, error
