"""One rank of a 4-rank job that hangs at its 4th all_reduce, for flight-record dumps.

Every rank runs a watchdog (``--watchdog`` s), issues three all_reduces of 4096 float32
and waits for them, then the 4th; ``--mode`` says how one rank goes wrong there:

* ``skip``: rank 2 never issues the 4th, and waits on the host (a barrier that never comes);
* ``count``: rank 1 issues it with 1024 elements;
* ``sleep``: rank 3 sleeps in ``time.sleep`` before it (no NCCL call at all).

The others then ``synchronize()``: their watchdog aborts the hung operation, the error
is raised unhandled (the dump's ``unhandled`` trigger), and the launcher asks the rest.
"""

from __future__ import annotations

import os
import time

from _job import communicator, parser

from pynccl.cuda import DeviceBuffer


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--mode", choices=("skip", "count", "sleep"), required=True)
    p.add_argument("--watchdog", type=float, default=3.0)
    args = p.parse_args()
    comm = communicator(args)
    rank = comm.rank
    comm.start_watchdog(args.watchdog)
    buf = DeviceBuffer(4096, "float32")
    for _ in range(3):
        comm.all_reduce(buf)
    comm.synchronize()
    print(f"WARM rank={rank} pid={os.getpid()}", flush=True)
    if (args.mode, rank) in (("skip", 2), ("sleep", 3)):
        time.sleep(600)  # skip: waiting for a host barrier; sleep: stuck on the host
    elif (args.mode, rank) == ("count", 1):
        comm.all_reduce(buf, count=1024)
    else:
        comm.all_reduce(buf)
    comm.synchronize()


if __name__ == "__main__":
    main()
