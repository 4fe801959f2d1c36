"""The loopback libcudart, driven through ctypes directly (no pynccl layers above it).

Results are checked against numpy re-computations. Streams are held with a "gate"
task (a callback blocked on a threading.Event) so that "work is still pending"
states are reached deterministically, never by a timing race.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from ctypes import byref, c_char_p, c_float, c_int, c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _support_cudart import (
    ACTIVE,
    CAPTURE_IMPLICIT,
    CAPTURE_INVALIDATED,
    CAPTURE_ISOLATION,
    CAPTURE_MERGE,
    CAPTURE_UNJOINED,
    CAPTURE_UNMATCHED,
    CAPTURE_UNSUPPORTED,
    CAPTURE_WRONG_THREAD,
    CAPTURED_EVENT,
    D2D,
    D2H,
    DEFAULT,
    GLOBAL,
    H2D,
    H2H,
    HOST_FN,
    ILLEGAL_STATE,
    INITIALIZATION_ERROR,
    INVALID_DEVICE,
    INVALID_DEVICE_POINTER,
    INVALID_MEMCPY_DIRECTION,
    INVALID_RESOURCE_HANDLE,
    INVALID_VALUE,
    INVALIDATED,
    LEGACY,
    NONE,
    NOT_READY,
    PER_THREAD,
    RELAXED,
    SUCCESS,
    THREAD_LOCAL,
    PointerAttributes,
    TaskGate,
    bind,
    capture_status,
    clean_thread_state,  # noqa: F401  (autouse: per-test thread state)
    end_capture,
    event,
    keep,
    malloc,
    ok,
    read,
    stream,
)

from pynccl.testing import loopback
from pynccl.testing.loopback import _build

CLONE_FN = ctypes.CFUNCTYPE(c_void_p, c_void_p, c_int)
REAL_CUDART = "/usr/local/cuda/lib64/libcudart.so.13"
REAL_HEADERS = "/usr/local/cuda/include"


@pytest.fixture(scope="module")
def cudart_path() -> str:
    try:
        return loopback.build_cudart()
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"cannot build the loopback cudart: {exc}")


@pytest.fixture(scope="module")
def rt(cudart_path: str) -> ctypes.CDLL:
    return bind(cudart_path)


def ndev(rt: ctypes.CDLL) -> int:
    n = c_int()
    ok(rt, rt.cudaGetDeviceCount(byref(n)))
    return n.value


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


# ---- stream capture and graphs ----------------------------------------------------


def instantiate(rt: ctypes.CDLL, graph: int | None) -> int:
    exe = c_void_p()
    ok(rt, rt.cudaGraphInstantiate(byref(exe), graph, 0))
    assert exe.value is not None
    return exe.value


def write(rt: ctypes.CDLL, ptr: int, data: np.ndarray) -> None:
    """A host-to-device copy that has landed on return: cudaMemcpy from pageable memory
    returns once the source is staged, so wait for the legacy stream (work on another,
    non-blocking stream is not ordered after it)."""
    ok(rt, rt.cudaMemcpy(ptr, data.ctypes.data, data.nbytes, H2D))
    ok(rt, rt.cudaStreamSynchronize(None))


def test_capture_records_instead_of_running_and_replays(rt: ctypes.CDLL) -> None:
    n = 4096
    a, b, c = malloc(rt, n), malloc(rt, n), malloc(rt, n)
    for p in (a, b, c):
        ok(rt, rt.cudaMemset(p, 0, n))
    s = stream(rt, 1)
    assert capture_status(rt, s) == NONE
    assert rt.pynccl_lb_stream_capturing(s) == 0
    ok(rt, rt.cudaStreamBeginCapture(s, THREAD_LOCAL))
    assert capture_status(rt, s) == ACTIVE
    assert rt.pynccl_lb_stream_capturing(s) == 1
    ok(rt, rt.cudaMemsetAsync(b, 9, n, s))
    ok(rt, rt.cudaMemcpyAsync(b, a, n // 2, D2D, s))  # then the first half from a
    ok(rt, rt.cudaMemcpyAsync(c, b, n, D2D, s))
    rc, graph = end_capture(rt, s)
    ok(rt, rc)
    assert graph is not None
    assert capture_status(rt, s) == NONE
    ok(rt, rt.cudaStreamSynchronize(s))
    assert not read(rt, c, n).any()  # captured, not run
    exe = instantiate(rt, graph)
    ok(rt, rt.cudaGraphDestroy(graph))  # the executable graph is independent of it
    for k in (1, 2, 3):  # new inputs between replays: the graph reads them at replay
        write(rt, a, np.full(n, k, np.uint8))
        ok(rt, rt.cudaGraphLaunch(exe, s))
        ok(rt, rt.cudaStreamSynchronize(s))
        want = np.concatenate([np.full(n // 2, k, np.uint8), np.full(n - n // 2, 9, np.uint8)])
        assert np.array_equal(read(rt, c, n), want)
    # several launches back to back, without synchronizing in between, keep stream order
    ok(rt, rt.cudaMemset(c, 0, n))
    with TaskGate(rt, s):
        for _ in range(5):
            ok(rt, rt.cudaGraphLaunch(exe, s))
        assert rt.cudaStreamQuery(s) == NOT_READY
    ok(rt, rt.cudaStreamSynchronize(s))
    assert read(rt, c, 1)[0] == 3
    ok(rt, rt.cudaGraphExecDestroy(exe))
    ok(rt, rt.cudaStreamDestroy(s))
    for p in (a, b, c):
        ok(rt, rt.cudaFree(p))


def test_capture_begin_and_end_errors(rt: ctypes.CDLL) -> None:
    for legacy in (None, LEGACY):
        assert rt.cudaStreamBeginCapture(legacy, GLOBAL) == CAPTURE_UNSUPPORTED
        assert "legacy default stream" in rt.pynccl_lb_last_error_detail().decode()
    s = stream(rt)
    assert rt.cudaStreamBeginCapture(s, 3) == INVALID_VALUE
    assert end_capture(rt, s) == (ILLEGAL_STATE, None)  # not capturing
    ok(rt, rt.cudaStreamBeginCapture(s, GLOBAL))
    assert rt.cudaStreamBeginCapture(s, GLOBAL) == ILLEGAL_STATE
    assert rt.cudaStreamEndCapture(s, None) == INVALID_VALUE
    assert capture_status(rt, s) == ACTIVE  # neither error ended it
    rc, graph = end_capture(rt, s)  # an empty capture is a valid, empty graph
    ok(rt, rc)
    exe = instantiate(rt, graph)
    ok(rt, rt.cudaGraphLaunch(exe, s))
    ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.cudaGraphExecDestroy(exe))
    ok(rt, rt.cudaGraphDestroy(graph))
    # per-thread default streams can be captured (legacy ones cannot)
    ok(rt, rt.cudaStreamBeginCapture(PER_THREAD, THREAD_LOCAL))
    assert capture_status(rt, PER_THREAD) == ACTIVE
    rc, graph = end_capture(rt, PER_THREAD)
    ok(rt, rc)
    ok(rt, rt.cudaGraphDestroy(graph))
    ok(rt, rt.cudaStreamDestroy(s))


def _in_thread(fn: object) -> object:
    box: list[object] = []
    th = threading.Thread(target=lambda: box.append(fn()))  # type: ignore[operator]
    th.start()
    th.join(60)
    return box[0]


def test_end_capture_from_another_thread(rt: ctypes.CDLL) -> None:
    s = stream(rt, 1)
    for mode, want in (
        (GLOBAL, CAPTURE_WRONG_THREAD),
        (THREAD_LOCAL, CAPTURE_WRONG_THREAD),
        (RELAXED, SUCCESS),
    ):
        ok(rt, rt.cudaStreamBeginCapture(s, mode))
        rc, graph = _in_thread(lambda: end_capture(rt, s))  # type: ignore[misc]
        assert rc == want, mode
        if rc:
            assert "another thread" in _in_thread(
                lambda: (end_capture(rt, s), rt.pynccl_lb_last_error_detail().decode())[1]
            )
            rc, graph = end_capture(rt, s)  # still capturing: its own thread ends it
            ok(rt, rc)
        ok(rt, rt.cudaGraphDestroy(graph))
    ok(rt, rt.cudaStreamDestroy(s))


def _breaks(rt: ctypes.CDLL, s: int, call: object, want: int, mode: int = GLOBAL) -> str:
    """Begin capturing s, make the call, check its error and that it invalidated the
    capture; end the capture (no graph). Returns the call's detail text."""
    ok(rt, rt.cudaStreamBeginCapture(s, mode))
    try:
        rc = call()  # type: ignore[operator]
        detail = rt.pynccl_lb_last_error_detail().decode()
        assert rc == want, (rc, detail)
        assert capture_status(rt, s) == INVALIDATED
        # once invalidated, further work on the stream fails too
        assert rt.cudaMemsetAsync(0, 0, 0, s) == SUCCESS  # (an empty one is a no-op)
    finally:
        rc, graph = end_capture(rt, s)
    assert (rc, graph) == (CAPTURE_INVALIDATED, None)
    assert capture_status(rt, s) == NONE
    return detail


