"""Threads and one communicator: calls are serialized by the communicator's gate, a
destroy/abort from another thread never hands a destroyed handle to NCCL, a call stuck in
another thread is reported (NcclInvalidUsage) instead of waited on silently, and every
wait is bounded by its timeout, also while a non-blocking init is still in progress."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pynccl import NcclInvalidUsage, NcclTimeoutError
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer

N = 16


@pytest.fixture
def buffers(lb: Any) -> Iterator[tuple[DeviceBuffer, DeviceBuffer]]:
    a = DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32), device=0)
    b = DeviceBuffer(N, "float32", device=0)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("verb", ["destroy", "abort"])
def test_teardown_from_another_thread_mid_calls(buffers: Any, verb: str) -> None:
    a, b = buffers
    rng = random.Random(7)
    for _trial in range(25):
        comm = Communicator(1, UniqueId(), 0, device=0)
        errors: list[BaseException] = []
        issued = [0]
        started = threading.Event()

        def issue(
            comm: Communicator = comm,
            errors: list[BaseException] = errors,
            issued: list[int] = issued,
            started: threading.Event = started,
        ) -> None:
            started.set()
            try:
                while True:
                    comm.all_reduce(a, b)
                    comm.broadcast(a.ptr, b.ptr, count=N, dtype="float32")
                    issued[0] += 2
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=issue)
        worker.start()
        started.wait()
        time.sleep(rng.uniform(0, 0.003))
        getattr(comm, verb)()
        worker.join(30)
        assert not worker.is_alive(), "a call hung after the teardown"
        assert len(errors) == 1 and isinstance(errors[0], NcclInvalidUsage), errors
        assert "cannot be used any more" in str(errors[0])
        assert comm.state == ("destroyed" if verb == "destroy" else "aborted")


def test_two_threads_on_one_communicator_are_serialized(buffers: Any) -> None:
    a, b = buffers
    comm = Communicator(1, UniqueId(), 0, device=0)
    per_thread = 300
    errors: list[BaseException] = []

    def issue() -> None:
        try:
            for _ in range(per_thread):
                comm.all_reduce(a.ptr, b.ptr, count=N, dtype="float32")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=issue) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        record = comm.flight_record()
        assert record[-1][0] == 2 * per_thread  # every call numbered once, none lost
        assert [e[0] for e in record] == list(range(2 * per_thread - 63, 2 * per_thread + 1))
        comm.synchronize(timeout=60)
        assert np.array_equal(b.to_numpy(), np.arange(N, dtype=np.float32))
    finally:
        comm.destroy()


def test_a_call_stuck_in_another_thread_is_reported_not_waited_on(
    buffers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = buffers
    comm = Communicator(1, UniqueId(), 0, device=0)
    monkeypatch.setattr(type(comm), "GATE_TIMEOUT", 0.2)
    release = threading.Event()
    entered = threading.Event()
    real = comm._bfn[0]

    def stuck(*args: Any) -> int:  # an ncclAllReduce that does not return
        entered.set()
        release.wait(30)
        return int(real(*args))

    comm._bfn[0] = stuck
    late: list[BaseException] = []

    def issue() -> None:
        try:
            comm.all_reduce(a, b)
        except BaseException as exc:
            late.append(exc)

    worker = threading.Thread(target=issue)
    worker.start()
    assert entered.wait(10)
    try:
        t0 = time.monotonic()
        with pytest.raises(NcclInvalidUsage, match="in use by another thread"):
            comm.broadcast(a, b)
        assert time.monotonic() - t0 < 5
        with pytest.raises(NcclInvalidUsage, match="abort"):
            comm.destroy()  # refuses: the call in flight still holds the handle
        assert comm.state == "ready"
        comm.abort()  # proceeds: abort is what releases hung work
        assert comm.state == "aborted"
    finally:
        release.set()
        worker.join(30)
    # The stuck call had its handle before the abort (as a call inside NCCL would):
    # the loopback then reports the aborted communicator to it.
    assert len(late) == 1 and "invalid communicator" in str(late[0])
    with pytest.raises(NcclInvalidUsage, match="aborted"):
        comm.all_reduce(a, b)


def test_a_refused_destroy_leaves_the_communicator_usable(
    buffers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # destroy marks the communicator closing before it waits for the call in flight;
    # when it gives up, the mark is undone: calls work again and the gate has one token.
    a, b = buffers
    comm = Communicator(1, UniqueId(), 0, device=0)
    monkeypatch.setattr(type(comm), "GATE_TIMEOUT", 0.2)
    release, entered = threading.Event(), threading.Event()
    real = comm._bfn[0]

    def stuck(*args: Any) -> int:
        entered.set()
        release.wait(30)
        return int(real(*args))

    comm._bfn[0] = stuck
    worker = threading.Thread(target=comm.all_reduce, args=(a, b))
    worker.start()
    try:
        assert entered.wait(10)
        with pytest.raises(NcclInvalidUsage, match="abort"):
            comm.destroy()
        assert comm.state == "ready"
    finally:
        release.set()
        worker.join(30)
    comm._bfn[0] = real
    b.copy_from(np.zeros(N, np.float32))
    comm.all_reduce(a, b)
    comm.synchronize(timeout=30)
    assert np.array_equal(b.to_numpy(), np.arange(N, dtype=np.float32))
    assert comm._gate == [True]
    comm.destroy()
    assert comm.state == "destroyed"
    with pytest.raises(NcclInvalidUsage, match="destroyed; it cannot be used any more"):
        comm.all_reduce(a, b)


@pytest.fixture
def init_in_progress(lb: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Communicator]:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", str(10**9))
    comm = Communicator(1, UniqueId(), 0, device=0, config=Config(blocking=False))
    assert comm.state == "initializing"
    yield comm
    comm.abort()


def test_synchronize_timeout_bounds_a_non_blocking_init(init_in_progress: Communicator) -> None:
    t0 = time.monotonic()
    with pytest.raises(NcclTimeoutError, match="not ready after"):
        init_in_progress.synchronize(timeout=0.2)
    assert time.monotonic() - t0 < 5


def test_watchdog_bounds_a_non_blocking_init(init_in_progress: Communicator) -> None:
    comm = init_in_progress
    t0 = time.monotonic()
    comm.start_watchdog(0.3, interval=0.02)  # returns at once: init still in progress
    assert time.monotonic() - t0 < 1
    deadline = time.monotonic() + 10
    while comm.state != "aborted" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert comm.state == "aborted"
    assert isinstance(comm.error, NcclTimeoutError) and "not ready within" in str(comm.error)


def test_constructor_watchdog_does_not_wait_for_a_non_blocking_init(
    lb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", str(10**9))
    t0 = time.monotonic()
    comm = Communicator(
        1, UniqueId(), 0, device=0, config=Config(blocking=False), watchdog_timeout=0.3
    )
    assert time.monotonic() - t0 < 2
    deadline = time.monotonic() + 10
    while comm.state != "aborted" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert comm.state == "aborted" and isinstance(comm.error, NcclTimeoutError)
