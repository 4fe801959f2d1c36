"""``with pynccl.group(simulate=True) as g:`` — ncclGroupSimulateEnd on the loopback.

The loopback's ncclGroupSimulateEnd plans the group without launching it and estimates
5 us per operation plus its bytes at 20 GB/s (pynccl/testing/loopback/nccl/launch.c);
:func:`loopback_estimate` is that model written out independently, and the receive
buffers prove that nothing ran: they keep their contents through a simulated group, and
a real group afterwards delivers the data of the real sends, not of the simulated ones.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from support.worlds import ThreadWorld, use_loopback

from pynccl import library
from pynccl.comm import Communicator
from pynccl.cuda import DeviceBuffer
from pynccl.enums import Result
from pynccl.errors import NcclInvalidUsage, NotSupportedError
from pynccl.groups import SimulatedGroup, group, group_depth, group_end, group_start

N = 4096  # float32 elements per operation

Worlds = Callable[[int], ThreadWorld]


def loopback_estimate(*nbytes: int) -> float:
    """Seconds the loopback estimates for operations of these byte sizes."""
    return sum(5.0 + b / 20e3 for b in nbytes) * 1e-6


def _buf(values: Any, device: int) -> DeviceBuffer:
    return DeviceBuffer.from_numpy(np.asarray(values, dtype=np.float32), device=device)


@pytest.fixture
def pair(thread_worlds: Worlds) -> ThreadWorld:
    return thread_worlds(2)


def _no_group_is_open() -> None:
    """The library has no group open on this thread: one more end is NCCL's misuse."""
    assert group_depth() == 0
    with pytest.raises(NcclInvalidUsage):
        library.lib().ncclGroupEnd()


def test_send_recv_are_estimated_and_not_run(pair: ThreadWorld) -> None:
    def one(r: int, comm: Communicator) -> tuple[float | None, list[float], list[float]]:
        peer = 1 - r
        with _buf(np.full(N, 10.0 + r), r) as fake, _buf(np.full(N, 20.0 + r), r) as real, \
                _buf(np.full(N, -1.0), r) as dest:  # fmt: skip
            g = group(simulate=True)
            assert isinstance(g, SimulatedGroup) and g.estimated_time is None
            with g as entered:
                assert entered is g and group_depth() == 1
                comm.send(fake, peer)
                comm.recv(dest, peer)
            assert group_depth() == 0
            comm.synchronize()
            untouched = dest.to_numpy().tolist()
            with group():  # a real exchange afterwards gets the real data
                comm.send(real, peer)
                comm.recv(dest, peer)
            comm.synchronize()
            return g.estimated_time, untouched, dest.to_numpy().tolist()

    for r, (estimate, untouched, got) in pair.run(one).items():
        assert estimate == pytest.approx(loopback_estimate(4 * N, 4 * N), rel=1e-6)
        assert untouched == [-1.0] * N
        assert got == [20.0 + (1 - r)] * N


def test_a_collective_is_estimated_and_not_run(pair: ThreadWorld) -> None:
    def one(r: int, comm: Communicator) -> tuple[float | None, list[float], list[float]]:
        with _buf(np.full(N, 1.0 + r), r) as src, _buf(np.zeros(N), r) as dest:
            with group(simulate=True) as g:
                comm.all_reduce(src, dest)
                with group():  # a plain group nested inside: simulated with it
                    comm.all_reduce(src, dest, count=N // 2)
            comm.synchronize()
            before = dest.to_numpy().tolist()
            comm.all_reduce(src, dest)
            comm.synchronize()
            return g.estimated_time, before, dest.to_numpy().tolist()

    for estimate, before, after in pair.run(one).values():
        assert estimate == pytest.approx(loopback_estimate(4 * N, 2 * N), rel=1e-6)
        assert before == [0.0] * N
        assert after == [3.0] * N


def test_an_empty_simulated_group_has_no_estimate(lb: Any) -> None:
    with group(simulate=True) as g:
        pass
    assert g.estimated_time is None
    _no_group_is_open()


def test_a_reentered_group_forgets_its_last_estimate(pair: ThreadWorld) -> None:
    def one(r: int, comm: Communicator) -> tuple[float | None, float | None, float | None]:
        with _buf(np.full(N, 1.0), r) as src:
            g = group(simulate=True)
            with g:
                comm.all_reduce(src)
            first = g.estimated_time
            with g:
                during = g.estimated_time
            return first, during, g.estimated_time

    for first, during, second in pair.run(one).values():
        assert first == pytest.approx(loopback_estimate(4 * N), rel=1e-6)
        assert during is None and second is None  # the second group had no operation


def test_nested_simulation_is_refused_before_any_c_call(lb: Any) -> None:
    with group():
        with pytest.raises(NcclInvalidUsage, match="outermost group"):
            with group(simulate=True):
                pytest.fail("the body of a refused group ran")
        assert group_depth() == 1  # the refused group opened nothing
    _no_group_is_open()
    group_start()
    try:
        with pytest.raises(NcclInvalidUsage, match="outermost group"):
            group(simulate=True).__enter__()
        assert group_depth() == 1
    finally:
        assert group_end() == Result.SUCCESS
    _no_group_is_open()


def test_simulate_must_be_a_bool(lb: Any) -> None:
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match=r"group\(simulate=...\) takes True or False"):
            group(simulate=bad)  # type: ignore[arg-type]
    assert group().estimated_time is None  # a plain group makes no estimate


def test_body_exception_propagates_and_ends_the_group(lb: Any) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with group(simulate=True):
            assert group_depth() == 1
            raise Boom
    _no_group_is_open()


class _Cai:
    """A device array seen only through ``__cuda_array_interface__`` (weakly referable)."""

    def __init__(self, buf: DeviceBuffer) -> None:
        self.__cuda_array_interface__ = {
            "shape": buf.shape,
            "typestr": "<f4",
            "data": (buf.ptr, False),
            "strides": None,
            "version": 3,
        }


def test_buffers_are_kept_alive_until_the_simulated_end(pair: ThreadWorld) -> None:
    def one(r: int, comm: Communicator) -> tuple[bool, bool, float | None]:
        with _buf(np.full(8, 1.0), r) as src:
            with group(simulate=True) as g:
                temp = _Cai(src)
                alive = weakref.ref(temp)
                comm.send(temp, 1 - r)
                comm.recv(_Cai(src), 1 - r)
                del temp
                gc.collect()
                kept = alive() is not None  # the group holds it until it ends
            gc.collect()
            return kept, alive() is None, g.estimated_time

    for kept, released, estimate in pair.run(one).values():
        assert kept and released
        assert estimate == pytest.approx(loopback_estimate(32, 32), rel=1e-6)


@pytest.fixture
def old_library() -> Iterator[None]:
    with use_loopback("2.18.1"):
        yield


def test_older_library_is_not_supported_before_the_group_starts(old_library: None) -> None:
    assert library.version() < (2, 22, 3)
    with pytest.raises(NotSupportedError, match=r"2\.22\.3") as info:
        with group(simulate=True):
            pytest.fail("the body ran")
    assert "ncclGroupSimulateEnd" in str(info.value)
    _no_group_is_open()
    with group():  # plain groups still work there
        assert group_depth() == 1
    _no_group_is_open()
