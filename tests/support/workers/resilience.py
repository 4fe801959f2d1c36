"""One rank of a process world for tests/comm/test_comm_resilience.py, through the object API.

    python tests/support/workers/resilience.py SCENARIO UID_HEX NRANKS RANK [ARGS]

prints one JSON line per event (``{"event": ..., ...}``) and exits 0 when every check
of the scenario passed (1 otherwise, after an ``{"event": "fail", ...}`` line):

* ``shrink VICTIM``: a checked all_reduce, then ``ready``; the victim waits to be
  SIGKILLed by the test, the others issue an all_reduce it never joins, see
  ``synchronize`` raise (``parent``), shrink it away with ``abort=True`` and check an
  all_reduce on the child against numpy (``child``).
* ``grow_old TOTAL``: an existing rank of a grow to TOTAL ranks; rank 0 takes the id
  (``grow_id``, printed for the test to hand to the new ranks) and passes it to ``grow``.
* ``grow_new``: a new rank, ``Communicator.join`` with the id (UID_HEX).

Every grown or shrunk communicator checks an all_reduce against numpy (``grown`` /
``child``); the inputs are small integers in float32, so any order of summation is exact.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

# Run as a script: tests/ (for the support package) importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from support.reference import small_ints

import pynccl
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer

COUNT = 4096


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def data(original_rank: int) -> np.ndarray:
    """The input of the process that was rank ``original_rank`` of the first world."""
    return small_ints(13, original_rank, COUNT)


def all_reduce_ok(comm: Communicator, me: int, members: list[int]) -> bool:
    """Sum all_reduce of ``data(me)`` on ``comm``, against numpy over ``members``."""
    with DeviceBuffer.from_numpy(data(me), device=comm.device) as buf:
        comm.all_reduce(buf)
        comm.synchronize(timeout=60)
        got = buf.to_numpy()
    want = np.sum([data(m) for m in members], axis=0, dtype=np.float32)
    return bool(np.array_equal(got, want))


def shrink(comm: Communicator, rank: int, nranks: int, victim: int) -> bool:
    everyone = list(range(nranks))
    ok = all_reduce_ok(comm, rank, everyone)
    emit(event="ready", ok=ok)
    if rank == victim:
        time.sleep(120)
        emit(event="fail", why="the victim was not killed")
        return False
    buf = DeviceBuffer.from_numpy(data(rank), device=comm.device)
    comm.all_reduce(buf)  # the victim never joins this one
    try:
        comm.synchronize(timeout=30)
        emit(event="fail", why="synchronize returned although a peer died")
        return False
    except pynccl.NcclError as e:
        emit(event="parent", error=type(e).__name__, state=str(comm.state))
    child = comm.shrink([victim], abort=True)
    survivors = [r for r in everyone if r != victim]
    ok = all_reduce_ok(child, rank, survivors)
    emit(event="child", rank=child.rank, size=child.size, ok=ok)
    child.destroy()
    comm.abort()
    buf.close()
    return ok


def grown(comm: Communicator, me: int, total: int) -> bool:
    ok = all_reduce_ok(comm, me, list(range(total)))
    emit(event="grown", rank=comm.rank, size=comm.size, ok=ok)
    comm.destroy()
    return ok


def main(argv: list[str]) -> int:
    scenario, uid_hex, nranks, rank = argv[0], argv[1], int(argv[2]), int(argv[3])
    uid = UniqueId.fromhex(uid_hex)
    if scenario == "grow_new":
        comm = Communicator.join(nranks, uid, rank, device=rank)
        ok = grown(comm, rank, nranks)
        emit(event="exit", ok=ok)
        return 0 if ok else 1
    comm = Communicator(nranks, uid, rank, device=rank)
    if scenario == "shrink":
        ok = shrink(comm, rank, nranks, int(argv[4]))
    elif scenario == "grow_old":
        total = int(argv[4])
        ok = all_reduce_ok(comm, rank, list(range(nranks)))
        if rank == 0:
            gid = comm.grow_id()
            emit(event="grow_id", uid=gid.hex())
            bigger = comm.grow(total, gid)
        else:
            bigger = comm.grow(total)
        ok = grown(bigger, rank, total) and ok
        comm.destroy()
    else:
        emit(event="fail", why=f"unknown scenario {scenario!r}")
        return 1
    emit(event="exit", ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
