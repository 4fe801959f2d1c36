"""One-sided signals on the loopback libnccl (ncclPutSignal / ncclSignal / ncclWaitSignal).

Raw ctypes in thread worlds (process worlds: test_loopback_windows.py's ring). Every
rank puts numpy patterns into its neighbour's window and waits for its other
neighbour; the windows are then compared with the patterns. A wait blocks its stream
(cudaStreamQuery says "not ready") until the listed counts arrive; waits consume
counts; signal and context indices are checked against numRmaSig / numRmaCtx; the
same operations captured into a CUDA graph run again on every launch.
"""

from __future__ import annotations

import ctypes
import time
from ctypes import byref, c_void_p

import numpy as np
import pytest
from support.clib import Lib
from support.clib_fixtures import _asan_loaded, _build
from support.clib_rma import (
    INVALID_ARG,
    INVALID_USAGE,
    Rank,
    check_ring,
    pattern,
    ring_rounds,
    waits,
)
from support.wait import threads

from pynccl._capi.nccl_device import DEVICE_PROTOTYPES
from pynccl._capi.structs import make_config

NOT_READY = 600  # cudaErrorNotReady
RELAXED = 2  # cudaStreamCaptureModeRelaxed
#: host.h functions the loopback implements (the rest need a device API it cannot offer)
LOOPBACK_DEVICE_FUNCTIONS = {
    "ncclCommQueryProperties",
    "ncclGetLsaDevicePointer",
    "ncclGetLsaMultimemDevicePointer",
    "ncclGetMultimemDevicePointer",
    "ncclGetPeerDevicePointer",
    "ncclTeamLsa",
    "ncclTeamRail",
    "ncclTeamRankToLsa",
    "ncclTeamRankToWorld",
    "ncclTeamWorld",
}


def query(lib: Lib, stream: int) -> int:
    return int(lib.cudart.raw("cudaStreamQuery")(stream))


def settle(lib: Lib, stream: int) -> int:
    """cudaStreamQuery after giving queued work a moment to run."""
    time.sleep(0.05)
    return query(lib, stream)


def test_put_signal_ring_in_a_thread_world(lib: Lib) -> None:
    n, count = 4, 777
    uid = lib.unique_id()

    def rank(me: int) -> list[np.ndarray]:
        r = Rank(lib, uid, n, me)
        assert r.init_rc == 0, r.init_error
        try:
            return ring_rounds(r, count, 3)
        finally:
            r.close()

    for me, seen in enumerate(threads(n, rank)):
        check_ring(seen, n, me, count)


def test_waits_block_the_stream_and_consume_counts(lib: Lib) -> None:
    uid = lib.unique_id()
    r0, r1 = threads(2, lambda me: Rank(lib, uid, 2, me))
    try:
        for _ in range(3):
            assert r0.signal(1) == 0
        assert r1.wait((2, 0, 0, 0)) == 0 and r1.wait((1, 0, 0, 0)) == 0
        assert r1.sync() == 0  # three signals, three consumed
        assert r1.wait((1, 0, 0, 0)) == 0
        assert settle(lib, r1.stream) == NOT_READY  # a fourth has not been sent
        assert r0.signal(1) == 0
        assert r1.sync() == 0 and query(lib, r1.stream) == 0
        # a wait on several peers' counts (self included) completes when all arrived
        assert r1.wait((1, 0, 0, 0), (2, 1, 0, 0)) == 0
        assert r1.signal(1) == 0  # to itself, after the wait on the same stream: never
        assert settle(lib, r1.stream) == NOT_READY
        s2 = lib.stream(1)
        assert lib.ncclSignal(1, 0, 0, 0, r1.comm, s2) == 0
        assert lib.ncclSignal(1, 0, 0, 0, r1.comm, s2) == 0
        assert r0.signal(1) == 0
        assert r1.sync() == 0 and lib.sync(s2) == 0
        lib.destroy_stream(s2)
        assert lib.async_error(r0.comm) == lib.async_error(r1.comm) == 0
    finally:
        threads(2, lambda me: (r0, r1)[me].close())


def test_signal_and_context_indices_follow_the_config(lib: Lib) -> None:
    uid = lib.unique_id()
    cfg = make_config()
    cfg.numRmaCtx, cfg.numRmaSig = 2, 3
    r0, r1 = threads(2, lambda me: Rank(lib, uid, 2, me, cfg))
    try:
        assert r0.init_rc == r1.init_rc == 0, r0.init_error
        assert r0.signal(1, sig=2, ctx=1) == 0
        assert r1.wait((1, 0, 0, 0)) == 0  # another (signal, context): still waiting
        assert settle(lib, r1.stream) == NOT_READY
        assert r0.signal(1, sig=0, ctx=0) == 0
        assert r1.sync() == 0
        assert r1.wait((1, 0, 2, 1)) == 0 and r1.sync() == 0
        assert r0.signal(1, sig=3) == INVALID_ARG
        assert "Signal index 3 is invalid (the communicator has numRmaSig=3" in lib.last_error()
        assert r0.signal(1, ctx=2) == INVALID_ARG
        assert "Context 2 is invalid (the communicator has numRmaCtx=2" in lib.last_error()
        assert r1.wait((1, 0, 0, 2)) == INVALID_ARG
        assert "descriptor 0: Context 2" in lib.last_error()
    finally:
        threads(2, lambda me: (r0, r1)[me].close())
    # the default config has one of each
    uid = lib.unique_id()
    r = Rank(lib, uid, 1, 0)
    try:
        assert r.signal(0, sig=1) == INVALID_ARG and "numRmaSig=1" in lib.last_error()
        assert r.signal(0, ctx=1) == INVALID_ARG and "numRmaCtx=1" in lib.last_error()
        assert r.signal(0) == 0 and r.wait((1, 0, 0, 0)) == 0 and r.sync() == 0
    finally:
        r.close()


