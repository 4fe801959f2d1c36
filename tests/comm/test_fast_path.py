"""The collectives' one fast path (``Collectives._call``): what it resolves by value (raw
pointers made afresh, names, numpy dtypes, arrays read by their type's handler) and what it
must leave to the checked path. These tests pin what must not change because of it:
results (against numpy), the flight record, a changed default stream, the watchdog,
teardown, calls with equal values of other types, and what stays alive (interfaces read
afresh: ``test_fast_path_cai.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.cai_cases import interface
from support.comm import takes_fast_path
from support.worlds import ThreadWorld

from pynccl import DataType, NcclInvalidUsage
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer, Stream
from pynccl.groups import release_done

pytestmark = pytest.mark.usefixtures("lb")

F32 = DataType.FLOAT32
N = 64


def _repeat(calls: Any, recv_n: int) -> list[list[np.ndarray]]:
    """Four steps on two ranks of ``calls(comm, send, recv)`` (two calls, the same objects
    each step), each step's send filled with ``10 * step + rank``: what recv held after
    each call."""
    with ThreadWorld(2) as world:

        def one(r: int, comm: Communicator) -> list[np.ndarray]:
            send = DeviceBuffer(N, F32, device=r)
            recv = DeviceBuffer(recv_n, F32, device=r)
            got = []
            issue = calls(comm, send, recv)
            for step in range(4):
                send.copy_from(np.full(N, 10 * step + r, np.float32))
                for call in issue:
                    call()
                    comm.synchronize()
                    got.append(recv.to_numpy().copy())
            send.close()
            recv.close()
            return got

        return world.run(one)


def test_repeated_calls_with_the_same_objects_compute_each_time() -> None:
    def raw(comm: Communicator, send: DeviceBuffer, recv: DeviceBuffer) -> list[Any]:
        sp, rp, n = send.ptr, recv.ptr, N  # the same int objects on every call
        return [
            lambda: comm.all_reduce(sp, rp, count=n, dtype=F32),
            lambda: comm.all_gather(sp, rp, count=n, dtype=F32),
        ]

    results = _repeat(raw, 2 * N)
    for r in range(2):
        for step in range(4):
            a = [np.full(N, 10 * step + k, np.float32) for k in range(2)]
            np.testing.assert_array_equal(results[r][2 * step][:N], a[0] + a[1])
            np.testing.assert_array_equal(results[r][2 * step + 1], np.concatenate(a))


def test_fast_calls_are_recorded_like_other_calls(solo_comm: Any, new_buffers: Any) -> None:
    comm = solo_comm
    sp, rp = new_buffers(N).ptr, new_buffers(N).ptr
    for _ in range(3):
        comm.broadcast(sp, rp, root=0, count=N, dtype=F32)
    records = comm.flight_record()[-3:]
    seqs = [r[0] for r in records]
    assert seqs == [comm._seq - 2, comm._seq - 1, comm._seq]
    # (seq, function, root, (send, recv, count, dtype, root, comm, stream))
    assert {(r[1], r[2], r[3]) for r in records} == {
        ("ncclBroadcast", 0, (sp, rp, N, int(F32), 0, comm.handle, 0))
    }


def test_a_new_default_stream_is_used_by_the_next_identical_call(
    solo_comm: Any, new_buffers: Any
) -> None:
    comm = solo_comm
    ptr = new_buffers(N).ptr
    s = Stream()
    try:
        comm.all_reduce(ptr, count=N, dtype=F32)
        comm.all_reduce(ptr, count=N, dtype=F32)  # a hit
        assert comm.flight_record()[-1][3][-1] == 0
        comm.stream = s
        comm.all_reduce(ptr, count=N, dtype=F32)
        comm.all_reduce(ptr, count=N, dtype=F32)
        assert comm.flight_record()[-1][3][-1] == s.handle
        assert comm.flight_record()[-2][3][-1] == s.handle
    finally:
        comm.stream = None
        s.close()


def test_the_watchdog_sees_fast_calls_and_calls_given_a_stream(
    solo_comm: Any, new_buffers: Any
) -> None:
    comm = solo_comm
    a = new_buffers(N)
    s = Stream()
    try:
        ptr = a.ptr
        comm.all_reduce(ptr, count=N, dtype=F32)
        comm.all_reduce(ptr, count=N, dtype=F32)
        comm.start_watchdog(30.0, interval=0.01)
        watch = comm._watch
        assert watch is not None
        calls: list[tuple[int, int]] = []
        real = watch.enqueued
        watch.enqueued = lambda seq, stream: (calls.append((seq, stream)), real(seq, stream))  # type: ignore[method-assign]
        comm.all_reduce(ptr, count=N, dtype=F32)
        comm.all_reduce(ptr, count=N, dtype=F32)
        assert calls == [(comm._seq - 1, 0), (comm._seq, 0)]
        comm.all_reduce(a, stream=s)  # the inline paths given a stream (test_stream_arg.py)
        comm.all_reduce(ptr, count=N, dtype=F32, stream=s.handle)
        assert calls[2:] == [(comm._seq - 1, s.handle), (comm._seq, s.handle)]
        comm.stop_watchdog()
        comm.all_reduce(ptr, count=N, dtype=F32)
        assert len(calls) == 4
        comm.synchronize(timeout=60)
        s.synchronize()
    finally:
        comm.stop_watchdog()
        s.close()


def test_after_destroy_the_same_objects_are_refused(solo_comm: Any, new_buffers: Any) -> None:
    comm = solo_comm
    ptr = new_buffers(N).ptr
    comm.all_reduce(ptr, count=N, dtype=F32)
    comm.all_reduce(ptr, count=N, dtype=F32)
    comm.destroy()
    with pytest.raises(NcclInvalidUsage, match="destroyed"):
        comm.all_reduce(ptr, count=N, dtype=F32)


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"count": float(N)}, TypeError),
        ({"count": True}, TypeError),
        ({"dtype": "float32x"}, (TypeError, ValueError)),
        ({"count": -1}, ValueError),
    ],
)
def test_a_fast_call_does_not_let_an_equal_mistake_through(
    bad: dict[str, Any], error: Any, solo_comm: Any, new_buffers: Any
) -> None:
    comm = solo_comm
    ptr = new_buffers(N).ptr
    comm.all_reduce(ptr, count=N, dtype=F32)
    comm.all_reduce(ptr, count=N, dtype=F32)
    kwargs: dict[str, Any] = {"count": N, "dtype": F32, **bad}
    with pytest.raises(error):
        comm.all_reduce(ptr, **kwargs)
    with pytest.raises(TypeError):
        comm.all_reduce(float(ptr), count=N, dtype=F32)


def test_equal_values_made_afresh_take_the_fast_path_and_no_other_equal_value_does(
    solo_comm: Any, new_buffers: Any
) -> None:
    # Pointers and counts come as new int objects at every call (t.data_ptr(), t.numel()),
    # dtypes as names or numpy objects: the fast path resolves them by value; a bool, a
    # float or a numpy number of an equal value is checked in full (and refused).
    comm = solo_comm
    x = np.arange(1, N + 1, dtype=np.float32)
    buf = new_buffers(x)
    ptr = buf.ptr
    comm.all_reduce(ptr, count=N, dtype=F32)
    comm.all_reduce(ptr, count=N, dtype=F32)
    assert takes_fast_path(lambda: comm.all_reduce(ptr + 0, count=N + 0, dtype=F32))
    assert takes_fast_path(lambda: comm.all_reduce(ptr + 0, count=N + 0, dtype="float32"))
    assert takes_fast_path(lambda: comm.all_reduce(ptr, count=N, dtype=np.float32, op="sum"))
    assert takes_fast_path(lambda: comm.all_reduce(ptr, count=N, dtype=np.dtype("float32")))
    comm.synchronize()
    np.testing.assert_array_equal(buf.to_numpy(), x)
    comm.all_reduce(ptr, count=1, dtype=F32)
    comm.all_reduce(ptr, count=1, dtype=F32)
    for count in (True, 1.0):
        with pytest.raises(TypeError, match=f"count must be a non-negative int, got "
                           f"{type(count).__name__}"):  # fmt: skip
            comm.all_reduce(ptr, count=count, dtype=F32)
    with pytest.raises(TypeError, match="got float"):
        comm.all_reduce(float(ptr), count=1, dtype=F32)
    with pytest.raises(TypeError, match=r"got numpy\.int64"):
        comm.all_reduce(np.int64(ptr), count=1, dtype=F32)
    comm.all_reduce(ptr, count=np.int64(1), dtype=F32)  # a count may be any integer
    assert comm.flight_record()[-1][3][2] == 1
    # The int 7 is FLOAT32's value (accepted, checked); equal values of other types are not.
    assert not takes_fast_path(lambda: comm.all_reduce(ptr, count=1, dtype=7))
    for dtype in (7.0, True, np.float64(7.0), np.int64(7)):
        with pytest.raises(TypeError, match="data type"):
            comm.all_reduce(ptr, count=1, dtype=dtype)
    for op in (0.0, False):  # equal to SUM's value
        with pytest.raises((TypeError, ValueError), match="op"):
            comm.all_reduce(ptr, count=1, dtype=F32, op=op)
    comm.synchronize()


# -- arrays --------------------------------------------------------------------------------


def test_repeated_devicebuffer_calls_compute_each_time() -> None:
    def bufs(comm: Communicator, send: DeviceBuffer, recv: DeviceBuffer) -> list[Any]:
        return [
            lambda: comm.all_reduce(send, recv, "max"),
            lambda: comm.broadcast(send, recv, root=1),
        ]

    results = _repeat(bufs, N)
    for r in range(2):
        for step in range(4):
            np.testing.assert_array_equal(results[r][2 * step], np.full(N, 10 * step + 1))
            np.testing.assert_array_equal(results[r][2 * step + 1], np.full(N, 10 * step + 1))


def _pair(kind: str, new_buffers: Any) -> tuple[Any, Any]:
    """Two arrays of ``kind``: DeviceBuffers (freed when collected), or objects keeping an
    interface of one buffer of ``new_buffers``."""
    if kind == "DeviceBuffer":
        return DeviceBuffer(N, F32), DeviceBuffer(N, F32)
    buf = new_buffers(N)
    cls = type("Kept", (), {})
    pair = cls(), cls()
    for x in pair:
        x.__cuda_array_interface__ = interface(buf)
    return pair


@pytest.mark.parametrize("kind", ["DeviceBuffer", "interface"])
def test_the_fast_path_keeps_no_array_alive(kind: str, solo_comm: Any, new_buffers: Any) -> None:
    import gc
    import weakref

    comm = solo_comm
    a, b = _pair(kind, new_buffers)
    for _ in range(2):
        comm.all_reduce(a, b)
    assert takes_fast_path(comm.all_reduce, a, b)
    refs = weakref.ref(a), weakref.ref(b)
    del a, b
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


def test_a_closed_or_replaced_buffer_is_checked_again(solo_comm: Any, new_buffers: Any) -> None:
    comm = solo_comm
    fresh = Communicator(1, UniqueId(), 0, device=0)  # never saw these buffers
    a, b = new_buffers(N), new_buffers(N)
    try:
        comm.all_reduce(a, b)
        comm.all_reduce(a, b)
        b.close()
        with pytest.raises(ValueError) as hit:
            comm.all_reduce(a, b)
        with pytest.raises(ValueError) as cold:
            fresh.all_reduce(a, b)
        assert str(hit.value) == str(cold.value) and "freed" in str(hit.value)
        # A smaller buffer (perhaps at the freed address): the size is checked afresh.
        small = new_buffers(N // 2)
        with pytest.raises(ValueError, match="elements"):
            comm.all_reduce(a, small)
    finally:
        fresh.destroy()


@pytest.mark.parametrize("kind", ["DeviceBuffer", "interface"])
def test_fast_array_calls_are_recorded_and_follow_the_stream(
    kind: str, solo_comm: Any, new_buffers: Any
) -> None:
    comm = solo_comm
    s = Stream()
    try:
        a, b = _pair(kind, new_buffers)
        comm.reduce(a, b, root=0)
        assert takes_fast_path(comm.reduce, a, b, root=0)
        comm.reduce(a, b, root=0)
        records = comm.flight_record()[-3:]
        assert [r[0] for r in records] == [comm._seq - 2, comm._seq - 1, comm._seq]
        # (seq, function, root, (send, recv, count, dtype, op, root, comm, stream))
        if kind == "DeviceBuffer":
            ptrs = (a.ptr, b.ptr)
        else:
            ptrs = (a.__cuda_array_interface__["data"][0],) * 2
        n = N if kind == "DeviceBuffer" else a.__cuda_array_interface__["shape"][0]
        assert {(r[1], r[2], r[3]) for r in records} == {
            ("ncclReduce", 0, (*ptrs, n, int(F32), 0, 0, comm.handle, 0))
        }
        comm.stream = s
        comm.reduce(a, b, root=0)
        comm.reduce(a, b, root=0)
        assert [r[3][-1] for r in comm.flight_record()[-2:]] == [s.handle, s.handle]
    finally:
        comm.stream = None
        s.close()


@pytest.mark.parametrize("kind", ["DeviceBuffer", "interface"])
def test_a_fast_array_call_inside_a_group_keeps_the_arrays_until_it_ends(
    kind: str, solo_comm: Any, new_buffers: Any
) -> None:
    import gc
    import weakref

    from pynccl import group

    comm = solo_comm
    a, b = _pair(kind, new_buffers)
    comm.all_reduce(a, b)
    assert takes_fast_path(comm.all_reduce, a, b)
    refs = weakref.ref(a), weakref.ref(b)
    with group():
        comm.all_reduce(a, b)  # a hit
        del a, b
        gc.collect()
        assert refs[0]() is not None and refs[1]() is not None
    # Held until the work queued on them has run (they may be a stream-ordered caching
    # allocator's memory), released by a later group end or release_done() after that.
    comm.synchronize()
    release_done()
    gc.collect()
    assert refs[0]() is None and refs[1]() is None
