"""One-sided operations in the object API on the loopback: put_signal / signal /
wait_signal rings in thread worlds and a 4-process world, captured into CUDA graphs and
replayed with new data, SignalWait, and the argument and version refusals.

Every rank puts its block into the next rank's window and signals; the receiver waits
for its predecessor's signal and compares what landed with numpy's copy of what the
predecessor sent. Run as a script, this module is one rank of the process world:
``python tests/comm/test_comm_signals.py <uid hex> <nranks> <rank>``.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

if __name__ == "__main__":  # the process-world worker: make the repository importable
    _here = os.path.dirname(os.path.abspath(__file__))
    while not os.path.isdir(os.path.join(_here, "pynccl")):
        _here = os.path.dirname(_here)
    sys.path.insert(0, _here)

import pynccl
from pynccl import Communicator, SignalWait
from pynccl.cuda import DeviceBuffer, Graph, Stream

N = 256  # float32 elements per block


def pattern(rank: int, round_: int) -> np.ndarray:
    """What ``rank`` sends in round ``round_``: distinct per rank, round and element."""
    return (np.arange(N, dtype=np.float32) + 1000.0 * rank + 1e5 * round_).astype(np.float32)


def barrier(comm: Communicator, stream: Any) -> None:
    """Everyone has checked the round before anyone puts the next one."""
    with DeviceBuffer(1, "float32") as tiny:
        comm.all_reduce(tiny, stream=stream)
        comm.synchronize(stream, timeout=60)


def ring(comm: Communicator, rounds: int, graphed: bool) -> list[bool]:
    """``rounds`` rounds of the ring on this rank; True per round whose data matched."""
    r, n = comm.rank, comm.size
    nxt, prev = (r + 1) % n, (r - 1) % n
    stream = Stream(non_blocking=True)
    src = comm.mem_alloc(N, "float32")
    dst = comm.mem_alloc(N, "float32")
    sw = comm.register_window(src)  # put sources must lie in a symmetric window
    dw = comm.register_window(dst)
    ok = []
    graph = Graph() if graphed else None
    try:
        if graph is not None:
            with graph.capture(stream, "relaxed"):
                comm.put_signal(src, nxt, dw, stream=stream)
                comm.wait_signal([SignalWait(prev)], stream=stream)
        for k in range(rounds):
            src.copy_from(pattern(r, k))
            if graph is not None:
                graph.replay(stream)
            else:
                comm.put_signal(src, nxt, dw, stream=stream)
                comm.wait_signal(SignalWait(prev), stream=stream)
            comm.synchronize(stream, timeout=60)
            ok.append(bool(np.array_equal(dst.to_numpy(), pattern(prev, k))))
            barrier(comm, stream)
    finally:
        if graph is not None:
            graph.close()
        dw.close()
        sw.close()
        for buf in (src, dst):
            buf.close()
        stream.close()
    return ok


@pytest.fixture(scope="module")
def get(thread_worlds: Any) -> Any:
    return thread_worlds


@pytest.mark.parametrize("size", [2, 3])
def test_put_signal_ring_in_a_thread_world(get: Any, size: int) -> None:
    world = get(size)
    out = world.run(lambda r, comm: ring(comm, 3, graphed=False))
    assert out == {r: [True] * 3 for r in range(size)}
    assert all(comm.windows == [] for comm in world.comms.values())


def test_graph_captures_put_and_wait_and_replays_new_data(get: Any) -> None:
    world = get(3)
    out = world.run(lambda r, comm: ring(comm, 3, graphed=True))
    assert out == {r: [True] * 3 for r in range(3)}


def test_put_into_a_larger_non_symmetric_window_of_the_peer(get: Any) -> None:
    # Rank 1's window is twice rank 0's: rank 0 may put past its own window's size (NCCL
    # checks the peer's); a window too small there is NCCL's error, with its text.
    world = get(2)

    def body(r: int, comm: Communicator) -> Any:
        src = comm.mem_alloc(N, "float32")
        dst = comm.mem_alloc(2 * N, "float32")
        sw = comm.register_window(src)
        dw = comm.register_window(dst, nbytes=4 * N * (r + 1), symmetric=False)
        src.copy_from(pattern(r, 0))
        barrier(comm, None)
        try:
            if r == 0:
                comm.put_signal(src, 1, dw, offset=N)  # past rank 0's own 4*N bytes
                with pytest.raises(ValueError, match="do not fit in the window of 1024 bytes"):
                    comm.put_signal(src, 1, sw, offset=1)  # symmetric: checked here
            else:
                with pytest.raises(pynccl.NcclInvalidArgument, match="do not fit in rank 0's"):
                    comm.put_signal(src, 0, dw, offset=1)
                comm.wait_signal(SignalWait(0))
            comm.synchronize(timeout=60)
            return dst.to_numpy()[N:]
        finally:
            dw.close()
            sw.close()
            src.close()
            dst.close()

    out = world.run(body)
    np.testing.assert_array_equal(out[1], pattern(0, 0))


def test_signal_without_data_and_several_waits(get: Any) -> None:
    # Every rank signals every other rank twice; each waits for count=2 from each peer
    # in one wait_signal of several descriptors (which only returns once all arrived).
    world = get(3)

    def body(r: int, comm: Communicator) -> bool:
        stream = Stream(non_blocking=True)
        try:
            peers = [p for p in range(comm.size) if p != r]
            for p in peers:
                comm.signal(p, stream=stream)
                comm.signal(p, stream=stream)
            comm.wait_signal([SignalWait(p, count=2) for p in peers], stream=stream)
            comm.synchronize(stream, timeout=60)
            return True
        finally:
            stream.close()

    assert world.run(body) == {0: True, 1: True, 2: True}


def test_abort_from_another_thread_while_signalling(lb: Any) -> None:
    # The one-sided calls pass the handle under the gate, like the collectives: an abort
    # from another thread never hands NCCL a freed communicator; the loop gets told why.
    import threading

    comm = Communicator(1, pynccl.UniqueId(), 0, device=0)
    stream = Stream(non_blocking=True)
    started = threading.Event()
    caught: list[BaseException] = []

    def loop() -> None:
        try:
            while True:
                comm.signal(0, stream=stream)
                started.set()
        except BaseException as exc:  # the abort's refusal ends the loop
            caught.append(exc)

    t = threading.Thread(target=loop)
    t.start()
    assert started.wait(30)
    comm.abort()
    t.join(30)
    assert not t.is_alive()
    assert isinstance(caught[0], pynccl.NcclInvalidUsage)
    assert "aborted" in str(caught[0])
    stream.close()


def test_signal_wait_is_a_frozen_value() -> None:
    a = SignalWait(1, count=2)
    assert a == SignalWait(1, 2, 0, 0) and hash(a) == hash(SignalWait(1, 2))
    assert a != SignalWait(1, 3)
    assert repr(a) == "SignalWait(peer=1, count=2, signal=0, context=0)"
    with pytest.raises(AttributeError, match="frozen"):
        a.peer = 2  # type: ignore[misc]
    assert not hasattr(a, "__dict__")
    assert SignalWait(np.int64(3)).peer == 3
    with pytest.raises(ValueError, match=r"count=0 is out of range; expected 1 <= count"):
        SignalWait(0, count=0)
    with pytest.raises(TypeError, match=r"peer must be an int, got float 1\.0"):
        SignalWait(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="signal=-1 is out of range"):
        SignalWait(0, signal=-1)


def test_bad_arguments_are_refused_before_c(get: Any) -> None:
    world = get(2)

    def body(r: int, comm: Communicator) -> list[str]:
        src = comm.mem_alloc(N, "float32")
        plain = DeviceBuffer(N, "float32")
        win = comm.register_window(src)
        src.copy_from(pattern(r, 0))
        barrier(comm, None)  # the peer's put below lands after this copy
        seen = []
        cases = [
            (lambda: comm.put_signal(src, 2, win), ValueError,
             "peer=2 is out of range; expected 0 <= peer < 2 for a communicator of size 2"),
            (lambda: comm.put_signal(src, 1 - r, win, offset=1), ValueError,
             "offset=1 + count=256 elements of 4 bytes do not fit in the window of 1024 bytes"),
            (lambda: comm.put_signal(src, 1 - r, win, count=N + 1), ValueError, "count"),
            (lambda: comm.put_signal(src, 1 - r, win, signal=1), ValueError,
             "signal=1 is out of range; expected 0 <= signal < 1 (the communicator has "
             "numRmaSig=1, numRmaCtx=1)"),
            (lambda: comm.put_signal(src, 1 - r, win, context=1), ValueError,
             "context=1 is out of range; expected 0 <= context < 1"),
            (lambda: comm.put_signal(src, 1 - r, "win"), TypeError,  # type: ignore[arg-type]
             "window must be a pynccl.Window, got str"),
            (lambda: comm.put_signal(plain, 1 - r, win), ValueError,
             "is not inside a symmetric window of this communicator"),
            (lambda: comm.put_signal(src.ptr, 1 - r, win), TypeError, "count= and dtype="),
            (lambda: comm.signal(-1), ValueError, "peer=-1 is out of range"),
            (lambda: comm.signal(True), TypeError, "peer must be an int, got bool"),  # type: ignore[arg-type]
            (lambda: comm.wait_signal([]), ValueError, "at least one SignalWait"),
            (lambda: comm.wait_signal([SignalWait(5)]), ValueError,
             "waits[0].peer=5 is out of range; expected 0 <= waits[0].peer < 2"),
            (lambda: comm.wait_signal([SignalWait(0, signal=3)]), ValueError,
             "waits[0].signal=3 is out of range"),
            (lambda: comm.wait_signal([(0, 1)]), TypeError,  # type: ignore[list-item]
             "waits[0] must be a pynccl.SignalWait, got tuple"),
            (lambda: comm.wait_signal(5), TypeError,  # type: ignore[arg-type]
             "waits must be a SignalWait or a list of them, got int"),
        ]  # fmt: skip
        try:
            for call, kind, text in cases:
                with pytest.raises(kind) as info:
                    call()
                assert text in str(info.value), (text, str(info.value))
                seen.append(kind.__name__)
            # nothing was issued: a put and a wait still match up afterwards
            comm.put_signal(src, 1 - r, win, count=4, offset=8)
            comm.wait_signal(SignalWait(1 - r))
            comm.synchronize(timeout=60)
            assert np.array_equal(src.to_numpy()[8:12], pattern(1 - r, 0)[:4])
        finally:
            win.close()
            src.close()
            plain.close()
        return seen

    out = world.run(body)
    assert out[0] == out[1] and len(out[0]) == 15


def test_several_signals_and_contexts_from_the_config(lb: Any) -> None:
    from support.worlds import ThreadWorld

    with ThreadWorld(2, config=pynccl.Config(num_rma_sig=3, num_rma_ctx=2)) as world:

        def body(r: int, comm: Communicator) -> bool:
            stream = Stream(non_blocking=True)
            try:
                comm.signal(1 - r, signal=2, context=1, stream=stream)
                with pytest.raises(ValueError, match=r"signal=3 is out of range; expected 0 <= "
                                   r"signal < 3 \(the communicator has numRmaSig=3, numRmaCtx=2"):
                    comm.signal(1 - r, signal=3)
                with pytest.raises(ValueError, match="context=2 is out of range"):
                    comm.signal(1 - r, context=2)
                comm.wait_signal(SignalWait(1 - r, signal=2, context=1), stream=stream)
                comm.synchronize(stream, timeout=60)
                return True
            finally:
                stream.close()

        assert world.run(body) == {0: True, 1: True}


def test_ring_on_non_blocking_communicators(lb: Any) -> None:
    from support.worlds import ThreadWorld

    with ThreadWorld(2, config=pynccl.Config(blocking=False)) as world:
        out = world.run(lambda r, comm: ring(comm, 2, graphed=False))
        assert out == {0: [True, True], 1: [True, True]}
        assert all(c.windows == [] and c.state == "ready" for c in world.comms.values())


@pytest.mark.parametrize(
    ("version", "what"),
    [("2.24.3", "it requires NCCL >= 2.29.2"), ("2.30.7", "signal=1 is out of range")],
)
def test_emulated_older_releases(version: str, what: str) -> None:
    # 2.24.3 has no one-sided operations; 2.30.7 has them with signal 0 / context 0 only
    # (numRmaSig came in 2.31).
    from support.worlds import use_loopback

    with use_loopback(version):
        with Communicator(1, pynccl.UniqueId(), 0, device=0) as comm:
            kind = pynccl.NotSupportedError if "requires" in what else ValueError
            with pytest.raises(kind) as info:
                comm.signal(0, signal=1)
            assert what in str(info.value)
            if kind is pynccl.NotSupportedError:
                assert str(info.value).startswith("ncclSignal is not supported")


def test_put_signal_ring_in_a_four_process_world(lb: Any, lb_env: dict[str, str]) -> None:
    # lb: the unique id comes from the loopback libnccl the ranks use
    uid = pynccl.UniqueId()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, uid.hex(), "4", str(r)],
            env=lb_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(4)
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}:\n{out}"
        assert f"RING rank={r} ok=[True, True, True] graphed=[True, True] peer=True" in out, out


def peer_bytes(comm: Communicator) -> bool:
    """peer_pointer of the next rank (another process: its memory mapped here) reads what
    that rank wrote into its window."""
    nxt = (comm.rank + 1) % comm.size
    buf = comm.mem_alloc(N, "float32")
    buf.copy_from(pattern(comm.rank, 9))
    with comm.register_window(buf) as win:
        ptr = win.peer_pointer(nxt)
        assert ptr is not None
        seen = np.ctypeslib.as_array((ctypes.c_float * N).from_address(ptr)).copy()
        barrier(comm, None)  # nobody frees its buffer while a peer still reads it
    buf.close()
    return bool(np.array_equal(seen, pattern(nxt, 9)))


def _worker(argv: list[str]) -> int:
    uid, nranks, rank = pynccl.UniqueId.fromhex(argv[0]), int(argv[1]), int(argv[2])
    with Communicator(nranks, uid, rank, device=rank) as comm:
        ok = ring(comm, 3, graphed=False)
        graphed = ring(comm, 2, graphed=True)
        peer = peer_bytes(comm)
        assert comm.windows == []
    print(f"RING rank={rank} ok={ok} graphed={graphed} peer={peer}", flush=True)
    return 0 if all([*ok, *graphed, peer]) else 1


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
