"""Helpers for the loopback window / signal / property / encryption tests, raw ctypes.

``support.wait.threads(n, fn)`` runs fn(rank) on n threads (a thread world: every rank of one
communicator in this process). ``Rank`` is one rank's state (communicator, stream,
ncclMemAlloc buffers, windows) with thin wrappers that return the raw ncclResult_t.

Run as a script, this module is one rank of a multi-process job::

    python tests/support/clib_rma.py <scenario> <uid hex> <nranks> <rank> [args]

with the library paths in $PYNCCL_NCCL_LIBRARY / $PYNCCL_CUDART_LIBRARY. It prints one
JSON line per event and exits 0 unless a check failed. The expected data of every
rank is a function of (rank, round), so each process computes the reference itself.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Sequence
from ctypes import byref, c_void_p
from typing import Any

import numpy as np

if __name__ == "__main__":  # a worker: tests/ and the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pynccl._capi.structs import (
    NCCL_API_MAGIC,
    STRUCT_VERSION,
    ncclEncryptionConfig_t,
    ncclUniqueId,
    ncclWaitSignalDesc_t,
)
from support.clib import Lib

SUCCESS, CUDA_ERR, SYSTEM, INTERNAL, INVALID_ARG, INVALID_USAGE, REMOTE = range(7)
FLOAT32 = 7
WIN_SYMMETRIC = 1


def pattern(rank: int, count: int, round_: int = 0) -> np.ndarray:
    """What `rank` puts in round `round_`: distinct per rank, round and element."""
    return (np.arange(count, dtype=np.float32) + 1000.0 * rank + 1e5 * round_).astype(np.float32)


def waits(*descs: tuple[int, int, int, int]) -> Any:
    """A ncclWaitSignalDesc_t array from (opCnt, peer, sigIdx, ctx) tuples."""
    arr = (ncclWaitSignalDesc_t * len(descs))()
    for d, (cnt, peer, sig, ctx) in zip(arr, descs):
        d.opCnt, d.peer, d.sigIdx, d.ctx = cnt, peer, sig, ctx
    return arr


def set_encryption(lib: Lib, psk: bytes | None, magic: int = NCCL_API_MAGIC) -> int:
    cfg = ncclEncryptionConfig_t(
        ctypes.sizeof(ncclEncryptionConfig_t), magic, STRUCT_VERSION, 0 if psk is None else 1, psk
    )
    return int(lib.ncclSetEncryption(byref(cfg)))


class Rank:
    """One rank of a communicator: init on device `rank % 8`, one stream, its memory."""

    def __init__(
        self, lib: Lib, uid: ncclUniqueId, nranks: int, rank: int, config: Any = None
    ) -> None:
        self.lib, self.nranks, self.rank = lib, nranks, rank
        lib.set_device(rank % 8)
        comm = c_void_p()
        if config is None:
            rc = lib.ncclCommInitRank(byref(comm), nranks, uid, rank)
        else:
            rc = lib.ncclCommInitRankConfig(byref(comm), nranks, uid, rank, byref(config))
        self.init_rc = int(rc)
        self.init_error = lib.last_error() if rc else ""
        self.comm = int(comm.value or 0)
        self.stream = lib.stream(rank % 8)
        self.mems: list[int] = []
        self.wins: list[int] = []

    def mem_alloc(self, nbytes: int) -> int:
        p = c_void_p()
        rc = self.lib.ncclMemAlloc(byref(p), nbytes)
        assert rc == 0, f"ncclMemAlloc = {rc}: {self.lib.last_error()}"
        self.mems.append(int(p.value or 0))
        return int(p.value or 0)

    def register(self, ptr: int, nbytes: int, flags: int = WIN_SYMMETRIC) -> tuple[int, int]:
        """(rc, window); a registered window is deregistered by close()."""
        win = c_void_p()
        rc = int(self.lib.ncclCommWindowRegister(self.comm, ptr, nbytes, byref(win), flags))
        if rc == 0:
            self.wins.append(int(win.value or 0))
        return rc, int(win.value or 0)

    def deregister(self, win: int) -> int:
        rc = int(self.lib.ncclCommWindowDeregister(self.comm, win))
        if rc == 0:
            self.wins.remove(win)
        return rc

    def put(
        self, src: int, count: int, peer: int, win: int, offset: int, sig: int = 0, ctx: int = 0
    ) -> int:
        return int(
            self.lib.ncclPutSignal(
                src, count, FLOAT32, peer, win, offset, sig, ctx, 0, self.comm, self.stream
            )
        )

    def wait(self, *descs: tuple[int, int, int, int]) -> int:
        arr = waits(*descs)
        return int(self.lib.ncclWaitSignal(len(descs), arr, self.comm, self.stream))

    def sync(self) -> int:
        return self.lib.sync(self.stream)

    def signal(self, peer: int, sig: int = 0, ctx: int = 0, flags: int = 0) -> int:
        return int(self.lib.ncclSignal(peer, sig, ctx, flags, self.comm, self.stream))

    def wait_all_peers_signal(self) -> int:
        """A barrier made of signals: signal every peer, wait for one from each, sync."""
        others = [p for p in range(self.nranks) if p != self.rank]
        for p in others:
            rc = self.signal(p)
            if rc:
                return rc
        rc = self.wait(*[(1, p, 0, 0) for p in others]) if others else 0
        return rc or self.sync()

    def peer_pointer(self, win: int, offset: int, peer: int, lsa: bool = False) -> tuple[int, int]:
        out = c_void_p()
        fn = self.lib.ncclGetLsaDevicePointer if lsa else self.lib.ncclGetPeerDevicePointer
        rc = int(fn(win, offset, peer, byref(out)))
        return rc, int(out.value or 0)

    def close(self, destroy: bool = True) -> None:
        lib = self.lib
        if self.comm:
            for w in list(self.wins):
                assert self.deregister(w) == 0, lib.last_error()
            if destroy:
                assert lib.ncclCommDestroy(self.comm) == 0, lib.last_error()
        lib.destroy_stream(self.stream)
        for p in self.mems:
            assert lib.ncclMemFree(p) == 0
        self.mems = []


def read_f32(addr: int, count: int) -> np.ndarray:
    """count float32 at a host address (loopback device memory is host memory)."""
    return np.frombuffer(ctypes.string_at(addr, count * 4), dtype=np.float32).copy()


def write_f32(addr: int, values: np.ndarray) -> None:
    a = np.ascontiguousarray(values, dtype=np.float32)
    ctypes.memmove(addr, a.ctypes.data, a.nbytes)


def ring_rounds(r: Rank, count: int, rounds: int) -> list[np.ndarray]:
    """Every rank put_signals `count` floats into its right neighbour's window (at slot
    `rank`), `rounds` times, waiting for its left neighbour each round. Returns what
    this rank's window held after each round. Window: nranks slots of count floats."""
    lib, n, me = r.lib, r.nranks, r.rank
    right, left = (me + 1) % n, (me - 1) % n
    src = r.mem_alloc(count * 4)
    dst = r.mem_alloc(n * count * 4)
    lib.upload(dst, np.full(n * count, -1.0, np.float32))
    rc, _swin = r.register(src, count * 4)
    assert rc == 0, lib.last_error()
    rc, dwin = r.register(dst, n * count * 4)
    assert rc == 0, lib.last_error()
    seen = []
    for k in range(rounds):
        lib.upload(src, pattern(me, count, k))
        assert r.put(src, count, right, dwin, me * count * 4) == 0, lib.last_error()
        assert r.wait((1, left, 0, 0)) == 0, lib.last_error()
        assert r.sync() == 0, lib.last_error()
        seen.append(lib.download(dst, np.float32, n * count))
        # the next round overwrites src and dst: everyone must have finished this one
        assert r.wait_all_peers_signal() == 0, lib.last_error()
    return seen


