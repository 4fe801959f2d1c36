"""The loopback libnccl, driven through ctypes (pynccl's prototype table, raw results).

Results are checked against numpy / ml_dtypes references (tests/support/clib.py), never
against the library itself. Worlds: ncclCommInitAll driven by this thread (both the
direct path, where ranks read each other's buffers, and the staged path through the
shared-memory slots, with tiny slots so that every collective spans many chunks);
threads calling ncclCommInitRank; and separate processes (tests/support/clib.py as a
script). Also: groups and p2p, in-place rules, the *Config variants, version builds,
non-blocking init, split, every error path, mismatch detection, peer death, abort,
fault injection, the null build, and that nothing (segment, thread) is left behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from ctypes import byref, c_int, c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import ROOT, SUPPORT
from support.clib import (
    AVG,
    DTYPES,
    IN_PROGRESS,
    INVALID_ARG,
    INVALID_USAGE,
    KINDS,
    MAX,
    MIN,
    PROD,
    REDUCING,
    REMOTE,
    SUCCESS,
    SUM,
    GroupWorld,
    Lib,
    call_collective,
)
from support.clib_fixtures import _build
from support.reference import assert_matches, expected, make_input, ref_reduce, sizes
from support.wait import threads

from pynccl._capi.nccl import PROTOTYPES
from pynccl._capi.nccl_device import DEVICE_PROTOTYPES
from pynccl._capi.structs import (
    make_coll_config,
    make_config,
    make_sim_info,
    ncclUniqueId,
)

HELPER = str(SUPPORT / "clib.py")
LOOPBACK_DIR = ROOT / "pynccl" / "testing" / "loopback"


@pytest.fixture(params=["direct", "staged"])
def path(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both collective paths; the staged one with slots and rings of a few hundred bytes."""
    if request.param == "staged":
        monkeypatch.setenv("PYNCCL_LOOPBACK_DIRECT", "0")
        monkeypatch.setenv("PYNCCL_LOOPBACK_CHUNK_BYTES", "192")
        monkeypatch.setenv("PYNCCL_LOOPBACK_RING_BYTES", "256")
    return str(request.param)


def shm_name(uid: ncclUniqueId) -> str:
    raw = bytes(uid)
    return "/dev/shm/pynccl-lb-" + raw[0:8].hex() + raw[64:80].hex()


