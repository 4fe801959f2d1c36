"""The loopback libnccl fixtures the test_loopback_*.py modules share.

A module takes them with ``from support.clib_fixtures import build, lib, world``; pytest then finds
them in its namespace. ``_build`` makes (or reuses) a loopback build, sanitized when this
process runs under AddressSanitizer (CI's sanitizer step), and skips without a compiler.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from support.clib import GroupWorld, Lib


def _asan_loaded() -> bool:
    with open("/proc/self/maps") as maps:
        return any("libasan" in line for line in maps)


SANITIZE = _asan_loaded()


def _build(version: str | None = None, null: bool = False) -> Any:
    from pynccl.testing import loopback

    try:
        return loopback.build(version, null=null, sanitize=SANITIZE)
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"cannot build the loopback libraries: {exc}")


@pytest.fixture(scope="module")
def build() -> Any:
    return _build()


@pytest.fixture(scope="module")
def lib(build: Any) -> Lib:
    return Lib(build.nccl, build.cudart)


@pytest.fixture
def world(lib: Lib) -> Iterator[Any]:
    """world(n) -> a GroupWorld, closed after the test."""
    made: list[GroupWorld] = []

    def make(n: int) -> GroupWorld:
        w = GroupWorld(lib, n)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()
