"""Calls given ``stream=``: the generated methods take them inline (the stream read as the
slow path reads it, first after config), on that stream, and never remember them.

Results are checked against numpy on two ranks, with every kind of buffer and stream; the
flight record must show the stream given (the watchdog too: ``test_fast_path.py``); a stream
object's handle is read afresh at every call (a closed Stream is refused, not reused).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.worlds import MinimalCAI, ThreadWorld

from pynccl import DataType
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer, Stream

pytestmark = pytest.mark.usefixtures("lb")

F32 = DataType.FLOAT32
N = 16


def _wrap(kind: str, buf: DeviceBuffer) -> dict[str, Any]:
    """``buf`` as call arguments of ``kind``."""
    if kind == "raw":
        return {"buf": buf.ptr, "count": buf.size, "dtype": F32}
    if kind == "interface":
        return {"buf": MinimalCAI(buf.ptr, buf.size, F32, "<f4")}
    return {"buf": buf}


@pytest.mark.parametrize("how", ["Stream", "handle"])
@pytest.mark.parametrize("kind", ["raw", "DeviceBuffer", "interface"])
def test_calls_given_a_stream_compute_on_it_and_are_recorded_so(kind: str, how: str) -> None:
    data = {r: np.arange(N, dtype=np.float32) * (r + 1) + 0.5 for r in range(2)}

    def one(r: int, comm: Communicator) -> dict[str, Any]:
        s = Stream(device=r)
        stream: Any = s if how == "Stream" else s.handle
        src = DeviceBuffer.from_numpy(data[r], device=r)
        dst = DeviceBuffer(N, F32, device=r)
        out = DeviceBuffer(2 * N, F32, device=r)
        got: dict[str, Any] = {}
        x, y, z = _wrap(kind, src), _wrap(kind, dst), _wrap(kind, out)
        count = {"count": N, "dtype": F32} if kind == "raw" else {}
        for _ in range(2):  # the same call again: a memo would take it if any
            comm.all_reduce(x["buf"], y["buf"], "max", stream=stream, **count)
            s.synchronize()
            got["all_reduce"] = dst.to_numpy().copy()
            comm.all_gather(x["buf"], z["buf"], stream=stream, **count)
            s.synchronize()
            got["all_gather"] = out.to_numpy().copy()
            comm.broadcast(x["buf"], y["buf"], root=1, stream=stream, **count)
            s.synchronize()
            got["broadcast"] = dst.to_numpy().copy()
            got["streams"] = {rec[3][-1] for rec in comm.flight_record()[-3:]}
        got["handle"] = s.handle
        for buf in (src, dst, out):
            buf.close()
        s.close()
        return got

    with ThreadWorld(2) as world:
        results = world.run(one)
    for got in results.values():
        np.testing.assert_array_equal(got["all_reduce"], np.maximum(data[0], data[1]))
        np.testing.assert_array_equal(got["all_gather"], np.concatenate([data[0], data[1]]))
        np.testing.assert_array_equal(got["broadcast"], data[1])
        assert got["streams"] == {got["handle"]}


def test_a_stream_given_is_used_for_that_call_only() -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    a, b = DeviceBuffer(N, F32), DeviceBuffer(N, F32)
    default, other = Stream(), Stream()
    try:
        comm.stream = default
        for call in (
            lambda **kw: comm.all_reduce(a.ptr, b.ptr, count=N, dtype=F32, **kw),
            lambda **kw: comm.all_reduce(a, b, **kw),
            lambda **kw: comm.all_reduce(MinimalCAI(a.ptr, N, F32, "<f4"), b, **kw),
        ):
            call()
            call()
            call(stream=other)
            call(stream=0)  # the legacy stream, not the communicator's default
            call()
            assert [r[3][-1] for r in comm.flight_record()[-3:]] == [
                other.handle,
                0,
                default.handle,
            ]
        closing = Stream()
        comm.all_reduce(a, b, stream=closing)
        closing.close()
        before = comm.flight_record()[-1]
        with pytest.raises(ValueError, match="this Stream is closed"):
            comm.all_reduce(a, b, stream=closing)
        assert comm.flight_record()[-1] == before  # nothing was issued
        comm.synchronize(timeout=60)
        other.synchronize()
    finally:
        comm.stream = None
        for obj in (a, b, default, other):
            obj.close()
        comm.destroy()
