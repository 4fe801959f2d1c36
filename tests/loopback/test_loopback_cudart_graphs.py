"""The loopback libcudart, driven through ctypes directly: stream capture and CUDA graphs
(what capture records and what breaks it, capture modes and threads, forks and joins
through events, graph lifecycles, the enqueue2 clone contract).

Results are checked against numpy re-computations; streams are held with a gate task
(see test_loopback_cudart.py).
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import byref, c_int, c_void_p

import numpy as np
from support.cudart import (
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
    GLOBAL,
    H2D,
    HOST_FN,
    ILLEGAL_STATE,
    INVALID_VALUE,
    INVALIDATED,
    LEGACY,
    NONE,
    NOT_READY,
    PER_THREAD,
    RELAXED,
    SUCCESS,
    THREAD_LOCAL,
    TaskGate,
    built_cudart_path,  # noqa: F401  (the cudart_path fixture)
    capture_status,
    clean_thread_state,  # noqa: F401  (autouse: per-test thread state)
    end_capture,
    event,
    keep,
    malloc,
    ok,
    read,
    standalone_rt,  # noqa: F401  (the rt fixture)
    stream,
)

CLONE_FN = ctypes.CFUNCTYPE(c_void_p, c_void_p, c_int)


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