def test_what_breaks_a_capture(rt: ctypes.CDLL) -> None:
    n = 256
    a, b = malloc(rt, n), malloc(rt, n)
    host = np.zeros(n, np.uint8)
    s = stream(rt)  # blocking: the legacy stream synchronizes with it
    nb = stream(rt, 1)
    ev = event(rt)
    assert "cannot be waited for" in _breaks(
        rt, s, lambda: rt.cudaStreamSynchronize(s), CAPTURE_UNSUPPORTED
    )
    _breaks(rt, s, lambda: rt.cudaStreamQuery(s), CAPTURE_UNSUPPORTED)
    _breaks(rt, s, lambda: rt.cudaDeviceSynchronize(), CAPTURE_UNSUPPORTED)
    _breaks(rt, s, lambda: rt.cudaMemcpy(host.ctypes.data, a, n, D2H), CAPTURE_UNSUPPORTED)
    _breaks(rt, s, lambda: rt.cudaMemset(a, 0, n), CAPTURE_UNSUPPORTED, THREAD_LOCAL)
    p = c_void_p()
    assert "capture-unsafe" in _breaks(
        rt, s, lambda: rt.cudaMalloc(byref(p), 64), CAPTURE_UNSUPPORTED
    )
    _breaks(rt, s, lambda: rt.cudaFree(b), CAPTURE_UNSUPPORTED, THREAD_LOCAL)
    # work on the legacy stream while a blocking stream captures (relaxed: only that)
    assert "legacy default stream" in _breaks(
        rt, s, lambda: rt.cudaMemsetAsync(a, 1, n, None), CAPTURE_IMPLICIT, RELAXED
    )
    _breaks(rt, s, lambda: rt.cudaMemcpy(host.ctypes.data, a, n, D2H), CAPTURE_IMPLICIT, RELAXED)
    _breaks(rt, s, lambda: rt.cudaEventRecord(ev, None), CAPTURE_IMPLICIT, RELAXED)
    _breaks(rt, s, lambda: rt.cudaStreamSynchronize(None), CAPTURE_IMPLICIT, RELAXED)

    # an event recorded inside the capture completes only when the graph runs
    def record_then(fn: object) -> int:
        ok(rt, rt.cudaEventRecord(ev, s))
        return fn(ev)  # type: ignore[operator, no-any-return]

    _breaks(rt, s, lambda: record_then(rt.cudaEventQuery), CAPTURED_EVENT)
    _breaks(rt, s, lambda: record_then(rt.cudaEventSynchronize), CAPTURED_EVENT)
    # ... and waiting on uncaptured work is an isolation error
    ok(rt, rt.cudaEventRecord(ev, nb))
    assert "cudaEventWaitExternal" in _breaks(
        rt, s, lambda: rt.cudaStreamWaitEvent(s, ev, 0), CAPTURE_ISOLATION
    )
    # a task without a clone callback cannot be captured
    cb = HOST_FN(lambda _arg: None)
    keep(cb)
    assert "pynccl_lb_stream_enqueue2" in _breaks(
        rt,
        s,
        lambda: rt.pynccl_lb_stream_enqueue(s, ctypes.cast(cb, c_void_p), None, None),
        CAPTURE_UNSUPPORTED,
    )

    # after an invalidation, more work reports it
    def twice() -> int:
        assert rt.cudaStreamQuery(s) == CAPTURE_UNSUPPORTED
        return int(rt.cudaMemsetAsync(a, 0, n, s))

    assert "invalidated earlier" in _breaks(rt, s, twice, CAPTURE_INVALIDATED)
    ok(rt, rt.cudaEventDestroy(ev))
    for x in (s, nb):
        ok(rt, rt.cudaStreamDestroy(x))
    for x in (a, b):
        ok(rt, rt.cudaFree(x))


