"""Stream order and lifetimes, each checked with a stream held busy (a host task that
blocks it until released), so that work the code failed to order, or memory it failed to
keep, shows as wrong data rather than a race that happens to go right:

* ``__cuda_array_interface__`` v3 ``stream``: the call's stream waits for the producer's,
  on every path an array takes (first call, inline path, slow path, persistent op,
  v-collective), and only when the two streams differ;
* the communicator's stream objects stay alive (``Communicator(stream=...)``,
  ``comm.stream = ...``, ``<op>_init(stream=...)``, a split child);
* DeviceBuffer's helpers finish before returning where they say so, also when the
  runtime's synchronous-looking calls return once enqueued, as CUDA's do;
* ``PersistentOp.close`` and a device PreMulSum scalar keep their memory until the work
  using it has run, under :class:`pynccl.testing.allocator.CachingAllocator`, which
  reuses and poisons a freed block at once.

The reference is numpy (the data a correct order leaves), never the code under test.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.cudart import Hold, keep, read_f32

from pynccl import DataType
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer, Stream
from pynccl.library import cudart
from pynccl.testing.allocator import CachingAllocator

pytestmark = pytest.mark.usefixtures("lb")

N = 16
F32 = DataType.FLOAT32


class Produced:
    """An array of a producer that exports its stream, as CuPy does: a new v3 interface
    at every read, naming the stream its pending work is on."""

    def __init__(self, buf: DeviceBuffer, stream: int | None) -> None:
        self.ptr, self.n, self.stream = buf.ptr, buf.size, stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai = {"shape": (self.n,), "typestr": "<f4", "data": (self.ptr, False), "version": 3}
        cai["stream"] = self.stream
        return cai


@pytest.fixture
def comm() -> Iterator[Communicator]:
    """A one-rank communicator on a non-blocking stream (no implicit order with the
    legacy default stream: only what pynccl orders is ordered). The fixture keeps the
    stream itself: the tests of the communicator's own keeping are below."""
    stream = Stream(non_blocking=True)
    c = Communicator(1, UniqueId(), 0, device=0, stream=stream)
    try:
        yield c
    finally:
        c.synchronize(timeout=60)
        c.destroy()
        stream.close()


# -- __cuda_array_interface__ v3 stream ------------------------------------------------------


def _produce(stream: int, buf: DeviceBuffer, data: np.ndarray) -> None:
    """Queue the producer's write of ``data`` into ``buf`` on ``stream``."""
    keep(data)  # pageable source: alive until the copy ran
    rc = cudart().raw("cudaMemcpyAsync")(buf.ptr, data.ctypes.data, data.nbytes, 1, stream)
    assert rc == 0


