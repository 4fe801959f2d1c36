"""The object API on the loopback libraries, asynchronous progress: non-blocking init,
the flight recorder, synchronize with a timeout, asynchronous errors and the watchdog,
and that nothing (threads, mappings) outlives the communicators.

Results are checked against numpy; bounds are generous.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from support.comm import to_device
from support.suite import Spec, check
from support.wait import wait_for
from support.worlds import ThreadWorld

from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer
from pynccl.enums import DataType, RedOp, Result
from pynccl.errors import NcclError, NcclInvalidUsage, NcclSystemError, NcclTimeoutError

pytestmark = pytest.mark.usefixtures("lb")


def _no_thread_named(prefix: str) -> bool:
    return not any(t.name.startswith(prefix) for t in threading.enumerate())


# --- non-blocking ---------------------------------------------------------------------------------


def test_non_blocking_init_becomes_ready(lb: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", "5")
    world = ThreadWorld(2, config=Config(blocking=False))
    try:
        states = world.run(lambda r, c: (c.state, c.get_async_error()))
        for state, result in states.values():
            assert state == "initializing" and result == Result.IN_PROGRESS
        world.run(lambda r, c: c.wait_ready(timeout=30))
        assert all(c.state == "ready" for c in world.comms.values())
        check(world, Spec("all_reduce", "float32", count=9))
        check(world, Spec("send_recv", "int8", count=4, root=1))
    finally:
        world.close()


def test_non_blocking_communicator_waits_by_itself_before_a_call(
    lb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", "3")
    world = ThreadWorld(2, config=Config(blocking=False))
    try:
        check(world, Spec("all_gather", "float32", count=3))  # no wait_ready first
    finally:
        world.close()


def test_wait_ready_times_out(lb: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", str(10**9))
    comm = Communicator(1, UniqueId(), 0, device=0, config=Config(blocking=False))
    try:
        assert comm.state == "initializing"
        with pytest.raises(NcclTimeoutError, match=r"not ready after 0\.05 s"):
            comm.wait_ready(timeout=0.05)
        assert comm.state == "initializing"
    finally:
        comm.abort()
    assert comm.state == "aborted"


# --- flight recorder, synchronize, watchdog -------------------------------------------------------


def test_flight_record_lists_the_operations(solo_comm: Communicator) -> None:
    assert solo_comm.flight_record() == [] and solo_comm.last_operation() == "none"
    assert "No operation issued yet" in solo_comm.format_flight_record()
    with to_device(np.zeros(10)) as b, to_device(np.zeros(10), np.int64) as c:
        solo_comm.all_reduce(b)
        solo_comm.broadcast(c, root=0, count=3)
        solo_comm.reduce(b.ptr, count=7, dtype="float32", op="max")
        solo_comm.synchronize()
    names = [(e[0], e[1], e[2]) for e in solo_comm.flight_record()]
    assert names == [(1, "ncclAllReduce", -1), (2, "ncclBroadcast", 0), (3, "ncclReduce", 0)]
    text = solo_comm.format_flight_record()
    assert "Last 3 operations issued on rank 0/1" in text
    # Numbered from #1 (as the loopback's mismatch report counts), with op and root.
    assert "#1 ncclAllReduce count=10 dtype=ncclFloat32 op=sum" in text
    assert "#2 ncclBroadcast count=3 dtype=ncclInt64 root=0" in text
    assert solo_comm.last_operation().startswith(
        "#3 ncclReduce count=7 dtype=ncclFloat32 op=max root=0"
    )


def test_flight_record_keeps_the_last_64(solo_comm: Communicator) -> None:
    with to_device([1.0]) as b:
        for _ in range(70):
            solo_comm.all_reduce(b)
        solo_comm.synchronize()
    record = solo_comm.flight_record()
    assert [e[0] for e in record] == list(range(7, 71))


def test_count_arguments_cache_stays_bounded_and_exact(
    solo_comm: Communicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # all_reduce hands ctypes cached count arguments: the cache must stay bounded, and
    # every count (cached, fresh, 0) must reach C exactly.
    from pynccl._capi import _binding as comm_module  # the one shared cache

    saved = dict(comm_module.COUNT_ARGS)
    comm_module.COUNT_ARGS.clear()  # the fast path holds this dict itself
    monkeypatch.setattr(comm_module, "COUNT_ARGS_LIMIT", 8)
    data = np.arange(40, dtype=np.float32)
    with to_device(data) as src, to_device(np.zeros(40, np.float32)) as dst:
        for count in [*range(20), 3, 19, 0]:
            dst.copy_from(np.full(40, -1, np.float32))
            solo_comm.all_reduce(src.ptr, dst.ptr, count=count, dtype="float32")
            solo_comm.synchronize()
            got = dst.to_numpy()
            assert np.array_equal(got[:count], data[:count]) and (got[count:] == -1).all()
    try:
        assert len(comm_module.COUNT_ARGS) == 8
        cache = comm_module.COUNT_ARGS.items()
        assert all(type(k) is int and comm_module.arg_value(v) == k for k, v in cache)
    finally:
        comm_module.COUNT_ARGS.clear()
        comm_module.COUNT_ARGS.update(saved)


def test_flight_record_wraps_with_mixed_operations(solo_comm: Communicator) -> None:
    # The inline raw-pointer path and the slow path store the same entry: both must read
    # back with the right sequence numbers (from #1) once the ring has wrapped.
    with to_device(np.zeros(71)) as b:
        for i in range(1, 71):
            if i % 3:
                solo_comm.all_reduce(b.ptr, count=i, dtype="float32", op="max")
            else:
                solo_comm.broadcast(b, root=0, count=i)
        solo_comm.synchronize()
    record = solo_comm.flight_record()
    assert [e[0] for e in record] == list(range(7, 71))
    for seq, name, where, args in record:
        if seq % 3:
            assert (name, where, args[2], args[4]) == ("ncclAllReduce", -1, seq, int(RedOp.MAX))
        else:
            assert (name, where, args[2]) == ("ncclBroadcast", 0, seq)
    assert solo_comm.describe(69) == "ncclBroadcast" and solo_comm.describe(68) == "ncclAllReduce"
    assert solo_comm.describe(6) == "operation"  # overwritten
    assert solo_comm.describe(71) == "operation"  # not issued yet
    assert solo_comm.last_operation().startswith(
        "#70 ncclAllReduce count=70 dtype=ncclFloat32 op=max"
    )


def test_synchronize_times_out_on_a_hung_operation(
    lb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "2")  # the second operation never ends
    comm = Communicator(1, UniqueId(), 0, device=0)
    with to_device(np.zeros(5)) as b:
        comm.all_reduce(b)
        comm.synchronize(timeout=30)
        comm.broadcast(b, count=4)
        with pytest.raises(NcclTimeoutError) as info:
            comm.synchronize(timeout=0.2)
        text = str(info.value)
        assert "did not finish within 0.2 s" in text
        assert "Last operation issued: #2 ncclBroadcast count=4" in text
        assert "#1 ncclAllReduce count=5" in text  # and the flight record
        assert comm.state == "aborted"
        with pytest.raises(NcclInvalidUsage, match="aborted"):
            comm.all_reduce(b)


def test_synchronize_raises_the_asynchronous_error(
    lb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER", "1")  # the 2nd operation fails
    comm = Communicator(1, UniqueId(), 0, device=0)
    try:
        with to_device(np.zeros(5)) as b:
            comm.all_reduce(b)
            comm.all_reduce(b)
            with pytest.raises(NcclSystemError) as info:
                comm.synchronize(timeout=30)
                comm.all_reduce(b)
                comm.synchronize(timeout=30)
            assert "ncclAllReduce" in str(info.value)
            assert comm.get_async_error() == Result.SYSTEM_ERROR
            with pytest.raises(NcclSystemError):
                comm.check()
    finally:
        comm.abort()


def test_watchdog_aborts_a_hung_communicator(lb: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "1")
    comm = Communicator(1, UniqueId(), 0, device=0, watchdog_timeout=0.2)
    with to_device(np.zeros(3)) as b:
        comm.all_gather(b, b, count=1)
        assert wait_for(lambda: comm.state == "aborted", 20), "the watchdog did not abort"
        reason = comm.error
        assert isinstance(reason, NcclTimeoutError)
        assert "ncclAllGather" in str(reason) and "watchdog aborted" in str(reason)
        with pytest.raises(NcclTimeoutError):
            comm.all_reduce(b)
    assert wait_for(lambda: _no_thread_named("pynccl-watchdog"), 20)
    comm.destroy()  # already aborted: a no-op


def test_watchdog_aborts_on_an_asynchronous_error(lb: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # From the first operation on, the async error is ncclInternalError (3).
    monkeypatch.setenv("PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER", "0:3")
    comm = Communicator(1, UniqueId(), 0, device=0)
    comm.start_watchdog(30.0, interval=0.01)
    with pytest.raises(NcclInvalidUsage, match="already running"):
        comm.start_watchdog(30.0)
    with to_device(np.zeros(3)) as b:
        comm.all_reduce(b)
        assert wait_for(lambda: comm.state == "aborted", 20)
        assert isinstance(comm.error, NcclError)
        assert comm.error.result == Result.INTERNAL_ERROR
        assert "ncclAllReduce" in str(comm.error)
    assert wait_for(lambda: _no_thread_named("pynccl-watchdog"), 20)


def test_watchdog_stops_with_the_communicator(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0, watchdog_timeout=30.0)
    with to_device(np.ones(4)) as b:
        for _ in range(5):
            comm.all_reduce(b, op="prod")
        comm.synchronize()
        assert b.to_numpy().tolist() == [1.0] * 4
    comm.destroy()
    assert _no_thread_named("pynccl-watchdog")


def test_a_peer_abort_is_a_remote_error(lb: Any) -> None:
    from pynccl.errors import NcclRemoteError

    world = ThreadWorld(2)
    world.broken = True  # its communicators end aborted

    def one(r: int, comm: Communicator) -> str:
        if r == 1:
            time.sleep(0.1)  # rank 0 is waiting in its all_reduce by now (or soon)
            comm.abort()
            return "aborted"
        with to_device([1.0, 2.0]) as b, pytest.raises(NcclRemoteError) as info:
            comm.all_reduce(b)  # refused at once if the peer has already aborted
            comm.synchronize(timeout=30)
        return str(info.value)

    try:
        out = world.run(one)
    finally:
        world.close()
    assert out[1] == "aborted"
    assert "ncclAllReduce" in out[0]  # the flight record says what was waiting


def _mapped_worlds() -> int:
    with open("/proc/self/maps") as maps:
        return sum("pynccl-lb-" in line for line in maps)


def test_nothing_outlives_the_communicators(lb: Any) -> None:
    maps_before = _mapped_worlds()
    threads_before = {t.ident for t in threading.enumerate()}
    world = ThreadWorld(3)
    children = world.run(lambda r, c: c.split(0 if r else None))
    world.run(lambda r, c: c.start_watchdog(30.0))
    group_comms = Communicator.init_all(2)
    assert _mapped_worlds() > maps_before
    world.run(lambda r, c: children[r] and children[r].destroy())
    for comm in group_comms:
        comm.destroy()
    world.close()
    assert _mapped_worlds() == maps_before
    assert wait_for(lambda: {t.ident for t in threading.enumerate()} <= threads_before, 20)


def test_device_is_known_without_device_argument_and_checked(lb: Any) -> None:
    # Made on a thread whose current device is 2: NCCL takes that device, and a buffer
    # that says it lives on device 1 is refused before any C call.
    from pynccl.cuda import get_device, set_device

    class OnDevice1:  # a CuPy-style device array: .device.id
        class device:
            id = 1

        def __init__(self, ptr: int, n: int) -> None:
            self.__cuda_array_interface__ = {
                "shape": (n,), "typestr": "<f4", "data": (ptr, False), "version": 3,
            }  # fmt: skip

    previous = get_device()
    set_device(2)
    try:
        comm = Communicator(1, UniqueId(), 0)
    finally:
        set_device(previous)
    try:
        with DeviceBuffer(8, DataType.FLOAT32, device=2) as good:
            bad = OnDevice1(good.ptr, 8)  # checked before anything asked for comm.device
            with pytest.raises(ValueError, match="on device 1 but the communicator is on device 2"):
                comm.all_reduce(bad)
            comm.all_reduce(good)
            comm.synchronize()
        assert comm.device == 2
    finally:
        comm.destroy()
