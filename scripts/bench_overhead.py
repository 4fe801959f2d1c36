#!/usr/bin/env python3
"""Per-call host overhead of pynccl's layers, against the floor of any ctypes binding.

Runs against the loopback *null* libnccl (collectives validate their arguments and
return without moving data), in one process, interleaving the variants round by
round so machine noise hits all of them alike. Prints medians over the rounds (ns
per call) and the ratio of each to the floor's median; the best round of each, and
its ratio to the floor's best, show how much of the spread is machine noise:

* floor        bare ctypes ``ncclAllReduce`` with argtypes/restype set, no checks
* low-level    ``pynccl.lib().ncclAllReduce(...)`` (checked, raises typed errors)
* comm raw     ``Communicator.all_reduce(ptr, ptr, count=, dtype=)``
* comm CAI     ``Communicator.all_reduce(a, b)``, ``a``/``b`` exposing ``__cuda_array_interface__``
* comm DevBuf  the same with :class:`pynccl.cuda.DeviceBuffer`

Targets (issue 6): low-level <= 1.15x, comm raw <= 1.5x, comm CAI <= 3x the floor.
Also prints the time of ``import pynccl`` in a fresh interpreter (median of 7).

    python scripts/bench_overhead.py [--rounds 60] [--calls 3000]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time
from typing import Any, Callable


class CaiArray:
    """A minimal device-array object, as CuPy or Numba would expose it."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<f4",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def import_time_ms(repeat: int = 7) -> float:
    code = "import time; t = time.perf_counter(); import pynccl; print(time.perf_counter() - t)"
    samples = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout) * 1e3
        for _ in range(repeat)
    ]  # fmt: skip
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()

    from pynccl.testing import loopback

    build = loopback.use(null=True)
    import pynccl
    from pynccl import DataType, RedOp
    from pynccl.comm import Communicator, UniqueId
    from pynccl.cuda import DeviceBuffer

    n = 1024
    comm = Communicator(1, UniqueId(), 0, device=0)
    a = DeviceBuffer(n, DataType.FLOAT32)
    b = DeviceBuffer(n, DataType.FLOAT32)
    send, recv, h = a.ptr, b.ptr, comm.handle

    bare = ctypes.CDLL(build.nccl).ncclAllReduce
    bare.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    bare.restype = ctypes.c_int
    low = pynccl.lib().ncclAllReduce
    f32, op = DataType.FLOAT32, RedOp.SUM
    ca, cb = CaiArray(send, n), CaiArray(recv, n)
    all_reduce = comm.all_reduce

    variants: dict[str, Callable[[], Any]] = {
        "floor (bare ctypes)": lambda: bare(send, recv, n, 7, 0, h, 0),
        "low-level lib()": lambda: low(send, recv, n, f32, op, h, 0),
        "comm raw pointers": lambda: all_reduce(send, recv, count=n, dtype=f32),
        "comm CAI objects": lambda: all_reduce(ca, cb),
        "comm DeviceBuffer": lambda: all_reduce(a, b),
    }
    # The lambda frame is common to all variants; measure it to subtract it.
    empty: Callable[[], Any] = lambda: None  # noqa: E731
    samples: dict[str, list[float]] = {k: [] for k in variants}
    base: list[float] = []
    perf = time.perf_counter_ns
    for fn in variants.values():
        for _ in range(200):
            fn()  # warm up (binding, caches)
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = perf()
            for _ in range(args.calls):
                fn()
            samples[name].append((perf() - t0) / args.calls)
        t0 = perf()
        for _ in range(args.calls):
            empty()
        base.append((perf() - t0) / args.calls)

    loop = statistics.median(base)
    medians = {k: max(statistics.median(v) - loop, 1e-9) for k, v in samples.items()}
    bests = {k: max(min(v) - min(base), 1e-9) for k, v in samples.items()}
    floor, floor_best = medians["floor (bare ctypes)"], bests["floor (bare ctypes)"]
    targets = {"low-level lib()": 1.15, "comm raw pointers": 1.5, "comm CAI objects": 3.0}
    print(
        "pynccl per-call overhead, ncclAllReduce on the loopback null build "
        f"({args.rounds} rounds x {args.calls} calls, loop cost {loop:.0f} ns subtracted)"
    )
    print(f"{'variant':<22}{'median ns':>10}{'x floor':>9}{'best ns':>9}{'x floor':>9}  target")
    for name, value in medians.items():
        target = targets.get(name)
        verdict = (
            ""
            if target is None
            else f"<= {target:.2f}x " + ("ok" if value / floor <= target else "MISSED")
        )
        best = bests[name]
        print(
            f"{name:<22}{value:>10.0f}{value / floor:>9.2f}{best:>9.0f}{best / floor_best:>9.2f}"
            f"  {verdict}"
        )
    print(f"import pynccl: {import_time_ms():.1f} ms (median of 7 fresh interpreters)")
    a.close()
    b.close()
    comm.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
