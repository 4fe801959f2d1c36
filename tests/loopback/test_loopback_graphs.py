"""CUDA stream capture and graphs through pynccl, on the loopback libraries.

The loopback versions of tests/gpu/test_gpu.py::test_graph_capture_and_replay: collectives
captured on a stream are recorded, not run; every replay of the graph runs them again,
reading the inputs as they are at replay time; results are checked against numpy.
Worlds: one rank, 2..4 ranks as threads (each capturing its own stream, and one thread
capturing every rank's stream inside one group), and two processes.

Inputs are written on the stream the graph runs on (``copy_from(..., stream)``,
``fill_zero(stream)``): as on a GPU, the default-stream forms only enqueue on the legacy
stream (a host-to-device copy returns once staged, a memset at once), which a
non-blocking stream does not wait for.
"""

from __future__ import annotations

import contextlib
import json
import textwrap
import threading
from collections.abc import Iterator
from ctypes import byref, c_int
from typing import Any

import numpy as np
import pytest
from support.child import result_line, run_ranks

from pynccl import cuda, library
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer, Graph, Stream
from pynccl.errors import CudaError, NcclError, NcclInvalidUsage
from pynccl.groups import group

pytestmark = pytest.mark.usefixtures("lb")

GLOBAL, THREAD_LOCAL, RELAXED = range(3)  # cudaStreamCaptureMode
CAPTURE_UNSUPPORTED = 900
CAPTURE_INVALIDATED = 901
N = 1024


@pytest.fixture
def stream() -> Iterator[Stream]:
    cuda.set_device(0)
    s = Stream(non_blocking=True)
    yield s
    s.close()


def inputs(rank: int, k: float) -> np.ndarray:
    return (np.arange(N, dtype=np.float32) % 7 + k) * (rank + 1)


def test_single_rank_capture_and_replay(stream: Stream) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer.from_numpy(np.zeros(N, np.float32), stream=stream)
    y, z = DeviceBuffer(N, "float32"), DeviceBuffer(N, "float32")
    op = comm.create_premul_sum(3.0, "float32")
    g = Graph()
    with g.capture(stream, "thread_local"):
        assert stream.is_capturing() and cuda.is_capturing(stream)
        comm.all_reduce(x, y, op, stream=stream)
        comm.all_gather(y, z, stream=stream)
    assert not stream.is_capturing() and g.captured
    for k in (1.0, 2.0, 5.0):
        x.copy_from(inputs(0, k), stream)
        y.fill_zero(stream)
        z.fill_zero(stream)
        g.replay()
        stream.synchronize()
        assert np.array_equal(y.to_numpy(), inputs(0, k) * 3)
        assert np.array_equal(z.to_numpy(), inputs(0, k) * 3)
    # replays back to back, without synchronizing in between
    y.fill_zero(stream)
    for _ in range(4):
        g.replay()
    comm.synchronize(stream, timeout=30)
    assert np.array_equal(y.to_numpy(), inputs(0, 5.0) * 3)
    g.close()
    comm.destroy_op(op)
    comm.destroy()
    for b in (x, y, z):
        b.close()


