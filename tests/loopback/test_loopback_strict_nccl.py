"""The loopback libnccl as strict as NCCL: one test per row of issue 20's leniency table
(the libnccl half), through raw ctypes.

Each test shows what NCCL does, read from its source (src/group.cc, init.cc, enqueue.cc,
dev_runtime.cc, mem_manager.cc) and nccl.h 2.32.3, and fails on the lenient loopback
that came before; data is checked against numpy. Calls that block are made on helper
threads and checked with generous bounds ("not returned after 1 s", "returned within
20 s"). A hang NCCL never ends (2.31.2's teardown barrier) runs in a child process
(tests/support/clib_strict.py), which the test kills.
"""

from __future__ import annotations

import os
import subprocess
import sys
from ctypes import byref, c_int, c_uint64, c_void_p
from typing import Any

import numpy as np
import pytest
from support import SUPPORT
from support.clib import (
    IN_PROGRESS,
    INTERNAL,
    INVALID_ARG,
    INVALID_USAGE,
    SUCCESS,
    SUM,
    GroupWorld,
    Lib,
)
from support.clib_rma import CUDA_ERR, WIN_SYMMETRIC, Rank, read_f32, write_f32
from support.clib_strict import (
    Bg,
    allreduce_group,
    child_events,
    child_self_put,
    next_event,
    nonblocking_world,
    poll_ready,
)
from support.reference import make_input, ref_reduce
from support.wait import threads

from pynccl._capi.nccl_device import make_comm_properties
from pynccl._capi.structs import make_config

STRICT_HELPER = str(SUPPORT / "clib_strict.py")
FLOAT32 = 7
SHRINK_DEFAULT, SHRINK_ABORT = 0, 1
SUSPEND_MEM = 1
STAT_SUSPEND, STAT_SUSPENDED, STAT_PERSIST, STAT_TOTAL = range(4)
THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal
NOT_READY = "before the previous operation returned ncclSuccess"


@pytest.fixture(scope="module")
def lib() -> Lib:
    from support.clib_fixtures import _build

    b = _build()
    return Lib(b.nccl, b.cudart)


# ---- non-blocking group ends (src/group.cc: ncclGroupEndInternal, groupLaunchNonBlocking) --


