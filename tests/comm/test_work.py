"""Completion handles (:class:`pynccl.Work`): ``async_op=True`` on every collective and
send/recv, ``with pynccl.group(async_op=True) as g: ... g.work``, ``wait(timeout)`` on a
hung operation (the communicator left as the watchdog leaves it), ``test()``/``done``,
``wait_stream`` and the events' lifetimes. Results are checked against numpy
(``support.reference``); the order against a stream held busy (``support.cudart.Hold``),
so that a handle that did not wait shows as wrong data."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np
import pytest
from support.cudart import Hold, live_events, read_f32
from support.reference import expected, sizes
from support.worlds import ThreadWorld

import pynccl
from pynccl import NcclInvalidUsage, NcclTimeoutError, Work
from pynccl.comm._spec import COLLECTIVES, Where
from pynccl.comm._work import POOL_LIMIT, pooled_events
from pynccl.cuda import DeviceBuffer, Event, Graph, Stream
from pynccl.library import cudart

pytestmark = pytest.mark.usefixtures("lb")

N = 4
ROWS = [row for row in COLLECTIVES if row.where is not Where.PEER]


@pytest.fixture(scope="module")
def world() -> Any:
    with ThreadWorld(2) as w:
        yield w


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.method)
def test_every_collective_returns_a_work_that_waits_for_it(world: Any, row: Any) -> None:
    kind = row.cfunc[4:]
    nsend, nrecv = sizes(kind, N, 2)
    sends = [np.arange(nsend, dtype=np.float32) * (r + 1) + 1 for r in range(2)]

    def one(r: int, comm: Any) -> np.ndarray | None:
        send = DeviceBuffer.from_numpy(sends[r])
        recv = DeviceBuffer.from_numpy(np.full(nrecv, -7, np.float32))
        stream = Stream()
        where = {} if row.where is Where.NONE else {"root": 1}
        with Hold(stream.handle) as hold:  # the operation cannot run before the release
            work = getattr(comm, row.method)(send, recv, stream=stream, async_op=True, **where)
            assert isinstance(work, Work) and work.streams == (stream.handle,)
            assert not work.test() and not work.done
            hold.release()
            work.wait(timeout=20)
        assert work.done
        got = read_f32(recv.ptr, nrecv)  # no synchronize: the Work alone ordered it
        for buf in (send, recv, stream):
            buf.close()
        return got

    out = world.run(one)
    for r in range(2):
        want = expected(kind, sends, N, "sum", 1, r)
        if want is not None:
            np.testing.assert_array_equal(out[r], want)


def test_plain_calls_return_none_and_async_op_takes_only_bools(world: Any) -> None:
    def one(r: int, comm: Any) -> None:
        buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
        assert comm.all_reduce(buf) is None
        with pytest.raises(TypeError, match="async_op must be a bool, got str 'yes'"):
            comm.all_reduce(buf, async_op="yes")
        comm.synchronize()
        buf.close()

    world.run(one)


def test_group_work_covers_send_and_recv_on_every_stream(world: Any) -> None:
    def one(r: int, comm: Any) -> np.ndarray:
        a = DeviceBuffer.from_numpy(np.full(N, r + 1, np.float32))
        b = DeviceBuffer.from_numpy(np.zeros(N, np.float32))
        s1, s2 = Stream(), Stream()
        with Hold(s1.handle) as h1, Hold(s2.handle) as h2:
            with pynccl.group(async_op=True) as g:
                assert g.work is None  # not ended yet
                comm.send(a.ptr, 1 - r, count=N, dtype="float32", stream=s1)
                comm.recv(b, 1 - r, stream=s2)
            work = g.work
            assert work is not None and set(work.streams) == {s1.handle, s2.handle}
            assert len(work.events) == 2
            with pytest.raises(ValueError, match="covers 2 streams"):
                work.event  # noqa: B018
            assert not work.done
            h1.release()
            h2.release()
            work.wait(timeout=20)
        got = read_f32(b.ptr, N)
        for obj in (a, b, s1, s2):
            obj.close()
        return got

    out = world.run(one)
    for r in range(2):
        np.testing.assert_array_equal(out[r], np.full(N, 2 - r, np.float32))


def test_an_empty_group_is_done_and_async_op_inside_a_group_is_refused(world: Any) -> None:
    def one(r: int, comm: Any) -> None:
        with pynccl.group(async_op=True) as g:
            pass
        assert g.work is not None and g.work.done and g.work.streams == ()
        buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
        before = comm.flight_seq
        with pytest.raises(NcclInvalidUsage, match="async_op=True inside a group"):
            with pynccl.group():
                comm.all_reduce(buf, async_op=True)
        assert comm.flight_seq == before  # refused before anything was issued
        with pynccl.group() as plain:
            pass
        with pytest.raises(
            ValueError,
            match=r"pynccl.group\(\) records no completion handle; "
            r"open the group with pynccl.group\(async_op=True\)",
        ):
            plain.work  # noqa: B018
        buf.close()

    world.run(one)


def test_wait_stream_orders_a_copy_on_another_stream(world: Any) -> None:
    rt: Any = cudart()

    def one(r: int, comm: Any) -> np.ndarray:
        buf = DeviceBuffer.from_numpy(np.full(N, r + 1, np.float32))
        out = DeviceBuffer.from_numpy(np.zeros(N, np.float32))
        work_stream, copy_stream = Stream(), Stream()
        with Hold(work_stream.handle) as hold:
            work = comm.all_reduce(buf, stream=work_stream, async_op=True)
            work.wait_stream(copy_stream)
            rt.cudaMemcpyAsync(out.ptr, buf.ptr, 4 * N, 3, copy_stream.handle)  # D2D
            hold.release()
        copy_stream.synchronize()
        got = read_f32(out.ptr, N)
        for obj in (buf, out, work_stream, copy_stream):
            obj.close()
        return got

    out = world.run(one)
    for r in range(2):
        np.testing.assert_array_equal(out[r], np.full(N, 3, np.float32))


def test_events_go_back_to_the_pool_and_a_handed_out_event_is_the_callers() -> None:
    comm = pynccl.Communicator(1, pynccl.UniqueId(), 0, device=0)
    buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
    comm.all_reduce(buf, async_op=True).wait()
    gc.collect()
    base = live_events()
    assert pooled_events() >= 1
    works = [comm.all_reduce(buf, async_op=True) for _ in range(2 * POOL_LIMIT)]
    assert live_events() >= base + 2 * POOL_LIMIT - pooled_events()
    for w in works:
        w.wait()
    del works, w
    gc.collect()
    assert pooled_events() <= POOL_LIMIT * 2  # one list per device, each bounded
    live = live_events()
    assert live <= base + POOL_LIMIT  # garbage Works gave their events back or freed them
    event = comm.all_reduce(buf, async_op=True).event  # the Work is garbage at once
    gc.collect()
    assert isinstance(event, Event) and event.device == 0
    event.synchronize()
    assert live_events() == live  # taken from the pool, and not given back to it
    event.close()
    assert live_events() == live - 1
    buf.close()
    comm.destroy()


def test_async_op_refused_while_the_stream_is_captured() -> None:
    comm = pynccl.Communicator(1, pynccl.UniqueId(), 0, device=0)
    stream = Stream()
    buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
    graph = Graph()
    with graph.capture(stream, "thread_local"):
        with pytest.raises(NcclInvalidUsage, match=r"being captured into a CUDA graph"):
            comm.all_reduce(buf, stream=stream, async_op=True)
        comm.all_reduce(buf, stream=stream)  # the capture is intact: this one is captured
    assert graph.captured
    graph.close()
    for obj in (buf, stream):
        obj.close()
    comm.destroy()


@pytest.mark.slow
def test_wait_on_a_hung_operation_trips_the_communicator_as_the_watchdog_does() -> None:
    with ThreadWorld(2) as w:
        w.broken = True  # rank 1 never joins the first all_reduce: abort at the end
        joined = threading.Event()

        def one(r: int, comm: Any) -> Any:
            buf = DeviceBuffer.from_numpy(np.full(N, r + 1, np.float32))
            if r == 1:
                joined.wait(30)
                return None
            work = comm.all_reduce(buf, async_op=True)
            assert not work.test()
            start = time.monotonic()
            with pytest.raises(NcclTimeoutError) as info:
                work.wait(timeout=0.5)
            took = time.monotonic() - start
            joined.set()
            return took, str(info.value), info.value, comm.state, comm.error, comm.flight_seq

        took, text, error, state, recorded, seq = w.run(one)[0]
    assert 0.5 <= took < 1.5, took
    assert f"#{seq} ncclAllReduce count={N} dtype=ncclFloat32 op=sum" in text
    assert "rank 0/2" in text and "Work.wait" in text and "aborted" in text
    assert state == "aborted" and recorded is error  # what the next call raises


@pytest.mark.slow
def test_test_and_done_flip_once_the_peer_joins() -> None:
    with ThreadWorld(2) as w:
        issued = threading.Event()

        def one(r: int, comm: Any) -> Any:
            buf = DeviceBuffer.from_numpy(np.full(N, r + 1, np.float32))
            if r == 1:
                issued.wait(30)
                time.sleep(0.3)
                comm.all_reduce(buf)
                comm.synchronize()
                return read_f32(buf.ptr, N)
            work = comm.all_reduce(buf, async_op=True)
            issued.set()
            seen = [work.test()]
            work.wait(timeout=20)
            seen.append(work.done)
            return seen, read_f32(buf.ptr, N)

        out = w.run(one)
    assert out[0][0] == [False, True]
    np.testing.assert_array_equal(out[0][1], np.full(N, 3, np.float32))
    np.testing.assert_array_equal(out[1], np.full(N, 3, np.float32))


# -- stream="current": the array library's current stream ------------------------------------


class _Dev:
    def __init__(self, kind: str, index: int) -> None:
        self.type, self.index = kind, index


def _stand_in(lib: str, stream: int, device: str = "cuda") -> tuple[Any, Any]:
    """A module named ``lib`` (torch or cupy) whose current stream is ``stream``, and an
    array type of that module exposing ``__cuda_array_interface__``."""
    import types

    mod: Any = types.ModuleType(lib)
    handle = types.SimpleNamespace(cuda_stream=stream, ptr=stream)
    mod.cuda = types.SimpleNamespace(
        current_stream=lambda dev: handle if dev.type == "cuda" else None,
        get_current_stream=lambda: handle,
    )

    class Tensor:
        def __init__(self, buf: DeviceBuffer) -> None:
            self.buf, self.device = buf, _Dev(device, 0)

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return self.buf.__cuda_array_interface__

    Tensor.__module__ = lib
    return mod, Tensor


@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_stream_current_follows_the_array_librarys_current_stream(
    lib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    comm = pynccl.Communicator(1, pynccl.UniqueId(), 0, device=0)
    current = Stream()
    mod, tensor = _stand_in(lib, current.handle)
    buf = DeviceBuffer.from_numpy(np.full(N, 2, np.float32))
    monkeypatch.setitem(__import__("sys").modules, lib, mod)
    with Hold(current.handle) as hold:
        work = comm.all_reduce(tensor(buf), stream="current", async_op=True)
        assert work.streams == (current.handle,)
        assert comm.flight_record()[-1][3][-1] == current.handle
        hold.release()
        work.wait(timeout=20)
    comm.all_reduce(buf.ptr, count=N, dtype="float32", stream="current")  # raw: comm.stream
    assert comm.flight_record()[-1][3][-1] == comm.stream == 0
    comm.synchronize()
    np.testing.assert_array_equal(read_f32(buf.ptr, N), np.full(N, 2, np.float32))
    buf.close()
    current.close()
    comm.destroy()


def test_stream_current_of_cupy_is_the_arrays_devices_not_the_current_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CuPy keeps a current stream per device: an array on device 1 read while device 0 is
    # current must get device 1's (device 0's would be another device's stream).
    import types

    from pynccl.cuda import get_device, set_device

    set_device(1)
    try:
        comm = pynccl.Communicator(1, pynccl.UniqueId(), 0, device=1)
        on_1 = Stream()
        buf = DeviceBuffer.from_numpy(np.full(N, 3, np.float32))
    finally:
        set_device(0)
    on_0 = Stream()
    per_device = {-1: on_0.handle, 0: on_0.handle, 1: on_1.handle}
    mod: Any = types.ModuleType("cupy")
    mod.cuda = types.SimpleNamespace(
        get_current_stream=lambda device_id=-1: types.SimpleNamespace(ptr=per_device[device_id])
    )

    class ndarray:  # CuPy's name
        device = types.SimpleNamespace(id=1)

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return buf.__cuda_array_interface__

    ndarray.__module__ = "cupy"
    monkeypatch.setitem(__import__("sys").modules, "cupy", mod)
    assert get_device() == 0
    comm.all_reduce(ndarray(), stream="current")
    assert comm.flight_record()[-1][3][-1] == on_1.handle
    comm.synchronize()
    np.testing.assert_array_equal(read_f32(buf.ptr, N), np.full(N, 3, np.float32))
    buf.close()
    comm.destroy()
    on_0.close()
    on_1.close()


def test_stream_current_where_it_is_not_taken_says_where_it_is() -> None:
    comm = pynccl.Communicator(1, pynccl.UniqueId(), 0, device=0)
    buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
    op = comm.all_reduce_init(buf)
    with pytest.raises(TypeError, match=r"got builtins.str 'current' \('current' is taken by the "
                       r"collectives, send/recv and v-collectives"):  # fmt: skip
        op(stream="current")
    with pytest.raises(TypeError, match=r"got builtins.str 'current' \('current' is taken"):
        buf.copy_from(np.ones(N, np.float32), stream="current")
    op.close()
    buf.close()
    comm.destroy()


def test_stream_current_without_the_library_loaded_uses_the_comms_stream() -> None:
    comm = pynccl.Communicator(1, pynccl.UniqueId(), 0, device=0)
    _, tensor = _stand_in("cupy", 12345)  # its module is not in sys.modules
    buf = DeviceBuffer.from_numpy(np.ones(N, np.float32))
    comm.all_reduce(tensor(buf), stream="current")
    assert comm.flight_record()[-1][3][-1] == 0
    comm.synchronize()
    buf.close()
    comm.destroy()


def test_stream_current_with_a_torch_cpu_tensor_is_refused_as_on_the_host() -> None:
    torch = pytest.importorskip("torch")
    comm = pynccl.Communicator(1, pynccl.UniqueId(), 0, device=0)
    t = torch.ones(N)
    with pytest.raises(Exception) as plain:
        comm.all_reduce(t)
    with pytest.raises(type(plain.value)) as current:
        comm.all_reduce(t, stream="current")
    assert str(current.value) == str(plain.value)
    comm.destroy()
