"""The object API on the loopback libraries: argument validation (every error names the
argument and the values it reports, alike on every rank) and groups.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from support.comm import Worlds, to_device
from support.producers import CAIArray, DLPackProducer, kDLCUDA
from support.worlds import Slot, ThreadWorld

from pynccl import library
from pynccl.comm import Communicator
from pynccl.cuda import DeviceBuffer, Stream
from pynccl.enums import Result
from pynccl.errors import NcclInvalidUsage
from pynccl.groups import group, group_depth, group_end, group_start

pytestmark = pytest.mark.usefixtures("lb")


# --- argument validation --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(thread_worlds: Worlds) -> ThreadWorld:
    return thread_worlds(2)


def _raises_on_ranks(
    world: ThreadWorld,
    call: Callable[[int, Communicator], Any],
    exc: type,
    words: list[str],
    ranks: tuple[int, ...] = (0, 1),
) -> None:
    """``call`` raises ``exc`` naming ``words`` on each of ``ranks`` (the others do not
    call it), before reaching NCCL, so that no rank is left waiting for a peer."""

    def one(r: int, comm: Communicator) -> str:
        if r not in ranks:
            return " ".join(words)
        before = len(comm.flight_record())
        with pytest.raises(exc) as info:
            call(r, comm)
        assert len(comm.flight_record()) == before, "the bad call was issued"
        return str(info.value)

    for r, text in world.run(one).items():
        for word in words:
            assert word in text, f"rank {r}: {word!r} not in {text!r}"


F32 = np.float32


def _d(n: int, dtype: Any = F32, r: int = 0) -> DeviceBuffer:
    return DeviceBuffer(n, np.dtype(dtype), device=r)


VALIDATION = {
    "recv too small": (
        lambda r, c: c.all_reduce(_d(10, r=r), _d(5, r=r)),
        ValueError,
        ["recvbuf holds 5 elements", "needs 10"],
    ),
    "send too small for count": (
        lambda r, c: c.all_reduce(_d(4, r=r), _d(10, r=r), count=8),
        ValueError,
        ["sendbuf holds 4 elements", "needs 8"],
    ),
    "all_gather recv < size*count": (
        lambda r, c: c.all_gather(_d(3, r=r), _d(5, r=r)),
        ValueError,
        ["recvbuf holds 5 elements", "needs 6"],
    ),
    "reduce_scatter send < size*count": (
        lambda r, c: c.reduce_scatter(_d(7, r=r), _d(4, r=r)),
        ValueError,
        ["sendbuf holds 7 elements", "needs 8"],
    ),
    "all_to_all not a multiple": (
        lambda r, c: c.all_to_all(_d(5, r=r), _d(6, r=r)),
        ValueError,
        ["sendbuf holds 5 elements", "multiple of the 2 ranks"],
    ),
    "all_to_all recv small": (
        lambda r, c: c.all_to_all(_d(6, r=r), _d(4, r=r)),
        ValueError,
        ["recvbuf holds 4 elements", "needs 6"],
    ),
    "gather root recv small": (
        lambda r, c: c.gather(_d(3, r=r), _d(5, r=r), root=1),
        ValueError,
        ["recvbuf holds 5 elements", "needs 6"],
        (1,),  # only the root checks its recvbuf
    ),
    "scatter root send small": (
        lambda r, c: c.scatter(_d(5, r=r), _d(3, r=r), root=0),
        ValueError,
        ["sendbuf holds 5 elements", "needs 6"],
        (0,),
    ),
    "dtype mismatch": (
        lambda r, c: c.all_reduce(_d(4, r=r), _d(4, np.int32, r=r)),
        TypeError,
        ["recvbuf", "float32", "int32"],
    ),
    "dtype= disagrees with the array": (
        lambda r, c: c.all_reduce(_d(4, r=r), dtype="float64"),
        TypeError,
        ["dtype=float64", "sendbuf", "float32"],
    ),
    "root out of range": (
        lambda r, c: c.broadcast(_d(4, r=r), root=2),
        ValueError,
        ["root=2", "size 2"],
    ),
    "negative root": (
        lambda r, c: c.reduce(_d(4, r=r), root=-1),
        ValueError,
        ["root=-1", "size 2"],
    ),
    "root not an int": (
        lambda r, c: c.gather(_d(4, r=r), _d(8, r=r), root="0"),
        TypeError,
        ["root must be an int", "str"],
    ),
    "peer out of range": (
        lambda r, c: c.send(_d(4, r=r), 2),
        ValueError,
        ["peer=2", "size 2"],
    ),
    "recv peer negative": (
        lambda r, c: c.recv(_d(4, r=r), -3),
        ValueError,
        ["peer=-3", "size 2"],
    ),
    "negative count, raw": (
        lambda r, c: c.all_reduce(_d(4, r=r).ptr, count=-1, dtype="float32"),
        ValueError,
        ["count", "-1"],
    ),
    "negative count, array": (
        lambda r, c: c.broadcast(_d(4, r=r), count=-2),
        ValueError,
        ["count=-2", "out of range"],
    ),
    "raw pointer without count": (
        lambda r, c: c.all_reduce(_d(4, r=r).ptr, dtype="float32"),
        TypeError,
        ["raw pointer", "count="],
    ),
    "raw pointer without dtype": (
        lambda r, c: c.broadcast(_d(4, r=r).ptr, count=4),
        TypeError,
        ["raw pointer", "dtype="],
    ),
    "raw recv without count": (
        lambda r, c: c.recv(_d(4, r=r).ptr, 0),
        TypeError,
        ["recvbuf", "raw pointer"],
    ),
    "NULL raw pointer": (
        lambda r, c: c.all_reduce(0, count=4, dtype="float32"),
        ValueError,
        ["NULL"],
    ),
    # ctypes silently wraps a c_void_p / size_t of 2**64 and up into another value:
    # every raw-pointer route must refuse those itself.
    "raw pointer past 2**64": (
        lambda r, c: c.all_reduce(_d(4, r=r).ptr, (1 << 64) + _d(4, r=r).ptr, count=4, dtype="f4"),
        ValueError,
        ["recvbuf=", "not a valid pointer", "2**64"],
    ),
    "negative raw pointer": (
        lambda r, c: c.all_gather(-_d(4, r=r).ptr, _d(8, r=r).ptr, count=4, dtype="float32"),
        ValueError,
        ["sendbuf=-", "not a valid pointer"],
    ),
    "raw pointer past 2**64, p2p": (
        lambda r, c: c.send(1 << 64, 1 - r, count=4, dtype="float32"),
        ValueError,
        ["sendbuf=0x10000000000000000", "not a valid pointer"],
    ),
    "count of 2**64, raw": (
        lambda r, c: c.all_reduce(_d(4, r=r).ptr, count=1 << 64, dtype="float32"),
        ValueError,
        ["count=18446744073709551616", "2**64"],
    ),
    "count of 2**64, reduce_scatter": (
        lambda r, c: c.reduce_scatter(_d(4, r=r).ptr, _d(4, r=r).ptr, count=1 << 64, dtype="f4"),
        ValueError,
        ["count=18446744073709551616", "expected 0 <= count < 2**64"],
    ),
    "unknown op": (
        lambda r, c: c.all_reduce(_d(4, r=r), op="mean"),
        ValueError,
        ["op 'mean'", "sum"],
    ),
    "unknown dtype": (
        lambda r, c: c.all_reduce(_d(4, r=r).ptr, count=4, dtype="complex64"),
        TypeError,
        ["complex64"],
    ),
    "gather root needs recvbuf": (
        lambda r, c: c.gather(_d(4, r=r), None, root=r),
        TypeError,
        ["recvbuf is required on the root"],
    ),
    "scatter root needs sendbuf": (
        lambda r, c: c.scatter(None, _d(4, r=r), root=r),
        TypeError,
        ["sendbuf is required on the root"],
    ),
    "host numpy array": (
        lambda r, c: c.all_reduce(np.zeros(4, F32)),  # numpy exports DLPack: kDLCPU
        ValueError,
        ["sendbuf", "CPU", "device memory"],
    ),
    "not a buffer": (
        lambda r, c: c.all_gather("abc", _d(4, r=r)),
        TypeError,
        ["sendbuf must be", "str"],
    ),
    "wrong device": (
        lambda r, c: c.all_reduce(_d(4, r=1 - r)),
        ValueError,
        ["sendbuf is on device", "communicator is on device"],
    ),
    "wrong device, recvbuf": (
        lambda r, c: c.reduce_scatter(_d(8, r=r), _d(4, r=1 - r)),
        ValueError,
        ["recvbuf is on device", "communicator is on device"],
    ),
    "non-contiguous CAI": (
        lambda r, c: c.all_reduce(_strided(r)),
        ValueError,
        ["sendbuf", "non-contiguous", "strides"],
    ),
    "non-contiguous DLPack": (
        lambda r, c: c.broadcast(_strided(r, dlpack=True)),
        ValueError,
        ["sendbuf", "non-contiguous"],
    ),
    "read-only recvbuf": (
        lambda r, c: c.all_reduce(_d(4, r=r), _readonly(r)),
        ValueError,
        ["recvbuf", "read-only"],
    ),
    "DLPack on the CPU": (
        lambda r, c: c.all_reduce(DLPackProducer(np.zeros(4, F32), device=(1, 0))),
        ValueError,
        ["sendbuf", "CPU", "device memory"],
    ),
    "bad stream": (
        lambda r, c: c.all_reduce(_d(4, r=r), stream="default"),
        TypeError,
        ["stream"],
    ),
}

_KEEP: list[Any] = []  # device memory behind the strided / read-only views, freed at exit


def _device_view(r: int, n: int) -> np.ndarray:
    import ctypes

    buf = _d(n, r=r)
    _KEEP.append(buf)
    raw = (ctypes.c_uint8 * buf.nbytes).from_address(buf.ptr)
    return np.frombuffer(raw, np.uint8).view(F32)


def _strided(r: int, dlpack: bool = False) -> Any:
    view = _device_view(r, 8)[::2]
    return DLPackProducer(view, device=(kDLCUDA, r)) if dlpack else CAIArray(view)


def _readonly(r: int) -> Any:
    return CAIArray(_device_view(r, 4), readonly=True)


@pytest.mark.parametrize("case", list(VALIDATION), ids=list(VALIDATION))
def test_validation_error_names_the_argument(pair: ThreadWorld, case: str) -> None:
    call, exc, words, *ranks = VALIDATION[case]
    try:
        _raises_on_ranks(pair, call, exc, words, *ranks)
    finally:
        for buf in _KEEP:
            buf.close()
        _KEEP.clear()
        gc.collect()


def test_count_may_be_smaller_than_the_arrays(pair: ThreadWorld) -> None:
    # count= is NCCL's per-rank count; the arrays may be larger (only count is touched).
    def one(r: int, comm: Communicator) -> np.ndarray:
        with (
            to_device(np.arange(6) + 10 * r, device=r) as s,
            to_device(np.full(6, -1.0), device=r) as d,
        ):
            comm.all_reduce(s, d, count=4)
            comm.synchronize()
            return d.to_numpy()

    for got in pair.run(one).values():
        assert got.tolist() == [10, 12, 14, 16, -1, -1]


def test_cuda_array_interface_with_device_and_dlpack_deleters(pair: ThreadWorld) -> None:
    # DLPack capsules are read, never consumed: each export is released (deleter
    # called) once the call is done, so nothing accumulates.
    def one(r: int, comm: Communicator) -> tuple[list[float], int]:
        send = Slot("dlpack", np.array([r + 1.0, 2.0], F32), r)
        recv = Slot("cai", np.zeros(2, F32), r)
        producer = send.obj
        comm.all_reduce(producer, recv.obj, "max")
        comm.synchronize()
        out = recv.read().tolist()
        gc.collect()
        live = producer.exported
        send.close()
        recv.close()
        return out, live

    for got, live in pair.run(one).values():
        assert got == [2.0, 2.0] and live == 0


# --- groups ---------------------------------------------------------------------------------------


def test_groups_nest_and_only_the_outermost_launches(pair: ThreadWorld) -> None:
    # Both ranks send before they receive: only a group makes that complete.
    def one(r: int, comm: Communicator) -> tuple[list[int], list[float]]:
        depths = []
        with to_device([r + 1.0] * 3, device=r) as s, to_device([0.0] * 3, device=r) as d:
            with group():
                depths.append(group_depth())
                with group():
                    depths.append(group_depth())
                    comm.send(s, 1 - r)
                depths.append(group_depth())
                comm.recv(d, 1 - r)
            depths.append(group_depth())
            comm.synchronize()
            return depths, d.to_numpy().tolist()

    for r, (depths, got) in pair.run(one).items():
        assert depths == [1, 2, 1, 0]
        assert got == [2.0 - r] * 3


def test_group_start_end_functions(pair: ThreadWorld) -> None:
    def one(r: int, comm: Communicator) -> list[float]:
        with to_device([r * 1.0], device=r) as s, to_device([-1.0], device=r) as d:
            group_start()
            comm.recv(d, 1 - r)
            comm.send(s, 1 - r)
            assert group_end() == Result.SUCCESS
            comm.synchronize()
            return d.to_numpy().tolist()

    assert pair.run(one) == {0: [1.0], 1: [0.0]}


def test_exception_in_a_group_ends_it_and_propagates(lb: Any) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with group():
            assert group_depth() == 1
            raise Boom
    assert group_depth() == 0
    # The library's group really ended: one more end is NCCL's "end without start".
    with pytest.raises(NcclInvalidUsage):
        library.lib().ncclGroupEnd()


def test_group_end_failure_is_chained_to_the_body_exception(lb: Any) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom) as info:
        with group():
            library.lib().ncclGroupEnd()  # closes NCCL's group behind pynccl's back
            raise Boom
    assert isinstance(info.value.__context__, NcclInvalidUsage)
    assert any("ncclGroupEnd also failed" in note for note in info.value.__notes__)
    assert group_depth() == 0


def test_a_failed_group_end_raises_and_closes_the_group(lb: Any) -> None:
    with pytest.raises(NcclInvalidUsage):
        with group():
            library.lib().ncclGroupEnd()  # closes NCCL's group behind pynccl's back
    assert group_depth() == 0
    with pytest.raises(NcclInvalidUsage):
        with group():
            with group():
                library.lib().ncclGroupEnd()
            # The stray end closed one of NCCL's two groups, the inner exit the other:
            # the outer exit's ncclGroupEnd has none left to end.
            assert group_depth() == 1
    assert group_depth() == 0


def test_group_end_without_start_is_invalid_usage(lb: Any) -> None:
    with pytest.raises(NcclInvalidUsage):
        group_end()
    assert group_depth() == 0


def test_group_depth_is_per_thread(lb: Any) -> None:
    seen: list[int] = []
    with group():
        t = threading.Thread(target=lambda: seen.append(group_depth()))
        t.start()
        t.join()
        assert group_depth() == 1
    assert seen == [0]


def test_one_thread_drives_init_all_communicators_in_a_group(lb: Any) -> None:
    comms = Communicator.init_all(3)
    streams = [Stream(device=r) for r in range(3)]
    bufs = [to_device([r + 1.0, 2.0 * r], device=r) for r in range(3)]
    try:
        with group():
            for r, comm in enumerate(comms):
                comm.all_reduce(bufs[r], op="sum", stream=streams[r])
        for r, comm in enumerate(comms):
            comm.synchronize(stream=streams[r])
            assert bufs[r].to_numpy().tolist() == [6.0, 6.0]
    finally:
        for b in bufs:
            b.close()
        for comm in comms:
            comm.destroy()
        for s in streams:
            s.close()
