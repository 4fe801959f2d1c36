"""Init at scale on the loopback libnccl: ncclCommInitRankScalable with every unique id used,
as NCCL does (the ranks split into nId groups, one root per id), and a world whose p2p rings
(nranks^2 of them) are reserved at a sender's first send, not all at init."""

from __future__ import annotations

import os
import threading
import time
from ctypes import byref, c_void_p
from typing import Any

import pytest

from pynccl._capi.structs import ncclUniqueId

INVALID_ARGUMENT, REMOTE_ERROR = 4, 6


def _init_scalable(lib: Any, nranks: int, ids_per_rank: dict[int, list[Any]]) -> dict[int, Any]:
    """ncclCommInitRankScalable on a thread per rank (rank r on device r, blocking);
    {rank: (code, comm, last error)}."""
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        lib.set_device(r)
        ids = ids_per_rank[r]
        arr = (ncclUniqueId * len(ids))(*ids)
        comm = c_void_p()
        code = lib.ncclCommInitRankScalable(byref(comm), nranks, r, len(ids), arr, None)
        out[r] = (code, int(comm.value or 0), lib.last_error() if code else "")

    threads = [threading.Thread(target=rank, args=(r,)) for r in ids_per_rank]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _destroy(lib: Any, results: dict[int, Any]) -> None:
    for _code, comm, _ in results.values():
        if comm:
            assert lib.ncclCommDestroy(comm) == 0, lib.last_error()


def _need_scalable(lib: Any) -> None:
    if not lib.has("ncclCommInitRankScalable"):
        pytest.skip("this loopback release predates ncclCommInitRankScalable (NCCL 2.23.4)")


def test_scalable_init_with_several_ids_forms_one_world(lib):
    _need_scalable(lib)
    ids = [lib.unique_id() for _ in range(2)]
    got = _init_scalable(lib, 5, {r: ids for r in range(5)})
    try:
        assert [got[r][0] for r in range(5)] == [0] * 5, got
        for r in range(5):
            assert lib.count(got[r][1]) == 5
            assert lib.user_rank(got[r][1]) == r
    finally:
        _destroy(lib, got)


def test_scalable_init_uses_every_id(lib, monkeypatch):
    # Rank 1 passes the same first id but another second one: in NCCL it reaches a root of
    # its own (its group's id is not the others'), so it never meets them; before, the
    # loopback looked at commIds[0] only and let it in.
    _need_scalable(lib)
    monkeypatch.setenv("PYNCCL_LOOPBACK_INIT_TIMEOUT", "1")
    a, b, c = (lib.unique_id() for _ in range(3))
    got = _init_scalable(lib, 2, {0: [a, b], 1: [a, c]})
    _destroy(lib, got)
    for r in (0, 1):
        code, _, error = got[r]
        assert code == REMOTE_ERROR, got
        assert "timed out waiting for rank" in error, error


def test_scalable_init_nid_must_match_on_every_rank(lib, monkeypatch):
    _need_scalable(lib)
    monkeypatch.setenv("PYNCCL_LOOPBACK_INIT_TIMEOUT", "1")
    a, b = lib.unique_id(), lib.unique_id()
    got = _init_scalable(lib, 2, {0: [a], 1: [a, b]})
    _destroy(lib, got)
    assert [got[r][0] for r in (0, 1)] == [REMOTE_ERROR, REMOTE_ERROR], got


def test_scalable_init_refuses_more_ids_than_ranks(lib):
    # NCCL: "improper usage of ncclCommInitRank: nId = 3, nranks=2" (ncclInvalidArgument)
    _need_scalable(lib)
    ids = [lib.unique_id() for _ in range(3)]
    got = _init_scalable(lib, 2, {0: ids})
    assert got[0][:2] == (INVALID_ARGUMENT, 0), got
    assert "nId = 3, nranks=2" in got[0][2]
    bad = ncclUniqueId()  # all zeros: not a loopback id
    got = _init_scalable(lib, 2, {0: [ids[0], bad]})
    assert got[0][0] == INVALID_ARGUMENT and "commIds[1]" in got[0][2], got


def _memfds(prefix: str = "/memfd:pynccl-lb-") -> dict[str, os.stat_result]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(prefix):
                found[target] = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return found


def test_p2p_rings_are_not_reserved_at_init(lib, monkeypatch):
    # A 64-rank world holds 64^2 p2p rings of 16 KiB (64 MiB) beside 32 MiB of collective
    # slots; reserving them all at init made it quadratic (1 GiB at 256 ranks). Rank 0 alone
    # creates the world and waits for the others, its segment open meanwhile.
    monkeypatch.setenv("PYNCCL_LOOPBACK_INIT_TIMEOUT", "3")
    monkeypatch.setenv("PYNCCL_LOOPBACK_RING_BYTES", str(16 << 10))
    before = set(_memfds())
    uid = lib.unique_id()
    result: list[int] = []

    def rank0() -> None:
        lib.set_device(0)
        comm = c_void_p()
        result.append(lib.ncclCommInitRank(byref(comm), 64, uid, 0))

    t = threading.Thread(target=rank0)
    t.start()
    try:
        deadline = time.monotonic() + 2.5
        mine: dict[str, os.stat_result] = {}
        while not mine and time.monotonic() < deadline:
            mine = {k: v for k, v in _memfds().items() if k not in before}
            time.sleep(0.01)
        assert mine, "rank 0's world segment never appeared"
        (st,) = mine.values()
        rings = 64 * 64 * (16 << 10)
        assert st.st_size > rings
        assert st.st_blocks * 512 <= st.st_size - rings, (st.st_blocks * 512, st.st_size)
    finally:
        t.join(30)
    assert result == [REMOTE_ERROR]


