"""NCCL memory as other libraries' allocator, on the loopback: CuPy (the real library, which
imports and makes its memory objects without a GPU), cuda.core (the real MemoryResource
base; its Buffer needs a driver) and the torch shim (called through ctypes as torch's
CUDAPluggableAllocator would; torch's side needs a CUDA build). Each allocation is
registered as a window, used in a collective against numpy, and freed with nothing left
behind: the loopback's leak counter and ``comm.mem_stats()`` come back to where they were."""

from __future__ import annotations

import ctypes
import gc
import os
import re
from collections.abc import Iterator
from ctypes import POINTER, c_int, c_long, c_size_t, c_void_p
from typing import Any

import numpy as np
import pytest
from support.cudart import read_f32

import pynccl
from pynccl import Communicator
from pynccl.cuda import DeviceBuffer, set_device
from pynccl.cuda._buffer import wait_dropped
from pynccl.interop import cupy_allocator, torch_allocator_shim, torch_mem_pool

N = 1024  # float32 elements


@pytest.fixture(scope="module")
def get(thread_worlds: Any) -> Any:
    return thread_worlds


#: A communicator and its NcclMemoryResource (the ``resource`` fixture).
Resource = tuple[Communicator, Any]


@pytest.fixture()
def resource(lb: Any) -> Iterator[Resource]:
    """A 1-rank communicator and its cuda.core ``NcclMemoryResource`` (skips without
    cuda-core); the communicator is destroyed after the test."""
    pytest.importorskip("cuda.core", reason="cuda-core is not installed")
    from pynccl.interop import NcclMemoryResource

    comm = Communicator(1, pynccl.UniqueId(), 0, device=0)
    try:
        yield comm, NcclMemoryResource(comm)
    finally:
        comm.destroy()


def _find(ptr: int, nbytes: int) -> int:
    """The device of the loopback allocation holding [ptr, +nbytes), or -1."""
    fn = ctypes.CDLL(pynccl.cudart().path).pynccl_lb_find_alloc
    fn.restype, fn.argtypes = c_int, [c_void_p, c_size_t, POINTER(c_int)]
    dev = c_int(-1)
    return dev.value if fn(ptr, nbytes, ctypes.byref(dev)) == 1 else -1


def live(device: int = -1) -> tuple[int, int]:
    """The loopback's leak counter: (live allocations, their bytes)."""
    fn = ctypes.CDLL(pynccl.cudart().path).pynccl_lb_live_allocations
    fn.restype, fn.argtypes = c_long, [c_int, POINTER(c_size_t)]
    nbytes = c_size_t()
    return int(fn(device, ctypes.byref(nbytes))), nbytes.value


def settled() -> tuple[int, int]:
    gc.collect()
    assert wait_dropped()
    return live()


def _fill(ptr: int, values: np.ndarray) -> None:
    ctypes.memmove(ptr, values.ctypes.data, values.nbytes)  # loopback memory is host memory


def _warm(world: Any) -> None:
    """One window and one barrier on every rank first: the communicators' own scratch
    (the registration's agreement, the barrier), kept until they are destroyed, is then
    part of the baseline."""

    def body(r: int, comm: Communicator) -> None:
        buf = comm.mem_alloc(N, "float32")
        with comm.register_window(buf):
            comm.barrier()
            comm.synchronize()
        buf.close()

    world.run(body)


def _window_all_reduce(comm: Communicator, ptr: int, r: int) -> np.ndarray:
    """Register [ptr, +4N) as a window, all_reduce in place on it, deregister."""
    _fill(ptr, np.arange(N, dtype=np.float32) * (r + 1))
    with comm.register_window(ptr, nbytes=4 * N) as win:
        assert win.nbytes == 4 * N
        comm.all_reduce(ptr, ptr, count=N, dtype="float32")
        comm.synchronize()
        out = read_f32(ptr, N)
        comm.barrier()
        comm.synchronize()
    return out


def test_the_leak_counter_counts_nccl_and_cuda_allocations(lb: Any) -> None:
    before = settled()
    a = DeviceBuffer((N,), "float32", 0, allocator="nccl")
    b = DeviceBuffer((3,), "int8", 1)
    count, nbytes = live()
    assert count == before[0] + 2 and nbytes >= before[1] + 4 * N + 3
    assert live(0)[0] >= 1 and live(5) == (0, 0)
    assert live(1)[0] >= 1
    a.close()
    assert live()[0] == before[0] + 1
    b.close()
    assert live() == before