CALLS = {
    "all_reduce": lambda comm, x, y: comm.all_reduce(x, y),
    "all_reduce count=": lambda comm, x, y: comm.all_reduce(x, y, count=N),
    "all_reduce_init": lambda comm, x, y: comm.all_reduce_init(x, y)(),
    "all_gather_v": lambda comm, x, y: comm.all_gather_v(x, y, [N]),
    "broadcast": lambda comm, x, y: comm.broadcast(x, y, root=0),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("producer", ["user stream", "legacy (1)"])
def test_the_call_waits_for_the_producers_stream(
    comm: Communicator, call: str, producer: str
) -> None:
    src, dst = DeviceBuffer(N, F32, device=0), DeviceBuffer(N, F32, device=0)
    src.fill_zero()
    side = Stream(non_blocking=True, device=0)
    handle = side.handle if producer == "user stream" else 0
    cai_stream = side.handle if producer == "user stream" else 1
    x = Produced(src, cai_stream)
    for step in range(3):  # the type's first call (its handler), then the inline paths
        want = np.arange(N, dtype=np.float32) + 100 * step
        dst.fill_zero()
        with Hold(handle) as hold:
            _produce(handle, src, want)
            CALLS[call](comm, x, dst)
            assert comm.stream != handle
            hold.release()
            comm.synchronize(timeout=30)
        np.testing.assert_array_equal(dst.to_numpy(), want, err_msg=f"{call}, call {step}")
    side.synchronize()
    side.close()


def test_an_interface_whose_stream_changes_in_place_is_ordered(
    comm: Communicator,
) -> None:
    # An interface kept as one dict, read by the fast path call after call: its stream
    # entry changed in place must still order the call after the new producer's work.
    from support.comm import takes_fast_path

    src, dst = DeviceBuffer(N, F32, device=0), DeviceBuffer(N, F32, device=0)
    src.fill_zero()
    cls = type("Kept", (), {})
    kept, out = cls(), cls()
    for obj, buf in ((kept, src), (out, dst)):
        obj.__cuda_array_interface__ = {
            "shape": (N,), "typestr": "<f4", "data": (buf.ptr, False), "version": 3,
            "stream": None,
        }  # fmt: skip
    comm.all_reduce(kept, out)
    assert takes_fast_path(comm.all_reduce, kept, out)
    side = Stream(non_blocking=True, device=0)
    want = np.arange(N, dtype=np.float32) + 7
    with Hold(side.handle) as hold:
        _produce(side.handle, src, want)
        kept.__cuda_array_interface__["stream"] = side.handle
        comm.all_reduce(kept, out)
        hold.release()
        comm.synchronize(timeout=30)
    np.testing.assert_array_equal(dst.to_numpy(), want)
    side.close()


def test_no_order_is_made_when_the_streams_are_the_same(
    comm: Communicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pynccl.cuda import _stream

    waits: list[tuple[int, int]] = []
    real = _stream.wait_stream

    def counted(consumer: int, producer: int, device: int | None = None) -> None:
        waits.append((consumer, producer))
        real(consumer, producer, device)

    monkeypatch.setattr(_stream, "wait_stream", counted)
    a, b = DeviceBuffer(N, F32, device=0), DeviceBuffer(N, F32, device=0)
    for cai_stream in (comm.stream, None):  # the communicator's own stream; no stream
        for _ in range(3):
            comm.all_reduce(Produced(a, cai_stream), Produced(b, cai_stream))
    comm.all_reduce(Produced(a, 1), b, stream=0)  # legacy is legacy: 1 (protocol) = 0 (CUDA)
    assert waits == []
    other = Stream(non_blocking=True, device=0)
    comm.all_reduce(Produced(a, other.handle), b)
    assert waits == [(comm.stream, other.handle)]
    comm.synchronize(timeout=30)
    other.close()


def test_the_producers_stream_entry_is_refused_when_malformed(comm: Communicator) -> None:
    a = DeviceBuffer(N, F32, device=0)
    for bad, exc, words in [
        (0, ValueError, "stream=0 is disallowed"),
        (True, TypeError, "stream True is not an int"),
        (2.5, TypeError, "stream 2.5 is not an int"),
    ]:
        for _ in range(2):  # the handler's path, then the inline one
            with pytest.raises(exc, match=words):
                comm.all_reduce(Produced(a, bad))  # type: ignore[arg-type]


# -- the communicator's stream objects -----------------------------------------------------


class OwnsItsStream:
    """A ``__cuda_stream__`` provider that owns its stream (cuda.core's Stream): the
    stream dies with it."""

    def __init__(self) -> None:
        self._stream = Stream(non_blocking=True, device=0)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._stream.handle)


def _reduce_twice(comm: Communicator, run: Any = None) -> None:
    with DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32), device=0) as x:
        y = DeviceBuffer(N, F32, device=0)
        (run or (lambda: comm.all_reduce(x, y, op="max")))()
        comm.synchronize(timeout=30)
        np.testing.assert_array_equal(y.to_numpy(), np.arange(N, dtype=np.float32))
        y.close()


@pytest.mark.parametrize("make", [Stream, OwnsItsStream], ids=["Stream", "__cuda_stream__"])
def test_the_streams_a_communicator_was_given_stay_alive(make: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0, stream=make())
    try:
        gc.collect()
        _reduce_twice(comm)  # the constructor's stream
        comm.stream = make()
        gc.collect()
        _reduce_twice(comm)  # the setter's
        child = comm.split(0)
        assert child is not None
        comm.stream = None  # the parent lets go; the child keeps it
        gc.collect()
        _reduce_twice(child)
        child.destroy()
        s = make()
        ref = weakref.ref(s)
        comm.stream = s
        del s
        gc.collect()
        assert ref() is not None
        comm.stream = None  # not kept once replaced
        gc.collect()
        assert ref() is None
    finally:
        comm.destroy()


