"""One rank of a job in which rank ``--victim`` dies; the others report what they saw.

``--when collective`` (default): after a checked warm-up all_reduce every rank prints
``READY rank= pid= shm=``; the victim then sleeps, waiting to be SIGKILLed by the
test, while the others enqueue an all_reduce (float32, count 1024) that cannot
complete without it, print ``BLOCKED rank=`` and wait in
``synchronize(timeout=--timeout)``. They print ``PEER-ERROR rank= error=<class>
state= sigterm= seconds= message=`` and abort their communicator.

``--when init``: the victim SIGKILLs itself right after the id exchange, before it
joins the NCCL world; the others, stuck in communicator init, print
``INIT-ERROR rank= error=<class> seconds= message=`` once init gives up
(``PYNCCL_LOOPBACK_INIT_TIMEOUT``).

Survivors exit 0 when they got an error (the test judges which), 1 otherwise. They
hold SIGTERM back: a launcher stopping the job after the victim's death must not
hide what they observed (it SIGKILLs them after its grace period anyway).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import numpy as np
from _job import DeferredTerm, communicator, fail, parser, report, shm_names

import pynccl
from pynccl.bootstrap import detect_launch_env, make_rendezvous
from pynccl.cuda import DeviceBuffer


class DieAfterShare:
    """A rendezvous that kills its process once the id has arrived."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def share(self, payload: bytes | None, *, rank: int, world_size: int, timeout: float) -> bytes:
        data: bytes = self.inner.share(payload, rank=rank, world_size=world_size, timeout=timeout)
        os.kill(os.getpid(), signal.SIGKILL)
        return data


def survive_init(args: Any, rank: int) -> None:
    start = time.monotonic()
    try:
        comm = communicator(args)
    except pynccl.NcclError as e:
        report(
            "INIT-ERROR",
            rank=rank,
            error=type(e).__name__,
            seconds=f"{time.monotonic() - start:.2f}",
            message=e,
        )
        sys.exit(0)
    comm.abort()
    fail(rank, "communicator init succeeded although a rank never joined")


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--when", choices=("collective", "init"), default="collective")
    p.add_argument("--timeout", type=float, default=30.0, help="synchronize timeout (s)")
    args = p.parse_args()
    term = DeferredTerm()
    env = detect_launch_env()
    rank = env.rank
    report("STARTED", rank=rank, pid=os.getpid())

    if args.when == "init":
        if rank == args.victim:
            inner = make_rendezvous(env, file=args.file)
            pynccl.Communicator.from_env(timeout=60, rendezvous=DieAfterShare(inner))
            fail(rank, "the victim survived its own SIGKILL")
        survive_init(args, rank)

    comm = communicator(args)
    with DeviceBuffer.from_numpy(np.ones(16, dtype="float32")) as warm:
        comm.all_reduce(warm)
        comm.synchronize(timeout=60)
        if warm.to_numpy().tolist() != [float(comm.size)] * 16:
            fail(rank, f"warm-up all_reduce gave {warm.to_numpy().tolist()}")
    report("READY", rank=rank, pid=os.getpid(), shm=shm_names())

    if rank == args.victim:
        time.sleep(120)
        fail(rank, "the victim was not killed")

    buf = DeviceBuffer.from_numpy(np.full(1024, rank + 1, dtype="float32"))
    comm.all_reduce(buf)
    report("BLOCKED", rank=rank)
    start = time.monotonic()
    try:
        comm.synchronize(timeout=args.timeout)
    except (pynccl.NcclRemoteError, pynccl.NcclTimeoutError) as e:
        seconds = time.monotonic() - start
        state = comm.state
        comm.abort()
        buf.close()
        report(
            "PEER-ERROR",
            rank=rank,
            error=type(e).__name__,
            state=state,
            sigterm=term.received,
            seconds=f"{seconds:.2f}",
            message=e,
        )
        sys.exit(0)
    fail(rank, "synchronize returned although a peer died in the collective")


if __name__ == "__main__":
    main()