def test_capture_modes_and_other_threads(rt: ctypes.CDLL) -> None:
    n = 64
    s, nb = stream(rt), stream(rt, 1)

    def malloc_free() -> int:
        p = c_void_p()
        rc = rt.cudaMalloc(byref(p), n)
        if rc == SUCCESS:
            ok(rt, rt.cudaFree(p))
        return int(rc)

    # global: nobody may make unsafe calls
    _breaks(rt, s, lambda: _in_thread(malloc_free), CAPTURE_UNSUPPORTED, GLOBAL)
    # thread-local / relaxed: other threads may
    for mode in (THREAD_LOCAL, RELAXED):
        ok(rt, rt.cudaStreamBeginCapture(s, mode))
        assert _in_thread(malloc_free) == SUCCESS
        if mode == RELAXED:  # ... and the capturing thread too
            assert malloc_free() == SUCCESS
        assert capture_status(rt, s) == ACTIVE
        rc, graph = end_capture(rt, s)
        ok(rt, rc)
        ok(rt, rt.cudaGraphDestroy(graph))
    # a non-blocking capturing stream leaves the legacy stream free
    a = malloc(rt, n)
    ok(rt, rt.cudaStreamBeginCapture(nb, RELAXED))
    status = c_int(-1)
    ok(rt, rt.cudaMemsetAsync(a, 1, n, None))
    ok(rt, rt.cudaStreamIsCapturing(None, byref(status)))
    assert status.value == NONE
    rc, graph = end_capture(rt, nb)
    ok(rt, rc)
    ok(rt, rt.cudaGraphDestroy(graph))
    # asking the legacy stream while a blocking one captures: an error, not an invalidation
    ok(rt, rt.cudaStreamBeginCapture(s, GLOBAL))
    assert rt.cudaStreamIsCapturing(None, byref(status)) == CAPTURE_IMPLICIT
    assert capture_status(rt, s) == ACTIVE
    rc, graph = end_capture(rt, s)
    ok(rt, rc)
    ok(rt, rt.cudaGraphDestroy(graph))
    ok(rt, rt.cudaFree(a))
    for x in (s, nb):
        ok(rt, rt.cudaStreamDestroy(x))


def test_capture_forks_and_joins_through_events(rt: ctypes.CDLL) -> None:
    n = 512
    a, b, c = malloc(rt, n), malloc(rt, n), malloc(rt, n)
    s1, s2, s3 = stream(rt, 1), stream(rt, 1), stream(rt, 1)
    fork, join = event(rt), event(rt)
    # a fork not joined back
    ok(rt, rt.cudaStreamBeginCapture(s1, THREAD_LOCAL))
    ok(rt, rt.cudaEventRecord(fork, s1))
    ok(rt, rt.cudaStreamWaitEvent(s2, fork, 0))
    assert capture_status(rt, s2) == ACTIVE
    ok(rt, rt.cudaMemsetAsync(b, 2, n, s2))
    assert end_capture(rt, s2) == (CAPTURE_UNMATCHED, None)  # and that invalidates
    assert end_capture(rt, s1) == (CAPTURE_INVALIDATED, None)
    assert capture_status(rt, s2) == NONE
    ok(rt, rt.cudaStreamBeginCapture(s1, THREAD_LOCAL))
    ok(rt, rt.cudaEventRecord(fork, s1))
    ok(rt, rt.cudaStreamWaitEvent(s2, fork, 0))
    ok(rt, rt.cudaMemsetAsync(b, 2, n, s2))
    assert end_capture(rt, s1) == (CAPTURE_UNJOINED, None)
    assert capture_status(rt, s2) == NONE
    # fork, work on both, join: one graph
    ok(rt, rt.cudaStreamBeginCapture(s1, THREAD_LOCAL))
    ok(rt, rt.cudaMemsetAsync(a, 1, n, s1))
    ok(rt, rt.cudaEventRecord(fork, s1))
    ok(rt, rt.cudaStreamWaitEvent(s2, fork, 0))
    ok(rt, rt.cudaMemcpyAsync(b, a, n, D2D, s2))
    # another capture may not wait on this one's event
    ok(rt, rt.cudaStreamBeginCapture(s3, THREAD_LOCAL))
    assert rt.cudaStreamWaitEvent(s3, fork, 0) == CAPTURE_MERGE
    assert end_capture(rt, s3) == (CAPTURE_INVALIDATED, None)
    ok(rt, rt.cudaEventRecord(join, s2))
    ok(rt, rt.cudaStreamWaitEvent(s1, join, 0))
    ok(rt, rt.cudaMemcpyAsync(c, b, n, D2D, s1))
    rc, graph = end_capture(rt, s1)
    ok(rt, rc)
    assert capture_status(rt, s2) == NONE
    ok(rt, rt.cudaEventQuery(fork))  # usable again once the capture is over
    exe = instantiate(rt, graph)
    ok(rt, rt.cudaGraphLaunch(exe, s3))
    ok(rt, rt.cudaStreamSynchronize(s3))
    assert (read(rt, c, n) == 1).all()
    ok(rt, rt.cudaGraphExecDestroy(exe))
    ok(rt, rt.cudaGraphDestroy(graph))
    for e in (fork, join):
        ok(rt, rt.cudaEventDestroy(e))
    for x in (s1, s2, s3):
        ok(rt, rt.cudaStreamDestroy(x))
    for p in (a, b, c):
        ok(rt, rt.cudaFree(p))


