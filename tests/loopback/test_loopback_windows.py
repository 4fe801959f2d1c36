"""ncclMemAlloc memory, windows and their peer pointers on the loopback libnccl, raw ctypes.

Thread worlds (every rank a thread of this process: a peer's window is its own
allocation) and process worlds (tests/support/clib_rma.py workers: each rank maps its peers'
ncclMemAlloc memory when the window is registered). Every value read through a peer
pointer is compared with the numpy pattern the peer wrote; the window rules (4096-byte
alignment for every window, equal flags) fail on every rank alike. The stricter rules of
NCCL's (ncclMemAlloc memory only, sizes that may differ) are in test_loopback_strict_nccl.py.
"""

from __future__ import annotations

import os
from ctypes import byref, c_void_p
from typing import Any

import numpy as np
import pytest
from support.clib import GroupWorld, Lib
from support.clib_rma import (
    INVALID_ARG,
    INVALID_USAGE,
    WIN_SYMMETRIC,
    Rank,
    pattern,
    read_f32,
    spawn_job,
    waits,
    write_f32,
)
from support.wait import threads

from pynccl._capi.nccl_device import ncclMultimemHandle_t


def test_mem_alloc_is_page_aligned_device_memory(lib: Lib) -> None:
    p = c_void_p()
    assert lib.ncclMemAlloc(byref(p), 10_000) == 0
    assert p.value is not None and p.value % 4096 == 0
    lib.upload(p.value, np.arange(2500, dtype=np.float32))
    np.testing.assert_array_equal(lib.download(p.value, np.float32, 2500), np.arange(2500))
    assert lib.ncclMemFree(p) == 0
    assert lib.ncclMemAlloc(byref(p), 0) == INVALID_ARG
    assert "invalid arguments" in lib.last_error()


def test_peer_and_lsa_pointers_read_and_write_the_peers_bytes(lib: Lib) -> None:
    n, count = 3, 3000  # 12 kB: a window of several pages
    uid = lib.unique_id()

    def rank(me: int) -> tuple[list[np.ndarray], np.ndarray, list[int]]:
        r = Rank(lib, uid, n, me)
        assert r.init_rc == 0, r.init_error
        buf = r.mem_alloc(count * 4)
        lib.upload(buf, pattern(me, count))
        rc, win = r.register(buf, count * 4)
        assert rc == 0, lib.last_error()
        user = c_void_p()
        assert lib.ncclWinGetUserPtr(r.comm, win, byref(user)) == 0 and user.value == buf
        peers = []
        codes = []
        for p in range(n):
            rc, addr = r.peer_pointer(win, 8, p)
            rc2, lsa = r.peer_pointer(win, 8, p, lsa=True)
            assert rc == rc2 == 0 and addr == lsa, lib.last_error()
            peers.append(read_f32(addr - 8, count))
            write_f32(addr - 8 + 4 * (10 + me), np.array([-me - 1], np.float32))
        for bad in (n, -1):
            codes.append(r.peer_pointer(win, 0, bad)[0])
        codes.append(r.peer_pointer(win, count * 4, 0)[0])  # offset beyond the window
        mm = c_void_p(1)
        assert lib.ncclGetLsaMultimemDevicePointer(win, 0, byref(mm)) == 0 and mm.value is None
        handle = ncclMultimemHandle_t(None)
        codes.append(lib.ncclGetMultimemDevicePointer(win, 0, handle, byref(mm)))
        assert r.wait_all_peers_signal() == 0, lib.last_error()
        mine = lib.download(buf, np.float32, count)
        r.close()
        codes.append(r.peer_pointer(win, 0, 0)[0])  # deregistered: unknown window
        return peers, mine, codes

    out = threads(n, rank)
    for me, (peers, mine, codes) in enumerate(out):
        for p in range(n):
            np.testing.assert_array_equal(peers[p][:10], pattern(p, count)[:10])
            np.testing.assert_array_equal(peers[p][10 + n :], pattern(p, count)[10 + n :])
        want = pattern(me, count)
        want[10 : 10 + n] = -np.arange(1, n + 1, dtype=np.float32)
        np.testing.assert_array_equal(mine, want)
        assert codes == [INVALID_ARG] * 5


