"""Persistent operations: ``comm.<method>_init(...)`` for every row of the spec table —
checked once with the method's own errors, replayed with changing data (results against
numpy), recorded like the method, buffers kept alive, refused once the communicator is
gone or the operation closed, serialized across threads, grouped fallbacks replayed on
an emulated 2.24 build, and in a 4-process world replayed with changing data (one with a
CollConfig) and captured into a CUDA graph that replays with new inputs."""

from __future__ import annotations

import gc
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.child import result_line, run_ranks
from support.worlds import ThreadWorld, use_loopback
from test_arg_policy import MISTAKES, _call, _shape

import pynccl
from pynccl import CollConfig, DataType, PersistentOp
from pynccl.comm import Communicator, UniqueId
from pynccl.comm._spec import COLLECTIVES, Where
from pynccl.cuda import DeviceBuffer, Stream
from pynccl.errors import NcclInvalidUsage

N = 4
SIZE = 3
ROOT = 2
BLOCKED = ("reduce_scatter", "scatter", "all_to_all")
GATHERING = ("all_gather", "gather", "all_to_all")
ROOTED = ("reduce", "broadcast", "gather", "scatter")
COLLS = [row.method for row in COLLECTIVES if row.where is not Where.PEER]


def _data(method: str, rank: int, step: int) -> np.ndarray:
    blocks = SIZE if method in BLOCKED else 1
    return np.arange(N * blocks, dtype=np.float32) * (step + 1) + 10 * rank


def _want(method: str, rank: int, step: int) -> np.ndarray | None:
    """What NCCL leaves in rank ``rank``'s recvbuf (numpy; None: untouched)."""
    xs = [_data(method, r, step) for r in range(SIZE)]
    total = np.sum(xs, axis=0, dtype=np.float32)
    block = slice(rank * N, (rank + 1) * N)
    return {
        "all_reduce": total,
        "reduce": total if rank == ROOT else None,
        "broadcast": xs[ROOT],
        "all_gather": np.concatenate(xs),
        "reduce_scatter": total[block],
        "gather": np.concatenate(xs) if rank == ROOT else None,
        "scatter": xs[ROOT][block],
        "all_to_all": np.concatenate([x[block] for x in xs]),
    }[method]


@pytest.fixture(scope="module")
def world(lb: Any) -> Iterator[ThreadWorld]:
    w = ThreadWorld(SIZE)
    try:
        yield w
    finally:
        w.close()


def _replay(world: ThreadWorld, method: str, kind: str, steps: int = 3) -> None:
    def one(r: int, comm: Communicator) -> list[tuple[Any, ...]]:
        send = DeviceBuffer.from_numpy(_data(method, r, 0), device=r)
        n_recv = N * SIZE if method in GATHERING else N
        recv = DeviceBuffer.from_numpy(np.full(n_recv, -1, np.float32), device=r)
        kw = {"root": ROOT} if method in ROOTED else {}
        try:
            if kind == "raw":
                count = N
                op = getattr(comm, method + "_init")(
                    send.ptr, recv.ptr, count=count, dtype=DataType.FLOAT32, **kw
                )
            else:
                op = getattr(comm, method + "_init")(send, recv, **kw)
            assert isinstance(op, PersistentOp) and op.method == method
            records = []
            for step in range(steps):
                send.copy_from(_data(method, r, step))
                before = comm._seq
                op()
                assert comm._seq == before + 1
                records.append(comm.flight_record()[-1][1:])
                comm.synchronize(timeout=60)
                want = _want(method, r, step)
                got = recv.to_numpy()
                untouched = np.full(n_recv, -1, np.float32)
                np.testing.assert_array_equal(got, untouched if want is None else want)
            # The record of a replay is the record of the same call made by the method.
            getattr(comm, method)(send, recv, **kw)
            records.append(comm.flight_record()[-1][1:])
            comm.synchronize(timeout=60)
            op.close()
            return records
        finally:
            send.close()
            recv.close()

    for records in world.run(one).values():
        assert len(set(records)) == 1, records


