"""Window.peer_array on the loopback: a view of a peer's window with
``__cuda_array_interface__`` and DLPack, read through numpy over the pointer (loopback memory
is host memory) and through pynccl's own adapters as a collective's buffer, bounded by the
peer's own window size, refusing bad peers, shapes and dtypes with the common wording."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from support import ROOT

import pynccl
from pynccl import Communicator, DataType
from pynccl._adapt import _export, as_buffer
from pynccl.comm import PeerArray

N = 1024


@pytest.fixture(scope="module")
def get(thread_worlds: Any) -> Any:
    return thread_worlds


def _host(ptr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr)).copy()


class OnlyDLPack:
    """A buffer seen through DLPack only (pynccl prefers the array interface)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __dlpack__(self, **kw: Any) -> Any:
        return self.inner.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.inner.__dlpack_device__()  # type: ignore[no-any-return]


def test_rank_1_reads_rank_0s_window(get: Any) -> None:
    world = get(2)
    ref = np.arange(N, dtype=np.float32) * 3 + 1

    def body(r: int, comm: Communicator) -> dict[str, Any]:
        buf = comm.mem_alloc(N, "float32")
        buf.copy_from(ref if r == 0 else np.zeros(N, np.float32))
        win = comm.register_window(buf)
        out = comm.mem_alloc(2 * N, "float32")
        got: dict[str, Any] = {}
        try:
            comm.barrier()
            comm.synchronize()
            view = win.peer_array(1 - r, (N,), "float32")
            assert isinstance(view, PeerArray) and view.owner is win
            cai = view.__cuda_array_interface__
            assert cai["shape"] == (N,) and cai["typestr"] == "<f4" and cai["version"] == 3
            assert cai["data"] == (win.peer_pointer(1 - r), False) and cai["stream"] is None
            assert view.__dlpack_device__() == (2, comm.device)
            got["numpy"] = _host(view.ptr, N)
            # pynccl's adapters read the view (array interface, and DLPack alone) ...
            assert as_buffer(view)[:3] == (view.ptr, N, DataType.FLOAT32)
            half = win.peer_array(1 - r, (2, N // 2))
            assert as_buffer(OnlyDLPack(half))[:3] == (half.ptr, N, DataType.FLOAT32)
            # ... and a collective takes what they read, copied to this device first: NCCL
            # refuses a peer's address as a collective's buffer (it lies on the peer's
            # device; the loopback does the same).
            mine = comm.mem_alloc(N, "float32")
            ptr, n, dt, _ = as_buffer(OnlyDLPack(half))
            pynccl.cudart().cudaMemcpy(mine.ptr, ptr, n * dt.itemsize, 3)
            comm.all_gather(mine, out)
            comm.synchronize()
            got["gathered"] = out.to_numpy()
            with pytest.raises(pynccl.NcclInvalidArgument, match="mismatch"):
                comm.all_reduce(view, mine)  # the loopback refuses it as NCCL does
            mine.close()
            comm.barrier()
            comm.synchronize()
            return got
        finally:
            win.close()
            buf.close()
            out.close()

    res = world.run(body)
    zeros = np.zeros(N, np.float32)
    np.testing.assert_array_equal(res[1]["numpy"], ref)
    np.testing.assert_array_equal(res[0]["numpy"], zeros)
    for r in (0, 1):  # rank 0 sent (a copy of) rank 1's zeros, rank 1 rank 0's ref
        np.testing.assert_array_equal(res[r]["gathered"], np.concatenate([zeros, ref]))
    gc.collect()
    assert not _export._LIVE  # every exported capsule was released


def test_bounded_by_the_peers_own_size_and_bad_arguments(get: Any) -> None:
    # From NCCL 2.30.7 (the loopback emulates 2.32.3) symmetric windows may differ in size.
    world = get(2)

    def body(r: int, comm: Communicator) -> bool:
        n = N * (r + 1)  # rank 0: N floats, rank 1: 2N
        buf = comm.mem_alloc(n, "float32")
        with comm.register_window(buf) as win:
            assert win.peer_array(1, (2 * N,)).nbytes == 8 * N  # rank 1's is 2N floats
            assert win.peer_array(0, (N,), "int32").dtype.name == "INT32"
            with pytest.raises(ValueError, match=r"shape=\(2048,\) of float32 is 8192 bytes, "
                               "more than rank 0's window of 4096 bytes"):
                win.peer_array(0, 2 * N)
            with pytest.raises(ValueError, match="peer=2 is out of range; expected 0 <= peer < 2"):
                win.peer_array(2, (1,))
            with pytest.raises(ValueError, match=r"shape=.* is out of range"):
                win.peer_array(0, (-1,))
            with pytest.raises(TypeError, match="shape must be an int or a tuple of ints"):
                win.peer_array(0, 1.5)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="data type 'float7'"):
                win.peer_array(0, (1,), "float7")
            view = win.peer_array(1 - r, (4,))
            with pytest.raises(BufferError, match="never copied"):
                view.__dlpack__(copy=True)
            with pytest.raises(BufferError, match="dl_device"):
                view.__dlpack__(dl_device=(1, 0))
            with pytest.raises(ValueError, match="stream=0"):
                view.__dlpack__(stream=0)
            comm.barrier()
            comm.synchronize()
        buf.close()
        return True

    assert world.run(body) == {0: True, 1: True}


def test_a_window_registered_in_a_group_has_unknown_peer_sizes(get: Any) -> None:
    world = get(2)

    def body(r: int, comm: Communicator) -> bool:
        buf = comm.mem_alloc(N, "float32")
        with pynccl.group():
            win = comm.register_window(buf)
        try:
            assert win.peer_array(r, (N,)).nbytes == 4 * N  # its own size is known
            with pytest.raises(ValueError, match=f"the size of rank {1 - r}'s window is not known"):
                win.peer_array(1 - r, (1,))
            comm.barrier()
            comm.synchronize()
        finally:
            win.close()
            buf.close()
        return True

    assert world.run(body) == {0: True, 1: True}


def test_dlpack_arguments_are_checked_as_the_array_api_defines_them() -> None:
    # The array API's __dlpack__ for a CUDA array: stream None, -1, 1, 2 or a handle
    # (a cudaStream_t: below 2**64), 0 refused; max_version and dl_device are int pairs.
    view = PeerArray(0x1000, (4,), "float32", 0, object())
    for stream in (-7, -2, 1 << 64, 0):
        with pytest.raises(ValueError, match=rf"stream={stream} is out of range; expected None"):
            view.__dlpack__(stream=stream)
    with pytest.raises(TypeError, match=r"stream must be None or an int .*got bool True"):
        view.__dlpack__(stream=True)
    with pytest.raises(TypeError, match=r"max_version must be None or a \(major, minor\) tuple"
                       " of two ints, got 1"):
        view.__dlpack__(max_version=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dl_device must be .* got \(2, 0, 1\)"):
        view.__dlpack__(dl_device=(2, 0, 1))  # type: ignore[arg-type]
    for stream in (None, -1, 1, 2, (1 << 64) - 1):
        assert '"dltensor"' in repr(view.__dlpack__(stream=stream, max_version=(0, 8)))
    assert '"dltensor_versioned"' in repr(view.__dlpack__(max_version=(1, 1), dl_device=(2, 0)))
    gc.collect()
    assert not _export._LIVE


def test_a_view_of_a_closed_window_hands_out_no_address(lb: Any) -> None:
    # The peer's memory is valid only while the window is registered: once it is closed
    # the view refuses, as the window itself does, instead of handing out a dead address.
    comm = Communicator(1, pynccl.UniqueId(), 0, device=0)
    buf = comm.mem_alloc(N, "float32")
    try:
        win = comm.register_window(buf)
        view = win.peer_array(0, (N,))
        assert view.__cuda_array_interface__["data"] == (buf.ptr, False)
        win.close()
        for export in (
            lambda: view.__cuda_array_interface__,
            view.__dlpack__,
            lambda: as_buffer(view),
            lambda: comm.all_reduce(view, buf),
        ):
            with pytest.raises(pynccl.NcclInvalidUsage, match="which is closed; it cannot be"):
                export()
        assert view.__dlpack_device__() == (2, 0)  # where it was is still known
    finally:
        buf.close()
        comm.destroy()
    gc.collect()
    assert not _export._LIVE


_RELEASE_SETS_OFF_A_COLLECTION = textwrap.dedent("""
    import gc
    from pynccl._adapt._export import PeerArray, _LIVE
    class Owner:
        def __del__(self):
            gc.collect()  # what any finalizer that allocates may set off
    class Cycle:
        pass
    gc.disable()
    view = PeerArray(0x1000, (4,), "float32", 0, Owner())
    capsule = view.__dlpack__()
    c = Cycle(); c.self = c
    c.capsule = PeerArray(0x2000, (4,), "float32", 0, object()).__dlpack__()
    del c, view
    del capsule  # its release drops the view, its owner collects, the cycle's capsule goes
    print("released", len(_LIVE))
""")


def test_a_release_that_sets_off_another_release_does_not_deadlock() -> None:
    # An unconsumed capsule's release drops the view and maybe its owner, whose finalizer
    # may set off a collection that releases another capsule: the registry's lock must
    # not be held meanwhile (it is not reentrant: the process hung).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", _RELEASE_SETS_OFF_A_COLLECTION],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )  # fmt: skip
    assert (proc.returncode, proc.stdout.strip()) == (0, "released 0"), proc.stderr