def test_nonblocking_group_end_launches_later_and_every_comm_is_in_progress(
    lib: Lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ncclGroupEnd returns ncclInProgress and launches from a thread of its own; every
    communicator of the group reads ncclInProgress (not only one whose call said so: the
    calls inside the group returned ncclSuccess), a call meanwhile is refused with
    ncclInvalidArgument, which the next poll then reads (ncclCommSetAsyncError), and the
    collective is not on its stream yet: a synchronize returns before it even ran."""
    n, count = 2, 1000
    comms = nonblocking_world(lib, n)
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", "3")  # read at each group end
    streams = [lib.stream(r) for r in range(n)]
    sends = [make_input(np.float32, count, r, seed=21) for r in range(n)]
    bufs = [lib.malloc(count * 4, r) for r in range(n)]
    try:
        for r in range(n):
            lib.upload(bufs[r], sends[r])
        assert allreduce_group(lib, comms, streams, bufs, count) == [SUCCESS, SUCCESS, IN_PROGRESS]
        assert lib.async_error(comms[0]) == IN_PROGRESS  # poll 1 of 3
        for r in range(n):  # nothing was launched: the stream is empty
            assert lib.sync(streams[r]) == 0
            np.testing.assert_array_equal(lib.download(bufs[r], np.float32, count), sends[r])
        assert lib.ncclCommDestroy(comms[0]) == INVALID_ARG and NOT_READY in lib.last_error()
        rc = lib.ncclAllReduce(bufs[1], bufs[1], count, FLOAT32, SUM, comms[1], streams[1])
        assert rc == INVALID_ARG and NOT_READY in lib.last_error()
        assert lib.async_error(comms[1]) == INVALID_ARG  # poll 2: the refusal, stored
        assert lib.async_error(comms[0]) == IN_PROGRESS  # poll 3: the launch may go
        for c in comms:  # the job's own result replaces the refusal's
            assert poll_ready(lib, c, (IN_PROGRESS, INVALID_ARG)) == SUCCESS, lib.last_error()
        for r in range(n):
            assert lib.sync(streams[r]) == 0
            np.testing.assert_array_equal(
                lib.download(bufs[r], np.float32, count), ref_reduce(sends)
            )
        # one operation outside a group is an implicit group, as in ncclEnqueueCheck
        for r in range(n):
            rc = lib.ncclAllReduce(bufs[r], bufs[r], count, FLOAT32, SUM, comms[r], streams[r])
            assert rc == IN_PROGRESS
        for c in comms:
            assert poll_ready(lib, c) == SUCCESS, lib.last_error()
        for r in range(n):
            assert lib.sync(streams[r]) == 0
            want = ref_reduce([ref_reduce(sends)] * n)
            np.testing.assert_array_equal(lib.download(bufs[r], np.float32, count), want)
    finally:
        for c in comms:
            poll_ready(lib, c, (IN_PROGRESS, INVALID_ARG))
            assert lib.ncclCommDestroy(c) == 0, lib.last_error()
        for r in range(n):
            lib.destroy_stream(streams[r])
            lib.free(bufs[r])


def test_an_abort_ends_a_held_nonblocking_group(lib: Lib, monkeypatch: pytest.MonkeyPatch) -> None:
    comms = nonblocking_world(lib, 1)
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", "1000000")  # read at group ends
    s, p = lib.stream(0), lib.malloc(64)
    try:
        assert lib.ncclAllReduce(p, p, 4, FLOAT32, SUM, comms[0], s) == IN_PROGRESS
        assert lib.async_error(comms[0]) == IN_PROGRESS
        aborting = Bg(lambda: lib.ncclCommAbort(comms[0]))
        assert aborting.done(20) and aborting.result == SUCCESS
    finally:
        lib.destroy_stream(s)
        lib.free(p)


# ---- host calls that block (init.cc: commDestroySync, ncclCommRevoke; enqueue.cc) ----------


def test_finalize_revoke_and_default_shrink_wait_for_outstanding_work(lib: Lib) -> None:
    """NCCL's finalize, revoke and default shrink wait for every operation the comm
    issued (they synchronize its device stream): a collective whose peer never joins
    keeps them waiting until an abort, and so does one still queued behind other work
    on its stream (a revoke ends it at once when the stream reaches it)."""
    # finalize: rank 0's all-reduce waits for rank 1, which aborts instead
    w = GroupWorld(lib, 2)
    p = [w.alloc(r, 64) for r in range(2)]
    assert lib.ncclAllReduce(p[0], p[0], 4, FLOAT32, SUM, w.comms[0], w.streams[0]) == 0
    fin = Bg(lambda: lib.ncclCommFinalize(w.comms[0]))
    assert not fin.done(1.0)
    assert lib.ncclCommAbort(w.comms[1]) == 0
    assert fin.done(20) and fin.result == SUCCESS
    w.comms[1] = 0
    w.close()

    # default shrink: the same, with rank 2 aborting
    w = GroupWorld(lib, 3)
    p = [w.alloc(r, 64) for r in range(3)]
    assert lib.ncclAllReduce(p[0], p[0], 4, FLOAT32, SUM, w.comms[0], w.streams[0]) == 0
    excl = (c_int * 1)(2)
    kids = [c_void_p(), c_void_p()]
    shrinks = [
        Bg(
            lambda r=r: lib.ncclCommShrink(
                w.comms[r], excl, 1, byref(kids[r]), None, SHRINK_DEFAULT
            )
        )
        for r in range(2)
    ]
    assert not shrinks[0].done(1.0)
    assert lib.ncclCommAbort(w.comms[2]) == 0
    assert all(s.done(20) for s in shrinks) and [s.result for s in shrinks] == [0, 0]
    children = [int(k.value or 0) for k in kids]
    bufs = [w.alloc(r, 64) for r in range(2)]
    for r in range(2):
        lib.upload(bufs[r], np.full(16, r + 1.0, np.float32))
    assert allreduce_group(lib, children, w.streams[:2], bufs, 16) == [0, 0, 0]
    for r in range(2):
        assert lib.sync(w.streams[r]) == 0
        np.testing.assert_array_equal(lib.download(bufs[r], np.float32, 16), np.full(16, 3.0))
        assert lib.ncclCommDestroy(children[r]) == 0
    w.comms[2] = 0
    w.close()

    # revoke: world B's all-reduce (its peer late) holds stream s; A's rank 0 is queued behind
    a, b = GroupWorld(lib, 2), GroupWorld(lib, 2)
    pa = [a.alloc(r, 64) for r in range(2)]
    pb = [b.alloc(r, 64) for r in range(2)]
    for r in range(2):
        lib.upload(pb[r], np.full(16, r + 1.0, np.float32))
    s = a.streams[0]
    assert lib.ncclAllReduce(pb[0], pb[0], 4, FLOAT32, SUM, b.comms[0], s) == 0
    assert lib.ncclAllReduce(pa[0], pa[0], 4, FLOAT32, SUM, a.comms[0], s) == 0
    revoking = Bg(lambda: lib.ncclCommRevoke(a.comms[0], 0))
    assert not revoking.done(1.0)  # A's operation has not left the stream yet
    assert lib.ncclAllReduce(pb[1], pb[1], 4, FLOAT32, SUM, b.comms[1], b.streams[1]) == 0
    assert revoking.done(20) and revoking.result == SUCCESS
    assert lib.sync(s) == 0 and lib.sync(b.streams[1]) == 0
    for r in range(2):  # B's all-reduce ran, A's queued one was dropped by the revoke
        np.testing.assert_array_equal(lib.download(pb[r], np.float32, 4), np.full(4, 3.0))
    assert lib.ncclCommAbort(a.comms[1]) == 0
    a.comms[1] = 0
    a.close()
    b.close()


def test_a_full_work_queue_blocks_the_issuing_thread(
    lib: Lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL's work FIFO (NCCL_WORK_FIFO_BYTES) holds the launches not yet run: one
    ncclDevWorkBatch (16 bytes) and one ncclDevWorkColl (144 bytes) per all-reduce
    (src/include/device.h). A launch that finds it full waits (waitWorkFifoAvailable)
    until earlier work ran; an abort releases it with ncclInternalError."""
    monkeypatch.setenv("NCCL_WORK_FIFO_BYTES", "4096")
    fits = 4096 // (16 + 144)
    w = GroupWorld(lib, 2)
    count = 8
    send = [w.alloc(r, count * 4) for r in range(2)]
    recv = [w.alloc(r, count * 4 * (fits + 1)) for r in range(2)]
    for r in range(2):
        lib.upload(send[r], np.full(count, r + 1.0, np.float32))

    def issue(r: int, k: int) -> int:
        dst = recv[r] + k * count * 4
        return int(lib.ncclAllReduce(send[r], dst, count, FLOAT32, SUM, w.comms[r], w.streams[r]))

    assert [issue(0, k) for k in range(fits)] == [0] * fits  # rank 1 has not joined: queued
    last = Bg(lambda: issue(0, fits))
    assert not last.done(1.0)  # the queue is full
    for k in range(fits + 1):  # rank 1's collectives let rank 0's run
        assert issue(1, k) == 0
    assert last.done(20) and last.result == SUCCESS
    for r in range(2):
        assert lib.sync(w.streams[r]) == 0
        got = lib.download(recv[r], np.float32, count * (fits + 1))
        np.testing.assert_array_equal(got, np.full(count * (fits + 1), 3.0, np.float32))
    assert [issue(0, k) for k in range(fits)] == [0] * fits
    stuck = Bg(lambda: issue(0, fits))
    assert not stuck.done(1.0)
    assert lib.ncclCommAbort(w.comms[0]) == 0
    assert stuck.done(20) and stuck.result == INTERNAL
    assert "work queue" in lib.last_error()
    w.comms[0] = 0
    w.close()


def test_nonblocking_finalize_is_in_progress_until_the_work_is_done(lib: Lib) -> None:
    comms = nonblocking_world(lib, 2)
    s, p = [lib.stream(r) for r in range(2)], [lib.malloc(64, r) for r in range(2)]
    ok = False
    try:
        assert lib.ncclAllReduce(p[0], p[0], 4, FLOAT32, SUM, comms[0], s[0]) == IN_PROGRESS
        assert poll_ready(lib, comms[0]) == SUCCESS  # launched; it waits for rank 1
        assert lib.ncclCommFinalize(comms[0]) == IN_PROGRESS
        assert [lib.async_error(comms[0]) for _ in range(50)] == [IN_PROGRESS] * 50
        assert lib.ncclAllReduce(p[1], p[1], 4, FLOAT32, SUM, comms[1], s[1]) == IN_PROGRESS
        assert poll_ready(lib, comms[0]) == SUCCESS, lib.last_error()
        assert poll_ready(lib, comms[1]) == SUCCESS
        ok = True
    finally:
        for c in comms:  # after a failure rank 0 may still wait for rank 1: abort then
            assert (lib.ncclCommDestroy(c) if ok else lib.ncclCommAbort(c)) == 0
        for r in range(2):
            lib.destroy_stream(s[r])
            lib.free(p[r])


# ---- teardown with a live graph (init.cc: localPersistentRefs) ------------------------------


@pytest.mark.parametrize("end", ["ncclCommDestroy", "ncclCommAbort", "revoked"])
def test_teardown_waits_while_a_graph_that_captured_the_comm_lives(lib: Lib, end: str) -> None:
    """commDestroySync polls until every graph that captured the communicator is
    destroyed, for destroy and abort alike (commReclaim): a graph, and each executable
    graph made from it, holds the communicator. After ncclCommRevoke (finalizeCalled)
    destroy skips commDestroySync: it returns with the graph alive."""
    rt = lib.cudart
    w = GroupWorld(lib, 1)
    comm, s = w.comms[0], w.streams[0]
    x = w.alloc(0, 64)
    lib.upload(x, np.arange(16, dtype=np.float32))
    graph, exe = c_void_p(), c_void_p()
    assert rt.raw("cudaStreamBeginCapture")(s, THREAD_LOCAL) == 0
    assert lib.ncclAllReduce(x, x, 16, FLOAT32, SUM, comm, s) == 0
    assert rt.raw("cudaStreamEndCapture")(s, byref(graph)) == 0
    assert rt.raw("cudaGraphInstantiate")(byref(exe), graph, 0) == 0
    assert rt.raw("cudaGraphLaunch")(exe, s) == 0 and lib.sync(s) == 0
    np.testing.assert_array_equal(lib.download(x, np.float32, 16), np.arange(16, dtype=np.float32))
    if end == "revoked":
        assert lib.ncclCommRevoke(comm, 0) == 0
        ending = Bg(lambda: lib.ncclCommDestroy(comm))
        assert ending.done(20) and ending.result == SUCCESS
    else:
        ending = Bg(lambda: getattr(lib, end)(comm))
        assert not ending.done(1.0)
    assert rt.raw("cudaGraphExecDestroy")(exe) == 0
    assert end == "revoked" or not ending.done(0.5)  # the graph itself still holds it
    assert rt.raw("cudaGraphDestroy")(graph) == 0
    assert ending.done(20) and ending.result == SUCCESS
    w.comms = []
    w.close()


# ---- NCCL >= 2.31.2: the parent's destroy after an abortive shrink ----------------------------


@pytest.mark.parametrize(
    "version, how, hangs",
    [(None, "abort", True), ("2.30.7", "abort", False), (None, "destroy", False)],
)
def test_parent_destroy_after_an_abortive_shrink(
    version: str | None, how: str, hangs: bool
) -> None:
    """From 2.31.2 commDestroySync runs an untimed barrier of the ranks that only
    ncclCommAbort skips (pytorch/pytorch#194679, #194775): after
    ncclCommShrink(NCCL_SHRINK_ABORT), where the excluded rank aborted the parent, a
    survivor's destroy of the parent never returns; a survivor that aborts it does not
    wait. 2.30.7 had no barrier; and when every rank destroys the parent, all return."""
    from support.clib_fixtures import _build

    b = _build(version)
    env = {**os.environ, "PYNCCL_NCCL_LIBRARY": b.nccl, "PYNCCL_CUDART_LIBRARY": b.cudart}
    proc = subprocess.Popen(
        [sys.executable, STRICT_HELPER, "barrier", how],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        events = child_events(proc)
        shrunk = next_event(events, "shrunk", 60)
        assert shrunk and shrunk["rcs"] == [0, 0] and shrunk["ok"]
        if how == "abort":
            aborted = next_event(events, "aborted", 30)
            assert aborted and aborted["rc"] == 0 and aborted["seconds"] < 10
        assert next_event(events, "destroying", 30)
        done = next_event(events, "destroyed", 3.0 if hangs else 30)
        if hangs:
            assert done is None, done
        else:
            assert done and done["rcs"] == [0] * len(done["rcs"])
    finally:
        proc.kill()
        proc.wait(timeout=30)


# ---- NCCL's semantics: windows, split, shrink, suspend, host RMA ------------------------------


@pytest.mark.parametrize("version, accepted", [(None, True), ("2.30.5", False)])
def test_symmetric_windows_may_differ_in_size_from_2_30_7(
    version: str | None, accepted: bool
) -> None:
    from support.clib_fixtures import _build

    b = _build(version)
    vlib = Lib(b.nccl, b.cudart)
    uid, n = vlib.unique_id(), 2

    def rank(me: int) -> tuple[int, str, np.ndarray | None]:
        r = Rank(vlib, uid, n, me)
        assert r.init_rc == 0, r.init_error
        size = 4096 * (me + 1)
        buf = r.mem_alloc(size)
        write_f32(buf, np.full(size // 4, me + 0.5, np.float32))
        rc, win = r.register(buf, size, WIN_SYMMETRIC)
        err = vlib.last_error()
        seen = None
        if rc == 0:  # each rank reads the whole of its peer's window
            peer = 1 - me
            prc, addr = r.peer_pointer(win, 0, peer)
            assert prc == 0
            seen = read_f32(addr, 4096 * (peer + 1) // 4)
            assert r.wait_all_peers_signal() == 0
        r.close()
        return rc, err, seen

    for me, (rc, err, seen) in enumerate(threads(n, rank)):
        if accepted:
            assert rc == 0, err
            peer = 1 - me
            np.testing.assert_array_equal(seen, np.full(1024 * (peer + 1), peer + 0.5, np.float32))
        else:
            assert rc == INVALID_USAGE and "same size on every rank" in err


def test_window_deregistration_is_local(lib: Lib) -> None:
    """Rank 0 deregisters and then all-reduces while rank 1 all-reduces first and
    deregisters later: no agreement step, so no deadlock."""
    uid = lib.unique_id()

    def rank(me: int) -> np.ndarray:
        r = Rank(lib, uid, 2, me)
        assert r.init_rc == 0, r.init_error
        buf = r.mem_alloc(4096)
        rc, win = r.register(buf, 4096)
        assert rc == 0, lib.last_error()
        x = lib.malloc(64, me)
        lib.upload(x, np.full(16, me + 1.0, np.float32))
        if me == 0:
            assert r.deregister(win) == 0
        assert lib.ncclAllReduce(x, x, 16, FLOAT32, SUM, r.comm, r.stream) == 0 and r.sync() == 0
        if me == 1:
            assert r.deregister(win) == 0
        got = lib.download(x, np.float32, 16)
        lib.free(x)
        r.close()
        return got

    for got in threads(2, rank, timeout=20):
        np.testing.assert_array_equal(got, np.full(16, 3.0, np.float32))


def test_a_revoked_comm_can_be_split(lib: Lib) -> None:
    """nccl.h: once revoked and quiescent the communicator "is safe for destroy, split,
    and shrink"."""
    w = GroupWorld(lib, 2)
    for c in w.comms:
        assert lib.ncclCommRevoke(c, 0) == 0, lib.last_error()
    kids = [c_void_p(), c_void_p()]
    assert lib.ncclGroupStart() == 0
    rcs = [int(lib.ncclCommSplit(w.comms[r], 0, r, byref(kids[r]), None)) for r in range(2)]
    assert [*rcs, int(lib.ncclGroupEnd())] == [0, 0, 0], lib.last_error()
    bufs = [w.alloc(r, 64) for r in range(2)]
    sends = [make_input(np.float32, 16, r, seed=31) for r in range(2)]
    for r in range(2):
        lib.upload(bufs[r], sends[r])
    children = [int(k.value or 0) for k in kids]
    assert allreduce_group(lib, children, w.streams, bufs, 16) == [0, 0, 0]
    for r in range(2):
        assert lib.sync(w.streams[r]) == 0
        np.testing.assert_array_equal(lib.download(bufs[r], np.float32, 16), ref_reduce(sends))
        assert lib.ncclCommDestroy(children[r]) == 0
    w.close()


def test_shrink_with_an_empty_exclusion_list_is_an_invalid_argument(
    lib: Lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = GroupWorld(lib, 2)
    monkeypatch.setenv("PYNCCL_LOOPBACK_INIT_TIMEOUT", "2")  # a child made anyway gives up
    out = c_void_p()
    excl = (c_int * 1)(1)
    assert lib.ncclCommShrink(w.comms[0], excl, 0, byref(out), None, SHRINK_DEFAULT) == INVALID_ARG
    assert "excludeRanksCount 0" in lib.last_error()
    assert lib.ncclCommShrink(w.comms[0], None, 0, byref(out), None, SHRINK_DEFAULT) == INVALID_ARG
    assert out.value is None
    w.close()


def test_window_calls_are_legal_during_a_capture(lib: Lib) -> None:
    """dev_runtime.cc switches the thread to relaxed capture mode for register and
    deregister: both work while the thread captures, and the capture stays valid."""
    rt = lib.cudart
    r = Rank(lib, lib.unique_id(), 1, 0)
    buf = r.mem_alloc(4096)
    graph = c_void_p()
    assert rt.raw("cudaStreamBeginCapture")(r.stream, 0) == 0  # global mode
    rc, win = r.register(buf, 4096)
    rc2 = r.deregister(win) if rc == 0 else -1
    end = rt.raw("cudaStreamEndCapture")(r.stream, byref(graph))
    assert (rc, rc2, end) == (0, 0, 0), lib.last_error()
    assert rt.raw("cudaGraphDestroy")(graph) == 0
    r.close()


def test_host_rma_support_and_put_signal_agree(lib: Lib) -> None:
    """hostRmaSupport = numRmaCtx > 0 on a symmetric-memory comm of one LSA team (every
    loopback world), and rmaTaskAppend refuses host RMA without it."""

    def props_and_put(config: Any) -> tuple[bool, int, int, int, str]:
        r = Rank(lib, lib.unique_id(), 1, 0, config=config)
        assert r.init_rc == 0, r.init_error
        props = make_comm_properties()
        assert lib.ncclCommQueryProperties(r.comm, byref(props)) == 0
        buf = r.mem_alloc(4096)
        rc, win = r.register(buf, 4096)
        assert rc == 0, lib.last_error()
        put = r.put(buf, 4, 0, win, 64)
        sig = r.signal(0)
        wait = r.wait((1 + (put == 0), 0, 0, 0))
        err = lib.last_error()
        assert r.sync() == 0
        r.close()
        return bool(props.hostRmaSupport), put, sig, wait, err

    assert props_and_put(None)[:4] == (True, 0, 0, 0)
    off, put, sig, wait, err = props_and_put(make_config({"numRmaCtx": 0}))
    assert (off, put, sig, wait) == (False, INVALID_ARG, INVALID_ARG, INVALID_ARG)
    assert "host RMA is not supported" in err


def test_windows_need_ncclmemalloc_memory_and_the_alignment(lib: Lib) -> None:
    """ncclDevrWindowRegisterInGroup: the memory must be cuMem's (cudaMalloc's fails in
    cuMemRetainAllocationHandle) and NCCL_WIN_REQUIRED_ALIGNMENT (4096) into its
    allocation, whatever the flags."""
    r = Rank(lib, lib.unique_id(), 1, 0)
    plain = lib.malloc(8192)
    mem = r.mem_alloc(8192)
    try:
        for flags in (0, WIN_SYMMETRIC):
            assert r.register(plain, 4096, flags)[0] == CUDA_ERR
            assert "ncclMemAlloc" in lib.last_error()
            assert r.register(mem + 64, 4096, flags)[0] == INVALID_ARG
            assert "suitably aligned" in lib.last_error()
            rc, win = r.register(mem + 4096, 4096, flags)
            assert rc == 0 and r.deregister(win) == 0
    finally:
        lib.free(plain)
        r.close()


def test_mem_stats_keep_their_totals_while_suspended(lib: Lib) -> None:
    """mem_manager.cc: suspending releases memory without untracking it; the totals stay,
    only ncclStatGpuMemSuspended changes."""
    w = GroupWorld(lib, 2)

    def stats(c: int) -> list[int]:
        out = []
        for which in range(4):
            v = c_uint64()
            assert lib.ncclCommMemStats(c, which, byref(v)) == 0
            out.append(v.value)
        return out

    before = [stats(c) for c in w.comms]
    assert all(s[STAT_SUSPENDED] == 0 and s[STAT_SUSPEND] > 0 for s in before)
    for c in w.comms:
        assert lib.ncclCommSuspend(c, SUSPEND_MEM) == 0
    for s, b in zip([stats(c) for c in w.comms], before):
        assert s == [b[STAT_SUSPEND], 1, b[STAT_PERSIST], b[STAT_TOTAL]]
    for c in w.comms:
        assert lib.ncclCommResume(c) == 0
    assert [stats(c) for c in w.comms] == before
    w.close()


def test_suspend_refuses_a_split_share_parent_with_a_live_child(lib: Lib) -> None:
    cfg = make_config({"splitShare": 1})
    uid = lib.unique_id()

    def rank(me: int) -> list[int]:
        r = Rank(lib, uid, 2, me, config=cfg)
        assert r.init_rc == 0, r.init_error
        kid = c_void_p()
        assert lib.ncclCommSplit(r.comm, 0, me, byref(kid), None) == 0
        codes = [int(lib.ncclCommSuspend(r.comm, SUSPEND_MEM))]
        msg = lib.last_error()
        codes.append(int(lib.ncclCommSuspend(kid.value, SUSPEND_MEM)))
        assert lib.ncclCommDestroy(kid.value) == 0
        codes.append(int(lib.ncclCommSuspend(r.comm, SUSPEND_MEM)))  # no child left
        codes.append(int(lib.ncclCommResume(r.comm)))
        r.close()
        assert "Memory suspend not supported with split_share communicators" in msg
        return codes

    for codes in threads(2, rank):
        assert codes == [INVALID_USAGE, INVALID_USAGE, 0, 0]


# ---- put_signal to self with overlapping source and destination (signal.c) -------------------


def test_put_signal_to_itself_may_overlap(lib: Lib) -> None:
    """The copy is a memmove: the bytes of the source as they were, at the destination.
    Checked here and in a child under AddressSanitizer (a memcpy of overlapping ranges
    aborts there)."""
    assert child_self_put(lib)
    from pynccl.testing import loopback

    try:
        env = {**os.environ, **loopback.env(sanitize=True)}
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"no sanitized build: {exc}")
    proc = subprocess.run(
        [sys.executable, STRICT_HELPER, "self_put"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"ok": true' in proc.stdout
