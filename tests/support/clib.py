"""The loopback libnccl through plain ctypes, for the tests of the C library itself.

``Lib`` wraps one loaded libnccl (every function bound with nccl.h's prototype by
pynccl's low-level table, called *unchecked* so tests see the raw ncclResult_t)
and the loopback libcudart. ``GroupWorld`` is the init_all world at this level:
``ncclCommInitAll`` driven from one thread, raw handles and result codes (the object
API's is ``support.worlds.GroupWorld``). Results are checked against the one numpy
reference, ``support.reference``.

Run as a script, this module is one rank of a multi-process job::

    python tests/support/clib.py <scenario> <uid hex> <nranks> <rank> [args]

with the library paths in $PYNCCL_NCCL_LIBRARY / $PYNCCL_CUDART_LIBRARY. It prints
one JSON line per event (``{"event": ..., ...}``) and exits 0 unless a check failed.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from collections.abc import Callable
from ctypes import byref, c_int, c_void_p
from typing import Any

import ml_dtypes
import numpy as np

if __name__ == "__main__":  # a worker: tests/ and the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pynccl._capi.cudart import CudartLibrary
from pynccl._capi.nccl import NcclLibrary
from pynccl._capi.structs import ncclUniqueId
from support.reference import assert_matches, expected, make_input, ref_reduce, sizes

# ncclResult_t
SUCCESS, CUDA_ERR, SYSTEM, INTERNAL, INVALID_ARG, INVALID_USAGE, REMOTE, IN_PROGRESS = range(8)

#: ncclDataType_t -> numpy dtype
DTYPES: dict[int, Any] = {
    0: np.dtype(np.int8),
    1: np.dtype(np.uint8),
    2: np.dtype(np.int32),
    3: np.dtype(np.uint32),
    4: np.dtype(np.int64),
    5: np.dtype(np.uint64),
    6: np.dtype(np.float16),
    7: np.dtype(np.float32),
    8: np.dtype(np.float64),
    9: np.dtype(ml_dtypes.bfloat16),
    10: np.dtype(ml_dtypes.float8_e4m3fn),
    11: np.dtype(ml_dtypes.float8_e5m2),
}
SUM, PROD, MAX, MIN, AVG = range(5)
KINDS = (
    "AllReduce",
    "Broadcast",
    "Bcast",
    "Reduce",
    "AllGather",
    "ReduceScatter",
    "AlltoAll",
    "Gather",
    "Scatter",
)
REDUCING = ("AllReduce", "Reduce", "ReduceScatter")
H2D, D2H = 1, 2


class Lib:
    """One loaded loopback libnccl (raw, unchecked calls by C name) and its cudart."""

    def __init__(self, nccl_path: str, cudart_path: str) -> None:
        self.cudart = CudartLibrary(ctypes.CDLL(cudart_path), cudart_path)
        self.nccl = NcclLibrary(ctypes.CDLL(nccl_path), nccl_path)
        self.path = nccl_path
        self.version = self.nccl.version

    def __getattr__(self, name: str) -> Any:
        if name.startswith("nccl"):
            return self.nccl.raw(name)
        raise AttributeError(name)

    def has(self, name: str) -> bool:
        return self.nccl.has(name)

    def last_error(self) -> str:
        return self.nccl.last_error()

    def error_string(self, code: int) -> str:
        return self.nccl.error_string(code)

    # -- cudart --
    def set_device(self, dev: int) -> None:
        assert self.cudart.raw("cudaSetDevice")(dev) == 0

    def device(self) -> int:
        d = c_int()
        assert self.cudart.raw("cudaGetDevice")(byref(d)) == 0
        return d.value

    def malloc(self, nbytes: int, dev: int | None = None) -> int:
        old = self.device()
        if dev is not None:
            self.set_device(dev)
        p = c_void_p()
        rc = self.cudart.raw("cudaMalloc")(byref(p), max(nbytes, 1))
        self.set_device(old)
        assert rc == 0, f"cudaMalloc({nbytes}) = {rc}"
        return int(p.value or 0)

    def free(self, ptr: int) -> None:
        assert self.cudart.raw("cudaFree")(ptr) == 0

    def upload(self, ptr: int, array: np.ndarray) -> None:
        """Copy ``array`` to ``ptr`` and wait until it has landed (cudaMemcpy from pageable
        memory returns once the source is staged; a peer's stream, or another device's,
        is not ordered after it)."""
        a = np.ascontiguousarray(array)
        if a.nbytes:
            assert self.cudart.raw("cudaMemcpy")(ptr, a.ctypes.data, a.nbytes, H2D) == 0
            assert self.cudart.raw("cudaStreamSynchronize")(None) == 0

    def download(self, ptr: int, dtype: Any, count: int) -> np.ndarray:
        out = np.empty(count, dtype=dtype)
        if out.nbytes:
            assert self.cudart.raw("cudaMemcpy")(out.ctypes.data, ptr, out.nbytes, D2H) == 0
        return out

    def stream(self, dev: int) -> int:
        old = self.device()
        self.set_device(dev)
        s = c_void_p()
        rc = self.cudart.raw("cudaStreamCreate")(byref(s))
        self.set_device(old)
        assert rc == 0
        return int(s.value or 0)

    def sync(self, stream: int) -> int:
        return int(self.cudart.raw("cudaStreamSynchronize")(stream))

    def destroy_stream(self, stream: int) -> None:
        assert self.cudart.raw("cudaStreamDestroy")(stream) == 0

    # -- nccl helpers --
    def unique_id(self) -> ncclUniqueId:
        uid = ncclUniqueId()
        assert self.ncclGetUniqueId(byref(uid)) == 0
        return uid

    def async_error(self, comm: int) -> int:
        r = c_int(-1)
        rc = self.ncclCommGetAsyncError(comm, byref(r))
        assert rc == 0, f"ncclCommGetAsyncError = {rc}: {self.last_error()}"
        return r.value

    def user_rank(self, comm: int) -> int:
        r = c_int(-1)
        assert self.ncclCommUserRank(comm, byref(r)) == 0
        return r.value

    def count(self, comm: int) -> int:
        r = c_int(-1)
        assert self.ncclCommCount(comm, byref(r)) == 0
        return r.value


class GroupWorld:
    """``ncclCommInitAll(n)``: rank r on device r with its own stream, driven by
    this thread (every call for every rank inside one group)."""

    def __init__(self, lib: Lib, n: int) -> None:
        self.lib, self.n = lib, n
        comms = (c_void_p * n)()
        rc = lib.ncclCommInitAll(comms, n, None)
        assert rc == 0, f"ncclCommInitAll = {rc}: {lib.last_error()}"
        self.comms = [int(c or 0) for c in comms]
        self.streams = [lib.stream(r) for r in range(n)]
        self.buffers: list[int] = []

    def alloc(self, rank: int, nbytes: int) -> int:
        p = self.lib.malloc(nbytes, rank)
        self.buffers.append(p)
        return p

    def run(self, call: Callable[[int], int]) -> list[int]:
        """call(rank) for every rank inside one group; then synchronize the streams."""
        lib = self.lib
        assert lib.ncclGroupStart() == 0
        codes = [call(r) for r in range(self.n)]
        end = lib.ncclGroupEnd()
        if any(codes) or end:
            return [*codes, end]
        for s in self.streams:
            assert lib.sync(s) == 0
        return codes

    def close(self) -> None:
        for c in self.comms:
            if c:
                assert self.lib.ncclCommDestroy(c) == 0, self.lib.last_error()
        for s in self.streams:
            self.lib.destroy_stream(s)
        for p in self.buffers:
            self.lib.free(p)
        self.comms, self.streams, self.buffers = [], [], []


# ---- one collective on every rank of a world -------------------------------------------


def call_collective(
    lib: Lib,
    kind: str,
    comm: int,
    stream: int,
    sbuf: int,
    rbuf: int,
    count: int,
    dtype: int,
    op: int,
    root: int,
    config: Any = None,
) -> int:
    if config is not None:
        fn = getattr(lib, f"nccl{kind}Config")
        extra: tuple[Any, ...] = (byref(config),)
    else:
        fn = getattr(lib, f"nccl{kind}")
        extra = ()
    if kind == "AllReduce" or kind == "ReduceScatter":
        return int(fn(sbuf, rbuf, count, dtype, op, comm, stream, *extra))
    if kind == "Reduce":
        return int(fn(sbuf, rbuf, count, dtype, op, root, comm, stream, *extra))
    if kind == "Bcast":
        return int(fn(rbuf, count, dtype, root, comm, stream))
    if kind in ("Broadcast", "Gather", "Scatter"):
        return int(fn(sbuf, rbuf, count, dtype, root, comm, stream, *extra))
    return int(fn(sbuf, rbuf, count, dtype, comm, stream, *extra))  # AllGather, AlltoAll


# ---- the multi-process worker ----------------------------------------------------------


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _init(lib: Lib, uid_hex: str, nranks: int, rank: int) -> int:
    uid = ncclUniqueId()
    ctypes.memmove(byref(uid), bytes.fromhex(uid_hex), ctypes.sizeof(uid))
    lib.set_device(rank % 8)
    comm = c_void_p()
    rc = lib.ncclCommInitRank(byref(comm), nranks, uid, rank)
    if rc:
        _emit(event="init", rc=rc, error=lib.last_error())
        sys.exit(1)
    return int(comm.value or 0)


def _scenario_colls(lib: Lib, comm: int, nranks: int, rank: int, args: list[str]) -> bool:
    """Every collective kind over a few types; the data of every rank is deterministic,
    so each process computes the full reference itself."""
    stream = lib.stream(rank % 8)
    ok = True
    count = 1000 + 7
    for kind in KINDS:
        if not lib.has(f"nccl{'Broadcast' if kind == 'Bcast' else kind}"):
            continue
        for dt in (7, 9, 2, 6):
            op = PROD if dt == 9 else SUM
            root = 1 % nranks
            ns, nr = sizes(kind, count, nranks)
            sends = [make_input(DTYPES[dt], ns, r, seed=dt) for r in range(nranks)]
            sb = lib.malloc(ns * DTYPES[dt].itemsize)
            rb = lib.malloc(nr * DTYPES[dt].itemsize)
            lib.upload(sb, sends[rank])
            if kind == "Bcast":
                lib.upload(rb, sends[rank])
            rc = call_collective(lib, kind, comm, stream, sb, rb, count, dt, op, root)
            rc = rc or lib.sync(stream)
            want = expected(kind, sends, count, op, root, rank)
            if rc:
                ok = False
                _emit(event="fail", kind=kind, dtype=dt, rc=rc, error=lib.last_error())
            elif want is not None:
                got = lib.download(rb, DTYPES[dt], nr)
                try:
                    assert_matches(got, want, f"{kind} {dt}")
                except AssertionError as exc:
                    ok = False
                    _emit(event="fail", kind=kind, dtype=dt, error=str(exc)[:500])
            lib.free(sb)
            lib.free(rb)
    # grouped all-to-all made of send/recv, self included, larger than the rings
    n = 20000
    sb = lib.malloc(nranks * n * 4)
    rb = lib.malloc(nranks * n * 4)
    mine = np.arange(nranks * n, dtype=np.float32) + 1e6 * rank
    lib.upload(sb, mine)
    assert lib.ncclGroupStart() == 0
    for peer in range(nranks):
        assert lib.ncclSend(sb + peer * n * 4, n, 7, peer, comm, stream) == 0
        assert lib.ncclRecv(rb + peer * n * 4, n, 7, peer, comm, stream) == 0
    rc = lib.ncclGroupEnd() or lib.sync(stream)
    got = lib.download(rb, np.float32, nranks * n)
    want = np.concatenate(
        [
            (np.arange(nranks * n, dtype=np.float32) + 1e6 * p)[rank * n : (rank + 1) * n]
            for p in range(nranks)
        ]
    )
    if rc or not np.array_equal(got, want):
        ok = False
        _emit(event="fail", kind="sendrecv", rc=rc, error=lib.last_error())
    lib.free(sb)
    lib.free(rb)
    lib.destroy_stream(stream)
    return ok


def _scenario_big(lib: Lib, comm: int, nranks: int, rank: int, args: list[str]) -> bool:
    """A large float32 all-reduce (count from args), checked in full."""
    count = int(args[0])
    stream = lib.stream(rank % 8)
    sb = lib.malloc(count * 4)
    rb = lib.malloc(count * 4)
    lib.upload(sb, np.full(count, rank + 1, dtype=np.float32))
    t0 = time.perf_counter()
    rc = lib.ncclAllReduce(sb, rb, count, 7, SUM, comm, stream) or lib.sync(stream)
    seconds = time.perf_counter() - t0
    got = lib.download(rb, np.float32, count)
    ok = rc == 0 and bool(np.all(got == nranks * (nranks + 1) / 2))
    _emit(event="big", rc=rc, ok=ok, seconds=seconds, error=lib.last_error() if rc else "")
    lib.free(sb)
    lib.free(rb)
    lib.destroy_stream(stream)
    return ok


def _scenario_die(lib: Lib, comm: int, nranks: int, rank: int, args: list[str]) -> bool:
    """Loop all-reduces; the parent kills the victim (args[0]) after 'ready'. The
    survivors must see their pending collective stop with ncclRemoteError."""
    victim = int(args[0])
    count = 1 << 20
    stream = lib.stream(rank % 8)
    sb, rb = lib.malloc(count * 4), lib.malloc(count * 4)
    rc = lib.ncclAllReduce(sb, rb, count, 7, SUM, comm, stream) or lib.sync(stream)
    _emit(event="ready", rc=rc)
    if rank == victim:
        while True:  # keep participating until killed
            time.sleep(0.05)
    # The victim issues nothing more: this collective can only end by failure detection.
    t0 = time.perf_counter()
    rc = lib.ncclAllReduce(sb, rb, count, 7, SUM, comm, stream)
    sync = lib.sync(stream)
    err = lib.async_error(comm)
    _emit(
        event="done",
        rc=rc,
        sync=sync,
        async_error=err,
        seconds=time.perf_counter() - t0,
        error=lib.last_error(),
    )
    lib.ncclCommAbort(comm)
    return err == REMOTE


def _scenario_orphan(lib: Lib, uid_hex: str, nranks: int, rank: int) -> None:
    """Join a world whose other ranks may never come (the parent may kill this process);
    report how the init ended. $LB_TEST_DEVICE overrides the device (rank % 8)."""
    uid = ncclUniqueId()
    ctypes.memmove(byref(uid), bytes.fromhex(uid_hex), ctypes.sizeof(uid))
    lib.set_device(int(os.environ.get("LB_TEST_DEVICE", rank % 8)))
    comm = c_void_p()
    _emit(event="joining")
    rc = lib.ncclCommInitRank(byref(comm), nranks, uid, rank)
    _emit(event="init_done", rc=rc, error=lib.last_error() if rc else "")
    if rc == 0:
        lib.ncclCommDestroy(comm)


def _allreduce_ok(lib: Lib, comm: int, nranks: int, rank: int, count: int) -> tuple[int, bool]:
    """A float32 sum all-reduce of every rank's make_input, checked against numpy."""
    stream = lib.stream(lib.device())
    sb, rb = lib.malloc(count * 4), lib.malloc(count * 4)
    sends = [make_input(np.float32, count, r, seed=11) for r in range(nranks)]
    lib.upload(sb, sends[rank])
    rc = lib.ncclAllReduce(sb, rb, count, 7, SUM, comm, stream) or lib.sync(stream)
    ok = rc == 0 and bool(np.array_equal(lib.download(rb, np.float32, count), ref_reduce(sends)))
    lib.free(sb)
    lib.free(rb)
    lib.destroy_stream(stream)
    return rc, ok


