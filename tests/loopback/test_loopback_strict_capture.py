"""The loopback libcudart as strict as CUDA (issue 20): the capture rows of the leniency
table (LENIENCY_TABLE in test_loopback_strict_cudart.py, whose table test finds these).

CUDA's stream-capture interaction modes across threads: during a global-mode capture a
"potentially unsafe" call (a query, a synchronize, malloc/free, a synchronous copy) from
another thread in global mode fails with cudaErrorStreamCaptureUnsupported and
invalidates the capture, while a relaxed or thread-local thread, or any thread during a
thread-local or relaxed capture, may make it; each thread has its own mode
(cudaThreadExchangeStreamCaptureMode). And cudaStreamIsCapturing(0)'s implicit
synchronization error stays the thread's last error without invalidating the capture.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from ctypes import byref, c_int, c_void_p

import numpy as np
import pytest
from support.cudart import (
    ACTIVE,
    CAPTURE_IMPLICIT,
    CAPTURE_INVALIDATED,
    CAPTURE_UNSUPPORTED,
    CAPTURED_EVENT,
    D2H,
    GLOBAL,
    INVALID_VALUE,
    NON_BLOCKING,
    RELAXED,
    SUCCESS,
    THREAD_LOCAL,
    capture_status,
    clean_thread_state,  # noqa: F401  (autouse: per-test thread state)
    detail,
    end_capture,
    event,
    filled,
    linked_rt,  # noqa: F401  (the rt fixture)
    ok,
    stream,
)

N = 4096


def exchange(rt: ctypes.CDLL, mode: int) -> int:
    """Set this thread's capture interaction mode to ``mode``; the one it had."""
    m = c_int(mode)
    ok(rt, rt.cudaThreadExchangeStreamCaptureMode(byref(m)))
    return m.value


# ---- capture interaction modes across threads ------------------------------------------------


def _unsafe_calls(rt: ctypes.CDLL) -> dict[str, Callable[[], int]]:
    """The "potentially unsafe" calls, on objects that have nothing to do with the capture."""
    other = stream(rt, NON_BLOCKING)
    ev = event(rt)
    ok(rt, rt.cudaEventRecord(ev, other))
    ok(rt, rt.cudaStreamSynchronize(other))
    a = filled(rt, 1, N)
    host = np.zeros(64, np.uint8)

    def malloc_free() -> int:
        p = c_void_p()
        rc = int(rt.cudaMalloc(byref(p), 64))
        if rc == SUCCESS:
            ok(rt, rt.cudaFree(p))
        return rc

    return {
        "cudaEventQuery": lambda: int(rt.cudaEventQuery(ev)),
        "cudaEventSynchronize": lambda: int(rt.cudaEventSynchronize(ev)),
        "cudaStreamQuery": lambda: int(rt.cudaStreamQuery(other)),
        "cudaStreamSynchronize": lambda: int(rt.cudaStreamSynchronize(other)),
        "cudaDeviceSynchronize": lambda: int(rt.cudaDeviceSynchronize()),
        "cudaMalloc": malloc_free,
        "cudaMemcpy": lambda: int(rt.cudaMemcpy(host.ctypes.data, a, 64, D2H)),
        "cudaMemset": lambda: int(rt.cudaMemset(a, 3, 64)),
    }


UNSAFE = (
    "cudaEventQuery",
    "cudaEventSynchronize",
    "cudaStreamQuery",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMalloc",
    "cudaMemcpy",
    "cudaMemset",
)


def _from_thread(rt: ctypes.CDLL, call: Callable[[], int], mode: int) -> tuple[int, str]:
    """``call`` from a new thread whose interaction mode is ``mode`` (a new thread's is
    global: no exchange then)."""
    box: list[tuple[int, str]] = []

    def body() -> None:
        if mode != GLOBAL:
            exchange(rt, mode)
        rc = call()
        box.append((rc, detail(rt)))

    t = threading.Thread(target=body)
    t.start()
    t.join(60)
    assert box, "the call did not return"
    return box[0]


@pytest.mark.parametrize(
    "mode", [GLOBAL, THREAD_LOCAL, RELAXED], ids=["global", "local", "relaxed"]
)
@pytest.mark.parametrize("call", UNSAFE)
def test_capture_unsafe_from_other_threads(rt: ctypes.CDLL, call: str, mode: int) -> None:
    calls = _unsafe_calls(rt)
    s = stream(rt, NON_BLOCKING)
    ok(rt, rt.cudaStreamBeginCapture(s, GLOBAL))  # torch.cuda.graph's default
    rc, why = _from_thread(rt, calls[call], mode)
    end, graph = end_capture(rt, s)
    if mode == GLOBAL:  # CUDA: refused, and the capture is invalidated
        assert rc == CAPTURE_UNSUPPORTED, (rc, why)
        assert "another thread" in why and "cudaThreadExchangeStreamCaptureMode" in why
        assert (end, graph) == (CAPTURE_INVALIDATED, None)
        assert call in detail(rt)  # the end names what invalidated it
    else:  # a relaxed or thread-local thread ignores other threads' captures
        assert rc == SUCCESS, (rc, why)
        ok(rt, end)
        ok(rt, rt.cudaGraphDestroy(graph))
    ok(rt, rt.cudaStreamDestroy(s))
    ok(rt, rt.cudaDeviceSynchronize())


