"""The object API on the loopback libraries: UniqueId, Config, Communicator lifecycle,
split, PreMulSum and registration.

Results are checked against numpy (``_worlds.ref_reduce``); error messages are
checked for the argument they name and the values they report. Argument validation and
groups are in test_comm_validation.py; non-blocking init, the flight recorder,
synchronize with a timeout and the watchdog in test_comm_async.py.
"""

from __future__ import annotations

import gc
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from support.comm import Worlds, to_device
from support.reference import ref_reduce
from support.suite import Spec, check
from support.worlds import ThreadWorld

from pynccl import library
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer, Stream
from pynccl.enums import DataType, Result
from pynccl.errors import NcclInvalidUsage, NcclSystemError
from pynccl.groups import group, group_depth, group_end, group_start

pytestmark = pytest.mark.usefixtures("lb")


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


def test_properties(solo_comm: Communicator) -> None:
    assert (solo_comm.rank, solo_comm.size, solo_comm.device, solo_comm.state) == (0, 1, 0, "ready")
    assert isinstance(solo_comm.handle, int) and solo_comm.handle > 0
    assert solo_comm.stream == 0
    assert solo_comm.library is library.lib()
    assert "rank 0/1" in repr(solo_comm) and "ready" in repr(solo_comm)
    with Stream(device=0) as s:
        solo_comm.stream = s
        assert solo_comm.stream == s.handle
        solo_comm.stream = None
        assert solo_comm.stream == 0
    assert solo_comm.get_async_error() == Result.SUCCESS
    solo_comm.check()


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
    with to_device([1.0]) as buf:
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
    with to_device([1.0, 2.0]) as buf:
        comm.all_reduce(buf)
        comm.finalize()
        assert comm.state == "finalized"
        comm.finalize()  # a second finalize is a no-op here, not NCCL's InvalidArgument
        with pytest.raises(NcclInvalidUsage, match="finalized"):
            comm.all_reduce(buf)
        np.testing.assert_array_equal(buf.to_numpy(), [1.0, 2.0])
    comm.destroy()
    assert comm.state == "destroyed"


def test_destroy_inside_a_group_is_refused(solo_comm: Communicator) -> None:
    with group():
        with pytest.raises(NcclInvalidUsage, match="inside a group"):
            solo_comm.destroy()
        assert solo_comm.state == "ready"
    assert group_depth() == 0
    with to_device([3.0]) as buf:
        solo_comm.all_reduce(buf)  # still usable
        solo_comm.synchronize()
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


def test_from_handle_borrows(solo_comm: Communicator) -> None:
    other = Communicator.from_handle(solo_comm.handle)
    assert (other.rank, other.size, other.device) == (0, 1, 0)
    assert "borrowed" in repr(other)
    with to_device([1.5, 2.5]) as buf:
        other.all_reduce(buf)
        other.synchronize()
        assert buf.to_numpy().tolist() == [1.5, 2.5]
        other.destroy()
        assert other.state == "closed"
        with pytest.raises(NcclInvalidUsage, match="closed"):
            other.all_reduce(buf)
        solo_comm.all_reduce(buf)  # the owner's handle is alive
        solo_comm.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        other2 = Communicator.from_handle(solo_comm.handle)
        del other2  # a borrowed handle never warns
        gc.collect()
    for bad in (0, -1, "0x1", 1.0):
        with pytest.raises(ValueError, match="handle must be a non-NULL ncclComm_t"):
            Communicator.from_handle(bad)  # type: ignore[arg-type]


# --- split ----------------------------------------------------------------------------------------


def test_split_by_color_orders_by_key(thread_worlds: Worlds) -> None:
    world = thread_worlds(4)

    # colors: ranks 0,2 -> 0; ranks 1,3 -> 1. key = -rank: reversed order in each child.
    def one(r: int, comm: Communicator) -> tuple[int, int, list[float]]:
        child = comm.split(r % 2, key=-r)
        assert child is not None
        try:
            with to_device([float(r)], device=r) as s, to_device([0.0, 0.0], device=r) as d:
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
            with to_device([r + 0.5], device=r) as s, to_device([0.0] * 3, device=r) as d:
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


def test_split_rejects_bad_color_and_key(solo_comm: Communicator) -> None:
    with pytest.raises(ValueError, match="color must be a non-negative int or None, got -5"):
        solo_comm.split(-5)
    with pytest.raises(TypeError, match="key must be an int, got str"):
        solo_comm.split(0, key="a")  # type: ignore[arg-type]


def test_non_blocking_split(thread_worlds: Worlds) -> None:
    world = thread_worlds(2)

    def one(r: int, comm: Communicator) -> tuple[int, int, str]:
        child = comm.split(0, config=Config(blocking=False))
        assert child is not None
        try:
            child.wait_ready(timeout=30)
            with to_device([r + 1.0], device=r) as b:
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
    from support.reference import np_dtype, rank_data

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


def test_premul_sum_errors(solo_comm: Communicator) -> None:
    with pytest.raises(ValueError, match="residence must be 'host' or 'device', got 'gpu'"):
        solo_comm.create_premul_sum(1.0, "float32", residence="gpu")
    with pytest.raises(ValueError, match="op 99 was not created on this communicator"):
        solo_comm.destroy_op(99)
    op = solo_comm.create_premul_sum(2.0, "float32")
    solo_comm.destroy_op(op)
    with pytest.raises(ValueError, match="not created on this communicator"):
        solo_comm.destroy_op(op)
    with to_device([1.0]) as b, pytest.raises(ValueError, match=f"op {op} is not a reduction op"):
        solo_comm.all_reduce(b, op=op)  # destroyed: no longer an op of this communicator


# --- registration ---------------------------------------------------------------------------------


def test_register_and_deregister(solo_comm: Communicator) -> None:
    with to_device(np.arange(16)) as b:
        h1 = solo_comm.register(b)
        h2 = solo_comm.register(b.ptr, nbytes=32)
        assert h1 and h2
        solo_comm.all_reduce(b)
        solo_comm.synchronize()
        solo_comm.deregister(h1)
        solo_comm.deregister(h2)
        with pytest.raises(TypeError, match="raw pointer needs nbytes="):
            solo_comm.register(b.ptr)
        with pytest.raises(ValueError, match=r"nbytes=-4 is out of range"):
            solo_comm.register(b.ptr, nbytes=-4)
        with pytest.raises(ValueError, match=r"buf=0x[0-9a-f]+ is not a valid pointer"):
            solo_comm.register((1 << 64) + b.ptr, nbytes=32)  # ctypes would wrap it to b.ptr
        with pytest.raises(ValueError, match="buf is a NULL pointer but 32 bytes are needed"):
            solo_comm.register(0, nbytes=32)