def check_ring(seen: Sequence[np.ndarray], n: int, me: int, count: int) -> None:
    left = (me - 1) % n
    for k, got in enumerate(seen):
        want = np.full(n * count, -1.0, np.float32)
        want[left * count : (left + 1) * count] = pattern(left, count, k)
        np.testing.assert_array_equal(got, want, err_msg=f"rank {me} round {k}")


# ---- the multi-process worker ----------------------------------------------------------


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _uid(uid_hex: str) -> ncclUniqueId:
    uid = ncclUniqueId()
    ctypes.memmove(byref(uid), bytes.fromhex(uid_hex), ctypes.sizeof(uid))
    return uid


def _scenario_ring(lib: Lib, r: Rank, args: list[str]) -> bool:
    """put_signal ring, then peer pointers read the neighbours' bytes and write into them."""
    n, me, count = r.nranks, r.rank, int(args[0])
    seen = ring_rounds(r, count, 2)
    check_ring(seen, n, me, count)
    buf = r.mem_alloc(count * 4)
    lib.upload(buf, pattern(me, count, 7))
    rc, win = r.register(buf, count * 4)
    assert rc == 0, lib.last_error()
    for p in range(n):
        for lsa in (False, True):
            rc, addr = r.peer_pointer(win, 0, p, lsa)
            assert rc == 0, lib.last_error()
            np.testing.assert_array_equal(read_f32(addr, count), pattern(p, count, 7))
            # a UVA device address on a GPU: cudaMemcpy takes it (the mapping is registered)
            got = lib.download(addr, np.float32, count)
            np.testing.assert_array_equal(got, pattern(p, count, 7))
    assert r.wait_all_peers_signal() == 0, lib.last_error()  # all read before anyone writes
    # each rank writes its rank into element `me` of every peer's window
    for p in range(n):
        rc, addr = r.peer_pointer(win, me * 4, p)
        assert rc == 0
        write_f32(addr, np.array([me + 0.5], np.float32))
    assert r.wait_all_peers_signal() == 0, lib.last_error()
    got = lib.download(buf, np.float32, count)
    want = pattern(me, count, 7)
    want[:n] = np.arange(n, dtype=np.float32) + 0.5
    np.testing.assert_array_equal(got, want)
    # memory that is not from ncclMemAlloc is no window (NCCL: cuMem memory only)
    plain = lib.malloc(4096)
    rc, _ = r.register(plain, 4096)
    _emit(event="plain", rc=rc, error=lib.last_error())
    lib.free(plain)
    assert rc == CUDA_ERR
    return True