def test_external_event_wait_is_a_graph_node(rt: ctypes.CDLL) -> None:
    s, other = stream(rt, 1), stream(rt, 1)
    ev = event(rt)
    ok(rt, rt.cudaEventRecord(ev, other))
    ok(rt, rt.cudaStreamBeginCapture(s, THREAD_LOCAL))
    ok(rt, rt.cudaStreamWaitEvent(s, ev, 1))  # cudaEventWaitExternal
    rc, graph = end_capture(rt, s)
    ok(rt, rc)
    exe = instantiate(rt, graph)
    with TaskGate(rt, other) as gate:
        ok(rt, rt.cudaEventRecord(ev, other))  # the launch waits for this record
        ok(rt, rt.cudaGraphLaunch(exe, s))
        assert rt.cudaStreamQuery(s) == NOT_READY
        gate.open()
        ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.cudaGraphExecDestroy(exe))
    ok(rt, rt.cudaGraphDestroy(graph))
    ok(rt, rt.cudaEventDestroy(ev))
    for x in (s, other):
        ok(rt, rt.cudaStreamDestroy(x))


def test_graph_handles_and_lifecycles(rt: ctypes.CDLL) -> None:
    n = 128
    a, b = malloc(rt, n), malloc(rt, n)
    s = stream(rt, 1)
    exe = c_void_p(1234)
    assert rt.cudaGraphInstantiate(byref(exe), None, 0) == INVALID_VALUE
    assert exe.value is None
    assert rt.cudaGraphInstantiate(byref(exe), 12345, 0) == INVALID_VALUE
    assert "not a live graph" in rt.pynccl_lb_last_error_detail().decode()
    assert rt.cudaGraphLaunch(None, s) == INVALID_VALUE
    assert rt.cudaGraphLaunch(12345, s) == INVALID_VALUE
    assert rt.cudaGraphExecDestroy(None) == INVALID_VALUE
    assert rt.cudaGraphDestroy(None) == INVALID_VALUE
    ok(rt, rt.cudaStreamBeginCapture(s, THREAD_LOCAL))
    ok(rt, rt.cudaMemsetAsync(a, 5, n, s))
    rc, graph = end_capture(rt, s)
    ok(rt, rc)
    x1, x2 = instantiate(rt, graph), instantiate(rt, graph)
    assert rt.cudaGraphInstantiate(byref(exe), graph, 1) == INVALID_VALUE  # no flags
    ok(rt, rt.cudaGraphDestroy(graph))
    assert rt.cudaGraphDestroy(graph) == INVALID_VALUE
    assert "destroyed twice" in rt.pynccl_lb_last_error_detail().decode()
    ok(rt, rt.cudaGraphExecDestroy(x1))
    assert rt.cudaGraphExecDestroy(x1) == INVALID_VALUE
    assert rt.cudaGraphLaunch(x1, s) == INVALID_VALUE
    # launched into a capturing stream, a graph's nodes join that capture
    s2 = stream(rt, 1)
    ok(rt, rt.cudaStreamBeginCapture(s2, THREAD_LOCAL))
    ok(rt, rt.cudaGraphLaunch(x2, s2))
    ok(rt, rt.cudaMemcpyAsync(b, a, n, D2D, s2))
    rc, outer = end_capture(rt, s2)
    ok(rt, rc)
    ok(rt, rt.cudaGraphExecDestroy(x2))  # the outer graph holds its own copies
    x3 = instantiate(rt, outer)
    ok(rt, rt.cudaGraphDestroy(outer))
    ok(rt, rt.cudaGraphLaunch(x3, s))
    ok(rt, rt.cudaGraphExecDestroy(x3))  # with its launch still queued
    ok(rt, rt.cudaStreamSynchronize(s))
    assert (read(rt, b, n) == 5).all()
    # a capturing stream destroyed: its capture is gone with it
    ok(rt, rt.cudaStreamBeginCapture(s2, GLOBAL))
    ok(rt, rt.cudaMemsetAsync(a, 1, n, s2))
    ok(rt, rt.cudaStreamDestroy(s2))
    p = c_void_p()
    ok(rt, rt.cudaMalloc(byref(p), 64))  # no global capture left behind
    ok(rt, rt.cudaFree(p))
    # a forked stream destroyed: the capture is invalidated
    s3, ev = stream(rt, 1), event(rt)
    ok(rt, rt.cudaStreamBeginCapture(s, THREAD_LOCAL))
    ok(rt, rt.cudaEventRecord(ev, s))
    ok(rt, rt.cudaStreamWaitEvent(s3, ev, 0))
    ok(rt, rt.cudaStreamDestroy(s3))
    assert end_capture(rt, s) == (CAPTURE_INVALIDATED, None)
    assert "destroyed" in rt.pynccl_lb_last_error_detail().decode()
    ok(rt, rt.cudaEventDestroy(ev))
    ok(rt, rt.cudaStreamDestroy(s))
    for x in (a, b):
        ok(rt, rt.cudaFree(x))


