#!/usr/bin/env python3
"""Per-call host overhead of pynccl's object API, for the argument forms users write.

Runs against the loopback *null* libnccl (collectives validate their arguments and return
without moving data), in one process, through the public API only. Every variant is timed
next to its floor, a bare ctypes function of the same C symbol with ``argtypes``/``restype``
set (its prototype written out here from ``nccl.h``), interleaved round by round so that
machine noise hits both alike; the verdict is on the median of the per-round ratios.

For every collective (``all_reduce`` ... ``all_to_all``) and for ``send``+``recv`` as a pair
inside ``pynccl.group()`` (against bare ``ncclGroupStart/ncclSend/ncclRecv/ncclGroupEnd``,
figures per C call), the variants are (issue 21's table):

raw pointers (target <= 1.2x, and the spread between a row's raw forms <= 10 %):
* ``enum``       ``dtype=DataType.FLOAT32, op=RedOp.SUM``, the same int objects every call
* ``str``        ``dtype="float32", op="sum"`` (the README's form)
* ``np-type``    ``dtype=np.float32``;  ``np-dtype``: ``dtype=np.dtype("float32")``
* ``alias-fp32`` / ``alias-bf16``  ``dtype="fp32"`` / ``"bf16"``, when pynccl accepts them
  (a line says so when it does not)
* ``fresh``      pointers and count made afresh at every call (``ptr + 0``, as
                 ``t.data_ptr()`` makes them; the floor makes them too);
                 ``fresh+stream``: the same with ``stream=<int>`` (vLLM's call site)
* ``stream-int`` ``stream=<int>``;  ``stream-obj``: ``stream=pynccl.Stream``;
  ``str+stream``: the README's form with ``stream=<int>``
* ``rotate4``    four buffer pairs in turn (the floor rotates through them too)

buffer objects (target <= 1.8x; the floor calls the producer as any consumer would):
* ``CAI``        ``__cuda_array_interface__`` built afresh at every read, as CuPy, Numba and
                 torch build theirs (the floor reads both interfaces)
* ``DLPack``     a CUDA-device DLPack producer (a ``DLManagedTensorVersioned`` wrapped in a
                 new capsule at every export; the floor exports both)
* ``DevBuf``     :class:`pynccl.DeviceBuffer`;  each also with ``stream=`` (``-stream``)

persistent operations (target <= 0.8x): ``op()`` and ``op(stream=<int>)`` of
``op = comm.<method>_init(...)``.

Then ``with pynccl.group(): pass`` against a bare ``ncclGroupStart(); ncclGroupEnd()``, in
user-space CPU instructions counted with Linux ``perf_event_open`` (target <= 1,500 over the
bare pair); where the kernel gives no hardware counter (a VM) it says so and prints ns, or
with ``--callgrind`` counts them under valgrind's callgrind (runs of this script looping
1,000 and 3,000 times, so that start-up and set-up cancel out).

Prints per variant its median ns per C call (the loop's own cost subtracted), the median of
its per-round ratios to its floor, the best round's ratio, its target and ok/MISSED; then the
spread of each row's raw forms, and a summary of the targets missed. The import times are
``scripts/bench_import.py``'s (from a wheel: an editable install's finder adds ~15 ms).

    python scripts/bench_overhead.py [--rounds 20] [--calls 1000] [--quick] [--only REGEX]
                                     [--callgrind]
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _bench_kit import (
    CaiArray,
    DLPackArray,
    FreshCaiArray,
    InstructionCounter,
    group_callgrind,
    group_instructions,
    group_ns,
    run_group_loop,
)

__all__ = ["CaiArray", "build_variants", "main"]  # CaiArray: scripts/bench_adapt.py's

#: Targets of issue 21, by variant class.
TARGETS = {"raw": 1.2, "object": 1.8, "pair": 1.5, "persistent": 0.8}
#: The spread between one row's raw forms (max ratio / min ratio - 1).
SPREAD_TARGET = 0.10
#: ``with group(): pass`` over a bare ncclGroupStart/End pair, user-space instructions.
GROUP_TARGET = 1500

NCCL_FLOAT32, NCCL_SUM = 7, 0  # ncclFloat32, ncclSum in nccl.h

#: (method, C function, takes an op, takes a root): every collective, in nccl.h's argument
#: order (send, recv, count, datatype[, op][, root], comm, stream).
COLLECTIVES = (
    ("all_reduce", "ncclAllReduce", True, False),
    ("broadcast", "ncclBroadcast", False, True),
    ("reduce", "ncclReduce", True, True),
    ("all_gather", "ncclAllGather", False, False),
    ("reduce_scatter", "ncclReduceScatter", True, False),
    ("gather", "ncclGather", False, True),
    ("scatter", "ncclScatter", False, True),
    ("all_to_all", "ncclAlltoAll", False, False),
)


@dataclass
class Variant:
    fn: Callable[[], Any]
    floor: str | None  # the name of its floor; None for a floor
    kind: str = ""  # a key of TARGETS, "" for a floor
    c_calls: int = 1  # C calls per invocation: the ns column is per C call


def _bare(cdll: ctypes.CDLL, name: str, argtypes: list[Any]) -> Any:
    fn = getattr(cdll, name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def _argtypes(has_op: bool, has_root: bool) -> list[Any]:
    vp, i = ctypes.c_void_p, ctypes.c_int
    return [vp, vp, ctypes.c_size_t, i] + [i] * (has_op + has_root) + [vp, vp]


def _caller(m: Callable[..., Any], has_op: bool) -> Callable[..., Callable[[], Any]]:
    """``make(s, r, n, dt, op, stream)`` -> a call written as a user writes it (keywords
    spelled out, ``stream=`` only when given), so no ``**kwargs`` cost is measured."""

    def make(s: Any, r: Any, n: Any, dt: Any, op: Any, st: Any = None) -> Callable[[], Any]:
        if has_op and st is None:
            return lambda: m(s, r, count=n, dtype=dt, op=op)
        if has_op:
            return lambda: m(s, r, count=n, dtype=dt, op=op, stream=st)
        if st is None:
            return lambda: m(s, r, count=n, dtype=dt)
        return lambda: m(s, r, count=n, dtype=dt, stream=st)

    return make


def _fresh(m: Callable[..., Any], has_op: bool, s: int, r: int, n: int, dt: Any, op: Any,
           st: int | None = None) -> Callable[[], Any]:  # fmt: skip
    """A call whose pointers, count (and stream) are new int objects every time, as
    ``t.data_ptr()``, ``t.numel()`` and ``torch.cuda.current_stream().cuda_stream`` give."""
    if has_op and st is None:
        return lambda: m(s + 0, r + 0, count=n + 0, dtype=dt, op=op)
    if st is None:
        return lambda: m(s + 0, r + 0, count=n + 0, dtype=dt)
    h = st
    if has_op:
        return lambda: m(s + 0, r + 0, count=n + 0, dtype=dt, op=op, stream=h + 0)
    return lambda: m(s + 0, r + 0, count=n + 0, dtype=dt, stream=h + 0)


def dtype_forms(np: Any) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """``{form: (dtype, op)}`` of the raw rows, and a note per alias pynccl refuses."""
    from pynccl import DataType, RedOp, as_datatype

    forms: dict[str, tuple[Any, Any]] = {
        "enum": (DataType.FLOAT32, RedOp.SUM),
        "str": ("float32", "sum"),
        "np-type": (np.float32, RedOp.SUM),
        "np-dtype": (np.dtype("float32"), RedOp.SUM),
    }
    notes = []
    for alias in ("fp32", "bf16"):
        try:
            as_datatype(alias)
        except (TypeError, ValueError) as exc:
            notes.append(f"dtype={alias!r} is not accepted ({exc.__class__.__name__}): not timed")
        else:
            forms[f"alias-{alias}"] = (alias, "sum")
    return forms, notes


@dataclass
class Objects:
    """What every variant reuses: the communicator, its buffers, streams and producers."""

    comm: Any
    s: int  # send and receive device addresses
    r: int
    n: int
    h: int  # the communicator's handle
    st: Any  # a pynccl Stream, and its handle
    sh: int
    pairs: list[tuple[int, int]]  # four more buffer pairs, in turn
    devbufs: tuple[Any, Any]  # DeviceBuffers of s and r
    cais: tuple[FreshCaiArray, FreshCaiArray]
    dls: tuple[DLPackArray, DLPackArray]


def build_variants(
    n: int, stack: list[Callable[[], Any]], watchdog: float | None = None
) -> tuple[dict[str, Variant], list[str], ctypes.CDLL]:
    import numpy as np

    from pynccl.testing import loopback

    build = loopback.use(null=True)
    from pynccl import Communicator, DataType, DeviceBuffer, Stream, UniqueId

    comm = Communicator(1, UniqueId(), 0, device=0)
    stack.append(comm.destroy)
    if watchdog is not None:  # its per-call event, and the flight record's states
        comm.start_watchdog(watchdog)
    bufs = [DeviceBuffer(n, DataType.FLOAT32) for _ in range(10)]
    stack.extend(b.close for b in bufs)
    st = Stream()
    stack.append(st.close)
    s, r = bufs[0].ptr, bufs[1].ptr
    o = Objects(
        comm, s, r, n, comm.handle, st, st.handle,
        [(bufs[2 * i].ptr, bufs[2 * i + 1].ptr) for i in range(1, 5)],
        (bufs[0], bufs[1]), (FreshCaiArray(s, n), FreshCaiArray(r, n)),
        (DLPackArray(s, n), DLPackArray(r, n)),
    )  # fmt: skip
    cdll = ctypes.CDLL(build.nccl)
    forms, notes = dtype_forms(np)
    v: dict[str, Variant] = {}
    for m, cfunc, has_op, has_root in COLLECTIVES:
        if hasattr(cdll, cfunc):
            bare = _bare(cdll, cfunc, _argtypes(has_op, has_root))
            v.update(_collective_variants(m, bare, has_op, has_root, forms, o))
        else:
            notes.append(f"{m}: {cfunc} is not in this libnccl: not timed")
    v.update(_pair_variants(cdll, forms, o))
    return v, notes, cdll


def _floor(bare: Any, args: tuple[int, ...]) -> Callable[[], Any]:
    return lambda: bare(*args)


def _floor_reading(bare: Any, args: tuple[int, ...], x: Any, y: Any) -> Callable[[], Any]:
    """A floor that reads both arrays' interfaces, or exports both DLPack tensors, first:
    what any consumer pays the producer."""
    if isinstance(x, DLPackArray):
        mv = (1, 1)
        return lambda: (x.__dlpack__(max_version=mv), y.__dlpack__(max_version=mv), bare(*args))
    return lambda: (x.__cuda_array_interface__, y.__cuda_array_interface__, bare(*args))


def _objects_call(m: Callable[..., Any], x: Any, y: Any, st: Any = None) -> Callable[[], Any]:
    if st is None:
        return lambda: m(x, y)
    return lambda: m(x, y, stream=st)


def _collective_variants(
    m: str, bare: Any, has_op: bool, has_root: bool, forms: dict[str, tuple[Any, Any]],
    o: Objects,
) -> dict[str, Variant]:  # fmt: skip
    """Every form of one collective, each after its floor (timed next to it)."""
    f32, op_sum = forms["enum"]
    s, r, n, h, sh = o.s, o.r, o.n, o.h, o.sh
    mid = (NCCL_SUM,) * has_op + (0,) * has_root
    args = (s, r, n, NCCL_FLOAT32, *mid, h, 0)
    method = getattr(o.comm, m)
    make = _caller(method, has_op)
    fl, fls, flf = f"{m} floor", f"{m} floor(stream)", f"{m} floor(fresh)"
    v = {fl: Variant(_floor(bare, args), None)}
    for form, (dt, op) in forms.items():
        v[f"{m} {form}"] = Variant(make(s, r, n, dt, op), fl, "raw")

    def bare_fresh() -> Any:
        return bare(s + 0, r + 0, n + 0, NCCL_FLOAT32, *mid, h, 0)

    v[flf] = Variant(bare_fresh, None)
    v[f"{m} fresh"] = Variant(_fresh(method, has_op, s, r, n, f32, op_sum), flf, "raw")
    v[f"{m} fresh+stream"] = Variant(_fresh(method, has_op, s, r, n, f32, op_sum, sh), flf, "raw")
    v[fls] = Variant(_floor(bare, (s, r, n, NCCL_FLOAT32, *mid, h, sh)), None)
    v[f"{m} stream-int"] = Variant(make(s, r, n, f32, op_sum, sh), fls, "raw")
    v[f"{m} stream-obj"] = Variant(make(s, r, n, f32, op_sum, o.st), fls, "raw")
    v[f"{m} str+stream"] = Variant(make(s, r, n, "float32", "sum", sh), fls, "raw")
    rargs = [(p, q, n, NCCL_FLOAT32, *mid, h, 0) for p, q in o.pairs]
    calls = [make(p, q, n, f32, op_sum) for p, q in o.pairs]

    def bare_rot() -> None:
        for a in rargs:
            bare(*a)

    def rotate() -> None:
        for call in calls:
            call()

    v[f"{m} floor(rotate4)"] = Variant(bare_rot, None, c_calls=4)
    v[f"{m} rotate4"] = Variant(rotate, f"{m} floor(rotate4)", "raw", c_calls=4)
    for kind, (x, y) in (("CAI", o.cais), ("DLPack", o.dls)):
        v[f"{m} floor({kind})"] = Variant(_floor_reading(bare, args, x, y), None)
        v[f"{m} {kind}"] = Variant(_objects_call(method, x, y), f"{m} floor({kind})", "object")
        v[f"{m} {kind}-stream"] = Variant(
            _objects_call(method, x, y, sh), f"{m} floor({kind})", "object"
        )
    a, b = o.devbufs
    v[f"{m} DevBuf"] = Variant(_objects_call(method, a, b), fl, "object")
    v[f"{m} DevBuf-stream"] = Variant(_objects_call(method, a, b, o.st), fls, "object")
    init = getattr(o.comm, f"{m}_init")
    pop = init(s, r, count=n, dtype=f32, op=op_sum) if has_op else init(s, r, count=n, dtype=f32)
    v[f"{m} persistent"] = Variant(pop, fl, "persistent")
    v[f"{m} persistent-stream"] = Variant(lambda: pop(stream=sh), fls, "persistent")
    return v


def _pair_variants(
    cdll: ctypes.CDLL, forms: dict[str, tuple[Any, Any]], o: Objects
) -> dict[str, Variant]:
    """``send``+``recv`` as a pair inside ``group()``: 4 C calls per pair, bare or not."""
    from pynccl import group

    comm, s, r, n, h, st, sh, pairs = o.comm, o.s, o.r, o.n, o.h, o.st, o.sh, o.pairs
    vp, i = ctypes.c_void_p, ctypes.c_int
    v: dict[str, Variant] = {}
    gs = _bare(cdll, "ncclGroupStart", [])
    ge = _bare(cdll, "ncclGroupEnd", [])
    bs = _bare(cdll, "ncclSend", [vp, ctypes.c_size_t, i, i, vp, vp])
    br = _bare(cdll, "ncclRecv", [vp, ctypes.c_size_t, i, i, vp, vp])
    snd, rcv = comm.send, comm.recv

    def floor(s: int = s, r: int = r, stream: int = 0) -> Any:
        gs()
        bs(s, n, NCCL_FLOAT32, 0, h, stream)
        br(r, n, NCCL_FLOAT32, 0, h, stream)
        ge()

    def pair(s: Any, r: Any, dt: Any, stream: Any = None) -> Callable[[], None]:
        if stream is None:

            def call() -> None:
                with group():
                    snd(s, 0, count=n, dtype=dt)
                    rcv(r, 0, count=n, dtype=dt)
        else:

            def call() -> None:
                with group():
                    snd(s, 0, count=n, dtype=dt, stream=stream)
                    rcv(r, 0, count=n, dtype=dt, stream=stream)

        return call

    def fresh() -> None:
        with group():
            snd(s + 0, 0, count=n + 0, dtype=f32)
            rcv(r + 0, 0, count=n + 0, dtype=f32)

    def floor_fresh() -> None:
        floor(s + 0, r + 0)

    def obj(x: Any, y: Any, stream: Any = None) -> Callable[[], None]:
        if stream is None:

            def call() -> None:
                with group():
                    snd(x, 0)
                    rcv(y, 0)
        else:

            def call() -> None:
                with group():
                    snd(x, 0, stream=stream)
                    rcv(y, 0, stream=stream)

        return call

    f32 = forms["enum"][0]
    fl, fls = "send+recv floor", "send+recv floor(stream)"
    v[fl] = Variant(floor, None, c_calls=4)
    v[fls] = Variant(lambda: floor(stream=sh), None, c_calls=4)
    for form, (dt, _op) in forms.items():
        v[f"send+recv {form}"] = Variant(pair(s, r, dt), fl, "pair", c_calls=4)
    v["send+recv floor(fresh)"] = Variant(floor_fresh, None, c_calls=4)
    v["send+recv fresh"] = Variant(fresh, "send+recv floor(fresh)", "pair", c_calls=4)
    v["send+recv stream-int"] = Variant(pair(s, r, f32, sh), fls, "pair", c_calls=4)
    v["send+recv stream-obj"] = Variant(pair(s, r, f32, st), fls, "pair", c_calls=4)
    rot = [pair(p, q, f32) for p, q in pairs]

    def floor_rot() -> None:
        for p, q in pairs:
            floor(p, q)

    def rotate() -> None:
        for call in rot:
            call()

    v["send+recv floor(rotate4)"] = Variant(floor_rot, None, c_calls=16)
    v["send+recv rotate4"] = Variant(rotate, "send+recv floor(rotate4)", "pair", c_calls=16)
    (a, b), (fa, fb), (da, db) = o.devbufs, o.cais, o.dls
    mv = (1, 1)

    def floor_cai() -> None:
        fa.__cuda_array_interface__, fb.__cuda_array_interface__  # noqa: B018
        floor()

    def floor_dl() -> None:
        da.__dlpack__(max_version=mv), db.__dlpack__(max_version=mv)
        floor()

    v["send+recv floor(CAI)"] = Variant(floor_cai, None, c_calls=4)
    v["send+recv CAI"] = Variant(obj(fa, fb), "send+recv floor(CAI)", "pair", c_calls=4)
    v["send+recv floor(DLPack)"] = Variant(floor_dl, None, c_calls=4)
    v["send+recv DLPack"] = Variant(obj(da, db), "send+recv floor(DLPack)", "pair", c_calls=4)
    v["send+recv DevBuf"] = Variant(obj(a, b), fl, "pair", c_calls=4)
    v["send+recv DevBuf-stream"] = Variant(obj(a, b, st), fls, "pair", c_calls=4)
    ps = comm.send_init(s, 0, count=n, dtype=f32)
    pr = comm.recv_init(r, 0, count=n, dtype=f32)

    def persistent() -> None:
        with group():
            ps()
            pr()

    v["send+recv persistent"] = Variant(persistent, fl, "pair", c_calls=4)
    return v


def select(variants: dict[str, Variant], pattern: str | None) -> dict[str, Variant]:
    """The variants whose name matches ``pattern`` (a regex, searched), with their floors,
    each floor placed just before its first variant (timed next to it)."""
    if pattern is None:
        return variants
    rx = re.compile(pattern)
    out: dict[str, Variant] = {}
    for name, var in variants.items():
        if var.floor is not None and rx.search(name):
            out.setdefault(var.floor, variants[var.floor])
            out[name] = var
    return out


def time_rounds(variants: dict[str, Variant], rounds: int, calls: int) -> dict[str, list[float]]:
    """ns per invocation of each variant in each round, the loop's own cost subtracted."""
    empty: Callable[[], Any] = lambda: None  # noqa: E731
    samples: dict[str, list[float]] = {k: [] for k in variants}
    perf = time.perf_counter_ns
    for var in variants.values():
        for _ in range(100):
            var.fn()  # warm up: bindings, caches, first-use imports
    loop = range(calls)
    for _ in range(rounds):
        t0 = perf()
        for _ in loop:
            empty()
        base = (perf() - t0) / calls
        for name, var in variants.items():
            fn = var.fn
            t0 = perf()
            for _ in loop:
                fn()
            samples[name].append(max((perf() - t0) / calls - base, 1e-9))
    return samples


