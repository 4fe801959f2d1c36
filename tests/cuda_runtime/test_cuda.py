"""pynccl.cuda: argument handling (no library), the real libcudart without a driver
(subprocess), and the objects against a CUDA runtime with devices: the loopback
libcudart from ``pynccl.testing.loopback.build()``, or the library named by
``$PYNCCL_TEST_CUDART`` (e.g. the real one on a GPU machine).

Results are checked against numpy and numpy's own dtype strings.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from support import ROOT
from support.child import last_json, run_python

from pynccl import cuda, library
from pynccl.cuda import DeviceBuffer, Event, MemoryType, Stream, stream_handle
from pynccl.cuda._buffer import wait_dropped
from pynccl.enums import DataType
from pynccl.errors import CudaError

CUDART = "/usr/local/cuda/lib64/libcudart.so.13"
HAS_DRIVER = os.path.exists("/proc/driver/nvidia/version")

# --- no library needed ------------------------------------------------------------------


class _CudaStreamProto:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


class _TorchLike:
    cuda_stream = 0x1234


class _CupyLike:
    ptr = 0x5678


def test_stream_handle_accepts_every_protocol() -> None:
    assert stream_handle(None) == 0
    assert stream_handle(0xABC) == 0xABC
    assert stream_handle(_CudaStreamProto(0x42)) == 0x42
    assert stream_handle(_TorchLike()) == 0x1234
    assert stream_handle(_CupyLike()) == 0x5678
    assert stream_handle(Stream.legacy_default()) == 0x1  # cudaStreamLegacy
    assert stream_handle(Stream.per_thread_default()) == 0x2  # cudaStreamPerThread


@pytest.mark.parametrize("bad", ["0", 1.5, object(), True])
def test_stream_handle_rejects_non_streams(bad: Any) -> None:
    with pytest.raises(TypeError, match="stream"):
        stream_handle(bad)


def test_stream_handle_rejects_negative_and_bad_protocol() -> None:
    with pytest.raises(ValueError, match="-3"):
        stream_handle(-3)

    class Bad:
        def __cuda_stream__(self) -> int:
            return 7

    with pytest.raises(TypeError, match="version, handle"):
        stream_handle(Bad())


def test_wrapped_stream_is_borrowed() -> None:
    owner = _CudaStreamProto(0x99)
    s = Stream.wrap(owner)
    assert (s.handle, s.owned, s.__cuda_stream__()) == (0x99, False, (0, 0x99))
    assert Stream.wrap(s) is s
    s.close()  # never destroys what it borrowed: no CUDA call, so no library needed
    assert s.closed
    with pytest.raises(ValueError, match="closed"):
        _ = s.handle
    with Stream.wrap(0x77) as t:
        assert t.handle == 0x77
    assert t.closed


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda: cuda.set_device("0"), TypeError, "^device must be an int, got str '0'$"),
        (lambda: cuda.set_device(True), TypeError, "^device must be an int, got bool True$"),
        (lambda: cuda.set_device(1.0), TypeError, "^device must be an int, got float 1.0$"),
        (lambda: cuda.set_device(-1), ValueError, r"^device=-1 is out of range; expected 0 <="),
        # 2**32 must not wrap to device 0 in ctypes' 32-bit int
        (lambda: cuda.set_device(1 << 32), ValueError, r"^device=4294967296 is out of range"),
        (lambda: Stream(device=1 << 32), ValueError, r"^device=4294967296 is out of range"),
        (lambda: DeviceBuffer(-4), ValueError, "shape=-4"),
        (lambda: DeviceBuffer((2, 2.5)), TypeError, "^shape must be an int or a tuple of ints"),
        (lambda: DeviceBuffer((2, True)), TypeError, "^shape must be an int or a tuple of ints"),
        (lambda: DeviceBuffer((1 << 32, 1 << 32)), ValueError, r"spans 18446744073709551616 e"),
        (lambda: DeviceBuffer(3, device=-2), ValueError, "device=-2"),
        (lambda: cuda.pointer_attributes("0x10"), TypeError, "^ptr must be a pointer"),
        (lambda: cuda.pointer_attributes(1 << 64), ValueError, "^ptr=0x1000"),
    ],
)
def test_bad_arguments_name_the_value(call: Any, exc: type[Exception], words: str) -> None:
    with pytest.raises(exc, match=words):
        call()


def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(TypeError, match=r"'int16' is not supported"):
        DeviceBuffer(4, "int16")
    with pytest.raises(TypeError, match=r"complex32.*complex64 or complex128"):
        DeviceBuffer(4, "complex32")


# --- the real libcudart without a driver (subprocess: it is loaded process-wide) -----------


def run_child(code: str) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYNCCL_")}
    env.update(PYTHONPATH=str(ROOT), PYNCCL_CUDART_LIBRARY=CUDART)
    return last_json(run_python(["-c", textwrap.dedent(code)], env))


@pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver")
@pytest.mark.skipif(not os.path.exists(CUDART), reason=f"no {CUDART}")
def test_real_cudart_without_driver() -> None:
    out = run_child(
        """
        import json
        from pynccl import cuda
        from pynccl.errors import CudaError
        calls = {
            "get_device": cuda.get_device,
            "set_device": lambda: cuda.set_device(0),
            "synchronize": cuda.synchronize,
            "Stream": cuda.Stream,
            "Event": cuda.Event,
            "DeviceBuffer": lambda: cuda.DeviceBuffer(16),
            "from_numpy": lambda: cuda.DeviceBuffer.from_numpy([1.0, 2.0]),
            "pointer_attributes": lambda: cuda.pointer_attributes(4096),
        }
        errors = {}
        for name, call in calls.items():
            try:
                call()
                errors[name] = None
            except CudaError as e:
                errors[name] = [e.name, e.code, e.function, str(e)]
        print(json.dumps({"count": cuda.device_count(), "runtime": cuda.runtime_version(),
                          "driver": cuda.driver_version(), "errors": errors}))
        """
    )
    assert out["count"] == 0
    assert out["driver"] is None
    assert out["runtime"][0] >= 12
    for name, err in out["errors"].items():
        assert err is not None, f"{name} succeeded without a driver"
        err_name, code, function, text = err
        assert err_name in ("cudaErrorInsufficientDriver", "cudaErrorNoDevice"), name
        assert code in (35, 100)
        assert function.startswith("cuda") and function in text
        assert err_name in text


# --- a CUDA runtime with devices -----------------------------------------------------------


def _runtime_with_devices() -> tuple[str, bool]:
    """(libcudart path, is_loopback) to test against, or skip."""
    override = os.environ.get("PYNCCL_TEST_CUDART")
    if override:
        return override, False
    try:
        from pynccl.testing import loopback
    except ImportError:
        pytest.skip("pynccl.testing.loopback is not available")
    try:
        # Only the cudart is needed here; it builds without the loopback libnccl.
        return str(loopback.build_cudart()), True
    except Exception as e:  # no compiler, etc.
        pytest.skip(f"cannot build the loopback libcudart: {e}")


@pytest.fixture(scope="module")
def runtime() -> Iterator[bool]:
    """Makes a runtime with devices the process's libcudart; yields whether it is the loopback."""
    path, is_loopback = _runtime_with_devices()
    before = library.loaded()[1]
    library._replace_for_testing(None, path)
    start = cuda.get_device()
    try:
        yield is_loopback
    finally:
        cuda.set_device(start)
        library._cudart = before  # the previous runtime (or none) again