@pytest.mark.parametrize("kind", ["raw", "buffer"])
@pytest.mark.parametrize("method", COLLS)
def test_replays_with_changing_data_match_numpy(world: ThreadWorld, method: str, kind: str) -> None:
    _replay(world, method, kind)


def test_send_recv_ring_in_a_group(world: ThreadWorld) -> None:
    def one(r: int, comm: Communicator) -> None:
        send = DeviceBuffer(N, "float32", device=r)
        recv = DeviceBuffer(N, "float32", device=r)
        try:
            ps = comm.send_init(send, (r + 1) % SIZE)
            pr = comm.recv_init(recv, (r - 1) % SIZE)
            for step in range(3):
                send.copy_from(np.arange(N, dtype=np.float32) + 100 * r + step)
                with pynccl.group():
                    ps()
                    pr()
                comm.synchronize(timeout=60)
                src = (r - 1) % SIZE
                np.testing.assert_array_equal(
                    recv.to_numpy(), np.arange(N, dtype=np.float32) + 100 * src + step
                )
            tail = comm.flight_record()[-2:]
            assert [e[1] for e in tail] == ["ncclSend", "ncclRecv"]
            assert [e[2] for e in tail] == [(r + 1) % SIZE, (r - 1) % SIZE]
            marks = comm.format_flight_record(2)
            assert "[group" in marks  # recorded as issued inside a group
        finally:
            send.close()
            recv.close()

    world.run(one)


def test_every_row_has_an_init_with_the_method_signature(lb: Any) -> None:
    for row in COLLECTIVES:
        method = getattr(Communicator, row.method)
        init = getattr(Communicator, row.method + "_init")
        sig, want = inspect.signature(init), inspect.signature(method)
        # The method's own parameters, less async_op (a persistent op's handle is its op()).
        params = dict(want.parameters)
        assert list(params)[-1] == "async_op"
        del params["async_op"]
        assert dict(sig.parameters) == params
        assert sig.return_annotation == "PersistentOp" and want.return_annotation == "Work | None"
        assert init.__qualname__.endswith(f".{row.method}_init")
        assert f":meth:`{row.method}`" in (init.__doc__ or "")