def _scenario_enc(lib: Lib, uid_hex: str, nranks: int, rank: int, args: list[str]) -> bool:
    """Set the encryption key named by args[rank] ("-" for none), then init."""
    key = args[rank]
    rc = set_encryption(lib, None if key == "-" else key.encode() * (32 // len(key) + 1))
    assert rc == 0, lib.last_error()
    r = Rank(lib, _uid(uid_hex), nranks, rank)
    _emit(event="init", rc=r.init_rc, error=r.init_error)
    if r.init_rc == 0:
        r.close()
    return True


def main(argv: list[str]) -> int:
    scenario, uid_hex, nranks, rank = argv[0], argv[1], int(argv[2]), int(argv[3])
    lib = Lib(os.environ["PYNCCL_NCCL_LIBRARY"], os.environ["PYNCCL_CUDART_LIBRARY"])
    try:
        if scenario == "enc":
            ok = _scenario_enc(lib, uid_hex, nranks, rank, argv[4:])
        else:
            r = Rank(lib, _uid(uid_hex), nranks, rank)
            assert r.init_rc == 0, r.init_error
            ok = {"ring": _scenario_ring}[scenario](lib, r, argv[4:])
            r.close()
    except AssertionError as exc:
        _emit(event="fail", error=str(exc)[:2000], last=lib.last_error())
        ok = False
    _emit(event="exit", ok=ok)
    return 0 if ok else 1


def spawn_job(build: Any, scenario: str, uid: ncclUniqueId, n: int, *args: str) -> list[Any]:
    """Start n worker processes; returns their events (lists of dicts), in rank order."""
    import subprocess

    env = {**os.environ, "PYNCCL_NCCL_LIBRARY": build.nccl, "PYNCCL_CUDART_LIBRARY": build.cudart}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                scenario,
                bytes(uid).hex(),
                str(n),
                str(r),
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        assert lines, f"worker printed nothing (exit {p.returncode}): {stderr[-2000:]}"
        out.append(lines)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