def test_p2p_after_lazy_reservation(lib):
    # every pair's first send reserves its ring; the bytes arrive intact, in both directions
    import numpy as np

    n, count = 4, 50_000  # 200 KB: many laps of a 16 KiB ring
    uid = lib.unique_id()
    comms: dict[int, int] = {}

    def init(r: int) -> None:
        lib.set_device(r)
        comm = c_void_p()
        assert lib.ncclCommInitRank(byref(comm), n, uid, r) == 0, lib.last_error()
        comms[r] = int(comm.value or 0)

    threads = [threading.Thread(target=init, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    bufs = {}
    try:
        for r in range(n):
            send = np.arange(count, dtype=np.float32) + 1000 * r
            bufs[r] = (lib.malloc(send.nbytes, r), lib.malloc(send.nbytes, r), lib.stream(r))
            lib.upload(bufs[r][0], send)
        assert lib.ncclGroupStart() == 0
        for r in range(n):
            s, d, st = bufs[r]
            assert lib.ncclSend(s, count, 7, (r + 1) % n, comms[r], st) == 0
            assert lib.ncclRecv(d, count, 7, (r - 1) % n, comms[r], st) == 0
        assert lib.ncclGroupEnd() == 0, lib.last_error()
        for r in range(n):
            assert lib.sync(bufs[r][2]) == 0
            got = lib.download(bufs[r][1], np.float32, count)
            want = np.arange(count, dtype=np.float32) + 1000 * ((r - 1) % n)
            np.testing.assert_array_equal(got, want)
    finally:
        for s, d, st in bufs.values():
            lib.free(s)
            lib.free(d)
            lib.destroy_stream(st)
        for c in comms.values():
            assert lib.ncclCommDestroy(c) == 0


_NO_ROOM_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
/* every MADV_POPULATE_WRITE fails as on a full memory cgroup or shm: ENOMEM */
int madvise(void *addr, size_t len, int advice) {
    if (advice == 23) { errno = ENOMEM; return -1; }
    int (*real)(void *, size_t, int) = (int (*)(void *, size_t, int))dlsym(RTLD_NEXT, "madvise");
    return real(addr, len, advice);
}
"""

_NO_ROOM_RANKS = """
import sys, threading
from ctypes import byref, c_void_p
import numpy as np
sys.path.insert(0, sys.argv[3])
from support.clib import Lib
lib = Lib(sys.argv[1], sys.argv[2])
uid, comms = lib.unique_id(), {}
def init(r):
    lib.set_device(r)
    comm = c_void_p()
    assert lib.ncclCommInitRank(byref(comm), 2, uid, r) == 0, lib.last_error()
    comms[r] = comm.value
threads = [threading.Thread(target=init, args=(r,)) for r in (0, 1)]
[t.start() for t in threads]
[t.join(30) for t in threads]
bufs = {r: (lib.malloc(64, r), lib.malloc(64, r), lib.stream(r)) for r in (0, 1)}
for r in (0, 1):
    lib.upload(bufs[r][0], np.full(16, r + 1, np.float32))
rc = lib.ncclSend(bufs[0][0], 16, 7, 1, comms[0], bufs[0][2])
print("send", rc, lib.last_error().replace("\\n", " "))
print("sync", lib.sync(bufs[0][2]), lib.async_error(comms[0]), lib.async_error(comms[1]))
assert lib.ncclGroupStart() == 0
for r in (0, 1):
    lib.ncclAllReduce(bufs[r][0], bufs[r][1], 16, 7, 0, comms[r], bufs[r][2])
print("allreduce", lib.ncclGroupEnd(), [lib.sync(bufs[r][2]) for r in (0, 1)],
      [float(lib.download(bufs[r][1], np.float32, 16)[0]) for r in (0, 1)])
for r in (0, 1):
    lib.ncclCommAbort(comms[r])
"""


def test_ring_reservation_failure_is_the_sends_error(build, tmp_path):
    # NCCL connects p2p peers in ncclGroupEnd (ncclSend outside a group) before launching:
    # no room is that call's ncclSystemError, the communicator and its peer left working.
    # Before, ncclSend returned ncclSuccess and the stream worker broke the whole world.
    import shutil
    import subprocess
    import sys

    from support import ROOT

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the madvise shim")
    shim = tmp_path / "noroom.so"
    (tmp_path / "noroom.c").write_text(_NO_ROOM_SHIM)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "noroom.c"), "-ldl"], check=True
    )
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [env.get("LD_PRELOAD", ""), str(shim)]))
    proc = subprocess.run(
        [sys.executable, "-c", _NO_ROOM_RANKS, build.nccl, build.cudart, str(ROOT / "tests")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line}
    send = lines["send"].split(maxsplit=2)
    assert send[1] == "2", lines["send"]  # ncclSystemError, from the call itself
    assert "cannot reserve" in send[2] and "to rank 1" in send[2], lines["send"]
    assert lines["sync"].split()[1:] == ["0", "0", "0"], lines["sync"]  # nothing broke
    assert lines["allreduce"] == "allreduce 0 [0, 0] [3.0, 3.0]", lines["allreduce"]
