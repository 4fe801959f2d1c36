"""The fast path against the checked path it stands in for.

A ``__cuda_array_interface__`` type whose handler is cached has its common case read by
value on the fast path (the handler of ``_adapt._cai._make_cai_handler``); everything else
goes to the checked path. Each case here is called twice on a new type: first through the
checked path (the type is not cached yet), then through the fast path; both must give the
same result (checked against numpy) or the same exception and message. Also the shared
pointer arguments (``PTR_ARGS``), whose hits stand for a passed range check.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from support.cai_cases import CASES, F32, N, changed, interface, outcome, reduce, resolve

from pynccl._capi import _binding
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer
from pynccl.errors import NcclInvalidArgument

pytestmark = pytest.mark.usefixtures("lb")


@pytest.mark.parametrize("name, send_change, recv_change", CASES, ids=[c[0] for c in CASES])
def test_the_fast_cai_path_matches_the_checked_path(
    name: str, send_change: dict[str, Any], recv_change: dict[str, Any]
) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    src = DeviceBuffer.from_numpy(np.arange(1, N + 1, dtype=np.float32))
    dst = DeviceBuffer(N, F32)

    def make(buf: DeviceBuffer, change: dict[str, Any]) -> Any:
        return changed(interface(buf), *resolve(buf, change))

    cls = type("Fresh", (), {})  # a new type: its handler is not cached yet
    outcomes = []
    try:
        for _ in range(3):  # slow path, then inline twice
            dst.copy_from(np.zeros(N, np.float32))
            x, y = cls(), cls()
            x.__cuda_array_interface__ = make(src, send_change)
            y.__cuda_array_interface__ = make(dst, recv_change)
            outcomes.append(outcome(lambda x=x, y=y: reduce(comm, x, y), dst))
        assert outcomes[0] == outcomes[1] == outcomes[2]
        kind, text = outcomes[0]
        if name in ("plain", "read-only sendbuf (not written)", "mask None", "contiguous strides",
                    "2-D", "shape as a list", "complex", "no strides key"):  # fmt: skip
            assert kind == "ok", text
            assert text == repr(np.arange(1, N + 1, dtype=np.float32).tolist())
        else:
            assert kind in ("TypeError", "ValueError"), (kind, text)
    finally:
        src.close()
        dst.close()
        comm.destroy()


def test_the_fast_cai_path_reads_the_device_the_array_reports() -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    buf = DeviceBuffer(N, F32)

    class OnDevice:
        def __init__(self, device: int) -> None:
            self.device = device
            self.__cuda_array_interface__ = interface(buf)

    try:
        for _ in range(3):
            comm.all_reduce(OnDevice(0), OnDevice(0))
            with pytest.raises(ValueError, match="device 3"):
                comm.all_reduce(OnDevice(3), OnDevice(0))
    finally:
        buf.close()
        comm.destroy()


def test_shared_pointer_arguments_are_kept_only_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_binding, "PTR_ARGS", {})
    cache = _binding.PTR_ARGS
    assert _binding.ptr_arg(0) is None and 0 not in cache
    assert _binding.arg_value(_binding.ptr_arg((1 << 63) + 8)) == (1 << 63) + 8 and not cache
    one = _binding.ptr_arg(4096)
    assert _binding.ptr_arg(4096) is one and cache == {4096: one}
    monkeypatch.setattr(_binding, "PTR_ARGS_LIMIT", 3)
    for p in (8192, 12288):
        _binding.ptr_arg(p)
    assert len(cache) == 3
    _binding.ptr_arg(16384)  # full: emptied, then refilled
    assert list(cache) == [16384]
    assert _binding.arg_value(one) == 4096  # objects handed out stay as they were


@pytest.mark.parametrize("ptr", [0, 1 << 64, -8])
def test_a_raw_pointer_out_of_range_is_refused_by_every_call(ptr: int) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    buf = DeviceBuffer(N, F32)
    try:
        messages = set()
        for _ in range(2):
            for call in (
                lambda: comm.all_reduce(ptr, buf.ptr, count=N, dtype=F32),
                lambda: comm.all_reduce(buf.ptr, ptr, count=N, dtype=F32),
                lambda: comm.broadcast(ptr, buf.ptr, root=0, count=N, dtype=F32),
            ):
                with pytest.raises((ValueError, TypeError)) as info:
                    call()
                text = str(info.value).replace("recvbuf", "BUF").replace("sendbuf", "BUF")
                messages.add((type(info.value), text))
        assert len(messages) == 1, messages
    finally:
        buf.close()
        comm.destroy()


@pytest.mark.parametrize("count", [17, (1 << 32) + 5])
def test_pointer_and_count_arguments_reach_c_exactly(count: int) -> None:
    # The fast path and persistent operations pass pointers and counts as byref() pointer
    # arguments (a size_t as the machine word it is): the loopback reports the pointer and
    # the byte extent it received, which must be the ones given, high bits included.
    comm = Communicator(1, UniqueId(), 0, device=0)
    buf = DeviceBuffer(16, F32)
    want = f"sendbuff {buf.ptr:#x} ({count * 4} bytes)"
    try:
        op = comm.all_reduce_init(buf.ptr, buf.ptr, count=count, dtype="float32")
        calls = [lambda: comm.all_reduce(buf.ptr, buf.ptr, count=count, dtype="float32")] * 3
        for call in [op, *calls]:  # the checked path first, then the fast path (if in range)
            with pytest.raises(NcclInvalidArgument, match=re.escape(want)):
                call()
        assert _binding.arg_value(_binding.count_arg(count)) == count
    finally:
        buf.close()
        comm.destroy()
