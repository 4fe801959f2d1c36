#!/usr/bin/env python3
"""Per-call cost of the adaptation layer's handlers, the part of a collective call that
``pynccl._adapt`` owns: what the object API pays, per buffer, before its C call.

Measured in one process, interleaving the variants round by round so machine noise hits
all alike; prints the median and the best round (ns per call, the loop's own cost
subtracted) of each, and the ratio to the floor, a bare ctypes ``ncclAllReduce`` on the
loopback null build (as in ``scripts/bench_overhead.py``):

* ``as_buffer`` on a raw pointer, and the handlers the object API calls directly
  (``_BUFFER_HANDLERS[type(obj)](obj, None, None, name, writable, None)``) for a
  ``__cuda_array_interface__`` object, a :class:`pynccl.cuda.DeviceBuffer` and a DLPack
  producer, and ``as_stream`` on a stream object;
* with ``--baseline FILE`` (an older single-file ``_adapt.py``, e.g.
  ``git show bf97c0c:pynccl/_adapt.py > /tmp/adapt_old.py``), the same calls through it,
  interleaved with the current ones, and the ratio current / baseline.

    python scripts/bench_adapt.py [--rounds 40] [--calls 4000] [--baseline FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_overhead import CaiArray  # the same stand-in for a CuPy array


class TorchLikeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


def load_baseline(path: str) -> ModuleType:
    # Loaded inside the pynccl package so that its relative imports (dtypes, enums) resolve.
    spec = importlib.util.spec_from_file_location("pynccl._adapt_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def variants_of(adapt: Any, tag: str, objs: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    as_buffer, as_stream, handlers = adapt.as_buffer, adapt.as_stream, adapt._BUFFER_HANDLERS
    ptr, n, f32 = objs["ptr"], objs["n"], objs["f32"]
    out: dict[str, Callable[[], Any]] = {
        f"as_buffer raw{tag}": lambda: as_buffer(ptr, n, f32),
        f"as_stream torch-like{tag}": lambda: as_stream(objs["stream"]),
    }
    for kind in ("CAI", "DeviceBuffer", "DLPack"):
        obj = objs[kind]
        adapt.buffer_handler(obj, "sendbuf")  # fill the cache
        out[f"handler {kind}{tag}"] = lambda obj=obj: handlers[type(obj)](
            obj, None, None, "recvbuf", True, None
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--baseline", help="an older single-file _adapt.py to compare with")
    args = parser.parse_args()

    import numpy as np
    import support.producers as P

    from pynccl.testing import loopback

    build = loopback.use(null=True)
    from pynccl import DataType
    from pynccl import _adapt as current
    from pynccl.cuda import DeviceBuffer

    n = 1024
    buf = DeviceBuffer(n, DataType.FLOAT32)
    host = np.zeros(n, np.float32)
    objs = {
        "ptr": buf.ptr,
        "n": n,
        "f32": DataType.FLOAT32,
        "CAI": CaiArray(buf.ptr, n),
        "DeviceBuffer": buf,
        "DLPack": P.DLPackProducer(host),
        "stream": TorchLikeStream(0x10),
    }
    bare = ctypes.CDLL(build.nccl).ncclAllReduce
    bare.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    bare.restype = ctypes.c_int
    send = buf.ptr
    variants: dict[str, Callable[[], Any]] = {
        "floor (bare ctypes)": lambda: bare(send, send, n, 7, 0, None, 0)
    }
    variants.update(variants_of(current, "", objs))
    if args.baseline:
        variants.update(variants_of(load_baseline(args.baseline), " [baseline]", objs))

    empty: Callable[[], Any] = lambda: None  # noqa: E731
    samples: dict[str, list[float]] = {k: [] for k in variants}
    base: list[float] = []
    perf = time.perf_counter_ns
    for fn in variants.values():
        for _ in range(200):
            fn()
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

    loop, loop_best = statistics.median(base), min(base)
    medians = {k: max(statistics.median(v) - loop, 1e-9) for k, v in samples.items()}
    bests = {k: max(min(v) - loop_best, 1e-9) for k, v in samples.items()}
    floor, floor_best = medians["floor (bare ctypes)"], bests["floor (bare ctypes)"]
    print(
        f"pynccl._adapt per-call cost ({args.rounds} rounds x {args.calls} calls, loop cost "
        f"{loop:.0f} ns subtracted; floor = bare ctypes ncclAllReduce, null loopback)"
    )
    print(f"{'variant':<36}{'median ns':>10}{'x floor':>9}{'best ns':>9}{'x floor':>9}  vs base")
    for name, value in medians.items():
        best = bests[name]
        versus = ""
        other = f"{name} [baseline]"
        if other in bests:
            versus = f"{best / bests[other]:.2f}x (best)"
        print(
            f"{name:<36}{value:>10.0f}{value / floor:>9.2f}{best:>9.0f}{best / floor_best:>9.2f}"
            f"  {versus}"
        )
    buf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
