"""The loopback libcudart as strict as CUDA (issue 20): the leniency table, row by row.

Each row is a place where the loopback used to be more lenient than the CUDA runtime's
documentation (cuda_runtime_api.h, "API synchronization behavior"); its test shows the
strict behaviour. Streams are held busy by a host function (``cudaLaunchHostFunc``) that
waits on a ``threading.Event``, so "still pending" is reached deterministically; timing
bounds are generous ("returns within 8 s"), never tight. That an operation "has not
happened yet" is read through the host address of loopback device memory (a peek only
the loopback allows).

Rows (see LENIENCY_TABLE): memset_async, d2d_memcpy_async, h2d_memcpy_staged,
d2h_memcpy_waits, async_copies_stream_ordered, capture_unsafe_from_other_threads,
capture_mode_of_the_capture, capturing_thread_interaction_mode,
exchange_capture_mode, host_function, implicit_capture_error_is_last_error,
peer_mapping_is_device_memory, peer_pointer_across_processes. The tests of the capture
rows (capture interaction modes across threads, and the implicit-synchronization error of
cudaStreamIsCapturing) are in test_loopback_strict_capture.py.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import textwrap
import threading
from collections.abc import Callable
from ctypes import byref, c_int, c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_loopback_strict_capture
from support.child import result_line, run_ranks
from support.cudart import (
    D2D,
    D2H,
    H2D,
    HOST_FN,
    INVALID_DEVICE,
    INVALID_RESOURCE_HANDLE,
    INVALID_VALUE,
    NON_BLOCKING,
    NOT_PERMITTED,
    NOT_READY,
    SUCCESS,
    THREAD_LOCAL,
    HostGate,
    PointerAttributes,
    clean_thread_state,  # noqa: F401  (autouse: per-test thread state)
    detail,
    end_capture,
    filled,
    keep,
    linked_rt,  # noqa: F401  (the rt fixture)
    malloc,
    ok,
    read,
    stream,
)

WAIT = 8.0  # "returns within": generous on a loaded 2-core machine
N = 4096

#: Row -> the strict behaviour (CUDA's documented one) that its test shows.
LENIENCY_TABLE = {
    "memset_async": "cudaMemset returns once enqueued on the legacy stream",
    "d2d_memcpy_async": "a device-to-device cudaMemcpy returns once enqueued",
    "h2d_memcpy_staged": "a pageable host-to-device cudaMemcpy waits for the legacy stream's "
    "queue, stages the source and returns before the copy lands",
    "d2h_memcpy_waits": "a device-to-host cudaMemcpy returns once the copy is done",
    "async_copies_stream_ordered": "the Async forms are ordered on their stream and read "
    "their source when they run",
    "capture_unsafe_from_other_threads": "queries, synchronizes, malloc/free and sync "
    "copies from a thread in global mode during another thread's global capture fail with "
    "900 and invalidate it; a relaxed or thread-local thread may make them",
    "capture_mode_of_the_capture": "a thread-local or relaxed capture leaves other threads free",
    "capturing_thread_interaction_mode": "the capturing thread in relaxed mode may make "
    "unsafe calls, never ones that conflict with the capture",
    "exchange_capture_mode": "cudaThreadExchangeStreamCaptureMode swaps a per-thread mode",
    "host_function": "cudaLaunchHostFunc runs in stream order, is captured as a node, and "
    "may not call CUDA",
    "implicit_capture_error_is_last_error": "error 906 of cudaStreamIsCapturing(0) stays "
    "the thread's last error until read, and does not invalidate the capture",
    "peer_mapping_is_device_memory": "a registered peer mapping is device memory to copies",
    "peer_pointer_across_processes": "cudaMemcpy reads and writes a peer window pointer of "
    "another process",
}


def peek(ptr: int, n: int = N) -> np.ndarray:
    """Loopback device memory through its host address, without any stream ordering."""
    return np.frombuffer((ctypes.c_uint8 * n).from_address(ptr), np.uint8).copy()


def within(call: Callable[[], int], seconds: float = WAIT) -> tuple[bool, int | None]:
    """Run ``call`` on a thread: (returned within ``seconds``, its result)."""
    box: list[int] = []
    t = threading.Thread(target=lambda: box.append(call()), daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive(), box[0] if box else None)


def test_the_table_has_a_test_per_row() -> None:
    names = [*globals(), *vars(test_loopback_strict_capture)]  # the capture-mode rows' tests
    tests = {name for name in names if name.startswith("test_")}
    assert [row for row in LENIENCY_TABLE if f"test_{row}" not in tests] == []


# ---- host synchronization of copies and memsets ------------------------------------------


def test_memset_async(rt: ctypes.CDLL) -> None:
    a = filled(rt, 0, N)
    with HostGate(rt, None):  # the legacy stream is busy
        done, rc = within(lambda: rt.cudaMemset(a, 7, N))
        assert (done, rc) == (True, SUCCESS)  # returned while the stream is held...
        assert not peek(a).any()  # ...and has not happened yet
    ok(rt, rt.cudaStreamSynchronize(None))
    assert (read(rt, a, N) == 7).all()
    ok(rt, rt.cudaFree(a))


def test_d2d_memcpy_async(rt: ctypes.CDLL) -> None:
    a, b = filled(rt, 5, N), filled(rt, 0, N)
    with HostGate(rt, None):
        done, rc = within(lambda: rt.cudaMemcpy(b, a, N, D2D))
        assert (done, rc) == (True, SUCCESS)
        assert not peek(b).any()
    ok(rt, rt.cudaStreamSynchronize(None))
    assert (read(rt, b, N) == 5).all()
    for p in (a, b):
        ok(rt, rt.cudaFree(p))


def test_h2d_memcpy_staged(rt: ctypes.CDLL) -> None:
    a = filled(rt, 0, N)
    host = np.full(N, 9, np.uint8)
    # A held blocking stream: legacy-stream work waits for it, the legacy stream's own
    # queue is empty, so the host does not wait: the copy is staged and left pending.
    blocking = stream(rt, 0)
    with HostGate(rt, blocking):
        done, rc = within(lambda: rt.cudaMemcpy(a, host.ctypes.data, N, H2D))
        assert (done, rc) == (True, SUCCESS)
        host[:] = 1  # the source was staged: reusing it at once is fine
        assert not peek(a).any()  # not landed
    ok(rt, rt.cudaStreamSynchronize(None))
    assert (read(rt, a, N) == 9).all()
    # "A stream sync is performed before the copy is initiated": work queued on the
    # legacy stream itself is waited for.
    with HostGate(rt, None) as gate:
        host[:] = 3
        returned = threading.Event()
        t = threading.Thread(
            target=lambda: (rt.cudaMemcpy(a, host.ctypes.data, N, H2D), returned.set())
        )
        t.start()
        assert not returned.wait(0.3)  # cannot return before the gate opens
        gate.open()
        assert returned.wait(WAIT)
        t.join()
    ok(rt, rt.cudaStreamSynchronize(None))
    assert (read(rt, a, N) == 3).all()
    ok(rt, rt.cudaStreamDestroy(blocking))
    ok(rt, rt.cudaFree(a))


def test_d2h_memcpy_waits(rt: ctypes.CDLL) -> None:
    a = filled(rt, 4, N)
    out = np.zeros(N, np.uint8)
    with HostGate(rt, None) as gate:
        ok(rt, rt.cudaMemsetAsync(a, 6, N, None))  # queued behind the gate
        returned = threading.Event()
        t = threading.Thread(
            target=lambda: (rt.cudaMemcpy(out.ctypes.data, a, N, D2H), returned.set())
        )
        t.start()
        assert not returned.wait(0.3)
        gate.open()
        assert returned.wait(WAIT)
        t.join()
    assert (out == 6).all()  # done, and after the earlier memset, on return
    ok(rt, rt.cudaFree(a))


def test_async_copies_stream_ordered(rt: ctypes.CDLL) -> None:
    a, b = filled(rt, 0, N), filled(rt, 0, N)
    s = stream(rt, NON_BLOCKING)
    host = np.full(N, 9, np.uint8)
    with HostGate(rt, s):
        ok(rt, rt.cudaMemcpyAsync(a, host.ctypes.data, N, H2D, s))
        ok(rt, rt.cudaMemsetAsync(b, 2, N // 2, s))
        host[:] = 4  # pageable source of an Async copy: read when the copy runs
        assert not peek(a).any() and not peek(b).any()
        assert rt.cudaStreamQuery(s) == NOT_READY
    ok(rt, rt.cudaStreamSynchronize(s))
    assert (peek(a) == 4).all()
    assert (peek(b)[: N // 2] == 2).all() and not peek(b)[N // 2 :].any()
    ok(rt, rt.cudaStreamDestroy(s))
    for p in (a, b):
        ok(rt, rt.cudaFree(p))


# ---- host functions -------------------------------------------------------------------------


def test_host_function(rt: ctypes.CDLL) -> None:
    a = filled(rt, 0, N)
    s = stream(rt, NON_BLOCKING)
    seen: list[int] = []
    inside: list[tuple[int, str]] = []

    def record(user: int | None) -> None:
        seen.append(int(peek(a, 1)[0]) + (user or 0))
        d = c_int()
        inside.append((rt.cudaGetDevice(byref(d)), detail(rt)))

    fn = keep(HOST_FN(record))
    # In stream order: after the work before it, before the work after it.
    ok(rt, rt.cudaMemsetAsync(a, 1, N, s))
    ok(rt, rt.cudaLaunchHostFunc(s, fn, None))
    ok(rt, rt.cudaMemsetAsync(a, 2, N, s))
    ok(rt, rt.cudaStreamSynchronize(s))
    assert seen == [1] and peek(a, 1)[0] == 2
    # Host functions must not call CUDA: cudaErrorNotPermitted.
    assert inside[0][0] == NOT_PERMITTED, inside
    assert "host function" in inside[0][1]
    assert rt.cudaGetErrorName(NOT_PERMITTED) == b"cudaErrorNotPermitted"
    # It holds its stream: the stream is busy while the function runs.
    with HostGate(rt, s) as gate:
        assert gate.started.wait(WAIT)
        assert rt.cudaStreamQuery(s) == NOT_READY
    ok(rt, rt.cudaStreamSynchronize(s))
    # Captured, it is a node: not run at capture, run at every launch, with its userData.
    seen.clear()
    ok(rt, rt.cudaStreamBeginCapture(s, THREAD_LOCAL))
    ok(rt, rt.cudaLaunchHostFunc(s, fn, 100))
    end, graph = end_capture(rt, s)
    ok(rt, end)
    assert seen == []
    exe = c_void_p()
    ok(rt, rt.cudaGraphInstantiate(byref(exe), graph, 0))
    for _ in range(3):
        ok(rt, rt.cudaGraphLaunch(exe, s))
    ok(rt, rt.cudaStreamSynchronize(s))
    assert seen == [102, 102, 102]
    ok(rt, rt.cudaGraphExecDestroy(exe))
    ok(rt, rt.cudaGraphDestroy(graph))
    # Bad arguments.
    assert rt.cudaLaunchHostFunc(s, None, None) == INVALID_VALUE
    ok(rt, rt.cudaStreamDestroy(s))
    assert rt.cudaLaunchHostFunc(s, fn, None) == INVALID_RESOURCE_HANDLE
    ok(rt, rt.cudaFree(a))


# ---- peer mappings ---------------------------------------------------------------------------


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def test_peer_mapping_is_device_memory(rt: ctypes.CDLL) -> None:
    """What libnccl does for another process's window: the same memfd mapped a second
    time (here in this process), registered as a peer mapping of device 0."""
    if os.environ.get("PYNCCL_LOOPBACK_STRICT") == "0":
        pytest.skip("the loaded loopback cudart is not strict")
    size = 2 * mmap.PAGESIZE
    fd = os.memfd_create("pynccl-test-peer")
    try:
        os.ftruncate(fd, size)
        owner, peer = mmap.mmap(fd, size), mmap.mmap(fd, size)
        peer_ptr = _address(peer)
        host = np.arange(size, dtype=np.uint64).astype(np.uint8)
        owner[:] = host.tobytes()
        out = np.zeros(size, np.uint8)
        assert rt.cudaMemcpy(out.ctypes.data, peer_ptr, size, D2H) == INVALID_VALUE
        assert "registered peer mapping" in detail(rt)
        ok(rt, rt.pynccl_lb_register_foreign_range(peer_ptr, size, -1))
        ok(rt, rt.cudaMemcpy(out.ctypes.data, peer_ptr, size, D2H))
        assert np.array_equal(out, host)  # the owner's bytes, read through the peer pointer
        ok(rt, rt.cudaMemset(peer_ptr + 16, 0xAB, 32))
        head = host[::-1].copy()
        ok(rt, rt.cudaMemcpy(peer_ptr, head.ctypes.data, 8, H2D))
        ok(rt, rt.cudaStreamSynchronize(None))
        want = host.copy()
        want[16:48] = 0xAB
        want[:8] = head[:8]
        assert np.frombuffer(owner[:], np.uint8).tolist() == want.tolist()
        attrs = PointerAttributes()
        ok(rt, rt.cudaPointerGetAttributes(byref(attrs), peer_ptr + 100))
        assert (attrs.type, attrs.device) == (2, 0)  # cudaMemoryTypeDevice, device 0
        dev = c_int(-1)
        assert rt.pynccl_lb_find_alloc(peer_ptr, size, byref(dev)) == 1 and dev.value == 0
        # Not an allocation: nothing frees it; no overlapping or malformed registration.
        assert rt.cudaFree(peer_ptr) == INVALID_VALUE
        assert "peer mapping" in detail(rt)
        assert rt.pynccl_lb_free(peer_ptr) == INVALID_VALUE
        assert rt.pynccl_lb_register_foreign_range(peer_ptr + 8, 8, 0) == INVALID_VALUE
        assert "overlaps" in detail(rt)
        assert rt.pynccl_lb_register_foreign_range(None, 8, 0) == INVALID_VALUE
        assert rt.pynccl_lb_register_foreign_range(_address(owner), 0, 0) == INVALID_VALUE
        assert rt.pynccl_lb_register_foreign_range(_address(owner), 8, 99999) == INVALID_DEVICE
        assert rt.pynccl_lb_unregister_foreign_range(peer_ptr + 8) == INVALID_VALUE
        ok(rt, rt.pynccl_lb_unregister_foreign_range(peer_ptr))
        assert rt.pynccl_lb_unregister_foreign_range(peer_ptr) == INVALID_VALUE
        assert rt.cudaMemcpy(out.ctypes.data, peer_ptr, size, D2H) == INVALID_VALUE
        a = malloc(rt, 64)  # an allocation cannot be registered over either
        assert rt.pynccl_lb_register_foreign_range(a + 8, 8, 0) == INVALID_VALUE
        assert rt.pynccl_lb_unregister_foreign_range(a) == INVALID_VALUE
        ok(rt, rt.cudaFree(a))
        del out
        owner.close()
        peer.close()
    finally:
        os.close(fd)


_PEER_RANK = textwrap.dedent(
    """
    import ctypes, json, os, sys
    import numpy as np
    from pynccl import Communicator, UniqueId, library
    from pynccl.cuda import DeviceBuffer

    rank, n = int(os.environ["RANK"]), 2
    peer = 1 - rank
    N = 256
    mine = lambda r: np.arange(N, dtype=np.float32) + 1000.0 * (r + 1)
    rt = library.cudart()
    with Communicator(n, UniqueId.fromhex(os.environ["UID"]), rank, device=rank) as comm:
        def barrier():
            with DeviceBuffer(1, "float32") as tiny:
                comm.all_reduce(tiny)
                comm.synchronize(timeout=60)
        buf = comm.mem_alloc(N, "float32")
        src = mine(rank)  # (a temporary's .ctypes.data would dangle)
        rt.cudaMemcpy(buf.ptr, src.ctypes.data, 4 * N, 1)
        rt.cudaStreamSynchronize(None)
        with comm.register_window(buf) as win:
            ptr = win.peer_pointer(peer)
            barrier()  # every rank has written its window
            seen = np.zeros(N, np.float32)
            rt.cudaMemcpy(seen.ctypes.data, ptr, 4 * N, 2)  # D2H from the peer pointer
            barrier()  # both have read: now overwrite the peer's first half
            half = np.full(N // 2, -rank - 1, np.float32)
            rt.cudaMemcpy(ptr, half.ctypes.data, 2 * N, 1)  # H2D to the peer pointer
            rt.cudaStreamSynchronize(None)
            barrier()
            after = buf.to_numpy()
            barrier()  # nobody deregisters while the peer may still copy
        buf.close()
    want = mine(rank)
    want[: N // 2] = -peer - 1
    print("RESULT " + json.dumps([bool(np.array_equal(seen, mine(peer))),
                                  bool(np.array_equal(after, want))]))
    """
)


def test_peer_pointer_across_processes(lib: Any, lb_env: dict[str, str]) -> None:
    if b"pynccl_lb_register_foreign_range" not in Path(lb_env["PYNCCL_NCCL_LIBRARY"]).read_bytes():
        pytest.skip(
            "this loopback libnccl does not register the peer windows it maps "
            "(pynccl_lb_register_foreign_range, nccl/winreg.c map_peers)"
        )
    uid = ctypes.string_at(ctypes.addressof(lib.unique_id()), 128).hex()
    ranks = run_ranks(
        ["-c", _PEER_RANK], [{**lb_env, "RANK": str(r), "UID": uid} for r in range(2)]
    )
    for returncode, out, err in ranks:
        assert returncode == 0, err[-3000:]
        assert result_line(out) == "RESULT [true, true]", err[-3000:]
