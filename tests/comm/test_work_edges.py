"""Completion handles at their edges (issue 24's review): a wait whose operation
completes at its deadline, a recording group entered again or ended during a CUDA-graph
capture or failing to record, events taken from the shared pool by another thread, and
``async_op`` checked as every yes/no option. Results against numpy; what the
handles cover against the streams the calls were issued on."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np
import pytest
from support.cudart import live_events, read_f32
from support.worlds import ThreadWorld

import pynccl
from pynccl import NcclInvalidUsage, Work
from pynccl.cuda import DeviceBuffer, Graph, Stream
from pynccl.library import cudart

pytestmark = pytest.mark.usefixtures("lb")

N = 4


@pytest.fixture(scope="module")
def world() -> Any:
    with ThreadWorld(2) as w:
        yield w


class _LateWork(Work):
    """A Work whose first test() saw the operation still running and returned only past
    the deadline: the operation completed in between."""

    __slots__ = ("_seen",)

    def test(self) -> bool:
        if not getattr(self, "_seen", False):
            self._seen = True
            time.sleep(0.05)
            return False
        return super().test()


def test_wait_returns_when_the_operation_completes_at_the_deadline(world: Any) -> None:
    def one(r: int, comm: Any) -> str:
        buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
        comm.all_reduce(buf)
        comm.synchronize()
        work = _LateWork.after(comm, comm.stream)  # its event completes at once
        work.wait(timeout=0.01)  # not NcclTimeoutError, nor StopIteration
        assert work.done
        buf.close()
        return str(comm.state)

    assert world.run(one) == {0: "ready", 1: "ready"}


def test_a_recording_group_entered_again_forgets_the_last_ends_work(world: Any) -> None:
    def one(r: int, comm: Any) -> None:
        buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
        g = pynccl.group(async_op=True)
        with g:
            pass
        first = g.work
        assert first is not None and first.streams == ()
        with g:
            assert g.work is None  # not ended yet: not the first end's handle
            comm.all_reduce(buf)
        assert g.work is not first and g.work is not None
        assert g.work.streams == (comm.stream,)
        g.work.wait(timeout=20)
        buf.close()

    world.run(one)


def test_async_op_is_checked_as_every_yes_no_option_is(world: Any) -> None:
    """A numpy bool is a bool (as for every flag, ``pynccl._limits.check_flag``); an int,
    even 1, is refused with the flags' one wording, by the collectives, the v-collectives
    and group()."""

    def one(r: int, comm: Any) -> None:
        buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
        out = DeviceBuffer.from_numpy(np.zeros(2 * N, np.float32))
        work = comm.all_reduce(buf, async_op=np.True_)
        assert isinstance(work, Work)
        work.wait(timeout=20)
        assert comm.all_reduce(buf, async_op=np.False_) is None
        assert comm.all_gather_v(buf, out, [N, N], async_op=np.False_) is None
        comm.synchronize()
        np.testing.assert_array_equal(read_f32(buf.ptr, N), np.full(N, 4, np.float32))
        before = comm.flight_seq
        for call in (
            lambda: comm.all_reduce(buf, async_op=1),
            lambda: comm.all_gather_v(buf, out, [N, N], async_op=1),
            lambda: pynccl.group(async_op=1),
        ):
            with pytest.raises(TypeError, match=r"^async_op must be a bool, got int 1$"):
                call()
        assert comm.flight_seq == before  # refused before anything was issued
        with pynccl.group(async_op=np.True_) as g:
            comm.all_reduce(buf)
        assert g.work is not None
        g.work.wait(timeout=20)
        for obj in (buf, out):
            obj.close()

    world.run(one)


class _TakenMeanwhile(list):  # type: ignore[type-arg]
    """A pool that holds an event when looked at, and none by the pop: what another
    thread's record() taking the last event in between leaves (the GIL may switch
    threads between the two)."""

    def __bool__(self) -> bool:
        return True

    def pop(self, *args: Any) -> Any:
        raise IndexError("pop from empty list")


@pytest.mark.parametrize("which", ["own stream", "default stream"])
def test_record_makes_an_event_when_another_thread_took_the_pools_last(which: str) -> None:
    from pynccl.comm import _work

    stream = Stream() if which == "own stream" else None
    saved = _work._POOL.pop(0, None)
    _work._POOL[0] = _TakenMeanwhile()
    try:
        handle = _work.record(0, 0 if stream is None else stream.handle)
    finally:
        del _work._POOL[0]
        if saved is not None:
            _work._POOL[0] = saved
    assert handle and cudart().raw("cudaEventSynchronize")(handle) == 0  # a live event
    _work._give_back(0, handle)
    if stream is not None:
        stream.close()


def test_a_group_whose_work_cannot_be_recorded_still_ends_cleanly(
    world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cudaEventRecord failing at the end of a group(async_op=True) (a sticky CUDA error,
    say): the error propagates, and the launched group is ended all the same — nothing it
    issued leaks into the thread's next group (whose work would cover it)."""
    from pynccl.comm import _work

    def failing(device: int, stream: int) -> int:
        raise RuntimeError(f"cudaEventRecord failed on stream {stream:#x}")

    def one(r: int, comm: Any) -> tuple[int, ...]:
        buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
        with pytest.raises(RuntimeError, match="cudaEventRecord failed"):
            with pynccl.group(async_op=True):
                comm.all_reduce(buf.ptr, count=N, dtype="float32")
        barrier.wait(10)
        monkeypatch.setattr(_work, "record", real)
        comm.synchronize()
        with pynccl.group(async_op=True) as g:
            pass
        buf.close()
        assert g.work is not None
        return g.work.streams

    real = _work.record
    barrier = threading.Barrier(2)
    monkeypatch.setattr(_work, "record", failing)
    assert world.run(one) == {0: (), 1: ()}


