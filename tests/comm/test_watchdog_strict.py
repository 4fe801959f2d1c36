"""The watchdog as strict as a GPU makes it (issue 20: bugs 1, 2, 8, 11; fuzz 5, 13).

* its queries (and ``synchronize()``'s) never break another thread's global-mode capture:
  CUDA fails ``cudaEventQuery``/``cudaStreamQuery`` from a thread in the default global
  interaction mode with cudaErrorStreamCaptureUnsupported and invalidates the capture;
  the thread must switch itself to relaxed mode (``cudaThreadExchangeStreamCaptureMode``),
  as PyTorch's watchdog does. These tests need that call in the loopback libcudart and
  skip, saying so, where it lacks it;
* a call blocked inside NCCL on another thread (it holds the communicator's gate) does
  not keep the watchdog from seeing a hang: ``ncclCommGetAsyncError`` is read without the
  gate, and a gate timeout is never taken as "torn down";
* its events belong to the communicator's device (an event recorded on another device's
  stream fails in CUDA; on stream 0 it lands on the current device's legacy stream, where
  the communicator's work is not), and ``Event(device=)``/``Stream.wait`` cross devices;
* ``start_watchdog(interval=)`` is checked like every timeout, and the thread never dies
  silently; its error texts are sentences; ``format_flight_record(last=)`` is checked;
* an unchecked ``cudaStreamIsCapturing(0)`` (error 906) does not stay the thread's last
  CUDA error.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from support.wait import wait_for

from pynccl import NcclInvalidUsage, NcclTimeoutError, library
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer, Event, Graph, Stream, get_device, set_device
from pynccl.groups import group

N = 16


@pytest.fixture(autouse=True)
def _loopback(lb: Any) -> None:
    """Every test of this module runs on the default loopback (NCCL 2.32)."""


@pytest.fixture
def capture_modes(lb: Any) -> None:
    """Skips where the loopback libcudart lacks cudaThreadExchangeStreamCaptureMode: the
    strict cross-thread capture rules land with it (without it nothing is enforced)."""
    if not hasattr(library.cudart()._cdll, "cudaThreadExchangeStreamCaptureMode"):
        pytest.skip("the loopback libcudart lacks cudaThreadExchangeStreamCaptureMode")


def _watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pynccl-watchdog")]


@pytest.fixture
def hung(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Communicator, DeviceBuffer]]:
    """A one-rank communicator on device 0 whose first operation never ends (until an
    abort), and a buffer; aborted afterwards. Its stream is non-blocking: a hung operation
    on the legacy stream would hold every blocking stream of the device too."""
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "1")
    stream = Stream(non_blocking=True, device=0)
    comm = Communicator(1, UniqueId(), 0, device=0, stream=stream)
    monkeypatch.delenv("PYNCCL_LOOPBACK_HANG")
    buf = DeviceBuffer(N, "float32", device=0)
    yield comm, buf
    comm.abort()
    buf.close()
    stream.close()


# ---- bug 1: captures of other threads -----------------------------------------------------------


def _capture_in_another_thread(seconds: float) -> tuple[bool, BaseException | None]:
    """Thread B captures on a stream of its own in global mode (torch.cuda.graph's default)
    for ``seconds``, with one captured copy; returns (captured, what the capture raised).
    On device 1: global mode forbids unsafe calls to every thread whatever its device, and
    cudaFree on device 0 would wait for the hung operation there."""
    out: dict[str, Any] = {}

    def capture() -> None:
        set_device(1)
        side = Stream(non_blocking=True)
        a, b = DeviceBuffer(N, "float32"), DeviceBuffer(N, "float32")
        g = Graph()
        try:
            with g.capture(side, "global"):
                library.cudart().cudaMemcpyAsync(b.ptr, a.ptr, 4 * N, 3, side.handle)
                time.sleep(seconds)
            out["captured"] = g.captured
        except BaseException as exc:
            out["error"] = exc
        finally:
            g.close()
            for x in (a, b):
                x.close()
            side.close()

    t = threading.Thread(target=capture)
    t.start()
    t.join(30)
    assert not t.is_alive()
    return bool(out.get("captured")), out.get("error")


def test_the_watchdog_leaves_another_threads_global_capture_intact(
    capture_modes: None, hung: tuple[Communicator, DeviceBuffer]
) -> None:
    comm, buf = hung
    comm.start_watchdog(60.0, interval=0.005)
    comm.all_reduce(buf)  # never completes: the watchdog queries its event at every look
    time.sleep(0.05)
    captured, error = _capture_in_another_thread(0.3)
    assert error is None and captured  # CUDA would have invalidated it (error 901 at the end)
    assert comm.state == "ready" and comm.error is None  # nor was the query read as a failure
    assert comm._watch is not None and comm._watch.running


def test_synchronize_waits_during_another_threads_global_capture(capture_modes: None) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32))
    result: dict[str, Any] = {}
    began, finish = threading.Event(), threading.Event()

    def capture() -> None:
        side = Stream(non_blocking=True)
        g = Graph()
        try:
            with g.capture(side, "global"):
                began.set()
                finish.wait(20)
            result["captured"] = g.captured
        except BaseException as exc:
            result["error"] = exc
        finally:
            g.close()
            side.close()

    t = threading.Thread(target=capture)
    t.start()
    try:
        assert began.wait(20)
        comm.all_reduce(x)
        comm.synchronize(timeout=30)  # refused before (or broke the capture, on CUDA)
    finally:
        finish.set()
        t.join(30)
    assert result == {"captured": True}
    assert np.array_equal(x.to_numpy(), np.arange(N, dtype=np.float32))
    comm.destroy()
    x.close()


# ---- bug 2: a call blocked inside NCCL holds the gate --------------------------------------------


def test_a_call_blocked_in_nccl_does_not_blind_the_watchdog(
    hung: tuple[Communicator, DeviceBuffer], monkeypatch: pytest.MonkeyPatch
) -> None:
    comm, buf = hung
    monkeypatch.setattr(type(comm), "GATE_TIMEOUT", 1.0)
    comm.start_watchdog(0.5, interval=0.02)
    comm.all_reduce(buf)  # operation #1: hangs on the stream
    release, entered = threading.Event(), threading.Event()
    real = comm._bfn[1]  # broadcast's slot (the watchdog's wrapper)

    def blocked(*args: Any) -> int:  # like a host call blocked inside NCCL (a full queue)
        entered.set()
        release.wait(30)
        return int(real(*args))

    comm._bfn[1] = blocked
    worker = threading.Thread(target=lambda: _swallow(lambda: comm.broadcast(buf)))
    worker.start()
    try:
        assert entered.wait(10)
        t0 = time.monotonic()
        # Before: the watchdog read the async error through the gate, timed out after
        # GATE_TIMEOUT and took that for "torn down": it vanished and nothing was aborted.
        assert wait_for(lambda: comm.state == "aborted", 8), "the watchdog did not abort"
        assert time.monotonic() - t0 < 8
        reason = comm.error
        assert isinstance(reason, NcclTimeoutError), reason
        assert "operation #1 did not complete within 0.5 s" in str(reason)
        assert "ncclAllReduce" in str(reason)
    finally:
        release.set()
        worker.join(30)


def _swallow(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:  # the blocked call meets the aborted communicator: expected
        pass


# ---- fuzz 5: the interval, and a thread that never dies silently --------------------------------


@pytest.mark.parametrize(
    ("interval", "error", "words"),
    [
        (0, ValueError, "interval=0 is out of range; expected a finite number > 0"),
        (-1, ValueError, "interval=-1 is out of range; expected a finite number > 0"),
        (math.nan, ValueError, "interval=nan is out of range"),
        (math.inf, ValueError, "interval=inf is out of range"),
        ("1", TypeError, "interval must be a number of seconds or None, got str '1'"),
        (True, TypeError, "interval must be a number of seconds or None, got bool True"),
        (object(), TypeError, "interval must be a number of seconds or None, got object"),
    ],
)
def test_start_watchdog_checks_the_interval(
    solo_comm: Communicator, interval: object, error: type, words: str
) -> None:
    before = len(_watchdog_threads())
    with pytest.raises(error) as info:
        solo_comm.start_watchdog(5.0, interval=interval)  # type: ignore[arg-type]
    assert words in str(info.value)
    assert solo_comm._watch is None and len(_watchdog_threads()) == before
    # the same wording as a timeout (check_timeout's)
    with pytest.raises(ValueError, match="watchdog timeout=0 is out of range"):
        solo_comm.start_watchdog(0)


def test_the_watchdog_thread_reports_an_unexpected_error_and_goes_on(
    hung: tuple[Communicator, DeviceBuffer], monkeypatch: pytest.MonkeyPatch
) -> None:
    comm, buf = hung
    real = Communicator.watch_status
    calls = [0]

    def flaky(self: Communicator) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected failure")
        return real(self)

    monkeypatch.setattr(Communicator, "watch_status", flaky)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        comm.start_watchdog(0.3, interval=0.02)
        comm.all_reduce(buf)  # hangs: the watchdog, still alive, must abort it
        assert wait_for(lambda: comm.state == "aborted", 10), "the watchdog died"
    texts = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert any("unexpected RuntimeError: injected failure" in t for t in texts), texts
    assert isinstance(comm.error, NcclTimeoutError)


# ---- fuzz 13: texts ------------------------------------------------------------------------------


def test_a_watchdog_error_and_its_record_are_separate_sentences(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", str(10**9))
    comm = Communicator(1, UniqueId(), 0, device=0, config=Config(blocking=False))
    try:
        comm.start_watchdog(0.2, interval=0.02)
        assert wait_for(lambda: comm.state == "aborted", 10)
        text = str(comm.error)
        assert "the watchdog aborted it. No operation issued yet on rank 0." in text, text
    finally:
        comm.abort()


def test_format_flight_record_checks_last(solo_comm: Communicator) -> None:
    x = DeviceBuffer(N, "float32", device=0)
    for _ in range(3):
        solo_comm.all_reduce(x)
    assert solo_comm.format_flight_record(last=2).startswith("Last 2 operations issued on rank 0/1")
    for bad, error, words in (
        (-1, ValueError, "last=-1 is out of range"),
        (True, TypeError, "last must be a non-negative int, got bool True"),
        (1.5, TypeError, "last must be a non-negative int, got float 1.5"),
        ("2", TypeError, "last must be a non-negative int, got str '2'"),
    ):
        with pytest.raises(error, match=words):
            solo_comm.format_flight_record(last=bad)  # type: ignore[arg-type]
    solo_comm.synchronize(timeout=30)
    x.close()


# ---- bug 8: devices ------------------------------------------------------------------------------


@pytest.fixture
def pair_on_two_devices() -> Iterator[list[Communicator]]:
    comms = Communicator.init_all([0, 1])
    set_device(0)
    yield comms
    for c in comms:
        c.abort()
    set_device(0)


def test_the_watchdog_watches_stream_0_on_the_communicators_device(
    pair_on_two_devices: list[Communicator],
) -> None:
    _, comm1 = pair_on_two_devices
    x = DeviceBuffer(N, "float32", device=1)
    set_device(0)  # the calling thread's device is not the communicator's
    comm1.start_watchdog(0.5, interval=0.02)
    comm1.all_reduce(x)  # on stream 0 of device 1 (NCCL's): rank 0 never joins, it hangs
    assert get_device() == 0
    # Before, its event went to device 0's legacy stream, where nothing waits: no abort.
    assert wait_for(lambda: comm1.state == "aborted", 8), "the hang went unseen"
    assert "ncclAllReduce" in str(comm1.error)
    x.close()


def test_watched_calls_on_two_devices_in_one_group(
    pair_on_two_devices: list[Communicator],
) -> None:
    comms = pair_on_two_devices
    streams = [Stream(device=d) for d in (0, 1)]
    data = [np.arange(N, dtype=np.float32) * (d + 1) for d in (0, 1)]
    bufs = [DeviceBuffer.from_numpy(data[d], device=d) for d in (0, 1)]
    for c in comms:
        c.start_watchdog(30.0)
    set_device(0)
    with group():  # one thread, current device 0: rank 1's event must be made on device 1
        for d in (0, 1):
            comms[d].all_reduce(bufs[d], stream=streams[d])
    assert get_device() == 0
    for d in (0, 1):
        comms[d].synchronize(streams[d], timeout=30)
        np.testing.assert_array_equal(bufs[d].to_numpy(), data[0] + data[1])
        assert comms[d].error is None and comms[d].state == "ready"
    for c in comms:
        c.destroy()
    for b in bufs:
        b.close()
    for s in streams:
        s.close()


def test_events_and_stream_waits_across_devices(lb: Any) -> None:
    set_device(0)
    s1 = Stream(device=1)
    e = Event(device=1, timing=False)
    assert e.device == 1 and get_device() == 0
    e.record(s1)  # an event of device 0 would be refused on a stream of device 1
    e.synchronize()
    s0 = Stream(device=0)
    src = DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32), device=1)
    dst = DeviceBuffer(N, "float32", device=1)
    library.cudart().cudaMemcpyAsync(dst.ptr, src.ptr, 4 * N, 3, s1.handle)
    s0.wait(s1)  # the event is made on s1's device
    s0.synchronize()
    np.testing.assert_array_equal(dst.to_numpy(), np.arange(N, dtype=np.float32))
    assert get_device() == 0
    for x in (e, src, dst, s0, s1):
        x.close()


# ---- bug 11: error 906 is not left behind --------------------------------------------------------


def test_a_refused_call_during_a_capture_leaves_no_cuda_error(solo_comm: Communicator) -> None:
    rt = library.cudart()
    blocking = Stream()  # its capture makes the legacy stream answer 906
    rt.raw("cudaGetLastError")()
    g = Graph()
    with g.capture(blocking, "global"):
        with pytest.raises(NcclInvalidUsage, match="cannot run while a stream"):
            solo_comm.split(0)  # asks cudaStreamIsCapturing(0)
        assert rt.raw("cudaGetLastError")() == 0
    g.close()
    blocking.close()