def spawn(
    build: Any,
    scenario: str,
    uid: ncclUniqueId,
    n: int,
    *args: str,
    env: dict[str, str] | None = None,
    ranks: Any = None,
) -> list[subprocess.Popen[str]]:
    full = {
        **os.environ,
        "PYNCCL_NCCL_LIBRARY": build.nccl,
        "PYNCCL_CUDART_LIBRARY": build.cudart,
        **(env or {}),
    }
    return [
        subprocess.Popen(
            [sys.executable, HELPER, scenario, bytes(uid).hex(), str(n), str(r), *args],
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (range(n) if ranks is None else ranks)
    ]


def events(proc: subprocess.Popen[str], timeout: float = 120) -> list[dict[str, Any]]:
    import json

    out, err = proc.communicate(timeout=timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert lines, f"worker printed nothing (exit {proc.returncode}): {err[-2000:]}"
    return lines


def launch(
    lib: Lib,
    w: GroupWorld,
    kinds: Any,
    sb: Any,
    rb: Any,
    counts: Any,
    dt: int,
    ops: Any,
    roots: Any,
) -> list[int]:
    """One collective per rank (each with its own kind, count, op and root), one group."""
    return w.run(
        lambda r: call_collective(
            lib, kinds[r], w.comms[r], w.streams[r], sb[r], rb[r], counts[r], dt, ops[r], roots[r]
        )
    )


def run_kind(
    lib: Lib,
    w: GroupWorld,
    kind: str,
    dt: int,
    op: int,
    count: int,
    seed: int,
    root: int = 1,
    config: Any = None,
    scalar: Any = None,
) -> None:
    """One collective on every rank of w, checked against the numpy reference."""
    n, dtype = w.n, DTYPES[dt]
    ns, nr = sizes(kind, count, n)
    sends = [make_input(dtype, ns, r, seed) for r in range(n)]
    sbufs = [w.alloc(r, ns * dtype.itemsize) for r in range(n)]
    rbufs = [w.alloc(r, nr * dtype.itemsize) for r in range(n)]
    for r in range(n):
        lib.upload(sbufs[r], sends[r])
        lib.upload(rbufs[r], (sends[r] if kind == "Bcast" else np.zeros(nr, dtype)))
    codes = w.run(
        lambda r: call_collective(
            lib, kind, w.comms[r], w.streams[r], sbufs[r], rbufs[r], count, dt, op, root, config
        )
    )
    assert not any(codes), f"{kind} {dtype} op {op}: {codes} {lib.last_error()}"
    for r in range(n):
        want = expected(kind, sends, count, op, root, r, scalar)
        if want is None:
            continue
        got = lib.download(rbufs[r], dtype, nr)
        assert_matches(got, want, f"{kind} {dtype} op={op} rank {r}")


# ---- exports, headers, versions --------------------------------------------------------


def test_exports_every_function_of_the_header_and_its_p_alias(build: Any) -> None:
    cdll = ctypes.CDLL(build.nccl)
    missing = [n for n in PROTOTYPES if not hasattr(cdll, n) or not hasattr(cdll, "p" + n)]
    assert missing == []
    out = subprocess.run(["nm", "-D", "--defined-only", build.nccl], capture_output=True, text=True)
    if out.returncode == 0:  # nothing else leaks out of the library
        names = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
        extra = {n for n in names if n.lstrip("p") not in {**PROTOTYPES, **DEVICE_PROTOTYPES}}
        assert extra == {"pynccl_lb_init_missing"}  # the one test hook (nccl/initwait.c)


def _wheel_nccl_include() -> str | None:
    for base in sys.path:
        cand = Path(base) / "nvidia" / "nccl" / "include"
        if (cand / "nccl.h").is_file():
            return str(cand)
    return None


def test_sources_compile_against_the_real_nccl_header() -> None:
    """Every exported definition checked by the compiler against NVIDIA's prototypes."""
    inc = _wheel_nccl_include()
    cuda = "/usr/local/cuda/include"
    cc = shutil.which(os.environ.get("CC", "cc"))
    if inc is None or not Path(cuda, "cuda_runtime_api.h").is_file() or cc is None:
        pytest.skip("needs the nvidia-nccl wheel's nccl.h, the CUDA headers and a compiler")
    sources = sorted(str(p) for p in (LOOPBACK_DIR / "nccl").glob("*.c"))
    proc = subprocess.run(
        [
            cc,
            "-fsyntax-only",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-DLB_USE_REAL_HEADERS",
            f"-I{inc}",
            f"-I{cuda}",
            f"-I{LOOPBACK_DIR / 'include'}",
            f"-I{LOOPBACK_DIR}",
            *sources,
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("version", ["2.18.1", "2.24.3", "2.32.3"])
def test_version_builds(version: str) -> None:
    b = _build(version)
    lib = Lib(b.nccl, b.cudart)
    triple = tuple(int(p) for p in version.split("."))
    v = c_int()
    assert lib.ncclGetVersion(byref(v)) == 0
    assert v.value == triple[0] * 10000 + triple[1] * 100 + triple[2]
    cdll = ctypes.CDLL(b.nccl)
    for name, proto in PROTOTYPES.items():
        assert hasattr(cdll, name) == (proto.first <= triple), name
    if triple < (2, 28, 3):  # 2.18.1: no Gather / AlltoAll / Scatter symbols
        assert not hasattr(cdll, "ncclGather") and not hasattr(cdll, "ncclAlltoAll")
    assert lib.error_string(8) == ("timeout" if triple >= (2, 30, 3) else "unknown result code")
    w = GroupWorld(lib, 2)
    try:
        run_kind(lib, w, "AllReduce", 9, SUM, 33, seed=1)  # bfloat16 everywhere
        if triple >= (2, 24, 3):
            run_kind(lib, w, "AllReduce", 10, SUM, 33, seed=2)
            run_kind(lib, w, "AllReduce", 11, MAX, 33, seed=3)
        else:
            p = w.alloc(0, 64)
            assert lib.ncclAllReduce(p, p, 8, 10, SUM, w.comms[0], w.streams[0]) == INVALID_ARG
            assert "invalid type 10" in lib.last_error()
        p = w.alloc(0, 64)
        assert lib.ncclAllReduce(p, p, 8, 12, SUM, w.comms[0], w.streams[0]) == INVALID_ARG
    finally:
        w.close()
    # ncclConfig_t fields newer than the release are ignored (nvlsCTAs arrived in 2.27)
    cfg = make_config()
    cfg.nvlsCTAs = -5
    comm = c_void_p()
    rc = lib.ncclCommInitRankConfig(byref(comm), 1, lib.unique_id(), 0, byref(cfg))
    if triple >= (2, 27, 0):
        assert rc == INVALID_ARG and "nvlsCTAs" in lib.last_error()
    else:
        assert rc == SUCCESS
        assert lib.ncclCommDestroy(comm) == 0


def test_config_fields_follow_the_release(lib: Lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """blocking=0 with version < 2.14 is reset to blocking; a short 2.14-sized struct
    still works; a bad magic or value is ncclInvalidArgument."""
    uid = lib.unique_id()
    comm = c_void_p()
    cfg = make_config({"blocking": 0})
    cfg.version = 21300
    assert lib.ncclCommInitRankConfig(byref(comm), 1, uid, 0, byref(cfg)) == SUCCESS
    assert lib.ncclCommDestroy(comm) == 0
    cfg = make_config({"blocking": 0})
    cfg.size = 24  # a 2.14-era struct
    comm = c_void_p()
    assert lib.ncclCommInitRankConfig(byref(comm), 1, lib.unique_id(), 0, byref(cfg)) == IN_PROGRESS
    while lib.async_error(comm.value) == IN_PROGRESS:
        pass
    assert lib.ncclCommDestroy(comm) == 0
    bad = make_config()
    bad.magic = 0x1234
    assert lib.ncclCommInitRankConfig(byref(comm), 1, lib.unique_id(), 0, byref(bad)) == INVALID_ARG
    assert "NCCL_CONFIG_INITIALIZER" in lib.last_error()
    bad = make_config({"blocking": 2})
    assert lib.ncclCommInitRankConfig(byref(comm), 1, lib.unique_id(), 0, byref(bad)) == INVALID_ARG
    assert "blocking" in lib.last_error()
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")  # like NCCL, the env overrides blocking
    assert lib.ncclCommInitRankConfig(byref(comm), 1, lib.unique_id(), 0, None) == IN_PROGRESS
    while lib.async_error(comm.value) == IN_PROGRESS:
        pass
    assert lib.ncclCommDestroy(comm) == 0


def test_error_strings_and_unique_ids(lib: Lib) -> None:
    want = {
        0: "no error",
        1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3: "internal error - please report this issue to the NCCL developers",
        4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
        5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
        6: "remote process exited or there was a network error",
        7: "NCCL operation in progress",
        8: "timeout",
        9: "unknown result code",
        -1: "unknown result code",
    }
    for code, text in want.items():
        assert lib.error_string(code) == text
    ids = {bytes(lib.unique_id()) for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 128 for i in ids)
    assert lib.ncclGetUniqueId(None) == INVALID_ARG


# ---- collectives against numpy ---------------------------------------------------------


@pytest.mark.parametrize("dt", sorted(DTYPES), ids=[str(DTYPES[d]) for d in sorted(DTYPES)])
@pytest.mark.parametrize("kind", KINDS)
def test_collective(lib: Lib, world: Any, path: str, kind: str, dt: int) -> None:
    """Every collective x type (x every op) on 3 ranks, odd sizes."""
    w = world(3)
    ops = [SUM, PROD, MAX, MIN, AVG] if kind in REDUCING else [SUM]
    for i, op in enumerate(ops):
        run_kind(lib, w, kind, dt, op, count=37 + i, seed=dt * 10 + i, root=i % 3)


@pytest.mark.parametrize("dt", [6, 9, 10, 11])
def test_small_float_arithmetic_rounds_like_float32_then_casts(
    lib: Lib, world: Any, dt: int
) -> None:
    """Every pair of float8 values (all 65536, NaN/inf/subnormals/overflow included), and
    200k random pairs of float16 / bfloat16 bit patterns: x op y computed in float32 and
    rounded to nearest even (for float8, ml_dtypes' saturation rules)."""
    w, dtype = world(2), DTYPES[dt]
    bits = np.uint8 if dtype.itemsize == 1 else np.uint16
    if dtype.itemsize == 1:
        a, b = (v.ravel().astype(np.uint8) for v in np.meshgrid(np.arange(256), np.arange(256)))
    else:
        rng = np.random.default_rng(dt)
        a, b = (rng.integers(0, 1 << 16, 200_000, dtype=np.uint16) for _ in range(2))
    x, y = a.view(dtype), b.view(dtype)
    n = len(x)
    sb = [w.alloc(r, n * dtype.itemsize) for r in range(2)]
    rb = [w.alloc(r, n * dtype.itemsize) for r in range(2)]
    lib.upload(sb[0], x)
    lib.upload(sb[1], y)
    f32 = np.float32
    for op, ref in (
        (SUM, lambda: (x.astype(f32) + y.astype(f32)).astype(dtype)),
        (PROD, lambda: (x.astype(f32) * y.astype(f32)).astype(dtype)),
        (MAX, lambda: np.maximum(x.astype(f32), y.astype(f32)).astype(dtype)),
        (MIN, lambda: np.minimum(x.astype(f32), y.astype(f32)).astype(dtype)),
    ):
        codes = w.run(
            lambda r, op=op: lib.ncclAllReduce(sb[r], rb[r], n, dt, op, w.comms[r], w.streams[r])
        )
        assert not any(codes), lib.last_error()
        with np.errstate(all="ignore"):
            got, want = lib.download(rb[0], dtype, n), ref()
        nan_got, nan_want = np.isnan(got.astype(f32)), np.isnan(want.astype(f32))
        np.testing.assert_array_equal(nan_got, nan_want, err_msg=f"NaNs, op {op}")
        ok = ~nan_want
        if op in (MAX, MIN):  # which zero max(+0, -0) returns is unspecified (fmax, maxps)
            ok &= want.astype(f32) != 0
            np.testing.assert_array_equal(got[~ok & ~nan_want].astype(f32), 0)
        np.testing.assert_array_equal(got[ok].view(bits), want[ok].view(bits), err_msg=f"op {op}")


@pytest.mark.parametrize("dt", [2, 7, 6, 9, 10])
def test_premulsum(lib: Lib, world: Any, path: str, dt: int) -> None:
    """Host-immediate scalars are read at creation, device scalars when the op runs."""
    w = world(2)
    dtype = DTYPES[dt]
    user_ops: list[list[int]] = []
    for r in range(2):
        host = np.array([1.5 if dtype.kind == "f" or dt >= 9 else 3], dtype=dtype)
        dev = w.alloc(r, 8)
        lib.upload(dev, np.array([2], dtype=dtype))
        ops = []
        for residence, ptr in ((1, host.ctypes.data), (0, dev)):
            op = c_int()
            assert lib.ncclRedOpCreatePreMulSum(byref(op), ptr, dt, residence, w.comms[r]) == 0
            ops.append(op.value)
        assert ops[0] >= 5 and ops[1] >= 5
        lib.upload(dev, np.array([0.5 if dtype.kind == "f" or dt >= 9 else 5], dtype=dtype))
        host[0] = 0  # already captured
        user_ops.append(ops)
    for which, scalar in ((0, 1.5), (1, 0.5)):
        if dtype.kind in "iu":
            scalar = 3 if which == 0 else 5
        for kind in REDUCING:
            n, count = 2, 29
            ns, nr = sizes(kind, count, n)
            sends = [make_input(dtype, ns, r, seed=which) for r in range(n)]
            sb = [w.alloc(r, ns * dtype.itemsize) for r in range(n)]
            rb = [w.alloc(r, nr * dtype.itemsize) for r in range(n)]
            for r in range(n):
                lib.upload(sb[r], sends[r])
            codes = launch(
                lib,
                w,
                [kind] * n,
                sb,
                rb,
                [count] * n,
                dt,
                [ops[which] for ops in user_ops],
                [0] * n,
            )
            assert not any(codes), lib.last_error()
            for r in range(n):
                want = expected(
                    kind, [s for s in sends], count, -1, 0, r, np.array(scalar).astype(dtype)
                )
                if want is not None:
                    assert_matches(lib.download(rb[r], dtype, nr), want, f"{kind} premulsum")
    # a user op is bound to its type
    p = w.alloc(0, 64)
    other = 8 if dt != 8 else 7
    assert lib.ncclAllReduce(p, p, 4, other, user_ops[0][0], w.comms[0], w.streams[0]) == 4
    assert "does not match" in lib.last_error()
    for r in range(2):
        for op in user_ops[r]:
            assert lib.ncclRedOpDestroy(op, w.comms[r]) == 0
    assert lib.ncclRedOpDestroy(user_ops[0][0], w.comms[0]) == INVALID_ARG
    assert lib.ncclRedOpDestroy(SUM, w.comms[0]) == INVALID_ARG
    assert "builtin" in lib.last_error()
    assert lib.ncclRedOpDestroy(-1, w.comms[0]) == INVALID_ARG


@pytest.mark.parametrize("kind", KINDS)
def test_in_place(lib: Lib, world: Any, path: str, kind: str) -> None:
    """NCCL's in-place layouts (nccl.h): the send buffer inside the receive buffer."""
    w, n, count, dt, root = world(3), 3, 41, 7, 2
    dtype, E = DTYPES[dt], 4
    ns, nr = sizes(kind, count, n)
    sends = [make_input(dtype, ns, r, seed=5) for r in range(n)]
    bufs = [w.alloc(r, max(ns, nr) * E) for r in range(n)]

    def offset(r: int) -> int:  # where the send buffer sits inside the receive buffer
        if kind == "AllGather" or (kind == "Gather" and r == root):
            return r * count * E
        return 0

    def send_ptr(r: int) -> int:
        if kind == "ReduceScatter" or (kind == "Scatter" and r == root):
            return bufs[r]
        return bufs[r] + offset(r)

    def recv_ptr(r: int) -> int:
        if kind == "ReduceScatter" or (kind == "Scatter" and r == root):
            return bufs[r] + r * count * E
        return bufs[r]

    for r in range(n):
        lib.upload(send_ptr(r), sends[r])
    codes = w.run(
        lambda r: call_collective(
            lib, kind, w.comms[r], w.streams[r], send_ptr(r), recv_ptr(r), count, dt, SUM, root
        )
    )
    assert not any(codes), lib.last_error()
    for r in range(n):
        want = expected(kind, sends, count, SUM, root, r)
        if want is not None:
            assert_matches(lib.download(recv_ptr(r), dtype, nr), want, f"{kind} in place {r}")


def test_large_counts_span_many_chunks(
    lib: Lib, world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_DIRECT", "0")
    monkeypatch.setenv("PYNCCL_LOOPBACK_CHUNK_BYTES", "4096")
    w = world(4)
    for kind in ("AllReduce", "ReduceScatter", "AlltoAll", "Broadcast"):
        run_kind(lib, w, kind, 8, SUM, 100_003, seed=3, root=3)


def test_config_variants(lib: Lib, world: Any) -> None:
    w = world(2)
    cfg = make_coll_config({"CTAPolicy": 1})
    for kind in (
        "AllReduce",
        "Broadcast",
        "Reduce",
        "AllGather",
        "ReduceScatter",
        "AlltoAll",
        "Gather",
        "Scatter",
    ):
        run_kind(lib, w, kind, 7, SUM, 19, seed=1, root=1, config=cfg)
    p = w.alloc(0, 64)
    bad = make_coll_config()
    bad.magic = 0
    assert lib.ncclAllReduceConfig(p, p, 4, 7, SUM, w.comms[0], w.streams[0], byref(bad)) == 4
    bad = make_coll_config({"forceAlgSelection": 2})
    assert lib.ncclAllReduceConfig(p, p, 4, 7, SUM, w.comms[0], w.streams[0], byref(bad)) == 4
    assert "forceAlgSelection" in lib.last_error()
    # NULL config = the plain call
    run_kind(lib, w, "AllReduce", 7, MAX, 5, seed=2, config=None)


def test_single_rank_and_empty_collectives(lib: Lib, world: Any) -> None:
    w = world(1)
    for kind in KINDS:
        run_kind(lib, w, kind, 4, PROD, 9, seed=1, root=0)
    run_kind(lib, w, "AllReduce", 6, AVG, 9, seed=1)
    # count 0 is dropped (even with no buffers at all), like NCCL
    assert lib.ncclAllReduce(None, None, 0, 7, SUM, w.comms[0], w.streams[0]) == SUCCESS


# ---- p2p and groups --------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_grouped_alltoall_of_sendrecv_with_self(lib: Lib, world: Any, path: str, n: int) -> None:
    w, count = world(n), 300  # 1200-byte messages through 256-byte rings (staged)
    sb = [w.alloc(r, n * count * 4) for r in range(n)]
    rb = [w.alloc(r, n * count * 4) for r in range(n)]
    data = [np.arange(n * count, dtype=np.float32) + 10000 * r for r in range(n)]
    for r in range(n):
        lib.upload(sb[r], data[r])

    def call(r: int) -> int:
        rc = 0
        for p in range(n):
            rc |= lib.ncclSend(sb[r] + p * count * 4, count, 7, p, w.comms[r], w.streams[r])
            rc |= lib.ncclRecv(rb[r] + p * count * 4, count, 7, p, w.comms[r], w.streams[r])
        return rc

    assert not any(w.run(call)), lib.last_error()
    for r in range(n):
        want = np.concatenate([data[p][r * count : (r + 1) * count] for p in range(n)])
        np.testing.assert_array_equal(lib.download(rb[r], np.float32, n * count), want)


def test_thread_ranks_initrank_and_sendrecv_both_sending_first(
    lib: Lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """InitRank from several threads blocks until all joined; in a group both ranks may
    send first (messages much larger than the ring) without deadlock."""
    monkeypatch.setenv("PYNCCL_LOOPBACK_RING_BYTES", "1024")
    n, count = 3, 50_000
    uid = lib.unique_id()

    def rank(r: int) -> tuple[np.ndarray, np.ndarray]:
        lib.set_device(r)
        comm = c_void_p()
        assert lib.ncclCommInitRank(byref(comm), n, uid, r) == 0, lib.last_error()
        s = lib.stream(r)
        sb, rb, ab = lib.malloc(count * 4, r), lib.malloc(count * 4, r), lib.malloc(count * 4, r)
        lib.upload(sb, np.full(count, r, dtype=np.float32) + np.arange(count, dtype=np.float32))
        assert lib.ncclGroupStart() == 0
        assert lib.ncclSend(sb, count, 7, (r + 1) % n, comm, s) == 0
        assert lib.ncclRecv(rb, count, 7, (r - 1) % n, comm, s) == 0
        assert lib.ncclGroupEnd() == 0
        assert lib.ncclAllReduce(sb, ab, count, 7, SUM, comm, s) == 0
        assert lib.sync(s) == 0
        got = lib.download(rb, np.float32, count), lib.download(ab, np.float32, count)
        assert lib.ncclCommDestroy(comm) == 0
        lib.destroy_stream(s)
        for p in (sb, rb, ab):
            lib.free(p)
        return got

    out = threads(n, rank)
    base = np.arange(count, dtype=np.float32)
    for r in range(n):
        np.testing.assert_array_equal(out[r][0], base + (r - 1) % n)
        np.testing.assert_array_equal(out[r][1], ref_reduce([base + q for q in range(n)]))


def test_initrank_inside_a_group_from_one_thread(lib: Lib) -> None:
    n, uid = 3, lib.unique_id()
    comms = [c_void_p() for _ in range(n)]
    assert lib.ncclGroupStart() == 0
    for r in range(n):
        lib.set_device(r)
        assert lib.ncclCommInitRank(byref(comms[r]), n, uid, r) == 0
    lib.set_device(0)
    assert lib.ncclGroupEnd() == 0, lib.last_error()
    assert [lib.user_rank(c.value) for c in comms] == [0, 1, 2]
    assert [lib.count(c.value) for c in comms] == [3, 3, 3]
    dev = c_int()
    assert lib.ncclCommCuDevice(comms[2].value, byref(dev)) == 0 and dev.value == 2
    for c in comms:
        assert lib.ncclCommDestroy(c.value) == 0


def test_groups_nest_and_report_errors(lib: Lib, world: Any) -> None:
    w = world(2)
    assert lib.ncclGroupEnd() == INVALID_USAGE
    assert "not in a group" in lib.last_error()
    p = [w.alloc(r, 64) for r in range(2)]
    for r in range(2):
        lib.upload(p[r], np.full(4, r + 1, np.float32))
    # nested: only the outermost end launches
    assert lib.ncclGroupStart() == 0 and lib.ncclGroupStart() == 0
    for r in range(2):
        assert lib.ncclAllReduce(p[r], p[r], 4, 7, SUM, w.comms[r], w.streams[r]) == 0
    assert lib.ncclGroupEnd() == 0
    assert lib.ncclGroupEnd() == 0
    for r in range(2):
        assert lib.sync(w.streams[r]) == 0
        np.testing.assert_array_equal(lib.download(p[r], np.float32, 4), np.full(4, 3.0))
    # an error inside a group fails the group and launches nothing
    assert lib.ncclGroupStart() == 0
    assert lib.ncclAllReduce(p[0], p[0], 4, 7, SUM, w.comms[0], w.streams[0]) == 0
    assert lib.ncclAllReduce(p[1], p[1], 4, 99, SUM, w.comms[1], w.streams[1]) == INVALID_ARG
    assert lib.ncclGroupEnd() == INVALID_ARG
    assert lib.ncclGroupEnd() == INVALID_USAGE
    # sending to self needs the matching receive in the same group
    assert lib.ncclSend(p[0], 4, 7, 0, w.comms[0], w.streams[0]) == INVALID_USAGE
    assert "self" in lib.last_error()


def test_one_communicator_on_two_streams_in_a_group(lib: Lib, world: Any) -> None:
    """NCCL joins the streams of one communicator's ops in a group (events here)."""
    w = world(2)
    extra = [lib.stream(r) for r in range(2)]
    a = [w.alloc(r, 64) for r in range(2)]
    g = [w.alloc(r, 128) for r in range(2)]
    for r in range(2):
        lib.upload(a[r], np.full(4, r + 1.0, np.float32))
    assert lib.ncclGroupStart() == 0
    for r in range(2):
        assert lib.ncclAllReduce(a[r], a[r], 4, 7, SUM, w.comms[r], w.streams[r]) == 0
        assert lib.ncclAllGather(a[r], g[r], 4, 7, w.comms[r], extra[r]) == 0
    assert lib.ncclGroupEnd() == 0, lib.last_error()
    for r in range(2):
        assert lib.sync(extra[r]) == 0 and lib.sync(w.streams[r]) == 0
        np.testing.assert_array_equal(lib.download(g[r], np.float32, 8), np.full(8, 3.0))
        lib.destroy_stream(extra[r])


def test_group_simulate_end(lib: Lib, world: Any) -> None:
    w = world(2)
    p = [w.alloc(r, 64) for r in range(2)]
    for r in range(2):
        lib.upload(p[r], np.full(4, 5.0, np.float32))
    sim = make_sim_info()
    assert lib.ncclGroupStart() == 0
    for r in range(2):
        assert lib.ncclAllReduce(p[r], p[r], 4, 7, SUM, w.comms[r], w.streams[r]) == 0
    assert lib.ncclGroupSimulateEnd(byref(sim)) == 0
    assert sim.estimatedTime > 0
    for r in range(2):  # simulated, not run
        assert lib.sync(w.streams[r]) == 0
        np.testing.assert_array_equal(lib.download(p[r], np.float32, 4), np.full(4, 5.0))
    bad = make_sim_info()
    bad.magic = 1
    assert lib.ncclGroupStart() == 0
    assert lib.ncclGroupSimulateEnd(byref(bad)) == INVALID_ARG
    assert "NCCL_SIM_INFO_INITIALIZER" in lib.last_error()
    assert lib.ncclGroupStart() == 0 and lib.ncclGroupStart() == 0
    assert lib.ncclGroupSimulateEnd(byref(bad)) == 0  # nested: ignored
    assert lib.ncclGroupEnd() == 0


# ---- init variants ---------------------------------------------------------------------


def test_nonblocking_init_becomes_ready_as_it_is_polled(
    lib: Lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", "3")
    n, uid = 2, lib.unique_id()
    comms = [c_void_p() for _ in range(n)]
    cfg = make_config({"blocking": 0})
    for r in range(n):
        lib.set_device(r)
        assert lib.ncclCommInitRankConfig(byref(comms[r]), n, uid, r, byref(cfg)) == IN_PROGRESS
        assert comms[r].value  # set at once, like NCCL
    lib.set_device(0)
    p = lib.malloc(16, 0)
    s = lib.stream(0)
    assert lib.ncclAllReduce(p, p, 4, 7, SUM, comms[0].value, s) == INVALID_ARG
    assert "before the previous operation" in lib.last_error()
    polls = [0] * n
    for r in range(n):
        while lib.async_error(comms[r].value) == IN_PROGRESS:
            polls[r] += 1
            assert polls[r] < 1000
    assert min(polls) >= 3
    assert lib.ncclAllReduce(p, p, 0, 7, SUM, comms[0].value, s) == 0
    for c in comms:
        assert lib.ncclCommDestroy(c.value) == 0
    lib.free(p)
    lib.destroy_stream(s)


def test_init_rank_scalable_and_init_all_devlist(lib: Lib) -> None:
    n = 2
    ids = (ncclUniqueId * 2)(lib.unique_id(), lib.unique_id())
    comms = [c_void_p() for _ in range(n)]
    assert lib.ncclGroupStart() == 0
    for r in range(n):
        lib.set_device(r)
        assert lib.ncclCommInitRankScalable(byref(comms[r]), n, r, 2, ids, None) == 0
    lib.set_device(0)
    assert lib.ncclGroupEnd() == 0, lib.last_error()
    for c in comms:
        assert lib.ncclCommDestroy(c.value) == 0
    out = (c_void_p * 2)()
    devs = (c_int * 2)(5, 3)
    assert lib.ncclCommInitAll(out, 2, devs) == 0
    got = []
    for c in out:
        d = c_int()
        assert lib.ncclCommCuDevice(c, byref(d)) == 0
        got.append(d.value)
        assert lib.ncclCommDestroy(c) == 0
    assert got == [5, 3]


def test_split(lib: Lib, world: Any) -> None:
    """Colors group ranks, keys order them (descending here), NOCOLOR gets NULL."""
    w = world(4)
    kids = [c_void_p() for _ in range(4)]
    colors = [0, 1, 0, -1]
    assert lib.ncclGroupStart() == 0
    for r in range(4):
        assert lib.ncclCommSplit(w.comms[r], colors[r], -r, byref(kids[r]), None) == 0
    assert lib.ncclGroupEnd() == 0, lib.last_error()
    assert kids[3].value is None
    assert lib.count(kids[0].value) == 2 and lib.count(kids[1].value) == 1
    assert lib.user_rank(kids[0].value) == 1 and lib.user_rank(kids[2].value) == 0
    bufs = [w.alloc(r, 16) for r in range(3)]
    for r in range(3):
        lib.upload(bufs[r], np.full(4, r + 1, np.float32))
    assert lib.ncclGroupStart() == 0
    for r in range(3):
        assert lib.ncclAllReduce(bufs[r], bufs[r], 4, 7, SUM, kids[r].value, w.streams[r]) == 0
    assert lib.ncclGroupEnd() == 0
    for r in range(3):
        assert lib.sync(w.streams[r]) == 0
    for r, want in ((0, 4.0), (1, 2.0), (2, 4.0)):
        np.testing.assert_array_equal(lib.download(bufs[r], np.float32, 4), np.full(4, want))
    for k in kids[:3]:
        assert lib.ncclCommDestroy(k.value) == 0
    assert lib.ncclCommSplit(w.comms[0], -5, 0, byref(kids[0]), None) == INVALID_ARG


def test_nonblocking_split_completes_as_the_parent_is_polled(lib: Lib) -> None:
    n, uid = 2, lib.unique_id()
    cfg = make_config({"blocking": 0})
    parents = [c_void_p() for _ in range(n)]
    for r in range(n):
        lib.set_device(r)
        assert lib.ncclCommInitRankConfig(byref(parents[r]), n, uid, r, byref(cfg)) == IN_PROGRESS
    lib.set_device(0)
    for p in parents:
        while lib.async_error(p.value) == IN_PROGRESS:
            pass
    kids = [c_void_p() for _ in range(n)]
    for r in range(n):
        assert lib.ncclCommSplit(parents[r].value, 0, r, byref(kids[r]), None) == IN_PROGRESS
    for p in parents:
        while lib.async_error(p.value) == IN_PROGRESS:
            pass
        assert lib.async_error(p.value) == SUCCESS, lib.last_error()
    assert [lib.user_rank(k.value) for k in kids] == [0, 1]
    for c in (*kids, *parents):
        assert lib.ncclCommDestroy(c.value) == 0


# ---- errors ----------------------------------------------------------------------------


def test_argument_errors(lib: Lib, world: Any) -> None:
    w = world(3)
    c, s = w.comms[0], w.streams[0]
    p = w.alloc(0, 64)
    cases = [
        (lambda: lib.ncclAllReduce(p, p, 4, 7, SUM, None, s), "comm argument is NULL"),
        (lambda: lib.ncclAllReduce(p, p, 4, 12, SUM, c, s), "invalid type 12"),
        (lambda: lib.ncclAllReduce(p, p, 4, -1, SUM, c, s), "invalid type -1"),
        (lambda: lib.ncclAllReduce(p, p, 4, 7, 5, c, s), "unknown to this communicator"),
        (lambda: lib.ncclAllReduce(p, p, 4, 7, -3, c, s), "invalid reduction operation"),
        (lambda: lib.ncclBroadcast(p, p, 4, 7, 3, c, s), "invalid root 3"),
        (lambda: lib.ncclReduce(p, p, 4, 7, SUM, -1, c, s), "invalid root -1"),
        (lambda: lib.ncclSend(p, 4, 7, 3, c, s), "invalid peer 3"),
        (lambda: lib.ncclRecv(p, 4, 7, -1, c, s), "invalid peer -1"),
        (lambda: lib.ncclAllReduce(p, p, 17, 7, SUM, c, s), "does not lie inside"),
        (lambda: lib.ncclAllGather(p, p, 8, 7, c, s), "recvbuff"),
        (lambda: lib.ncclAllReduce(p, None, 4, 7, SUM, c, s), "recvbuff argument is NULL"),
        (lambda: lib.ncclAllReduce(p, p, 1 << 62, 7, SUM, c, s), "overflows"),
        (lambda: lib.ncclAllReduce(p + 64, p, 1, 7, SUM, c, s), "does not lie inside"),
    ]
    host = np.zeros(4, np.float32)
    cases.append(
        (
            lambda: lib.ncclAllReduce(host.ctypes.data, p, 4, 7, SUM, c, s),
            "does not lie inside a loopback device allocation",
        )
    )
    other = w.alloc(1, 64)  # on device 1
    cases.append((lambda: lib.ncclAllReduce(other, p, 4, 7, SUM, c, s), "device 1"))
    for call, text in cases:
        assert call() == INVALID_ARG, text
        assert text in lib.last_error(), (text, lib.last_error())
    assert lib.ncclAllReduce(p, p, 4, 7, SUM, c, 0x1234) == 1  # not a stream
    assert "stream" in lib.last_error()
    assert lib.ncclAllReduce(p, p, 4, 7, SUM, c, w.streams[1]) == INVALID_ARG
    assert "belongs to device 1" in lib.last_error()


def test_off_root_buffers_may_be_null(lib: Lib, world: Any, path: str) -> None:
    """Broadcast's sendbuff and Reduce/Gather's recvbuff matter on the root only."""
    w = world(3)
    b = [w.alloc(r, 64) for r in range(3)]
    lib.upload(b[0], np.arange(8, dtype=np.float32))
    assert not any(
        w.run(
            lambda r: lib.ncclBroadcast(
                b[r] if r == 0 else None, b[r], 8, 7, 0, w.comms[r], w.streams[r]
            )
        )
    )
    for r in range(3):
        np.testing.assert_array_equal(lib.download(b[r], np.float32, 8), np.arange(8))
    assert not any(
        w.run(
            lambda r: lib.ncclReduce(
                b[r], b[r] if r == 1 else None, 8, 7, SUM, 1, w.comms[r], w.streams[r]
            )
        )
    )
    np.testing.assert_array_equal(lib.download(b[1], np.float32, 8), 3 * np.arange(8))


def test_init_and_lifetime_errors(lib: Lib, world: Any) -> None:
    uid = lib.unique_id()
    comm = c_void_p()
    assert lib.ncclCommInitRank(byref(comm), 0, uid, 0) == INVALID_ARG
    assert lib.ncclCommInitRank(byref(comm), 2, uid, 2) == INVALID_ARG
    assert "Invalid rank requested" in lib.last_error()
    assert lib.ncclCommInitRank(byref(comm), 2, ncclUniqueId(), 0) == INVALID_ARG
    assert lib.ncclCommInitRank(None, 2, uid, 0) == INVALID_ARG
    assert lib.ncclCommInitAll(None, 2, None) == INVALID_ARG
    out = (c_void_p * 2)()
    assert lib.ncclCommInitAll(out, 2, (c_int * 2)(1, 1)) == INVALID_USAGE
    assert lib.ncclCommInitAll(out, 2, (c_int * 2)(0, 99)) == INVALID_ARG
    assert lib.ncclCommInitAll(out, 0, None) == INVALID_ARG
    # NULL comms: NCCL returns success for teardown, InvalidArgument for queries
    assert lib.ncclCommDestroy(None) == 0 and lib.ncclCommAbort(None) == 0
    assert lib.ncclCommFinalize(None) == 0
    r = c_int()
    assert lib.ncclCommCount(None, byref(r)) == INVALID_ARG
    assert lib.ncclCommGetAsyncError(None, byref(r)) == INVALID_ARG
    w = world(2)
    assert lib.ncclCommCount(w.comms[0], None) == INVALID_ARG
    assert lib.ncclCommFinalize(w.comms[0]) == 0
    assert lib.ncclCommFinalize(w.comms[0]) == INVALID_ARG
    p = w.alloc(0, 16)
    assert lib.ncclAllReduce(p, p, 4, 7, SUM, w.comms[0], w.streams[0]) == INVALID_USAGE
    dead = w.comms[1]
    assert lib.ncclCommDestroy(dead) == 0
    w.comms[1] = 0
    assert lib.ncclAllReduce(p, p, 4, 7, SUM, dead, w.streams[0]) == INVALID_ARG
    assert "invalid communicator" in lib.last_error()
    assert lib.ncclCommDestroy(dead) == INVALID_ARG


def test_duplicate_device_in_one_process(lib: Lib, monkeypatch: pytest.MonkeyPatch) -> None:
    n, uid = 2, lib.unique_id()

    def rank(r: int) -> int:
        lib.set_device(0)  # both ranks on device 0: NCCL's "Duplicate GPU detected"
        comm = c_void_p()
        rc = lib.ncclCommInitRank(byref(comm), n, uid, r)
        assert comm.value is None
        return int(rc)

    assert threads(n, rank) == [INVALID_USAGE, INVALID_USAGE]
    assert "Duplicate GPU" in lib.last_error()
    monkeypatch.setenv("PYNCCL_LOOPBACK_STRICT", "0")  # allowed when not strict
    uid = lib.unique_id()

    def rank2(r: int) -> int:
        lib.set_device(0)
        comm = c_void_p()
        rc = lib.ncclCommInitRank(byref(comm), n, uid, r)
        assert lib.ncclCommDestroy(comm) == 0
        return int(rc)

    assert threads(n, rank2) == [0, 0]


def test_not_strict_accepts_host_memory(lib: Lib, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_STRICT", "0")
    w = GroupWorld(lib, 2)
    try:
        a = [np.full(8, r + 1.0) for r in range(2)]
        codes = w.run(
            lambda r: lib.ncclAllReduce(
                a[r].ctypes.data, a[r].ctypes.data, 8, 8, SUM, w.comms[r], w.streams[r]
            )
        )
        assert not any(codes), lib.last_error()
        for r in range(2):
            np.testing.assert_array_equal(a[r], np.full(8, 3.0))
    finally:
        w.close()


def test_blocking_and_nonblocking_in_one_group(lib: Lib, world: Any) -> None:
    w = world(2)
    uid = lib.unique_id()
    nb = c_void_p()
    cfg = make_config({"blocking": 0})
    assert lib.ncclCommInitRankConfig(byref(nb), 1, uid, 0, byref(cfg)) == IN_PROGRESS
    while lib.async_error(nb.value) == IN_PROGRESS:
        pass
    p = w.alloc(0, 16)
    assert lib.ncclGroupStart() == 0
    assert lib.ncclAllReduce(p, p, 4, 7, SUM, w.comms[0], w.streams[0]) == 0
    assert lib.ncclAllReduce(p, p, 4, 7, SUM, nb.value, w.streams[0]) == INVALID_ARG
    assert "nonblocking" in lib.last_error()
    assert lib.ncclGroupEnd() == INVALID_ARG
    assert lib.ncclCommDestroy(nb.value) == 0


def test_memory_and_registration(lib: Lib, world: Any) -> None:
    w = world(1)
    p = c_void_p()
    assert lib.ncclMemAlloc(byref(p), 4096) == 0 and p.value
    assert lib.ncclMemAlloc(None, 16) == INVALID_ARG
    assert lib.ncclMemAlloc(byref(c_void_p()), 0) == INVALID_ARG
    h = c_void_p()
    assert lib.ncclCommRegister(w.comms[0], p, 4096, byref(h)) == 0
    assert lib.ncclCommDeregister(w.comms[0], h) == 0
    assert lib.ncclCommDeregister(w.comms[0], h) == INVALID_ARG
    host = np.zeros(16)
    assert lib.ncclCommRegister(w.comms[0], host.ctypes.data, 128, byref(h)) == INVALID_ARG
    # a registration still held is released with its communicator (no leak under ASan)
    assert lib.ncclCommRegister(w.comms[0], p, 64, byref(h)) == 0
    # collectives work on ncclMemAlloc memory
    lib.upload(p.value, np.arange(4, dtype=np.float32))
    assert lib.ncclAllReduce(p, p, 4, 7, SUM, w.comms[0], w.streams[0]) == 0
    assert lib.sync(w.streams[0]) == 0
    np.testing.assert_array_equal(lib.download(p.value, np.float32, 4), np.arange(4))
    assert lib.ncclMemFree(None) == 0
    assert lib.ncclMemFree(p) == 0


# ---- failures of others ----------------------------------------------------------------


def test_mismatched_collectives_fail_with_both_sides_named(lib: Lib, world: Any) -> None:
    for a, b in (
        (("AllReduce", 10, SUM, 0), ("AllReduce", 12, SUM, 0)),
        (("Broadcast", 8, SUM, 0), ("Broadcast", 8, SUM, 1)),
        (("AllReduce", 8, SUM, 0), ("AllReduce", 8, MAX, 0)),
        (("AllReduce", 8, SUM, 0), ("AllGather", 8, SUM, 0)),
    ):
        w = world(2)
        p = [w.alloc(r, 256) for r in range(2)]
        kinds, counts, ops, roots = zip(a, b)
        codes = launch(lib, w, kinds, p, p, counts, 7, ops, roots)
        assert codes == [0, 0]
        assert [lib.async_error(c) for c in w.comms] == [INVALID_USAGE, INVALID_USAGE]
        msg = lib.last_error()
        assert "mismatch" in msg and "rank 0 called" in msg and "rank 1 called" in msg, msg
        assert lib.ncclAllReduce(p[0], p[0], 1, 7, SUM, w.comms[0], w.streams[0]) == INVALID_USAGE


def test_sendrecv_size_mismatch(lib: Lib, world: Any) -> None:
    w = world(2)
    p = [w.alloc(r, 256) for r in range(2)]
    assert lib.ncclGroupStart() == 0
    assert lib.ncclSend(p[0], 8, 7, 1, w.comms[0], w.streams[0]) == 0
    assert lib.ncclRecv(p[1], 9, 7, 0, w.comms[1], w.streams[1]) == 0
    assert lib.ncclGroupEnd() == 0
    for r in range(2):
        assert lib.sync(w.streams[r]) == 0
    assert lib.async_error(w.comms[1]) == INVALID_USAGE
    assert "mismatch" in lib.last_error()


def test_abort_from_another_thread_releases_a_blocked_stream(lib: Lib, world: Any) -> None:
    w = world(2)
    p = w.alloc(0, 64)
    # rank 1 never joins this collective: rank 0's stream task blocks
    assert lib.ncclAllReduce(p, p, 4, 7, SUM, w.comms[0], w.streams[0]) == 0
    aborter = threading.Thread(target=lambda: lib.ncclCommAbort(w.comms[0]))
    aborter.start()
    assert lib.sync(w.streams[0]) == 0
    aborter.join(timeout=30)
    assert not aborter.is_alive()
    w.comms[0] = 0
    assert lib.async_error(w.comms[1]) == REMOTE
    assert "ncclCommAbort" in lib.last_error()


def test_fault_injection(lib: Lib, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_LOOPBACK_FAIL_INIT", "2")
    out = (c_void_p * 2)()
    assert lib.ncclCommInitAll(out, 2, None) == 2
    comm = c_void_p()
    assert lib.ncclCommInitRank(byref(comm), 1, lib.unique_id(), 0) == 2
    assert "PYNCCL_LOOPBACK_FAIL_INIT" in lib.last_error()
    monkeypatch.delenv("PYNCCL_LOOPBACK_FAIL_INIT")

    monkeypatch.setenv("PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER", "2:3")
    w = GroupWorld(lib, 2)
    try:
        p = [w.alloc(r, 16) for r in range(2)]
        for i in range(3):
            codes = w.run(
                lambda r: lib.ncclAllReduce(p[r], p[r], 4, 7, SUM, w.comms[r], w.streams[r])
            )
            assert codes == [0, 0]
            want = SUCCESS if i < 2 else 3
            assert [lib.async_error(c) for c in w.comms] == [want, want]
        assert "PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER" in lib.last_error()
    finally:
        w.close()
    monkeypatch.delenv("PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER")

    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "2")
    w = GroupWorld(lib, 2)
    try:
        p = [w.alloc(r, 16) for r in range(2)]
        w.run(lambda r: lib.ncclAllReduce(p[r], p[r], 4, 7, SUM, w.comms[r], w.streams[r]))
        assert lib.ncclAllReduce(p[0], p[0], 4, 7, SUM, w.comms[0], w.streams[0]) == 0
        assert lib.ncclAllReduce(p[1], p[1], 4, 7, SUM, w.comms[1], w.streams[1]) == 0
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (lib.sync(w.streams[0]), done.set()))
        waiter.start()
        assert not done.wait(0.3)  # the second operation hangs until ...
        assert lib.ncclCommAbort(w.comms[0]) == 0  # ... the abort
        w.comms[0] = 0
        waiter.join(timeout=30)
        assert done.is_set()
        assert lib.sync(w.streams[1]) == 0
        assert lib.async_error(w.comms[1]) == REMOTE
    finally:
        w.close()


# ---- processes -------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", ["default", pytest.param("4096", marks=pytest.mark.slow)])
def test_process_ranks(lib: Lib, build: Any, chunk: str) -> None:
    """Ranks in separate processes (staged through shared memory), every collective."""
    uid = lib.unique_id()
    env = {"PYNCCL_LOOPBACK_RING_BYTES": "4096"}
    if chunk != "default":
        env["PYNCCL_LOOPBACK_CHUNK_BYTES"] = chunk
    procs = spawn(build, "colls", uid, 3, env=env)
    for p in procs:
        ev = events(p)
        fails = [e for e in ev if e["event"] == "fail"]
        assert fails == [] and ev[-1] == {"event": "exit", "ok": True}, ev
    assert not os.path.exists(shm_name(uid))


@pytest.mark.slow
def test_killed_peer_stops_the_others(lib: Lib, build: Any) -> None:
    """kill -9 one process: the others' pending collective ends with ncclRemoteError."""
    import json

    uid, n, victim = lib.unique_id(), 3, 2
    procs = spawn(build, "die", uid, n, str(victim))
    for p in procs:  # every rank finished one collective together
        line = p.stdout.readline() if p.stdout else ""
        assert json.loads(line) == {"event": "ready", "rc": 0}, line
    os.kill(procs[victim].pid, signal.SIGKILL)
    procs[victim].wait(timeout=30)
    for r in range(n):
        if r == victim:
            continue
        ev = events(procs[r], timeout=60)
        done = next(e for e in ev if e["event"] == "done")
        assert done["async_error"] == REMOTE, done
        assert done["seconds"] < 5  # the documented bound (detection takes about 0.1 s)
        assert "exited" in done["error"], done
    assert not os.path.exists(shm_name(uid))


def rendezvous_name(uid: ncclUniqueId) -> str:
    """The abstract unix socket a world's creator listens on until every rank joined."""
    raw = bytes(uid)
    return "@pynccl-lb-" + raw[0:8].hex() + raw[64:80].hex()


def rendezvous_open(uid: ncclUniqueId) -> bool:
    with open("/proc/net/unix") as f:
        return any(line.split()[-1] == rendezvous_name(uid) for line in f.readlines()[1:])


def test_a_process_killed_during_init_leaves_nothing(lib: Lib, build: Any) -> None:
    import json

    uid = lib.unique_id()
    (orphan,) = spawn(build, "orphan", uid, 2, ranks=[0])
    assert orphan.stdout is not None
    assert json.loads(orphan.stdout.readline())["event"] == "joining"
    for _ in range(2000):
        if rendezvous_open(uid):
            break
        time.sleep(0.005)
    assert rendezvous_open(uid)  # the creator waits for rank 1
    assert not os.path.exists(shm_name(uid))  # the segment has no name
    orphan.kill()
    orphan.wait(timeout=30)
    assert not rendezvous_open(uid)  # the kernel dropped the name with the process


@pytest.mark.slow
def test_256mib_allreduce_across_4_processes(lib: Lib, build: Any) -> None:
    uid = lib.unique_id()
    procs = spawn(build, "big", uid, 4, str(64 << 20))
    for p in procs:
        ev = events(p, timeout=600)
        big = next(e for e in ev if e["event"] == "big")
        assert big["ok"], big
    assert not os.path.exists(shm_name(uid))


# ---- the null build and leaks ----------------------------------------------------------


def test_null_build_checks_arguments_and_moves_nothing() -> None:
    b = _build(null=True)
    lib = Lib(b.nccl, b.cudart)
    w = GroupWorld(lib, 2)
    try:
        p = [w.alloc(r, 16) for r in range(2)]
        for r in range(2):
            lib.upload(p[r], np.full(4, r + 1, np.float32))
        assert not any(
            w.run(lambda r: lib.ncclAllReduce(p[r], p[r], 4, 7, SUM, w.comms[r], w.streams[r]))
        )
        for r in range(2):
            np.testing.assert_array_equal(lib.download(p[r], np.float32, 4), np.full(4, r + 1.0))
        assert lib.ncclAllReduce(p[0], p[0], 4, 12, SUM, w.comms[0], w.streams[0]) == INVALID_ARG
        assert lib.ncclSend(p[0], 4, 7, 5, w.comms[0], w.streams[0]) == INVALID_ARG
    finally:
        w.close()


def test_nothing_left_behind(lib: Lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """A world's rendezvous is gone once everyone joined; the libnccl starts no threads
    (but NCCL's RAS listener, off here: tests/test_ras.py counts that one)."""
    monkeypatch.setenv("NCCL_RAS_ENABLE", "0")

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    lib.set_device(0)
    s0 = lib.stream(0)  # let the cudart start what it keeps
    lib.destroy_stream(s0)
    before_threads = threads()
    uid = lib.unique_id()
    comms = [c_void_p() for _ in range(2)]
    assert lib.ncclGroupStart() == 0
    for r in range(2):
        lib.set_device(r)
        assert lib.ncclCommInitRank(byref(comms[r]), 2, uid, r) == 0
        # the creator listens until it sees everyone joined; no file is ever made
        assert rendezvous_open(uid)
        assert not os.path.exists(shm_name(uid))
    lib.set_device(0)
    assert lib.ncclGroupEnd() == 0
    assert not rendezvous_open(uid)
    assert threads() == before_threads
    for c in comms:
        assert lib.ncclCommDestroy(c.value) == 0
    assert not rendezvous_open(uid)
