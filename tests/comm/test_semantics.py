"""Semantics NCCL has that the object API must keep: root-only buffers may be None on the
other ranks, synchronize() waits on the communicator's device, complex arrays as float
pairs (sum/avg only). Results are checked against numpy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from ctypes import byref, c_int
from typing import Any

import numpy as np
import pytest
from support.worlds import MinimalCAI, ThreadWorld

from pynccl import NcclTimeoutError, _adapt, library
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer
from pynccl.enums import DataType
from pynccl.groups import group

N = 5


def _rank_data(r: int, n: int = N) -> np.ndarray:
    return np.arange(n, dtype=np.float32) + 100 * (r + 1)


def _run(world: ThreadWorld, fn: Callable[[int, Communicator], Any]) -> dict[int, Any]:
    def one(r: int, comm: Communicator) -> Any:
        out = fn(r, comm)
        comm.synchronize(timeout=60)
        return None if out is None else out.to_numpy()

    return world.run(one)


def test_broadcast_with_none_on_the_other_ranks(thread_worlds: Any) -> None:
    world = thread_worlds(3)
    root = 1
    keep: dict[int, DeviceBuffer] = {}

    def call(r: int, comm: Communicator) -> DeviceBuffer:
        recv = DeviceBuffer(N, "float32", device=r)
        send = DeviceBuffer.from_numpy(_rank_data(r), device=r) if r == root else None
        if send is not None:
            keep[r] = send
        comm.broadcast(send, recv, root=root)
        return recv

    for r, got in _run(world, call).items():
        assert np.array_equal(got, _rank_data(root)), r


def test_gather_and_scatter_with_none_off_the_root(thread_worlds: Any) -> None:
    world = thread_worlds(3)
    root = 2

    def gather(r: int, comm: Communicator) -> DeviceBuffer | None:
        send = DeviceBuffer.from_numpy(_rank_data(r), device=r)
        recv = DeviceBuffer(3 * N, "float32", device=r) if r == root else None
        comm.gather(send, recv, root=root)
        return recv

    got = _run(world, gather)
    assert np.array_equal(got[root], np.concatenate([_rank_data(r) for r in range(3)]))
    assert got[0] is None and got[1] is None
    whole = np.arange(3 * N, dtype=np.float32) * 7

    def scatter(r: int, comm: Communicator) -> DeviceBuffer:
        send = DeviceBuffer.from_numpy(whole, device=r) if r == root else None
        recv = DeviceBuffer(N, "float32", device=r)
        comm.scatter(send, recv, root=root)
        return recv

    for r, part in _run(world, scatter).items():
        assert np.array_equal(part, whole[r * N : (r + 1) * N]), r


def test_reduce_needs_no_recvbuf_off_the_root(thread_worlds: Any) -> None:
    world = thread_worlds(3)
    root = 0

    def call(r: int, comm: Communicator) -> DeviceBuffer:
        send = DeviceBuffer.from_numpy(_rank_data(r), device=r)
        recv = DeviceBuffer(N, "float32", device=r) if r == root else None
        comm.reduce(send, recv, root=root)
        return recv if recv is not None else send

    got = _run(world, call)
    assert np.array_equal(got[root], sum(_rank_data(r) for r in range(3)))


def test_the_root_still_needs_its_buffer(thread_worlds: Any) -> None:
    world = thread_worlds(2)

    def call(r: int, comm: Communicator) -> str:
        with pytest.raises(TypeError) as info:
            comm.broadcast(None, DeviceBuffer(N, "float32", device=r), root=r)
        return str(info.value)

    for text in world.run(call).values():
        assert "sendbuf is required on the root of broadcast" in text


# --- synchronize on the communicator's device -------------------------------------------------


@pytest.fixture
def pair_in_one_thread(lb: Any) -> Iterator[list[Communicator]]:
    comms = Communicator.init_all(2)
    try:
        yield comms
    finally:
        for c in comms:
            c.destroy()


def test_synchronize_waits_on_the_communicators_device(
    pair_in_one_thread: list[Communicator], monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = library.cudart()
    get_device = rt.raw("cudaGetDevice")
    real_raw = rt.raw
    seen: list[int] = []

    def current() -> int:
        value = c_int(-1)
        get_device(byref(value))
        return value.value

    def raw(name: str) -> Any:
        fn = real_raw(name)
        if name != "cudaStreamQuery":
            return fn

        def query(stream: Any) -> int:
            seen.append(current())
            return int(fn(stream))

        return query

    monkeypatch.setattr(rt, "raw", raw)
    bufs = [DeviceBuffer.from_numpy(_rank_data(r), device=r) for r in range(2)]
    rt.cudaSetDevice(0)
    with group():
        for r, comm in enumerate(pair_in_one_thread):
            comm.all_reduce(bufs[r])
    for comm in reversed(pair_in_one_thread):
        seen.clear()
        comm.synchronize(timeout=60)
        assert seen and set(seen) == {comm.device}, (comm.device, seen)
        assert current() == 0, "synchronize must restore the caller's device"
    want = _rank_data(0) + _rank_data(1)
    for b in bufs:
        assert np.array_equal(b.to_numpy(), want)
        b.close()


# --- complex arrays -----------------------------------------------------------------------------

needs_complex = pytest.mark.skipif(
    not hasattr(_adapt, "is_complex"),
    reason="complex arrays need pynccl._adapt.is_complex (the adapt helper's work)",
)


@needs_complex
def test_complex_arrays_sum_and_refuse_max(thread_worlds: Any) -> None:
    world = thread_worlds(2)
    data = {r: (np.arange(N) + 1j * (np.arange(N) - r)).astype(np.complex64) for r in range(2)}

    def call(r: int, comm: Communicator) -> tuple[np.ndarray, str]:
        dev = DeviceBuffer.from_numpy(data[r].view(np.float32), device=r)
        arr = MinimalCAI(dev.ptr, N, DataType.FLOAT32, "<c8")
        with pytest.raises(TypeError) as info:
            comm.all_reduce(arr, op="max")
        comm.all_reduce(arr)
        comm.synchronize(timeout=60)
        return dev.to_numpy().view(np.complex64), str(info.value)

    for got, text in world.run(call).values():
        assert np.array_equal(got, data[0] + data[1])
        assert "complex" in text and "max" in text


class _OnDevice(MinimalCAI):
    """An interface that also tells its device (.device), like CuPy's and PyTorch's."""

    def __init__(self, ptr: int, n: int, device: int) -> None:
        super().__init__(ptr, n, DataType.FLOAT32, "<f4")
        self.device = device


@pytest.mark.parametrize("kind", ["DeviceBuffer", "interface", "interface with device"])
def test_prod_max_min_of_real_arrays_are_issued_inline_and_complex_ones_refused(
    lb: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    from pynccl.comm._collectives import Collectives

    slow_calls: list[tuple[Any, bool]] = []  # (op, whether sendbuf is complex)
    real_slow = Collectives._slow

    def counted(self: Any, row: Any, sendbuf: Any, *args: Any) -> Any:
        slow_calls.append((args[1], _adapt.is_complex(sendbuf)))
        return real_slow(self, row, sendbuf, *args)

    monkeypatch.setattr(Collectives, "_slow", counted)
    ops = {"prod": np.multiply, "max": np.maximum, "min": np.minimum}
    data = {r: (np.arange(N, dtype=np.float32) - 2) * (r + 1) for r in range(2)}
    complex_data = (np.arange(N) + 1j).astype(np.complex64)

    def call(r: int, comm: Communicator) -> tuple[dict[str, np.ndarray], list[str]]:
        src = DeviceBuffer.from_numpy(data[r], device=r)
        dst = DeviceBuffer(N, DataType.FLOAT32, device=r)
        cplx = DeviceBuffer.from_numpy(complex_data, device=r)
        wrap: Callable[[DeviceBuffer], Any] = {
            "DeviceBuffer": lambda buf: buf,
            "interface": lambda buf: MinimalCAI(buf.ptr, N, DataType.FLOAT32, "<f4"),
            "interface with device": lambda buf: _OnDevice(buf.ptr, N, r),
        }[kind]
        x, y = wrap(src), wrap(dst)
        comm.all_reduce(x, y)  # a type's first call takes the slow path (its handler)
        comm.synchronize(timeout=60)
        got, refused = {}, []
        for name in ops:
            for _ in range(2):  # checked in full, then (a memo hit) again
                comm.all_reduce(x, y, name)
                comm.synchronize(timeout=60)
                got[name] = dst.to_numpy().copy()
        c = cplx if kind == "DeviceBuffer" else MinimalCAI(cplx.ptr, N, DataType.FLOAT32, "<c8")
        for name in ops:
            for _ in range(2):
                with pytest.raises(TypeError) as info:
                    comm.all_reduce(c, op=name)
                refused.append(str(info.value))
        for buf in (src, dst, cplx):
            buf.close()
        return got, refused

    with ThreadWorld(2) as world:  # its own communicators: no memo of another test's calls
        results = world.run(call)
    for got, refused in results.values():
        for name, ufunc in ops.items():
            np.testing.assert_array_equal(got[name], ufunc(data[0], data[1]))
        assert len(set(refused)) == 3 and all("complex" in text for text in refused)
    # Of prod/max/min, the slow path saw the complex arrays only (3 ops, twice, 2 ranks).
    assert sorted(c for op, c in slow_calls if op in ops) == [True] * 12


# --- messages: a short record in the text, the whole record as an attribute ---------------------


def test_errors_carry_a_short_record_and_the_whole_one(
    lb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "10")  # the tenth operation never ends
    comm = Communicator(1, UniqueId(), 0, device=0)
    buf = DeviceBuffer.from_numpy(_rank_data(0), device=0)
    try:
        for i in range(10):
            comm.all_reduce(buf, op="max" if i % 2 else "sum")
        with pytest.raises(NcclTimeoutError) as info:
            comm.synchronize(timeout=0.3)
    finally:
        buf.close()
    err = info.value
    text = str(err)
    assert "Last 4 operations issued on rank 0/1 (of 10 recorded" in text
    assert "#10 ncclAllReduce" in text and "op=max" in text and "#6 " not in text
    assert [e[0] for e in err.flight_record] == list(range(1, 11))  # type: ignore[attr-defined]
    assert comm.state == "aborted"


def test_the_record_shows_group_boundaries(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    a = DeviceBuffer.from_numpy(_rank_data(0), device=0)
    b = DeviceBuffer(N, "float32", device=0)
    try:
        comm.all_reduce(a, b)  # #1, no group
        with group():
            comm.send(a, 0)  # #2 and #3 in one group
            comm.recv(b.ptr, 0, count=N, dtype="float32")
        with group():
            comm.all_reduce(a.ptr, b.ptr, count=N, dtype="float32", op="max")  # #4, next group
        comm.synchronize(timeout=60)
        lines = comm.format_flight_record().splitlines()[1:]
    finally:
        comm.destroy()
        a.close()
        b.close()
    tags = [line.rsplit("[group ", 1)[1].rstrip("]") if "[group" in line else "" for line in lines]
    assert tags[0] == "" and tags[1] == tags[2] != "" and tags[3] not in ("", tags[1])
    assert "#4 ncclAllReduce" in lines[3] and "op=max" in lines[3]