def test_group_async_op_refused_at_its_end_while_a_stream_is_captured() -> None:
    """No event is recorded into the capture (the host cannot wait for one there, and
    asking it would invalidate the capture): the end refuses as async_op=True does."""
    comm = pynccl.Communicator(1, pynccl.UniqueId(), 0, device=0)
    stream = Stream()
    buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
    graph = Graph()
    with graph.capture(stream, "thread_local"):
        with pytest.raises(NcclInvalidUsage, match=rf"stream {stream.handle:#x} is being captured"):
            with pynccl.group(async_op=True):
                comm.all_reduce(buf, stream=stream)
        with pynccl.group(async_op=True) as g:  # the group ended: the next one is fresh
            pass
        assert g.work is not None and g.work.streams == ()
        comm.all_reduce(buf, stream=stream)  # the capture is intact: this one is captured
    assert graph.captured
    graph.replay(stream)
    stream.synchronize()
    np.testing.assert_array_equal(read_f32(buf.ptr, N), np.ones(N, np.float32))
    graph.close()
    for obj in (buf, stream):
        obj.close()
    comm.destroy()


def test_the_refusal_inside_a_group_names_a_group_that_has_work(world: Any) -> None:
    """What the refusal advises works: ``pynccl.group()`` has no g.work (ValueError)."""

    def one(r: int, comm: Any) -> None:
        buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
        with pytest.raises(NcclInvalidUsage) as info:
            with pynccl.group():
                comm.all_reduce(buf, async_op=True)
        assert "use `with pynccl.group(async_op=True) as g:` and g.work" in str(info.value)
        with pynccl.group(async_op=True) as g:  # the advice, followed
            comm.all_reduce(buf)
        assert g.work is not None
        g.work.wait(timeout=20)
        buf.close()

    world.run(one)


def test_a_group_whose_second_event_fails_gives_the_first_back(
    world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The events a group's Work had recorded before one failed go back to the pool: no
    Work holds them, and none is lost (the loopback counts live events)."""
    from pynccl.comm import _work

    real = _work.record
    failing: set[int] = set()

    def record(device: int, stream: int) -> int:
        if stream in failing:
            raise RuntimeError(f"cudaEventRecord failed on stream {stream:#x}")
        return real(device, stream)

    def one(r: int, comm: Any) -> int:
        a = DeviceBuffer.from_numpy(np.full(N, r + 1, np.float32))
        b = DeviceBuffer.from_numpy(np.zeros(N, np.float32))
        s1, s2 = Stream(), Stream()
        failing.add(s2.handle)
        with pytest.raises(RuntimeError, match="cudaEventRecord failed"):
            with pynccl.group(async_op=True):
                comm.send(a, 1 - r, stream=s1)
                comm.recv(b, 1 - r, stream=s2)
        s1.synchronize()
        s2.synchronize()
        np.testing.assert_array_equal(read_f32(b.ptr, N), np.full(N, 2 - r, np.float32))
        for obj in (a, b, s1, s2):
            obj.close()
        return r

    gc.collect()  # earlier tests' Works give their events back first
    outside_pool = live_events() - _work.pooled_events()
    monkeypatch.setattr(_work, "record", record)
    world.run(one)
    monkeypatch.setattr(_work, "record", real)
    gc.collect()
    assert live_events() - _work.pooled_events() == outside_pool  # none leaked