class _Inits:
    """``comm`` with each method replaced by its ``_init`` (for test_arg_policy's _call)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name + "_init")


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_init_raises_the_methods_own_errors(solo: Communicator, mistake: str) -> None:
    override, exc, words = MISTAKES[mistake]
    a = DeviceBuffer(8, "float32", device=0)
    b = DeviceBuffer(8, "float32", device=0)
    try:
        for row in COLLECTIVES:
            if "root" in override and row.where is Where.NONE:
                continue
            before = solo._seq
            with pytest.raises(Exception) as direct:
                _call(solo, row.method, (a, b), **override)
            with pytest.raises(Exception) as init:
                _call(_Inits(solo), row.method, (a, b), **override)  # type: ignore[arg-type]
            assert type(init.value) is type(direct.value) is exc
            assert str(init.value) == str(direct.value)
            assert words in _shape(str(direct.value))
            assert solo._seq == before
    finally:
        a.close()
        b.close()


def test_temporaries_are_kept_alive_by_the_operation(solo: Communicator) -> None:
    x = np.arange(8, dtype=np.float32)
    op = solo.all_reduce_init(DeviceBuffer.from_numpy(x), DeviceBuffer(8, "float32"))
    gc.collect()
    for _ in range(3):
        op()  # the loopback's strict pointer checks would catch freed memory
    solo.synchronize(timeout=60)
    op.close()
    assert op.closed


def test_refused_after_destroy_and_abort(lb: Any) -> None:
    for end in ("destroy", "abort"):
        comm = Communicator(1, UniqueId(), 0, device=0)
        x = DeviceBuffer(8, "float32", device=0)
        try:
            op = comm.all_reduce_init(x)
            op()
            getattr(comm, end)()
            seq = comm._seq
            with pytest.raises(NcclInvalidUsage, match=f"communicator rank 0 is {end}"):
                op()
            with pytest.raises(NcclInvalidUsage):
                op(stream=0)
            with pytest.raises(NcclInvalidUsage):
                comm.all_reduce_init(x)
            assert comm._seq == seq
        finally:
            x.close()


def test_refused_after_close_or_when_a_buffer_was_freed(solo: Communicator) -> None:
    x = DeviceBuffer(8, "float32", device=0)
    op = solo.all_reduce_init(x)
    seq = solo._seq
    x.close()
    with pytest.raises(ValueError, match="was closed"):
        op()
    with op:
        pass
    with pytest.raises(NcclInvalidUsage, match="persistent all_reduce was closed"):
        op()
    assert solo._seq == seq and "closed" in repr(op)


def test_a_destroyed_custom_op_is_refused(solo: Communicator) -> None:
    x = DeviceBuffer(8, "float32", device=0)
    try:
        premul = solo.create_premul_sum(2.0, "float32")
        op = solo.all_reduce_init(x, op=premul)
        op()
        solo.destroy_op(premul)
        seq = solo._seq
        with pytest.raises(ValueError, match="was destroyed"):
            op()
        assert solo._seq == seq
    finally:
        x.close()


def test_another_stream_and_a_config(solo: Communicator) -> None:
    x = DeviceBuffer.from_numpy(np.arange(8, dtype=np.float32), device=0)
    s = Stream()
    try:
        op = solo.all_reduce_init(x, config=CollConfig(max_ctas=2))
        assert op.function == "ncclAllReduceConfig"
        op()
        op(stream=s)
        first, second = solo.flight_record()[-2:]
        assert first[1] == second[1] == "ncclAllReduceConfig"
        assert first[3][-1] == 0 and second[3][-1] == s.handle  # the stream, last argument
        s.synchronize()
        solo.synchronize(timeout=60)
        np.testing.assert_array_equal(x.to_numpy(), np.arange(8, dtype=np.float32))
    finally:
        x.close()
        s.close()


def test_other_streams_each_get_their_own_call_and_are_checked_first(solo: Communicator) -> None:
    # op(stream=) prebuilds the call for each stream on its first use: every later call on
    # it, by handle or by Stream, must pass that stream (not another one's call), and a
    # value that merely equals a handle (True, 2.0) is refused as comm.all_reduce refuses it.
    x = DeviceBuffer.from_numpy(np.arange(8, dtype=np.float32), device=0)
    s1, s2 = Stream(), Stream()
    try:
        op = solo.all_reduce_init(x)
        order = (s1.handle, s2, s1, s2.handle, s1.handle, None)
        for st in order:
            op(stream=st)
        streams = [e[3][-1] for e in solo.flight_record()[-len(order):]]
        want = [s1.handle, s2.handle, s1.handle, s2.handle, s1.handle, 0]
        assert streams == want
        seq = solo._seq
        for bad in (True, float(s1.handle)):
            with pytest.raises(TypeError) as theirs:
                solo.all_reduce(x, stream=bad)
            with pytest.raises(TypeError) as ours:
                op(stream=bad)
            assert str(ours.value) == str(theirs.value) and repr(bad) in str(ours.value)
        assert solo._seq == seq  # nothing reached NCCL
        op.close()  # waits for both streams
        solo.synchronize(timeout=60)
        np.testing.assert_array_equal(x.to_numpy(), np.arange(8, dtype=np.float32))
    finally:
        x.close()
        s1.close()
        s2.close()


def test_inside_a_group_the_operation_is_kept_alive(solo: Communicator) -> None:
    from pynccl import groups

    x = DeviceBuffer(8, "float32", device=0)
    try:
        op = solo.all_reduce_init(x)
        with pynccl.group():
            op()
            assert any(kept is op for kept in groups.kept_objects())
            op.close()  # closed inside the group: its buffers still live until the end
            assert any(kept is x for kept in groups.kept_objects())
        assert groups.kept_objects() == []
    finally:
        x.close()


def test_two_threads_are_serialized_and_all_recorded(solo: Communicator) -> None:
    x = DeviceBuffer(8, "float32", device=0)
    try:
        op = solo.all_reduce_init(x)
        seq = solo._seq
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                for _ in range(300):
                    op()
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=loop) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and solo._seq == seq + 600
        solo.synchronize(timeout=60)
    finally:
        x.close()


def test_destroy_from_another_thread_never_reaches_c_with_a_dead_handle(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer(8, "float32", device=0)
    op = comm.all_reduce_init(x)
    outcome: list[BaseException | None] = []

    def loop() -> None:
        try:
            while True:
                op()
        except NcclInvalidUsage as exc:
            outcome.append(exc)

    t = threading.Thread(target=loop)
    t.start()
    comm.destroy()
    t.join(60)
    x.close()
    assert len(outcome) == 1 and "destroyed" in str(outcome[0])


def test_the_watchdog_sees_persistent_operations(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer(8, "float32", device=0)
    try:
        comm.start_watchdog(30.0, interval=0.01)
        op = comm.all_reduce_init(x)
        watch = comm._watch
        assert watch is not None
        calls: list[int] = []
        real = watch.enqueued
        watch.enqueued = lambda seq, stream: (calls.append(seq), real(seq, stream))  # type: ignore[method-assign]
        op()
        op()
        assert calls == [comm._seq - 1, comm._seq]
        comm.synchronize(timeout=60)
        assert comm.error is None
    finally:
        comm.stop_watchdog()
        x.close()
        comm.destroy()


@pytest.mark.parametrize("method", ["gather", "scatter", "all_to_all"])
def test_grouped_fallbacks_replay_their_plan(method: str) -> None:
    with use_loopback("2.24.3"), ThreadWorld(SIZE) as world:

        def one(r: int, comm: Communicator) -> list[str]:
            send = DeviceBuffer.from_numpy(_data(method, r, 0), device=r)
            n_recv = N * SIZE if method in GATHERING else N
            recv = DeviceBuffer.from_numpy(np.full(n_recv, -1, np.float32), device=r)
            kw = {"root": ROOT} if method in ROOTED else {}
            try:
                op = getattr(comm, method + "_init")(send, recv, **kw)
                for step in range(2):
                    send.copy_from(_data(method, r, step))
                    op()
                    comm.synchronize(timeout=60)
                    want = _want(method, r, step)
                    np.testing.assert_array_equal(
                        recv.to_numpy(), np.full(n_recv, -1, np.float32) if want is None else want
                    )
                return sorted({e[1] for e in comm.flight_record()})
            finally:
                send.close()
                recv.close()

        for names in world.run(one).values():
            assert set(names) <= {"ncclSend", "ncclRecv"} and names


_PROCESS_RANK = """
import json, os
import numpy as np
from pynccl import CollConfig
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer, Graph, Stream

