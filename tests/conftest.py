"""Shared fixtures: the loopback libraries and worlds of communicators over them.

``build``/``lib``/``world`` (from ``support.clib_fixtures``) are the raw-ctypes loopback libnccl of
the test_loopback_*.py modules. Nothing here is autouse: a test module opts in by asking for
``lb`` (the default loopback build made this process's libnccl/libcudart for the module), or
uses ``support.worlds.use_loopback(version)`` for other emulated releases. Each swap is undone when
its scope ends (the previously loaded libraries and environment come back), so modules that
test the real libnccl or library discovery are unaffected.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support import ROOT

# The raw-ctypes loopback libnccl fixtures (build, lib, world) of the test_loopback_*.py modules.
from support.clib_fixtures import build, lib, world  # noqa: F401


@pytest.fixture(scope="module")
def lb() -> Iterator[Any]:
    """The default loopback (NCCL 2.32.3) as this process's libraries, for one module."""
    from support.worlds import use_loopback

    with use_loopback() as made:
        yield made


@pytest.fixture(scope="session")
def lb_env() -> dict[str, str]:
    """Environment for child processes that should run on the default loopback."""
    from support.worlds import loopback_build, sanitized

    loopback_build()
    from pynccl.testing import loopback

    env = {**os.environ, **loopback.env(sanitize=sanitized())}
    root = str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def thread_worlds(lb: Any) -> Iterator[Callable[[int], Any]]:
    """``get(n)``: a ``ThreadWorld`` of ``n`` ranks, made once per module and size
    (remade if a failure left it broken); all destroyed when the module ends."""
    from support.worlds import ThreadWorld

    worlds: dict[int, ThreadWorld] = {}

    def get(n: int) -> ThreadWorld:
        world = worlds.get(n)
        if world is not None and world.broken:
            world.close()
            world = None
        if world is None:
            world = worlds[n] = ThreadWorld(n)
        return world

    try:
        yield get
    finally:
        for world in worlds.values():
            world.close()


def _one_rank() -> Iterator[Any]:
    """A new communicator of one rank on device 0, destroyed afterwards (destroying it
    twice is harmless)."""
    from pynccl.comm import Communicator, UniqueId

    comm = Communicator(1, UniqueId(), 0, device=0)
    try:
        yield comm
    finally:
        comm.destroy()


@pytest.fixture(scope="module")
def solo(lb: Any) -> Iterator[Any]:
    """A communicator of one rank on device 0 shared by the tests of one module (a module
    may define its own ``solo`` instead)."""
    yield from _one_rank()


@pytest.fixture
def solo_comm(lb: Any) -> Iterator[Any]:
    """A new communicator of one rank on device 0 (nothing remembered yet), destroyed
    after the test."""
    yield from _one_rank()


@pytest.fixture
def new_buffers(lb: Any) -> Iterator[Callable[[Any], Any]]:
    """``new_buffers(n)``: a new float32 DeviceBuffer of ``n`` elements on device 0
    (``new_buffers(array)``: holding ``array``); every one closed after the test."""
    from pynccl.cuda import DeviceBuffer

    made: list[DeviceBuffer] = []

    def make(what: Any) -> DeviceBuffer:
        made.append(
            DeviceBuffer(what, "float32") if type(what) is int else DeviceBuffer.from_numpy(what)
        )
        return made[-1]

    yield make
    for buf in made:
        buf.close()
