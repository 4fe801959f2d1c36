"""Windows in the object API on the loopback: register_window / Window, deduplication and
reference counts, the alignment / flags rules agreed by every rank before the C call,
peer_pointer reading the peer's bytes, closing at destroy and abort, registration and
deregistration during a capture, and the release gate (tests/comm/test_windows_semantics.py:
the rules that changed with NCCL's documented semantics)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

import pynccl
from pynccl import Communicator, NcclInvalidUsage, UniqueId, Window
from pynccl.cuda import DeviceBuffer, Graph, Stream
from pynccl.enums import WIN_REQUIRED_ALIGNMENT, WinFlag

N = 1024  # float32 elements


@pytest.fixture(scope="module")
def get(thread_worlds: Any) -> Any:
    return thread_worlds


def test_window_properties_and_peer_pointer_reads_the_peer(get: Any) -> None:
    world = get(3)

    def body(r: int, comm: Communicator) -> list[bool]:
        buf = comm.mem_alloc(N, "float32")
        buf.copy_from(np.arange(N, dtype=np.float32) * (r + 1))
        win = comm.register_window(buf)
        try:
            assert isinstance(win, Window) and win.symmetric
            assert win.user_ptr == buf.ptr and win.nbytes == 4 * N
            assert win.dtype == pynccl.DataType.FLOAT32 and win.flags == WinFlag.COLL_SYMMETRIC
            assert win.handle != 0 and comm.windows == [win]
            comm.synchronize()
            found = []
            for peer in range(comm.size):
                for offset in (0, 7, N - 1):
                    ptr = win.peer_pointer(peer, offset)
                    assert ptr is not None
                    got = ctypes.c_float.from_address(ptr).value  # loopback memory is host
                    found.append(got == float(offset * (peer + 1)))
            with pytest.raises(ValueError, match="offset=1024 elements of 4 bytes do not fit"):
                win.peer_pointer(0, N)
            with pytest.raises(ValueError, match="peer=3 is out of range; expected 0 <= peer < 3"):
                win.peer_pointer(3)
            # Deregistration is local: nobody frees its buffer while a peer still reads it.
            comm.barrier()
            comm.synchronize()
            return found
        finally:
            win.close()
            buf.close()

    out = world.run(body)
    assert all(all(v) and len(v) == 9 for v in out.values())


def test_lsa_and_multimem_pointers(get: Any) -> None:
    # The loopback's LSA team is the whole world (every rank's memory is reachable) and it
    # has no multicast: NCCL answers NULL for the multimem pointer then.
    world = get(2)

    def body(r: int, comm: Communicator) -> bool:
        buf = comm.mem_alloc(N, "float32")
        buf.copy_from(np.full(N, r + 5, np.float32))
        with comm.register_window(buf) as win:
            lsa = [win.lsa_pointer(p, 3) for p in range(2)]
            assert lsa == [win.peer_pointer(p, 3) for p in range(2)]
            assert [ctypes.c_float.from_address(a).value for a in lsa] == [5.0, 6.0]
            assert win.multimem_pointer() is None
            with pytest.raises(ValueError, match="lsa_rank=2 is out of range; expected 0 <= "
                               "lsa_rank < 2 for an LSA team of size 2"):
                win.lsa_pointer(2)
            comm.barrier()  # deregistration is local: the peer may still be reading
            comm.synchronize()
        buf.close()
        return True

    assert world.run(body) == {0: True, 1: True}


def test_same_range_twice_is_one_window_refcounted(get: Any) -> None:
    world = get(2)

    def body(r: int, comm: Communicator) -> tuple[int, ...]:
        buf = comm.mem_alloc(2 * N, "float32")
        a = comm.register_window(buf)
        b = comm.register_window(buf)  # the same (ptr, size, flags): no second registration
        c = comm.register_window(buf, nbytes=4 * N)  # another range: another window
        d = comm.register_window(buf, symmetric=False)  # other flags: another window
        assert a is b and a is not c and a is not d
        assert comm.windows == [a, c, d]
        handle = a.handle
        a.close()  # one reference left
        assert not b.closed and b.handle == handle and comm.windows == [a, c, d]
        b.close()  # the last: deregistered
        assert a.closed and comm.windows == [c, d]
        with pytest.raises(NcclInvalidUsage, match="is closed"):
            _ = a.handle
        a.close()  # idempotent
        e = comm.register_window(buf)  # registers anew
        assert e is not a and not e.closed
        with c, d, e:
            pass
        assert comm.windows == []
        buf.close()
        return (len(comm.windows),)

    assert world.run(body) == {0: (0,), 1: (0,)}


def test_alignment_size_and_flags_are_refused_on_every_rank(get: Any) -> None:
    world = get(2)

    def body(r: int, comm: Communicator) -> list[str]:
        buf = comm.mem_alloc(2 * N, "float32")
        messages = []
        try:
            # rank 1 alone passes a misaligned buffer: both ranks raise the same error
            ptr = buf.ptr + (16 if r == 1 else 0)
            with pytest.raises(ValueError) as info:
                comm.register_window(ptr, nbytes=4096)
            messages.append(str(info.value))
            # different flags
            with pytest.raises(ValueError) as info:
                comm.register_window(buf, symmetric=r == 0)
            messages.append(str(info.value))
            # different sizes are fine without NCCL_WIN_COLL_SYMMETRIC
            with comm.register_window(buf, nbytes=4096 * (r + 1), symmetric=False) as w:
                assert not w.symmetric
            with pytest.raises(ValueError, match="at least 1 byte"):
                comm.register_window(buf, nbytes=0)
            with pytest.raises(ValueError, match="nbytes=8193 is more than the 8192 bytes"):
                comm.register_window(buf, nbytes=8193)
            with pytest.raises(TypeError, match="needs nbytes="):
                comm.register_window(buf.ptr)
            with pytest.raises(ValueError, match="flags=0x100 has bits"):
                comm.register_window(buf, flags=0x100)
            with pytest.raises(TypeError, match="symmetric must be a bool"):
                comm.register_window(buf, symmetric=1)  # type: ignore[arg-type]
            assert comm.windows == []
            with comm.register_window(buf):  # nothing was left half-registered
                pass
        finally:
            buf.close()
        return messages

    out = world.run(body)
    assert out[0] == out[1]  # the same verdict on every rank
    misaligned, flags = out[0]
    assert "rank 1's buffer does not" in misaligned and str(WIN_REQUIRED_ALIGNMENT) in misaligned
    assert "window flags differ between ranks (rank 0: 0x1, rank 1: 0x0)" in flags


def test_dedup_must_match_on_every_rank(get: Any) -> None:
    world = get(2)

    def body(r: int, comm: Communicator) -> str:
        buf = comm.mem_alloc(N, "float32")
        other = comm.mem_alloc(N, "float32")
        first = comm.register_window(buf if r == 0 else other)
        try:
            with pytest.raises(ValueError) as info:
                comm.register_window(buf)  # rank 0 holds it already, rank 1 does not
            return str(info.value)
        finally:
            first.close()
            buf.close()
            other.close()

    out = world.run(body)
    assert out[0] == out[1]
    assert "rank 0 has this range registered already and rank 1 does not" in out[0]


def test_destroy_and_abort_mark_windows_closed(lb: Any) -> None:
    from support.worlds import ThreadWorld

    for kind in ("destroy", "abort"):
        world = ThreadWorld(2)

        def body(r: int, comm: Communicator) -> tuple[Window, Any, DeviceBuffer]:
            buf = comm.mem_alloc(N, "float32")
            return comm.register_window(buf), comm.register(buf), buf

        made = world.run(body)
        world.broken = kind == "abort"
        world.close()
        for win, reg, buf in made.values():
            assert win.closed and reg.closed and win._buf is None and reg._buf is None
            win.close()  # nothing to do any more, and no C call on a freed window
            reg.close()
            with pytest.raises(NcclInvalidUsage, match="is closed"):
                _ = win.handle
            buf.close()


def test_register_window_and_close_during_a_capture_leave_it_intact(lb: Any) -> None:
    # NCCL registers and deregisters windows in relaxed capture mode (dev_runtime.cc), so
    # both are allowed while a graph is captured (vLLM registers during capture); the
    # capture records only the collective. ncclMemAlloc is still refused.
    stream = Stream(non_blocking=True)
    comm = Communicator(1, UniqueId(), 0, device=0, stream=stream)
    buf = comm.mem_alloc(2 * N, "float32")
    win = comm.register_window(buf)
    g = Graph()
    with g.capture(stream, "global"):  # ends cleanly: nothing invalidated it
        inner = comm.register_window(buf, nbytes=4096)
        assert inner is not win and inner.handle
        win.close()
        with pytest.raises(NcclInvalidUsage, match="ncclMemAlloc cannot run while"):
            comm.mem_alloc(N)
        comm.all_reduce(buf)
    assert g.captured and win.closed and comm.windows == [inner]
    buf.copy_from(np.full(2 * N, 3, np.float32))
    g.replay()
    stream.synchronize()
    assert (buf.to_numpy() == 3).all()  # a sum over one rank
    g.close()
    inner.close()
    comm.destroy()
    buf.close()
    stream.close()


def test_windows_need_2_27(lb: Any) -> None:
    from support.worlds import use_loopback

    with use_loopback("2.24.3"):
        with Communicator(1, UniqueId(), 0, device=0) as comm:
            buf = comm.mem_alloc(N, "float32")  # ncclMemAlloc is 2.19
            with pytest.raises(pynccl.NotSupportedError) as info:
                comm.register_window(buf)
            text = str(info.value)
            assert text.startswith("ncclCommWindowRegister is not supported by the loaded NCCL")
            assert "it requires NCCL >= 2.27.3" in text
            buf.close()


def test_one_thread_registers_every_rank_in_a_group(lb: Any) -> None:
    # Communicator.init_all: one thread drives both ranks, so the collective registration
    # runs at the group's end; the handle is known from then on.
    comms = Communicator.init_all(2)
    bufs = [c.mem_alloc(N, "float32") for c in comms]
    try:
        with pynccl.group():
            wins = [c.register_window(b) for c, b in zip(comms, bufs)]
            with pytest.raises(NcclInvalidUsage, match="the group it was registered in has not"):
                _ = wins[0].handle
        assert all(w.handle and w.user_ptr == b.ptr for w, b in zip(wins, bufs))
        assert [c.windows for c in comms] == [[wins[0]], [wins[1]]]
        with pynccl.group():
            for w in wins:
                w.close()
        assert all(w.closed for w in wins) and all(c.windows == [] for c in comms)
    finally:
        for c in comms:
            c.destroy()
        for b in bufs:
            b.close()