rank, n = int(os.environ["RANK"]), int(os.environ["SIZE"])
comm = Communicator(n, UniqueId.fromhex(os.environ["UID"]), rank, device=rank)
N = 64
x, y = DeviceBuffer(N, "float32"), DeviceBuffer(N, "float32")
big, part = DeviceBuffer(N * n, "float32"), DeviceBuffer(N, "float32")
ar = comm.all_reduce_init(x, y)
rs = comm.reduce_scatter_init(big, part, op="max", config=CollConfig(max_ctas=2))
ok = []
for k in range(3):
    mine = lambda r: np.arange(N, dtype=np.float32) * (k + 1) + r
    wide = lambda r: np.arange(N * n, dtype=np.float32) * ((r + k) % n)
    x.copy_from(mine(rank))
    big.copy_from(wide(rank))
    ar()
    rs()
    comm.synchronize(timeout=60)
    ok.append(bool(np.array_equal(y.to_numpy(), sum(mine(r) for r in range(n)))))
    top = np.max([wide(r) for r in range(n)], axis=0)[rank * N : (rank + 1) * N]
    ok.append(bool(np.array_equal(part.to_numpy(), top)))
# Captured into a CUDA graph on another stream, replayed with new inputs.
s = Stream(non_blocking=True)
g = Graph()
with g.capture(s):
    ar(stream=s)