def _rank_replays(comm: Communicator, barrier: threading.Barrier, mode: int) -> dict[str, Any]:
    """One thread's rank: capture all_reduce + all_gather on its own stream, replay."""
    r, n = comm.rank, comm.size
    cuda.set_device(comm.device)
    s = Stream(non_blocking=True)
    x = DeviceBuffer.from_numpy(np.zeros(N, np.float32), stream=s)
    y = DeviceBuffer(N, "float32")
    z = DeviceBuffer(N * n, "float32")
    barrier.wait()  # nobody allocates while a global-mode capture is under way
    g = Graph()
    with g.capture(s, cuda.CaptureMode(mode)):
        comm.all_reduce(x, y, "sum", stream=s)
        comm.all_gather(x, z, stream=s)
    barrier.wait()
    ok = []
    for k in (1.0, 4.0, 9.0):
        x.copy_from(inputs(r, k), s)
        y.fill_zero(s)
        g.replay()
        g.replay()  # twice: same inputs, same results
        comm.synchronize(s, timeout=60)
        want_y = sum(inputs(q, k) for q in range(n))
        want_z = np.concatenate([inputs(q, k) for q in range(n)])
        ok.append(
            bool(np.array_equal(y.to_numpy(), want_y))
            and bool(np.array_equal(z.to_numpy(), want_z))
        )
    g.close()
    for b in (x, y, z):
        b.close()
    s.close()
    return {"ok": ok}


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("mode", [THREAD_LOCAL, GLOBAL])
def test_thread_ranks_capture_and_replay(nranks: int, mode: int) -> None:
    comms = Communicator.init_all(nranks)
    barrier = threading.Barrier(nranks, timeout=60)
    results: dict[int, Any] = {}

    def main(comm: Communicator) -> None:
        try:
            results[comm.rank] = _rank_replays(comm, barrier, mode)
        except BaseException as exc:  # reported below
            results[comm.rank] = exc
            barrier.abort()

    threads = [threading.Thread(target=main, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        for r in range(nranks):
            got = results.get(r)
            if isinstance(got, BaseException):
                raise got
            assert got == {"ok": [True, True, True]}, (r, got)
    finally:
        for c in comms:
            c.destroy()


def test_one_thread_captures_every_ranks_stream_in_a_group() -> None:
    """GroupWorld style: init_all, one thread, one group; each rank's stream is its own
    capture (the loopback records a communicator's ops on one stream)."""
    n = 3
    comms = Communicator.init_all(n)
    streams, bufs = [], []
    for c in comms:
        cuda.set_device(c.device)
        streams.append(Stream(non_blocking=True))
        bufs.append(DeviceBuffer(N, "float32"))
    cuda.set_device(0)
    graphs = [Graph() for _ in streams]
    with contextlib.ExitStack() as captures:
        for g, s in zip(graphs, streams):
            captures.enter_context(g.capture(s))
        with group():
            for c, s, b in zip(comms, streams, bufs):
                c.all_reduce(b, stream=s)  # in place
    for k in (1.0, 2.0):
        for r, b in enumerate(bufs):
            b.copy_from(inputs(r, k), streams[r])
        for g in graphs:
            g.replay()
        for c, s in zip(comms, streams):
            c.synchronize(s, timeout=60)
        want = sum(inputs(r, k) for r in range(n))
        for b in bufs:
            assert np.array_equal(b.to_numpy(), want)
    for g in graphs:
        g.close()
    for c in comms:
        c.destroy()


def test_capture_breaking_calls_raise_and_invalidate(stream: Stream) -> None:
    rt = library.cudart()
    comm = Communicator(1, UniqueId(), 0, device=0, stream=stream)
    x = DeviceBuffer(N, "float32")
    for breaking in (
        lambda: stream.synchronize(),
        lambda: x.copy_from(np.ones(N, np.float32)),  # a synchronous copy
        lambda: DeviceBuffer(16, "float32"),  # cudaMalloc in a global-mode capture
        lambda: cuda.synchronize(),
    ):
        g = Graph()
        with pytest.raises(CudaError) as end_info, g.capture(stream, "global"):
            comm.all_reduce(x)
            with pytest.raises(CudaError) as info:
                breaking()
            assert info.value.code == CAPTURE_UNSUPPORTED
            status = c_int(-1)
            rt.cudaStreamIsCapturing(stream.handle, byref(status))
            assert status.value == 2  # cudaStreamCaptureStatusInvalidated
            with pytest.raises(NcclError) as nccl_info:
                comm.all_reduce(x)  # more work on an invalidated capture
            assert "invalidated" in str(nccl_info.value)
        assert end_info.value.code == CAPTURE_INVALIDATED  # raised when the capture ends
        assert not stream.is_capturing() and not g.captured
    comm.all_reduce(x)  # the stream and the communicator are fine afterwards
    comm.synchronize(timeout=30)
    comm.destroy()
    x.close()


def test_init_split_register_are_refused_while_capturing(stream: Stream) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0, stream=stream)
    x = DeviceBuffer(N, "float32")
    g = Graph()
    with g.capture(stream, "global"):  # ends without error: the refusals did not invalidate it
        with pytest.raises(NcclInvalidUsage, match="being captured into a CUDA graph"):
            Communicator(1, UniqueId(), 0, device=0, stream=stream)
        with pytest.raises(NcclInvalidUsage, match="ncclCommSplit cannot run while"):
            comm.split(0)
        with pytest.raises(NcclInvalidUsage, match="ncclCommRegister cannot run while"):
            comm.register(x)
        comm.all_reduce(x)
    x.copy_from(np.full(N, 2, np.float32), stream)
    g.replay()
    stream.synchronize()
    assert (x.to_numpy() == 2).all()
    g.close()
    comm.destroy()
    x.close()


def test_watchdog_records_nothing_under_capture(stream: Stream) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0, stream=stream, watchdog_timeout=60)
    watch = comm._watch
    assert watch is not None
    x = DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32), stream=stream)
    y = DeviceBuffer(N, "float32")
    g = Graph()
    with g.capture(stream, "global"):
        comm.all_reduce(x, y)
        assert len(watch.events.pending) == 0  # an event recorded now would join the graph
    for _ in range(3):
        g.replay()
    comm.synchronize(timeout=30)
    assert np.array_equal(y.to_numpy(), np.arange(N, dtype=np.float32))
    comm.all_reduce(x, y)  # outside the capture, the watchdog watches again
    assert len(watch.events.pending) + len(watch.events.pool) >= 1
    comm.synchronize(timeout=30)
    assert comm.error is None
    g.close()
    comm.destroy()
    for b in (x, y):
        b.close()


