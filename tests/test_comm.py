"""The object API on the loopback libraries: UniqueId, Config, Communicator lifecycle,
argument validation, groups, non-blocking init, split, PreMulSum, registration,
the flight recorder, synchronize with a timeout and the watchdog.

Results are checked against numpy (``_worlds.ref_reduce``); error messages are
checked for the argument they name and the values they report.
"""

from __future__ import annotations

import gc
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _producers import CAIArray, DLPackProducer, kDLCUDA
from _support_wait import wait_for
from _worlds import Slot, Spec, ThreadWorld, check, ref_reduce

from pynccl import library
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer, Stream
from pynccl.enums import DataType, RedOp, Result
from pynccl.errors import NcclError, NcclInvalidUsage, NcclSystemError, NcclTimeoutError
from pynccl.groups import group, group_depth, group_end, group_start

pytestmark = pytest.mark.usefixtures("lb")

Worlds = Callable[[int], ThreadWorld]


@pytest.fixture
def solo(lb: Any) -> Iterator[Communicator]:
    """A one-rank communicator on device 0, made on this thread."""
    comm = Communicator(1, UniqueId(), 0, device=0)
    try:
        yield comm
    finally:
        comm.abort() if comm.state == "initializing" else comm.destroy()


def _buf(values: Any, dtype: Any = np.float32, device: int = 0) -> DeviceBuffer:
    return DeviceBuffer.from_numpy(np.asarray(values, dtype=dtype), device=device)


def _no_thread_named(prefix: str) -> bool:
    return not any(t.name.startswith(prefix) for t in threading.enumerate())


def test_public_names() -> None:
    import pynccl
    from pynccl import groups

    assert pynccl.Communicator is Communicator and pynccl.Config is Config
    assert pynccl.UniqueId is UniqueId and pynccl.DeviceBuffer is DeviceBuffer
    assert pynccl.group is group and pynccl.group_start is group_start
    assert pynccl.group_end is group_end and groups.group_depth is group_depth


# --- UniqueId -------------------------------------------------------------------------------------


def test_unique_id_round_trips_and_hides_itself() -> None:
    a, b = UniqueId(), UniqueId()
    raw = bytes(a)
    assert len(raw) == 128 and raw != bytes(b)
    assert a != b and a == UniqueId.from_bytes(raw) == UniqueId(bytearray(raw))
    assert UniqueId.fromhex(a.hex()) == a and len(a.hex()) == 256
    assert pickle.loads(pickle.dumps(a)) == a
    assert hash(UniqueId.from_bytes(raw)) == hash(a)
    assert len({a, UniqueId.from_bytes(raw), b}) == 2
    assert bytes(a.struct) == raw
    text = repr(a)
    assert a.hex()[:16] not in text and len(text) < 40
    assert a.fingerprint() in text
    assert (a == raw) is False  # NotImplemented: only ids compare equal to ids


@pytest.mark.parametrize(
    ("make", "exc", "words"),
    [
        (lambda: UniqueId.from_bytes(b"x" * 5), ValueError, ["128 bytes", "got 5"]),
        (lambda: UniqueId(b"y" * 129), ValueError, ["128 bytes", "got 129"]),
        (lambda: UniqueId.from_bytes("ab" * 128), TypeError, ["bytes", "str"]),  # type: ignore[arg-type]
        (lambda: UniqueId.fromhex("zz" * 128), ValueError, ["hex", "128 bytes"]),
        (lambda: UniqueId.fromhex("ab"), ValueError, ["128 bytes", "got 1"]),
    ],
)
def test_unique_id_rejects_bad_input(make: Callable[[], Any], exc: type, words: list[str]) -> None:
    with pytest.raises(exc) as info:
        make()
    text = str(info.value) + str(info.value.__cause__ or "")
    for word in words:
        assert word in text


# --- Config ---------------------------------------------------------------------------------------


