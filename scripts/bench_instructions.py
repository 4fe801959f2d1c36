#!/usr/bin/env python3
"""Per-call cost of pynccl's object API in CPU instructions: the noise-free counterpart of
``scripts/bench_overhead.py``, and what CPython itself costs for the constructs that bound it.

Timings on a shared machine move by several per cent from run to run; instruction counts do
not. For every variant of ``bench_overhead.py`` chosen (``--only REGEX``, searched in the
names; default: ``all_reduce`` and ``send+recv``) and its floor, this runs a loop of ``K``
and of ``3K`` calls under valgrind's callgrind, counts the instructions of the main thread
alone (the loopback's worker threads poll at their own pace) with a fixed hash seed, and
prints the difference per C call: start-up and set-up cancel out, and the same build counts
the same number every run. Each variant's ratio to its floor is judged against the targets
of issue 21, as ``bench_overhead.py`` judges its timed ratios.

``--protocol`` prints what CPython 3.x costs for the pieces every call of a Python binding
is made of, each measured the same way against an empty loop — the lower bounds that the
targets meet (or do not): a ``with`` statement over a context manager whose
``__enter__``/``__exit__`` do nothing, a call of a Python-class instance with and without a
keyword (``op()``, ``op(stream=s)``), a method call with a keyword, a thread-local
attribute, a ``threading.local`` read, a 7-tuple, an int-keyed dict lookup.

    python scripts/bench_instructions.py [--only REGEX] [--calls K] [--protocol]

Needs valgrind (``apt-get install valgrind``); says so and exits 2 without it.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from _bench_kit import callgrind_per_call

#: (what it is, set-up, the statement timed): CPython's own costs (``--protocol``).
PROTOCOL = (
    ("empty loop (subtracted from every row below)", "", "pass"),
    ("with cm: pass (Python __enter__/__exit__ that do nothing)",
     "class CM:\n    def __enter__(self): return self\n    def __exit__(self, a, b, c): "
     "return None\ncm = CM()", "with cm: pass"),
    ("op() (a Python class's __call__, nothing done)",
     "class Op:\n    def __call__(self, stream=None): return None\nop = Op(); s = 12345",
     "op()"),
    ("op(stream=s) (the same, a keyword: CPython builds a dict)",
     "class Op:\n    def __call__(self, stream=None): return None\nop = Op(); s = 12345",
     "op(stream=s)"),
    ("obj.m(stream=s) (a method, a keyword: no dict)",
     "class O:\n    def m(self, stream=None): return None\nobj = O(); s = 12345",
     "obj.m(stream=s)"),
    ("local.s (a threading.local attribute)",
     "import threading\nlocal = threading.local(); local.s = 1", "local.s"),
    ("(a, b, c, d, e, f, g) (a 7-tuple, made and freed)", "a = b = c = d = e = f = g = 1.5",
     "(a, b, c, d, e, f, g)"),
    ("d[k] (an int-keyed dict lookup)", "k = 1 << 40\nd = {k: 1}", "d[k]"),
    ("gate.pop(); gate.append(True) (a list as a lock)", "gate = [True]",
     "gate.pop(); gate.append(True)"),
)  # fmt: skip


def _child_variant(name: str, k: int) -> None:
    import bench_overhead

    stack: list = []  # type: ignore[type-arg]
    variants, _, _ = bench_overhead.build_variants(1024, stack)
    fn = variants[name].fn
    for _ in range(k):
        fn()
    for close in reversed(stack):
        close()


def _child_statement(index: int, k: int) -> None:
    _, setup, stmt = PROTOCOL[index]
    space: dict[str, object] = {}
    exec(setup, space)  # this script's own table
    exec(f"def _loop(_n):\n    for _ in range(_n):\n        {stmt}\n", space)
    space["_loop"](k)  # type: ignore[operator]


def protocol(k: int) -> None:
    print(f"CPython {sys.version.split()[0]}: instructions per statement (callgrind, main thread)")
    base = callgrind_per_call([__file__, "--stmt", "0"], k)
    print(f"  {base:7.0f}  {PROTOCOL[0][0]}")
    for i, (what, _, _) in enumerate(PROTOCOL[1:], 1):
        n = callgrind_per_call([__file__, "--stmt", str(i)], k) - base
        print(f"  {n:7.0f}  {what}")


def variants(pattern: str, k: int) -> int:
    import bench_overhead

    stack: list = []  # type: ignore[type-arg]
    found, notes, _ = bench_overhead.build_variants(1024, stack)
    for close in reversed(stack):
        close()
    chosen = bench_overhead.select(found, pattern)
    print(f"pynccl per C call in instructions (callgrind, main thread; loops of {k} and "
          f"{3 * k} calls), Python {sys.version.split()[0]}")  # fmt: skip
    print(f"{'call':30s} {'instr':>8s} {'x floor':>8s}  target")
    floors: dict[str, float] = {}
    missed = 0
    for name, var in chosen.items():
        n = callgrind_per_call([__file__, "--variant", name], k) / var.c_calls
        if var.floor is None:
            floors[name] = n
            print(f"{name:30s} {n:8.0f}")
            continue
        ratio = n / floors[var.floor]
        target = bench_overhead.TARGETS[var.kind]
        ok = ratio <= target
        missed += not ok
        print(f"{name:30s} {n:8.0f} {ratio:8.2f}  <= {target:.2f}x {'ok' if ok else 'MISSED'}")
    for note in notes:
        print(note)
    print(f"{missed} target(s) missed")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        default=r"^(all_reduce|send\+recv) ",
        help="the variants whose name matches REGEX (searched)",
    )
    parser.add_argument("--calls", type=int, default=1000, help="K: loops of K and 3K calls")
    parser.add_argument(
        "--protocol",
        action="store_true",
        help="CPython's own costs of the constructs a call is made of",
    )
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child: one variant's loop
    parser.add_argument("--stmt", type=int, help=argparse.SUPPRESS)  # a child: a statement
    parser.add_argument("k", nargs="?", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        _child_variant(args.variant, args.k)
        return 0
    if args.stmt is not None:
        _child_statement(args.stmt, args.k)
        return 0
    if shutil.which("valgrind") is None:
        print("bench_instructions: valgrind is not installed (apt-get install valgrind)")
        return 2
    if args.protocol:
        protocol(args.calls * 2)
        return 0
    return variants(args.only, args.calls)


if __name__ == "__main__":
    sys.exit(main())
