"""``__cuda_array_interface__`` arrays on the fast path: each call reads each interface
once, by value (the type's handler, :func:`pynccl._adapt._cai._make_cai_handler`), and
gives what the checked path gives.

What must hold: every change to an interface is seen (each case of
``support.cai_cases.CASES``, made in place on a dict read before or as a new dict, gives what the
checked path gives on a type never seen), results (against numpy), how often an interface
is read (once a call), the device an array reports, the flight record and the stream
(what stays alive: ``test_fast_path.py``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from support.cai_cases import CASES, N, changed, interface, outcome, reduce, resolve
from support.comm import takes_fast_path

from pynccl.comm import Communicator
from pynccl.cuda import DeviceBuffer

pytestmark = pytest.mark.usefixtures("lb")


@pytest.mark.parametrize("how", ["in place", "new dict"])
@pytest.mark.parametrize("name, send_change, recv_change", CASES, ids=[c[0] for c in CASES])
def test_the_fast_path_sees_every_change_to_an_interface(
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
    assert takes_fast_path(lambda: reduce(comm, x, y))
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
def test_interfaces_are_read_once_a_call_and_the_results_are_right(
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
    # The type's first call probes it (and takes the checked path); from then on each
    # interface is read once a call, kept or built afresh.
    assert reads[0] >= 2 and reads[1:] == [2] * 7
    before = cls.reads
    comm.broadcast(a, root=0)  # in place: one object, read once
    assert cls.reads - before == 1


def test_an_interface_that_raises_after_fast_calls_raises_as_it_would_cold(
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
    x.device = 3
    with pytest.raises(ValueError, match="device 3"):
        comm.all_reduce(x)


def test_arrays_sharing_one_interface_take_the_fast_path(
    solo_comm: Communicator, new_buffers: Callable[..., DeviceBuffer]
) -> None:
    comm = solo_comm
    cai = interface(new_buffers(N))
    views = [types.SimpleNamespace(__cuda_array_interface__=cai) for _ in range(3)]
    comm.reduce(views[0], views[0], root=0)  # the type's first call: the checked path
    for v in views[1:]:
        assert takes_fast_path(lambda: comm.reduce(v, views[0], root=0))  # noqa: B023


def test_a_stream_changed_while_a_call_reads_its_arrays_is_used_by_the_next(
    solo_comm: Communicator, new_buffers: Callable[..., DeviceBuffer]
) -> None:
    # The stream changed while a call reads its arrays (here by the array's own interface
    # getter): that call issues on the stream it had read (it started before the change),
    # the next ones on the new one.
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
        comm.all_reduce(x)
        cai = interface(buf)  # new objects
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