def test_ranks_must_agree_on_the_signal_space(lib: Lib) -> None:
    uid = lib.unique_id()

    def rank(me: int) -> tuple[int, str]:
        cfg = make_config()
        cfg.numRmaSig = 1 + me
        r = Rank(lib, uid, 2, me, cfg)
        r.close(destroy=r.init_rc == 0)
        return r.init_rc, r.init_error

    out = threads(2, rank)
    assert any(rc == INVALID_USAGE and "numRmaSig" in err for rc, err in out), out
    assert all(rc != 0 for rc, _ in out)


def test_argument_checks_word_nccls_messages(lib: Lib) -> None:
    uid = lib.unique_id()
    r = Rank(lib, uid, 1, 0)
    try:
        src = r.mem_alloc(8192)
        rc, win = r.register(src, 8192)
        assert rc == 0
        plain = r.mem_alloc(4096)
        rc, pwin = r.register(plain, 4096, 0)  # not symmetric
        assert rc == 0
        cases = [
            (lambda: r.signal(0, flags=1), "Flags 1 is invalid (must be 0)"),
            (lambda: r.signal(1), "invalid peer 1 (peer should be in the 0..0 range)"),
            (lambda: r.wait((0, 0, 0, 0)), "descriptor 0 has invalid opCnt 0"),
            (lambda: lib.ncclWaitSignal(0, waits((1, 0, 0, 0)), r.comm, r.stream), "invalid arg"),
            (lambda: lib.ncclWaitSignal(1, None, r.comm, r.stream), "invalid arguments"),
            (lambda: r.put(src, 4, 0, None, 0), "peerWin is NULL"),
            (lambda: r.put(None, 4, 0, win, 0), "srcBuff is NULL"),
            (lambda: r.put(plain, 4, 0, win, 0), "not in a valid symmetric window"),
            (lambda: r.put(src + 8000, 100, 0, win, 0), "not in a valid symmetric window"),
            (lambda: r.put(src, 16, 0, win, 8192 - 60), "do not fit in rank 0's window"),
            (lambda: r.put(src, 4, 0, src, 0), "is not registered with communicator"),
        ]
        for call, text in cases:
            assert call() == INVALID_ARG, text
            assert text in lib.last_error()
        rc = lib.ncclPutSignal(src, 4, 12, 0, win, 0, 0, 0, 0, r.comm, r.stream)
        assert rc == INVALID_ARG and "invalid type 12" in lib.last_error()
        assert r.put(src, 16, 0, pwin, 4096 - 64) == 0  # into a non-symmetric window is fine
        assert r.wait((1, 0, 0, 0)) == 0 and r.sync() == 0
        assert lib.async_error(r.comm) == 0
    finally:
        r.close()


def test_a_graph_replays_captured_signals(lib: Lib) -> None:
    n, count = 2, 500
    rt = lib.cudart.raw
    uid = lib.unique_id()

    def rank(me: int) -> list[np.ndarray]:
        r = Rank(lib, uid, n, me)
        src, dst = r.mem_alloc(count * 4), r.mem_alloc(count * 4)
        assert r.register(src, count * 4)[0] == 0
        rc, dwin = r.register(dst, count * 4)
        assert rc == 0
        peer = 1 - me
        assert rt("cudaStreamBeginCapture")(r.stream, RELAXED) == 0
        assert r.put(src, count, peer, dwin, 0) == 0
        assert r.wait((1, peer, 0, 0)) == 0
        graph, exe = c_void_p(), c_void_p()
        assert rt("cudaStreamEndCapture")(r.stream, byref(graph)) == 0
        assert rt("cudaGraphInstantiate")(byref(exe), graph, 0) == 0
        assert query(lib, r.stream) == 0  # capturing ran nothing
        seen = []
        for k in range(3):
            lib.upload(src, pattern(me, count, k))
            assert rt("cudaGraphLaunch")(exe, r.stream) == 0
            assert r.sync() == 0
            seen.append(lib.download(dst, np.float32, count))
            assert r.wait_all_peers_signal() == 0  # both read before the next launch
        assert rt("cudaGraphExecDestroy")(exe) == 0
        assert rt("cudaGraphDestroy")(graph) == 0
        assert lib.async_error(r.comm) == 0
        r.close()
        return seen

    for me, seen in enumerate(threads(n, rank)):
        for k, got in enumerate(seen):
            np.testing.assert_array_equal(got, pattern(1 - me, count, k))