def test_devices(runtime: bool) -> None:
    n = cuda.device_count()
    assert n >= 1
    if runtime:
        assert n == int(os.environ.get("PYNCCL_LOOPBACK_DEVICES", "8"))
    major, _minor = cuda.runtime_version()
    assert major >= 12
    assert cuda.driver_version() is not None
    start = cuda.get_device()
    try:
        cuda.set_device(n - 1)
        assert cuda.get_device() == n - 1
    finally:
        cuda.set_device(start)
    with pytest.raises(CudaError) as info:
        cuda.set_device(n + 5)
    assert info.value.name == "cudaErrorInvalidDevice"
    assert cuda.get_device() == start
    cuda.synchronize()


def _reference(dt: DataType, shape: tuple[int, ...]) -> Any:
    import numpy as np

    from pynccl.dtypes import to_numpy_dtype

    npdt = to_numpy_dtype(dt)
    values = (np.arange(int(np.prod(shape))) % 100 - 50).reshape(shape)
    if dt.name.startswith("UINT"):
        values = values + 50
    return values.astype(np.float64).astype(npdt)


@pytest.mark.parametrize("dt", list(DataType))
@pytest.mark.parametrize("shape", [(0,), (7,), (3, 5), (2, 3, 4)])
def test_round_trip_every_dtype(runtime: bool, dt: DataType, shape: tuple[int, ...]) -> None:
    import numpy as np

    host = _reference(dt, shape)
    with DeviceBuffer.from_numpy(host) as buf:
        assert (buf.dtype, buf.shape, buf.size) == (dt, shape, host.size)
        assert buf.nbytes == host.nbytes
        back = buf.to_numpy()
    assert back.dtype == host.dtype and back.shape == host.shape
    assert np.array_equal(back.view(np.uint8), host.view(np.uint8))  # bit-exact


