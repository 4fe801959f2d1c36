"""Per-call config: ``pynccl.CollConfig`` as ``config=`` on every collective (the row's
``nccl*Config`` C function), results against numpy in a thread world, refused before any
C call where NCCL lacks it (an emulated 2.30 build; a 2.31 build for the 2.32 field;
send/recv, which have no config variant) and recorded in the flight record."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from support.worlds import ThreadWorld, use_loopback

import pynccl
from pynccl import CollConfig, DataType
from pynccl.comm import Communicator, UniqueId
from pynccl.comm._spec import COLLECTIVES, Where
from pynccl.cuda import DeviceBuffer, Event
from pynccl.errors import NcclInvalidArgument, NotSupportedError

N = 4  # elements per rank block
SIZE = 3
COLLS = [row.method for row in COLLECTIVES if row.where is not Where.PEER]


# -- an independent oracle: what each collective leaves on each rank -----------------------------


def _send_data(method: str, rank: int, size: int) -> np.ndarray:
    blocks = size if method in ("reduce_scatter", "scatter", "all_to_all") else 1
    return (np.arange(N * blocks, dtype=np.float32) + 100 * rank + 1).astype(np.float32)


def _expected(method: str, rank: int, size: int, root: int) -> np.ndarray | None:
    xs = [_send_data(method, r, size) for r in range(size)]
    if method == "all_reduce":
        return np.sum(xs, axis=0, dtype=np.float32)
    if method == "reduce":
        return np.sum(xs, axis=0, dtype=np.float32) if rank == root else None
    if method == "broadcast":
        return xs[root]
    if method == "all_gather":
        return np.concatenate(xs)
    if method == "reduce_scatter":
        return np.sum(xs, axis=0, dtype=np.float32)[rank * N : (rank + 1) * N]
    if method == "gather":
        return np.concatenate(xs) if rank == root else None
    if method == "scatter":
        return xs[root][rank * N : (rank + 1) * N]
    if method == "all_to_all":
        return np.concatenate([xs[j][rank * N : (rank + 1) * N] for j in range(size)])
    raise AssertionError(method)


def _recv_len(method: str, size: int) -> int:
    return N * size if method in ("all_gather", "gather", "all_to_all") else N


def _issue(
    comm: Communicator, method: str, send: DeviceBuffer, recv: DeviceBuffer, root: int, **kw: Any
) -> None:
    extra = {"root": root} if method in ("reduce", "broadcast", "gather", "scatter") else {}
    getattr(comm, method)(send, recv, **extra, **kw)


@pytest.fixture(scope="module")
def world(lb: Any) -> Iterator[ThreadWorld]:
    w = ThreadWorld(SIZE)
    try:
        yield w
    finally:
        w.close()


def _run(world: ThreadWorld, method: str, root: int, call: Callable[..., None]) -> None:
    def one(r: int, comm: Communicator) -> None:
        send = DeviceBuffer.from_numpy(_send_data(method, r, SIZE), device=r)
        recv = DeviceBuffer.from_numpy(np.full(_recv_len(method, SIZE), -7, np.float32), device=r)
        try:
            call(comm, method, send, recv, root)
            comm.synchronize(timeout=60)
            want = _expected(method, r, SIZE, root)
            got = recv.to_numpy()
            if want is None:
                np.testing.assert_array_equal(got, np.full(got.size, -7, np.float32))
            else:
                np.testing.assert_array_equal(got, want)
        finally:
            send.close()
            recv.close()

    world.run(one)


# -- the object ---------------------------------------------------------------------------------


def test_the_struct_is_built_once_with_ncclS_initialiser_and_the_fields() -> None:
    cfg = CollConfig(max_ctas=4, alg_selection="ring", user_profiler_tag=9)
    s = cfg.struct
    assert cfg.struct is s  # built once, in __init__
    assert ctypes.sizeof(s) == 72 and s.size == 72
    assert s.magic == 0xCAFEBEEF and s.version == 23203
    assert s.maxCTAs == 4 and s.algSelection == b"ring" and s.userProfilerTag == 9
    undef = -(2**31)
    assert (s.minCTAs, s.nvlsCTAs, s.cgaClusterSize, s.CTAPolicy) == (undef,) * 4
    assert s.forceAlgSelection == 1 and not s.launchCompletionEvent and not s.ext
    assert CollConfig(force_alg_selection=False).struct.forceAlgSelection == 0
    assert cfg.c_fields() == {"maxCTAs": 4, "algSelection": b"ring", "userProfilerTag": 9}


def test_frozen_compared_by_value_and_hashable() -> None:
    cfg = CollConfig(min_ctas=1, cta_policy=2)
    with pytest.raises(AttributeError, match="frozen"):
        cfg.min_ctas = 3  # type: ignore[misc]
    with pytest.raises(AttributeError, match="frozen"):
        del cfg.min_ctas  # type: ignore[misc]
    assert cfg == CollConfig(cta_policy=2, min_ctas=1) != CollConfig(min_ctas=1)
    assert hash(cfg) == hash(CollConfig(cta_policy=2, min_ctas=1))
    assert len({cfg, CollConfig(cta_policy=2, min_ctas=1)}) == 1
    assert repr(cfg) == "CollConfig(min_ctas=1, cta_policy=2)"
    assert cfg.since == (2, 31, 2)
    assert CollConfig(launch_completion_event=5).since == (2, 32, 0)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"max_ctas": -1}, ValueError, "max_ctas=-1 is out of range"),
        ({"min_ctas": 2**31}, ValueError, "min_ctas=2147483648 is out of range"),
        ({"nvls_ctas": 1.0}, TypeError, "nvls_ctas"),
        ({"cga_cluster_size": True}, TypeError, "cga_cluster_size"),
        ({"cta_policy": "efficiency"}, TypeError, "cta_policy"),
        ({"alg_selection": b"ring"}, TypeError, "alg_selection must be a str"),
        ({"alg_selection": "ri\0ng"}, ValueError, "NUL"),
        ({"force_alg_selection": 1}, TypeError, "force_alg_selection must be a bool"),
        ({"user_profiler_tag": 2**63}, ValueError, "NCCL reserves"),
        ({"user_profiler_tag": -1}, ValueError, "user_profiler_tag=-1 is out of range"),
        ({"launch_completion_event": 0}, ValueError, "non-NULL cudaEvent_t"),
        ({"launch_completion_event": "ev"}, TypeError, "launch_completion_event"),
    ],
)
def test_bad_fields_are_refused_naming_the_value(
    kwargs: dict[str, Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text.replace("(", r"\(")):
        CollConfig(**kwargs)


def test_numpy_ints_are_taken_as_ints() -> None:
    assert CollConfig(max_ctas=np.int64(3)).struct.maxCTAs == 3
    assert type(CollConfig(max_ctas=np.int32(3)).max_ctas) is int


# -- on the loopback (2.32.3) --------------------------------------------------------------------


@pytest.mark.parametrize("method", COLLS)
def test_every_collective_with_a_config_matches_numpy(world: ThreadWorld, method: str) -> None:
    cfg = CollConfig(max_ctas=2, cta_policy=1, user_profiler_tag=42)

    def call(comm: Communicator, m: str, send: Any, recv: Any, root: int) -> None:
        before = comm._seq
        _issue(comm, m, send, recv, root, config=cfg)
        record = comm.flight_record()[-1]
        assert comm._seq == before + 1
        assert record[1] == by_method_cfunc(m) + "Config"
        assert "Config count=" in comm.format_flight_record(1)

    _run(world, method, 1, call)


def by_method_cfunc(method: str) -> str:
    return next(row.cfunc for row in COLLECTIVES if row.method == method)


def test_raw_pointers_and_in_place_take_the_config_too(world: ThreadWorld) -> None:
    cfg = CollConfig(min_ctas=1)

    def one(r: int, comm: Communicator) -> None:
        x = DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32) * (r + 1), device=r)
        try:
            comm.all_reduce(x, config=cfg)  # in place
            comm.all_reduce(x.ptr, x.ptr, count=N, dtype=DataType.FLOAT32, config=cfg)
            comm.synchronize(timeout=60)
            once = np.arange(N, dtype=np.float32) * sum(range(1, SIZE + 1))
            np.testing.assert_array_equal(x.to_numpy(), once * SIZE)
            names = [e[1] for e in comm.flight_record()[-2:]]
            assert names == ["ncclAllReduceConfig"] * 2
        finally:
            x.close()

    world.run(one)


def test_the_config_reaches_nccl(world: ThreadWorld) -> None:
    # The loopback checks CTAPolicy as NCCL does (a bitmask of the three policies):
    # an invalid one comes back as NCCL's error for the Config variant.
    def one(r: int, comm: Communicator) -> None:
        x = DeviceBuffer(N, "float32", device=r)
        try:
            with pytest.raises(NcclInvalidArgument, match="ncclAllReduceConfig") as info:
                comm.all_reduce(x, config=CollConfig(cta_policy=8))
            assert "CTAPolicy" in str(info.value)
        finally:
            x.close()

    world.run(one)


def test_launch_completion_event_is_recorded(world: ThreadWorld) -> None:
    def one(r: int, comm: Communicator) -> None:
        x = DeviceBuffer.from_numpy(np.ones(N, np.float32), device=r)
        ev = Event(timing=False)
        try:
            cfg = CollConfig(launch_completion_event=ev)
            assert cfg.launch_completion_event is ev
            assert cfg.struct.launchCompletionEvent == ev.handle
            comm.all_reduce(x, config=cfg)
            comm.synchronize(timeout=60)
            ev.synchronize()
            np.testing.assert_array_equal(x.to_numpy(), np.full(N, SIZE, np.float32))
        finally:
            x.close()
            ev.close()

    world.run(one)


def test_a_group_keeps_the_config_alive(world: ThreadWorld) -> None:
    from pynccl import groups

    def one(r: int, comm: Communicator) -> None:
        x = DeviceBuffer.from_numpy(np.ones(N, np.float32), device=r)
        try:
            with pynccl.group():
                cfg = CollConfig(max_ctas=1)
                comm.all_reduce(x, config=cfg)
                # Held by the group until it ends (NCCL reads the struct, and records the
                # event, when the group launches).
                assert any(kept is cfg for kept in groups.kept_objects())
            assert groups.kept_objects() == []
            comm.synchronize(timeout=60)
            np.testing.assert_array_equal(x.to_numpy(), np.full(N, SIZE, np.float32))
        finally:
            x.close()

    world.run(one)


@pytest.mark.parametrize("method", [row.method for row in COLLECTIVES])
def test_a_non_config_is_refused_alike_by_every_method(solo: Communicator, method: str) -> None:
    x = DeviceBuffer(N, "float32", device=0)
    try:
        before = solo._seq
        with pytest.raises(TypeError) as info:
            if method in ("send", "recv"):
                getattr(solo, method)(x, 0, config={"max_ctas": 1})
            else:
                bad = {"max_ctas": 1}
                getattr(solo, method)(x.ptr, x.ptr, count=1, dtype="float32", config=bad)
        assert str(info.value) == (
            "config must be a pynccl.CollConfig or None, got dict {'max_ctas': 1}"
        )
        assert solo._seq == before
    finally:
        x.close()


@pytest.mark.parametrize("method", ["send", "recv"])
def test_point_to_point_has_no_config_variant(solo: Communicator, method: str) -> None:
    x = DeviceBuffer(N, "float32", device=0)
    try:
        before = solo._seq
        with pytest.raises(NotSupportedError, match=f"config= on {method}") as info:
            getattr(solo, method)(x, 0, config=CollConfig(max_ctas=1))
        assert "collectives only" in str(info.value)
        with pytest.raises(NotSupportedError):
            getattr(solo, f"{method}_init")(x, 0, config=CollConfig())
        assert solo._seq == before
    finally:
        x.close()


# -- emulated older releases ---------------------------------------------------------------------


def test_below_2_31_every_collective_refuses_naming_2_31() -> None:
    with use_loopback("2.30.3"):
        comm = Communicator(1, UniqueId(), 0, device=0)
        x = DeviceBuffer(N, "float32", device=0)
        try:
            for method in COLLS:
                with pytest.raises(NotSupportedError) as info:
                    getattr(comm, method)(x, x, config=CollConfig())
                text = str(info.value)
                assert "requires NCCL >= 2.31.2" in text and "2.30.3" in text
                assert f"{by_method_cfunc(method)}Config" in text
                with pytest.raises(NotSupportedError, match=r"2\.31\.2"):
                    getattr(comm, method + "_init")(x, x, config=CollConfig(max_ctas=1))
            assert comm._seq == 0  # nothing reached NCCL
            comm.all_reduce(x)  # without a config, as before
            assert [e[1] for e in comm.flight_record()] == ["ncclAllReduce"]
        finally:
            x.close()
            comm.destroy()


def test_a_field_newer_than_the_library_is_refused_naming_its_release() -> None:
    with use_loopback("2.31.2"):
        comm = Communicator(1, UniqueId(), 0, device=0)
        x = DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32), device=0)
        try:
            with pytest.raises(NotSupportedError) as info:
                comm.all_reduce(x, config=CollConfig(launch_completion_event=12345))
            text = str(info.value)
            assert "launchCompletionEvent" in text and "2.32" in text and "2.31.2" in text
            assert comm._seq == 0
            comm.all_reduce(x, config=CollConfig(max_ctas=1))  # 2.31 fields: fine
            comm.synchronize(timeout=60)
            np.testing.assert_array_equal(x.to_numpy(), np.arange(N, dtype=np.float32))
            assert comm.flight_record()[-1][1] == "ncclAllReduceConfig"
        finally:
            x.close()
            comm.destroy()
