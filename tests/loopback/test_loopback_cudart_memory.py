"""The loopback libcudart, driven through ctypes directly: allocations, frees, copies and
memsets (a free waits for the device's pending work, a libnccl collective's included), and
the build checks: a sanitized build runs clean, the exports match CUDA's headers.

Results are checked against numpy re-computations; streams are held with a gate task
(see test_loopback_cudart.py).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from ctypes import byref, c_int, c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.cudart import (
    D2D,
    D2H,
    DEFAULT,
    H2D,
    H2H,
    INVALID_DEVICE,
    INVALID_DEVICE_POINTER,
    INVALID_MEMCPY_DIRECTION,
    INVALID_VALUE,
    NOT_READY,
    SUCCESS,
    PointerAttributes,
    TaskGate,
    built_cudart_path,  # noqa: F401  (the cudart_path fixture)
    clean_thread_state,  # noqa: F401  (autouse: per-test thread state)
    malloc,
    ndev,
    ok,
    standalone_rt,  # noqa: F401  (the rt fixture)
    stream,
)

from pynccl.testing import loopback
from pynccl.testing.loopback import _build

REAL_HEADERS = "/usr/local/cuda/include"


# ---- memory and copies ------------------------------------------------------------


def test_malloc_alignment_registry_and_attributes(rt: ctypes.CDLL) -> None:
    n = ndev(rt)
    dev = min(1, n - 1)
    ok(rt, rt.cudaSetDevice(dev))
    ptrs = [malloc(rt, size) for size in (1, 100, 4096, 1 << 20)]
    assert all(p % 256 == 0 for p in ptrs)
    attrs = PointerAttributes()
    for p, size in zip(ptrs, (1, 100, 4096, 1 << 20)):
        ok(rt, rt.cudaPointerGetAttributes(byref(attrs), p + size - 1))
        assert (attrs.type, attrs.device, attrs.devicePointer) == (2, dev, p + size - 1)
        found = c_int(-1)
        assert rt.pynccl_lb_find_alloc(p, size, byref(found)) == 1
        assert found.value == dev
        assert rt.pynccl_lb_find_alloc(p + size, 0, None) == 1  # one past the end
        assert rt.pynccl_lb_find_alloc(p + 1, size, None) == 0  # overruns the end
    host = np.zeros(16, np.uint8)
    ok(rt, rt.cudaPointerGetAttributes(byref(attrs), host.ctypes.data))
    assert (attrs.type, attrs.device, attrs.hostPointer) == (0, -2, host.ctypes.data)
    assert attrs.devicePointer is None
    assert rt.pynccl_lb_find_alloc(host.ctypes.data, 1, None) == 0
    assert rt.cudaPointerGetAttributes(None, ptrs[0]) == INVALID_VALUE
    for p in ptrs:
        ok(rt, rt.cudaFree(p))
    ok(rt, rt.cudaPointerGetAttributes(byref(attrs), ptrs[0]))
    assert attrs.type == 0  # freed: no longer device memory
    zero = c_void_p(1)
    ok(rt, rt.cudaMalloc(byref(zero), 0))
    assert zero.value is None
    assert rt.cudaMalloc(None, 16) == INVALID_VALUE
    huge = c_void_p()
    assert rt.cudaMalloc(byref(huge), 1 << 62) == 2  # cudaErrorMemoryAllocation
    assert huge.value is None


def test_bad_frees_are_errors_not_crashes(rt: ctypes.CDLL) -> None:
    p = malloc(rt, 1024)
    assert rt.cudaFree(p + 256) == INVALID_DEVICE_POINTER  # inside, not the start
    ok(rt, rt.cudaFree(p))
    assert rt.cudaFree(p) == INVALID_VALUE  # double free
    assert "double free" in rt.pynccl_lb_last_error_detail().decode()
    host = np.zeros(64, np.uint8)
    assert rt.cudaFree(host.ctypes.data) == INVALID_VALUE
    ok(rt, rt.cudaFree(None))
    q = c_void_p()
    ok(rt, rt.pynccl_lb_malloc(byref(q), 512, ndev(rt) - 1))
    found = c_int(-1)
    assert rt.pynccl_lb_find_alloc(q, 512, byref(found)) == 1
    assert found.value == ndev(rt) - 1
    assert rt.pynccl_lb_malloc(byref(q), 512, ndev(rt)) == INVALID_DEVICE
    ok(rt, rt.pynccl_lb_free(q))
    assert rt.pynccl_lb_free(q) == INVALID_VALUE


def test_sync_copies_and_memset_roundtrip(rt: ctypes.CDLL) -> None:
    rng = np.random.default_rng(1)
    src = rng.standard_normal(10_000).astype(np.float32)
    nbytes = src.nbytes
    a, b = malloc(rt, nbytes), malloc(rt, nbytes)
    ok(rt, rt.cudaMemcpy(a, src.ctypes.data, nbytes, H2D))
    ok(rt, rt.cudaMemcpy(b, a, nbytes, D2D))
    out = np.empty_like(src)
    ok(rt, rt.cudaMemcpy(out.ctypes.data, b, nbytes, D2H))
    np.testing.assert_array_equal(out, src)
    ok(rt, rt.cudaMemset(b + 400, 0x7F, 1000))
    ok(rt, rt.cudaMemcpy(out.ctypes.data, b, nbytes, DEFAULT))
    expected = src.copy()
    expected.view(np.uint8)[400:1400] = 0x7F
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))
    host2 = np.empty_like(src)
    ok(rt, rt.cudaMemcpy(host2.ctypes.data, src.ctypes.data, nbytes, H2H))
    np.testing.assert_array_equal(host2, src)
    ok(rt, rt.cudaMemcpy(out.ctypes.data, b, 0, D2H))  # nothing to do
    ok(rt, rt.cudaFree(a))
    ok(rt, rt.cudaFree(b))


def test_copy_argument_checks(rt: ctypes.CDLL) -> None:
    if os.environ.get("PYNCCL_LOOPBACK_STRICT") == "0":
        pytest.skip("the loaded loopback cudart is not strict")
    a = malloc(rt, 256)
    host = np.zeros(512, np.uint8)
    h = host.ctypes.data
    assert rt.cudaMemcpy(a, h, 256, 7) == INVALID_MEMCPY_DIRECTION
    assert rt.cudaMemcpy(h, h, 16, H2D) == INVALID_VALUE  # dst is not device memory
    assert "PYNCCL_LOOPBACK_STRICT" in rt.pynccl_lb_last_error_detail().decode()
    assert rt.cudaMemcpy(h, h, 16, D2H) == INVALID_VALUE  # src is not device memory
    assert rt.cudaMemcpy(a, h, 257, H2D) == INVALID_VALUE  # one byte past the end
    assert rt.cudaMemcpyAsync(a, a, 16, D2D, None) == SUCCESS
    assert rt.cudaMemcpy(None, h, 16, H2H) == INVALID_VALUE
    assert rt.cudaMemset(h, 0, 16) == INVALID_VALUE
    assert rt.cudaMemsetAsync(a + 128, 0, 129, None) == INVALID_VALUE
    ok(rt, rt.cudaMemcpy(h, h + 256, 256, DEFAULT))  # direction inferred: host is fine
    ok(rt, rt.cudaFree(a))


def test_relaxed_mode_allows_host_pointers(cudart_path: str) -> None:
    code = textwrap.dedent(
        """
        import ctypes, sys
        lib = ctypes.CDLL(sys.argv[1])
        src = (ctypes.c_char * 8)(*b"loopback")
        dst = (ctypes.c_char * 8)()
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
        rc = lib.cudaMemcpy(ctypes.addressof(dst), ctypes.addressof(src), 8, 1)
        lib.cudaStreamSynchronize(None)  # host to device returns before the copy lands
        print(rc, dst.raw.decode())
        """
    )
    for strict, expected in (("0", "0 loopback"), ("1", "1")):
        out = subprocess.run(
            [sys.executable, "-c", code, cudart_path],
            env={**os.environ, "PYNCCL_LOOPBACK_STRICT": strict},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert out.stdout.replace("\x00", "").split() == expected.split()


def test_long_async_chain_keeps_stream_order(rt: ctypes.CDLL) -> None:
    rng = np.random.default_rng(7)
    size = 4096
    ref = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(2)]
    bufs = [malloc(rt, size), malloc(rt, size)]
    s = stream(rt)
    keep = []  # host sources must stay alive and unchanged until the stream is done
    for i in range(2):
        keep.append(ref[i].copy())
        ok(rt, rt.cudaMemcpyAsync(bufs[i], keep[-1].ctypes.data, size, H2D, s))
    for _ in range(400):
        op = int(rng.integers(0, 3))
        i, j = (int(k) for k in rng.integers(0, 2, 2))
        off, off2 = (int(k) for k in rng.integers(0, size // 2, 2))
        n = int(rng.integers(1, size // 2))
        if op == 0:
            value = int(rng.integers(0, 256))
            ok(rt, rt.cudaMemsetAsync(bufs[i] + off, value, n, s))
            ref[i][off : off + n] = value
        elif op == 1:
            ok(rt, rt.cudaMemcpyAsync(bufs[j] + off2, bufs[i] + off, n, D2D, s))
            ref[j][off2 : off2 + n] = ref[i][off : off + n].copy()
        else:
            data = rng.integers(0, 256, n, dtype=np.uint8)
            keep.append(data)
            ok(rt, rt.cudaMemcpyAsync(bufs[i] + off, data.ctypes.data, n, H2D, s))
            ref[i][off : off + n] = data
    out = [np.empty(size, np.uint8) for _ in range(2)]
    for i in range(2):
        ok(rt, rt.cudaMemcpyAsync(out[i].ctypes.data, bufs[i], size, D2H, s))
    ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.cudaStreamQuery(s))
    for i in range(2):
        np.testing.assert_array_equal(out[i], ref[i])
    ok(rt, rt.cudaStreamDestroy(s))
    for b in bufs:
        ok(rt, rt.cudaFree(b))


def test_free_waits_for_the_device(rt: ctypes.CDLL) -> None:
    """cudaFree synchronizes the allocation's device, as CUDA's does."""
    s = stream(rt)
    a = malloc(rt, 1 << 16)
    returned = threading.Event()
    results: list[int] = []

    def free() -> None:
        results.append(rt.cudaFree(a))
        returned.set()

    with TaskGate(rt, s) as gate:
        ok(rt, rt.cudaMemsetAsync(a, 1, 1 << 16, s))
        t = threading.Thread(target=free)
        t.start()
        assert not returned.wait(0.3)  # the memset (behind the gate) is still pending
        assert rt.pynccl_lb_find_alloc(a, 1, None) == 1  # and its memory still allocated
        gate.open()
        assert returned.wait(30)
        t.join()
    assert results == [0]
    assert rt.cudaStreamQuery(s) == 0  # the queued work had completed
    assert rt.pynccl_lb_find_alloc(a, 1, None) == 0
    ok(rt, rt.cudaStreamDestroy(s))


def test_free_ignores_other_devices_work(rt: ctypes.CDLL) -> None:
    if ndev(rt) < 2:
        pytest.skip("needs 2 loopback devices")
    s = stream(rt)  # device 0
    a = malloc(rt, 4096)
    ok(rt, rt.cudaSetDevice(1))
    try:
        b = malloc(rt, 4096)
        with TaskGate(rt, s):
            ok(rt, rt.cudaFree(b))  # device 1 is idle: returns while device 0 is busy
            assert rt.cudaStreamQuery(s) == NOT_READY
    finally:
        ok(rt, rt.cudaSetDevice(0))
    ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.cudaFree(a))
    ok(rt, rt.cudaStreamDestroy(s))


@pytest.fixture(scope="module")
def nccl_lib(rt: ctypes.CDLL) -> object:
    """The loopback libnccl, linked to the very cudart ``rt`` is (one instance)."""
    from support.clib import Lib

    b = loopback.build()
    assert b.cudart == loopback.build_cudart()
    return Lib(b.nccl, b.cudart)


def _free_in_thread(
    rt: ctypes.CDLL, ptr: int
) -> tuple[threading.Thread, threading.Event, list[int]]:
    returned = threading.Event()
    results: list[int] = []

    def free() -> None:
        results.append(rt.cudaFree(ptr))
        returned.set()

    t = threading.Thread(target=free)
    t.start()
    return t, returned, results


def test_free_waits_for_a_pending_collective(rt: ctypes.CDLL, nccl_lib: Any) -> None:
    """A collective still waiting for its peer never sees its send buffer freed."""
    from support.clib import GroupWorld

    lib, n = nccl_lib, 1 << 14
    w = GroupWorld(lib, 2)
    send = [lib.malloc(4 * n, r) for r in range(2)]
    try:
        recv = [w.alloc(r, 4 * n) for r in range(2)]
        data = [np.arange(n, dtype=np.float32) * (r + 1) - r for r in range(2)]
        for r in range(2):
            lib.upload(send[r], data[r])
        # Rank 0 alone: its all-reduce waits on its stream for rank 1.
        assert lib.ncclAllReduce(send[0], recv[0], n, 7, 0, w.comms[0], w.streams[0]) == 0
        t, returned, results = _free_in_thread(rt, send[0])
        assert not returned.wait(0.3)  # cudaFree waits for device 0's pending work
        assert rt.pynccl_lb_find_alloc(send[0], 4 * n, None) == 1
        assert lib.ncclAllReduce(send[1], recv[1], n, 7, 0, w.comms[1], w.streams[1]) == 0
        assert returned.wait(30)
        t.join()
        assert results == [0]
        assert rt.cudaStreamQuery(w.streams[0]) == 0  # the collective had finished
        for r in range(2):
            assert lib.sync(w.streams[r]) == 0
            np.testing.assert_array_equal(lib.download(recv[r], np.float32, n), data[0] + data[1])
    finally:
        w.close()
        lib.free(send[1])


def test_free_waits_for_a_hung_operation_until_abort(
    rt: ctypes.CDLL, nccl_lib: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.clib import GroupWorld

    lib = nccl_lib
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "1")  # every rank's first operation hangs
    w = GroupWorld(lib, 2)
    monkeypatch.delenv("PYNCCL_LOOPBACK_HANG")
    buf = [lib.malloc(64, r) for r in range(2)]
    try:
        for r in range(2):
            assert lib.ncclAllReduce(buf[r], buf[r], 16, 7, 0, w.comms[r], w.streams[r]) == 0
        t, returned, results = _free_in_thread(rt, buf[0])
        assert not returned.wait(0.3)
        assert lib.ncclCommAbort(w.comms[0]) == 0  # releases the hung operation
        assert returned.wait(30)
        t.join()
        assert results == [0]
        assert rt.pynccl_lb_find_alloc(buf[0], 1, None) == 0
        assert lib.ncclCommAbort(w.comms[1]) == 0
        w.comms = []
    finally:
        w.close()
        lib.free(buf[1])


def test_ncclmemfree_path_outlives_queued_work(rt: ctypes.CDLL) -> None:
    """pynccl_lb_free (ncclMemFree) does not wait, but the memory outlives the queue."""
    s = stream(rt)
    a = c_void_p()
    ok(rt, rt.pynccl_lb_malloc(byref(a), 1 << 16, 0))
    with TaskGate(rt, s):
        ok(rt, rt.cudaMemsetAsync(a, 1, 1 << 16, s))
        ok(rt, rt.pynccl_lb_free(a))  # returns at once
        assert rt.pynccl_lb_find_alloc(a, 1, None) == 0
        assert rt.cudaStreamQuery(s) == NOT_READY
    ok(rt, rt.cudaStreamSynchronize(s))
    ok(rt, rt.cudaStreamDestroy(s))


# ---- sanitizers and header conformance ------------------------------------------------


@pytest.mark.slow
def test_sanitized_build_runs_clean(tmp_path: Path) -> None:
    try:
        path = loopback.build_cudart(sanitize=True)
        extra = _build._sanitizer_env()
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"no sanitizer toolchain: {exc}")
    code = textwrap.dedent(
        """
        import ctypes, sys, threading
        lib = ctypes.CDLL(sys.argv[1])
        V = ctypes.c_void_p
        lib.cudaMemsetAsync.argtypes = [V, ctypes.c_int, ctypes.c_size_t, V]
        lib.cudaMemcpyAsync.argtypes = [V, V, ctypes.c_size_t, ctypes.c_int, V]
        lib.pynccl_lb_stream_enqueue.argtypes = [V] * 4
        lib.cudaFree.argtypes = [V]
        lib.cudaStreamSynchronize.argtypes = lib.cudaStreamDestroy.argtypes = [V]
        gate = threading.Event()
        cb = ctypes.CFUNCTYPE(None, V)(lambda _: gate.wait(60))
        s, a, b = V(), V(), V()
        assert lib.cudaStreamCreate(ctypes.byref(s)) == 0
        for p in (a, b):
            assert lib.cudaMalloc(ctypes.byref(p), 1 << 16) == 0
        assert lib.pynccl_lb_stream_enqueue(s, ctypes.cast(cb, V), None, None) == 0
        assert lib.cudaMemsetAsync(a, 1, 1 << 16, s) == 0
        assert lib.cudaMemcpyAsync(b, a, 1 << 16, 3, s) == 0
        assert lib.cudaFree(a) == 0          # queued work still uses a: must not be freed
        gate.set()
        assert lib.cudaStreamSynchronize(s) == 0
        assert lib.cudaStreamDestroy(s) == 0
        assert lib.cudaFree(b) == 0
        assert lib.cudaFree(b) == 1
        assert lib.cudaMalloc(ctypes.byref(b), ctypes.c_size_t(1 << 62)) == 2  # error, not abort
        print("clean")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, path],
        env={**os.environ, **extra},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "clean", proc.stderr[-4000:]
    assert "runtime error" not in proc.stderr  # UBSan