def _scenario_shrink(lib: Lib, comm: int, nranks: int, rank: int, args: list[str]) -> bool:
    """The parent kills the victim (args[0]) after 'ready'; the survivors see their
    collective fail, shrink it away with NCCL_SHRINK_ABORT and all-reduce in the child."""
    victim = int(args[0])
    count = 1 << 16
    stream = lib.stream(rank % 8)
    sb, rb = lib.malloc(count * 4), lib.malloc(count * 4)
    rc = lib.ncclAllReduce(sb, rb, count, 7, SUM, comm, stream) or lib.sync(stream)
    _emit(event="ready", rc=rc)
    if rank == victim:
        while True:
            time.sleep(0.05)
    lib.ncclAllReduce(sb, rb, count, 7, SUM, comm, stream)
    lib.sync(stream)
    err = lib.async_error(comm)
    _emit(event="parent", async_error=err, error=lib.last_error())
    excl = (c_int * 1)(victim)
    child = c_void_p()
    rc = lib.ncclCommShrink(comm, excl, 1, byref(child), None, 1)  # NCCL_SHRINK_ABORT
    ok = False
    if rc == 0:
        crank, size = lib.user_rank(child.value), lib.count(child.value)
        rc, ok = _allreduce_ok(lib, int(child.value or 0), size, crank, 10_000)
        _emit(event="child", rc=rc, rank=crank, size=size, ok=ok)
        ok = ok and lib.ncclCommDestroy(child.value) == 0
    else:
        _emit(event="child", rc=rc, error=lib.last_error())
    lib.free(sb)
    lib.free(rb)
    lib.destroy_stream(stream)
    lib.ncclCommAbort(comm)
    return ok and err == REMOTE


