"""The generated methods' interface memo (``self._memo[INTERFACES + row]``): a call of
``__cuda_array_interface__`` arrays whose interfaces hold the very shape, data and typestr
objects of the row's last such call, on arrays of the same types, reuses its C arguments.

What must not change because of it: every change to an interface is seen (each case of
``_cai_cases.CASES``, made in place on the remembered dict or as a new dict, gives
what the slow path gives on a type never seen), results (against numpy), how often an
interface is read (once a call), the device an array reports, the flight record and the
stream (what stays alive: ``test_memo.py``, with the DeviceBuffer memo's).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _cai_cases import CASES, N, changed, interface, outcome, reduce, resolve

from pynccl.comm import Communicator
from pynccl.comm._memos import INTERFACES
from pynccl.cuda import DeviceBuffer

pytestmark = pytest.mark.usefixtures("lb")


@pytest.mark.parametrize("how", ["in place", "new dict"])
@pytest.mark.parametrize("name, send_change, recv_change", CASES, ids=[c[0] for c in CASES])
def test_the_interface_memo_sees_every_change(
    name: str,
    send_change: dict[str, Any],
    recv_change: dict[str, Any],
    how: str,
    solo_comm: Communicator,
    new_buffers: Callable[..., DeviceBuffer],
) -> None:
    comm = solo_comm
    src, dst = new_buffers(np.arange(1, N + 1, dtype=np.float32)), new_buffers(N)
    cls = type("Remembered", (), {})
    x, y = cls(), cls()
    x.__cuda_array_interface__ = interface(src)
    y.__cuda_array_interface__ = interface(dst)
    reduce(comm, x, y)
    reduce(comm, x, y)  # a hit
    assert comm._memo[INTERFACES][0] is cls and comm._memo[INTERFACES][4] is cls
    (sc, sw), (rc, rw) = resolve(src, send_change), resolve(dst, recv_change)
    if how == "in place":  # only the changed keys: the others keep their objects
        x.__cuda_array_interface__ = changed(x.__cuda_array_interface__, sc, sw)
        y.__cuda_array_interface__ = changed(y.__cuda_array_interface__, rc, rw)
    else:
        x.__cuda_array_interface__ = changed(interface(src), sc, sw)
        y.__cuda_array_interface__ = changed(interface(dst), rc, rw)
    dst.copy_from(np.zeros(N, np.float32))
    got = outcome(lambda: reduce(comm, x, y), dst)
    # What the slow path says on a type it has never seen, for the same interfaces.
    cold = type("Cold", (), {})
    x2, y2 = cold(), cold()
    x2.__cuda_array_interface__ = x.__cuda_array_interface__
    y2.__cuda_array_interface__ = y.__cuda_array_interface__
    dst.copy_from(np.zeros(N, np.float32))
    want = outcome(lambda: reduce(comm, x2, y2), dst)
    assert got == want
    if name == "plain" or name == "no strides key":
        assert got == ("ok", repr(np.arange(1, N + 1, dtype=np.float32).tolist()))


class _Counted:
    """Counts the reads of its interface: the same dict every time (``kept``), or a new
    dict of new tuples at every read (as CuPy, Numba and PyTorch build theirs)."""

    reads = 0

    def __init__(self, buf: DeviceBuffer, kept: bool) -> None:
        self.kept, self.ptr, self.n = kept, buf.ptr, buf.size
        self.cai = {"shape": (buf.size,), "typestr": "<f4", "data": (buf.ptr, False)}

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        type(self).reads += 1
        if self.kept:
            return self.cai
        return {"shape": (self.n,), "typestr": "<f4", "data": (self.ptr, False), "version": 3}


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "built afresh"])
def test_interfaces_are_read_once_a_call_but_for_misses_and_the_results_are_right(
    kept: bool, solo_comm: Communicator, new_buffers: Callable[..., DeviceBuffer]
) -> None:
    comm = solo_comm
    made = [new_buffers(N) for _ in range(3)]
    cls: Any = type("Counted", (_Counted,), {"reads": 0})
    a, b, c = (cls(buf, kept) for buf in made)
    rng = np.random.default_rng(7)
    reads = []
    for step in range(8):
        # The same pair, then (step 4) another recv, then the pair again.
        send, recv, out = (a, c, made[2]) if step == 4 else (a, b, made[1])
        want = rng.standard_normal(N).astype(np.float32)
        made[0].copy_from(want)
        before = cls.reads
        comm.all_reduce(send, recv)
        comm.synchronize()
        reads.append(cls.reads - before)
        np.testing.assert_array_equal(out.to_numpy(), want)
        assert (comm._memo[INTERFACES][0] is cls) == (kept and step > 0)
    # The first call reads sendbuf's interface twice more: is it kept? Built afresh,
    # interfaces are never remembered, and read once a call. Kept, a call that misses
    # the memo (steps 4 and 5) reads again what it read for it.
    assert reads == ([4, 2, 2, 2, 4, 4, 2, 2] if kept else [4] + [2] * 7)
    before = cls.reads
    comm.broadcast(a, root=0)  # in place: one object read as both buffers
    assert cls.reads - before == 2


def test_an_interface_that_raises_after_a_hit_raises_as_it_would_cold(
    solo_comm: Communicator, new_buffers: Callable[..., DeviceBuffer]
) -> None:
    comm = solo_comm

    class Flaky:
        broken = False

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            if self.broken:
                raise RuntimeError("the array was released")
            return cai

    cai = interface(new_buffers(N))
    x = Flaky()
    comm.all_reduce(x)
    comm.all_reduce(x)
    x.broken = True
    with pytest.raises(RuntimeError, match="released"):
        comm.all_reduce(x)
    x.broken = False
    comm.all_reduce(x)


def test_arrays_that_report_a_device_are_checked_every_call(
    solo_comm: Communicator, new_buffers: Callable[..., DeviceBuffer]
) -> None:
    comm = solo_comm
    cai = interface(new_buffers(N))

    class OnDevice:
        def __init__(self) -> None:
            self.device = 0
            self.__cuda_array_interface__ = cai

    x = OnDevice()
    comm.all_reduce(x)
    comm.all_reduce(x)
    assert comm._memo[INTERFACES][0] is not OnDevice  # never remembered
    x.device = 3
    with pytest.raises(ValueError, match="device 3"):
        comm.all_reduce(x)


def test_arrays_sharing_one_interface_share_its_memo(
    solo_comm: Communicator, new_buffers: Callable[..., DeviceBuffer]
) -> None:
    comm = solo_comm
    cai = interface(new_buffers(N))
    views = [types.SimpleNamespace(__cuda_array_interface__=cai) for _ in range(3)]
    comm.reduce(views[0], views[0], root=0)  # the type's first call: the slow path
    comm.reduce(views[0], views[0], root=0)
    remembered = comm._memo[INTERFACES + 2]
    assert remembered[0] is types.SimpleNamespace
    for v in views[1:]:
        comm.reduce(v, views[0], root=0)
        assert comm._memo[INTERFACES + 2] is remembered  # a hit (a miss would remember anew)


def test_a_call_that_read_a_replaced_value_does_not_remember_it(
    solo_comm: Communicator, new_buffers: Callable[..., DeviceBuffer]
) -> None:
    # A call binds the memo list first and stores into that list: the stream changed
    # while it was being checked (here by the array's own interface getter) makes it
    # store into the list that the change replaced, so the next call does not reuse the
    # old stream. (It issues on the stream it had read: it started before the change.)
    from pynccl.cuda import Stream

    comm = solo_comm
    buf = new_buffers(np.arange(N, dtype=np.float32))
    cai = interface(buf)
    other = Stream()
    switch: list[Stream] = []

    class Switching:
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            if switch:
                comm.stream = switch.pop()
            return cai

    x = Switching()
    try:
        comm.all_reduce(x)
        comm.all_reduce(x)  # remembered
        cai = interface(buf)  # new objects: the next call misses, is checked, and stores
        switch.append(other)  # ... after its read of the interface switched the stream
        comm.all_reduce(x)
        comm.all_reduce(x)
        comm.all_reduce(x)
        streams = [entry[3][-1] for entry in comm.flight_record()[-3:]]
        assert streams == [0, other.handle, other.handle]
        other.synchronize()
        np.testing.assert_array_equal(buf.to_numpy(), np.arange(N, dtype=np.float32))
    finally:
        comm.stream = None
        other.close()