def _syntax_check(sources: list[Path], root: Path) -> subprocess.CompletedProcess[str]:
    cc = os.environ.get("CC") or "cc"
    return subprocess.run(
        [
            cc,
            "-fsyntax-only",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-DLB_USE_REAL_HEADERS",
            f"-I{root / 'include'}",
            f"-I{root}",
            f"-I{REAL_HEADERS}",
            *map(str, sources),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_exports_match_the_real_cuda_headers(tmp_path: Path) -> None:
    if not Path(REAL_HEADERS, "cuda_runtime_api.h").is_file():
        pytest.skip(f"no CUDA headers in {REAL_HEADERS}")
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler")
    src = loopback.SOURCE_DIR
    sources = sorted((src / "cudart").glob("*.c"))
    assert len(sources) >= 8
    proc = _syntax_check(sources, src)
    assert proc.returncode == 0, proc.stderr
    # The check has teeth: one wrong parameter type is rejected by the real header.
    for sub in ("cudart", "include"):
        shutil.copytree(src / sub, tmp_path / sub)
    target = tmp_path / "cudart" / "api.c"
    text = target.read_text()
    assert "cudaError_t cudaSetDevice(int device) {" in text
    target.write_text(text.replace("cudaSetDevice(int device) {", "cudaSetDevice(long device) {"))
    bad = _syntax_check(sorted((tmp_path / "cudart").glob("*.c")), tmp_path)
    assert bad.returncode != 0
    assert "cudaSetDevice" in bad.stderr
