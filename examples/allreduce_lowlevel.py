"""All-reduce through the low-level layer: NCCL's C functions by their C names, over ctypes.

One process drives every device (``ncclCommInitAll``), as NCCL's own single-process
examples do, so this needs no launcher::

    python examples/allreduce_lowlevel.py              # on the GPUs
    python examples/allreduce_lowlevel.py --loopback   # without a GPU (host-memory stand-ins)
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

import pynccl

if "--loopback" in sys.argv:
    from pynccl.testing import loopback

    loopback.use()

L = pynccl.lib()  # the loaded libnccl; its attributes are nccl.h's functions
rt = pynccl.cudart()  # the CUDA runtime, same scheme
n = 1024  # elements per device

ndev_c = ctypes.c_int()
rt.cudaGetDeviceCount(ctypes.byref(ndev_c))
ndev = min(ndev_c.value, 4)

# One communicator per device, all in this process.
comms = (ctypes.c_void_p * ndev)()
devlist = (ctypes.c_int * ndev)(*range(ndev))
L.ncclCommInitAll(comms, ndev, devlist)

inputs = [np.arange(n, dtype=np.float32) * (d + 1) for d in range(ndev)]
bufs, streams = [], []
for d in range(ndev):
    rt.cudaSetDevice(d)
    buf, stream = ctypes.c_void_p(), ctypes.c_void_p()
    rt.cudaMalloc(ctypes.byref(buf), n * 4)
    rt.cudaStreamCreate(ctypes.byref(stream))
    rt.cudaMemcpy(buf, inputs[d].ctypes.data, n * 4, 1)  # 1: cudaMemcpyHostToDevice
    bufs.append(buf)
    streams.append(stream)

# Several ranks from one thread: one group, so NCCL launches them together.
L.ncclGroupStart()
for d in range(ndev):
    L.ncclAllReduce(
        bufs[d], bufs[d], n, pynccl.DataType.FLOAT32, pynccl.RedOp.SUM, comms[d], streams[d]
    )
L.ncclGroupEnd()

expected = np.sum(inputs, axis=0)
for d in range(ndev):
    rt.cudaSetDevice(d)
    rt.cudaStreamSynchronize(streams[d])
    out = np.empty(n, dtype=np.float32)
    rt.cudaMemcpy(out.ctypes.data, bufs[d], n * 4, 2)  # 2: cudaMemcpyDeviceToHost
    np.testing.assert_array_equal(out, expected)
    rt.cudaFree(bufs[d])
    rt.cudaStreamDestroy(streams[d])
    L.ncclCommDestroy(comms[d])

print(f"ncclAllReduce on {ndev} devices (NCCL {'.'.join(map(str, L.version))}): OK")