def test_multi_stream_group_under_capture_is_refused(stream: Stream) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    other = Stream(non_blocking=True)
    x, y = DeviceBuffer(N, "float32"), DeviceBuffer(N, "float32")
    g = Graph()
    with g.capture(stream, "thread_local"):
        with pytest.raises(NcclInvalidUsage, match="one stream only"):
            with group():
                comm.all_reduce(x, stream=stream)
                comm.all_reduce(y, stream=other)
    g.close()
    comm.destroy()
    other.close()
    for b in (x, y):
        b.close()


def test_graph_outlives_its_communicator(stream: Stream) -> None:
    # destroy() with a live graph that captured the communicator is refused (NCCL's
    # destroy would wait for the graph: tests/comm/test_teardown.py); abort() closes the graph
    # (NCCL's abort waits for it too, and a replay would use the freed communicator).
    comm = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer.from_numpy(np.ones(N, np.float32), stream=stream)
    y = DeviceBuffer.from_numpy(np.zeros(N, np.float32), stream=stream)
    g = Graph()
    with g.capture(stream, "thread_local"):
        comm.all_reduce(x, y, stream=stream)
    with pytest.raises(NcclInvalidUsage, match="live CUDA graph"):
        comm.destroy()
    comm.abort()
    assert not g.captured and comm.state == "aborted"
    with pytest.raises(ValueError, match="closed"):
        g.replay()
    stream.synchronize()
    assert not y.to_numpy().any()  # the captured collective never ran
    for b in (x, y):
        b.close()


def test_stream_destroyed_while_capturing_a_collective() -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer(N, "float32")
    s = Stream(non_blocking=True)
    library.cudart().cudaStreamBeginCapture(s.handle, THREAD_LOCAL)  # never ended
    comm.all_reduce(x, stream=s)
    s.close()  # the capture and its template go; nothing is left queued
    comm.all_reduce(x)
    comm.synchronize(timeout=30)
    comm.destroy()
    x.close()


_PROCESS_RANK = textwrap.dedent(
    """
    import json, os
    import numpy as np
    from ctypes import byref, c_void_p
    from pynccl import cuda, library
    from pynccl.comm import Communicator, UniqueId
    from pynccl.cuda import DeviceBuffer, Stream

    rank, n = int(os.environ["RANK"]), int(os.environ["SIZE"])
    comm = Communicator(n, UniqueId.fromhex(os.environ["UID"]), rank, device=rank)
    cuda.set_device(rank)
    rt = library.cudart()
    s = Stream(non_blocking=True)
    N = 512
    x = DeviceBuffer.from_numpy(np.zeros(N, np.float32), stream=s)
    y, z = DeviceBuffer(N, "float32"), DeviceBuffer(N * n, "float32")
    graph, exe = c_void_p(), c_void_p()
    rt.cudaStreamBeginCapture(s.handle, 0)
    comm.all_reduce(x, y, stream=s)
    comm.all_gather(x, z, stream=s)
    rt.cudaStreamEndCapture(s.handle, byref(graph))
    rt.cudaGraphInstantiate(byref(exe), graph, 0)
    rt.cudaGraphDestroy(graph)
    ok = []
    for k in (1.0, 3.0):
        mine = lambda r: (np.arange(N, dtype=np.float32) + k) * (r + 1)
        x.copy_from(mine(rank), s)
        rt.cudaGraphLaunch(exe, s.handle)
        comm.synchronize(s, timeout=60)
        ok.append(bool(np.array_equal(y.to_numpy(), sum(mine(r) for r in range(n))))
                  and bool(np.array_equal(z.to_numpy(),
                                          np.concatenate([mine(r) for r in range(n)]))))
    rt.cudaGraphExecDestroy(exe)
    comm.destroy()
    print("RESULT " + json.dumps(ok))
    """
)


def test_two_processes_capture_and_replay(lb_env: dict[str, str]) -> None:
    uid = UniqueId().hex()
    envs = [{**lb_env, "RANK": str(r), "SIZE": "2", "UID": uid} for r in range(2)]
    for returncode, out, err in run_ranks(["-c", _PROCESS_RANK], envs):
        assert returncode == 0, err[-3000:]
        assert json.loads(result_line(out)[len("RESULT ") :]) == [True, True], err[-3000:]