def report(
    variants: dict[str, Variant], samples: dict[str, list[float]]
) -> list[tuple[str, str, float, str]]:
    """Prints the table and the spreads; returns the misses as (form, row, figure, target)."""
    missed: list[tuple[str, str, float, str]] = []
    ratios: dict[str, float] = {}
    print(f"{'call':<32}{'ns/C call':>10}{'x floor':>9}{'best x':>8}  target")
    for name, var in variants.items():
        med = statistics.median(samples[name]) / var.c_calls
        if var.floor is None:
            print(f"{name:<32}{med:>10.0f}")
            continue
        fl = samples[var.floor]
        ratio = statistics.median(x / f for x, f in zip(samples[name], fl))
        best = min(samples[name]) / min(fl)
        ratios[name] = ratio
        target = TARGETS[var.kind]
        ok = ratio <= target
        verdict = f"<= {target:.2f}x {'ok' if ok else 'MISSED'}"
        if not ok:
            row, form = name.rsplit(" ", 1)
            missed.append((form, row, ratio, f"<= {target:.2f}x"))
        print(f"{name:<32}{med:>10.0f}{ratio:>9.2f}{best:>8.2f}  {verdict}")
    print(f"\nspread between a row's raw forms (max/min of their ratios; target <= "
          f"{SPREAD_TARGET:.0%}):")  # fmt: skip
    rows: dict[str, list[tuple[str, float]]] = {}
    for name, ratio in ratios.items():
        if variants[name].kind in ("raw", "pair") and not any(
            tag in name for tag in ("CAI", "DLPack", "DevBuf", "persistent")
        ):
            row, form = name.rsplit(" ", 1)
            rows.setdefault(row, []).append((form, ratio))
    every: list[float] = []
    for row, items in rows.items():
        if len(items) < 2:
            continue
        lo, hi = min(items, key=lambda x: x[1]), max(items, key=lambda x: x[1])
        spread = hi[1] / lo[1] - 1
        every += [x for _, x in items]
        ok = spread <= SPREAD_TARGET
        if not ok:
            missed.append(("spread of raw forms", row, spread, f"<= {SPREAD_TARGET:.0%}"))
        print(f"  {row:<16}{spread:>6.0%}  ({lo[0]} {lo[1]:.2f}x .. {hi[0]} {hi[1]:.2f}x)"
              f"  {'ok' if ok else 'MISSED'}")  # fmt: skip
    if every:
        print(f"  {'all rows':<16}{max(every) / min(every) - 1:>6.0%}  (a figure)")
    return missed


