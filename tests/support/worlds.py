"""The collective suite, mpi4py style: one set of assertions, run in many worlds.

A *world* is the set of communicators that this process drives:

* :class:`ThreadWorld` — every rank is a thread of this process that calls
  ``Communicator(n, uid, rank, device=rank)``, then issues its own collectives;
* :class:`GroupWorld` — ``Communicator.init_all(n)``; this one thread issues each
  collective for every rank inside one ``pynccl.group()``;
* :class:`ProcessWorld` — this process is one rank of a job of separate processes
  (see ``tests/_rank_worker.py``).

``world.collective(setup, call, finish)`` runs one operation on every rank the
world holds locally and returns ``{rank: finish(...)}``. :func:`check` builds a
:class:`Spec` (collective, dtype, op, count, root, in place, array kind) into
such a call and asserts the result of every local rank against a numpy
reference that computes what the loopback libnccl promises: integers wrap
around; floats fold in rank order ``((x0 op x1) op x2) ...`` in the type's own
arithmetic, with float16 / bfloat16 / float8 computed in float32 and rounded to
the type after every step; ``avg`` on floats is a pre-multiplied sum with the
scalar ``1/n`` rounded to the type.

Buffers live in loopback device memory (:class:`pynccl.cuda.DeviceBuffer`) and
are handed to pynccl as one of four *kinds*: the ``DeviceBuffer`` itself, a raw
``int`` pointer (with ``count=``/``dtype=``), a minimal object exposing only
``__cuda_array_interface__``, or a DLPack producer claiming ``kDLCUDA``. All but
the first are surrounded by guard elements that must come back untouched.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from _producers import DLPackProducer, kDLCUDA

from pynccl import library
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer, Stream
from pynccl.dtypes import as_datatype, to_numpy_dtype
from pynccl.enums import DataType
from pynccl.groups import group

__all__ = [
    "COLLECTIVES",
    "INPLACE_NONE",
    "INPLACE_OFFSET",
    "KINDS",
    "OPS",
    "REDUCING",
    "GroupWorld",
    "MinimalCAI",
    "ProcessWorld",
    "RankThreads",
    "Slot",
    "Spec",
    "ThreadWorld",
    "World",
    "check",
    "fixed_matrix",
    "loopback_build",
    "np_dtype",
    "rank_data",
    "ref_reduce",
    "use_loopback",
]

#: Seconds any single collective may take before a test calls it hung.
TIMEOUT = 60.0

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
KINDS = ("buffer", "raw", "cai", "dlpack")
SMALL_FLOATS = frozenset(
    {DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2}
)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
GUARD = 3  # elements on each side of a non-DeviceBuffer slot


# --- the loopback as this process's libraries -----------------------------------------------------

_ENV_KEYS = ("PYNCCL_NCCL_LIBRARY", "PYNCCL_CUDART_LIBRARY")


def _loopback() -> Any:
    import pytest

    try:
        from pynccl.testing import loopback
    except ImportError as exc:  # pragma: no cover - the package ships it
        pytest.skip(f"pynccl.testing.loopback is not importable: {exc}")
    return loopback


def sanitized() -> bool:
    """True when the suite should use the ASan/UBSan loopback builds
    (``PYNCCL_TEST_SANITIZE=1``, in a process started with ``loopback.env(sanitize=True)``)."""
    return os.environ.get("PYNCCL_TEST_SANITIZE", "") not in ("", "0")


def loopback_build(version: Any = None) -> Any:
    """``loopback.build(version)``, or skip the test when it cannot be built here."""
    import pytest

    loopback = _loopback()
    try:
        return loopback.build(version, sanitize=sanitized())
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"the loopback libraries cannot be built: {exc}")


@contextlib.contextmanager
def use_loopback(version: Any = None) -> Iterator[Any]:
    """Make the loopback build of ``version`` this process's libraries; restore the
    previously loaded libraries and environment afterwards."""
    build = loopback_build(version)
    saved_env = {k: os.environ.get(k) for k in _ENV_KEYS}
    saved_libs = library.loaded()
    with warnings.catch_warnings():
        # Swapping builds maps several libnccl files into this process, on purpose.
        warnings.filterwarnings("ignore", ".*different libnccl files", RuntimeWarning)
        _loopback().use(version, sanitize=sanitized())
        library.lib()  # loaded now, inside this filter, if use() only set the environment
        library.cudart()
    try:
        yield build
    finally:
        library._nccl, library._cudart = saved_libs
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --- rank threads ---------------------------------------------------------------------------------


class RankThreads:
    """One persistent thread per rank: a rank's CUDA device is per thread, so every
    call of rank r (init, collectives, synchronize, destroy) runs on thread r."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"rank{r}") for r in range(size)]

    def run(self, fn: Callable[[int], Any], timeout: float = TIMEOUT) -> list[Any]:
        """``fn(r)`` on every rank's thread at once; results in rank order.

        Raises the lowest rank's exception (with a note naming the rank, and one for
        each other rank's exception: a rank that raised before issuing a collective
        leaves its peers waiting, and their timeout is then the lowest rank's) after
        all ranks finished; ``TimeoutError`` if one is still running after ``timeout``.
        """
        futures = [pool.submit(fn, r) for r, pool in enumerate(self._pools)]
        results: list[Any] = []
        raised: list[tuple[int, BaseException]] = []
        for r, fut in enumerate(futures):
            try:
                results.append(fut.result(timeout=timeout))
            except TimeoutError:
                raise TimeoutError(f"rank {r} did not finish within {timeout} s") from None
            except BaseException as exc:  # collected: every rank must finish first
                raised.append((r, exc))
                results.append(None)
        if raised:
            r, first = raised[0]
            first.add_note(f"(raised on rank {r} of {self.size})")
            for other, exc in raised[1:]:
                first.add_note(f"(rank {other} raised {type(exc).__name__}: {exc})")
            raise first
        return results

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)


