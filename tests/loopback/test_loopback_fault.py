"""The loopback libnccl's fault tolerance and suspend/resume, through raw ctypes.

ncclCommRevoke / ncclCommShrink / ncclCommGetUniqueId + ncclCommGrow and
ncclCommSuspend / ncclCommResume / ncclCommMemStats, in thread worlds (one thread
driving every rank inside groups, or a thread per rank) and process worlds (a rank
SIGKILLed, then the survivors shrink; a world grown from 2 to 4 processes). Every
result is checked against numpy; the memory a suspend releases is read from the
kernel's own accounting (/proc/self/smaps).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from ctypes import byref, c_int, c_uint64, c_void_p
from typing import Any

import numpy as np
import pytest
from support.clib import (
    IN_PROGRESS,
    INVALID_ARG,
    INVALID_USAGE,
    REMOTE,
    SUCCESS,
    SUM,
    GroupWorld,
    Lib,
)
from support.reference import make_input, ref_reduce
from test_loopback_nccl import events, rendezvous_open, spawn

from pynccl._capi.structs import ncclUniqueId

SHRINK_DEFAULT, SHRINK_ABORT = 0, 1
SUSPEND_MEM = 1
STAT_SUSPEND, STAT_SUSPENDED, STAT_PERSIST, STAT_TOTAL = range(4)


def allreduce_checked(
    lib: Lib, comms: list[int], devices: list[int], count: int, seed: int
) -> None:
    """One float32 sum all-reduce over comms (one group, from this thread), against numpy."""
    n = len(comms)
    sends = [make_input(np.float32, count, r, seed) for r in range(n)]
    streams = [lib.stream(d) for d in devices]
    bufs = [(lib.malloc(count * 4, d), lib.malloc(count * 4, d)) for d in devices]
    try:
        for r in range(n):
            lib.upload(bufs[r][0], sends[r])
        assert lib.ncclGroupStart() == 0
        codes = [
            lib.ncclAllReduce(bufs[r][0], bufs[r][1], count, 7, SUM, comms[r], streams[r])
            for r in range(n)
        ]
        end = lib.ncclGroupEnd()
        assert end in (SUCCESS, IN_PROGRESS) and codes == [0] * n, (codes, lib.last_error())
        for c in comms:  # a nonblocking comm's group end may be in progress
            while (e := lib.async_error(c)) == IN_PROGRESS:
                pass
            assert e == SUCCESS, lib.last_error()
        for s in streams:
            assert lib.sync(s) == 0
        want = ref_reduce(sends)
        for r in range(n):
            np.testing.assert_array_equal(lib.download(bufs[r][1], np.float32, count), want)
    finally:
        for s in streams:
            lib.destroy_stream(s)
        for sb, rb in bufs:
            lib.free(sb)
            lib.free(rb)


def shrink_all(lib: Lib, comms: list[int], exclude: list[int], flags: int) -> list[int]:
    """ncclCommShrink on every rank not excluded, in one group; the children in order."""
    excl = (c_int * max(len(exclude), 1))(*exclude)
    out = [c_void_p() for _ in comms]
    assert lib.ncclGroupStart() == 0
    for r, c in enumerate(comms):
        if r not in exclude:
            rc = lib.ncclCommShrink(c, excl, len(exclude), byref(out[r]), None, flags)
            assert rc == 0, lib.last_error()
    assert lib.ncclGroupEnd() == 0, lib.last_error()
    return [int(o.value or 0) for r, o in enumerate(out) if r not in exclude]


def stat(lib: Lib, comm: int, which: int) -> int:
    v = c_uint64(12345)
    assert lib.ncclCommMemStats(comm, which, byref(v)) == 0, lib.last_error()
    return v.value


# ---- shrink --------------------------------------------------------------------------


def test_shrink_renumbers_the_remaining_ranks(lib: Lib, world: Any) -> None:
    w = world(4)
    kids = shrink_all(lib, w.comms, [1, 3], SHRINK_DEFAULT)
    try:
        assert [lib.user_rank(k) for k in kids] == [0, 1]
        assert [lib.count(k) for k in kids] == [2, 2]
        dev = c_int()
        assert lib.ncclCommCuDevice(kids[1], byref(dev)) == 0 and dev.value == 2
        allreduce_checked(lib, kids, [0, 2], 1000, seed=1)
        allreduce_checked(lib, w.comms, [0, 1, 2, 3], 100, seed=2)  # the parent still works
    finally:
        for k in kids:
            assert lib.ncclCommDestroy(k) == 0


def test_shrink_argument_errors(lib: Lib, world: Any) -> None:
    w = world(3)
    out = c_void_p(1)
    for excl, count, flags, code, words in (
        ([0], 1, 0, INVALID_ARG, "rank 0 is in excludeRanksList"),
        ([5], 1, 0, INVALID_ARG, "excludeRanksList[0] = 5 is not a rank"),
        ([1, 1], 2, 0, INVALID_ARG, "rank 1 appears twice"),
        ([1], 1, 7, INVALID_ARG, "invalid shrinkFlags 7"),
        ([1, 2, 0], 3, 0, INVALID_ARG, "invalid excludeRanksCount 3"),
        ([1], -1, 0, INVALID_ARG, "invalid excludeRanksCount -1"),
    ):
        arr = (c_int * len(excl))(*excl)
        assert lib.ncclCommShrink(w.comms[0], arr, count, byref(out), None, flags) == code
        assert words in lib.last_error()
        assert out.value is None
    assert lib.ncclCommShrink(w.comms[0], None, 1, byref(out), None, 0) == INVALID_ARG
    assert lib.ncclCommShrink(w.comms[0], None, 0, None, None, 0) == INVALID_ARG


# ---- revoke ----------------------------------------------------------------------------


def test_revoke_stops_a_hung_operation_then_shrink(
    lib: Lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "2")
    w = GroupWorld(lib, 3)
    monkeypatch.delenv("PYNCCL_LOOPBACK_HANG")  # the children do not hang
    kids: list[int] = []
    try:
        p = [w.alloc(r, 64) for r in range(3)]
        assert not any(
            w.run(lambda r: lib.ncclAllReduce(p[r], p[r], 4, 7, SUM, w.comms[r], w.streams[r]))
        )
        assert lib.ncclGroupStart() == 0
        for r in range(3):  # the second operation hangs on every rank
            assert lib.ncclAllReduce(p[r], p[r], 4, 7, SUM, w.comms[r], w.streams[r]) == 0
        assert lib.ncclGroupEnd() == 0
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (lib.sync(w.streams[0]), done.set()))
        waiter.start()
        assert not done.wait(0.3)
        for c in w.comms:  # blocking comms: each returns once its hung task stopped
            assert lib.ncclCommRevoke(c, 0) == 0, lib.last_error()
        waiter.join(timeout=30)
        assert done.is_set()
        for r in range(3):
            assert lib.sync(w.streams[r]) == 0
        assert [lib.async_error(c) for c in w.comms] == [SUCCESS] * 3  # quiescent
        # now only split, shrink, abort and destroy may use it (split: the strict tests)
        assert lib.ncclAllReduce(p[0], p[0], 4, 7, SUM, w.comms[0], w.streams[0]) == INVALID_USAGE
        assert "was revoked" in lib.last_error()
        assert lib.ncclCommFinalize(w.comms[0]) == INVALID_USAGE
        assert lib.ncclCommRevoke(w.comms[0], 1) == INVALID_ARG
        assert "revokeFlags 1" in lib.last_error()
        kids = shrink_all(lib, w.comms, [2], SHRINK_DEFAULT)
        allreduce_checked(lib, kids, [0, 1], 5000, seed=3)
    finally:
        for k in kids:
            assert lib.ncclCommDestroy(k) == 0
        w.close()


def test_nonblocking_revoke_reads_in_progress_until_quiescent(
    lib: Lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pynccl._capi.structs import make_config

    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "1")
    cfg = make_config({"blocking": 0})
    comm = c_void_p()
    lib.set_device(0)
    rc = lib.ncclCommInitRankConfig(byref(comm), 1, lib.unique_id(), 0, byref(cfg))
    assert rc in (SUCCESS, IN_PROGRESS)
    while lib.async_error(comm.value) == IN_PROGRESS:
        pass
    s = lib.stream(0)
    p = lib.malloc(16)
    try:
        # an implicit non-blocking group: launched by a worker, then it hangs on the stream
        assert lib.ncclAllReduce(p, p, 4, 7, SUM, comm.value, s) == IN_PROGRESS
        while lib.async_error(comm.value) == IN_PROGRESS:
            pass
        assert lib.ncclCommRevoke(comm.value, 0) == IN_PROGRESS
        assert lib.sync(s) == 0
        seen = set()
        for _ in range(10_000):
            e = lib.async_error(comm.value)
            seen.add(e)
            if e == SUCCESS:
                break
        assert e == SUCCESS and seen <= {IN_PROGRESS, SUCCESS}
    finally:
        assert lib.ncclCommDestroy(comm.value) == 0
        lib.destroy_stream(s)
        lib.free(p)


# ---- suspend / resume ------------------------------------------------------------------


def mapping_rss_kb(name_part: str) -> list[int]:
    """Rss (kB) of every mapping of this process whose name contains name_part."""
    out, current = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:
                current = len(fields) >= 6 and name_part in fields[5]
            elif current and fields[0] == "Rss:":
                out.append(int(fields[1]))
    return out


def test_suspend_releases_the_world_and_resume_restores_it(
    lib: Lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_DIRECT", "0")  # collectives go through the slots
    w = GroupWorld(lib, 2)
    try:
        count = 1 << 20
        allreduce_checked(lib, w.comms, [0, 1], count, seed=4)
        suspendable = [stat(lib, c, STAT_SUSPEND) for c in w.comms]
        persist = [stat(lib, c, STAT_PERSIST) for c in w.comms]
        assert all(s > 1 << 20 for s in suspendable) and all(p > 0 for p in persist)
        assert [stat(lib, c, STAT_TOTAL) for c in w.comms] == [
            s + p for s, p in zip(suspendable, persist)
        ]
        assert [stat(lib, c, STAT_SUSPENDED) for c in w.comms] == [0, 0]
        rss_before = mapping_rss_kb("memfd:pynccl-lb-")

        assert lib.ncclCommSuspend(w.comms[0], 2) == INVALID_ARG
        assert "invalid flags 0x2" in lib.last_error()
        assert lib.ncclCommResume(w.comms[0]) == INVALID_USAGE
        assert "is not suspended" in lib.last_error()
        assert lib.ncclCommSuspend(w.comms[0], SUSPEND_MEM) == 0
        assert stat(lib, w.comms[0], STAT_SUSPENDED) == 1
        assert stat(lib, w.comms[0], STAT_SUSPEND) == suspendable[0]  # rank 1 still active
        assert lib.ncclCommSuspend(w.comms[0], SUSPEND_MEM) == INVALID_USAGE
        assert "already suspended" in lib.last_error()
        p = w.alloc(0, 16)
        assert lib.ncclAllReduce(p, p, 4, 7, SUM, w.comms[0], w.streams[0]) == INVALID_USAGE
        assert "is suspended" in lib.last_error() and "ncclCommResume" in lib.last_error()

        assert lib.ncclCommSuspend(w.comms[1], SUSPEND_MEM) == 0  # the last: pages released
        # NCCL's tracked totals stay as they were (src/mem_manager.cc): only the pages go
        assert [stat(lib, c, STAT_SUSPEND) for c in w.comms] == suspendable
        assert [stat(lib, c, STAT_TOTAL) for c in w.comms] == [
            s + p for s, p in zip(suspendable, persist)
        ]
        assert [stat(lib, c, STAT_SUSPENDED) for c in w.comms] == [1, 1]
        rss_suspended = mapping_rss_kb("memfd:pynccl-lb-")
        released_kb = sum(suspendable) // 1024  # both mappings drop what both ranks held
        assert sum(rss_before) - sum(rss_suspended) >= released_kb, (rss_before, rss_suspended)

        for c in w.comms:
            assert lib.ncclCommResume(c) == 0, lib.last_error()
        assert [stat(lib, c, STAT_SUSPENDED) for c in w.comms] == [0, 0]
        assert [stat(lib, c, STAT_SUSPEND) for c in w.comms] == suspendable
        allreduce_checked(lib, w.comms, [0, 1], count, seed=5)
        bad = c_uint64()
        assert lib.ncclCommMemStats(w.comms[0], 9, byref(bad)) == INVALID_ARG
        assert lib.ncclCommMemStats(w.comms[0], STAT_TOTAL, None) == INVALID_ARG
    finally:
        w.close()


# ---- process worlds: shrink after SIGKILL, grow 2 -> 4 -------------------------------------


def test_shrink_after_a_rank_is_sigkilled(lib: Lib, build: Any) -> None:
    uid, n, victim = lib.unique_id(), 3, 1
    procs = spawn(build, "shrink", uid, n, str(victim))
    for p in procs:
        line = p.stdout.readline() if p.stdout else ""
        assert json.loads(line) == {"event": "ready", "rc": 0}, line
    os.kill(procs[victim].pid, signal.SIGKILL)
    procs[victim].wait(timeout=30)
    for r in range(n):
        if r == victim:
            continue
        ev = events(procs[r], timeout=60)
        failed = next(e for e in ev if e["event"] == "parent")
        assert failed["async_error"] == REMOTE, failed
        child = next(e for e in ev if e["event"] == "child")
        assert child == {"event": "child", "rc": 0, "rank": r - (r > victim), "size": 2, "ok": True}
        assert ev[-1] == {"event": "exit", "ok": True}


@pytest.mark.slow
def test_grow_from_2_to_4_processes(lib: Lib, build: Any) -> None:
    uid = lib.unique_id()
    old = spawn(build, "grow_old", uid, 2, "4")
    assert old[0].stdout is not None
    grow = json.loads(old[0].stdout.readline())
    assert grow["event"] == "grow_id" and grow["rc"] == 0, grow
    gid = ncclUniqueId.from_buffer_copy(bytes.fromhex(grow["uid"]))
    new = spawn(build, "grow_new", gid, 4, ranks=[2, 3])
    for r, p in enumerate([*old, *new]):
        ev = events(p, timeout=60)
        done = next(e for e in ev if e["event"] == "grown")
        assert done == {"event": "grown", "rc": 0, "rank": r, "size": 4, "ok": True}, ev
        assert ev[-1] == {"event": "exit", "ok": True}
    assert not rendezvous_open(gid)


# ---- grow in a thread world, and its argument errors ------------------------------------


def test_grow_in_a_thread_world_and_its_errors(lib: Lib, world: Any) -> None:
    w = world(2)
    gid = ncclUniqueId()
    assert lib.ncclCommGetUniqueId(w.comms[0], byref(gid)) == 0
    again = ncclUniqueId()
    assert lib.ncclCommGetUniqueId(w.comms[0], byref(again)) == INVALID_USAGE
    assert "not consumed" in lib.last_error()
    out = c_void_p(1)
    for args, code, words in (
        ((w.comms[0], 3, byref(gid), 0), INVALID_ARG, "passes rank -1"),
        ((w.comms[0], 2, byref(gid), -1), INVALID_ARG, "nRanks 2 must exceed"),
        ((w.comms[1], 3, byref(again), -1), INVALID_USAGE, "not made by ncclCommGetUniqueId"),
        ((None, 3, None, 2), INVALID_ARG, "needs the uniqueId"),
        ((None, 3, byref(gid), 3), INVALID_ARG, "Invalid rank requested : 3/3"),
    ):
        assert lib.ncclCommGrow(*args, byref(out), None) == code, lib.last_error()
        assert words in lib.last_error()
        assert out.value is None

    grown: list[int] = [0, 0, 0]
    errors: list[str] = []

    def existing(r: int) -> None:
        nc = c_void_p()
        uid = byref(gid) if r == 0 else None
        lib.set_device(r)
        if lib.ncclCommGrow(w.comms[r], 3, uid, -1, byref(nc), None) != 0:
            errors.append(lib.last_error())
        grown[r] = int(nc.value or 0)

    def new_rank() -> None:
        nc = c_void_p()
        lib.set_device(2)
        if lib.ncclCommGrow(None, 3, byref(gid), 2, byref(nc), None) != 0:
            errors.append(lib.last_error())
        grown[2] = int(nc.value or 0)

    threads = [threading.Thread(target=existing, args=(1,)), threading.Thread(target=new_rank)]
    for t in threads:
        t.start()
    existing(0)  # the root posts the id last: rank 1 waited for it in the parent's world
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    assert errors == [] and all(grown), errors
    try:
        assert [lib.user_rank(c) for c in grown] == [0, 1, 2]
        assert [lib.count(c) for c in grown] == [3, 3, 3]
        allreduce_checked(lib, grown, [0, 1, 2], 3000, seed=6)
        # the id was consumed: a new one may be taken, the old one is refused
        assert lib.ncclCommGrow(w.comms[0], 4, byref(gid), -1, byref(out), None) == INVALID_USAGE
        assert lib.ncclCommGetUniqueId(w.comms[0], byref(again)) == 0
    finally:
        for c in grown:
            assert lib.ncclCommDestroy(c) == 0


def test_nonblocking_shrink_completes_as_the_child_is_polled(lib: Lib) -> None:
    from pynccl._capi.structs import make_config

    cfg = make_config({"blocking": 0})
    comms = [c_void_p(), c_void_p()]
    uid = lib.unique_id()
    assert lib.ncclGroupStart() == 0
    for r in range(2):
        lib.set_device(r)
        rc = lib.ncclCommInitRankConfig(byref(comms[r]), 2, uid, r, byref(cfg))
        assert rc in (SUCCESS, IN_PROGRESS)
    lib.set_device(0)
    assert lib.ncclGroupEnd() in (SUCCESS, IN_PROGRESS)
    for c in comms:
        while lib.async_error(c.value) == IN_PROGRESS:
            pass
    child = c_void_p()
    excl = (c_int * 1)(1)
    rc = lib.ncclCommShrink(comms[0].value, excl, 1, byref(child), None, SHRINK_DEFAULT)
    assert rc in (SUCCESS, IN_PROGRESS), lib.last_error()
    assert child.value  # the handle is there at once; it is ready once polled so
    while (e := lib.async_error(child.value)) == IN_PROGRESS:
        pass
    try:
        assert e == SUCCESS and lib.count(child.value) == 1
        allreduce_checked(lib, [int(child.value)], [0], 100, seed=7)
    finally:
        assert lib.ncclCommDestroy(child.value) == 0
        for c in comms:
            assert lib.ncclCommDestroy(c.value) == 0