@pytest.mark.parametrize("dt", list(DataType))
def test_cuda_array_interface(runtime: bool, dt: DataType) -> None:
    import numpy as np

    from pynccl.dtypes import to_numpy_dtype

    with DeviceBuffer((4, 6), dt) as buf:
        cai = buf.__cuda_array_interface__
        assert cai["version"] == 3
        assert cai["shape"] == (4, 6)
        assert cai["data"] == (buf.ptr, False)
        assert cai["strides"] is None
        # numpy's own typestr where numpy has the type; opaque items otherwise.
        special = {DataType.BFLOAT16: "<V2", DataType.FLOAT8_E4M3: "|V1"}
        special[DataType.FLOAT8_E5M2] = "|V1"
        expected = special.get(dt) or np.dtype(to_numpy_dtype(dt)).str
        assert cai["typestr"] == expected
        assert np.dtype(cai["typestr"]).itemsize == dt.itemsize
    with pytest.raises(ValueError, match="freed"):
        _ = buf.__cuda_array_interface__


@pytest.mark.parametrize("np_name", ["complex64", "complex128"])
def test_complex_round_trip(runtime: bool, np_name: str) -> None:
    import numpy as np

    from pynccl._adapt import as_buffer

    host = (np.arange(10) - 4.5j * np.arange(10)).astype(np_name).reshape(2, 5)
    with DeviceBuffer.from_numpy(host) as buf, DeviceBuffer(10, np_name) as other:
        assert buf.is_complex and (buf.shape, buf.size, buf.nbytes) == ((2, 5), 10, host.nbytes)
        assert buf.dtype.name.lower() == host.real.dtype.name  # each half's float type
        back = buf.to_numpy()
        assert back.dtype == host.dtype and np.array_equal(back, host)
        assert buf.__cuda_array_interface__["typestr"] == host.dtype.str
        other.copy_from(buf)
        assert np.array_equal(other.to_numpy(), host.reshape(-1))
        other.copy_from(host[::-1].reshape(-1))
        assert np.array_equal(other.to_numpy(), host[::-1].reshape(-1))
        with pytest.raises(ValueError, match=r"source dtype float64 does not match.*complex"):
            other.copy_from(np.zeros(10))
        ptr, n, dt, _dev = as_buffer(buf)
        assert (ptr, n, dt) == (buf.ptr, 20, buf.dtype)


def test_from_numpy_non_contiguous_and_lists(runtime: bool) -> None:
    import numpy as np

    a = np.arange(24, dtype=np.int32).reshape(4, 6).T  # Fortran order view
    with DeviceBuffer.from_numpy(a) as buf:
        assert np.array_equal(buf.to_numpy(), a)
    with DeviceBuffer.from_numpy([[1.5, 2.5]]) as buf:
        assert buf.dtype == DataType.FLOAT64
        assert np.array_equal(buf.to_numpy(), np.array([[1.5, 2.5]]))


def test_copy_from_host_and_device(runtime: bool) -> None:
    import numpy as np

    a = np.linspace(-1, 1, 12, dtype=np.float32)
    with DeviceBuffer(12, "float32") as dst, DeviceBuffer.from_numpy(a[::-1]) as src:
        dst.copy_from(a.reshape(3, 4))  # same count, another shape
        assert np.array_equal(dst.to_numpy(), a)
        dst.copy_from(src)
        assert np.array_equal(dst.to_numpy(), a[::-1])
        with pytest.raises(ValueError, match="float64"):
            dst.copy_from(a.astype(np.float64))
        with pytest.raises(ValueError, match="11 elements"):
            dst.copy_from(a[:11])
        with Stream() as s:
            dst.copy_from(a, stream=s)
            assert np.array_equal(dst.to_numpy(stream=s), a)


def test_fill_zero_and_stream_order(runtime: bool) -> None:
    import numpy as np

    a = np.arange(1, 1001, dtype=np.int64)
    with DeviceBuffer.from_numpy(a) as buf, Stream() as s1, Stream(non_blocking=True) as s2:
        buf.fill_zero(stream=s1)
        done = s1.record()
        s2.wait_event(done)
        # Ordered after the memset by the event: must see zeros.
        assert np.array_equal(buf.to_numpy(stream=s2), np.zeros_like(a))
        done.close()
        buf.copy_from(a)
        buf.fill_zero()
        assert not buf.to_numpy().any()


