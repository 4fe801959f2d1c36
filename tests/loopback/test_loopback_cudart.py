"""The loopback libcudart, driven through ctypes directly (no pynccl layers above it):
devices, versions and errors; streams and events; worker threads, exit and fork.

Results are checked against numpy re-computations. Streams are held with a "gate"
task (a callback blocked on a threading.Event) so that "work is still pending"
states are reached deterministically, never by a timing race. Capture and graphs are in
test_loopback_cudart_graphs.py; memory, copies and the build checks in
test_loopback_cudart_memory.py (helpers: support/cudart.py).
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import threading
from ctypes import byref, c_char_p, c_float, c_int, c_void_p
from pathlib import Path

import numpy as np
import pytest
from support.cudart import (
    CAPTURE_UNSUPPORTED,
    CAPTURE_WRONG_THREAD,
    D2D,
    D2H,
    H2D,
    HOST_FN,
    INITIALIZATION_ERROR,
    INVALID_DEVICE,
    INVALID_RESOURCE_HANDLE,
    INVALID_VALUE,
    LEGACY,
    NOT_READY,
    PER_THREAD,
    SUCCESS,
    TaskGate,
    built_cudart_path,  # noqa: F401  (the cudart_path fixture)
    clean_thread_state,  # noqa: F401  (autouse: per-test thread state)
    event,
    keep,
    malloc,
    ndev,
    ok,
    standalone_rt,  # noqa: F401  (the rt fixture)
    stream,
)

REAL_CUDART = "/usr/local/cuda/lib64/libcudart.so.13"


def worker_threads(prefix: str) -> set[int]:
    """Thread ids in /proc/self/task whose name starts with ``prefix`` (the loopback
    names its workers lb-strm-dN, lb-legacy-dN, lb-pts-dN)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # exited meanwhile
            continue
        if name.startswith(prefix):
            found.add(int(tid))
    return found


# ---- devices, versions, errors ---------------------------------------------------


def test_versions(rt: ctypes.CDLL) -> None:
    v = c_int()
    ok(rt, rt.cudaRuntimeGetVersion(byref(v)))
    assert v.value == 13000
    ok(rt, rt.cudaDriverGetVersion(byref(v)))
    assert v.value == 13000
    assert rt.cudaRuntimeGetVersion(None) == INVALID_VALUE


def test_current_device_is_per_thread(rt: ctypes.CDLL) -> None:
    n = ndev(rt)
    if n < 2:
        pytest.skip("needs 2 loopback devices")
    ok(rt, rt.cudaSetDevice(1))
    seen: dict[str, int] = {}

    def worker() -> None:
        d = c_int(-1)
        rt.cudaGetDevice(byref(d))
        seen["initial"] = d.value
        rt.cudaSetDevice(n - 1)
        rt.cudaGetDevice(byref(d))
        seen["after"] = d.value

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    d = c_int()
    ok(rt, rt.cudaGetDevice(byref(d)))
    assert (seen["initial"], seen["after"], d.value) == (0, n - 1, 1)
    assert rt.pynccl_lb_current_device() == 1
    assert rt.pynccl_lb_device_count() == n


def test_set_device_out_of_range_and_last_error(rt: ctypes.CDLL) -> None:
    n = ndev(rt)
    assert rt.cudaSetDevice(n) == INVALID_DEVICE
    assert rt.cudaPeekAtLastError() == INVALID_DEVICE  # peek keeps it
    assert rt.cudaPeekAtLastError() == INVALID_DEVICE
    assert f"device {n} is out of range" in rt.pynccl_lb_last_error_detail().decode()
    assert rt.cudaGetLastError() == INVALID_DEVICE  # get clears it
    assert rt.cudaGetLastError() == SUCCESS
    assert rt.cudaSetDevice(-1) == INVALID_DEVICE
    d = c_int()
    ok(rt, rt.cudaGetDevice(byref(d)))
    assert d.value == 0  # unchanged by the failed calls
    # A pending query is a status, not an error: it does not become the last error.
    rt.cudaGetLastError()
    s = stream(rt)
    with TaskGate(rt, s):
        assert rt.cudaStreamQuery(s) == NOT_READY
        assert rt.cudaPeekAtLastError() == SUCCESS
    ok(rt, rt.cudaStreamDestroy(s))


