"""Lifetimes: every object handed to a collective stays referenced until the C call that
uses its memory has returned (for an operation queued in a group: until the group ends).

The loopback's strict mode refuses a pointer that lies in no live allocation, so a
temporary ``DeviceBuffer`` freed before the C call would fail the call; the first test
shows that the check does catch a freed temporary.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

from pynccl import NcclInvalidArgument
from pynccl.comm import Communicator
from pynccl.cuda import DeviceBuffer
from pynccl.cuda._buffer import wait_dropped
from pynccl.groups import group

N = 12


def _temp(x: np.ndarray) -> DeviceBuffer:
    return DeviceBuffer.from_numpy(x, device=0)


def test_the_loopback_catches_a_freed_temporary(solo_comm: Communicator) -> None:
    out = DeviceBuffer(N, "float32", device=0)
    gc.disable()  # the temporary goes by refcount alone
    try:
        # .ptr of a temporary: the buffer is dropped before the call is made, and freed by
        # the finalizers' reaper thread (a finalizer never waits for the device itself).
        ptr = _temp(np.ones(N, np.float32)).ptr
        assert wait_dropped(timeout=10)
        with pytest.raises(NcclInvalidArgument, match="does not lie inside"):
            solo_comm.all_reduce(ptr, out.ptr, count=N, dtype="f4")
    finally:
        gc.enable()
        out.close()


# (method, kwargs, send elements, recv elements) for a one-rank communicator.
CASES = [
    ("all_reduce", {}, N, N),
    ("broadcast", {"root": 0}, N, N),
    ("reduce", {"root": 0}, N, N),
    ("all_gather", {}, N, N),
    ("reduce_scatter", {}, N, N),
    ("gather", {"root": 0}, N, N),
    ("scatter", {"root": 0}, N, N),
    ("all_to_all", {}, N, N),
]


@pytest.mark.parametrize(("method", "kwargs", "ns", "nr"), CASES, ids=[c[0] for c in CASES])
def test_temporaries_live_through_every_collective(
    solo_comm: Communicator, method: str, kwargs: dict[str, Any], ns: int, nr: int
) -> None:
    x = np.arange(ns, dtype=np.float32) + 1
    call = getattr(solo_comm, method)
    gc.disable()
    try:
        # A temporary send buffer, a kept receive buffer: the result must arrive.
        out = DeviceBuffer(nr, "float32", device=0)
        call(_temp(x), out, **kwargs)
        solo_comm.synchronize()
        assert np.array_equal(out.to_numpy(), x), method
        # Both temporaries (nothing to read back; the call must simply be valid).
        call(_temp(x), DeviceBuffer(nr, "float32", device=0), **kwargs)
        solo_comm.synchronize()
        # In place on a temporary, where the method has that form.
        if method in ("all_reduce", "broadcast", "reduce"):
            call(_temp(x), **kwargs)
            solo_comm.synchronize()
        out.close()
    finally:
        gc.enable()


def test_temporaries_live_until_the_group_ends(solo_comm: Communicator) -> None:
    x = np.arange(N, dtype=np.float32) * 3
    out = DeviceBuffer(N, "float32", device=0)
    gc.disable()
    try:
        with group():
            solo_comm.send(_temp(x), 0)  # queued: NCCL reads it at the group's end
            solo_comm.recv(out, 0)
        solo_comm.synchronize()
        assert np.array_equal(out.to_numpy(), x)
        with group():
            solo_comm.all_reduce(_temp(x), out)
        solo_comm.synchronize()
        assert np.array_equal(out.to_numpy(), x)
        out.copy_from(np.zeros(N, np.float32))
        with group():
            with group():  # a nested group's end launches nothing: still kept
                solo_comm.send(_temp(x), 0)
            solo_comm.recv(out, 0)
        solo_comm.synchronize()
        assert np.array_equal(out.to_numpy(), x)
    finally:
        gc.enable()
        out.close()
