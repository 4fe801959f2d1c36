"""ncclCommQueryProperties, the team functions and ncclSetEncryption on the loopback.

Raw ctypes, through the host.h prototype table (pynccl._capi.nccl_device). Expected
values are the communicator's own (rank, size, device) and what an emulation without a
device API, multicast or GIN must say: no. Encryption: ranks of a process world whose
keys differ are refused at init, as their TLS handshake would fail with NCCL.
"""

from __future__ import annotations

import ctypes
from ctypes import byref
from typing import Any

import pytest
from support.clib import Lib
from support.clib_rma import (
    INVALID_ARG,
    INVALID_USAGE,
    SYSTEM,
    Rank,
    set_encryption,
    spawn_job,
)
from support.wait import threads

from pynccl._capi.nccl_device import make_comm_properties, ncclCommProperties_t, ncclTeam_t


def test_properties_of_every_rank(lib: Lib) -> None:
    n = 3
    uid = lib.unique_id()

    def rank(me: int) -> ncclCommProperties_t:
        r = Rank(lib, uid, n, me)
        props = make_comm_properties()
        props.ginSupport[5] = True  # must be cleared
        rc = lib.nccl.ncclCommQueryProperties(r.comm, byref(props))  # the checked wrapper
        r.close()
        assert rc == 0
        return props

    for me, p in enumerate(threads(n, rank)):
        assert (p.rank, p.nRanks, p.cudaDev, p.nvmlDev) == (me, n, me, me)
        assert not p.deviceApiSupport and not p.multimemSupport
        assert p.hostRmaSupport  # numRmaCtx defaults to 1: ncclPutSignal works (signal.c)
        assert not any(p.ginSupport) and p.ginType == 0 and p.nLsaTeams == 1
        assert not (p.cftSupport or p.cftMulticastSupport or p.cftCountedSupport)
    assert ctypes.sizeof(ncclCommProperties_t) == 152


def test_properties_misuse_and_versions(lib: Lib) -> None:
    r = Rank(lib, lib.unique_id(), 1, 0)
    try:
        q = lib.ncclCommQueryProperties
        props = make_comm_properties()
        props.magic = 0
        assert q(r.comm, byref(props)) == INVALID_USAGE
        assert "NCCL_COMM_PROPERTIES_INITIALIZER" in lib.last_error()
        assert q(r.comm, byref(make_comm_properties(23301))) == INVALID_USAGE
        assert "NCCL library is too old" in lib.last_error()
        assert q(r.comm, None) == INVALID_ARG
        # an older caller: fields newer than 2.29.3 stay as the caller left them
        old = make_comm_properties(22902)
        old.nLsaTeams = -7
        assert q(r.comm, byref(old)) == 0 and old.rank == 0 and old.nLsaTeams == -7
        # a smaller struct is filled up to its size only
        small = make_comm_properties()
        small.size = ncclCommProperties_t.nRanks.offset  # room for rank only
        small.nRanks = -3
        assert q(r.comm, byref(small)) == 0 and small.rank == 0 and small.nRanks == -3
    finally:
        r.close()


def test_teams(lib: Lib) -> None:
    n = 4
    uid = lib.unique_id()

    def rank(me: int) -> list[Any]:
        r = Rank(lib, uid, n, me)
        L = lib.nccl
        world, lsa, rail = L.ncclTeamWorld(r.comm), L.ncclTeamLsa(r.comm), L.ncclTeamRail(r.comm)
        out = [(t.nRanks, t.rank, t.stride) for t in (world, lsa, rail)] + [
            [L.ncclTeamRankToWorld(r.comm, world, k) for k in range(n)],
            [L.ncclTeamRankToLsa(r.comm, lsa, k) for k in range(n)],
            L.ncclTeamRankToWorld(r.comm, rail, 0),
        ]
        r.close()
        return out

    for me, (world, lsa, rail, to_world, to_lsa, rail0) in enumerate(threads(n, rank)):
        assert world == lsa == (n, me, 1)  # every peer's memory is reachable: LSA = world
        assert rail == (1, 0, n)
        assert to_world == to_lsa == list(range(n))
        assert rail0 == me
    assert ctypes.sizeof(ncclTeam_t) == 12


def test_set_encryption_checks_its_argument(lib: Lib) -> None:
    assert lib.ncclSetEncryption(None) == INVALID_ARG
    assert set_encryption(lib, b"k" * 40, magic=0) == INVALID_ARG
    assert "NCCL_ENCRYPTION_CONFIG_INITIALIZER" in lib.last_error()
    assert set_encryption(lib, b"too short") == INVALID_ARG
    assert "at least 32 characters" in lib.last_error()
    assert set_encryption(lib, b"k" * 32) == 0
    # in one process every rank shares the key
    r = Rank(lib, lib.unique_id(), 1, 0)
    assert r.init_rc == 0
    r.close()
    assert set_encryption(lib, None) == 0


@pytest.mark.parametrize("keys, ok", [(("a", "b"), False), (("a", "a"), True)])
def test_ranks_with_different_keys_are_refused_at_init(
    build: Any, lib: Lib, keys: tuple[str, str], ok: bool
) -> None:
    jobs = spawn_job(build, "enc", lib.unique_id(), 2, *keys)
    for events in jobs:
        init = next(e for e in events if e["event"] == "init")
        if ok:
            assert init["rc"] == 0
        else:
            assert init["rc"] == SYSTEM
            assert "different encryption settings" in init["error"]