def test_pci_bus_ids(rt: ctypes.CDLL) -> None:
    n = ndev(rt)
    ids = []
    for d in range(n):
        buf = ctypes.create_string_buffer(32)
        ok(rt, rt.cudaDeviceGetPCIBusId(buf, 32, d))
        ids.append(buf.value.decode())
    assert all(re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:00\.0", i) for i in ids), ids
    assert len(set(ids)) == n
    small = ctypes.create_string_buffer(b"x" * 8)
    ok(rt, rt.cudaDeviceGetPCIBusId(small, 5, 0))
    assert small.value == ids[0][:4].encode()  # truncated, NUL-terminated
    assert rt.cudaDeviceGetPCIBusId(ctypes.create_string_buffer(32), 32, n) == INVALID_DEVICE
    assert rt.cudaDeviceGetPCIBusId(None, 32, 0) == INVALID_VALUE


_CHILD = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
n = ctypes.c_int(-1)
rc = lib.cudaGetDeviceCount(ctypes.byref(n))
print(rc, n.value, lib.cudaSetDevice(2))
"""


@pytest.mark.parametrize(
    ("value", "expected"),
    [("3", "0 3 0"), ("2", "0 2 101"), ("0", "100 0 100"), ("lots", "1 -1 1"), ("", "1 -1 1")],
)
def test_device_count_from_environment(cudart_path: str, value: str, expected: str) -> None:
    env = {**os.environ, "PYNCCL_LOOPBACK_DEVICES": value}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, cudart_path],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == expected.split()
    if expected.startswith("1 "):  # malformed: every call fails, and says why once
        assert out.stderr.count(f"PYNCCL_LOOPBACK_DEVICES='{value}' is malformed") == 1


def _real_cudart() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(REAL_CUDART)
    except OSError:
        return None
    lib.cudaGetErrorName.restype = c_char_p
    lib.cudaGetErrorString.restype = c_char_p
    return lib


def test_error_names_and_strings(rt: ctypes.CDLL) -> None:
    # Independent spot checks (values and names from driver_types.h).
    assert rt.cudaGetErrorName(0) == b"cudaSuccess"
    assert rt.cudaGetErrorName(1) == b"cudaErrorInvalidValue"
    assert rt.cudaGetErrorName(101) == b"cudaErrorInvalidDevice"
    assert rt.cudaGetErrorName(400) == b"cudaErrorInvalidResourceHandle"
    assert rt.cudaGetErrorName(600) == b"cudaErrorNotReady"
    assert rt.cudaGetErrorString(1) == b"invalid argument"
    assert rt.cudaGetErrorName(123456) == b"unrecognized error code"
    assert rt.cudaGetErrorName(CAPTURE_UNSUPPORTED) == b"cudaErrorStreamCaptureUnsupported"
    assert rt.cudaGetErrorName(CAPTURE_WRONG_THREAD) == b"cudaErrorStreamCaptureWrongThread"
    codes = [c for c in range(1000) if rt.cudaGetErrorName(c) != b"unrecognized error code"]
    # every code this library returns has a name
    for c in (0, 1, 2, 3, 4, 17, 21, 100, 101, 400, 401, 600, 801, *range(900, 909)):
        assert c in codes
    real = _real_cudart()
    if real is None:
        pytest.skip(f"{REAL_CUDART} is not available to compare with")
    for c in codes:
        assert rt.cudaGetErrorName(c) == real.cudaGetErrorName(c), c
        assert rt.cudaGetErrorString(c) == real.cudaGetErrorString(c), c


# ---- streams and events -----------------------------------------------------------


def test_stream_query_and_event_wait_across_streams(rt: ctypes.CDLL) -> None:
    s1, s2 = stream(rt), stream(rt)
    e = event(rt)
    a, b = malloc(rt, 4096), malloc(rt, 4096)
    ok(rt, rt.cudaMemset(a, 0, 4096))
    ok(rt, rt.cudaMemset(b, 0, 4096))
    with TaskGate(rt, s1):
        ok(rt, rt.cudaMemsetAsync(a, 5, 4096, s1))
        ok(rt, rt.cudaEventRecord(e, s1))
        ok(rt, rt.cudaStreamWaitEvent(s2, e, 0))
        ok(rt, rt.cudaMemcpyAsync(b, a, 4096, D2D, s2))
        assert rt.cudaStreamQuery(s1) == NOT_READY
        assert rt.cudaEventQuery(e) == NOT_READY
        assert rt.cudaStreamQuery(s2) == NOT_READY  # held by the event, not by timing
    ok(rt, rt.cudaStreamSynchronize(s2))
    ok(rt, rt.cudaEventQuery(e))
    out = np.empty(4096, np.uint8)
    ok(rt, rt.cudaMemcpy(out.ctypes.data, b, 4096, D2H))
    np.testing.assert_array_equal(out, np.full(4096, 5, np.uint8))
    # Waiting on an event never recorded, or already complete, is a no-op.
    e2 = event(rt)
    ok(rt, rt.cudaStreamWaitEvent(s2, e2, 0))
    ok(rt, rt.cudaStreamWaitEvent(s2, e, 0))
    ok(rt, rt.cudaStreamQuery(s2))
    assert rt.cudaStreamWaitEvent(s2, e, 2) == INVALID_VALUE
    for h in (e, e2):
        ok(rt, rt.cudaEventDestroy(h))
    for s in (s1, s2):
        ok(rt, rt.cudaStreamDestroy(s))
    for p in (a, b):
        ok(rt, rt.cudaFree(p))


def test_events_elapsed_time_and_errors(rt: ctypes.CDLL) -> None:
    s = stream(rt)
    start, end = event(rt), event(rt)
    ms = c_float(-1.0)
    assert rt.cudaEventElapsedTime(byref(ms), start, end) == INVALID_RESOURCE_HANDLE  # unrecorded
    ok(rt, rt.cudaEventQuery(start))  # never recorded: complete
    ok(rt, rt.cudaEventSynchronize(start))
    buf = malloc(rt, 1 << 22)
    ok(rt, rt.cudaEventRecord(start, s))
    ok(rt, rt.cudaMemsetAsync(buf, 3, 1 << 22, s))
    with TaskGate(rt, s):
        ok(rt, rt.cudaEventRecord(end, s))
        assert rt.cudaEventElapsedTime(byref(ms), start, end) == NOT_READY
    ok(rt, rt.cudaEventSynchronize(end))
    ok(rt, rt.cudaEventElapsedTime(byref(ms), start, end))
    assert ms.value >= 0.0
    assert rt.cudaEventElapsedTime(None, start, end) == INVALID_VALUE
    quiet = event(rt, 0x02)  # cudaEventDisableTiming
    ok(rt, rt.cudaEventRecord(quiet, s))
    ok(rt, rt.cudaEventSynchronize(quiet))
    assert rt.cudaEventElapsedTime(byref(ms), start, quiet) == INVALID_RESOURCE_HANDLE
    bad = c_void_p()
    assert rt.cudaEventCreateWithFlags(byref(bad), 0x04) == INVALID_VALUE  # IPC needs 0x02
    assert rt.cudaEventCreateWithFlags(byref(bad), 0x40) == INVALID_VALUE
    ok(rt, rt.cudaEventDestroy(quiet))
    assert rt.cudaEventDestroy(quiet) == INVALID_RESOURCE_HANDLE
    assert rt.cudaEventRecord(quiet, s) == INVALID_RESOURCE_HANDLE
    assert rt.cudaEventQuery(quiet) == INVALID_RESOURCE_HANDLE
    if ndev(rt) > 1:
        ok(rt, rt.cudaSetDevice(1))
        other = stream(rt)
        ok(rt, rt.cudaSetDevice(0))
        assert rt.cudaEventRecord(start, other) == INVALID_RESOURCE_HANDLE  # wrong device
        assert "device 0" in rt.pynccl_lb_last_error_detail().decode()
        ok(rt, rt.cudaStreamDestroy(other))
    for h in (start, end):
        ok(rt, rt.cudaEventDestroy(h))
    ok(rt, rt.cudaStreamDestroy(s))
    ok(rt, rt.cudaFree(buf))


def test_destroy_event_with_pending_record(rt: ctypes.CDLL) -> None:
    s = stream(rt)
    e = event(rt)
    with TaskGate(rt, s):
        ok(rt, rt.cudaEventRecord(e, s))
        ok(rt, rt.cudaEventDestroy(e))  # the queued record keeps it alive internally
    ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.cudaStreamDestroy(s))


def test_invalid_stream_handles(rt: ctypes.CDLL) -> None:
    s = stream(rt)
    ok(rt, rt.cudaStreamDestroy(s))
    assert rt.cudaStreamDestroy(s) == INVALID_RESOURCE_HANDLE
    assert rt.cudaStreamSynchronize(s) == INVALID_RESOURCE_HANDLE
    assert rt.cudaMemsetAsync(None, 0, 0, s) == INVALID_RESOURCE_HANDLE
    assert rt.pynccl_lb_stream_device(s) == -1
    assert rt.cudaStreamDestroy(None) == INVALID_RESOURCE_HANDLE  # default streams stay
    assert rt.cudaStreamDestroy(LEGACY) == INVALID_RESOURCE_HANDLE
    bad = c_void_p()
    assert rt.cudaStreamCreateWithFlags(byref(bad), 4) == INVALID_VALUE
    assert rt.cudaStreamCreate(None) == INVALID_VALUE
    assert rt.pynccl_lb_stream_enqueue(None, None, None, None) == INVALID_VALUE
    assert rt.pynccl_lb_stream_device(None) == 0
    assert rt.pynccl_lb_stream_device(PER_THREAD) == 0


def test_stream_device_follows_the_creating_thread(rt: ctypes.CDLL) -> None:
    n = ndev(rt)
    last = n - 1
    ok(rt, rt.cudaSetDevice(last))
    s = stream(rt)
    ok(rt, rt.cudaSetDevice(0))
    assert rt.pynccl_lb_stream_device(s) == last
    assert rt.pynccl_lb_stream_device(LEGACY) == 0
    ok(rt, rt.cudaStreamDestroy(s))


def test_tasks_run_on_their_streams_device(rt: ctypes.CDLL) -> None:
    last = ndev(rt) - 1
    ok(rt, rt.cudaSetDevice(last))
    s = stream(rt)
    ok(rt, rt.cudaSetDevice(0))
    seen: list[int] = []
    callback = HOST_FN(lambda _arg: seen.append(rt.pynccl_lb_current_device()))
    keep(callback)
    ok(rt, rt.pynccl_lb_stream_enqueue(s, ctypes.cast(callback, c_void_p), None, None))
    ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.pynccl_lb_stream_enqueue(None, ctypes.cast(callback, c_void_p), None, None))
    ok(rt, rt.cudaStreamSynchronize(None))
    assert seen == [last, 0]
    ok(rt, rt.cudaStreamDestroy(s))


def test_legacy_stream_synchronizes_with_blocking_streams(rt: ctypes.CDLL) -> None:
    blocking, nonblocking = stream(rt, 0), stream(rt, 1)  # cudaStreamNonBlocking = 1
    a = malloc(rt, 1024)
    ok(rt, rt.cudaMemset(a, 0, 1024))
    with TaskGate(rt, blocking):
        # Legacy work queued now waits for the held blocking stream...
        ok(rt, rt.cudaMemsetAsync(a, 9, 1024, None))
        assert rt.cudaStreamQuery(None) == NOT_READY
        # ...a non-blocking stream does not.
        ok(rt, rt.cudaMemsetAsync(a, 1, 16, nonblocking))
        ok(rt, rt.cudaStreamSynchronize(nonblocking))
    ok(rt, rt.cudaStreamSynchronize(None))
    out = np.empty(1024, np.uint8)
    ok(rt, rt.cudaMemcpy(out.ctypes.data, a, 1024, D2H))
    np.testing.assert_array_equal(out, np.full(1024, 9, np.uint8))
    # And the other way: blocking-stream work waits for earlier legacy work.
    with TaskGate(rt, LEGACY):
        ok(rt, rt.cudaMemsetAsync(a, 2, 1024, blocking))
        assert rt.cudaStreamQuery(blocking) == NOT_READY
        ok(rt, rt.cudaMemsetAsync(a, 3, 16, nonblocking))
        ok(rt, rt.cudaStreamSynchronize(nonblocking))
    ok(rt, rt.cudaStreamSynchronize(blocking))
    ok(rt, rt.cudaMemcpy(out.ctypes.data, a, 1024, D2H))
    np.testing.assert_array_equal(out, np.full(1024, 2, np.uint8))
    for s in (blocking, nonblocking):
        ok(rt, rt.cudaStreamDestroy(s))
    ok(rt, rt.cudaFree(a))


def test_device_synchronize_covers_only_the_current_device(rt: ctypes.CDLL) -> None:
    if ndev(rt) < 2:
        pytest.skip("needs 2 loopback devices")
    ok(rt, rt.cudaSetDevice(1))
    s1 = stream(rt, 1)
    a = malloc(rt, 1 << 20)
    ok(rt, rt.cudaSetDevice(0))
    gate = TaskGate(rt, s1)
    ok(rt, rt.cudaMemsetAsync(a, 4, 1 << 20, s1))
    ok(rt, rt.cudaDeviceSynchronize())  # device 0: returns though device 1 is held
    assert rt.cudaStreamQuery(s1) == NOT_READY
    done = threading.Event()

    def sync_device_1() -> None:
        rt.cudaSetDevice(1)
        rt.cudaDeviceSynchronize()
        done.set()

    t = threading.Thread(target=sync_device_1)
    t.start()
    gate.open()
    t.join(60)
    assert done.is_set()
    out = np.empty(1 << 20, np.uint8)
    ok(rt, rt.cudaMemcpy(out.ctypes.data, a, 1 << 20, D2H))
    np.testing.assert_array_equal(out, np.full(1 << 20, 4, np.uint8))
    ok(rt, rt.cudaStreamDestroy(s1))
    ok(rt, rt.cudaFree(a))


def test_many_threads_many_streams(rt: ctypes.CDLL) -> None:
    n = ndev(rt)
    errors: list[str] = []

    def work(k: int) -> None:
        try:
            ok(rt, rt.cudaSetDevice(k % n))
            rng = np.random.default_rng(k)
            data = rng.integers(0, 2**31, 5000, dtype=np.int64)
            s = stream(rt)
            to_pts, to_s = event(rt), event(rt)
            a, b = malloc(rt, data.nbytes), malloc(rt, data.nbytes)
            ok(rt, rt.cudaMemcpyAsync(a, data.ctypes.data, data.nbytes, H2D, s))
            # Ping-pong between a user stream and the per-thread stream, ordered only
            # by events (neither is the legacy stream, so nothing else orders them).
            for _ in range(50):
                ok(rt, rt.cudaMemcpyAsync(b, a, data.nbytes, D2D, s))
                ok(rt, rt.cudaEventRecord(to_pts, s))
                ok(rt, rt.cudaStreamWaitEvent(PER_THREAD, to_pts, 0))
                ok(rt, rt.cudaMemsetAsync(a, 0, data.nbytes, PER_THREAD))
                ok(rt, rt.cudaMemcpyAsync(a, b, data.nbytes, D2D, PER_THREAD))
                ok(rt, rt.cudaEventRecord(to_s, PER_THREAD))
                ok(rt, rt.cudaStreamWaitEvent(s, to_s, 0))
            out = np.empty_like(data)
            ok(rt, rt.cudaMemcpyAsync(out.ctypes.data, a, data.nbytes, D2H, s))
            ok(rt, rt.cudaStreamSynchronize(s))
            np.testing.assert_array_equal(out, data)
            ok(rt, rt.cudaEventDestroy(to_pts))
            ok(rt, rt.cudaEventDestroy(to_s))
            ok(rt, rt.cudaStreamDestroy(s))
            ok(rt, rt.cudaFree(a))
            ok(rt, rt.cudaFree(b))
        except AssertionError as exc:
            errors.append(str(exc))

    pool = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert errors == []


# ---- no leaked threads, prompt exit, fork -------------------------------------------


def test_destroyed_streams_leave_no_threads(rt: ctypes.CDLL) -> None:
    before = worker_threads("lb-strm-")
    streams = [stream(rt, k % 2) for k in range(6)]
    assert worker_threads("lb-strm-") == before  # workers start lazily, with the first task
    bufs = [malloc(rt, 1 << 16) for _ in streams]
    for s, b in zip(streams, bufs):
        ok(rt, rt.cudaMemsetAsync(b, 1, 1 << 16, s))
        ok(rt, rt.cudaStreamSynchronize(s))  # its worker has run (and named itself)
    mine = worker_threads("lb-strm-") - before
    assert len(mine) == len(streams)
    for s in streams:
        ok(rt, rt.cudaStreamDestroy(s))  # drains and joins its worker
    assert worker_threads("lb-strm-") & mine == set()
    for b in bufs:
        ok(rt, rt.cudaFree(b))

    pts: set[int] = set()

    def per_thread_work() -> None:
        old = worker_threads("lb-pts-")
        buf = malloc(rt, 1 << 16)
        ok(rt, rt.cudaMemsetAsync(buf, 2, 1 << 16, PER_THREAD))
        ok(rt, rt.cudaStreamSynchronize(PER_THREAD))
        ok(rt, rt.cudaFree(buf))
        pts.update(worker_threads("lb-pts-") - old)

    t = threading.Thread(target=per_thread_work)
    t.start()
    t.join()
    assert len(pts) == 1
    # join() returns before the OS thread has run its TLS destructors, which join its
    # per-thread stream's worker: wait (bounded) for that worker to be gone.
    pause = threading.Event()
    for _ in range(500):
        if not worker_threads("lb-pts-") & pts:
            break
        pause.wait(0.01)
    assert worker_threads("lb-pts-") & pts == set()


_EXIT_CHILD = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
libc = ctypes.CDLL(None)
pause = ctypes.cast(libc.pause, ctypes.c_void_p)  # blocks forever: workers block signals
enqueue = lib.pynccl_lb_stream_enqueue
enqueue.argtypes = [ctypes.c_void_p] * 4
s = ctypes.c_void_p()
assert lib.cudaStreamCreate(ctypes.byref(s)) == 0
assert enqueue(s, pause, None, None) == 0
assert enqueue(None, pause, None, None) == 0
assert enqueue(ctypes.c_void_p(2), pause, None, None) == 0
print("queued", flush=True)
"""


def test_process_with_blocked_tasks_still_exits(cudart_path: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, cudart_path],
        capture_output=True,
        text=True,
        timeout=60,  # a hang, not a speed limit
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "queued"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_with_live_workers_gets_initialization_error(rt: ctypes.CDLL) -> None:
    ok(rt, rt.cudaMemset(malloc(rt, 16), 0, 16))  # a legacy worker now exists
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        p = c_void_p()
        rc = rt.cudaMalloc(byref(p), 16)
        os._exit(rc)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == INITIALIZATION_ERROR
    ok(rt, rt.cudaDeviceSynchronize())  # the parent is unaffected
