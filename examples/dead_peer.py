"""Catching a dead peer: the last rank dies; the others get a clear error instead of a hang.

``synchronize(timeout=...)`` waits for the stream while polling NCCL's asynchronous
error: a peer that died shows up as :class:`pynccl.NcclRemoteError` where NCCL (or the
loopback) notices it, and as :class:`pynccl.NcclTimeoutError` (the communicator aborted,
the message naming the last operation issued) where it does not. Either way the rank
gets control back and can exit cleanly. (Where no thread waits, ``Communicator(...,
watchdog_timeout=...)`` or ``from_env(watchdog_timeout=...)`` runs a watchdog thread that
aborts a hung communicator and makes its next call raise why.)::

    python -m pynccl launch -n 2 --loopback examples/dead_peer.py
    python examples/dead_peer.py [--loopback]      # starts 2 ranks itself
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

comm = pynccl.Communicator.from_env()
rank, size = comm.rank, comm.size
x = DeviceBuffer.from_numpy(np.ones(1024, dtype=np.float32))
comm.all_reduce(x)  # a first collective that everyone completes
comm.synchronize(timeout=60)
np.testing.assert_array_equal(x.to_numpy(), np.full(1024, size, dtype=np.float32))

if rank == size - 1:
    # Simulate a crash: leave at once, without destroying anything. (Exit status 0 so
    # that the launcher, which stops every rank when one fails, lets the others go on.)
    os._exit(0)

try:
    comm.all_reduce(x)  # the dead rank never joins this one
    comm.synchronize(timeout=10)  # (the call itself raises if NCCL already knows)
except (pynccl.NcclRemoteError, pynccl.NcclTimeoutError) as error:
    print(f"rank {rank}: peer lost, {type(error).__name__}: {str(error).splitlines()[0]}")
    comm.abort()  # a failed communicator is aborted, not destroyed
    sys.exit(0)
comm.destroy()
sys.exit(f"rank {rank}: the all_reduce finished without rank {size - 1}")