@pytest.mark.parametrize("given", ["stream=", "the communicator's"])
def test_a_persistent_op_keeps_its_stream(given: str) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    try:
        with DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32), device=0) as x:
            y = DeviceBuffer(N, F32, device=0)
            if given == "stream=":
                op = comm.all_reduce_init(x, y, stream=Stream(non_blocking=True))
            else:
                comm.stream = Stream(non_blocking=True)
                op = comm.all_reduce_init(x, y)
                comm.stream = None  # the op still issues on the stream it was made with
            gc.collect()
            for _ in range(2):
                op()
                comm.synchronize(op._stream, timeout=30)
                np.testing.assert_array_equal(y.to_numpy(), np.arange(N, dtype=np.float32))
            op.close()
            y.close()
    finally:
        comm.destroy()


# -- DeviceBuffer's helpers -------------------------------------------------------------------


class CudaSemantics:
    """The runtime as CUDA documents its synchronous-looking calls (cudart API sync
    behaviour): ``cudaMemset``, device-to-device and pageable host-to-device
    ``cudaMemcpy`` return once the work is enqueued on the legacy default stream (the
    host bytes staged first). The loopback of today waits; a GPU does not."""

    def __init__(self, rt: Any) -> None:
        self._rt = rt
        self._staged: list[object] = []

    def cudaMemset(self, ptr: int, value: int, nbytes: int) -> None:
        self._rt.cudaMemsetAsync(ptr, value, nbytes, 0)

    def cudaMemcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        if kind == 2:  # device to host: CUDA waits
            self._rt.cudaMemcpy(dst, src, nbytes, kind)
            return
        if kind == 1:  # pageable host memory: staged, then the DMA runs later
            stage = ctypes.create_string_buffer(ctypes.string_at(src, nbytes), nbytes)
            self._staged.append(stage)
            src = ctypes.addressof(stage)
        self._rt.cudaMemcpyAsync(dst, src, nbytes, kind, 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)


@pytest.fixture
def cuda_semantics(monkeypatch: pytest.MonkeyPatch) -> CudaSemantics:
    from pynccl.cuda import _runtime

    proxy = CudaSemantics(_runtime._rt())
    monkeypatch.setattr(_runtime, "_rt", lambda: proxy)
    return proxy


FIVES = np.full(N, 5, np.float32)
HELPERS = {
    "fill_zero()": (lambda b, o: b.fill_zero(), np.zeros(N, np.float32)),
    "copy_from(DeviceBuffer)": (lambda b, o: b.copy_from(o), np.full(N, 7, np.float32)),
    "copy_from(numpy)": (lambda b, o: b.copy_from(FIVES.copy()), FIVES),
}


@pytest.mark.parametrize("helper", [*HELPERS, "from_numpy()"])
def test_helpers_that_say_finished_are_finished_on_return(
    cuda_semantics: CudaSemantics, helper: str
) -> None:
    buf = DeviceBuffer.from_numpy(np.full(N, 3, np.float32), device=0)
    other = DeviceBuffer.from_numpy(np.full(N, 7, np.float32), device=0)
    hold = Hold(0)  # the legacy default stream: the helpers' own when given none
    timer = threading.Timer(0.3, hold.release)
    timer.start()
    try:
        if helper == "from_numpy()":
            want = np.arange(N, dtype=np.float32)
            made = DeviceBuffer.from_numpy(want, device=0)
            got = read_f32(made.ptr, N)
        else:
            run, want = HELPERS[helper]
            run(buf, other)
            got = read_f32(buf.ptr, N)
    finally:
        hold.release()
        timer.join()
    np.testing.assert_array_equal(got, want)


