"""cuda-python interop, against the real classes of cuda-bindings and cuda-core (skipped
where they do not import): a ``CUdeviceptr`` is a raw pointer, a cuda.core ``Buffer`` is
untyped bytes that ``dtype=``/``count=`` type when its size divides, and a device ordinal
is any ``__index__`` object or one with ``.device_id`` (cuda.core ``Device``), by the one
rule :func:`pynccl._limits.check_device_ordinal`. Results against numpy on the loopback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from support.worlds import ThreadWorld

from pynccl import Communicator, UniqueId
from pynccl._adapt import as_buffer
from pynccl._limits import check_device_ordinal, check_pointer
from pynccl.cuda import DeviceBuffer, Stream

driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
cuda_core = pytest.importorskip("cuda.core", reason="cuda-core is not installed")
CUdeviceptr = driver.CUdeviceptr
Buffer = cuda_core.Buffer


class HasDeviceId:
    """The protocol only (cuda.core's Device needs a driver to be made)."""

    def __init__(self, device_id: object) -> None:
        self.device_id = device_id


def _real_device() -> Any:
    try:
        return cuda_core.Device(0)
    except Exception as exc:  # no NVIDIA driver here
        pytest.skip(f"cuda.core.Device cannot be made without a driver: {exc}")


# --- device ordinals ------------------------------------------------------------------------


def test_device_ordinal_rule() -> None:
    assert check_device_ordinal(3) == 3
    assert check_device_ordinal(np.int64(2)) == 2
    assert check_device_ordinal(HasDeviceId(1)) == 1
    with pytest.raises(TypeError, match="device must be an int, got bool True"):
        check_device_ordinal(True)
    with pytest.raises(TypeError, match=r"device must be an int, got float 1.0"):
        check_device_ordinal(1.0)
    with pytest.raises(ValueError, match=r"device=-1 is out of range; expected 0 <= device"):
        check_device_ordinal(-1)
    with pytest.raises(ValueError, match=r"device.device_id=-2 is out of range"):
        check_device_ordinal(HasDeviceId(-2))
    with pytest.raises(TypeError, match=r"device.device_id must be an int, got str"):
        check_device_ordinal(HasDeviceId("0"))
    with pytest.raises(TypeError, match="device must be an int, got str"):
        check_device_ordinal("0")


def test_a_real_cuda_core_device_is_an_ordinal() -> None:
    dev = _real_device()
    assert check_device_ordinal(dev) == dev.device_id


def test_every_device_argument_takes_the_rule(lb: Any) -> None:
    with DeviceBuffer(4, "float32", device=HasDeviceId(1)) as b:
        assert b.device == 1
    s = Stream(device=np.int32(1))
    s.close()
    c = Communicator(1, UniqueId(), 0, device=HasDeviceId(0))
    try:
        assert c.device == 0
    finally:
        c.destroy()
    with pytest.raises(ValueError, match=r"device.device_id=-1 is out of range"):
        Communicator(1, UniqueId(), 0, device=HasDeviceId(-1))
    with pytest.raises(TypeError, match="device must be an int, got float"):
        DeviceBuffer(4, "float32", device=0.0)


# --- CUdeviceptr ------------------------------------------------------------------------------


def test_cudeviceptr_is_a_raw_pointer(lb: Any) -> None:
    with DeviceBuffer(8, "float32") as d:
        assert as_buffer(CUdeviceptr(d.ptr), 8, "float32") == (d.ptr, 8, d.dtype, None)
        with pytest.raises(TypeError, match=r"is a raw pointer .* count= must be given"):
            as_buffer(CUdeviceptr(d.ptr), None, "float32")
    assert check_pointer(CUdeviceptr(0x1000), "ptr", 4) == 0x1000
    with pytest.raises(ValueError, match="ptr is a NULL pointer but 4 bytes are needed"):
        check_pointer(CUdeviceptr(0), "ptr", 4)


def test_collectives_take_cudeviceptr(thread_worlds: Callable[[int], ThreadWorld]) -> None:
    n, count = 2, 5

    def run(r: int, comm: Communicator) -> tuple[np.ndarray, np.ndarray]:
        data = np.arange(count, dtype=np.float32) * (r + 1)
        with (
            DeviceBuffer.from_numpy(data) as x,
            DeviceBuffer(count, "float32") as y,
            DeviceBuffer(count * n, "float32") as z,
        ):
            comm.all_reduce(CUdeviceptr(x.ptr), CUdeviceptr(y.ptr), count=count, dtype="float32")
            comm.all_gather_v(CUdeviceptr(x.ptr), CUdeviceptr(z.ptr), [count] * n, dtype="float32")
            comm.synchronize(timeout=30)
            return y.to_numpy(), z.to_numpy()

    out = thread_worlds(n).run(run)
    base = np.arange(count, dtype=np.float32)
    for y, z in out.values():
        np.testing.assert_array_equal(y, base * 3)
        np.testing.assert_array_equal(z, np.concatenate([base, base * 2]))


def test_register_takes_cudeviceptr(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    try:
        with DeviceBuffer(4096, "uint8") as x:
            with comm.register(CUdeviceptr(x.ptr), nbytes=4096) as reg:
                assert (reg.ptr, reg.nbytes) == (x.ptr, 4096)
            with pytest.raises(TypeError, match="needs nbytes="):
                comm.register(CUdeviceptr(x.ptr))
    finally:
        comm.destroy()


# --- cuda.core Buffer -------------------------------------------------------------------------


def test_a_buffer_is_bytes_typed_by_dtype(lb: Any) -> None:
    with DeviceBuffer(16, "float32") as d:
        b = Buffer.from_handle(d.ptr, d.nbytes)
        assert as_buffer(b)[1:3] == (64, as_buffer(b, dtype="uint8")[2])
        assert as_buffer(b, dtype="float32")[:3] == (d.ptr, 16, d.dtype)
        assert as_buffer(b, 3, "float64")[1] == 3
        assert as_buffer(b, dtype="complex64")[1] == 16  # 8 complex64 = 16 floats
        with pytest.raises(ValueError, match="count=9 is larger than sendbuf, which holds only 8"):
            as_buffer(b, 9, "float64")
        odd = Buffer.from_handle(d.ptr, 10)
        with pytest.raises(
            ValueError,
            match=r"recvbuf is a byte buffer of 10 bytes, not a whole number of float32 "
            r"elements \(4 bytes each\)",
        ):
            as_buffer(odd, dtype="float32", name="recvbuf")
        b.close()
        with pytest.raises(ValueError, match=r"sendbuf is a cuda.core Buffer that has been closed"):
            as_buffer(b)


def test_collectives_take_a_buffer(thread_worlds: Callable[[int], ThreadWorld]) -> None:
    n, count = 3, 4

    def run(r: int, comm: Communicator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        data = (np.arange(count) + 10 * r).astype(np.float64)
        with (
            DeviceBuffer.from_numpy(data) as x,
            DeviceBuffer(count, "float64") as y,
            DeviceBuffer.from_numpy(np.full(8, r, np.uint8)) as w,
            DeviceBuffer(count * n, "float64") as z,
        ):
            bx = Buffer.from_handle(x.ptr, x.nbytes)
            by = Buffer.from_handle(y.ptr, y.nbytes)
            bw = Buffer.from_handle(w.ptr, w.nbytes)
            bz = Buffer.from_handle(z.ptr, z.nbytes)
            comm.all_reduce(bx, by, "max", dtype="float64")
            comm.broadcast(bw, root=2)  # untyped: 8 bytes, in place
            comm.all_to_all_v(bz, bz, [0] * n, [0] * n, dtype="float64")  # nothing moves
            comm.all_gather_v(bx, bz, [count] * n, dtype="float64")
            comm.synchronize(timeout=30)
            return y.to_numpy(), w.to_numpy(), z.to_numpy()

    out = thread_worlds(n).run(run)
    for y, w, z in out.values():
        np.testing.assert_array_equal(y, np.arange(count) + 10 * (n - 1))
        np.testing.assert_array_equal(w, np.full(8, 2, np.uint8))
        np.testing.assert_array_equal(
            z, np.concatenate([np.arange(count) + 10 * j for j in range(n)]).astype(np.float64)
        )
