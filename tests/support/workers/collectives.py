"""One rank of a job: ``Communicator.from_env()``, then collectives checked against numpy.

Run by ``python -m pynccl launch -n N --loopback collectives.py`` or by a test that
fakes a launcher's environment (``--file PATH`` / ``--store ADDRESS`` pick the
rendezvous backend; TCP otherwise). Every rank's input is drawn from a generator
seeded with its rank, so each rank can compute the expected result of every
collective on its own. Checks: all_reduce (sum, int64 and integer-valued float32;
max, int32), all_gather, broadcast from the last rank, a send/recv ring.

Prints ``READY rank= size= launcher= device= pid= shm=`` after init and
``E2E-OK rank= size= checks=`` at the end; a failed check prints ``FAIL`` and exits 1.
"""

from __future__ import annotations

import os

import numpy as np
from _job import communicator, fail, launcher, parser, report, shm_names
from support.reference import small_ints

import pynccl
from pynccl.cuda import DeviceBuffer


def rank_input(rank: int, count: int, dtype: str) -> np.ndarray:
    return small_ints(1000, rank, count, dtype)


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--count", type=int, default=20_000, help="elements per rank")
    args = p.parse_args()
    comm = communicator(args)
    rank, size, count = comm.rank, comm.size, args.count
    report(
        "READY",
        rank=rank,
        size=size,
        launcher=launcher(),
        device=comm.device,
        pid=os.getpid(),
        shm=shm_names(),
    )
    done = []

    def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
        if got.dtype != want.dtype or not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            fail(
                rank,
                f"{name}: {bad.size} elements differ, first at {bad[:3].tolist()}: "
                f"got {got[bad[:3]].tolist()} want {want[bad[:3]].tolist()}",
            )
        done.append(name)

    inputs = {dt: [rank_input(r, count, dt) for r in range(size)] for dt in ("int64", "float32")}

    # all_reduce, sum, out of place and in place
    for dt in ("int64", "float32"):
        with DeviceBuffer.from_numpy(inputs[dt][rank]) as send, DeviceBuffer(count, dt) as recv:
            comm.all_reduce(send, recv)
            comm.synchronize(timeout=60)
            check(f"all_reduce-sum-{dt}", recv.to_numpy(), np.sum(inputs[dt], axis=0, dtype=dt))
    x = inputs["int64"][rank].astype("int32")
    with DeviceBuffer.from_numpy(x) as buf:
        comm.all_reduce(buf, op="max")
        comm.synchronize(timeout=60)
        want = np.max([v.astype("int32") for v in inputs["int64"]], axis=0)
        check("all_reduce-max-int32-inplace", buf.to_numpy(), want)

    # all_gather: rank blocks in rank order
    mine = inputs["float32"][rank]
    with DeviceBuffer.from_numpy(mine) as send, DeviceBuffer(count * size, "float32") as recv:
        comm.all_gather(send, recv)
        comm.synchronize(timeout=60)
        check("all_gather", recv.to_numpy(), np.concatenate(inputs["float32"]))

    # broadcast from the last rank; the others start from their own data
    root = size - 1
    with DeviceBuffer.from_numpy(inputs["int64"][rank]) as buf:
        comm.broadcast(buf, root=root)
        comm.synchronize(timeout=60)
        check(f"broadcast-root{root}", buf.to_numpy(), inputs["int64"][root])

    # ring: send to the next rank, receive from the previous one, in one group
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    with DeviceBuffer.from_numpy(mine) as send, DeviceBuffer(count, "float32") as recv:
        recv.fill_zero()
        with pynccl.group():
            comm.send(send, nxt)
            comm.recv(recv, prev)
        comm.synchronize(timeout=60)
        check("send-recv-ring", recv.to_numpy(), inputs["float32"][prev])

    comm.destroy()
    report("E2E-OK", rank=rank, size=size, checks=",".join(done))


if __name__ == "__main__":
    main()
