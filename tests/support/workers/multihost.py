"""One rank of a job spread over several (network-namespace) hosts: ``from_env()``, then
every collective and a send/recv ring, each checked against numpy on every rank.

Each rank's input comes from a generator seeded with its rank, so every rank computes
every expected result on its own. The loopback's simulated hosts share one machine, whose
devices must stay distinct across them: ``launch --loopback --nnodes`` gives each node its
share (``CUDA_VISIBLE_DEVICES``) and ``from_env`` picks the device; a rank started without
a launcher that does (no ``CUDA_VISIBLE_DEVICES``) uses its *global* rank.

Prints ``READY rank= size= launcher= local= netns= pid= shm=`` after init (``netns``:
the inode of this process's network namespace) and ``E2E-OK rank= size= checks=`` at
the end; a failed check prints ``FAIL`` and exits 1.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import numpy as np
from _job import fail, launcher, report, shm_names
from support.reference import small_ints

import pynccl
from pynccl.bootstrap import detect_launch_env
from pynccl.cuda import DeviceBuffer

COUNT = 4096  # elements per rank (per block for the block collectives)


def rank_input(rank: int, n: int, dtype: str = "float32") -> np.ndarray:
    return small_ints(7000, rank, n, dtype)


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    env = detect_launch_env()
    device = None if "CUDA_VISIBLE_DEVICES" in os.environ else env.rank
    comm = pynccl.Communicator.from_env(timeout=60, device=device)
    rank, size = comm.rank, comm.size
    report(
        "READY",
        rank=rank,
        size=size,
        launcher=launcher(),
        local=env.local_rank,
        netns=os.stat("/proc/self/ns/net").st_ino,
        pid=os.getpid(),
        shm=shm_names(),
    )
    done: list[str] = []
    every = [rank_input(r, COUNT * size) for r in range(size)]  # each rank's full input
    mine = every[rank]
    blocks = [x.reshape(size, COUNT) for x in every]  # block j of rank r: blocks[r][j]

    def run(
        name: str,
        call: Callable[[DeviceBuffer, DeviceBuffer], None],
        n_out: int,
        want: np.ndarray | None,
        send: np.ndarray = mine,
    ) -> None:
        with DeviceBuffer.from_numpy(send) as sbuf, DeviceBuffer(n_out, "float32") as rbuf:
            rbuf.fill_zero()
            call(sbuf, rbuf)
            comm.synchronize(timeout=60)
            got = rbuf.to_numpy()
        if want is not None and not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            fail(
                rank,
                f"{name}: {bad.size} elements differ, first at {bad[:3].tolist()}: "
                f"got {got[bad[:3]].tolist()} want {want[bad[:3]].tolist()}",
            )
        done.append(name)

    n, last = COUNT * size, size - 1
    run("all_reduce-sum", lambda s, r: comm.all_reduce(s, r), n, np.sum(every, axis=0))
    run("all_reduce-max", lambda s, r: comm.all_reduce(s, r, op="max"), n, np.max(every, axis=0))
    run("broadcast", lambda s, r: comm.broadcast(s, r, root=last), n, every[last])
    run(
        "reduce",
        lambda s, r: comm.reduce(s, r, root=last),
        n,
        np.sum(every, axis=0) if rank == last else np.zeros(n, "float32"),
    )
    part = mine[:COUNT]
    run(
        "all_gather",
        lambda s, r: comm.all_gather(s, r),
        n,
        np.concatenate([x[:COUNT] for x in every]),
        send=part,
    )
    run(
        "reduce_scatter",
        lambda s, r: comm.reduce_scatter(s, r),
        COUNT,
        np.sum([b[rank] for b in blocks], axis=0),
    )
    run(
        "all_to_all",
        lambda s, r: comm.all_to_all(s, r),
        n,
        np.concatenate([b[rank] for b in blocks]),
    )
    run(
        "gather",
        lambda s, r: comm.gather(s, r, root=0),
        n,
        np.concatenate([x[:COUNT] for x in every]) if rank == 0 else np.zeros(n, "float32"),
        send=part,
    )
    run("scatter", lambda s, r: comm.scatter(s, r, root=last), COUNT, blocks[last][rank])

    nxt, prev = (rank + 1) % size, (rank - 1) % size

    def ring(s: DeviceBuffer, r: DeviceBuffer) -> None:
        with pynccl.group():
            comm.send(s, nxt)
            comm.recv(r, prev)

    run("send-recv-ring", ring, n, every[prev])
    comm.destroy()
    report("E2E-OK", rank=rank, size=size, checks=",".join(done))


if __name__ == "__main__":
    main()
