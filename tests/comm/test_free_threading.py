"""Shared state without the GIL (docs/architecture.md, "Without the GIL"): the tables filled on a
miss are filled once however many threads miss together, the registry of live communicators
can be listed while other threads make and drop communicators, and an object left undestroyed
at interpreter exit says so with its ResourceWarning and nothing else (free-threaded 3.13 runs
finalizers after the modules' globals are gone).

Each race is made wide on purpose (a slow step where two threads used to interleave), so the
tests fail on the old code with or without the GIL; ``scripts/free_threaded.sh`` also runs them
on a free-threaded interpreter with the GIL off.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from ctypes import c_int
from typing import Any

import pytest
from support import ROOT

from pynccl._capi import _binding
from pynccl.comm import _args, _state
from pynccl.enums import DataType, RedOp

THREADS = 4


def _together(fn: Any, n: int = THREADS) -> list[Any]:
    """``fn()`` on ``n`` threads released at once; their results, in thread order."""
    start = threading.Barrier(n)
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        start.wait()
        try:
            out[i] = fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("kind", ["dtype", "op"])
def test_threads_missing_a_release_table_at_once_share_one(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # What the checked path learns into one communicator's table must reach every other
    # communicator of the release: one table, whoever made it.
    if kind == "dtype":
        monkeypatch.setattr(_args, "_DTYPE_TABLES", {})
        names = _args.known_names

        def slow_names() -> Any:
            time.sleep(0.01)
            return names()

        monkeypatch.setattr(_args, "known_names", slow_names)
        make = _args.dtype_table
    else:
        monkeypatch.setattr(_args, "_OP_TABLES", {})

        class SlowOps:
            AVG = RedOp.AVG

            def __iter__(self) -> Any:
                for op in RedOp:
                    time.sleep(0.002)
                    yield op

        monkeypatch.setattr(_args, "RedOp", SlowOps())
        make = _args.op_table
    tables = _together(lambda: make((2, 32, 3)))
    assert all(t is tables[0] for t in tables)
    assert tables[0] is make((2, 32, 3))
    if kind == "dtype":
        assert tables[0]["float32"].value == int(DataType.FLOAT32)


class _FakeFunction:
    """A C function object that counts how often its argtypes are set (slowly)."""

    def __init__(self) -> None:
        self.sets = 0
        self.restype: Any = None
        self._argtypes: Any = None

    @property
    def argtypes(self) -> Any:
        return self._argtypes

    @argtypes.setter
    def argtypes(self, value: Any) -> None:
        self.sets += 1
        time.sleep(0.005)
        self._argtypes = value


class _FakeCDLL:
    """Like ctypes.CDLL: one cached function object per name."""

    def __init__(self) -> None:
        self.functions: dict[str, _FakeFunction] = {}

    def __getattr__(self, name: str) -> _FakeFunction:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.functions.setdefault(name, _FakeFunction())


def test_a_function_is_bound_once_when_threads_ask_for_it_at_once() -> None:
    # CDLL hands every thread the same function object; setting its argtypes while another
    # thread sets or calls it races inside ctypes without the GIL: bound once, under a lock.
    class Lib(_binding.BoundLibrary):
        PROTOTYPES = {"f": _binding.Prototype((1, 0, 0), c_int, (("x", c_int),))}

    cdll = _FakeCDLL()
    lib = Lib(cdll)  # type: ignore[arg-type]
    got = _together(lambda: lib.raw("f"))
    assert all(g is cdll.functions["f"] for g in got)
    assert cdll.functions["f"].sets == 1
    assert cdll.functions["f"].argtypes == [c_int]


class _Tracked:
    """A stand-in communicator: weak-referenceable and hashable, as Communicator is."""


def test_live_communicators_are_listed_while_others_come_and_go() -> None:
    # A capture's hook and a flight dump list the live communicators from any thread while
    # other threads make and drop theirs: a listing must never fail half way.
    kept = [_Tracked() for _ in range(2000)]
    for one in kept:
        _state.track(one)
    del one
    stop = time.monotonic() + 1.0
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while time.monotonic() < stop:
                extra = [_Tracked() for _ in range(50)]
                for obj in extra:
                    _state.track(obj)
                del extra, obj
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        listings = 0
        while time.monotonic() < stop:
            live = _state.live_handles()
            assert set(map(id, kept)) <= set(map(id, live))
            listings += 1
    finally:
        worker.join(30)
    assert not errors
    assert listings > 10
    del kept, live
    assert not [c for c in _state.live_handles() if isinstance(c, _Tracked)]


_LEFT_AT_EXIT = """
import pynccl
from pynccl.testing import loopback
loopback.use()
# A program that names pynccl's modules keeps them alive until exit, so that their globals
# are cleared before what __main__ still holds is finalized (free-threaded 3.13 does that
# for every program).
from pynccl.comm import _core
from pynccl.cuda import _buffer
comm = pynccl.Communicator(1, pynccl.UniqueId(), 0, device=0)
buf = pynccl.DeviceBuffer(4, "float32", device=0)
comm.all_reduce(buf, buf)
comm.synchronize()
print("left undestroyed", flush=True)
"""
_WARNING = (
    "ResourceWarning: pynccl.Communicator rank 0/1 was never destroyed; call destroy()/abort() "
    "or use it as a context manager"
)


def _interpreters() -> list[str]:
    """This interpreter, and the free-threaded one scripts/free_threaded.sh built, if cached."""
    import os

    cache = os.environ.get("PYNCCL_CACHE_DIR") or os.path.expanduser("~/.cache/pynccl")
    ft = os.path.join(cache, "free-threaded", "cpython-3.13t", "bin", "python3.13t")
    found = [sys.executable]
    if os.access(ft, os.X_OK) and "free-threading" not in sys.version:
        found.append(ft)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("python", _interpreters())
def test_an_undestroyed_communicator_at_exit_prints_its_warning_and_nothing_else(
    lb_env: dict[str, str], python: str
) -> None:
    for flags in ([], ["-W", "always::ResourceWarning"]):
        proc = subprocess.run(
            [python, *flags, "-c", _LEFT_AT_EXIT],
            env={**lb_env, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(ROOT),
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "left undestroyed\n"
        # The warning, where the interpreter still shows warnings that late (3.11 does;
        # free-threaded 3.13 has dropped its filters by then); never an ignored exception.
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        unexpected = [line for line in lines if not line.endswith(_WARNING)]
        assert not unexpected, proc.stderr
        assert len(lines) <= (1 if flags else 0), proc.stderr