def report_group(cdll: ctypes.CDLL, callgrind: bool) -> list[tuple[str, str, float, str]]:
    counter = InstructionCounter()
    try:
        if counter.fd >= 0:
            cost, how = group_instructions(cdll, counter, 2000), "perf_event_open"
        elif callgrind:
            cost, how = group_callgrind(1000), f"callgrind; {counter.reason}"
        else:
            print(f"\nwith group(): pass  {group_ns(cdll, 2000):+.0f} ns over a bare "
                  f"ncclGroupStart/End pair (no instruction counter: {counter.reason}; "
                  f"the target, <= {GROUP_TARGET} instructions, is not judged: --callgrind "
                  "counts them under valgrind)")  # fmt: skip
            return []
    finally:
        counter.close()
    ok = cost <= GROUP_TARGET
    print(f"\nwith group(): pass  {cost:+.0f} instructions over a bare ncclGroupStart/End "
          f"pair ({how}; target <= {GROUP_TARGET}: {'ok' if ok else 'MISSED'})")  # fmt: skip
    return [] if ok else [("with group(): pass", "group", cost, f"<= {GROUP_TARGET} instr")]


def summarize(missed: list[tuple[str, str, float, str]]) -> None:
    """One line per form that missed its target: the rows and the range of figures."""
    print(f"\n{len(missed)} target(s) missed" + (", by form:" if missed else ""))
    forms: dict[str, list[tuple[str, float, str]]] = {}
    for form, row, figure, target in missed:
        forms.setdefault(form, []).append((row, figure, target))
    for form, items in forms.items():
        lo, hi = min(x[1] for x in items), max(x[1] for x in items)
        pct = form.startswith("spread")
        if form.startswith("with group"):
            span = f"{hi:.0f} instr"
        else:
            span = f"{lo:.0%}..{hi:.0%}" if pct else f"{lo:.2f}x..{hi:.2f}x"
        rows = ", ".join(row for row, _, _ in items)
        print(f"  {form:<20} {span:<14} target {items[0][2]:<10} {len(items)} row(s): {rows}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=1000, help="calls per variant per round")
    parser.add_argument("--quick", action="store_true", help="5 rounds x 300 calls")
    parser.add_argument(
        "--only",
        metavar="REGEX",
        help="only the variants whose name matches REGEX ('all_reduce str', 'send+recv DevBuf', "
        "'group', ...)",
    )
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="where perf_event_open gives no instruction counter, count group()'s under "
        "valgrind's callgrind (four runs of a few seconds each)",
    )
    parser.add_argument(
        "--watchdog",
        type=float,
        metavar="SECONDS",
        help="time the calls with the communicator's watchdog on (an event per operation; "
        "PYNCCL_FLIGHT_STACKS=1 adds the call site of each)",
    )
    # group_callgrind's child: MODE K
    parser.add_argument("--group-loop", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.group_loop:
        return run_group_loop(args.group_loop[0], int(args.group_loop[1]))
    if args.quick:
        args.rounds, args.calls = 5, 300
    stack: list[Callable[[], Any]] = []
    try:
        variants, notes, cdll = build_variants(1024, stack, args.watchdog)
        chosen = select(variants, args.only)
        missed: list[tuple[str, str, float, str]] = []
        print("pynccl per-call overhead on the loopback null build, public API "
              f"({args.rounds} rounds x {args.calls} calls, Python "
              f"{sys.version.split()[0]})")  # fmt: skip
        for note in notes:
            print(f"note: {note}")
        if chosen:
            samples = time_rounds(chosen, args.rounds, args.calls)
            missed += report(chosen, samples)
        if args.only is None or re.search(args.only, "group"):
            missed += report_group(cdll, args.callgrind)
        summarize(missed)
    finally:
        for close in reversed(stack):
            close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
