"""Groups as NCCL runs them: after the group end, on other threads and streams.

* A non-blocking ``ncclGroupEnd`` that returns ``ncclInProgress`` puts *every*
  communicator of the group in progress (NCCL's ``src/group.cc`` sets each one's async
  error to ``ncclInProgress`` and launches from its own thread; the calls inside the group
  returned ``ncclSuccess``). Each must then wait for readiness before its next call and in
  ``synchronize()`` — also those of the v-collectives and the grouped fallbacks, which
  open groups of their own.
* The buffers of a group's operations must live until the operations have *run* on their
  streams, not only until the group end returned: a stream-ordered caching allocator
  (torch's, CuPy's) hands a freed block out again at once. ``pynccl.testing.allocator``'s
  :class:`CachingAllocator` stands for one (a freed block is poisoned at once); the
  results, checked against numpy, show whether the memory outlived the work.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from ctypes import byref, c_void_p

import numpy as np
import pytest
from support.reference import small_ints
from support.worlds import ThreadWorld, use_loopback

from pynccl import library
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer, Graph, Stream
from pynccl.enums import Result
from pynccl.groups import group, group_end, group_start, release_done
from pynccl.testing.allocator import CachingAllocator

N = 4096  # float32 elements

Worlds = Callable[[int], ThreadWorld]

pytestmark = pytest.mark.usefixtures("lb")


def nonblocking(n: int = 1) -> list[Communicator]:
    """``n`` one-rank non-blocking communicators on device 0, ready."""
    config = Config(blocking=False)
    comms = [Communicator(1, UniqueId(), 0, device=0, config=config) for _ in range(n)]
    for comm in comms:
        comm.wait_ready(timeout=30)
    return comms


def data(seed: int, n: int = N) -> np.ndarray:
    return small_ints(seed, 0, n)


# --- every communicator of an in-progress group waits -----------------------------------------


def test_an_in_progress_group_end_puts_every_communicator_of_the_group_in_progress() -> None:
    a, b, idle = nonblocking(3)
    x, y = DeviceBuffer.from_numpy(data(1)), DeviceBuffer.from_numpy(data(2))
    try:
        group_start()
        a.all_reduce(x)  # NCCL returns success for both calls inside the group
        b.all_reduce(y.ptr, count=N, dtype="float32")
        assert (a.state, b.state) == ("ready", "ready")
        assert group_end() == Result.IN_PROGRESS
        # Both members wait before their next call (NCCL refuses calls until then); a
        # communicator that took no part is not touched.
        assert (a.state, b.state, idle.state) == ("initializing", "initializing", "ready")
        a.synchronize(timeout=30)
        b.all_reduce(y)  # waits for readiness first
        b.synchronize(timeout=30)
        assert (a.state, b.state) == ("ready", "ready")
        np.testing.assert_array_equal(x.to_numpy(), data(1))  # a sum over one rank
        np.testing.assert_array_equal(y.to_numpy(), data(2))
    finally:
        for comm in (a, b, idle):
            comm.destroy()
        x.close()
        y.close()


def test_calls_right_after_an_in_progress_group_wait_instead_of_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NCCL refuses a call on a communicator whose group is still being launched
    # (ncclCommEnsureReady: "Attempt to use communicator before the previous operation
    # returned ncclSuccess"); the loopback reports the group in progress for a few polls.
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", "20")
    a, b = nonblocking(2)
    x, y = DeviceBuffer.from_numpy(data(12)), DeviceBuffer.from_numpy(data(13))
    try:
        for _ in range(3):
            with group():
                a.all_reduce(x)
                b.all_reduce(y)
            a.all_reduce(x)  # at once: each waits for its group first
            b.all_gather(y, y)
        a.synchronize(timeout=30)
        b.synchronize(timeout=30)
        np.testing.assert_array_equal(x.to_numpy(), data(12))  # sums over one rank
        np.testing.assert_array_equal(y.to_numpy(), data(13))
    finally:
        a.destroy()
        b.destroy()
        x.close()
        y.close()


def test_the_context_manager_form_marks_them_too() -> None:
    (comm,) = nonblocking()
    x = DeviceBuffer.from_numpy(data(3))
    try:
        with group():
            comm.send(x, 0)
            comm.recv(x, 0)
        assert comm.state == "initializing"
        comm.synchronize(timeout=30)
        np.testing.assert_array_equal(x.to_numpy(), data(3))
    finally:
        comm.destroy()
        x.close()


def test_v_collectives_open_a_group_whose_communicator_waits() -> None:
    (comm,) = nonblocking()
    x, y = DeviceBuffer.from_numpy(data(4, 5)), DeviceBuffer(8, "float32")
    s, r = DeviceBuffer.from_numpy(data(5, 6)), DeviceBuffer(3, "float32")
    try:
        comm.all_gather_v(x, y, [5], displs=[3])
        assert comm.state == "initializing"
        comm.synchronize(timeout=30)
        np.testing.assert_array_equal(y.to_numpy()[3:], data(4, 5))
        comm.reduce_scatter_v(s, r, [3], displs=[2])
        assert comm.state == "initializing"
        comm.synchronize(timeout=30)
        np.testing.assert_array_equal(r.to_numpy(), data(5, 6)[2:5])
    finally:
        comm.destroy()
        for buf in (x, y, s, r):
            buf.close()


def test_grouped_fallbacks_open_a_group_whose_communicator_waits() -> None:
    # NCCL 2.27 has no ncclGather / ncclAlltoAll: pynccl issues them as grouped send/recv.
    with use_loopback("2.27.3"):
        (comm,) = nonblocking()
        x, y = DeviceBuffer.from_numpy(data(6, 16)), DeviceBuffer(16, "float32")
        try:
            comm.gather(x, y, root=0)
            assert comm.state == "initializing"
            comm.synchronize(timeout=30)
            np.testing.assert_array_equal(y.to_numpy(), data(6, 16))
            comm.all_to_all(y, x)
            assert comm.state == "initializing"
            comm.synchronize(timeout=30)
            np.testing.assert_array_equal(x.to_numpy(), data(6, 16))
        finally:
            comm.destroy()
            x.close()
            y.close()


# --- what a group keeps lives until its work has run ------------------------------------------


def test_a_group_keeps_foreign_memory_until_the_work_on_it_has_run(thread_worlds: Worlds) -> None:
    pair = thread_worlds(2)
    ended = threading.Event()  # rank 0's group has ended (and let go of what it held)

    def one(r: int, comm: Communicator) -> np.ndarray:
        with CachingAllocator(device=r) as pool, DeviceBuffer(N, "float32", device=r) as out:
            if r == 1:
                assert ended.wait(30)  # the all_reduce runs only once rank 1 joins
                comm.all_reduce(DeviceBuffer.from_numpy(data(8), device=1), out)
            else:
                with group():  # only the group holds the array: freed (poisoned) when let go
                    comm.all_reduce(pool.from_numpy(data(7)), out)
                gc.collect()
                ended.set()
            comm.synchronize(timeout=30)
            return out.to_numpy()

    want = data(7) + data(8)
    for got in pair.run(one).values():
        np.testing.assert_array_equal(got, want)  # not the poison of the block's next owner


def test_held_objects_go_once_their_stream_has_passed(thread_worlds: Worlds) -> None:
    pair = thread_worlds(2)
    go = threading.Event()

    def one(r: int, comm: Communicator) -> tuple[bool, bool]:
        with CachingAllocator(device=r) as pool:
            x = pool.from_numpy(data(9 + r))
            if r == 1:
                assert go.wait(30)
                comm.all_reduce(x)
                comm.synchronize(timeout=30)
                return True, True
            ref = weakref.ref(x)
            with group():
                comm.all_reduce(x)  # waits on the stream for rank 1
            del x
            held = ref() is not None and release_done() == 1  # not run yet: still held
            go.set()
            comm.synchronize(timeout=30)  # the stream has passed: synchronize lets it go
            return held, ref() is None and release_done() == 0

    assert pair.run(one)[0] == (True, True)


def test_an_in_progress_group_holds_even_pynccl_buffers_until_nccl_launched() -> None:
    # A DeviceBuffer's cudaFree waits for the device, but a non-blocking group's work is
    # not on the device yet when the end returns: the buffer must wait for the launch.
    (comm,) = nonblocking()
    try:
        x = DeviceBuffer.from_numpy(data(9))
        ref = weakref.ref(x)
        with group():
            comm.all_reduce(x)
        del x
        gc.collect()
        alive = ref() is not None
        assert alive and release_done() == 1  # its communicator is in progress
        comm.synchronize(timeout=30)  # ready: NCCL launched; an event is recorded after
        comm.synchronize(timeout=30)  # the stream has passed it: synchronize lets it go
        gc.collect()
        assert ref() is None and release_done() == 0
    finally:
        comm.destroy()


def test_pynccl_buffers_of_a_launched_group_need_no_event(solo_comm: Communicator) -> None:
    x = DeviceBuffer.from_numpy(data(10))
    ref = weakref.ref(x)
    with group():
        solo_comm.all_reduce(x)
    del x
    gc.collect()
    assert ref() is None and release_done() == 0  # cudaFree waits for the device itself


@contextlib.contextmanager
def foreign_capture(stream: Stream) -> Iterator[list[int]]:
    """A capture pynccl did not begin (as torch.cuda.graph's): ``cudaStreamBeginCapture``
    in relaxed mode on ``stream``; yields a list that holds the executable graph after."""
    rt = library.cudart()
    rt.cudaStreamBeginCapture(stream.handle, 2)
    out: list[int] = []
    graph, exe = c_void_p(), c_void_p()
    try:
        yield out
    finally:
        rt.cudaStreamEndCapture(stream.handle, byref(graph))
    rt.cudaGraphInstantiate(byref(exe), graph, 0)
    rt.cudaGraphDestroy(graph)
    out.append(exe.value or 0)


@pytest.mark.parametrize("capture", ["pynccl", "foreign"])
def test_work_captured_into_a_graph_keeps_its_memory(capture: str) -> None:
    stream = Stream(non_blocking=True)
    comm = Communicator(1, UniqueId(), 0, device=0, stream=stream)
    rt = library.cudart()
    pool = CachingAllocator(device=0)
    out = DeviceBuffer(N, "float32")
    g = Graph()
    exe = 0
    try:
        x = pool.from_numpy(data(11))
        begun = g.capture(stream, "relaxed") if capture == "pynccl" else foreign_capture(stream)
        with begun as got, group():
            comm.all_reduce(x, out)
        del x  # only the group (and then the graph) holds it
        gc.collect()
        exe = got[0] if capture == "foreign" else 0
        for _ in range(2):  # each replay reads the memory as it is then: still the data
            out.fill_zero()
            if exe:
                rt.cudaGraphLaunch(exe, stream.handle)
            else:
                g.replay()
            stream.synchronize()
            np.testing.assert_array_equal(out.to_numpy(), data(11))
    finally:
        if exe:  # NCCL destroys no communicator while a graph that captured it lives
            rt.cudaGraphExecDestroy(exe)
        g.close()
        comm.destroy()
        out.close()
        pool.close()
        stream.close()