def test_enqueue2_clone_contract(rt: ctypes.CDLL) -> None:
    """What the loopback libnccl relies on: templates by clone(arg, 0), a run copy by
    clone(arg, 1) per launch, in launch order, every copy released exactly once."""
    lock = threading.Lock()
    log: list[tuple[str, int, int]] = []
    next_id = [100]

    def clone(arg: int | None, launch: int) -> int:
        with lock:
            next_id[0] += 1
            log.append(("clone", arg or 0, launch))
            return next_id[0]

    def run(arg: int | None) -> None:
        with lock:
            log.append(("run", arg or 0, 0))

    def release(arg: int | None) -> None:
        with lock:
            log.append(("release", arg or 0, 0))

    cbs = (keep(HOST_FN(run)), keep(HOST_FN(release)), keep(CLONE_FN(clone)))
    run_p, release_p, clone_p = (ctypes.cast(cb, c_void_p) for cb in cbs)
    s = stream(rt, 1)
    assert rt.pynccl_lb_stream_enqueue2(s, run_p, release_p, clone_p, 7, 1) == ILLEGAL_STATE
    assert rt.pynccl_lb_stream_enqueue2(s, run_p, release_p, clone_p, 7, 2) == INVALID_VALUE
    ok(rt, rt.pynccl_lb_stream_enqueue2(s, run_p, release_p, clone_p, 7, 0))  # runs now
    ok(rt, rt.cudaStreamSynchronize(s))
    assert log == [("run", 7, 0), ("release", 7, 0)]
    log.clear()
    ok(rt, rt.cudaStreamBeginCapture(s, THREAD_LOCAL))
    assert rt.pynccl_lb_stream_enqueue2(s, run_p, release_p, clone_p, 8, 0) == ILLEGAL_STATE
    ok(rt, rt.pynccl_lb_stream_enqueue2(s, run_p, release_p, clone_p, 8, 1))
    rc, graph = end_capture(rt, s)
    ok(rt, rc)
    assert log == []  # recorded, not run
    exe = instantiate(rt, graph)
    assert log == [("clone", 8, 0)]  # template 101
    ok(rt, rt.cudaGraphDestroy(graph))
    assert log[-1] == ("release", 8, 0)
    log.clear()
    for _ in range(2):
        ok(rt, rt.cudaGraphLaunch(exe, s))
    ok(rt, rt.cudaStreamSynchronize(s))
    assert log == [
        ("clone", 101, 1),
        ("clone", 101, 1),
        ("run", 102, 0),
        ("release", 102, 0),
        ("run", 103, 0),
        ("release", 103, 0),
    ] or sorted(log) == sorted(
        [
            ("clone", 101, 1),
            ("clone", 101, 1),
            ("run", 102, 0),
            ("release", 102, 0),
            ("run", 103, 0),
            ("release", 103, 0),
        ]
    )
    assert [e for e in log if e[0] == "run"] == [("run", 102, 0), ("run", 103, 0)]
    log.clear()
    ok(rt, rt.cudaGraphExecDestroy(exe))
    assert log == [("release", 101, 0)]
    ok(rt, rt.cudaStreamDestroy(s))


def test_malloc_alignment_registry_and_attributes(rt: ctypes.CDLL) -> None:
    n = ndev(rt)
    dev = min(1, n - 1)
    ok(rt, rt.cudaSetDevice(dev))
    ptrs = [malloc(rt, size) for size in (1, 100, 4096, 1 << 20)]
    assert all(p % 256 == 0 for p in ptrs)
    attrs = PointerAttributes()
    for p, size in zip(ptrs, (1, 100, 4096, 1 << 20)):
        ok(rt, rt.cudaPointerGetAttributes(byref(attrs), p + size - 1))
        assert (attrs.type, attrs.device, attrs.devicePointer) == (2, dev, p + size - 1)
        found = c_int(-1)
        assert rt.pynccl_lb_find_alloc(p, size, byref(found)) == 1
        assert found.value == dev
        assert rt.pynccl_lb_find_alloc(p + size, 0, None) == 1  # one past the end
        assert rt.pynccl_lb_find_alloc(p + 1, size, None) == 0  # overruns the end
    host = np.zeros(16, np.uint8)
    ok(rt, rt.cudaPointerGetAttributes(byref(attrs), host.ctypes.data))
    assert (attrs.type, attrs.device, attrs.hostPointer) == (0, -2, host.ctypes.data)
    assert attrs.devicePointer is None
    assert rt.pynccl_lb_find_alloc(host.ctypes.data, 1, None) == 0
    assert rt.cudaPointerGetAttributes(None, ptrs[0]) == INVALID_VALUE
    for p in ptrs:
        ok(rt, rt.cudaFree(p))
    ok(rt, rt.cudaPointerGetAttributes(byref(attrs), ptrs[0]))
    assert attrs.type == 0  # freed: no longer device memory
    zero = c_void_p(1)
    ok(rt, rt.cudaMalloc(byref(zero), 0))
    assert zero.value is None
    assert rt.cudaMalloc(None, 16) == INVALID_VALUE
    huge = c_void_p()
    assert rt.cudaMalloc(byref(huge), 1 << 62) == 2  # cudaErrorMemoryAllocation
    assert huge.value is None


