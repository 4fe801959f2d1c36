"""CuPy arrays straight into NCCL collectives, on CuPy's current stream.

pynccl reads ``__cuda_array_interface__``, so CuPy arrays (and CuPy streams) go in as
they are. Needs CuPy and a GPU (CuPy cannot run on the loopback libraries)::

    python -m pynccl launch -n 2 examples/cupy_arrays.py
    python examples/cupy_arrays.py                 # starts 2 ranks itself
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import pynccl

if "RANK" not in os.environ:  # not started by a launcher: start two ranks of this file
    cmd = [sys.executable, "-m", "pynccl", "launch", "-n", "2", __file__]
    sys.exit(subprocess.call(cmd))

import cupy as cp  # after the launcher block: the parent needs no CuPy

n = 1 << 16
with pynccl.Communicator.from_env() as comm:
    rank, size = comm.rank, comm.size
    cp.cuda.Device(comm.device).use()  # CuPy's current device = the communicator's
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # CuPy's current stream: its kernels and pynccl's collectives share it
        x = cp.arange(n, dtype=cp.float32) * (rank + 1)
        comm.all_reduce(x, stream=cp.cuda.get_current_stream())  # in place
        parts = cp.empty((size, n), dtype=cp.float32)
        comm.all_gather(x, parts, stream=stream)
        summed = cp.asnumpy(x, stream=stream)
        gathered = cp.asnumpy(parts, stream=stream)
    stream.synchronize()

    want = np.arange(n, dtype=np.float32) * sum(r + 1 for r in range(size))
    np.testing.assert_array_equal(summed, want)
    np.testing.assert_array_equal(gathered, np.stack([want] * size))
    print(f"rank {rank}/{size} on device {comm.device}: CuPy all_reduce and all_gather OK")
