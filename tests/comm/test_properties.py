"""``comm.properties`` (ncclCommQueryProperties) on the loopback: every rank's own values,
fresh after a split, fields of newer releases ``None`` on an emulated older build, and
NotSupportedError before 2.29.2."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from support.worlds import ThreadWorld, use_loopback

from pynccl import CommProperties, Communicator, NcclInvalidUsage, NotSupportedError, UniqueId
from pynccl.enums import GinConnectionType, GinType


def test_every_rank_sees_its_own_values(thread_worlds: Callable[[int], ThreadWorld]) -> None:
    n = 3
    props = thread_worlds(n).run(lambda r, c: (c.rank, c.size, c.device, c.properties))
    hashes = set()
    for r, (rank, size, device, p) in props.items():
        assert isinstance(p, CommProperties)
        assert (p.rank, p.size, p.device, p.nvml_device) == (r, n, r, r) == (rank, size, device, r)
        # What an emulation without a device API, multicast, GIN or CFT must say.
        assert p.device_api_support is False and p.multimem_support is False
        assert p.gin_type is GinType.NONE and p.railed_gin_type is GinType.NONE
        assert p.gin_connection_type is GinConnectionType.NONE
        assert p.gin_support == frozenset() and p.lsa_teams == 1
        assert p.cft_support is False and p.cft_counted_support is False
        assert isinstance(p.comm_hash, int)
        hashes.add(p.comm_hash)
    assert len(hashes) == 1  # one communicator, one hash


def test_frozen_and_readable(thread_worlds: Callable[[int], ThreadWorld]) -> None:
    p = thread_worlds(1).run(lambda r, c: c.properties)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.rank = 5  # type: ignore[misc]
    assert "rank=0" in repr(p) and "size=1" in repr(p)


def test_queried_afresh_for_a_split_child(thread_worlds: Callable[[int], ThreadWorld]) -> None:
    def run(r: int, c: Communicator) -> tuple[Any, Any]:
        child = c.split(r % 2, key=-r)  # reversed order within each color
        try:
            assert child is not None
            return c.properties, child.properties
        finally:
            if child is not None:
                child.destroy()

    out = thread_worlds(4).run(run)
    for r, (parent, child) in out.items():
        assert (parent.rank, parent.size) == (r, 4)
        members = [q for q in range(4) if q % 2 == r % 2]
        assert child.size == len(members)
        assert child.rank == sorted(members, reverse=True).index(r)
        assert child.device == r
        assert child.comm_hash != parent.comm_hash


def test_refused_on_a_destroyed_communicator(lb: Any) -> None:
    c = Communicator(1, UniqueId(), 0, device=0)
    c.destroy()
    with pytest.raises(NcclInvalidUsage, match="is destroyed"):
        _ = c.properties


def test_older_release_fills_fewer_fields() -> None:
    with use_loopback("2.29.2"):
        c = Communicator(1, UniqueId(), 0, device=0)
        try:
            p = c.properties
        finally:
            c.destroy()
    assert (p.rank, p.size, p.device) == (0, 1, 0)
    assert p.multimem_support is False
    for name in ("gin_type", "lsa_teams", "comm_hash", "gin_support", "cft_support"):
        assert getattr(p, name) is None, name
    assert "gin_type" not in repr(p)


def test_not_supported_before_2_29_2() -> None:
    with use_loopback("2.28.9"):
        c = Communicator(1, UniqueId(), 0, device=0)
        try:
            with pytest.raises(NotSupportedError, match=r"2\.29\.2"):
                _ = c.properties
        finally:
            c.destroy()