def test_bad_frees_are_errors_not_crashes(rt: ctypes.CDLL) -> None:
    p = malloc(rt, 1024)
    assert rt.cudaFree(p + 256) == INVALID_DEVICE_POINTER  # inside, not the start
    ok(rt, rt.cudaFree(p))
    assert rt.cudaFree(p) == INVALID_VALUE  # double free
    assert "double free" in rt.pynccl_lb_last_error_detail().decode()
    host = np.zeros(64, np.uint8)
    assert rt.cudaFree(host.ctypes.data) == INVALID_VALUE
    ok(rt, rt.cudaFree(None))
    q = c_void_p()
    ok(rt, rt.pynccl_lb_malloc(byref(q), 512, ndev(rt) - 1))
    found = c_int(-1)
    assert rt.pynccl_lb_find_alloc(q, 512, byref(found)) == 1
    assert found.value == ndev(rt) - 1
    assert rt.pynccl_lb_malloc(byref(q), 512, ndev(rt)) == INVALID_DEVICE
    ok(rt, rt.pynccl_lb_free(q))
    assert rt.pynccl_lb_free(q) == INVALID_VALUE


def test_sync_copies_and_memset_roundtrip(rt: ctypes.CDLL) -> None:
    rng = np.random.default_rng(1)
    src = rng.standard_normal(10_000).astype(np.float32)
    nbytes = src.nbytes
    a, b = malloc(rt, nbytes), malloc(rt, nbytes)
    ok(rt, rt.cudaMemcpy(a, src.ctypes.data, nbytes, H2D))
    ok(rt, rt.cudaMemcpy(b, a, nbytes, D2D))
    out = np.empty_like(src)
    ok(rt, rt.cudaMemcpy(out.ctypes.data, b, nbytes, D2H))
    np.testing.assert_array_equal(out, src)
    ok(rt, rt.cudaMemset(b + 400, 0x7F, 1000))
    ok(rt, rt.cudaMemcpy(out.ctypes.data, b, nbytes, DEFAULT))
    expected = src.copy()
    expected.view(np.uint8)[400:1400] = 0x7F
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))
    host2 = np.empty_like(src)
    ok(rt, rt.cudaMemcpy(host2.ctypes.data, src.ctypes.data, nbytes, H2H))
    np.testing.assert_array_equal(host2, src)
    ok(rt, rt.cudaMemcpy(out.ctypes.data, b, 0, D2H))  # nothing to do
    ok(rt, rt.cudaFree(a))
    ok(rt, rt.cudaFree(b))


def test_copy_argument_checks(rt: ctypes.CDLL) -> None:
    if os.environ.get("PYNCCL_LOOPBACK_STRICT") == "0":
        pytest.skip("the loaded loopback cudart is not strict")
    a = malloc(rt, 256)
    host = np.zeros(512, np.uint8)
    h = host.ctypes.data
    assert rt.cudaMemcpy(a, h, 256, 7) == INVALID_MEMCPY_DIRECTION
    assert rt.cudaMemcpy(h, h, 16, H2D) == INVALID_VALUE  # dst is not device memory
    assert "PYNCCL_LOOPBACK_STRICT" in rt.pynccl_lb_last_error_detail().decode()
    assert rt.cudaMemcpy(h, h, 16, D2H) == INVALID_VALUE  # src is not device memory
    assert rt.cudaMemcpy(a, h, 257, H2D) == INVALID_VALUE  # one byte past the end
    assert rt.cudaMemcpyAsync(a, a, 16, D2D, None) == SUCCESS
    assert rt.cudaMemcpy(None, h, 16, H2H) == INVALID_VALUE
    assert rt.cudaMemset(h, 0, 16) == INVALID_VALUE
    assert rt.cudaMemsetAsync(a + 128, 0, 129, None) == INVALID_VALUE
    ok(rt, rt.cudaMemcpy(h, h + 256, 256, DEFAULT))  # direction inferred: host is fine
    ok(rt, rt.cudaFree(a))