def test_config_maps_fields_to_nccl_names() -> None:
    cfg = Config(
        blocking=False,
        cga_cluster_size=2,
        net_name="Socket",
        comm_name="job",
        split_share=True,
        nvls_host_mode=1,
    )
    assert cfg.c_fields() == {
        "blocking": 0,
        "cgaClusterSize": 2,
        "netName": "Socket",
        "splitShare": 1,
        "commName": "job",
        "nvlsHostMode": 1,
    }
    s = cfg.to_struct((2, 32, 3))
    assert (s.blocking, s.cgaClusterSize, s.splitShare, s.nvlsHostMode) == (0, 2, 1, 1)
    assert s.commName == b"job" and s.magic == 0xCAFEBEEF
    assert s.minCTAs == -(2**31)  # NCCL_CONFIG_UNDEF_INT: left to NCCL
    assert Config().c_fields() == {}


def test_config_field_newer_than_the_library_is_not_supported() -> None:
    from pynccl.errors import NotSupportedError

    with pytest.raises(NotSupportedError) as info:
        Config(traffic_class=3).to_struct((2, 18, 1))
    text = str(info.value)
    assert "trafficClass" in text and "2.26" in text and "2.18.1" in text
    Config(split_share=True).to_struct((2, 18, 1))  # 2.18 has it


def test_config_rejects_values_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match=r"minCTAs.*32-bit"):
        Config(min_ctas=2**40).to_struct()
    with pytest.raises(TypeError, match=r"netName.*str"):
        Config(net_name=5).to_struct()  # type: ignore[arg-type]


def test_config_reaches_the_library(lb: Any) -> None:
    # comm_name and split_share are accepted by the loopback's InitRankConfig; a
    # collective then works as usual.
    world = ThreadWorld(2, config=Config(comm_name="pynccl-test", split_share=False))
    with world:
        check(world, Spec("all_reduce", "float32", count=4))


# --- construction errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"nranks": 0}, ValueError, ["nranks", "0"]),
        ({"nranks": 2.0}, TypeError, ["nranks", "2.0"]),
        ({"rank": 2}, ValueError, ["rank=2", "size 2"]),
        ({"rank": -1}, ValueError, ["rank=-1", "size 2"]),
        ({"rank": True}, TypeError, ["rank", "bool"]),
        ({"config": {"blocking": False}}, TypeError, ["config", "pynccl.Config", "dict"]),
        ({"unique_id": "0" * 256}, TypeError, ["unique_id", "str"]),
        ({"unique_id": []}, ValueError, ["unique_id", "empty"]),
        ({"unique_id": b"short"}, ValueError, ["128 bytes", "got 5"]),
        ({"device": -1}, ValueError, ["device", "-1"]),
    ],
)
def test_constructor_rejects_bad_arguments(
    kwargs: dict[str, Any], exc: type, words: list[str]
) -> None:
    args: dict[str, Any] = {"nranks": 2, "unique_id": UniqueId(), "rank": 0}
    args.update(kwargs)
    with pytest.raises(exc) as info:
        Communicator(args.pop("nranks"), args.pop("unique_id"), args.pop("rank"), **args)
    for word in words:
        assert word in str(info.value)


def test_init_all_rejects_bad_device_lists() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        Communicator.init_all([])
    with pytest.raises(ValueError, match=r"duplicates: \[0, 1, 0\]"):
        Communicator.init_all([0, 1, 0])
    with pytest.raises(ValueError, match="devices=-2 is out of range"):
        Communicator.init_all([0, -2])


def test_init_all_with_a_device_list(lb: Any) -> None:
    comms = Communicator.init_all([2, 5])
    try:
        assert [(c.rank, c.size, c.device) for c in comms] == [(0, 2, 2), (1, 2, 5)]
    finally:
        for c in comms:
            c.destroy()


def test_init_failure_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_FAIL_INIT", str(int(Result.SYSTEM_ERROR)))
    with pytest.raises(NcclSystemError) as info:
        Communicator(1, UniqueId(), 0)
    assert info.value.result == Result.SYSTEM_ERROR
    assert "ncclCommInitRank" in str(info.value)


# --- properties and lifecycle ---------------------------------------------------------------------