for k in (5, 7):
    x.copy_from(np.full(N, k * (rank + 1), np.float32))
    g.replay(s)
    s.synchronize()
    ok.append(bool(np.array_equal(y.to_numpy(), np.full(N, k * n * (n + 1) // 2, np.float32))))
names = sorted({e[1] for e in comm.flight_record()})
ar.close(); rs.close()
g.close()  # NCCL's destroy waits while a graph that captured the communicator lives
for b in (x, y, big, part):
    b.close()
comm.destroy()
print("RESULT " + json.dumps([ok, names]))
"""


def test_four_processes_replay_and_capture(lb: Any, lb_env: dict[str, str]) -> None:
    import json

    uid = UniqueId().hex()
    envs = [{**lb_env, "RANK": str(r), "SIZE": "4", "UID": uid} for r in range(4)]
    for returncode, out, err in run_ranks(["-c", _PROCESS_RANK], envs):
        assert returncode == 0, err[-3000:]
        ok, names = json.loads(result_line(out)[len("RESULT ") :])
        assert ok == [True] * 8, err[-3000:]
        assert names == ["ncclAllReduce", "ncclReduceScatterConfig"]


def test_another_stream_out_of_range_is_refused_as_the_method_refuses_it(
    solo: Communicator,
) -> None:
    # The override stream of a prebuilt call is checked as comm.all_reduce(stream=) checks
    # it: -1 reached NCCL as 0xffffffffffffffff, 2**64 raised ctypes' OverflowError.
    x = DeviceBuffer(8, "float32", device=0)
    try:
        for op in (solo.all_reduce_init(x), solo.all_reduce_init(x.ptr, count=8, dtype="float32")):
            seq = solo._seq
            for bad in (-1, 1 << 64):
                with pytest.raises(ValueError, match=f"stream handle {bad} is out of range"):
                    solo.all_reduce(x, stream=bad)
                with pytest.raises(ValueError, match=f"stream handle {bad} is out of range"):
                    op(stream=bad)
            assert solo._seq == seq
            op()
            op.close()
        solo.synchronize(timeout=60)
    finally:
        x.close()


def test_a_non_blocking_communicators_persistent_and_config_calls_are_watched(lb: Any) -> None:
    # They return ncclInProgress: the persistent call and the checked path's nccl*Config
    # call took that for "not issued" and recorded no completion event, so the watchdog
    # never saw them complete (nor hang); the plain method's slots always did.
    from pynccl.comm import Config, _flight

    comm = Communicator(1, UniqueId(), 0, device=0, config=Config(blocking=False))
    x = DeviceBuffer(8, "float32", device=0)
    try:
        comm.wait_ready(timeout=60)
        comm.start_watchdog(30)
        plain, with_config = comm.all_reduce_init(x), comm.all_reduce_init(x, config=CollConfig())
        comm.all_reduce(x)
        comm.all_reduce(x, config=CollConfig(max_ctas=2))
        for op in (plain, with_config):
            op()
            op(stream=0)
        comm.synchronize(timeout=60)
        record = _flight._comm_record(comm)
        assert [o["state"] for o in record["ops"]] == ["completed"] * 6, record
        assert record["watchdog"]["completed"] == 6
        plain.close()
        with_config.close()
    finally:
        x.close()
        comm.destroy()


def test_a_non_blocking_communicators_persistent_call_is_held_by_the_graph_capturing_it(
    lb: Any,
) -> None:
    # It returns ncclInProgress, taken for "not issued": the graph was not told, so it
    # neither kept the buffers alive nor held the communicator (as comm.all_reduce's does).
    from pynccl.comm import Config
    from pynccl.cuda import Graph

    comm = Communicator(1, UniqueId(), 0, device=0, config=Config(blocking=False))
    x = DeviceBuffer(8, "float32", device=0)
    s = Stream(non_blocking=True)
    g = Graph()
    try:
        comm.wait_ready(timeout=60)
        op = comm.all_reduce_init(x)
        with g.capture(s):
            op(stream=s)
        assert g.holds(comm)
        op.close()
        g.replay(s)
        s.synchronize()
    finally:
        g.close()
        s.close()
        x.close()
        comm.destroy()
