"""all_gather_v, reduce_scatter_v, all_to_all_v and barrier on the loopback, in thread
worlds of 1-4 ranks: uneven and zero counts, explicit displacements (gaps between blocks),
several data types, results against numpy; every mistake refused before anything is
issued (the receive buffer unchanged); capture into a CUDA graph and replay."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.worlds import ThreadWorld

from pynccl import Communicator, NcclInvalidUsage, UniqueId
from pynccl.cuda import DeviceBuffer, Graph, Stream

SIZES = [1, 2, 3, 4]
DTYPES = ["float32", "int32", "float64"]
SENTINEL = -7


def _counts(n: int, seed: int) -> list[int]:
    """Uneven counts with zeros among them (rank 1's block is empty when n > 1)."""
    rng = np.random.default_rng(seed)
    counts = [int(c) for c in rng.integers(1, 9, size=n)]
    if n > 1:
        counts[1] = 0
    return counts


def _data(rank: int, n: int, dtype: str, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    return rng.integers(-50, 50, size=n).astype(dtype)


def _gappy_displs(counts: list[int]) -> list[int]:
    """Displacements with a gap of 2 elements before every block, in reverse rank order."""
    out, at = [0] * len(counts), 0
    for j in reversed(range(len(counts))):
        at += 2
        out[j] = at
        at += counts[j]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gaps", [False, True])
def test_all_gather_v(
    thread_worlds: Callable[[int], ThreadWorld], n: int, dtype: str, gaps: bool
) -> None:
    counts = _counts(n, n)
    displs = _gappy_displs(counts) if gaps else None
    offs = displs if displs is not None else list(np.cumsum([0, *counts[:-1]]))
    total = max(d + c for d, c in zip(offs, counts)) + 1

    def run(r: int, comm: Any) -> np.ndarray:
        with (
            DeviceBuffer.from_numpy(_data(r, counts[r], dtype)) as x,
            DeviceBuffer.from_numpy(np.full(total, SENTINEL, dtype)) as y,
        ):
            comm.all_gather_v(x, y, counts, displs=displs)
            comm.synchronize(timeout=30)
            return y.to_numpy()

    out = thread_worlds(n).run(run)
    expect = np.full(total, SENTINEL, dtype)
    for j in range(n):
        expect[offs[j] : offs[j] + counts[j]] = _data(j, counts[j], dtype)
    for r in range(n):
        np.testing.assert_array_equal(out[r], expect)


def test_all_gather_v_in_place_and_raw_pointers(
    thread_worlds: Callable[[int], ThreadWorld],
) -> None:
    n = 3
    counts = [2, 0, 5]
    offs = [0, 2, 2]
    total = sum(counts)

    def run(r: int, comm: Any) -> tuple[np.ndarray, np.ndarray]:
        start = np.full(total, SENTINEL, np.float64)
        start[offs[r] : offs[r] + counts[r]] = _data(r, counts[r], "float64")
        with (
            DeviceBuffer.from_numpy(start) as y,
            DeviceBuffer.from_numpy(_data(r, counts[r], "float64")) as x,
            DeviceBuffer(total, "float64") as z,
        ):
            comm.all_gather_v(None, y, counts)
            comm.all_gather_v(x.ptr, z.ptr, counts, dtype="float64")
            comm.synchronize(timeout=30)
            return y.to_numpy(), z.to_numpy()

    out = thread_worlds(n).run(run)
    expect = np.concatenate([_data(j, counts[j], "float64") for j in range(n)])
    for r in range(n):
        np.testing.assert_array_equal(out[r][0], expect)
        np.testing.assert_array_equal(out[r][1], expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "max", "prod"])
def test_reduce_scatter_v(
    thread_worlds: Callable[[int], ThreadWorld], n: int, dtype: str, op: str
) -> None:
    counts = _counts(n, 10 + n)
    displs = _gappy_displs(counts)
    total = max(d + c for d, c in zip(displs, counts))
    reduce = {"sum": np.sum, "max": np.max, "prod": np.prod}[op]

    def src(r: int) -> np.ndarray:
        a = _data(r, total, dtype, salt=3)
        return a if op != "prod" else (np.abs(a) % 3 + 1).astype(dtype)

    def run(r: int, comm: Any) -> np.ndarray:
        with (
            DeviceBuffer.from_numpy(src(r)) as x,
            DeviceBuffer.from_numpy(np.full(counts[r] + 1, SENTINEL, dtype)) as y,
        ):
            comm.reduce_scatter_v(x, y, counts, op, displs=displs)
            comm.synchronize(timeout=30)
            return y.to_numpy()

    out = thread_worlds(n).run(run)
    stacked = np.stack([src(j) for j in range(n)])
    for r in range(n):
        block = stacked[:, displs[r] : displs[r] + counts[r]]
        expect = reduce(block, axis=0).astype(dtype)
        np.testing.assert_allclose(out[r][: counts[r]], expect, rtol=1e-12)
        assert out[r][counts[r]] == SENTINEL  # nothing written past the block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_all_to_all_v(thread_worlds: Callable[[int], ThreadWorld], n: int, dtype: str) -> None:
    # rank i sends m[i][j] elements to rank j (zeros included: the diagonal of rank 1, ...)
    rng = np.random.default_rng(77 + n)
    m = rng.integers(0, 5, size=(n, n))
    m[0, n - 1] = 0

    def block(i: int, j: int) -> np.ndarray:
        return _data(100 * i + j, int(m[i, j]), dtype, salt=5)

    def run(r: int, comm: Any) -> np.ndarray:
        send_counts = [int(c) for c in m[r]]
        recv_counts = [int(m[j, r]) for j in range(n)]
        recv_displs = _gappy_displs(recv_counts)
        total = max([d + c for d, c in zip(recv_displs, recv_counts)] + [0]) + 1
        sendbuf = np.concatenate([block(r, j) for j in range(n)])
        with (
            DeviceBuffer.from_numpy(sendbuf) as x,
            DeviceBuffer.from_numpy(np.full(total, SENTINEL, dtype)) as y,
        ):
            comm.all_to_all_v(x, y, send_counts, recv_counts, recv_displs=recv_displs)
            comm.synchronize(timeout=30)
            return y.to_numpy()

    out = thread_worlds(n).run(run)
    for r in range(n):
        recv_counts = [int(m[j, r]) for j in range(n)]
        recv_displs = _gappy_displs(recv_counts)
        expect = np.full(len(out[r]), SENTINEL, dtype)
        for j in range(n):
            expect[recv_displs[j] : recv_displs[j] + recv_counts[j]] = block(j, r)
        np.testing.assert_array_equal(out[r], expect)


def test_complex_counts_are_complex_elements(thread_worlds: Callable[[int], ThreadWorld]) -> None:
    n = 2
    counts = [3, 1]

    def data(r: int) -> np.ndarray:
        return (np.arange(counts[r]) + 1j * (r + 1)).astype(np.complex64)

    def run(r: int, comm: Any) -> np.ndarray:
        with DeviceBuffer.from_numpy(data(r)) as x, DeviceBuffer(4, "complex64") as y:
            comm.all_gather_v(x, y, counts)
            comm.synchronize(timeout=30)
            return y.to_numpy()

    out = thread_worlds(n).run(run)
    for r in range(n):
        np.testing.assert_array_equal(out[r], np.concatenate([data(0), data(1)]))


# --- mistakes: refused before anything is issued -------------------------------------------


def _mistakes(
    comm: Any, x: Any, y: Any, big: Any
) -> list[tuple[type[BaseException], str, Callable[[], None]]]:
    ok = [2] * comm.size
    return [
        (
            ValueError,
            "counts has 1 entries; expected one per rank (2)",
            lambda: comm.all_gather_v(x, y, [2]),
        ),
        (TypeError, "counts must be a sequence of 2 counts", lambda: comm.all_gather_v(x, y, 4)),
        (ValueError, "counts[1]=-1 is out of range", lambda: comm.all_gather_v(x, y, [2, -1])),
        (
            TypeError,
            "counts[0] must be a non-negative int, got float 2.0",
            lambda: comm.all_gather_v(x, y, [2.0, 2]),
        ),
        (
            ValueError,
            "recvbuf holds 4 elements but displs[1] + counts[1] = 3 + 2 needs 5",
            lambda: comm.all_gather_v(x, y, ok, displs=[0, 3]),
        ),
        (
            ValueError,
            "sendbuf holds 2 elements but counts[",
            lambda: comm.all_gather_v(x, big, [3, 3]),
        ),
        (TypeError, "recvbuf is a raw pointer", lambda: comm.all_gather_v(x, y.ptr, ok)),
        (
            TypeError,
            "dtype=int32 does not match sendbuf, whose data type is float32",
            lambda: comm.all_gather_v(x, y.ptr, ok, dtype="int32"),
        ),
        (
            TypeError,
            "sendbuf and recvbuf have different data types: sendbuf is float32 but "
            "recvbuf is float64",
            lambda: comm.all_gather_v(x, big, ok),
        ),
        (ValueError, "displs has 3 entries", lambda: comm.all_gather_v(x, y, ok, displs=[0, 1, 2])),
        (
            ValueError,
            "recv_displs[0] + recv_counts[0] = 3 + 2 needs 5",
            lambda: comm.all_to_all_v(x, y, [1, 1], ok, recv_displs=[3, 0]),
        ),
        (
            ValueError,
            "sendbuf holds 2 elements but send_displs[1] + send_counts[1] = 2 + 2 needs 4",
            lambda: comm.all_to_all_v(x, y, ok, ok),
        ),
        (
            ValueError,
            "recvbuf holds 4 elements but counts[",
            lambda: comm.reduce_scatter_v(y, y, [5, 5]),
        ),
        (
            ValueError,
            "op 'bogus' is not a reduction op",
            lambda: comm.reduce_scatter_v(y, x, ok, "bogus"),
        ),
        (TypeError, "sendbuf must be a device buffer", lambda: comm.reduce_scatter_v(None, x, ok)),
    ]


def test_every_mistake_is_refused_before_issuing(
    thread_worlds: Callable[[int], ThreadWorld],
) -> None:
    world = thread_worlds(2)

    def run(r: int, comm: Any) -> list[str]:
        failures = []
        with (
            DeviceBuffer.from_numpy(np.ones(2, np.float32)) as x,
            DeviceBuffer.from_numpy(np.full(4, SENTINEL, np.float32)) as y,
            DeviceBuffer(8, "float64") as big,
        ):
            seq = comm.flight_record()[-1][0] if comm.flight_record() else 0
            for kind, words, call in _mistakes(comm, x, y, big):
                try:
                    call()
                except kind as e:
                    if words not in str(e):
                        failures.append(f"{words!r} not in {e!r}")
                else:
                    failures.append(f"not refused: {words!r}")
            after = comm.flight_record()[-1][0] if comm.flight_record() else 0
            if after != seq:
                failures.append(f"{after - seq} operations were issued")
            comm.synchronize(timeout=30)
            if not np.array_equal(y.to_numpy(), np.full(4, SENTINEL, np.float32)):
                failures.append("recvbuf changed")
        return failures

    for failures in world.run(run).values():
        assert failures == []


# --- barrier and graphs --------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_barrier_orders_work_across_ranks(
    thread_worlds: Callable[[int], ThreadWorld], n: int
) -> None:
    def run(r: int, comm: Any) -> tuple[str, bool]:
        seq = comm.flight_record()[-1][0] if comm.flight_record() else 0
        comm.barrier()
        comm.barrier()
        comm.synchronize(timeout=30)
        items = [it for it in comm.flight_record() if it[0] > seq]
        bufs = comm._barrier_buf
        return items[-1][1], len(bufs) == 1 and not bufs[0].closed

    for function, allocated in thread_worlds(n).run(run).values():
        assert function == "ncclAllReduce" and allocated


