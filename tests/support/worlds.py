"""Worlds: the communicators that this process drives, one class per level.

* :class:`ThreadWorld` — every rank is a thread of this process that calls
  ``Communicator(n, uid, rank, device=rank)``, then issues its own collectives;
* :class:`GroupWorld` — ``Communicator.init_all(n)``; this one thread issues each
  collective for every rank inside one ``pynccl.group()``;
* :class:`ProcessWorld` — this process is one rank of a job of separate processes
  (see ``tests/support/rank_worker.py``).

``world.collective(setup, call, finish)`` runs one operation on every rank the
world holds locally and returns ``{rank: finish(...)}`` (``support.suite.check``
builds its calls). The raw-ctypes counterpart of ``GroupWorld``, for the tests of
the loopback libnccl itself, is ``support.clib.GroupWorld``.

Buffers live in loopback device memory (:class:`pynccl.cuda.DeviceBuffer`) and
are handed to pynccl as one of four *kinds* (:class:`Slot`): the ``DeviceBuffer``
itself, a raw ``int`` pointer (with ``count=``/``dtype=``), a minimal object exposing
only ``__cuda_array_interface__``, or a DLPack producer claiming ``kDLCUDA``. All but
the first are surrounded by guard elements that must come back untouched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pynccl import library
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer, Stream
from pynccl.dtypes import as_datatype
from pynccl.enums import DataType
from pynccl.groups import group
from support.producers import DLPackProducer, kDLCUDA
from support.reference import np_dtype

__all__ = [
    "KINDS",
    "TIMEOUT",
    "GroupWorld",
    "MinimalCAI",
    "ProcessWorld",
    "RankThreads",
    "Slot",
    "ThreadWorld",
    "World",
    "loopback_build",
    "sanitized",
    "use_loopback",
]

#: Seconds any single collective may take before a test calls it hung.
TIMEOUT = 60.0
KINDS = ("buffer", "raw", "cai", "dlpack")
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
