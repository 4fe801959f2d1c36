"""A ring exchange with send/recv: each rank sends to the next and receives from the previous.

The two calls go in one ``pynccl.group()`` so NCCL issues them together (alone, each
would wait for the other and the ring would deadlock)::

    python -m pynccl launch -n 4 --loopback examples/sendrecv_ring.py
    python examples/sendrecv_ring.py [--loopback]      # starts 2 ranks itself
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import pynccl
from pynccl.cuda import DeviceBuffer

if "RANK" not in os.environ:  # not started by a launcher: start two ranks of this file
    flag = ["--loopback"] if "--loopback" in sys.argv else []
    cmd = [sys.executable, "-m", "pynccl", "launch", "-n", "2", *flag, __file__]
    sys.exit(subprocess.call(cmd))

n = 256
with pynccl.Communicator.from_env() as comm:
    rank, size = comm.rank, comm.size
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    out = DeviceBuffer.from_numpy(np.full(n, rank, dtype=np.int64))
    into = DeviceBuffer(n, "int64")

    # Pass the token around the ring size times: afterwards it is back where it started.
    for step in range(size):
        with pynccl.group():
            comm.send(out, peer=nxt)
            comm.recv(into, peer=prev)
        comm.synchronize(timeout=60)
        expected = np.full(n, (rank - step - 1) % size, dtype=np.int64)
        np.testing.assert_array_equal(into.to_numpy(), expected)
        out, into = into, out
    np.testing.assert_array_equal(out.to_numpy(), np.full(n, rank, dtype=np.int64))
    print(f"rank {rank}: received from rank {prev}, {size} steps round the ring OK")
