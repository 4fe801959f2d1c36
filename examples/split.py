"""Sub-communicators with ``Communicator.split``: even and odd ranks reduce apart.

``split(color, key)`` is collective: every rank calls it, ranks with the same ``color``
share a new communicator, ordered by ``key`` (``color=None`` takes no part)::

    python -m pynccl launch -n 4 --loopback examples/split.py
    python examples/split.py [--loopback]      # starts 4 ranks itself (fewer if fewer GPUs)
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import pynccl
from pynccl.cuda import DeviceBuffer

if "RANK" not in os.environ:  # not started by a launcher: start up to four ranks
    flag = ["--loopback"] if "--loopback" in sys.argv else []
    if flag:
        from pynccl.testing import loopback

        loopback.use()
    n = str(min(4, pynccl.device_count()))
    cmd = [sys.executable, "-m", "pynccl", "launch", "-n", n, *flag, __file__]
    sys.exit(subprocess.call(cmd))

with pynccl.Communicator.from_env() as world:
    rank, size = world.rank, world.size
    color = rank % 2
    half = world.split(color, key=rank)  # every rank calls split, with its own color
    assert half is not None
    with half:
        members = [r for r in range(size) if r % 2 == color]
        assert half.size == len(members) and half.rank == members.index(rank)
        x = DeviceBuffer.from_numpy(np.full(8, rank + 1, dtype=np.float64))
        half.all_reduce(x)  # reduces over this half only
        half.synchronize(timeout=60)
        np.testing.assert_array_equal(x.to_numpy(), np.full(8, sum(r + 1 for r in members)))
        name = "odd" if color else "even"
        print(f"rank {rank}: rank {half.rank} of {half.size} in the {name} half, sum OK")
