"""All-reduce bandwidth of the loopback libnccl across processes on this host.

    python scripts/bench_loopback.py                 # 64 MiB float32, 4 processes
    python scripts/bench_loopback.py --nranks 2 --mib 256 --iters 5

Each rank is a separate process (the shared-memory transport). Every rank times
``iters`` all-reduces (each followed by a stream synchronize) after ``warmup``
untimed ones; the figure printed is NCCL's "algorithm bandwidth", the per-rank
buffer size divided by the time of one all-reduce (the slowest rank's mean).
The result is checked against the expected sum once.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from ctypes import byref, c_int, c_void_p

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    cudart = ctypes.CDLL(os.environ["PYNCCL_CUDART_LIBRARY"])
    nccl = ctypes.CDLL(os.environ["PYNCCL_NCCL_LIBRARY"])
    nccl.ncclGetLastError.restype = ctypes.c_char_p
    nccl.ncclGetLastError.argtypes = [c_void_p]
    nccl.ncclAllReduce.argtypes = [
        c_void_p,
        c_void_p,
        ctypes.c_size_t,
        c_int,
        c_int,
        c_void_p,
        c_void_p,
    ]
    nccl.ncclCommDestroy.argtypes = [c_void_p]
    cudart.cudaMalloc.argtypes = [ctypes.POINTER(c_void_p), ctypes.c_size_t]
    cudart.cudaFree.argtypes = [c_void_p]
    cudart.cudaMemcpy.argtypes = [c_void_p, c_void_p, ctypes.c_size_t, c_int]
    cudart.cudaStreamCreate.argtypes = [ctypes.POINTER(c_void_p)]
    cudart.cudaStreamSynchronize.argtypes = [c_void_p]
    cudart.cudaStreamDestroy.argtypes = [c_void_p]
    return nccl, cudart


class _Uid(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def _check(rc: int, what: str, nccl: ctypes.CDLL) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with {rc}: {nccl.ncclGetLastError(None).decode()}")


def worker(uid_hex: str, rank: int, nranks: int, count: int, iters: int, warmup: int) -> None:
    nccl, cudart = _libs()
    uid = _Uid()
    ctypes.memmove(byref(uid), bytes.fromhex(uid_hex), 128)
    _check(cudart.cudaSetDevice(rank % 8), "cudaSetDevice", nccl)
    comm = c_void_p()
    _check(nccl.ncclCommInitRank(byref(comm), nranks, uid, rank), "ncclCommInitRank", nccl)
    nbytes = count * 4
    send, recv, stream = c_void_p(), c_void_p(), c_void_p()
    _check(cudart.cudaMalloc(byref(send), nbytes), "cudaMalloc", nccl)
    _check(cudart.cudaMalloc(byref(recv), nbytes), "cudaMalloc", nccl)
    _check(cudart.cudaStreamCreate(byref(stream)), "cudaStreamCreate", nccl)
    host = np.full(count, rank + 1, dtype=np.float32)
    _check(cudart.cudaMemcpy(send, host.ctypes.data, nbytes, 1), "cudaMemcpy", nccl)
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        _check(nccl.ncclAllReduce(send, recv, count, 7, 0, comm, stream), "ncclAllReduce", nccl)
        _check(cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize", nccl)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    out = np.empty(count, dtype=np.float32)
    _check(cudart.cudaMemcpy(out.ctypes.data, recv, nbytes, 2), "cudaMemcpy", nccl)
    expected = nranks * (nranks + 1) / 2
    correct = bool(np.all(out == expected))
    _check(nccl.ncclCommDestroy(comm), "ncclCommDestroy", nccl)
    cudart.cudaStreamDestroy(stream)
    cudart.cudaFree(send)
    cudart.cudaFree(recv)
    print(json.dumps({"rank": rank, "times": times, "correct": correct}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nranks", type=int, default=4)
    parser.add_argument("--mib", type=float, default=64.0, help="per-rank buffer (MiB)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--version", default=None, help="emulated NCCL release, e.g. 2.18.1")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        uid, rank, nranks, count, iters, warmup = args.worker
        worker(uid, int(rank), int(nranks), int(count), int(iters), int(warmup))
        return 0

    from pynccl.testing import loopback

    env = {**os.environ, **loopback.env(args.version)}
    nccl = ctypes.CDLL(env["PYNCCL_NCCL_LIBRARY"])
    uid = _Uid()
    if nccl.ncclGetUniqueId(byref(uid)) != 0:
        raise SystemExit("ncclGetUniqueId failed")
    count = int(args.mib * (1 << 20)) // 4
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", bytes(uid).hex()]
    procs = [
        subprocess.Popen(
            [*cmd, str(r), str(args.nranks), str(count), str(args.iters), str(args.warmup)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(args.nranks)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"a worker failed with exit code {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    nbytes = count * 4
    per_iter = max(float(np.mean(r["times"])) for r in results)
    best = max(float(np.min(r["times"])) for r in results)
    print(
        f"all-reduce float32, {nbytes / (1 << 20):.0f} MiB per rank, {args.nranks} processes, "
        f"{args.iters} iterations: {per_iter * 1e3:.1f} ms each (best {best * 1e3:.1f} ms); "
        f"algorithm bandwidth {nbytes / per_iter / 1e9:.2f} GB/s "
        f"(best {nbytes / best / 1e9:.2f} GB/s); "
        f"correct: {all(r['correct'] for r in results)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