def test_properties(solo: Communicator) -> None:
    assert (solo.rank, solo.size, solo.device, solo.state) == (0, 1, 0, "ready")
    assert isinstance(solo.handle, int) and solo.handle > 0
    assert solo.stream == 0
    assert solo.library is library.lib()
    assert "rank 0/1" in repr(solo) and "ready" in repr(solo)
    with Stream(device=0) as s:
        solo.stream = s
        assert solo.stream == s.handle
        solo.stream = None
        assert solo.stream == 0
    assert solo.get_async_error() == Result.SUCCESS
    solo.check()


def _every_call(comm: Communicator, buf: DeviceBuffer) -> dict[str, Callable[[], Any]]:
    return {
        "all_reduce": lambda: comm.all_reduce(buf),
        "all_reduce_raw": lambda: comm.all_reduce(buf.ptr, count=1, dtype="float32"),
        "broadcast": lambda: comm.broadcast(buf),
        "reduce": lambda: comm.reduce(buf),
        "all_gather": lambda: comm.all_gather(buf, buf),
        "reduce_scatter": lambda: comm.reduce_scatter(buf, buf),
        "gather": lambda: comm.gather(buf, buf),
        "scatter": lambda: comm.scatter(buf, buf),
        "all_to_all": lambda: comm.all_to_all(buf, buf),
        "send": lambda: comm.send(buf, 0),
        "recv": lambda: comm.recv(buf, 0),
        "split": lambda: comm.split(0),
        "register": lambda: comm.register(buf),
        "premul": lambda: comm.create_premul_sum(2.0, "float32"),
        "synchronize": lambda: comm.synchronize(),
        "handle": lambda: comm.handle,
        "async_error": lambda: comm.get_async_error(),
        "finalize": lambda: comm.finalize(),
        "watchdog": lambda: comm.start_watchdog(1.0),
    }


@pytest.mark.parametrize("end", ["destroy", "abort", "close"])
def test_every_call_after_the_end_is_invalid_usage(lb: Any, end: str) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    getattr(comm, end)()
    state = {"destroy": "destroyed", "abort": "aborted", "close": "destroyed"}[end]
    assert comm.state == state
    with _buf([1.0]) as buf:
        for name, call in _every_call(comm, buf).items():
            with pytest.raises(NcclInvalidUsage) as info:
                call()
            assert state in str(info.value), f"{name}: {info.value}"
    # Ending again, in any way, does nothing.
    comm.destroy()
    comm.abort()
    comm.close()
    assert comm.state == state