def test_relaxed_mode_allows_host_pointers(cudart_path: str) -> None:
    code = textwrap.dedent(
        """
        import ctypes, sys
        lib = ctypes.CDLL(sys.argv[1])
        src = (ctypes.c_char * 8)(*b"loopback")
        dst = (ctypes.c_char * 8)()
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
        rc = lib.cudaMemcpy(ctypes.addressof(dst), ctypes.addressof(src), 8, 1)
        lib.cudaStreamSynchronize(None)  # host to device returns before the copy lands
        print(rc, dst.raw.decode())
        """
    )
    for strict, expected in (("0", "0 loopback"), ("1", "1")):
        out = subprocess.run(
            [sys.executable, "-c", code, cudart_path],
            env={**os.environ, "PYNCCL_LOOPBACK_STRICT": strict},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert out.stdout.replace("\x00", "").split() == expected.split()


def test_long_async_chain_keeps_stream_order(rt: ctypes.CDLL) -> None:
    rng = np.random.default_rng(7)
    size = 4096
    ref = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(2)]
    bufs = [malloc(rt, size), malloc(rt, size)]
    s = stream(rt)
    keep = []  # host sources must stay alive and unchanged until the stream is done
    for i in range(2):
        keep.append(ref[i].copy())
        ok(rt, rt.cudaMemcpyAsync(bufs[i], keep[-1].ctypes.data, size, H2D, s))
    for _ in range(400):
        op = int(rng.integers(0, 3))
        i, j = (int(k) for k in rng.integers(0, 2, 2))
        off, off2 = (int(k) for k in rng.integers(0, size // 2, 2))
        n = int(rng.integers(1, size // 2))
        if op == 0:
            value = int(rng.integers(0, 256))
            ok(rt, rt.cudaMemsetAsync(bufs[i] + off, value, n, s))
            ref[i][off : off + n] = value
        elif op == 1:
            ok(rt, rt.cudaMemcpyAsync(bufs[j] + off2, bufs[i] + off, n, D2D, s))
            ref[j][off2 : off2 + n] = ref[i][off : off + n].copy()
        else:
            data = rng.integers(0, 256, n, dtype=np.uint8)
            keep.append(data)
            ok(rt, rt.cudaMemcpyAsync(bufs[i] + off, data.ctypes.data, n, H2D, s))
            ref[i][off : off + n] = data
    out = [np.empty(size, np.uint8) for _ in range(2)]
    for i in range(2):
        ok(rt, rt.cudaMemcpyAsync(out[i].ctypes.data, bufs[i], size, D2H, s))
    ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.cudaStreamQuery(s))
    for i in range(2):
        np.testing.assert_array_equal(out[i], ref[i])
    ok(rt, rt.cudaStreamDestroy(s))
    for b in bufs:
        ok(rt, rt.cudaFree(b))


def test_free_waits_for_the_device(rt: ctypes.CDLL) -> None:
    """cudaFree synchronizes the allocation's device, as CUDA's does."""
    s = stream(rt)
    a = malloc(rt, 1 << 16)
    returned = threading.Event()
    results: list[int] = []

    def free() -> None:
        results.append(rt.cudaFree(a))
        returned.set()

    with TaskGate(rt, s) as gate:
        ok(rt, rt.cudaMemsetAsync(a, 1, 1 << 16, s))
        t = threading.Thread(target=free)
        t.start()
        assert not returned.wait(0.3)  # the memset (behind the gate) is still pending
        assert rt.pynccl_lb_find_alloc(a, 1, None) == 1  # and its memory still allocated
        gate.open()
        assert returned.wait(30)
        t.join()
    assert results == [0]
    assert rt.cudaStreamQuery(s) == 0  # the queued work had completed
    assert rt.pynccl_lb_find_alloc(a, 1, None) == 0
    ok(rt, rt.cudaStreamDestroy(s))


def test_free_ignores_other_devices_work(rt: ctypes.CDLL) -> None:
    if ndev(rt) < 2:
        pytest.skip("needs 2 loopback devices")
    s = stream(rt)  # device 0
    a = malloc(rt, 4096)
    ok(rt, rt.cudaSetDevice(1))
    try:
        b = malloc(rt, 4096)
        with TaskGate(rt, s):
            ok(rt, rt.cudaFree(b))  # device 1 is idle: returns while device 0 is busy
            assert rt.cudaStreamQuery(s) == NOT_READY
    finally:
        ok(rt, rt.cudaSetDevice(0))
    ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.cudaFree(a))
    ok(rt, rt.cudaStreamDestroy(s))


@pytest.fixture(scope="module")
def nccl_lib(rt: ctypes.CDLL) -> object:
    """The loopback libnccl, linked to the very cudart ``rt`` is (one instance)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _lb_nccl import Lib

    b = loopback.build()
    assert b.cudart == loopback.build_cudart()
    return Lib(b.nccl, b.cudart)


def _free_in_thread(
    rt: ctypes.CDLL, ptr: int
) -> tuple[threading.Thread, threading.Event, list[int]]:
    returned = threading.Event()
    results: list[int] = []

    def free() -> None:
        results.append(rt.cudaFree(ptr))
        returned.set()

    t = threading.Thread(target=free)
    t.start()
    return t, returned, results


def test_free_waits_for_a_pending_collective(rt: ctypes.CDLL, nccl_lib: Any) -> None:
    """A collective still waiting for its peer never sees its send buffer freed."""
    from _lb_nccl import GroupWorld

    lib, n = nccl_lib, 1 << 14
    w = GroupWorld(lib, 2)
    send = [lib.malloc(4 * n, r) for r in range(2)]
    try:
        recv = [w.alloc(r, 4 * n) for r in range(2)]
        data = [np.arange(n, dtype=np.float32) * (r + 1) - r for r in range(2)]
        for r in range(2):
            lib.upload(send[r], data[r])
        # Rank 0 alone: its all-reduce waits on its stream for rank 1.
        assert lib.ncclAllReduce(send[0], recv[0], n, 7, 0, w.comms[0], w.streams[0]) == 0
        t, returned, results = _free_in_thread(rt, send[0])
        assert not returned.wait(0.3)  # cudaFree waits for device 0's pending work
        assert rt.pynccl_lb_find_alloc(send[0], 4 * n, None) == 1
        assert lib.ncclAllReduce(send[1], recv[1], n, 7, 0, w.comms[1], w.streams[1]) == 0
        assert returned.wait(30)
        t.join()
        assert results == [0]
        assert rt.cudaStreamQuery(w.streams[0]) == 0  # the collective had finished
        for r in range(2):
            assert lib.sync(w.streams[r]) == 0
            np.testing.assert_array_equal(lib.download(recv[r], np.float32, n), data[0] + data[1])
    finally:
        w.close()
        lib.free(send[1])


def test_free_waits_for_a_hung_operation_until_abort(
    rt: ctypes.CDLL, nccl_lib: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from _lb_nccl import GroupWorld

    lib = nccl_lib
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "1")  # every rank's first operation hangs
    w = GroupWorld(lib, 2)
    monkeypatch.delenv("PYNCCL_LOOPBACK_HANG")
    buf = [lib.malloc(64, r) for r in range(2)]
    try:
        for r in range(2):
            assert lib.ncclAllReduce(buf[r], buf[r], 16, 7, 0, w.comms[r], w.streams[r]) == 0
        t, returned, results = _free_in_thread(rt, buf[0])
        assert not returned.wait(0.3)
        assert lib.ncclCommAbort(w.comms[0]) == 0  # releases the hung operation
        assert returned.wait(30)
        t.join()
        assert results == [0]
        assert rt.pynccl_lb_find_alloc(buf[0], 1, None) == 0
        assert lib.ncclCommAbort(w.comms[1]) == 0
        w.comms = []
    finally:
        w.close()
        lib.free(buf[1])


def test_ncclmemfree_path_outlives_queued_work(rt: ctypes.CDLL) -> None:
    """pynccl_lb_free (ncclMemFree) does not wait, but the memory outlives the queue."""
    s = stream(rt)
    a = c_void_p()
    ok(rt, rt.pynccl_lb_malloc(byref(a), 1 << 16, 0))
    with TaskGate(rt, s):
        ok(rt, rt.cudaMemsetAsync(a, 1, 1 << 16, s))
        ok(rt, rt.pynccl_lb_free(a))  # returns at once
        assert rt.pynccl_lb_find_alloc(a, 1, None) == 0
        assert rt.cudaStreamQuery(s) == NOT_READY
    ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.cudaStreamDestroy(s))


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


# ---- sanitizers and header conformance ------------------------------------------------


def test_sanitized_build_runs_clean(tmp_path: Path) -> None:
    try:
        path = loopback.build_cudart(sanitize=True)
        extra = _build._sanitizer_env()
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"no sanitizer toolchain: {exc}")
    code = textwrap.dedent(
        """
        import ctypes, sys, threading
        lib = ctypes.CDLL(sys.argv[1])
        V = ctypes.c_void_p
        lib.cudaMemsetAsync.argtypes = [V, ctypes.c_int, ctypes.c_size_t, V]
        lib.cudaMemcpyAsync.argtypes = [V, V, ctypes.c_size_t, ctypes.c_int, V]
        lib.pynccl_lb_stream_enqueue.argtypes = [V] * 4
        lib.cudaFree.argtypes = [V]
        lib.cudaStreamSynchronize.argtypes = lib.cudaStreamDestroy.argtypes = [V]
        gate = threading.Event()
        cb = ctypes.CFUNCTYPE(None, V)(lambda _: gate.wait(60))
        s, a, b = V(), V(), V()
        assert lib.cudaStreamCreate(ctypes.byref(s)) == 0
        for p in (a, b):
            assert lib.cudaMalloc(ctypes.byref(p), 1 << 16) == 0
        assert lib.pynccl_lb_stream_enqueue(s, ctypes.cast(cb, V), None, None) == 0
        assert lib.cudaMemsetAsync(a, 1, 1 << 16, s) == 0
        assert lib.cudaMemcpyAsync(b, a, 1 << 16, 3, s) == 0
        assert lib.cudaFree(a) == 0          # queued work still uses a: must not be freed
        gate.set()
        assert lib.cudaStreamSynchronize(s) == 0
        assert lib.cudaStreamDestroy(s) == 0
        assert lib.cudaFree(b) == 0
        assert lib.cudaFree(b) == 1
        assert lib.cudaMalloc(ctypes.byref(b), ctypes.c_size_t(1 << 62)) == 2  # error, not abort
        print("clean")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, path],
        env={**os.environ, **extra},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "clean", proc.stderr[-4000:]
    assert "runtime error" not in proc.stderr  # UBSan


def _syntax_check(sources: list[Path], root: Path) -> subprocess.CompletedProcess[str]:
    cc = os.environ.get("CC") or "cc"
    return subprocess.run(
        [
            cc,
            "-fsyntax-only",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-DLB_USE_REAL_HEADERS",
            f"-I{root / 'include'}",
            f"-I{root}",
            f"-I{REAL_HEADERS}",
            *map(str, sources),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_exports_match_the_real_cuda_headers(tmp_path: Path) -> None:
    if not Path(REAL_HEADERS, "cuda_runtime_api.h").is_file():
        pytest.skip(f"no CUDA headers in {REAL_HEADERS}")
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler")
    src = loopback.SOURCE_DIR
    sources = sorted((src / "cudart").glob("*.c"))
    assert len(sources) >= 8
    proc = _syntax_check(sources, src)
    assert proc.returncode == 0, proc.stderr
    # The check has teeth: one wrong parameter type is rejected by the real header.
    for sub in ("cudart", "include"):
        shutil.copytree(src / sub, tmp_path / sub)
    target = tmp_path / "cudart" / "api.c"
    text = target.read_text()
    assert "cudaError_t cudaSetDevice(int device) {" in text
    target.write_text(text.replace("cudaSetDevice(int device) {", "cudaSetDevice(long device) {"))
    bad = _syntax_check(sorted((tmp_path / "cudart").glob("*.c")), tmp_path)
    assert bad.returncode != 0
    assert "cudaSetDevice" in bad.stderr