@pytest.mark.parametrize("capture_mode", [THREAD_LOCAL, RELAXED], ids=["local", "relaxed"])
def test_capture_mode_of_the_capture(rt: ctypes.CDLL, capture_mode: int) -> None:
    calls = _unsafe_calls(rt)
    s = stream(rt, NON_BLOCKING)
    ok(rt, rt.cudaStreamBeginCapture(s, capture_mode))
    for name in UNSAFE:  # from a thread in the default, global mode
        rc, why = _from_thread(rt, calls[name], GLOBAL)
        assert rc == SUCCESS, (name, rc, why)
    assert capture_status(rt, s) == ACTIVE
    end, graph = end_capture(rt, s)
    ok(rt, end)
    ok(rt, rt.cudaGraphDestroy(graph))
    ok(rt, rt.cudaStreamDestroy(s))


def test_capturing_thread_interaction_mode(rt: ctypes.CDLL) -> None:
    calls = _unsafe_calls(rt)
    s = stream(rt, NON_BLOCKING)
    ev = event(rt)
    try:
        # Relaxed: the capturing thread itself may make every unsafe call...
        ok(rt, rt.cudaStreamBeginCapture(s, GLOBAL))
        assert exchange(rt, RELAXED) == GLOBAL
        for name in UNSAFE:
            assert calls[name]() == SUCCESS, (name, detail(rt))
        assert capture_status(rt, s) == ACTIVE
        # ...never one that conflicts with the capture: waiting on the capturing stream,
        rc = rt.cudaStreamQuery(s)
        assert rc == CAPTURE_UNSUPPORTED, detail(rt)
        assert end_capture(rt, s) == (CAPTURE_INVALIDATED, None)
        # or querying an event recorded inside it.
        ok(rt, rt.cudaStreamBeginCapture(s, GLOBAL))
        ok(rt, rt.cudaEventRecord(ev, s))
        assert rt.cudaEventQuery(ev) == CAPTURED_EVENT
        assert end_capture(rt, s) == (CAPTURE_INVALIDATED, None)
        # Thread-local: its own (non-relaxed) capture still forbids them.
        assert exchange(rt, THREAD_LOCAL) == RELAXED
        ok(rt, rt.cudaStreamBeginCapture(s, THREAD_LOCAL))
        assert calls["cudaEventQuery"]() == CAPTURE_UNSUPPORTED
        assert "this thread" in detail(rt)
        assert end_capture(rt, s) == (CAPTURE_INVALIDATED, None)
        # ... but not a relaxed capture of its own.
        ok(rt, rt.cudaStreamBeginCapture(s, RELAXED))
        assert calls["cudaStreamQuery"]() == SUCCESS
        end, graph = end_capture(rt, s)
        ok(rt, end)
        ok(rt, rt.cudaGraphDestroy(graph))
    finally:
        exchange(rt, GLOBAL)
    ok(rt, rt.cudaEventDestroy(ev))
    ok(rt, rt.cudaStreamDestroy(s))


def test_exchange_capture_mode(rt: ctypes.CDLL) -> None:
    assert exchange(rt, THREAD_LOCAL) == GLOBAL  # every thread starts global
    try:
        seen = _from_thread(rt, lambda: exchange(rt, GLOBAL), RELAXED)[0]
        assert seen == RELAXED  # the other thread saw its own mode, not this one's
        assert exchange(rt, RELAXED) == THREAD_LOCAL
        assert rt.cudaThreadExchangeStreamCaptureMode(None) == INVALID_VALUE
        bad = c_int(3)
        assert rt.cudaThreadExchangeStreamCaptureMode(byref(bad)) == INVALID_VALUE
        assert "*mode=3" in detail(rt)
        assert bad.value == 3
        assert exchange(rt, RELAXED) == RELAXED  # unchanged by the refused calls
    finally:
        exchange(rt, GLOBAL)
    assert exchange(rt, GLOBAL) == GLOBAL


# ---- the implicit-synchronization error of cudaStreamIsCapturing ----------------------------


def test_implicit_capture_error_is_last_error(rt: ctypes.CDLL) -> None:
    blocking = stream(rt, 0)
    ok(rt, rt.cudaStreamBeginCapture(blocking, GLOBAL))
    status = c_int(-1)
    assert rt.cudaStreamIsCapturing(None, byref(status)) == CAPTURE_IMPLICIT
    assert status.value == -1  # not written on error
    assert rt.cudaPeekAtLastError() == CAPTURE_IMPLICIT
    count = c_int()
    ok(rt, rt.cudaGetDeviceCount(byref(count)))  # a success does not reset it
    assert rt.cudaPeekAtLastError() == CAPTURE_IMPLICIT
    assert _from_thread(rt, lambda: int(rt.cudaPeekAtLastError()), GLOBAL)[0] == SUCCESS
    assert rt.cudaGetLastError() == CAPTURE_IMPLICIT  # read: and so cleared
    assert rt.cudaGetLastError() == SUCCESS
    assert capture_status(rt, blocking) == ACTIVE  # an error, not an invalidation
    end, graph = end_capture(rt, blocking)
    ok(rt, end)
    ok(rt, rt.cudaGraphDestroy(graph))
    ok(rt, rt.cudaStreamDestroy(blocking))