def _grown(lib: Lib, newcomm: c_void_p, rc: int) -> bool:
    ok = False
    if rc == 0:
        crank, size = lib.user_rank(newcomm.value), lib.count(newcomm.value)
        rc, ok = _allreduce_ok(lib, int(newcomm.value or 0), size, crank, 10_000)
        _emit(event="grown", rc=rc, rank=crank, size=size, ok=ok)
        ok = ok and lib.ncclCommDestroy(newcomm.value) == 0
    else:
        _emit(event="grown", rc=rc, error=lib.last_error())
    return ok


def _scenario_grow_old(lib: Lib, comm: int, nranks: int, rank: int, args: list[str]) -> bool:
    """An existing rank of a grow to args[0] ranks; rank 0 is the root and prints the id."""
    total = int(args[0])
    newcomm = c_void_p()
    if rank == 0:
        gid = ncclUniqueId()
        rc = lib.ncclCommGetUniqueId(comm, byref(gid))
        _emit(event="grow_id", rc=rc, uid=bytes(gid).hex())
        rc = rc or lib.ncclCommGrow(comm, total, byref(gid), -1, byref(newcomm), None)
    else:
        rc = lib.ncclCommGrow(comm, total, None, -1, byref(newcomm), None)
    return _grown(lib, newcomm, rc)