def test_finalize_then_destroy(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    with _buf([1.0, 2.0]) as buf:
        comm.all_reduce(buf)
        comm.finalize()
        assert comm.state == "finalized"
        comm.finalize()  # a second finalize is a no-op here, not NCCL's InvalidArgument
        with pytest.raises(NcclInvalidUsage, match="finalized"):
            comm.all_reduce(buf)
        np.testing.assert_array_equal(buf.to_numpy(), [1.0, 2.0])
    comm.destroy()
    assert comm.state == "destroyed"


def test_destroy_inside_a_group_is_refused(solo: Communicator) -> None:
    with group():
        with pytest.raises(NcclInvalidUsage, match="inside a group"):
            solo.destroy()
        assert solo.state == "ready"
    assert group_depth() == 0
    with _buf([3.0]) as buf:
        solo.all_reduce(buf)  # still usable
        solo.synchronize()
        assert buf.to_numpy().tolist() == [3.0]


def test_context_manager_destroys_on_normal_exit(lb: Any) -> None:
    with Communicator(1, UniqueId(), 0, device=0) as comm:
        assert comm.state == "ready"
    assert comm.state == "destroyed"


def test_context_manager_aborts_on_exception(lb: Any) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with Communicator(1, UniqueId(), 0, device=0) as comm:
            raise Boom
    assert comm.state == "aborted"


def test_undestroyed_communicator_warns_and_does_not_tear_down(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    handle = comm.handle
    with pytest.warns(ResourceWarning, match="never destroyed"):
        del comm
        gc.collect()
    # __del__ did not destroy it: the handle still answers, and is ours to destroy.
    L = library.lib()
    from ctypes import byref, c_int

    size = c_int()
    L.ncclCommCount(handle, byref(size))
    assert size.value == 1
    L.ncclCommDestroy(handle)


def test_destroyed_communicator_does_not_warn(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    comm.destroy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        del comm
        gc.collect()


def test_from_handle_borrows(solo: Communicator) -> None:
    other = Communicator.from_handle(solo.handle)
    assert (other.rank, other.size, other.device) == (0, 1, 0)
    assert "borrowed" in repr(other)
    with _buf([1.5, 2.5]) as buf:
        other.all_reduce(buf)
        other.synchronize()
        assert buf.to_numpy().tolist() == [1.5, 2.5]
        other.destroy()
        assert other.state == "closed"
        with pytest.raises(NcclInvalidUsage, match="closed"):
            other.all_reduce(buf)
        solo.all_reduce(buf)  # the owner's handle is alive
        solo.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        other2 = Communicator.from_handle(solo.handle)
        del other2  # a borrowed handle never warns
        gc.collect()
    for bad in (0, -1, "0x1", 1.0):
        with pytest.raises(ValueError, match="handle must be a non-NULL ncclComm_t"):
            Communicator.from_handle(bad)  # type: ignore[arg-type]


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
        with _buf(np.arange(6) + 10 * r, device=r) as s, _buf(np.full(6, -1.0), device=r) as d:
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
        with _buf([r + 1.0] * 3, device=r) as s, _buf([0.0] * 3, device=r) as d:
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
        with _buf([r * 1.0], device=r) as s, _buf([-1.0], device=r) as d:
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
    bufs = [_buf([r + 1.0, 2.0 * r], device=r) for r in range(3)]
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


# --- non-blocking ---------------------------------------------------------------------------------


def test_non_blocking_init_becomes_ready(lb: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", "5")
    world = ThreadWorld(2, config=Config(blocking=False))
    try:
        states = world.run(lambda r, c: (c.state, c.get_async_error()))
        for state, result in states.values():
            assert state == "initializing" and result == Result.IN_PROGRESS
        world.run(lambda r, c: c.wait_ready(timeout=30))
        assert all(c.state == "ready" for c in world.comms.values())
        check(world, Spec("all_reduce", "float32", count=9))
        check(world, Spec("send_recv", "int8", count=4, root=1))
    finally:
        world.close()


def test_non_blocking_communicator_waits_by_itself_before_a_call(
    lb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", "3")
    world = ThreadWorld(2, config=Config(blocking=False))
    try:
        check(world, Spec("all_gather", "float32", count=3))  # no wait_ready first
    finally:
        world.close()


def test_wait_ready_times_out(lb: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", str(10**9))
    comm = Communicator(1, UniqueId(), 0, device=0, config=Config(blocking=False))
    try:
        assert comm.state == "initializing"
        with pytest.raises(NcclTimeoutError, match=r"not ready after 0\.05 s"):
            comm.wait_ready(timeout=0.05)
        assert comm.state == "initializing"
    finally:
        comm.abort()
    assert comm.state == "aborted"


# --- split ----------------------------------------------------------------------------------------


def test_split_by_color_orders_by_key(thread_worlds: Worlds) -> None:
    world = thread_worlds(4)

    # colors: ranks 0,2 -> 0; ranks 1,3 -> 1. key = -rank: reversed order in each child.
    def one(r: int, comm: Communicator) -> tuple[int, int, list[float]]:
        child = comm.split(r % 2, key=-r)
        assert child is not None
        try:
            with _buf([float(r)], device=r) as s, _buf([0.0, 0.0], device=r) as d:
                child.all_gather(s, d)
                child.synchronize()
                return child.rank, child.size, d.to_numpy().tolist()
        finally:
            child.destroy()

    out = world.run(one)
    assert out[0] == (1, 2, [2.0, 0.0]) and out[2] == (0, 2, [2.0, 0.0])
    assert out[1] == (1, 2, [3.0, 1.0]) and out[3] == (0, 2, [3.0, 1.0])


def test_split_nocolor_gives_none_and_default_key_keeps_order(thread_worlds: Worlds) -> None:
    world = thread_worlds(4)

    def one(r: int, comm: Communicator) -> Any:
        child = comm.split(None if r == 1 else 7)
        if child is None:
            return None
        try:
            with _buf([r + 0.5], device=r) as s, _buf([0.0] * 3, device=r) as d:
                child.all_gather(s, d)
                child.synchronize()
                return child.rank, child.size, child.device, d.to_numpy().tolist()
        finally:
            child.destroy()

    out = world.run(one)
    assert out[1] is None
    assert out[0] == (0, 3, 0, [0.5, 2.5, 3.5])
    assert out[2] == (1, 3, 2, [0.5, 2.5, 3.5])
    assert out[3] == (2, 3, 3, [0.5, 2.5, 3.5])
    check(world, Spec("all_reduce", "int32", count=3))  # the parent is unaffected


def test_split_rejects_bad_color_and_key(solo: Communicator) -> None:
    with pytest.raises(ValueError, match="color must be a non-negative int or None, got -5"):
        solo.split(-5)
    with pytest.raises(TypeError, match="key must be an int, got str"):
        solo.split(0, key="a")  # type: ignore[arg-type]


def test_non_blocking_split(thread_worlds: Worlds) -> None:
    world = thread_worlds(2)

    def one(r: int, comm: Communicator) -> tuple[int, int, str]:
        child = comm.split(0, config=Config(blocking=False))
        assert child is not None
        try:
            child.wait_ready(timeout=30)
            with _buf([r + 1.0], device=r) as b:
                child.all_reduce(b)
                child.synchronize()
                return child.rank, int(b.to_numpy()[0]), child.state
        finally:
            child.destroy()

    assert world.run(one) == {0: (0, 3, "ready"), 1: (1, 3, "ready")}


# --- PreMulSum ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int32"])
@pytest.mark.parametrize("residence", ["host", "device"])
def test_premul_sum(thread_worlds: Worlds, dtype: str, residence: str) -> None:
    from _worlds import np_dtype, rank_data

    dt = DataType[dtype.upper()]
    world = thread_worlds(3)
    scalar = 3 if dt.is_integer else 2.5
    inputs = [rank_data(9, r, 33, dt, "sum") for r in range(3)]
    want = ref_reduce(inputs, dt, "premulsum", scalar)

    def one(r: int, comm: Communicator) -> np.ndarray:
        holder = None
        if residence == "device":
            holder = DeviceBuffer.from_numpy(np.array([scalar], np_dtype(dt)), device=r)
            op = comm.create_premul_sum(holder.ptr, dtype, residence="device")
        else:
            op = comm.create_premul_sum(scalar, dtype)
        try:
            with DeviceBuffer.from_numpy(inputs[r], device=r) as b:
                comm.all_reduce(b, op=op)
                comm.synchronize()
                return b.to_numpy()
        finally:
            comm.destroy_op(op)
            if holder is not None:
                holder.close()

    for r, got in world.run(one).items():
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=f"rank {r}")


def test_premul_sum_scales_each_rank_by_its_own_scalar(thread_worlds: Worlds) -> None:
    # NCCL's PreMulSum: every rank multiplies its own input by the scalar it passed.
    world = thread_worlds(3)
    scalars = [0.5, 2.0, -3.0]
    inputs = [np.arange(40, dtype=np.float64) + 7 * r for r in range(3)]
    want = sum(s * x for s, x in zip(scalars, inputs))  # exact in float64

    def one(r: int, comm: Communicator) -> np.ndarray:
        op = comm.create_premul_sum(scalars[r], "float64")
        try:
            with DeviceBuffer.from_numpy(inputs[r], device=r) as b:
                comm.all_reduce(b, op=op)
                comm.synchronize()
                return b.to_numpy()
        finally:
            comm.destroy_op(op)

    for r, got in world.run(one).items():
        np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


def test_premul_sum_errors(solo: Communicator) -> None:
    with pytest.raises(ValueError, match="residence must be 'host' or 'device', got 'gpu'"):
        solo.create_premul_sum(1.0, "float32", residence="gpu")
    with pytest.raises(ValueError, match="op 99 was not created on this communicator"):
        solo.destroy_op(99)
    op = solo.create_premul_sum(2.0, "float32")
    solo.destroy_op(op)
    with pytest.raises(ValueError, match="not created on this communicator"):
        solo.destroy_op(op)
    with _buf([1.0]) as b, pytest.raises(ValueError, match=f"op {op} is not a reduction op"):
        solo.all_reduce(b, op=op)  # destroyed: no longer an op of this communicator


# --- registration ---------------------------------------------------------------------------------


def test_register_and_deregister(solo: Communicator) -> None:
    with _buf(np.arange(16)) as b:
        h1 = solo.register(b)
        h2 = solo.register(b.ptr, nbytes=32)
        assert h1 and h2
        solo.all_reduce(b)
        solo.synchronize()
        solo.deregister(h1)
        solo.deregister(h2)
        with pytest.raises(TypeError, match="raw pointer needs nbytes="):
            solo.register(b.ptr)
        with pytest.raises(ValueError, match=r"nbytes=-4 is out of range"):
            solo.register(b.ptr, nbytes=-4)
        with pytest.raises(ValueError, match=r"buf=0x[0-9a-f]+ is not a valid pointer"):
            solo.register((1 << 64) + b.ptr, nbytes=32)  # ctypes would wrap it to b.ptr
        with pytest.raises(ValueError, match="buf is a NULL pointer but 32 bytes are needed"):
            solo.register(0, nbytes=32)


# --- flight recorder, synchronize, watchdog -------------------------------------------------------


def test_flight_record_lists_the_operations(solo: Communicator) -> None:
    assert solo.flight_record() == [] and solo.last_operation() == "none"
    assert "No operation issued yet" in solo.format_flight_record()
    with _buf(np.zeros(10)) as b, _buf(np.zeros(10), np.int64) as c:
        solo.all_reduce(b)
        solo.broadcast(c, root=0, count=3)
        solo.reduce(b.ptr, count=7, dtype="float32", op="max")
        solo.synchronize()
    names = [(e[0], e[1], e[2]) for e in solo.flight_record()]
    assert names == [(1, "ncclAllReduce", -1), (2, "ncclBroadcast", 0), (3, "ncclReduce", 0)]
    text = solo.format_flight_record()
    assert "Last 3 operations issued on rank 0/1" in text
    # Numbered from #1 (as the loopback's mismatch report counts), with op and root.
    assert "#1 ncclAllReduce count=10 dtype=ncclFloat32 op=sum" in text
    assert "#2 ncclBroadcast count=3 dtype=ncclInt64 root=0" in text
    assert solo.last_operation().startswith("#3 ncclReduce count=7 dtype=ncclFloat32 op=max root=0")


def test_flight_record_keeps_the_last_64(solo: Communicator) -> None:
    with _buf([1.0]) as b:
        for _ in range(70):
            solo.all_reduce(b)
        solo.synchronize()
    record = solo.flight_record()
    assert [e[0] for e in record] == list(range(7, 71))


def test_count_arguments_cache_stays_bounded_and_exact(
    solo: Communicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # all_reduce hands ctypes cached c_size_t objects for counts: the cache must stay
    # bounded, and every count (cached, fresh, 0) must reach C exactly.
    from pynccl._capi import _binding as comm_module  # the one shared cache

    saved = dict(comm_module.SIZE_ARGS)
    comm_module.SIZE_ARGS.clear()  # the generated methods hold this dict itself
    monkeypatch.setattr(comm_module, "SIZE_ARGS_LIMIT", 8)
    data = np.arange(40, dtype=np.float32)
    with _buf(data) as src, _buf(np.zeros(40, np.float32)) as dst:
        for count in [*range(20), 3, 19, 0]:
            dst.copy_from(np.full(40, -1, np.float32))
            solo.all_reduce(src.ptr, dst.ptr, count=count, dtype="float32")
            solo.synchronize()
            got = dst.to_numpy()
            assert np.array_equal(got[:count], data[:count]) and (got[count:] == -1).all()
    try:
        assert len(comm_module.SIZE_ARGS) == 8
        assert all(type(k) is int and v.value == k for k, v in comm_module.SIZE_ARGS.items())
    finally:
        comm_module.SIZE_ARGS.clear()
        comm_module.SIZE_ARGS.update(saved)


def test_flight_record_wraps_with_mixed_operations(solo: Communicator) -> None:
    # The inline raw-pointer path and the slow path store the same entry: both must read
    # back with the right sequence numbers (from #1) once the ring has wrapped.
    with _buf(np.zeros(71)) as b:
        for i in range(1, 71):
            if i % 3:
                solo.all_reduce(b.ptr, count=i, dtype="float32", op="max")
            else:
                solo.broadcast(b, root=0, count=i)
        solo.synchronize()
    record = solo.flight_record()
    assert [e[0] for e in record] == list(range(7, 71))
    for seq, name, where, args in record:
        if seq % 3:
            assert (name, where, args[2], args[4]) == ("ncclAllReduce", -1, seq, int(RedOp.MAX))
        else:
            assert (name, where, args[2]) == ("ncclBroadcast", 0, seq)
    assert solo.describe(69) == "ncclBroadcast" and solo.describe(68) == "ncclAllReduce"
    assert solo.describe(6) == "operation"  # overwritten
    assert solo.describe(71) == "operation"  # not issued yet
    assert solo.last_operation().startswith("#70 ncclAllReduce count=70 dtype=ncclFloat32 op=max")


def test_synchronize_times_out_on_a_hung_operation(
    lb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "2")  # the second operation never ends
    comm = Communicator(1, UniqueId(), 0, device=0)
    with _buf(np.zeros(5)) as b:
        comm.all_reduce(b)
        comm.synchronize(timeout=30)
        comm.broadcast(b, count=4)
        with pytest.raises(NcclTimeoutError) as info:
            comm.synchronize(timeout=0.2)
        text = str(info.value)
        assert "did not finish within 0.2 s" in text
        assert "Last operation issued: #2 ncclBroadcast count=4" in text
        assert "#1 ncclAllReduce count=5" in text  # and the flight record
        assert comm.state == "aborted"
        with pytest.raises(NcclInvalidUsage, match="aborted"):
            comm.all_reduce(b)


def test_synchronize_raises_the_asynchronous_error(
    lb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER", "1")  # the 2nd operation fails
    comm = Communicator(1, UniqueId(), 0, device=0)
    try:
        with _buf(np.zeros(5)) as b:
            comm.all_reduce(b)
            comm.all_reduce(b)
            with pytest.raises(NcclSystemError) as info:
                comm.synchronize(timeout=30)
                comm.all_reduce(b)
                comm.synchronize(timeout=30)
            assert "ncclAllReduce" in str(info.value)
            assert comm.get_async_error() == Result.SYSTEM_ERROR
            with pytest.raises(NcclSystemError):
                comm.check()
    finally:
        comm.abort()


def test_watchdog_aborts_a_hung_communicator(lb: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "1")
    comm = Communicator(1, UniqueId(), 0, device=0, watchdog_timeout=0.2)
    with _buf(np.zeros(3)) as b:
        comm.all_gather(b, b, count=1)
        assert wait_for(lambda: comm.state == "aborted", 20), "the watchdog did not abort"
        reason = comm.error
        assert isinstance(reason, NcclTimeoutError)
        assert "ncclAllGather" in str(reason) and "watchdog aborted" in str(reason)
        with pytest.raises(NcclTimeoutError):
            comm.all_reduce(b)
    assert wait_for(lambda: _no_thread_named("pynccl-watchdog"), 20)
    comm.destroy()  # already aborted: a no-op


def test_watchdog_aborts_on_an_asynchronous_error(lb: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # From the first operation on, the async error is ncclInternalError (3).
    monkeypatch.setenv("PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER", "0:3")
    comm = Communicator(1, UniqueId(), 0, device=0)
    comm.start_watchdog(30.0, interval=0.01)
    with pytest.raises(NcclInvalidUsage, match="already running"):
        comm.start_watchdog(30.0)
    with _buf(np.zeros(3)) as b:
        comm.all_reduce(b)
        assert wait_for(lambda: comm.state == "aborted", 20)
        assert isinstance(comm.error, NcclError)
        assert comm.error.result == Result.INTERNAL_ERROR
        assert "ncclAllReduce" in str(comm.error)
    assert wait_for(lambda: _no_thread_named("pynccl-watchdog"), 20)


def test_watchdog_stops_with_the_communicator(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0, watchdog_timeout=30.0)
    with _buf(np.ones(4)) as b:
        for _ in range(5):
            comm.all_reduce(b, op="prod")
        comm.synchronize()
        assert b.to_numpy().tolist() == [1.0] * 4
    comm.destroy()
    assert _no_thread_named("pynccl-watchdog")


def test_a_peer_abort_is_a_remote_error(lb: Any) -> None:
    from pynccl.errors import NcclRemoteError

    world = ThreadWorld(2)
    world.broken = True  # its communicators end aborted

    def one(r: int, comm: Communicator) -> str:
        if r == 1:
            time.sleep(0.1)  # rank 0 is waiting in its all_reduce by now (or soon)
            comm.abort()
            return "aborted"
        with _buf([1.0, 2.0]) as b, pytest.raises(NcclRemoteError) as info:
            comm.all_reduce(b)  # refused at once if the peer has already aborted
            comm.synchronize(timeout=30)
        return str(info.value)

    try:
        out = world.run(one)
    finally:
        world.close()
    assert out[1] == "aborted"
    assert "ncclAllReduce" in out[0]  # the flight record says what was waiting


def _mapped_worlds() -> int:
    with open("/proc/self/maps") as maps:
        return sum("pynccl-lb-" in line for line in maps)


def test_nothing_outlives_the_communicators(lb: Any) -> None:
    maps_before = _mapped_worlds()
    threads_before = {t.ident for t in threading.enumerate()}
    world = ThreadWorld(3)
    children = world.run(lambda r, c: c.split(0 if r else None))
    world.run(lambda r, c: c.start_watchdog(30.0))
    group_comms = Communicator.init_all(2)
    assert _mapped_worlds() > maps_before
    world.run(lambda r, c: children[r] and children[r].destroy())
    for comm in group_comms:
        comm.destroy()
    world.close()
    assert _mapped_worlds() == maps_before
    assert wait_for(lambda: {t.ident for t in threading.enumerate()} <= threads_before, 20)


def test_device_is_known_without_device_argument_and_checked(lb: Any) -> None:
    # Made on a thread whose current device is 2: NCCL takes that device, and a buffer
    # that says it lives on device 1 is refused before any C call.
    from pynccl.cuda import get_device, set_device

    class OnDevice1:  # a CuPy-style device array: .device.id
        class device:
            id = 1

        def __init__(self, ptr: int, n: int) -> None:
            self.__cuda_array_interface__ = {
                "shape": (n,), "typestr": "<f4", "data": (ptr, False), "version": 3,
            }  # fmt: skip

    previous = get_device()
    set_device(2)
    try:
        comm = Communicator(1, UniqueId(), 0)
    finally:
        set_device(previous)
    try:
        with DeviceBuffer(8, DataType.FLOAT32, device=2) as good:
            bad = OnDevice1(good.ptr, 8)  # checked before anything asked for comm.device
            with pytest.raises(ValueError, match="on device 1 but the communicator is on device 2"):
                comm.all_reduce(bad)
            comm.all_reduce(good)
            comm.synchronize()
        assert comm.device == 2
    finally:
        comm.destroy()
