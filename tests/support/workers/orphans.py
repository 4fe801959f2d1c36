"""One rank of a job whose launcher the test SIGKILLs while the ranks are blocked.

``--phase``:

* ``rendezvous``: rank 0 never serves the id (it sleeps); the others block fetching it.
* ``init``: the id is shared, then the last rank sleeps; the others block in
  ``ncclCommInitRank`` waiting for it (the loopback's shared segment exists by then).
* ``collective``: every rank initialises; then the last rank sleeps while the others
  block in an all_reduce waiting for it.

Each rank first starts a child of its own (``sleep``, in the rank's process group, as a
data loader would be), then prints ``READY rank= pid= child= phase=`` just before it
blocks (``shm=`` names the ``/dev/shm`` segments it maps at that point), then blocks for
up to 10 minutes: only the launcher's death may end it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import numpy as np
from _job import report, shm_names

import pynccl
from pynccl.bootstrap import detect_launch_env, make_rendezvous, select_device
from pynccl.cuda import DeviceBuffer

FOREVER = 600.0
CHILD: subprocess.Popen[bytes] | None = None


def ready(rank: int, phase: str) -> None:
    assert CHILD is not None
    report("READY", rank=rank, pid=os.getpid(), child=CHILD.pid, phase=phase, shm=shm_names())


def block(rank: int, phase: str) -> None:
    ready(rank, phase)
    time.sleep(FOREVER)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--phase", choices=("rendezvous", "init", "collective"), required=True)
    args = p.parse_args()
    global CHILD
    CHILD = subprocess.Popen(["sleep", str(FOREVER)])
    env = detect_launch_env()
    rank, size, last = env.rank, env.world_size, env.world_size - 1
    if args.phase == "rendezvous":
        if rank == 0:
            block(rank, args.phase)
        ready(rank, args.phase)
        pynccl.Communicator.from_env(timeout=FOREVER)
        return
    backend = make_rendezvous(env)
    payload = bytes(pynccl.UniqueId()) if rank == 0 else None
    uid = pynccl.UniqueId.from_bytes(backend.share(payload, rank=rank, world_size=size, timeout=60))
    if args.phase == "init":
        if rank == last:
            block(rank, args.phase)
        ready(rank, args.phase)
        pynccl.Communicator(size, uid, rank, device=select_device(env))
        return
    comm = pynccl.Communicator(size, uid, rank, device=select_device(env))
    if rank == last:
        block(rank, args.phase)
    buf = DeviceBuffer.from_numpy(np.ones(1024, dtype="float32"))
    ready(rank, args.phase)
    comm.all_reduce(buf)
    comm.synchronize()


if __name__ == "__main__":
    main()
