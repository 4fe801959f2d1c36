"""The waiting of :meth:`~pynccl.Communicator.synchronize`: refuse a stream being
captured, switch to relaxed capture mode and the communicator's device, and poll the
stream, watching the communicator's asynchronous error, until it drains or the deadline
passes; and :func:`exchange_mode`, the thread's capture interaction mode (shared with the
group's holder and the window agreement)."""

from __future__ import annotations

import time
from ctypes import byref, c_int

from ..enums import Result
from ..errors import NcclInvalidUsage

__all__ = ["exchange_mode", "sync_stream", "wait_stream"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_NOT_READY = 600  # cudaErrorNotReady


def sync_stream(
    s: int,
    device_of: Callable[[], int],
    deadline: float | None,
    check: Callable[[], None],
    timed_out: Callable[[int], BaseException],
) -> None:
    """Wait for stream ``s`` with the communicator's device (``device_of()``) current
    (the default streams 0, legacy and per-thread are per device), in relaxed capture
    mode (waiting never breaks another thread's capture); the caller's device and mode are
    restored after. See :func:`wait_stream` for ``check`` and ``timed_out``."""
    from ..cuda import _capture_blocks
    from ..cuda._graph import _unsafe_calls_prohibited, relaxed_capture_mode
    from ..library import cudart

    if _capture_blocks(s):
        # cudaStreamQuery would fail and invalidate the capture: nothing captured has
        # run yet, so there is nothing to wait for either.
        raise NcclInvalidUsage(
            Result.INVALID_USAGE,
            "synchronize",
            f"stream {s:#x} is being captured into a CUDA graph: its work runs when "
            "the graph is launched; end the capture, launch the graph, then synchronize",
        )
    rt = cudart()
    with relaxed_capture_mode() as relaxed:
        if not relaxed and _unsafe_calls_prohibited():
            # Without cudaThreadExchangeStreamCaptureMode, waiting on s would
            # invalidate that other capture.
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "synchronize",
                "a CUDA graph capture is in progress on another stream "
                "(pynccl.cuda.Graph): synchronizing now would invalidate it; synchronize "
                "after the capture ends",
            )
        current = c_int(-1)
        rt.raw("cudaGetDevice")(byref(current))
        device = device_of()
        if current.value != device:
            rt.cudaSetDevice(device)
        try:
            wait_stream(rt, s, deadline, check, timed_out)
        finally:
            if current.value != device and current.value >= 0:
                rt.raw("cudaSetDevice")(current.value)
        # The stream passed: what closed operations and ops kept for it can go now
        # (as Stream.synchronize() lets them go), not only at the next keep; and what
        # this thread's ended groups kept, not only at its next group end.
        from ..cuda._stream import release_done
        from ..groups import release_done as release_groups

        release_done()
        release_groups()


def wait_stream(
    rt: Any,
    s: int,
    deadline: float | None,
    check: Callable[[], None],
    timed_out: Callable[[int], BaseException],
) -> None:
    """Wait for stream ``s``; ``check()`` raises the communicator's error (between two
    queries), ``timed_out(s)`` gives the error to raise once ``deadline`` passed (it
    aborted the communicator). A failure of the query itself is never read as the
    communicator's: it raises as it is (and is not left as the thread's last error)."""
    from ..cuda._graph import is_capture_error

    query = rt.raw("cudaStreamQuery")
    delay = 0.0
    while True:
        rc = query(s)
        if rc == 0:
            return
        if rc != _NOT_READY:
            error = rt.make_error(rc, "cudaStreamQuery")
            rt.raw("cudaGetLastError")()
            if is_capture_error(rc):
                raise NcclInvalidUsage(
                    Result.INVALID_USAGE,
                    "synchronize",
                    f"cudaStreamQuery({s:#x}) was refused because of a CUDA graph "
                    f"capture ({error}); the communicator is unaffected: synchronize "
                    "after the capture ends",
                ) from error
            raise error
        check()
        if deadline is not None and time.monotonic() >= deadline:
            raise timed_out(s)
        time.sleep(delay)
        delay = min(delay * 2 or 0.0001, 0.005)


_EXCHANGE: tuple[object, Any] = (None, None)  # (libcudart, its function or None)


def exchange_mode(rt: Any, mode: int) -> int | None:
    """``cudaThreadExchangeStreamCaptureMode``: make ``mode`` the calling thread's capture
    interaction mode (2: relaxed); the previous one, or None where libcudart ``rt`` lacks
    the call (``mode=-1``: only tell whether it has it, as 0, changing nothing)."""
    global _EXCHANGE
    lib, fn = _EXCHANGE
    if lib is not rt:
        has = rt.has("cudaThreadExchangeStreamCaptureMode")
        fn = rt.raw("cudaThreadExchangeStreamCaptureMode") if has else None
        _EXCHANGE = (rt, fn)
    if fn is None:
        return None
    if mode < 0:
        return 0
    value = c_int(mode)
    if fn(byref(value)):
        rt.raw("cudaGetLastError")()
        return None
    return int(value.value)