# ---- CuPy -------------------------------------------------------------------------------


def test_cupy_allocator(get: Any) -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda13x)")
    world = get(2)
    _warm(world)
    before = settled()
    stats = world.run(lambda r, c: c.mem_stats())

    def body(r: int, comm: Communicator) -> np.ndarray:
        alloc = cupy_allocator(comm)
        p = alloc(4 * N)
        assert isinstance(p, cupy.cuda.MemoryPointer)
        assert p.mem.size == 4 * N and p.device_id == comm.device and p.ptr % 4096 == 0
        assert live(comm.device)[0] >= 1
        out = _window_all_reduce(comm, p.ptr, r)
        empty = alloc(0)
        assert empty.ptr == 0 and empty.mem.size == 0
        cupy.cuda.MemoryPool(alloc)  # CuPy's pool takes it (its malloc needs a GPU)
        set_device(1 - comm.device)
        try:
            with pytest.raises(ValueError, match=f"the current device is {1 - comm.device}"):
                alloc(16)
        finally:
            set_device(comm.device)
        del p
        return out

    out = world.run(body)
    want = np.arange(N, dtype=np.float32) * 3
    for r in (0, 1):
        np.testing.assert_array_equal(out[r], want)
    assert settled() == before
    assert world.run(lambda r, c: c.mem_stats()) == stats


def test_cupy_set_allocator_routes_cupy_alloc(lb: Any) -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda13x)")
    comm = Communicator(1, pynccl.UniqueId(), 0, device=0)
    previous = cupy.cuda.get_allocator()
    before = settled()
    try:
        cupy.cuda.set_allocator(cupy_allocator(comm))
        p = cupy.cuda.alloc(100)  # CuPy's own entry point, through the allocator
        assert live() == (before[0] + 1, before[1] + 4096 + 4096)  # one page, and its guard
        assert p.mem.size == 100
        del p
        assert settled() == before
    finally:
        cupy.cuda.set_allocator(previous)
        comm.destroy()
    with pytest.raises(TypeError, match=r"comm must be a pynccl\.Communicator, got int"):
        cupy_allocator(3)  # type: ignore[arg-type]


# ---- cuda.core --------------------------------------------------------------------------


def test_nccl_memory_resource(resource: Resource) -> None:
    import cuda.core as core

    comm, mr = resource
    assert isinstance(mr, core.MemoryResource)
    assert (mr.device_id, mr.is_device_accessible, mr.is_host_accessible) == (0, True, False)
    assert not mr.is_managed
    before = settled()
    try:
        buf = mr.allocate(4 * N, stream=None)
    except Exception as exc:  # no driver: cuda.core cannot make a device Buffer
        assert live() == before and mr.live_allocations == 0  # nothing left behind
        pytest.skip(f"cuda.core's Buffer needs a CUDA driver: {exc}")
    assert buf.size == 4 * N and buf.memory_resource is mr
    out = _window_all_reduce(comm, int(buf.handle), 0)
    np.testing.assert_array_equal(out, np.arange(N, dtype=np.float32))
    buf.close()
    assert settled() == before and mr.live_allocations == 0


def test_nccl_memory_resource_refuses_foreign_pointers(resource: Resource) -> None:
    from pynccl.interop import NcclMemoryResource

    _, mr = resource
    with pytest.raises(ValueError, match="ptr=0x1000 was not allocated by this resource"):
        mr.deallocate(0x1000, 16, stream=None)
    with pytest.raises(TypeError, match=r"comm must be a pynccl\.Communicator"):
        NcclMemoryResource(None)


def test_nccl_memory_resource_keeps_what_a_failed_deallocate_did_not_free(
    resource: Resource,
) -> None:
    comm, mr = resource
    before = settled()
    buf = comm.mem_alloc(64, "uint8")
    mr._live[buf.ptr] = buf  # as allocate() keeps it (its Buffer needs a CUDA driver)
    with pytest.raises(pynccl.CudaError, match="cudaErrorInvalidResourceHandle"):
        mr.deallocate(buf.ptr, 64, stream=0xDEAD0)  # no such stream: nothing waited for
    assert mr.live_allocations == 1 and live()[0] == before[0] + 1  # not freed, kept
    mr.deallocate(buf.ptr, 64, stream=None)  # the retry frees it
    del buf
    assert mr.live_allocations == 0 and settled() == before