def test_synchronize_refuses_a_capturing_stream_without_invalidating(stream: Stream) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0, stream=stream)
    x = DeviceBuffer.from_numpy(np.ones(N, np.float32), stream=stream)
    g = Graph()
    with g.capture(stream, "global"):  # would raise on exit had the capture been invalidated
        comm.all_reduce(x)
        with pytest.raises(NcclInvalidUsage, match="being captured into a CUDA graph") as info:
            comm.synchronize(timeout=5)
        assert "launch the graph, then synchronize" in str(info.value)
        assert stream.is_capturing()
    g.replay()
    comm.synchronize(timeout=30)
    assert np.array_equal(x.to_numpy(), np.ones(N, np.float32))
    g.close()
    comm.destroy()
    x.close()


def test_init_refused_while_another_stream_of_the_device_captures() -> None:
    blocking = Stream()  # a blocking stream: its capture forbids using the legacy stream
    comm = Communicator(1, UniqueId(), 0, device=0)  # on the legacy default stream
    g = Graph()
    with g.capture(blocking, "global"):
        with pytest.raises(NcclInvalidUsage, match="a stream of this device is being captured"):
            Communicator(1, UniqueId(), 0, device=0)
        with pytest.raises(NcclInvalidUsage, match="ncclCommSplit cannot run while a stream"):
            comm.split(0)
    assert g.captured  # nothing above invalidated the capture
    g.close()
    comm.destroy()
    blocking.close()


def test_graph_object_lifecycle_and_misuse(stream: Stream) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer.from_numpy(np.ones(N, np.float32), stream=stream)
    g = Graph()
    assert not g.captured and "empty" in repr(g)
    with pytest.raises(ValueError, match="nothing to replay"):
        g.replay()
    with pytest.raises(ValueError, match="legacy default stream cannot be captured"):
        with g.capture(None):
            pass
    with pytest.raises(ValueError, match="mode='sometimes'"):
        with g.capture(stream, "sometimes"):
            pass
    with pytest.raises(TypeError, match="mode must be a CaptureMode"):
        with g.capture(stream, 7):  # type: ignore[arg-type]
            pass
    # The body's exception propagates; the capture is ended and discarded.
    with pytest.raises(KeyError, match="from the body"):
        with g.capture(stream):
            comm.all_reduce(x, stream=stream)
            assert "capturing" in repr(g)
            with pytest.raises(RuntimeError, match="already capturing"):
                with g.capture(stream):
                    pass
            raise KeyError("from the body")
    assert not stream.is_capturing() and not g.captured
    # Capturing again replaces the graph: the second one doubles instead of summing.
    with g.capture(stream):
        comm.all_reduce(x, stream=stream)
    with g.capture(stream):
        comm.all_reduce(x, stream=stream, op=comm.create_premul_sum(2.0, "float32"))
    other = Stream(non_blocking=True)
    g.replay(other)  # on another stream than the capture's
    other.synchronize()
    assert np.array_equal(x.to_numpy(), np.full(N, 2, np.float32))
    with g:
        g.replay()
        stream.synchronize()
    assert not g.captured
    g.close()  # idempotent
    assert np.array_equal(x.to_numpy(), np.full(N, 4, np.float32))
    other.close()
    comm.destroy()
    x.close()


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_capture_on_a_side_stream_is_seen_by_the_capture_guard(mode: str) -> None:
    """A capture on a non-blocking side stream (the legacy stream cannot tell): refused where
    CUDA forbids unsafe calls — this thread unless relaxed, other threads in global mode."""
    side = Stream(non_blocking=True)
    comm = Communicator(1, UniqueId(), 0, device=0)  # on the legacy default stream
    x = DeviceBuffer(N, "float32")
    other_thread: list[BaseException | None] = []

    def elsewhere() -> None:
        try:
            Communicator(1, UniqueId(), 0, device=0).destroy()
            other_thread.append(None)
        except BaseException as exc:
            other_thread.append(exc)

    # synchronize() waits in relaxed capture mode where libcudart can switch to it
    # (cudaThreadExchangeStreamCaptureMode): then it is allowed, as CUDA allows it.
    relaxes = hasattr(library.cudart()._cdll, "cudaThreadExchangeStreamCaptureMode")
    g = Graph()
    with g.capture(side, mode):
        here = [
            lambda: Communicator(1, UniqueId(), 0, device=0),
            lambda: comm.split(0),
            lambda: comm.register(x),
        ]
        if relaxes:
            comm.synchronize(timeout=30)
        else:
            here.append(lambda: comm.synchronize())
        for call in here:
            if mode == "relaxed":
                continue
            with pytest.raises(NcclInvalidUsage, match="captur"):
                call()
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join(60)
        comm.all_reduce(x, stream=side)
    assert g.captured  # nothing above invalidated the capture
    if mode == "global":
        assert isinstance(other_thread[0], NcclInvalidUsage), other_thread
    else:
        assert other_thread == [None]
    if mode == "relaxed":  # the calls CUDA allows ran for real
        Communicator(1, UniqueId(), 0, device=0).destroy()
    g.close()
    comm.destroy()
    x.close()
    side.close()