def _scenario_grow_new(lib: Lib, uid_hex: str, nranks: int, rank: int) -> bool:
    """A new rank joining a grow with the root's id."""
    gid = ncclUniqueId()
    ctypes.memmove(byref(gid), bytes.fromhex(uid_hex), ctypes.sizeof(gid))
    lib.set_device(rank % 8)
    newcomm = c_void_p()
    rc = lib.ncclCommGrow(None, nranks, byref(gid), rank, byref(newcomm), None)
    return _grown(lib, newcomm, rc)


def main(argv: list[str]) -> int:
    scenario, uid_hex, nranks, rank = argv[0], argv[1], int(argv[2]), int(argv[3])
    lib = Lib(os.environ["PYNCCL_NCCL_LIBRARY"], os.environ["PYNCCL_CUDART_LIBRARY"])
    if scenario == "orphan":
        _scenario_orphan(lib, uid_hex, nranks, rank)
        return 0
    if scenario == "grow_new":
        ok = _scenario_grow_new(lib, uid_hex, nranks, rank)
        _emit(event="exit", ok=ok)
        return 0 if ok else 1
    comm = _init(lib, uid_hex, nranks, rank)
    run = {
        "colls": _scenario_colls,
        "big": _scenario_big,
        "die": _scenario_die,
        "shrink": _scenario_shrink,
        "grow_old": _scenario_grow_old,
    }[scenario]
    ok = run(lib, comm, nranks, rank, argv[4:])
    if scenario not in ("die", "shrink"):
        rc = lib.ncclCommDestroy(comm)
        ok = ok and rc == 0
    _emit(event="exit", ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