def test_streams_and_events(runtime: bool) -> None:
    with Stream() as s:
        assert s.owned and s.handle != 0
        assert s.__cuda_stream__() == (0, s.handle)
        assert s.query() is True  # nothing queued
        assert s.is_capturing() is False
        assert cuda.is_capturing(s) is False
        with Event() as start, Event() as end:
            start.record(s)
            with DeviceBuffer(1 << 16, "uint8") as buf:
                buf.fill_zero(stream=s)
                end.record(s)
                end.synchronize()
            assert end.query() is True
            assert start.elapsed_time(end) >= 0.0
        other = Stream()
        other.wait(s)
        other.synchronize()
        other.close()
        other.close()  # idempotent
        assert other.closed
    assert s.closed
    with pytest.raises(ValueError, match="closed"):
        s.synchronize()


def test_event_errors(runtime: bool) -> None:
    light = Event(timing=False).record()
    timed = Event().record()
    light.synchronize()
    timed.synchronize()
    with pytest.raises(CudaError):
        light.elapsed_time(timed)  # an event without timing cannot be timed
    with pytest.raises(TypeError, match="Event"):
        timed.elapsed_time(3)  # type: ignore[arg-type]
    light.close()
    timed.close()
    with pytest.raises(ValueError, match="closed"):
        timed.record()


def test_invalid_stream_handle_is_a_cuda_error(runtime: bool) -> None:
    if not runtime:
        pytest.skip("a bad handle may crash a real driver")
    bogus = Stream.wrap(0xDEAD00)
    with pytest.raises(CudaError) as info:
        bogus.synchronize()
    assert info.value.name == "cudaErrorInvalidResourceHandle"
    assert info.value.function == "cudaStreamSynchronize"


def test_devices_of_buffers_and_pointer_attributes(runtime: bool) -> None:
    import numpy as np

    n = cuda.device_count()
    target = n - 1
    start = cuda.get_device()
    with DeviceBuffer(8, "float32", device=target) as buf:
        assert buf.device == target
        assert cuda.get_device() == start  # restored
        assert cuda.pointer_attributes(buf.ptr) == (MemoryType.DEVICE, target)
    host = np.zeros(4)
    kind, _device = cuda.pointer_attributes(host.ctypes.data)
    assert kind == MemoryType.UNREGISTERED


def test_out_of_memory(runtime: bool) -> None:
    with pytest.raises(CudaError) as info:
        DeviceBuffer(1 << 60, "uint8")
    assert info.value.name == "cudaErrorMemoryAllocation"


def test_buffers_are_freed(runtime: bool) -> None:
    buf = DeviceBuffer(256, "int32")
    ptr = buf.ptr
    assert cuda.pointer_attributes(ptr)[0] == MemoryType.DEVICE
    buf.free()
    buf.close()  # idempotent
    assert buf.closed and buf.ptr == 0
    with pytest.raises(ValueError, match="freed"):
        buf.to_numpy()
    assert cuda.pointer_attributes(ptr)[0] != MemoryType.DEVICE
    # Dropped without close(): __del__ hands it to the reaper thread, which frees it (a
    # finalizer never waits for the device itself).
    buf2 = DeviceBuffer(256, "int32")
    ptr2 = buf2.ptr
    del buf2
    gc.collect()
    assert wait_dropped(timeout=10)
    assert cuda.pointer_attributes(ptr2)[0] != MemoryType.DEVICE


def test_package_facade_is_lazy_and_complete() -> None:
    # pynccl.cuda re-exports its public names lazily: importing the adaptation layer (which
    # needs only stream adaptation) loads none of the object modules or libcudart.
    code = textwrap.dedent(
        """
        import sys
        import pynccl._adapt
        loaded = sorted(m for m in sys.modules if m.startswith("pynccl.cuda."))
        from pynccl import cuda, library
        ns = {}
        exec("from pynccl.cuda import *", ns)
        missing = [n for n in cuda.__all__ if n not in ns]
        print(loaded, missing, library.loaded()[1] is None, "DeviceBuffer" in dir(cuda))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['pynccl.cuda._streamlike']", "[]", "True", "True"]
    with pytest.raises(AttributeError, match=r"module 'pynccl.cuda' has no attribute 'nope'"):
        _ = cuda.nope  # type: ignore[attr-defined]
