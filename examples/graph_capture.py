"""Capture collectives into a CUDA graph once, then replay it: one launch per step.

``pynccl.cuda.Graph`` needs no other CUDA library. Every rank captures the same
collectives and replays its own graph; the graph reads its buffers when it runs, so
new inputs are copied into the same buffers before each replay::

    python -m pynccl launch -n 2 --loopback examples/graph_capture.py
    python examples/graph_capture.py [--loopback]      # starts 2 ranks itself
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import pynccl
from pynccl.cuda import DeviceBuffer, Graph, Stream

if "RANK" not in os.environ:  # not started by a launcher: start two ranks of this file
    flag = ["--loopback"] if "--loopback" in sys.argv else []
    cmd = [sys.executable, "-m", "pynccl", "launch", "-n", "2", *flag, __file__]
    sys.exit(subprocess.call(cmd))

n = 512
with pynccl.Communicator.from_env() as comm:
    rank, size = comm.rank, comm.size
    stream = Stream(non_blocking=True)  # the legacy default stream cannot be captured
    x = DeviceBuffer(n, "float32")  # allocate before capturing: cudaMalloc breaks a capture
    total = DeviceBuffer(n, "float32")

    with Graph() as graph:
        with graph.capture(stream):  # recorded, not run
            comm.all_reduce(x, total, stream=stream)
            comm.all_reduce(total, op="max", stream=stream)  # in place, a second collective

        for step in range(3):
            x.copy_from(np.full(n, rank + step, dtype=np.float32), stream=stream)
            graph.replay()  # on the stream it was captured from
            comm.synchronize(stream, timeout=60)
            want = sum(r + step for r in range(size))  # the max over ranks of equal sums
            np.testing.assert_array_equal(total.to_numpy(), np.full(n, want, dtype=np.float32))

    stream.close()
    print(f"rank {rank}: 3 replays of a graph of 2 collectives OK")
