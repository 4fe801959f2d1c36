"""How one operation of each benchmarked collective is issued: the object API's
collectives, and nccl-tests' send/receive compositions (sendrecv, hypercube, alltoallv)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..enums import DataType
from ._sweep import Collective, Counts
from ._traffic import Traffic

_D2D = 3  # cudaMemcpyDeviceToDevice


def runner(
    coll: Collective,
    comm: Any,
    rt: Any,
    pointers: tuple[int, int],
    c: Counts,
    dtype: DataType,
    op: Any,
    root: int,
    stream: int,
    traffic: Traffic | None,
) -> Callable[[], None]:
    """A no-argument function issuing the operation once (all arguments bound).

    ``pointers`` are the send and receive addresses (in place: inside the receive
    buffer, at nccl-tests' offsets); ``traffic`` is alltoallv's pattern.
    """
    sp, rp = pointers
    n, s = c.param, stream
    name = coll.name
    if name == "all_reduce":
        return lambda: comm.all_reduce(sp, rp, op, count=n, dtype=dtype, stream=s)
    if name == "all_gather":
        return lambda: comm.all_gather(sp, rp, count=n, dtype=dtype, stream=s)
    if name == "reduce_scatter":
        return lambda: comm.reduce_scatter(sp, rp, op, count=n, dtype=dtype, stream=s)
    if name == "broadcast":
        return lambda: comm.broadcast(sp, rp, root=root, count=n, dtype=dtype, stream=s)
    if name == "reduce":
        return lambda: comm.reduce(sp, rp, op, root=root, count=n, dtype=dtype, stream=s)
    if name == "gather":
        return lambda: comm.gather(sp, rp, root=root, count=n, dtype=dtype, stream=s)
    if name == "scatter":
        return lambda: comm.scatter(sp, rp, root=root, count=n, dtype=dtype, stream=s)
    if name == "all_to_all":
        return lambda: comm.all_to_all(sp, rp, count=n, dtype=dtype, stream=s)
    if name == "hypercube":
        return _hypercube(comm, rt, sp, rp, n, dtype, s)
    if name == "alltoallv":
        return _alltoallv(comm, sp, rp, n, dtype, s, traffic or Traffic())
    return _sendrecv(comm, sp, rp, n, dtype, s)


def _exchanges(
    comm: Any, rounds: list[tuple[int, int, int, int, int]], dtype: DataType, s: int
) -> Callable[[], None]:
    """A function issuing, for each round ``(send address, to, receive address, from,
    count)`` in order, one send and one receive in a group (neither waits for the other)."""
    from ..groups import group

    def exchange() -> None:
        for send_at, to, recv_at, from_, count in rounds:
            with group():
                comm.send(send_at, to, count=count, dtype=dtype, stream=s)
                comm.recv(recv_at, from_, count=count, dtype=dtype, stream=s)

    return exchange


def _sendrecv(comm: Any, sp: int, rp: int, n: int, dtype: DataType, s: int) -> Callable[[], None]:
    """nccl-tests' sendrecv: each rank sends to the next and receives from the previous."""
    rank, size = int(comm.rank), int(comm.size)
    return _exchanges(comm, [(sp, (rank + 1) % size, rp, (rank - 1) % size, n)], dtype, s)


def _hypercube(
    comm: Any, rt: Any, sp: int, rp: int, n: int, dtype: DataType, s: int
) -> Callable[[], None]:
    """nccl-tests' hypercube: an all-gather by recursive doubling (a power-of-two number
    of ranks). This rank's block goes to its place in the receive buffer, then in round
    ``mask`` = 1, 2, 4 ... it swaps with rank ``rank ^ mask`` the ``mask`` blocks it holds
    for the ``mask`` blocks the peer holds, one send and one receive in a group."""
    rank, size = int(comm.rank), int(comm.size)
    block = n * dtype.itemsize
    mine = rp + rank * block
    rounds: list[tuple[int, int, int, int, int]] = []
    mask = 1
    while mask < size:
        held = rank & ~(mask - 1)  # first block of the run this rank holds
        wanted = held ^ mask  # first block of the run the peer holds
        peer = rank ^ mask
        rounds.append((rp + held * block, peer, rp + wanted * block, peer, n * mask))
        mask <<= 1
    exchange = _exchanges(comm, rounds, dtype, s)

    def hypercube() -> None:
        if mine != sp and block:  # in place, the input is already there
            rt.cudaMemcpyAsync(mine, sp, block, _D2D, s)
        exchange()

    return hypercube


def _alltoallv(
    comm: Any, sp: int, rp: int, n: int, dtype: DataType, s: int, traffic: Traffic
) -> Callable[[], None]:
    """nccl-tests' alltoallv: in one group, for each peer in rank order, a send of what
    this rank sends it and a receive of what it sends this rank (none where that is 0
    elements), each packed after the previous one in its buffer."""
    from ..groups import group

    rank, size = int(comm.rank), int(comm.size)
    itemsize = dtype.itemsize
    sends = traffic.sends(rank, size, n, itemsize)
    recvs = traffic.recvs(rank, size, n, itemsize)
    plan: list[tuple[bool, int, int, int]] = []  # (send?, address, count, peer)
    send_at, recv_at = sp, rp
    for peer in range(size):
        if sends[peer]:
            plan.append((True, send_at, sends[peer], peer))
            send_at += sends[peer] * itemsize
        if recvs[peer]:
            plan.append((False, recv_at, recvs[peer], peer))
            recv_at += recvs[peer] * itemsize

    def alltoallv() -> None:
        with group():
            for is_send, at, count, peer in plan:
                if is_send:
                    comm.send(at, peer, count=count, dtype=dtype, stream=s)
                else:
                    comm.recv(at, peer, count=count, dtype=dtype, stream=s)

    return alltoallv
