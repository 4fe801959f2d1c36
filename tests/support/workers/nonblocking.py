"""One rank of a job whose communicator is created non-blocking (``Config(blocking=False)``).

Run with ``PYNCCL_LOOPBACK_NONBLOCKING_DELAY=K`` (K well above the handful of polls a
20 ms wait makes): ``wait_ready(timeout=0.02)`` must time out while the communicator
is still initialising, a later ``wait_ready()`` must succeed, and an all_reduce and an
all_gather must then give numpy's results. Prints ``NB-OK rank= created=<state>
first_wait=<error class or none> after_first_wait=<state> ready=<state>``.
"""

from __future__ import annotations

import numpy as np
from _job import communicator, fail, parser, report

import pynccl
from pynccl.cuda import DeviceBuffer


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    comm = communicator(args, config=pynccl.Config(blocking=False))
    rank, size = comm.rank, comm.size
    created = comm.state
    try:
        comm.wait_ready(timeout=0.02)
    except pynccl.NcclTimeoutError as e:
        first_wait = type(e).__name__
    else:
        first_wait = "none"
    after_first_wait = comm.state
    comm.wait_ready(timeout=60)

    inputs = [np.arange(100, dtype="int32") * (r + 1) - r for r in range(size)]
    with DeviceBuffer.from_numpy(inputs[rank]) as buf, DeviceBuffer(100 * size, "int32") as out:
        comm.all_reduce(buf)
        comm.all_gather(buf, out)
        comm.synchronize(timeout=60)
        total = np.sum(inputs, axis=0, dtype="int32")
        if not np.array_equal(buf.to_numpy(), total):
            fail(rank, f"all_reduce gave {buf.to_numpy()[:5].tolist()}...")
        if not np.array_equal(out.to_numpy(), np.tile(total, size)):
            fail(rank, f"all_gather gave {out.to_numpy()[:5].tolist()}...")
    ready = comm.state
    comm.destroy()
    report(
        "NB-OK",
        rank=rank,
        created=created,
        first_wait=first_wait,
        after_first_wait=after_first_wait,
        ready=ready,
    )


if __name__ == "__main__":
    main()