def test_nccl_memory_resource_frees_every_empty_buffer(resource: Resource) -> None:
    # allocate(0) allocates nothing (cuda.core's resources give an empty buffer at 0), so
    # every empty buffer's close, deallocate(0, 0), frees nothing and is no error: a
    # second one said "ptr=0x0 was not allocated by this resource" (in Buffer's close).
    _, mr = resource
    before = settled()
    for _ in range(2):
        mr.deallocate(0, 0, stream=None)
    assert mr.live_allocations == 0 and settled() == before
    with pytest.raises(ValueError, match="ptr=0x0 was not allocated by this resource"):
        mr.deallocate(0, 16, stream=None)  # 16 bytes at 0 are no empty buffer


# ---- torch ------------------------------------------------------------------------------


def _shim() -> Any:
    lib = ctypes.CDLL(torch_allocator_shim())
    lib.pynccl_nccl_alloc.restype = c_void_p
    lib.pynccl_nccl_alloc.argtypes = [c_long, c_int, c_void_p]
    lib.pynccl_nccl_free.restype = None
    lib.pynccl_nccl_free.argtypes = [c_void_p, c_long, c_int, c_void_p]
    return lib


def test_torch_shim_allocates_on_the_asked_device(get: Any) -> None:
    world = get(2)
    _warm(world)
    before = settled()
    shim = _shim()

    def body(r: int, comm: Communicator) -> np.ndarray:
        ptr = shim.pynccl_nccl_alloc(4 * N, comm.device, None)
        assert ptr and ptr % 4096 == 0
        assert _find(ptr, 4 * N) == comm.device
        out = _window_all_reduce(comm, ptr, r)
        # Another device asked for: allocated there, the caller's device kept.
        other = shim.pynccl_nccl_alloc(64, 1 - comm.device, None)
        assert pynccl.cuda.get_device() == comm.device
        assert _find(other, 64) == 1 - comm.device
        shim.pynccl_nccl_free(other, 64, 1 - comm.device, None)
        assert shim.pynccl_nccl_alloc(0, comm.device, None) is None
        shim.pynccl_nccl_free(ptr, 4 * N, comm.device, None)
        return out

    out = world.run(body)
    for r in (0, 1):
        np.testing.assert_array_equal(out[r], np.arange(N, dtype=np.float32) * 3)
    assert settled() == before
    assert shim.pynccl_shim_last_error() == 0


def test_torch_shim_builds_where_the_compiler_warns(
    lb: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Built on a user's machine: a compiler warning (here CC's -Wpedantic: ISO C has no
    # dlsym cast to a function pointer) is no error, as for the loopback libraries.
    monkeypatch.setenv("PYNCCL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", f"{os.environ.get('CC') or 'cc'} -Wpedantic")
    path = torch_allocator_shim()
    assert path.startswith(str(tmp_path))
    lib = ctypes.CDLL(path)
    lib.pynccl_nccl_alloc.restype = c_void_p
    lib.pynccl_nccl_alloc.argtypes = [c_long, c_int, c_void_p]
    lib.pynccl_nccl_free.argtypes = [c_void_p, c_long, c_int, c_void_p]
    before = settled()
    ptr = lib.pynccl_nccl_alloc(64, 0, None)
    assert ptr and _find(ptr, 64) == 0
    lib.pynccl_nccl_free(ptr, 64, 0, None)
    assert settled() == before


def test_torch_mem_pool_needs_cuda_torch(lb: Any) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    comm = Communicator(1, pynccl.UniqueId(), 0, device=0)
    try:
        if torch.cuda.is_available():
            pool = torch_mem_pool(comm)
            assert isinstance(pool, torch.cuda.MemPool)
            return
        with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} has none")):
            torch_mem_pool(comm)
    finally:
        comm.destroy()


def test_torch_mem_pool_refuses_what_is_no_communicator_as_the_other_allocators() -> None:
    # Before torch is looked at, with cupy_allocator's and NcclMemoryResource's wording.
    with pytest.raises(TypeError, match=r"comm must be a pynccl\.Communicator, got int"):
        torch_mem_pool(3)  # type: ignore[arg-type]
