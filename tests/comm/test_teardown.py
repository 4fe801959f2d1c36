"""Teardown that cannot hang, and a gate that serves callers in order (issue 20: bugs 3,
9 (graphs), 10; fuzz 3, 4; the revoke/shrink semantics of NCCL).

* ``destroy()`` with hung work: ``ncclCommDestroy`` waits for the outstanding operation
  for ever; with a watchdog the wait is bounded by its timeout, then the communicator is
  aborted, and a warning names the operation;
* after ``shrink(..., abort=True)`` the parent's ``destroy()`` aborts (from NCCL 2.31.2
  on its destroy waits in a barrier for the ranks that aborted, pytorch#194775): the
  other ranks see the abort as a remote error, as NCCL reports it;
* NCCL's destroy waits while a CUDA graph that captured the communicator exists: a
  ``destroy()`` under a live :class:`pynccl.cuda.Graph` that did is refused, naming it;
  the graph keeps the buffers it captured alive until it is closed;
* ``finalize(timeout=)`` bounds a non-blocking communicator still initialising;
* the gate is first come, first served: a thread calling in a loop does not starve
  another one;
* a revoked communicator may be split ("safe for destroy, split, and shrink"), and
  ``shrink([])`` is refused (NCCL returns ncclInvalidArgument for an empty list).
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.reference import small_ints
from support.worlds import ThreadWorld

from pynccl import NcclInvalidUsage, NcclTimeoutError
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer, Graph, Stream, set_device
from pynccl.enums import Result

N = 16


@pytest.fixture(autouse=True)
def _loopback(lb: Any) -> None:
    """Every test of this module runs on the default loopback (NCCL 2.32)."""


def data(rank: int) -> np.ndarray:
    return small_ints(11, rank, N)


# ---- bug 3: destroy with hung work ------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[list[Communicator]]:
    """Two communicators of one world (devices 0 and 1) driven from this thread."""
    comms = Communicator.init_all([0, 1])
    yield comms
    for c in comms:
        c.abort()
    set_device(0)


def test_destroy_with_hung_work_is_bounded_by_the_watchdog(pair: list[Communicator]) -> None:
    comm0, comm1 = pair
    x = DeviceBuffer(N, "float32", device=1)
    comm1.start_watchdog(1.0, interval=0.05)
    comm1.all_reduce(x)  # rank 0 never joins: it hangs
    time.sleep(0.2)
    # Before, destroy waited for it for ever (here: until the peer's abort, 15 s later).
    safety = threading.Timer(15, comm0.abort)
    safety.start()
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            comm1.destroy()
        elapsed = time.monotonic() - t0
    finally:
        safety.cancel()
    assert elapsed < 8, f"destroy took {elapsed:.1f} s"
    assert comm1.state == "aborted"
    texts = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1, texts
    assert "operation #1 (ncclAllReduce) did not complete within the watchdog's 1 s" in texts[0]
    assert "aborted instead of destroyed" in texts[0]
    assert isinstance(comm1.error, NcclTimeoutError)
    # the abort reached the peer, as NCCL reports it (a destroy would leave it unaware)
    assert comm0.get_async_error() == Result.REMOTE_ERROR
    x.close()


# ---- bug 10 (a): destroy after an abortive shrink -----------------------------------------------


def test_destroy_after_an_abortive_shrink_aborts_the_parent() -> None:
    w = ThreadWorld(3)
    w.broken = True  # rank 2's communicator ends aborted

    def run(r: int, comm: Communicator) -> Any:
        if r == 2:  # the rank the others leave out
            return None
        child = comm.shrink([2], abort=True)
        try:
            buf = DeviceBuffer.from_numpy(data(r), device=r)
            child.all_reduce(buf)
            child.synchronize(timeout=30)
            got = buf.to_numpy()
            buf.close()
        finally:
            child.destroy()
        comm.destroy()  # NCCL >= 2.31.2 would wait here for rank 2: it aborts instead
        return got, str(comm.state)

    try:
        out = w.run(run)
        for r in (0, 1):
            got, state = out[r]
            np.testing.assert_array_equal(got, data(0) + data(1))
            assert state == "aborted"
        # ncclCommAbort, not ncclCommDestroy, retired the parents: rank 2 learns of it
        assert w.comms[2].get_async_error() == Result.REMOTE_ERROR
    finally:
        w.close()


# ---- bug 10 (b) and 9: graphs ------------------------------------------------------------------


@pytest.fixture
def comm() -> Iterator[Communicator]:
    """A one-rank communicator on device 0. The tests end it themselves (its destroy is
    what they check); one that a failure left alive is aborted (a graph may still hold it)."""
    comm = Communicator(1, UniqueId(), 0, device=0)
    yield comm
    if comm.state != "destroyed":
        comm.abort()


@pytest.fixture
def stream() -> Iterator[Stream]:
    """A non-blocking stream to capture on, closed after the test."""
    stream = Stream(non_blocking=True)
    yield stream
    stream.close()


def test_destroy_is_refused_while_a_graph_that_captured_it_lives(
    comm: Communicator, stream: Stream
) -> None:
    other = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32))
    g = Graph()
    with g.capture(stream):
        comm.all_reduce(x, stream=stream)
    other.destroy()  # a graph that did not capture it is no reason to refuse
    assert other.state == "destroyed"
    with pytest.raises(NcclInvalidUsage) as info:
        comm.destroy()  # NCCL's destroy would wait until the graph is destroyed
    text = str(info.value)
    assert repr(g) in text and "close them first (Graph.close()), or abort()" in text
    assert comm.state == "ready"  # untouched: the graph still replays
    g.replay()
    comm.synchronize(stream, timeout=30)
    np.testing.assert_array_equal(x.to_numpy(), np.arange(N, dtype=np.float32))
    g.close()
    comm.destroy()
    assert comm.state == "destroyed"
    x.close()


def test_a_graph_keeps_what_it_captured_until_closed(comm: Communicator, stream: Stream) -> None:
    y = DeviceBuffer(N, "float32")
    x = DeviceBuffer.from_numpy(data(0))
    kept = weakref.ref(x)
    g = Graph()
    with g.capture(stream):
        comm.all_reduce(x, y, stream=stream)
    del x
    gc.collect()
    assert kept() is not None  # the replay reads it: freed memory before
    for _ in range(2):
        g.replay()
    comm.synchronize(stream, timeout=30)
    np.testing.assert_array_equal(y.to_numpy(), data(0))
    g.close()
    gc.collect()
    assert kept() is None  # let go with the graph
    assert comm._bfn[0] is not None  # and the calls take their fast paths again
    comm.destroy()
    y.close()


def test_a_failed_capture_tracks_nothing(comm: Communicator, stream: Stream) -> None:
    x = DeviceBuffer(N, "float32")
    g = Graph()
    with pytest.raises(RuntimeError, match="body failed"), g.capture(stream):
        comm.all_reduce(x, stream=stream)
        raise RuntimeError("body failed")
    assert not g.captured
    comm.destroy()  # nothing live captured it
    assert comm.state == "destroyed"
    x.close()


# ---- fuzz 4: finalize(timeout=) ------------------------------------------------------------------


def test_finalize_timeout_bounds_a_non_blocking_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", str(10**9))  # never ready
    comm = Communicator(1, UniqueId(), 0, device=0, config=Config(blocking=False))
    result: list[BaseException] = []

    def finalize() -> None:
        try:
            comm.finalize(timeout=0.5)
        except BaseException as exc:
            result.append(exc)

    t = threading.Thread(target=finalize, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(8)
    try:
        assert not t.is_alive(), "finalize(timeout=0.5) did not return"  # it waited for ever
        assert time.monotonic() - t0 < 8
        assert len(result) == 1 and isinstance(result[0], NcclTimeoutError), result
        assert "not ready after 0.5 s" in str(result[0])
    finally:
        comm.abort()  # also what releases the old code's wait
        t.join(30)


# ---- fuzz 3: a fair gate -------------------------------------------------------------------------


def test_a_thread_calling_in_a_loop_does_not_starve_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    monkeypatch.setattr(type(comm), "GATE_TIMEOUT", 2.0)
    a = DeviceBuffer(1, "float32")
    b = DeviceBuffer(1, "float32")
    done = threading.Event()
    looped = [0]

    def loop() -> None:
        while not done.is_set():
            comm.all_reduce(a.ptr, a.ptr, count=1, dtype="float32")
            looped[0] += 1

    looper = threading.Thread(target=loop)
    looper.start()
    waits: list[float] = []
    errors: list[BaseException] = []
    try:
        while looped[0] < 100:  # the loop holds the gate most of the time by now
            time.sleep(0.001)
        for _ in range(20):
            t0 = time.monotonic()
            try:
                comm.broadcast(b.ptr, b.ptr, count=1, dtype="float32")
            except NcclInvalidUsage as exc:  # "in use by another thread" before
                errors.append(exc)
            waits.append(time.monotonic() - t0)
    finally:
        done.set()
        looper.join(30)
    assert errors == [], f"{len(errors)} of 20 calls starved: {errors[0]}"
    assert max(waits) < 1.5, waits
    comm.synchronize(timeout=60)
    assert comm._gate is comm._tokens and comm._tokens == [True]  # back to the fast path
    comm.destroy()
    a.close()
    b.close()


# ---- revoke / shrink semantics ------------------------------------------------------------------


def test_a_revoked_communicator_may_be_split() -> None:
    w = ThreadWorld(2)
    w.broken = True

    def run(r: int, comm: Communicator) -> Any:
        comm.revoke()
        try:
            child = comm.split(0)
        except NcclInvalidUsage as exc:
            # pynccl passes it on (it refused it itself before); a loopback libnccl older
            # than NCCL's rule may still refuse it: then the refusal is the library's.
            assert exc.function == "ncclCommSplit" and "revoked" in str(exc), str(exc)
            return "refused by the library"
        assert child is not None
        try:
            buf = DeviceBuffer.from_numpy(data(r), device=r)
            stream = Stream(device=r)
            child.all_reduce(buf, stream=stream)
            child.synchronize(stream, timeout=30)
            got = buf.to_numpy()
            buf.close()
            stream.close()
        finally:
            child.destroy()
        np.testing.assert_array_equal(got, data(0) + data(1))
        return child.size

    try:
        out = w.run(run)
    finally:
        w.close()
    assert out in ({0: 2, 1: 2}, {0: "refused by the library", 1: "refused by the library"})


def test_shrink_with_an_empty_exclusion_list_is_refused(solo_comm: Communicator) -> None:
    for empty in ([], ()):
        with pytest.raises(ValueError, match="exclude must name at least one rank"):
            solo_comm.shrink(empty)  # type: ignore[arg-type]
    assert solo_comm.state == "ready"  # refused before any C call


def test_a_graph_tracks_and_keeps_a_persistent_operation(
    comm: Communicator, stream: Stream
) -> None:
    x = DeviceBuffer.from_numpy(data(0))
    y = DeviceBuffer(N, "float32")
    op = comm.all_reduce_init(x, y, stream=stream)
    g = Graph()
    with g.capture(stream):
        op()  # the prebuilt call: it tells the graph too
    op.close()  # while the graph lives, what it replays stays alive
    del x
    gc.collect()
    with pytest.raises(NcclInvalidUsage, match="live CUDA graph"):
        comm.destroy()
    g.replay()
    comm.synchronize(stream, timeout=30)
    np.testing.assert_array_equal(y.to_numpy(), data(0))
    g.close()
    comm.destroy()
    y.close()