def test_barrier_buffer_is_freed_at_destroy_and_abort(lb: Any) -> None:
    for end in ("destroy", "abort"):
        world = ThreadWorld(2)
        try:
            world.run(lambda r, c: (c.barrier(), c.synchronize(timeout=30)))
            bufs = [c._barrier_buf[0] for c in world.comms.values()]
            assert not any(b.closed for b in bufs)
        finally:
            world.threads.run(lambda r, w=world, end=end: getattr(w.comms[r], end)())
            world.threads.close()
        assert all(b.closed for b in bufs)
        assert all(c._barrier_buf == [] for c in world.comms.values())
        with pytest.raises(NcclInvalidUsage, match=r"is (destroyed|aborted)"):
            world.comms[0].barrier()


def test_v_collectives_and_barrier_capture_and_replay(
    thread_worlds: Callable[[int], ThreadWorld],
) -> None:
    n = 3
    counts = [1, 3, 2]
    total = sum(counts)

    def run(r: int, comm: Any) -> list[np.ndarray]:
        s = Stream(non_blocking=True)
        x = DeviceBuffer.from_numpy(np.zeros(counts[r], np.float32))
        y = DeviceBuffer.from_numpy(np.zeros(total, np.float32))
        z = DeviceBuffer.from_numpy(np.zeros(counts[r], np.float32))
        comm.barrier(stream=s)  # allocates outside the capture
        comm.synchronize(s, timeout=30)
        g = Graph()
        try:
            with g.capture(s, "thread_local"):
                comm.all_gather_v(x, y, counts, stream=s)
                comm.barrier(stream=s)
                comm.reduce_scatter_v(y, z, counts, stream=s)
            results = []
            for step in range(2):
                x.copy_from(_data(r, counts[r], "float32", salt=step))
                g.replay()
                s.synchronize()
                results.append(y.to_numpy())
                results.append(z.to_numpy())
            return results
        finally:
            g.close()
            for b in (x, y, z):
                b.close()
            s.close()

    out = thread_worlds(n).run(run)
    offs = [0, 1, 4]
    for step in range(2):
        gathered = np.concatenate([_data(j, counts[j], "float32", salt=step) for j in range(n)])
        for r in range(n):
            np.testing.assert_array_equal(out[r][2 * step], gathered)
            np.testing.assert_array_equal(
                out[r][2 * step + 1], n * gathered[offs[r] : offs[r] + counts[r]]
            )


