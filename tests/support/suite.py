"""The collective suite, mpi4py style: one set of assertions, run in many worlds.

:func:`check` builds a :class:`Spec` (collective, dtype, op, count, root, in place,
array kind) into a ``world.collective`` call (``support.worlds``) and asserts the
result of every local rank against the one numpy reference (``support.reference``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pynccl.comm import Communicator
from pynccl.dtypes import as_datatype
from pynccl.enums import DataType
from pynccl.groups import group
from support.reference import assert_same, np_dtype, rank_data, ref_reduce
from support.worlds import KINDS, Slot, World

__all__ = [
    "COLLECTIVES",
    "INPLACE_NONE",
    "INPLACE_OFFSET",
    "OPS",
    "REDUCING",
    "Spec",
    "check",
    "fixed_matrix",
]

COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "send_recv",
)
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})
#: Collectives with an in-place form that pynccl spells ``recvbuf=None``.
INPLACE_NONE = frozenset({"all_reduce", "reduce", "broadcast"})
#: Collectives whose in-place form is NCCL's pointer offset (needs a sub-view).
INPLACE_OFFSET = frozenset({"all_gather", "reduce_scatter", "gather", "scatter"})
OPS = ("sum", "prod", "max", "min", "avg")


# --- one collective, asserted ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """One collective call to check: what every rank does and with what."""

    coll: str
    dtype: str = "float32"
    op: str = "sum"
    count: int = 5
    root: int = 0
    inplace: bool = False
    kind: str = "buffer"
    seed: int = 0

    @property
    def datatype(self) -> DataType:
        return as_datatype(self.dtype)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls(**json.loads(text))

    def __str__(self) -> str:
        where = "in-place" if self.inplace else "out-of-place"
        return (
            f"{self.coll} {self.dtype} {self.op} count={self.count} root={self.root} "
            f"{where} kind={self.kind} seed={self.seed}"
        )


def check(world: World, spec: Spec) -> None:
    """Run ``spec`` in ``world`` and assert every local rank's result (and that
    out-of-place send buffers are left unchanged)."""
    try:
        _CHECKS[spec.coll](world, spec)
    except AssertionError as exc:
        exc.add_note(f"in {world!r}: {spec}")
        raise


def _inputs(spec: Spec, size: int, per_rank: int, purpose: str) -> list[np.ndarray]:
    return [rank_data(spec.seed, r, per_rank, spec.datatype, purpose) for r in range(size)]


def _garbage(spec: Spec, n: int, rank: int) -> np.ndarray:
    return rank_data(spec.seed + 7919, rank, n, spec.datatype, "bytes")


def _purpose(spec: Spec) -> str:
    return spec.op if spec.coll in REDUCING else "bytes"


def _assert_results(
    results: dict[int, tuple[np.ndarray, np.ndarray | None]],
    expected: Callable[[int], np.ndarray | None],
    sent: Callable[[int], np.ndarray | None],
    what: str,
) -> None:
    for r, (got, send_after) in sorted(results.items()):
        want = expected(r)
        if want is not None:
            assert_same(got, want, f"rank {r} {what}")
        original = sent(r)
        if send_after is not None and original is not None:
            assert_same(send_after, original, f"rank {r} sendbuf changed by {what}")


def _check_in_or_out_of_place(
    world: World,
    spec: Spec,
    inputs: list[np.ndarray],
    call: Callable[[Communicator, Any, Any, int], None],
    expected: Callable[[int], np.ndarray | None],
    what: str,
) -> None:
    """The rows whose send and recv buffers have one size (all_reduce, reduce, broadcast):
    each rank sends ``inputs[r]``, into garbage or in place, and rank r must read
    ``expected(r)`` (None: not checked) with its sendbuf unchanged."""

    def setup(r: int) -> dict[str, Any]:
        st = {"s": Slot(spec.kind, inputs[r], world.device(r))}
        if not spec.inplace:
            st["r"] = Slot(spec.kind, _garbage(spec, spec.count, r), world.device(r))
        return st

    def issue(comm: Communicator, st: dict[str, Any]) -> None:
        recv = st["r"].obj if "r" in st else None
        call(comm, st["s"].obj, recv, st["s"])

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        if "r" in st:
            return st["r"].read(), st["s"].read()
        return st["s"].read(), None

    results = world.collective(setup, issue, finish)
    _assert_results(results, expected, lambda r: inputs[r], what)


def _check_all_reduce(world: World, spec: Spec) -> None:
    n = spec.count
    inputs = _inputs(spec, world.size, n, _purpose(spec))
    want = ref_reduce(inputs, spec.datatype, spec.op)
    _check_in_or_out_of_place(
        world, spec, inputs,
        lambda comm, send, recv, slot: comm.all_reduce(send, recv, spec.op, **slot.kw(n)),
        lambda r: want, "all_reduce",
    )  # fmt: skip


def _check_reduce(world: World, spec: Spec) -> None:
    n, root = spec.count, spec.root
    inputs = _inputs(spec, world.size, n, _purpose(spec))
    want = ref_reduce(inputs, spec.datatype, spec.op)
    _check_in_or_out_of_place(
        world, spec, inputs,
        lambda comm, send, recv, slot: comm.reduce(send, recv, spec.op, root=root, **slot.kw(n)),
        lambda r: want if r == root else None, "reduce",
    )  # fmt: skip


def _check_broadcast(world: World, spec: Spec) -> None:
    n, root = spec.count, spec.root
    inputs = _inputs(spec, world.size, n, "bytes")
    _check_in_or_out_of_place(
        world, spec, inputs,
        lambda comm, send, recv, slot: comm.broadcast(send, recv, root=root, **slot.kw(n)),
        lambda r: inputs[root], "broadcast",
    )  # fmt: skip


def _check_all_gather(world: World, spec: Spec) -> None:
    n, size = spec.count, world.size
    inputs = _inputs(spec, size, n, "bytes")
    want = np.concatenate(inputs)
    inplace = spec.inplace and spec.kind != "buffer"

    def setup(r: int) -> dict[str, Any]:
        if inplace:
            init = _garbage(spec, n * size, r)
            init[r * n : (r + 1) * n] = inputs[r]
            rs = Slot(spec.kind, init, world.device(r))
            return {"r": rs, "send": rs.view(r * n, n)}
        s = Slot(spec.kind, inputs[r], world.device(r))
        return {"s": s, "send": s.obj, "r": Slot(spec.kind, _garbage(spec, n * size, r), s.device)}

    def call(comm: Communicator, st: dict[str, Any]) -> None:
        comm.all_gather(st["send"], st["r"].obj, **st["r"].kw(n))

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        return st["r"].read(), (st["s"].read() if "s" in st else None)

    results = world.collective(setup, call, finish)
    _assert_results(results, lambda r: want, lambda r: inputs[r], "all_gather")


def _check_reduce_scatter(world: World, spec: Spec) -> None:
    n, size, dt = spec.count, world.size, spec.datatype
    inputs = _inputs(spec, size, n * size, _purpose(spec))
    full = ref_reduce(inputs, dt, spec.op)
    inplace = spec.inplace and spec.kind != "buffer"

    def setup(r: int) -> dict[str, Any]:
        s = Slot(spec.kind, inputs[r], world.device(r))
        if inplace:
            return {"s": s, "recv": s.view(r * n, n), "rank": r}
        return {"s": s, "r": Slot(spec.kind, _garbage(spec, n, r), s.device)}

    def call(comm: Communicator, st: dict[str, Any]) -> None:
        recv = st["recv"] if "recv" in st else st["r"].obj
        comm.reduce_scatter(st["s"].obj, recv, spec.op, **st["s"].kw(n))

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        if "r" in st:
            return st["r"].read(), st["s"].read()
        r = st["rank"]
        return st["s"].read()[r * n : (r + 1) * n], None

    results = world.collective(setup, call, finish)
    _assert_results(
        results, lambda r: full[r * n : (r + 1) * n], lambda r: inputs[r], "reduce_scatter"
    )


def _check_gather(world: World, spec: Spec) -> None:
    n, size, root = spec.count, world.size, spec.root
    inputs = _inputs(spec, size, n, "bytes")
    want = np.concatenate(inputs)
    inplace = spec.inplace and spec.kind != "buffer"

    def setup(r: int) -> dict[str, Any]:
        if r != root:
            s = Slot(spec.kind, inputs[r], world.device(r))
            return {"s": s, "send": s.obj, "recv": None}
        if inplace:
            init = _garbage(spec, n * size, r)
            init[r * n : (r + 1) * n] = inputs[r]
            rs = Slot(spec.kind, init, world.device(r))
            return {"r": rs, "send": rs.view(r * n, n), "recv": rs.obj}
        s = Slot(spec.kind, inputs[r], world.device(r))
        rs = Slot(spec.kind, _garbage(spec, n * size, r), s.device)
        return {"s": s, "send": s.obj, "r": rs, "recv": rs.obj}

    def call(comm: Communicator, st: dict[str, Any]) -> None:
        kw = {"count": n, "dtype": spec.datatype} if spec.kind == "raw" else {}
        comm.gather(st["send"], st["recv"], root=root, **kw)

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        got = st["r"].read() if "r" in st else np.empty(0, np_dtype(spec.datatype))
        return got, (st["s"].read() if "s" in st else None)

    results = world.collective(setup, call, finish)
    _assert_results(results, lambda r: want if r == root else None, lambda r: inputs[r], "gather")


def _check_scatter(world: World, spec: Spec) -> None:
    n, size, root = spec.count, world.size, spec.root
    source = rank_data(spec.seed, root, n * size, spec.datatype, "bytes")
    inplace = spec.inplace and spec.kind != "buffer"

    def setup(r: int) -> dict[str, Any]:
        if r == root and inplace:
            s = Slot(spec.kind, source, world.device(r))
            return {"s": s, "send": s.obj, "recv": s.view(r * n, n), "rank": r}
        rs = Slot(spec.kind, _garbage(spec, n, r), world.device(r))
        if r != root:
            return {"r": rs, "send": None, "recv": rs.obj}
        s = Slot(spec.kind, source, world.device(r))
        return {"s": s, "send": s.obj, "r": rs, "recv": rs.obj}

    def call(comm: Communicator, st: dict[str, Any]) -> None:
        kw = {"count": n, "dtype": spec.datatype} if spec.kind == "raw" else {}
        comm.scatter(st["send"], st["recv"], root=root, **kw)

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        if "r" not in st:
            r = st["rank"]
            return st["s"].read()[r * n : (r + 1) * n], None
        return st["r"].read(), (st["s"].read() if "s" in st else None)

    results = world.collective(setup, call, finish)
    _assert_results(
        results,
        lambda r: source[r * n : (r + 1) * n],
        lambda r: source if r == root else None,
        "scatter",
    )


def _check_all_to_all(world: World, spec: Spec) -> None:
    n, size = spec.count, world.size
    inputs = _inputs(spec, size, n * size, "bytes")

    def expected(r: int) -> np.ndarray:
        return np.concatenate([inputs[j][r * n : (r + 1) * n] for j in range(size)])

    def setup(r: int) -> dict[str, Any]:
        s = Slot(spec.kind, inputs[r], world.device(r))
        return {"s": s, "r": Slot(spec.kind, _garbage(spec, n * size, r), s.device)}

    def call(comm: Communicator, st: dict[str, Any]) -> None:
        comm.all_to_all(st["s"].obj, st["r"].obj, **st["s"].kw(n))

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        return st["r"].read(), st["s"].read()

    results = world.collective(setup, call, finish)
    _assert_results(results, expected, lambda r: inputs[r], "all_to_all")


def _check_send_recv(world: World, spec: Spec) -> None:
    """A ring shifted by ``root``: rank r sends to r+root and receives from r-root,
    both inside one group (a shift of 0 sends to itself)."""
    n, size, shift = spec.count, world.size, spec.root
    inputs = _inputs(spec, size, n, "bytes")

    def setup(r: int) -> dict[str, Any]:
        s = Slot(spec.kind, inputs[r], world.device(r))
        return {"s": s, "r": Slot(spec.kind, _garbage(spec, n, r), s.device)}

    def call(comm: Communicator, st: dict[str, Any]) -> None:
        r = comm.rank
        with group():
            comm.send(st["s"].obj, (r + shift) % size, **st["s"].kw(n))
            comm.recv(st["r"].obj, (r - shift) % size, **st["r"].kw(n))

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        return st["r"].read(), st["s"].read()

    results = world.collective(setup, call, finish)
    _assert_results(results, lambda r: inputs[(r - shift) % size], lambda r: inputs[r], "send/recv")


_CHECKS: dict[str, Callable[[World, Spec], None]] = {
    "all_reduce": _check_all_reduce,
    "reduce": _check_reduce,
    "broadcast": _check_broadcast,
    "all_gather": _check_all_gather,
    "reduce_scatter": _check_reduce_scatter,
    "gather": _check_gather,
    "scatter": _check_scatter,
    "all_to_all": _check_all_to_all,
    "send_recv": _check_send_recv,
}


def fixed_matrix(size: int, dtypes: Sequence[str] = ("float32",)) -> list[Spec]:
    """A small matrix covering every collective, kind, in-place form and a non-zero
    root, for the worlds too costly for property tests (processes, versions)."""
    specs: list[Spec] = []
    last = size - 1
    for i, coll in enumerate(COLLECTIVES):
        kind = KINDS[i % len(KINDS)]
        for j, dtype in enumerate(dtypes):
            op = "sum"
            if coll in REDUCING:
                ops = (
                    ("sum", "avg", "max") if as_datatype(dtype).is_float else ("sum", "prod", "min")
                )
                op = ops[(i + j) % 3]
            specs.append(Spec(coll, dtype, op, count=37, root=last, kind=kind, seed=i))
        if coll in INPLACE_NONE or coll in INPLACE_OFFSET:
            specs.append(Spec(coll, dtypes[0], count=11, root=last // 2, inplace=True, kind="raw"))
    specs.append(Spec("all_reduce", dtypes[0], "sum", count=0, kind="raw"))
    specs.append(Spec("all_reduce", dtypes[0], "sum", count=70_001, kind="buffer", seed=3))
    specs.append(Spec("all_to_all", dtypes[0], count=1_000, kind="dlpack", seed=4))
    return specs
