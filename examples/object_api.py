"""The object API on pynccl's own device buffers: no CuPy or torch needed.

Every rank runs this file; the launcher gives each its rank and device::

    python -m pynccl launch -n 2 examples/object_api.py              # on the GPUs
    python -m pynccl launch -n 2 --loopback examples/object_api.py   # without a GPU
    python examples/object_api.py [--loopback]                       # starts 2 ranks itself
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import pynccl
from pynccl.cuda import DeviceBuffer, Stream

if "RANK" not in os.environ:  # not started by a launcher: start two ranks of this file
    flag = ["--loopback"] if "--loopback" in sys.argv else []
    cmd = [sys.executable, "-m", "pynccl", "launch", "-n", "2", *flag, __file__]
    sys.exit(subprocess.call(cmd))

n = 1000
with pynccl.Communicator.from_env() as comm:  # destroyed at the end (aborted on an error)
    rank, size = comm.rank, comm.size
    stream = Stream(non_blocking=True)
    mine = np.arange(n, dtype=np.float32) + 100 * rank

    x = DeviceBuffer.from_numpy(mine)
    comm.all_reduce(x, op="sum", stream=stream)  # in place
    gathered = DeviceBuffer((size, n), "float32")
    comm.all_gather(DeviceBuffer.from_numpy(mine), gathered, stream=stream)
    comm.synchronize(stream, timeout=60)  # waits, and raises NCCL's async error if any

    everyone = np.stack([np.arange(n, dtype=np.float32) + 100 * r for r in range(size)])
    np.testing.assert_array_equal(x.to_numpy(), everyone.sum(axis=0))
    np.testing.assert_array_equal(gathered.to_numpy(), everyone)
    stream.close()
    print(f"rank {rank}/{size} on device {comm.device}: all_reduce and all_gather OK")