def test_barrier_first_call_is_refused_inside_a_capture(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    s = Stream(non_blocking=True)
    g = Graph()
    try:
        with DeviceBuffer.from_numpy(np.ones(3, np.float32)) as x, DeviceBuffer(3, "float32") as y:
            with g.capture(s, "thread_local"):
                with pytest.raises(NcclInvalidUsage, match=r"barrier's first call .* CUDA graph"):
                    comm.barrier(stream=s)
                comm.all_reduce(x, y, stream=s)  # the capture is intact
            assert comm._barrier_buf == []
            g.replay()
            s.synchronize()
            np.testing.assert_array_equal(y.to_numpy(), np.ones(3, np.float32))
            comm.barrier(stream=s)  # outside a capture: allocates
            comm.synchronize(s, timeout=30)
            assert len(comm._barrier_buf) == 1
    finally:
        g.close()
        s.close()
        comm.destroy()


WORKER = """
import numpy as np
import pynccl
from pynccl.cuda import DeviceBuffer

comm = pynccl.Communicator.from_env()
r, n = comm.rank, comm.size
counts = [(3 * j + 1) % 5 for j in range(n)]  # 1, 4, 2, 0: uneven, one empty block
def data(j, k, salt):
    return (np.arange(k) * (j + 2) + salt).astype(np.float64)
ok = []
with DeviceBuffer.from_numpy(data(r, counts[r], 1)) as x, DeviceBuffer(sum(counts), "float64") as y:
    comm.all_gather_v(x, y, counts)
    comm.synchronize(timeout=60)
    expect = np.concatenate([data(j, counts[j], 1) for j in range(n)])
    ok.append(np.array_equal(y.to_numpy(), expect))
total = sum(counts)
with DeviceBuffer.from_numpy(data(r, total, 7)) as x, DeviceBuffer(5, "float64") as y:
    comm.reduce_scatter_v(x, y, counts, "sum")
    comm.barrier()
    comm.synchronize(timeout=60)
    start = sum(counts[:r])
    expect = sum(data(j, total, 7) for j in range(n))[start : start + counts[r]]
    ok.append(np.array_equal(y.to_numpy()[: counts[r]], expect))
sc = [(r + j) % 3 for j in range(n)]             # to rank j
rc = [(j + r) % 3 for j in range(n)]             # from rank j: its sc[r]
send = np.concatenate([data(100 * r + j, sc[j], 3) for j in range(n)] + [np.zeros(0)])
with DeviceBuffer.from_numpy(send) as x, DeviceBuffer(max(sum(rc), 1), "float64") as y:
    comm.all_to_all_v(x, y, sc, rc)
    comm.synchronize(timeout=60)
    expect = np.concatenate([data(100 * j + r, rc[j], 3) for j in range(n)] + [np.zeros(0)])
    ok.append(np.array_equal(y.to_numpy()[: sum(rc)], expect))
comm.destroy()
print(f"VCOLL rank={r} ok={all(ok)} checks={len(ok)}", flush=True)
"""


def test_four_processes(lb_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "vcoll_worker.py"
    script.write_text(WORKER)
    env = dict(lb_env)
    for key in ("PYNCCL_NCCL_LIBRARY", "PYNCCL_CUDART_LIBRARY"):
        env.pop(key, None)  # --loopback provides them
    cmd = [sys.executable, "-m", "pynccl", "launch", "-n", "4", "--loopback"]
    proc = subprocess.run(
        [*cmd, "--timeout", "120", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = sorted(
        line[line.index("VCOLL") :] for line in proc.stdout.splitlines() if "VCOLL" in line
    )
    assert lines == [f"VCOLL rank={r} ok=True checks=3" for r in range(4)], proc.stdout


def test_complex_and_real_buffers_do_not_mix(thread_worlds: Callable[[int], ThreadWorld]) -> None:
    def run(r: int, comm: Any) -> str:
        with DeviceBuffer(2, "complex64") as x, DeviceBuffer(8, "float32") as y:
            with pytest.raises(TypeError) as info:
                comm.all_gather_v(x, y, [2, 2])
            return str(info.value)

    for text in thread_worlds(2).run(run).values():
        assert text == (
            "sendbuf and recvbuf have different data types: sendbuf is complex64 but "
            "recvbuf is float32"
        )