def test_bad_peer_pointer_words_nccls_message(lib: Lib) -> None:
    uid = lib.unique_id()
    r = Rank(lib, uid, 1, 0)
    try:
        buf = r.mem_alloc(4096)
        rc, win = r.register(buf, 4096)
        assert rc == 0
        assert r.peer_pointer(win, 0, 5)[0] == INVALID_ARG
        assert "peer 5 is not within valid range of ranks 1." in lib.last_error()
        assert r.peer_pointer(win, 0, 2, lsa=True)[0] == INVALID_ARG
        assert "lsaRank 2 is not in the valid lsaSize" in lib.last_error()
        assert lib.ncclGetPeerDevicePointer(None, 0, 0, byref(c_void_p())) == INVALID_ARG
        mm = c_void_p(1)  # multimem: no NVLS here, so NULL for a valid handle (struct by value)
        assert lib.ncclGetMultimemDevicePointer(win, 0, ncclMultimemHandle_t(16), byref(mm)) == 0
        assert mm.value is None
        assert lib.ncclGetMultimemDevicePointer(win, 0, ncclMultimemHandle_t(None), byref(mm)) == 4
        assert "MCBasePtr (nil) needs to be valid." in lib.last_error()
        assert lib.ncclWinGetUserPtr(r.comm, win, None) == INVALID_ARG
        assert lib.ncclCommWindowRegister(r.comm, None, 16, byref(c_void_p()), 0) == INVALID_ARG
        assert "invalid pointer" in lib.last_error()
        assert lib.ncclCommWindowRegister(r.comm, buf, 64, None, 0) == INVALID_ARG
        assert lib.ncclCommWindowDeregister(r.comm, buf) == INVALID_ARG  # not a window
        assert lib.ncclCommWindowDeregister(r.comm, None) == 0
    finally:
        r.close()


def test_one_thread_drives_every_rank_inside_groups(lib: Lib) -> None:
    """ncclCommInitAll's world: registrations queued in a group run at its end."""
    n, count = 3, 1000
    size = (n + 1) * count * 4  # slots 0..n-1 receive from rank `slot`; slot n is the source
    w = GroupWorld(lib, n)
    bufs, wins = [], []
    try:
        for r in range(n):
            lib.set_device(r)
            p = c_void_p()
            assert lib.ncclMemAlloc(byref(p), size) == 0
            bufs.append(int(p.value or 0))
            lib.upload(bufs[r], np.full(n * count, -1.0, np.float32))
            lib.upload(bufs[r] + n * count * 4, pattern(r, count))
        handles = [c_void_p() for _ in range(n)]
        assert lib.ncclGroupStart() == 0
        for r in range(n):
            rc = lib.ncclCommWindowRegister(w.comms[r], bufs[r], size, byref(handles[r]), 1)
            assert rc == 0 and handles[r].value is None  # not before the group ends
        assert lib.ncclGroupEnd() == 0, lib.last_error()
        wins = [int(h.value or 0) for h in handles]
        assert all(wins)
        for r in range(n):
            src = bufs[r] + n * count * 4
            for p in range(n):
                if p != r:
                    rc = lib.ncclPutSignal(
                        src, count, 7, p, wins[r], r * count * 4, 0, 0, 0, w.comms[r], w.streams[r]
                    )
                    assert rc == 0, lib.last_error()
        for r in range(n):
            descs = waits(*[(1, p, 0, 0) for p in range(n) if p != r])
            assert lib.ncclWaitSignal(n - 1, descs, w.comms[r], w.streams[r]) == 0
        for r in range(n):
            assert lib.sync(w.streams[r]) == 0
            want = np.concatenate(
                [
                    pattern(p, count) if p != r else np.full(count, -1.0, np.float32)
                    for p in range(n)
                ]
                + [pattern(r, count)]
            )
            np.testing.assert_array_equal(lib.download(bufs[r], np.float32, (n + 1) * count), want)
        # a failed group drops its window calls on every rank alike
        assert lib.ncclGroupStart() == 0
        extra = [c_void_p() for _ in range(n)]
        for r in range(n):
            assert lib.ncclCommWindowRegister(w.comms[r], bufs[r], 4096, byref(extra[r]), 0) == 0
        assert (
            lib.ncclAllReduce(bufs[0], bufs[0], 4, 12, 0, w.comms[0], w.streams[0]) == INVALID_ARG
        )
        assert lib.ncclGroupEnd() == INVALID_ARG
        assert all(e.value is None for e in extra)
        assert lib.ncclGroupStart() == 0
        for r in range(n):
            assert lib.ncclCommWindowDeregister(w.comms[r], wins[r]) == 0
        assert lib.ncclGroupEnd() == 0, lib.last_error()
        assert lib.ncclGetPeerDevicePointer(wins[0], 0, 0, byref(c_void_p())) == INVALID_ARG
    finally:
        w.close()
        for p in bufs:
            assert lib.ncclMemFree(p) == 0


