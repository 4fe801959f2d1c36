"""torch tensors, bfloat16 included, on torch's current stream.

torch exports bfloat16 through DLPack only (it has no ``__cuda_array_interface__``
typestr); pynccl takes tensors of every type as they are. Collectives go on
``torch.cuda.current_stream()``, so they are ordered with torch's own kernels. Needs
torch with CUDA and a GPU::

    python -m pynccl launch -n 2 examples/torch_bf16.py
    python examples/torch_bf16.py                  # starts 2 ranks itself
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

import torch  # after the launcher block: the parent needs no torch

n = 4096
with pynccl.Communicator.from_env() as comm:
    rank, size = comm.rank, comm.size
    torch.cuda.set_device(comm.device)
    stream = torch.cuda.current_stream()
    device = torch.device("cuda", comm.device)

    x = (torch.arange(n, device=device) % 16 + rank).to(torch.bfloat16)  # exact in bf16
    comm.all_reduce(x, stream=stream)  # in place; bf16 travels through DLPack
    y = torch.full((n,), float(rank), device=device, dtype=torch.bfloat16)
    comm.broadcast(y, root=0, stream=stream)
    torch.cuda.synchronize()

    base = np.arange(n) % 16
    want = sum(base + r for r in range(size)).astype(np.float32)
    np.testing.assert_array_equal(x.float().cpu().numpy(), want)
    np.testing.assert_array_equal(y.float().cpu().numpy(), np.zeros(n, dtype=np.float32))
    print(f"rank {rank}/{size} on device {comm.device}: bf16 all_reduce and broadcast OK")
