#!/usr/bin/env python3
"""Calls per second of pynccl's fast path with 1 thread and with 2 threads, in one process.

Each thread issues ``all_reduce`` on its own 1-rank communicator (raw pointers, ``dtype=
"float32"``, ``op="sum"``: the README's form) against the loopback's *null* libnccl, which
validates the arguments and returns without moving data, so the figure is pynccl's host
cost. With the GIL (CPython 3.11, or 3.13t with ``PYTHON_GIL=1``) two threads take turns and
reach no more calls per second than one; on a free-threaded interpreter with the GIL off
they run at once. ``scripts/free_threaded.sh`` runs it on both interpreters.

    python scripts/threads_throughput.py [--calls 100000] [--rounds 3] [--json]

Prints the interpreter, whether its GIL is enabled, and per thread count the best round's
total calls/s (every thread's calls over the wall time from a common start to the last
thread's end); ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any


def _round(comms: list[Any], ptrs: list[tuple[int, int]], calls: int) -> tuple[float, float]:
    """One timed round: each of ``len(comms)`` threads makes ``calls`` all_reduce calls on
    its own communicator; returns the calls/s of all threads together and the process's CPU
    seconds per wall second meanwhile (at most 1 with the GIL; up to the thread count
    without it, where that many cores are free)."""
    start = threading.Barrier(len(comms) + 1)
    errors: list[BaseException] = []

    def work(comm: Any, send: int, recv: int) -> None:
        all_reduce = comm.all_reduce
        start.wait()
        try:
            for _ in range(calls):
                all_reduce(send, recv, count=1024, dtype="float32", op="sum")
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c, *p)) for c, p in zip(comms, ptrs)]
    for t in threads:
        t.start()
    start.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if errors:
        raise errors[0]
    return len(comms) * calls / elapsed, cpu / elapsed


def control(n: int = 2, loops: int = 2_000_000) -> float:
    """CPU seconds per wall second of ``n`` threads each running a pure-Python loop: the most
    this interpreter and machine give ``n`` threads right now (about 1 with the GIL, or when
    other processes hold the other cores), the ceiling for the figure's CPU/wall."""

    def spin() -> None:
        x = 0
        for i in range(loops):
            x += i

    threads = [threading.Thread(target=spin) for _ in range(n)]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def measure(calls: int, rounds: int, counts: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """The figure: ``{"python", "gil", "calls", "rounds", "calls_per_s": {threads: best},
    "cpu_per_wall": {threads: that round's CPU/wall}, "control", "loadavg"}``: ``control`` is
    :func:`control` for the largest thread count, ``loadavg`` the machine's 1-minute load
    average before the run (on a loaded machine two threads find no second core)."""
    load = os.getloadavg()[0]
    from pynccl.testing import loopback

    loopback.use(null=True)
    from pynccl import Communicator, DataType, DeviceBuffer, UniqueId

    n = max(counts)
    comms = [Communicator(1, UniqueId(), 0, device=0) for _ in range(n)]
    bufs = [DeviceBuffer(1024, DataType.FLOAT32, device=0) for _ in range(2 * n)]
    try:
        ptrs = [(bufs[2 * i].ptr, bufs[2 * i + 1].ptr) for i in range(n)]
        for comm, (s, r) in zip(comms, ptrs):  # warm the fast path's tables
            comm.all_reduce(s, r, count=1024, dtype="float32", op="sum")
        best = {k: max(_round(comms[:k], ptrs[:k], calls) for _ in range(rounds)) for k in counts}
    finally:
        for b in bufs:
            b.close()
        for c in comms:
            c.destroy()
    probe = getattr(sys, "_is_gil_enabled", None)
    return {
        "python": sys.version.split()[0] + ("t" if probe is not None and "free-threading"
                                            in sys.version else ""),
        "gil": True if probe is None else bool(probe()),
        "calls": calls,
        "rounds": rounds,
        "calls_per_s": {str(k): round(v[0]) for k, v in best.items()},
        "cpu_per_wall": {str(k): round(v[1], 2) for k, v in best.items()},
        "control": round(control(max(counts)), 2),
        "loadavg": round(load, 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls per thread per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per thread count (best kept)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error(f"--calls and --rounds must be >= 1, got {args.calls} and {args.rounds}")
    result = measure(args.calls, args.rounds)
    if args.json:
        print(json.dumps(result))
        return 0
    one, two = result["calls_per_s"]["1"], result["calls_per_s"]["2"]
    print(f"python {result['python']} (GIL {'on' if result['gil'] else 'off'}): "
          f"1 thread {one:,} calls/s, 2 threads {two:,} calls/s ({two / one:.2f}x; "
          f"CPU/wall with 2 threads {result['cpu_per_wall']['2']}, pure-Python control "
          f"{result['control']}, "
          f"load average {result['loadavg']} on {os.cpu_count()} cores)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