def test_fill_zero_on_a_stream_is_queued_there(cuda_semantics: CudaSemantics) -> None:
    buf = DeviceBuffer.from_numpy(np.full(N, 3, np.float32), device=0)
    s = Stream(non_blocking=True, device=0)
    with Hold(s.handle) as hold:
        buf.fill_zero(s)  # returns while its stream is held: stream-ordered, not waited
        np.testing.assert_array_equal(read_f32(buf.ptr, N), np.full(N, 3, np.float32))
        hold.release()
        s.synchronize()
    np.testing.assert_array_equal(read_f32(buf.ptr, N), np.zeros(N, np.float32))
    s.close()


# -- memory kept until the work using it has run ----------------------------------------------


@pytest.fixture
def pool(comm: Communicator) -> Iterator[CachingAllocator]:
    # Ordered on the legacy default stream, which the communicator's (non-blocking)
    # stream does not wait for: only what pynccl keeps alive stays alive.
    with CachingAllocator(device=0) as p:
        yield p


def test_the_caching_allocator_reuses_and_poisons_at_once(pool: CachingAllocator) -> None:
    a = pool.from_numpy(np.arange(N, dtype=np.float32))
    ptr = a.ptr
    del a  # the last reference: back in the pool, poisoned
    b = pool.empty(N, "float32")
    assert (b.ptr, pool.reused, pool.poisoned) == (ptr, 1, 1)
    assert bytes(b.to_numpy().tobytes()) == b"\xa5" * 4 * N


def test_a_closed_persistent_op_keeps_its_buffers_until_its_stream_passed(
    comm: Communicator, pool: CachingAllocator
) -> None:
    want = np.arange(N, dtype=np.float32) + 1
    x, y = pool.from_numpy(want), pool.empty(N, "float32")
    op = comm.all_reduce_init(x, y)
    with Hold(comm.stream) as hold:
        op()
        op.close()
        del x  # the op's work has not run: x must not go back to the pool yet
        z = pool.empty(N, "float32")  # a new owner for x's block, were it free
        z.copy_from(np.full(N, -1, np.float32))
        hold.release()
        before = pool.poisoned
        comm.synchronize(timeout=30)
    np.testing.assert_array_equal(y.to_numpy(), want)
    assert pool.poisoned == before + 1  # its stream passed: synchronize() released x


def test_a_device_premul_scalar_lives_as_long_as_its_op(
    comm: Communicator, pool: CachingAllocator
) -> None:
    data = np.arange(N, dtype=np.float32)
    scalar = pool.from_numpy(np.array([2.0], np.float32))
    op = comm.create_premul_sum(scalar, "float32", residence="device")
    del scalar  # the op holds it
    pool.empty(1, "float32").copy_from(np.array([-1.0], np.float32))  # would take its block
    x, y = pool.from_numpy(data), pool.empty(N, "float32")
    comm.all_reduce(x, y, op=op)
    comm.synchronize(timeout=30)
    np.testing.assert_array_equal(y.to_numpy(), 2 * data)
    with Hold(comm.stream) as hold:  # destroyed while a call using it is still queued
        comm.all_reduce(y, x, op=op)
        comm.destroy_op(op)
        pool.empty(1, "float32").copy_from(np.array([-1.0], np.float32))
        hold.release()
        comm.synchronize(timeout=30)
    np.testing.assert_array_equal(x.to_numpy(), 4 * data)


# -- finalizers ------------------------------------------------------------------------------


def test_a_finalized_buffer_never_waits_for_its_device() -> None:
    # cudaFree waits for the device. A DeviceBuffer's finalizer runs wherever the garbage
    # collector does - on a GPU possibly a rank thread whose peers need it to go on before
    # that device can drain - so it hands the free to a reaper thread instead of waiting.
    from pynccl.cuda._buffer import wait_dropped

    buf = DeviceBuffer(N, "float32")
    with Hold(0) as hold:  # the legacy stream: the device cannot drain while held
        del buf  # returns at once (it used to wait until the hold ran out)
        assert not wait_dropped(timeout=0.2)  # the free waits on the reaper, not here
        hold.release()
    assert wait_dropped(timeout=10)
