"""Helpers of test_loopback_strict_nccl.py: raw-ctypes worlds of non-blocking
communicators, calls on helper threads, and the child processes (run as a script:
``python tests/support/clib_strict.py barrier <abort|destroy>`` or ``... self_put``, with the
library paths in $PYNCCL_NCCL_LIBRARY / $PYNCCL_CUDART_LIBRARY), which print one JSON
line per event.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from ctypes import byref, c_int, c_void_p
from typing import Any

import numpy as np

if __name__ == "__main__":  # a worker: tests/ and the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pynccl._capi.structs import make_config
from support.clib import IN_PROGRESS, SUCCESS, SUM, GroupWorld, Lib
from support.clib_rma import Rank, read_f32, write_f32

FLOAT32 = 7
SHRINK_ABORT = 1


class Bg:
    """fn() on a daemon thread: ``done(t)`` waits up to t seconds for it to return."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self._event = threading.Event()

        def body() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # handed to the test by done()
                self.result = exc
            self._event.set()

        threading.Thread(target=body, daemon=True).start()

    def done(self, timeout: float) -> bool:
        ok = self._event.wait(timeout)
        if ok and isinstance(self.result, BaseException):
            raise self.result
        return ok


def poll_ready(lib: Lib, comm: int, allow: tuple[int, ...] = (IN_PROGRESS,)) -> int:
    """ncclCommGetAsyncError until it reads something not in allow; that result."""
    for _ in range(200_000):
        e = lib.async_error(comm)
        if e not in allow:
            return e
    raise AssertionError("still in progress after 200000 polls")


def nonblocking_world(lib: Lib, n: int) -> list[int]:
    """n non-blocking communicators, rank r on device r, made in one group; ready."""
    cfg = make_config({"blocking": 0})
    uid = lib.unique_id()
    comms = [c_void_p() for _ in range(n)]
    assert lib.ncclGroupStart() == 0
    for r in range(n):
        lib.set_device(r)
        assert lib.ncclCommInitRankConfig(byref(comms[r]), n, uid, r, byref(cfg)) == IN_PROGRESS
    lib.set_device(0)
    assert lib.ncclGroupEnd() == IN_PROGRESS
    for c in comms:
        assert poll_ready(lib, int(c.value or 0)) == SUCCESS, lib.last_error()
    return [int(c.value or 0) for c in comms]


def allreduce_group(
    lib: Lib, comms: list[int], streams: list[int], bufs: list[int], count: int
) -> list[int]:
    """An in-place float32 sum all-reduce on every comm, in one group; the call codes."""
    assert lib.ncclGroupStart() == 0
    codes = [
        int(lib.ncclAllReduce(bufs[r], bufs[r], count, FLOAT32, SUM, c, streams[r]))
        for r, c in enumerate(comms)
    ]
    return [*codes, int(lib.ncclGroupEnd())]


def child_events(proc: subprocess.Popen[str]) -> queue.Queue[dict[str, Any]]:
    """A queue of the child's JSON events, filled by a reader thread."""
    out: queue.Queue[dict[str, Any]] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                out.put(json.loads(line))

    threading.Thread(target=pump, daemon=True).start()
    return out


def next_event(
    events: queue.Queue[dict[str, Any]], name: str, timeout: float
) -> dict[str, Any] | None:
    try:
        while True:
            e = events.get(timeout=timeout)
            if e["event"] == name:
                return e
    except queue.Empty:
        return None


def _child_barrier(lib: Lib, how: str) -> None:
    """Ranks 0 and 1 of a 3-rank thread world shrink rank 2 away with NCCL_SHRINK_ABORT,
    then destroy the parent; how: "abort" (rank 2 aborted the parent before, rank 1
    aborts it after) or "destroy" (every rank destroys it)."""
    w = GroupWorld(lib, 3)
    if how == "abort":  # the excluded rank behaves as a failed one: it aborts the parent
        assert lib.ncclCommAbort(w.comms[2]) == 0
    excl = (c_int * 1)(2)
    kids = [c_void_p(), c_void_p()]
    assert lib.ncclGroupStart() == 0
    rcs = [
        int(lib.ncclCommShrink(w.comms[r], excl, 1, byref(kids[r]), None, SHRINK_ABORT))
        for r in range(2)
    ]
    rcs.append(int(lib.ncclGroupEnd()))
    ok = all(lib.ncclCommDestroy(k.value) == 0 for k in kids)
    _emit(event="shrunk", rcs=rcs[:2] if rcs[2] == 0 else rcs, ok=ok)
    survivors = [0, 1]
    if how == "abort":
        t0 = time.monotonic()
        rc = int(lib.ncclCommAbort(w.comms[1]))
        _emit(event="aborted", rc=rc, seconds=time.monotonic() - t0)
        survivors = [0]
    destroys = [Bg(lambda r=r: int(lib.ncclCommDestroy(w.comms[r]))) for r in survivors]
    if how == "destroy":
        destroys.append(Bg(lambda: int(lib.ncclCommDestroy(w.comms[2]))))
    _emit(event="destroying")
    for d in destroys:
        d.done(3600)
    _emit(event="destroyed", rcs=[d.result for d in destroys])


def child_self_put(lib: Lib) -> bool:
    """ncclPutSignal of a window onto itself, 64 bytes up; whether the bytes are a
    memmove's (numpy's reference)."""
    r = Rank(lib, lib.unique_id(), 1, 0)
    n = 4096
    buf = r.mem_alloc(n * 4)
    start = np.arange(n, dtype=np.float32)
    write_f32(buf, start)
    rc, win = r.register(buf, n * 4)
    assert rc == 0, lib.last_error()
    assert r.put(buf, n - 16, 0, win, 64) == 0  # 16 floats up, onto itself
    assert r.wait((1, 0, 0, 0)) == 0 and r.sync() == 0
    want = start.copy()
    want[16:] = start[: n - 16]
    got = read_f32(buf, n)
    r.close()
    return bool(np.array_equal(got, want))


# ---- the child process ----------------------------------------------------------------------


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _child(argv: list[str]) -> int:
    lib = Lib(os.environ["PYNCCL_NCCL_LIBRARY"], os.environ["PYNCCL_CUDART_LIBRARY"])
    if argv[0] == "barrier":
        _child_barrier(lib, argv[1])
        return 0
    ok = child_self_put(lib)
    _emit(event="self_put", ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
