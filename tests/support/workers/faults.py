"""One rank of a job in which rank ``--fault-rank`` gets a fault injected into its second
operation (an all_gather, float64, count 5, after a checked warm-up all_reduce and a
file barrier in ``--sync-dir``).

``--mode``:

* ``watchdog``: that rank's op hangs (``PYNCCL_LOOPBACK_HANG=2``) and it runs a watchdog
  with a 1 s timeout; the others run one with 30 s. Every rank waits for its
  watchdog to abort the communicator, then makes one more call, which must raise the
  error the watchdog recorded.
* ``synchronize``: the op hangs on that rank; no watchdog. That rank calls
  ``synchronize(timeout=1)``, the others ``synchronize(timeout=30)``; then one more call.
* ``async-error``: that rank's op fails (``PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER=1``);
  every rank calls ``synchronize(timeout=30)``.

Each rank prints ``RESULT rank= error=<class> where=<enqueue|synchronize|watchdog>
state= next=<class of the next call's error> same= watchdog_threads= message=`` and
exits 0 through the normal interpreter exit (nothing explicitly destroyed or closed
after the fault): the test bounds the exit, so a hang at exit fails it.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from _job import communicator, fail, file_barrier, parser, report, wait_until

import pynccl
from pynccl.bootstrap import detect_launch_env
from pynccl.cuda import DeviceBuffer


def watchdog_threads() -> int:
    return sum(t.name.startswith("pynccl-watchdog") for t in threading.enumerate())


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--mode", choices=("watchdog", "synchronize", "async-error"), required=True)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--sync-dir", required=True, help="an empty directory for a file barrier")
    args = p.parse_args()
    rank = detect_launch_env().rank
    faulty = rank == args.fault_rank
    if faulty:
        # read by the loopback libnccl when the communicator is created
        if args.mode == "async-error":
            os.environ["PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER"] = "1"
        else:
            os.environ["PYNCCL_LOOPBACK_HANG"] = "2"
    comm = communicator(args)

    warm = DeviceBuffer.from_numpy(np.arange(8, dtype="float32"))
    comm.all_reduce(warm)
    comm.synchronize(timeout=60)
    if warm.to_numpy().tolist() != (np.arange(8) * comm.size).tolist():
        fail(rank, f"warm-up all_reduce gave {warm.to_numpy().tolist()}")
    if args.mode == "watchdog":
        comm.start_watchdog(1.0 if faulty else 30.0)
    report("READY", rank=rank, pid=os.getpid())
    # The fault must not reach a peer still checking its warm-up (synchronize would
    # rightly raise it there): meet outside NCCL first.
    file_barrier(args.sync_dir, rank, comm.size)

    send = DeviceBuffer.from_numpy(np.full(5, rank, dtype="float64"))
    recv = DeviceBuffer(5 * comm.size, "float64")
    error: BaseException | None = None
    where = "-"
    try:
        comm.all_gather(send, recv)
    except pynccl.NcclError as e:
        # a peer that failed first may already have broken the communicator: NCCL then
        # returns the error from the next call
        error, where = e, "enqueue"
    if args.mode == "watchdog":
        # whatever the enqueue said, the watchdog must abort and record why
        if not wait_until(lambda: comm.state == "aborted", 60):
            fail(rank, f"the watchdog did not abort the communicator (state {comm.state})")
        error, where = comm.error, "watchdog"
    elif error is None:
        try:
            comm.synchronize(timeout=1.0 if faulty and args.mode == "synchronize" else 30.0)
        except pynccl.NcclError as e:
            error, where = e, "synchronize"
    state = comm.state
    try:
        comm.all_reduce(warm)
    except pynccl.NcclError as e:
        following: BaseException | None = e
    else:
        following = None
    if state != "aborted":
        comm.abort()
    wait_until(lambda: watchdog_threads() == 0, 10)
    report(
        "RESULT",
        rank=rank,
        error=type(error).__name__ if error is not None else "none",
        where=where,
        state=state,
        next=type(following).__name__ if following is not None else "none",
        same=following is error,
        watchdog_threads=watchdog_threads(),
        message=error if error is not None else "-",
    )


if __name__ == "__main__":
    main()
