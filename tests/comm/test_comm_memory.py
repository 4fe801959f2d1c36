"""NCCL memory and registrations in the object API on the loopback: mem_alloc and
DeviceBuffer(allocator="nccl") used by collectives (checked against numpy), Registration
(handle, close, context manager, keeping the buffer alive), deregister with a Registration
or a bare handle, tracking until destroy, and the version refusals."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

import pynccl
from pynccl import Communicator, NcclInvalidUsage, Registration, UniqueId
from pynccl.cuda import DeviceBuffer

N = 512


@pytest.fixture(scope="module")
def get(thread_worlds: Any) -> Any:
    return thread_worlds


def test_mem_alloc_buffers_in_collectives(get: Any) -> None:
    world = get(3)
    inputs = [np.random.default_rng(r).standard_normal(N).astype(np.float32) for r in range(3)]

    def body(r: int, comm: Communicator) -> tuple[np.ndarray, np.ndarray, str]:
        x = comm.mem_alloc(N, "float32")
        g = comm.mem_alloc(3 * N, pynccl.DataType.FLOAT32)
        try:
            assert x.allocator == "nccl" and x.device == comm.device and x.shape == (N,)
            assert x.ptr % 4096 == 0  # NCCL memory starts on a page
            x.copy_from(inputs[r])
            comm.all_gather(x, g)
            comm.all_reduce(x)
            comm.synchronize(timeout=60)
            return x.to_numpy(), g.to_numpy(), repr(x)
        finally:
            x.close()
            g.close()

    out = world.run(body)
    want = (inputs[0] + inputs[1]) + inputs[2]
    for r in range(3):
        summed, gathered, text = out[r]
        np.testing.assert_array_equal(summed, want)
        np.testing.assert_array_equal(gathered, np.concatenate(inputs))
        assert " nccl ptr=" in text


def test_device_buffer_with_the_nccl_allocator(lb: Any) -> None:
    x = np.arange(100, dtype=np.int32)
    buf = DeviceBuffer.from_numpy(x, allocator="nccl")
    assert buf.allocator == "nccl" and buf.ptr % 4096 == 0
    np.testing.assert_array_equal(buf.to_numpy(), x)
    buf.close()
    assert buf.closed and buf.ptr == 0
    buf.close()  # idempotent: ncclMemFree is called once
    empty = DeviceBuffer(0, "float32", allocator="nccl")
    assert empty.ptr == 0 and empty.allocator == "nccl"
    empty.close()
    assert DeviceBuffer(4, "float32").allocator == "cuda"
    with pytest.raises(ValueError, match="allocator must be 'cuda' or 'nccl', got 'numa'"):
        DeviceBuffer(4, "float32", allocator="numa")
    with DeviceBuffer(8, "float64", allocator="nccl") as scoped:
        scoped.fill_zero()
        assert (scoped.to_numpy() == 0).all()
    assert scoped.closed


def test_registration_object(get: Any) -> None:
    world = get(2)

    def body(r: int, comm: Communicator) -> list[str]:
        buf = comm.mem_alloc(N, "float32")
        reg = comm.register(buf)
        assert isinstance(reg, Registration) and reg.handle and not reg.closed
        assert reg.ptr == buf.ptr and reg.nbytes == 4 * N
        reg.close()
        assert reg.closed
        with pytest.raises(NcclInvalidUsage, match="is closed: its handle is no longer valid"):
            _ = reg.handle
        reg.close()  # idempotent
        with comm.register(buf, nbytes=100) as part:
            assert part.nbytes == 100
        assert part.closed
        # deregister takes a Registration, or its handle as a bare int (the old API)
        a, b = comm.register(buf), comm.register(buf)
        comm.deregister(a)
        comm.deregister(b.handle)
        assert a.closed and b.closed
        raw = comm.register(buf.ptr, nbytes=64)
        comm.deregister(raw)
        errors = []
        for bad, kind in (
            (lambda: comm.register(buf.ptr), TypeError),
            (lambda: comm.register(buf, nbytes=4 * N + 1), ValueError),
            (lambda: comm.register(buf, nbytes=-1), ValueError),
            (lambda: comm.register(0, nbytes=8), ValueError),
            (lambda: comm.deregister("x"), TypeError),  # type: ignore[arg-type]
        ):
            with pytest.raises(kind) as info:
                bad()
            errors.append(str(info.value))
        buf.close()
        return errors

    out = world.run(body)
    assert out[0] == out[1]
    assert "register(ptr) with a raw pointer needs nbytes=" in out[0][0]
    assert "nbytes=2049 is more than the 2048 bytes buf holds" in out[0][1]
    assert "nbytes=-1 is out of range; expected 0 <= nbytes < 2**64" in out[0][2]
    assert "buf is a NULL pointer but 8 bytes are needed there" in out[0][3]
    assert "handle must be a Registration or an int handle, got str" in out[0][4]


def test_registration_keeps_its_buffer_alive_and_destroy_releases_it(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    reg = comm.register(DeviceBuffer.from_numpy(np.ones(N, np.float32)))  # a temporary
    held = weakref.ref(reg._buf)  # type: ignore[arg-type]
    gc.collect()
    assert held() is not None  # registered memory is not freed under NCCL
    other = comm.register(comm.mem_alloc(N))
    comm.destroy()  # deregisters both, then destroys
    assert reg.closed and other.closed
    gc.collect()
    assert held() is None
    with pytest.raises(NcclInvalidUsage, match="is closed"):
        _ = other.handle


def test_abort_only_marks_registrations_closed(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    buf = comm.mem_alloc(N)
    reg = comm.register(buf)
    comm.abort()
    assert reg.closed
    reg.close()  # no C call on an aborted communicator
    comm.deregister(reg)
    buf.close()


def test_memory_needs_2_19(lb: Any) -> None:
    from support.worlds import use_loopback

    with use_loopback("2.18.1"):
        with Communicator(1, UniqueId(), 0, device=0) as comm:
            for call, name in (
                (lambda: comm.mem_alloc(16), "ncclMemAlloc"),
                (lambda: DeviceBuffer(16, allocator="nccl"), "DeviceBuffer(allocator='nccl')"),
                (lambda: comm.register(DeviceBuffer(16)), "ncclCommRegister"),
            ):
                with pytest.raises(pynccl.NotSupportedError) as info:
                    call()
                assert str(info.value).startswith(name)
                assert "it requires NCCL >= 2.19.1" in str(info.value)