@pytest.mark.parametrize(
    "case, code, want",
    [
        ("align", INVALID_ARG, "Window address must be suitably aligned"),
        ("flags", INVALID_USAGE, "window flags differ"),
    ],
)
def test_window_rules_fail_on_every_rank(lib: Lib, case: str, code: int, want: str) -> None:
    """One rank's bad window fails the registration on every rank alike (rank 2's own
    error names the rule, the others name rank 2) and leaves the ranks in step."""
    n = 3
    uid = lib.unique_id()

    def rank(me: int) -> tuple[int, str, int]:
        r = Rank(lib, uid, n, me)
        assert r.init_rc == 0, r.init_error
        buf = r.mem_alloc(3 * 4096)
        size, ptr, flags = 4096, buf, WIN_SYMMETRIC
        if case == "align" and me == 2:
            ptr, flags = buf + 64, 0  # every window needs the alignment, symmetric or not
        if case == "align":
            flags = 0
        if case == "flags" and me == 0:
            flags = 0
        rc, _ = r.register(ptr, size, flags)
        err = lib.last_error()
        # the failed round left everyone in step: a valid registration still works
        ok, _ = r.register(buf, 4096, WIN_SYMMETRIC)
        r.close()
        return rc, err, ok

    for rc, err, ok in threads(n, rank):
        assert rc == code
        if case == "align":  # the last error is the process's: any rank's may be last
            assert want in err or "rank 2 could not register its window" in err
        else:
            assert want in err
        assert ok == 0


def test_non_symmetric_windows_may_differ_in_size(lib: Lib) -> None:
    n = 2
    uid = lib.unique_id()

    def rank(me: int) -> tuple[int, np.ndarray]:
        r = Rank(lib, uid, n, me)
        assert r.init_rc == 0, r.init_error
        size = 1000 * (me + 1)
        buf = r.mem_alloc(size)
        lib.upload(buf, np.full(size // 4, me, np.float32))
        rc, win = r.register(buf, size, 0)
        assert rc == 0, lib.last_error()
        other = 1 - me
        rc2, addr = r.peer_pointer(win, 0, other)
        assert rc2 == 0
        seen = read_f32(addr, 10)
        assert r.peer_pointer(win, 1000 * (other + 1), other)[0] == INVALID_ARG
        host = np.zeros(64, np.float32)  # host memory is no loopback device memory
        bad, _ = r.register(host.ctypes.data, 256, 0)
        r.close()
        return bad, seen

    out = threads(n, rank)
    for me, (bad, seen) in enumerate(out):
        assert bad == INVALID_ARG
        np.testing.assert_array_equal(seen, np.full(10, 1 - me, np.float32))


def test_process_world_windows_and_put_signal_ring(build: Any, lib: Lib) -> None:
    n = 3
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        pytest.skip("needs /proc/<pid>/fd")
    uid = lib.unique_id()
    jobs = spawn_job(build, "ring", uid, n, "1500")
    for r, events in enumerate(jobs):
        fails = [e for e in events if e["event"] == "fail"]
        assert not fails, f"rank {r}: {fails}"
        plain = [e for e in events if e["event"] == "plain"]
        # every rank fails alike; rank 0 (the first to fail) says why, the others name it
        want = "does not lie in one ncclMemAlloc" if r == 0 else "rank 0 could not register"
        assert plain and want in plain[0]["error"]
        assert events[-1] == {"event": "exit", "ok": True}


def test_windows_still_registered_go_with_their_communicator(lib: Lib) -> None:
    """A window still registered at destroy is released with the communicator."""
    uid = lib.unique_id()
    r = Rank(lib, uid, 1, 0)
    buf = r.mem_alloc(4096)
    rc, win = r.register(buf, 4096)
    assert rc == 0
    assert lib.ncclCommDestroy(r.comm) == 0
    assert r.peer_pointer(win, 0, 0)[0] == INVALID_ARG  # gone with its communicator
    r.wins = []
    r.close(destroy=False)


def test_a_communicator_destroyed_inside_the_group_fails_its_queued_window(lib: Lib) -> None:
    r = Rank(lib, lib.unique_id(), 1, 0)
    buf = r.mem_alloc(4096)
    win = c_void_p()
    assert lib.ncclGroupStart() == 0
    assert lib.ncclCommWindowRegister(r.comm, buf, 4096, byref(win), 0) == 0
    assert lib.ncclCommAbort(r.comm) == 0
    assert lib.ncclGroupEnd() == INVALID_USAGE
    assert "destroyed or aborted before the group ended" in lib.last_error()
    assert win.value is None
    r.comm = 0
    r.close(destroy=False)