def test_destroy_with_a_wait_pending_does_not_hang(lib: Lib) -> None:
    uid = lib.unique_id()
    r = Rank(lib, uid, 1, 0)
    assert r.wait((1, 0, 0, 0)) == 0
    assert settle(lib, r.stream) == NOT_READY
    t0 = time.perf_counter()
    assert lib.ncclCommDestroy(r.comm) == 0
    assert r.sync() == 0  # the wait task ended with its communicator
    assert time.perf_counter() - t0 < 5
    r.comm = 0
    r.close(destroy=False)


@pytest.mark.parametrize("version", ["2.24.3", "2.30.7"])  # 2.24.3: built by other tests too
def test_versions_export_their_releases_functions(version: str) -> None:
    b = _build(version)
    triple = tuple(int(p) for p in version.split("."))
    cdll = ctypes.CDLL(b.nccl)
    for name in ("ncclPutSignal", "ncclSignal", "ncclWaitSignal", "ncclWinGetUserPtr"):
        assert hasattr(cdll, name) == (triple >= (2, 29, 2)), name
    assert hasattr(cdll, "ncclParamBind") == (triple >= (2, 30, 3))
    assert not hasattr(cdll, "ncclSetEncryption")
    for name, proto in DEVICE_PROTOTYPES.items():
        if name in LOOPBACK_DEVICE_FUNCTIONS:
            assert hasattr(cdll, name) == (proto.first <= triple), name
    if triple < (2, 29, 2):
        return
    lib = Lib(b.nccl, b.cudart)
    uid = lib.unique_id()
    r = Rank(lib, uid, 1, 0)
    try:
        assert r.signal(0, sig=1) == INVALID_ARG  # one signal index before numRmaSig (2.31)
        assert r.signal(0) == 0 and r.wait((1, 0, 0, 0)) == 0 and r.sync() == 0
    finally:
        r.close()


def test_pynccl_graph_captures_signals_through_pynccl_lib(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through pynccl's own layers: Communicator handles, pynccl.lib()'s checked
    wrappers, pynccl.cuda.Stream and pynccl.cuda.Graph."""
    from support.worlds import use_loopback

    if _asan_loaded():  # the builds this module's other tests loaded
        monkeypatch.setenv("PYNCCL_TEST_SANITIZE", "1")
    with use_loopback():
        _graph_through_pynccl()


def _graph_through_pynccl() -> None:
    import threading

    from pynccl import cuda, library
    from pynccl.comm import Communicator, UniqueId

    n, count = 2, 256
    uid = UniqueId()
    barrier = threading.Barrier(n)

    def rank(me: int) -> list[np.ndarray]:
        L, rt = library.lib(), library.cudart()
        comm = Communicator(n, uid, me, device=me)
        cuda.set_device(me)
        s = cuda.Stream(non_blocking=True)
        src, dst, win_s, win_d = c_void_p(), c_void_p(), c_void_p(), c_void_p()
        L.ncclMemAlloc(byref(src), count * 4)
        L.ncclMemAlloc(byref(dst), count * 4)
        L.ncclCommWindowRegister(comm.handle, src, count * 4, byref(win_s), 1)
        L.ncclCommWindowRegister(comm.handle, dst, count * 4, byref(win_d), 1)
        peer = 1 - me
        desc = waits((1, peer, 0, 0))
        g = cuda.Graph()
        with g.capture(s, "relaxed"):
            L.ncclPutSignal(src, count, 7, peer, win_d, 0, 0, 0, 0, comm.handle, s.handle)
            L.ncclWaitSignal(1, desc, comm.handle, s.handle)
        seen = []
        host = np.empty(count, np.float32)
        for k in range(3):
            data = pattern(me, count, k)
            rt.cudaMemcpy(src, data.ctypes.data, count * 4, 1)  # cudaMemcpyHostToDevice
            rt.cudaStreamSynchronize(None)  # landed (it returns once staged; s is non-blocking)
            g.replay()
            s.synchronize()
            rt.cudaMemcpy(host.ctypes.data, dst, count * 4, 2)  # cudaMemcpyDeviceToHost
            seen.append(host.copy())
            barrier.wait()  # both read before the next replay writes
        g.close()
        L.ncclCommWindowDeregister(comm.handle, win_s)
        L.ncclCommWindowDeregister(comm.handle, win_d)
        comm.destroy()
        s.close()
        L.ncclMemFree(src)
        L.ncclMemFree(dst)
        return seen

    for me, seen in enumerate(threads(n, rank)):
        for k, got in enumerate(seen):
            np.testing.assert_array_equal(got, pattern(1 - me, count, k))