# --- worlds ---------------------------------------------------------------------------------------

Setup = Callable[[int], Any]
Call = Callable[[Communicator, Any], None]
Finish = Callable[[Any], Any]


class World:
    """What the suite needs from a world (see the module docstring)."""

    name = "world"
    size: int
    local_ranks: Sequence[int]
    comms: dict[int, Communicator]

    def device(self, rank: int) -> int:
        return rank

    def run(self, fn: Callable[[int, Communicator], Any]) -> dict[int, Any]:
        """``fn(rank, comm)`` for every local rank, each where that rank's calls belong."""
        raise NotImplementedError

    def collective(self, setup: Setup, call: Call, finish: Finish) -> dict[int, Any]:
        """Set up every local rank, issue ``call`` on each, wait, then ``finish``."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self.name} world of {self.size}>"


def _close_state(state: Any) -> None:
    for slot in state.values() if isinstance(state, dict) else ():
        if isinstance(slot, Slot):
            slot.close()


class ThreadWorld(World):
    """Every rank is a thread of this process with its own blocking ``Communicator``."""

    name = "threads"

    def __init__(self, size: int, *, config: Config | None = None) -> None:
        self.size = size
        self.local_ranks = range(size)
        self.threads = RankThreads(size)
        self.broken = False
        uid = UniqueId()
        try:
            made = self.threads.run(lambda r: Communicator(size, uid, r, device=r, config=config))
        except BaseException:
            self.threads.close()
            raise
        self.comms = dict(enumerate(made))

    def run(self, fn: Callable[[int, Communicator], Any]) -> dict[int, Any]:
        try:
            out = self.threads.run(lambda r: fn(r, self.comms[r]))
        except TimeoutError:
            self.broken = True
            raise
        return dict(enumerate(out))

    def collective(self, setup: Setup, call: Call, finish: Finish) -> dict[int, Any]:
        def one(r: int, comm: Communicator) -> Any:
            state = setup(r)
            try:
                call(comm, state)
                comm.synchronize(timeout=TIMEOUT)
                return finish(state)
            finally:
                _close_state(state)

        try:
            return self.run(one)
        except BaseException:
            # A rank that failed before issuing leaves its peers' work pending for ever.
            if any(c.state != "ready" for c in self.comms.values()):
                self.broken = True
            raise

    def close(self) -> None:
        def end(r: int) -> None:
            comm = self.comms[r]
            if self.broken:
                comm.abort()
            else:
                comm.destroy()

        try:
            self.threads.run(end)
        finally:
            self.threads.close()


class GroupWorld(World):
    """``Communicator.init_all``; this thread issues every rank's call inside one group.

    Each rank gets its own stream on its own device (one thread drives all of
    them, so the legacy default stream would be the same one for every rank).
    """

    name = "init_all"

    def __init__(self, size: int) -> None:
        self.size = size
        self.local_ranks = range(size)
        self.broken = False
        made = Communicator.init_all(size)
        self.comms = dict(enumerate(made))
        self.streams = [Stream(device=r) for r in range(size)]
        for r, comm in self.comms.items():
            comm.stream = self.streams[r]

    def run(self, fn: Callable[[int, Communicator], Any]) -> dict[int, Any]:
        with group():
            return {r: fn(r, comm) for r, comm in self.comms.items()}

    def collective(self, setup: Setup, call: Call, finish: Finish) -> dict[int, Any]:
        states = {r: setup(r) for r in self.local_ranks}
        try:
            with group():
                for r, comm in self.comms.items():
                    call(comm, states[r])
            for comm in self.comms.values():
                comm.synchronize(timeout=TIMEOUT)
            return {r: finish(states[r]) for r in self.local_ranks}
        except BaseException:
            if any(c.state != "ready" for c in self.comms.values()):
                self.broken = True
            raise
        finally:
            for state in states.values():
                _close_state(state)

    def close(self) -> None:
        for comm in self.comms.values():
            if self.broken:
                comm.abort()
            else:
                comm.destroy()
        for stream in self.streams:
            stream.close()


class ProcessWorld(World):
    """This process is rank ``rank`` of a job of separate processes."""

    name = "processes"

    def __init__(self, comm: Communicator) -> None:
        self.size = comm.size
        self.rank = comm.rank
        self.local_ranks = (comm.rank,)
        self.comms = {comm.rank: comm}
        self._device = comm.device

    def device(self, rank: int) -> int:
        return self._device

    def run(self, fn: Callable[[int, Communicator], Any]) -> dict[int, Any]:
        return {self.rank: fn(self.rank, self.comms[self.rank])}

    def collective(self, setup: Setup, call: Call, finish: Finish) -> dict[int, Any]:
        comm = self.comms[self.rank]
        state = setup(self.rank)
        try:
            call(comm, state)
            comm.synchronize(timeout=TIMEOUT)
            return {self.rank: finish(state)}
        finally:
            _close_state(state)

    def close(self) -> None:
        self.comms[self.rank].destroy()


# --- data and references --------------------------------------------------------------------------


def np_dtype(dt: DataType) -> np.dtype[Any]:
    return np.dtype(to_numpy_dtype(dt))


def _random_bytes(rng: np.random.Generator, n: int, dt: DataType) -> np.ndarray:
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(np_dtype(dt))


def rank_data(seed: int, rank: int, n: int, dt: DataType, purpose: str) -> np.ndarray:
    """Rank ``rank``'s input of ``n`` elements of ``dt``, the same in every process.

    ``purpose``: ``"bytes"`` (any bit pattern: data movement only), or a reduction
    op; integers then take any value (to wrap around), floats values that keep the
    result finite for up to 8 ranks while still rounding.
    """
    rng = np.random.default_rng([seed, rank, n, int(dt), zlib.crc32(purpose.encode())])
    if purpose == "bytes" or dt.is_integer:
        return _random_bytes(rng, n, dt)
    if purpose == "prod":
        mag = rng.uniform(0.5, 1.9, size=n) * rng.choice([-1.0, 1.0], size=n)
    else:
        scale = 4.0 if dt in (DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2) else 100.0
        mag = rng.normal(0.0, scale, size=n)
    return mag.astype(np.float32).astype(np_dtype(dt))


def _fold(
    inputs: Sequence[np.ndarray], step: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> np.ndarray:
    acc = inputs[0].copy()
    for x in inputs[1:]:
        acc = step(acc, x)
    return acc


def ref_reduce(
    inputs: Sequence[np.ndarray], dt: DataType, op: str, scalar: float | None = None
) -> np.ndarray:
    """``inputs[0] op inputs[1] op ...`` as the loopback computes it (module docstring).

    ``op="premulsum"`` is sum(scalar * x); ``avg`` on floats is premulsum with 1/n.
    """
    n = len(inputs)
    npdt = np_dtype(dt)
    if dt.is_integer:
        u = _UNSIGNED[dt.itemsize]
        xs = [x.view(u) for x in inputs]
        if op in ("max", "min"):
            f = np.maximum if op == "max" else np.minimum
            return _fold(list(inputs), lambda a, b: f(a, b))
        if op == "sum":
            return _fold(xs, lambda a, b: a + b).view(npdt)
        if op == "prod":
            return _fold(xs, lambda a, b: a * b).view(npdt)
        if op == "premulsum":
            sc = np.array([scalar], dtype=npdt).view(u)[0]
            return _fold([x * sc for x in xs], lambda a, b: a + b).view(npdt)
        if op == "avg":
            # NCCL's SumPostDiv: the wrapped sum in the type, divided by the number of
            # ranks as C divides (truncating toward zero), in Python ints.
            total = _fold(xs, lambda a, b: a + b).view(npdt)
            quot = [int(v) // n if v >= 0 else -(-int(v) // n) for v in total.tolist()]
            return np.array(quot, dtype=npdt)
        raise ValueError(f"no integer reference for op {op!r}")
    if op == "avg":
        op, scalar = "premulsum", 1.0 / n
    if dt in SMALL_FLOATS:
        dec: Callable[[np.ndarray], np.ndarray] = lambda a: a.astype(np.float32)  # noqa: E731
        enc: Callable[[np.ndarray], np.ndarray] = lambda f: f.astype(npdt)  # noqa: E731
    else:
        dec = enc = lambda a: a
    with np.errstate(all="ignore"):
        if op == "sum":
            return _fold(list(inputs), lambda a, b: enc(dec(a) + dec(b)))
        if op == "prod":
            return _fold(list(inputs), lambda a, b: enc(dec(a) * dec(b)))
        if op in ("max", "min"):

            def pick(a: np.ndarray, b: np.ndarray) -> np.ndarray:
                fa, fb = dec(a), dec(b)
                take = (fb > fa if op == "max" else fb < fa) | np.isnan(fb)
                return np.where(take, b, a)

            return _fold(list(inputs), pick)
        if op == "premulsum":
            # The scalar stored in the type (C: double for float64, else (float)v then
            # rounded to the type), then used in the type's arithmetic.
            wide = np.float64(scalar) if dt is DataType.FLOAT64 else np.float32(scalar)
            sc = dec(np.array([wide], dtype=npdt))[0]
            first = enc(dec(inputs[0]) * sc)
            if dt in SMALL_FLOATS:
                terms = [enc(dec(x) * sc) for x in inputs[1:]]
            else:
                terms = [x * sc for x in inputs[1:]]
            return _fold([first, *terms], lambda a, b: enc(dec(a) + dec(b)))
    raise ValueError(f"no float reference for op {op!r}")


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Element-wise identical bit patterns (any NaN equals any NaN)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    u = _UNSIGNED[got.dtype.itemsize]
    equal = got.view(u) == want.view(u)
    if got.dtype.kind not in "iu" and not equal.all():
        with np.errstate(invalid="ignore"):
            equal |= np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
    return bool(equal.all())


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if same_bits(got, want):
        return
    u = _UNSIGNED[want.dtype.itemsize]
    bad = np.flatnonzero(got.view(u) != want.view(u)) if got.shape == want.shape else []
    first = int(bad[0]) if len(bad) else -1
    detail = (
        f"{len(bad)} of {want.size} elements differ; first at [{first}]: "
        f"got {got[first]!r}, expected {want[first]!r}"
        if first >= 0
        else f"got shape {got.shape} {got.dtype}, expected {want.shape} {want.dtype}"
    )
    raise AssertionError(f"{what}: {detail}")


# --- buffers of every kind ------------------------------------------------------------------------


class MinimalCAI:
    """Nothing but ``__cuda_array_interface__`` (v2), plus ``.dtype`` where the
    typestr cannot say it (bfloat16, float8)."""

    def __init__(self, ptr: int, n: int, dt: DataType, typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": typestr,
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }
        if typestr[1] == "V":
            self.dtype = np_dtype(dt)


_SENTINEL = 0xA5


class Slot:
    """``n`` elements of device memory on ``device``, initialised from ``host``, handed
    to pynccl as ``kind``. Non-``buffer`` kinds sit between guard elements that
    :meth:`read` checks: NCCL must write exactly the elements it was given."""

    def __init__(self, kind: str, host: np.ndarray, device: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown buffer kind {kind!r}")
        self.kind = kind
        self.n = host.size
        self.dt = as_datatype(host.dtype)
        self.itemsize = self.dt.itemsize
        self.guard = 0 if kind == "buffer" else GUARD
        g = np.full(self.guard * self.itemsize, _SENTINEL, np.uint8).view(host.dtype)
        full = np.concatenate([g, host, g]) if self.guard else np.ascontiguousarray(host)
        self.buf = DeviceBuffer.from_numpy(full, device=device)
        self.device = device
        self._views: list[Any] = []
        self.ptr = self.buf.ptr + self.guard * self.itemsize
        self.obj = self._expose(self.ptr, self.n)

    def _expose(self, ptr: int, n: int) -> Any:
        if self.kind == "buffer":
            return self.buf
        if self.kind == "raw":
            return ptr
        if self.kind == "cai":
            typestr = self.buf.__cuda_array_interface__["typestr"]
            return MinimalCAI(ptr, n, self.dt, typestr)
        raw = (ctypes.c_uint8 * (n * self.itemsize)).from_address(ptr)
        view = np.frombuffer(raw, dtype=np.uint8).view(np_dtype(self.dt))
        producer = DLPackProducer(view, device=(kDLCUDA, self.device))
        self._views.append(producer)
        return producer

    def view(self, offset: int, n: int) -> Any:
        """Elements ``[offset, offset + n)`` as an object of the same kind (not ``buffer``)."""
        if self.kind == "buffer":
            raise ValueError("a DeviceBuffer has no sub-views")
        return self._expose(self.ptr + offset * self.itemsize, n)

    def kw(self, count: int) -> dict[str, Any]:
        """The keywords a raw pointer needs; arrays carry their own size and type."""
        return {"count": count, "dtype": self.dt} if self.kind == "raw" else {}

    def read(self) -> np.ndarray:
        """The ``n`` elements, after checking the guards are intact."""
        full = self.buf.to_numpy()
        if self.guard:
            raw = full.view(np.uint8)
            gb = self.guard * self.itemsize
            for part, name in ((raw[:gb], "before"), (raw[raw.size - gb :], "after")):
                if not (part == _SENTINEL).all():
                    raise AssertionError(
                        f"memory {name} a {self.kind} buffer of {self.n} elements was written"
                    )
            return full[self.guard : self.guard + self.n].copy()
        return full.reshape(-1).copy()

    def close(self) -> None:
        self._views.clear()
        self.buf.close()


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


def _check_all_reduce(world: World, spec: Spec) -> None:
    n, dt = spec.count, spec.datatype
    inputs = _inputs(spec, world.size, n, _purpose(spec))
    want = ref_reduce(inputs, dt, spec.op)

    def setup(r: int) -> dict[str, Any]:
        st = {"s": Slot(spec.kind, inputs[r], world.device(r))}
        if not spec.inplace:
            st["r"] = Slot(spec.kind, _garbage(spec, n, r), world.device(r))
        return st

    def call(comm: Communicator, st: dict[str, Any]) -> None:
        recv = st["r"].obj if "r" in st else None
        comm.all_reduce(st["s"].obj, recv, spec.op, **st["s"].kw(n))

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        if "r" in st:
            return st["r"].read(), st["s"].read()
        return st["s"].read(), None

    results = world.collective(setup, call, finish)
    _assert_results(results, lambda r: want, lambda r: inputs[r], "all_reduce")


def _check_reduce(world: World, spec: Spec) -> None:
    n, dt, root = spec.count, spec.datatype, spec.root
    inputs = _inputs(spec, world.size, n, _purpose(spec))
    want = ref_reduce(inputs, dt, spec.op)

    def setup(r: int) -> dict[str, Any]:
        st = {"s": Slot(spec.kind, inputs[r], world.device(r))}
        if not spec.inplace:
            st["r"] = Slot(spec.kind, _garbage(spec, n, r), world.device(r))
        return st

    def call(comm: Communicator, st: dict[str, Any]) -> None:
        recv = st["r"].obj if "r" in st else None
        comm.reduce(st["s"].obj, recv, spec.op, root=root, **st["s"].kw(n))

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        if "r" in st:
            return st["r"].read(), st["s"].read()
        return st["s"].read(), None

    results = world.collective(setup, call, finish)
    _assert_results(results, lambda r: want if r == root else None, lambda r: inputs[r], "reduce")


def _check_broadcast(world: World, spec: Spec) -> None:
    n, root = spec.count, spec.root
    inputs = _inputs(spec, world.size, n, "bytes")

    def setup(r: int) -> dict[str, Any]:
        st = {"s": Slot(spec.kind, inputs[r], world.device(r))}
        if not spec.inplace:
            st["r"] = Slot(spec.kind, _garbage(spec, n, r), world.device(r))
        return st

    def call(comm: Communicator, st: dict[str, Any]) -> None:
        recv = st["r"].obj if "r" in st else None
        comm.broadcast(st["s"].obj, recv, root=root, **st["s"].kw(n))

    def finish(st: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        if "r" in st:
            return st["r"].read(), st["s"].read()
        return st["s"].read(), None

    results = world.collective(setup, call, finish)
    _assert_results(results, lambda r: inputs[root], lambda r: inputs[r], "broadcast")


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
