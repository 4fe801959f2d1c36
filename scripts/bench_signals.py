#!/usr/bin/env python3
"""Per-call host cost of the one-sided operations and of window registration.

Runs against the loopback *null* libnccl (calls validate their arguments and return
without moving data) on a one-rank communicator, interleaving every variant round by
round so machine noise hits all of them alike:

* ``signal``       ``comm.signal(0)`` against the bare ctypes ``ncclSignal``
* ``put_signal``   ``comm.put_signal(buf, 0, win)`` (a DeviceBuffer in a symmetric window)
                   against the bare ``ncclPutSignal``
* ``wait_signal``  ``comm.wait_signal(SignalWait(0))`` against the bare ``ncclWaitSignal``
                   with a prebuilt descriptor

and, on the full (not null) loopback with two rank threads, what ``register_window`` +
``close`` costs with the ranks' agreement (one all_gather and a stream wait) against the
bare ``ncclCommWindowRegister`` + ``ncclCommWindowDeregister``.

Prints medians over the rounds (ns per call, the loop's own cost subtracted) and their
ratio to the floor. No targets: these run once per transfer, not per element.

    python scripts/bench_signals.py [--rounds 20] [--calls 2000]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def _loop_ns(fn: Callable[[], object], calls: int) -> float:
    t = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t) / calls


def one_sided(rounds: int, calls: int) -> dict[str, tuple[float, float]]:
    from pynccl.testing import loopback

    loopback.use(null=True)
    import pynccl
    from pynccl import Communicator, SignalWait, UniqueId
    from pynccl._capi.structs import ncclWaitSignalDesc_t

    comm = Communicator(1, UniqueId(), 0, device=0)
    buf = comm.mem_alloc(256, "float32")
    win = comm.register_window(buf)
    L = pynccl.lib()
    h, wh, ptr = comm.handle, win.handle, buf.ptr
    sig, put, wait = L.raw("ncclSignal"), L.raw("ncclPutSignal"), L.raw("ncclWaitSignal")
    desc = (ncclWaitSignalDesc_t * 1)()
    desc[0].opCnt, desc[0].peer = 1, 0
    sw = SignalWait(0)
    variants: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "signal": (lambda: sig(0, 0, 0, 0, h, 0), lambda: comm.signal(0)),
        "put_signal": (
            lambda: put(ptr, 256, 7, 0, wh, 0, 0, 0, 0, h, 0),
            lambda: comm.put_signal(buf, 0, win),
        ),
        "wait_signal": (lambda: wait(1, desc, h, 0), lambda: comm.wait_signal(sw)),
    }
    empty: list[float] = []
    samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in variants}
    for _ in range(rounds):
        empty.append(_loop_ns(lambda: None, calls))
        for name, (floor, api) in variants.items():
            samples[name][0].append(_loop_ns(floor, calls))
            samples[name][1].append(_loop_ns(api, calls))
    base = statistics.median(empty)
    out = {}
    for name, (floor_s, api_s) in samples.items():
        out[name] = (statistics.median(floor_s) - base, statistics.median(api_s) - base)
    win.close()
    buf.close()
    comm.destroy()
    return out


def registration(rounds: int) -> tuple[float, float]:
    """(bare, object API) microseconds per register + close on two rank threads."""
    from pynccl.testing import loopback

    loopback.use()
    from pynccl import Communicator, UniqueId
    from pynccl.enums import WinFlag

    uid = UniqueId()
    comms: list[Any] = [None, None]
    times: list[list[tuple[float, float]]] = [[], []]
    barrier = threading.Barrier(2)

    def rank(r: int) -> None:
        comms[r] = comm = Communicator(2, uid, r, device=r)
        buf = comm.mem_alloc(1 << 16)
        L = comm.library
        for _ in range(rounds):
            barrier.wait()
            t = time.perf_counter_ns()
            out = ctypes.c_void_p()
            L.ncclCommWindowRegister(comm.handle, buf.ptr, buf.nbytes, ctypes.byref(out),
                                     int(WinFlag.COLL_SYMMETRIC))  # fmt: skip
            L.ncclCommWindowDeregister(comm.handle, out.value)
            bare = time.perf_counter_ns() - t
            barrier.wait()
            t = time.perf_counter_ns()
            comm.register_window(buf).close()
            times[r].append((bare / 1e3, (time.perf_counter_ns() - t) / 1e3))
        buf.close()
        comm.destroy()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = times[0]
    return statistics.median(b for b, _ in rows), statistics.median(a for _, a in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    print(f"# one-sided calls, null loopback, {args.rounds} rounds x {args.calls} calls")
    print(f"# {'call':<12} {'floor ns':>9} {'pynccl ns':>10} {'ratio':>6}")
    for name, (floor, api) in one_sided(args.rounds, args.calls).items():
        print(f"  {name:<12} {floor:9.0f} {api:10.0f} {api / floor:6.2f}")
    # The null build stays loaded in this process: measure registration in a fresh one.
    import subprocess

    code = (
        "import sys; sys.path.insert(0, 'scripts'); import bench_signals as b; "
        f"print(*b.registration({max(args.rounds, 5)}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    bare, api = (float(v) for v in proc.stdout.split())
    print("# register_window + close, 2 rank threads, full loopback (us, median)")
    print(f"  bare {bare:.0f} us, pynccl {api:.0f} us (with the ranks' agreement), "
          f"ratio {api / bare:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
