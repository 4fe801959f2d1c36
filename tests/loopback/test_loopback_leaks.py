"""What the loopback libnccl leaves behind: heap leaks, mappings, /dev/shm entries.

* LeakSanitizer cannot watch the loopback inside CPython (the interpreter "leaks" at
  exit, and every loopback allocation made through ctypes has interpreter frames on
  its stack, so suppressing CPython would hide the loopback's leaks too). A small C
  driver linked against the sanitized build exercises every family of the API and
  exits with LeakSanitizer on: any leak fails it. The same driver built with one
  deliberate leak shows that the check can fail.
* Mappings of the process (/proc/self/maps) do not grow over init/destroy and split
  cycles.
* A rank SIGKILLed at any point of init leaves no /dev/shm entry and no rendezvous.
* Two ranks of one communicator on one device in different processes are refused with
  NCCL's "Duplicate GPU detected".
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time
from ctypes import byref, c_void_p
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.clib import INVALID_USAGE, REMOTE, Lib
from test_loopback_nccl import events, rendezvous_open, spawn

LOOPBACK_DIR = ROOT / "pynccl" / "testing" / "loopback"

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "lb_nccl.h"

#define N 3
#define CHECK(x) do { int r_ = (int)(x); if (r_) { \
    fprintf(stderr, "%s:%d %s = %d: %s\n", __FILE__, __LINE__, #x, r_, ncclGetLastError(NULL)); \
    exit(2); } } while (0)

static void allreduce(ncclComm_t *comms, int n, const int *devs) {
    void *buf[N];
    cudaStream_t s[N];
    for (int r = 0; r < n; r++) {
        CHECK(cudaSetDevice(devs[r]));
        CHECK(cudaMalloc(&buf[r], 4096));
        CHECK(cudaStreamCreate(&s[r]));
    }
    CHECK(ncclGroupStart());
    for (int r = 0; r < n; r++)
        CHECK(ncclAllReduce(buf[r], buf[r], 1024, ncclFloat32, ncclSum, comms[r], s[r]));
    CHECK(ncclGroupEnd());
    for (int r = 0; r < n; r++) {
        CHECK(cudaStreamSynchronize(s[r]));
        CHECK(cudaStreamDestroy(s[r]));
        CHECK(cudaFree(buf[r]));
    }
    CHECK(cudaSetDevice(0));
}

int main(void) {
    const int devs[N] = {0, 1, 2};
    for (int round = 0; round < 5; round++) {
        ncclComm_t comms[N], kids[N], shrunk[N];
        CHECK(ncclCommInitAll(comms, N, NULL));
        allreduce(comms, N, devs);
        CHECK(ncclGroupStart()); /* split: two children of one and two ranks */
        for (int r = 0; r < N; r++) CHECK(ncclCommSplit(comms[r], r == 0, 0, &kids[r], NULL));
        CHECK(ncclGroupEnd());
        for (int r = 0; r < N; r++) CHECK(ncclCommDestroy(kids[r]));
        CHECK(ncclGroupStart()); /* NOCOLOR */
        for (int r = 0; r < N; r++)
            CHECK(ncclCommSplit(comms[r], r ? 0 : NCCL_SPLIT_NOCOLOR, 0, &kids[r], NULL));
        CHECK(ncclGroupEnd());
        for (int r = 1; r < N; r++) CHECK(ncclCommDestroy(kids[r]));
        int excl[1] = {1};
        CHECK(ncclGroupStart());
        CHECK(ncclCommShrink(comms[0], excl, 1, &shrunk[0], NULL, 0));
        CHECK(ncclCommShrink(comms[2], excl, 1, &shrunk[1], NULL, 0));
        CHECK(ncclGroupEnd());
        const int sdevs[2] = {0, 2};
        allreduce(shrunk, 2, sdevs);
        for (int r = 0; r < 2; r++) CHECK(ncclCommDestroy(shrunk[r]));
        for (int r = 0; r < N; r++) CHECK(ncclCommSuspend(comms[r], 1 /* NCCL_SUSPEND_MEM */));
        uint64_t v;
        CHECK(ncclCommMemStats(comms[0], ncclStatGpuMemTotal, &v));
        for (int r = 0; r < N; r++) CHECK(ncclCommResume(comms[r]));
        ncclRedOp_t op;
        float scalar = 2.0f;
        CHECK(ncclRedOpCreatePreMulSum(&op, &scalar, ncclFloat32, ncclScalarHostImmediate,
                                       comms[0]));
        CHECK(ncclRedOpDestroy(op, comms[0]));
        void *mem, *handle;
        CHECK(ncclMemAlloc(&mem, 1 << 16));
        CHECK(ncclCommRegister(comms[0], mem, 1 << 16, &handle));
        CHECK(ncclCommDeregister(comms[0], handle));
        CHECK(ncclMemFree(mem));
        ncclUniqueId gid;
        CHECK(ncclCommGetUniqueId(comms[0], &gid));
        for (int r = 0; r < N; r++) CHECK(r ? ncclCommRevoke(comms[r], 0) : 0);
        CHECK(ncclCommAbort(comms[0]));
        for (int r = 1; r < N; r++) CHECK(ncclCommDestroy(comms[r]));
        /* one rank on its own, by unique id; a failed init */
        ncclUniqueId uid;
        ncclComm_t one, bad;
        CHECK(ncclGetUniqueId(&uid));
        CHECK(ncclCommInitRank(&one, 1, uid, 0));
        allreduce(&one, 1, devs);
        CHECK(ncclCommDestroy(one));
        if (ncclCommInitRank(&bad, 2, uid, 5) == ncclSuccess) return 3;
    }
#ifdef LEAK_ON_PURPOSE
    void *volatile lost = malloc(77);
    lost = NULL;
    (void)lost;
#endif
    puts("driver done");
    return 0;
}
"""


def _sanitized_build() -> Any:
    from pynccl.testing import loopback

    try:
        return loopback.build(sanitize=True)
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"no sanitized loopback build: {exc}")


def _driver(tmp_path: Path, b: Any, *defines: str) -> Path:
    src = tmp_path / "driver.c"
    src.write_text(DRIVER)
    exe = tmp_path / ("driver" + "".join(d.lower() for d in defines))
    cudart_dir = os.path.dirname(b.cudart)
    nccl_dir = os.path.dirname(b.nccl)
    cmd = [
        "gcc", "-g", "-std=gnu11", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
        *(f"-D{d}" for d in defines), f"-I{LOOPBACK_DIR}", f"-I{LOOPBACK_DIR / 'include'}",
        str(src), "-o", str(exe), b.nccl,
        f"-L{cudart_dir}", "-lpynccl_loopback_cudart",
        f"-Wl,-rpath,{nccl_dir}", f"-Wl,-rpath,{cudart_dir}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def _run_driver(exe: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS")}
    env["ASAN_OPTIONS"] = "detect_leaks=1:allocator_may_return_null=1"
    env["PYNCCL_LOOPBACK_DEVICES"] = "8"
    return subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
def test_no_leak_under_leak_sanitizer(tmp_path: Path) -> None:
    b = _sanitized_build()
    proc = _run_driver(_driver(tmp_path, b))
    assert proc.returncode == 0 and "driver done" in proc.stdout, proc.stderr[-4000:]
    assert "LeakSanitizer" not in proc.stderr, proc.stderr[-4000:]


def test_the_leak_check_sees_a_leak(tmp_path: Path) -> None:
    b = _sanitized_build()
    proc = _run_driver(_driver(tmp_path, b, "LEAK_ON_PURPOSE"))
    assert proc.returncode != 0 and "detected memory leaks" in proc.stderr, proc.stderr[-4000:]
    assert "77 byte(s) leaked" in proc.stderr


# ---- mappings ----------------------------------------------------------------------------


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return len(f.readlines())


def test_init_destroy_and_split_cycles_do_not_grow_the_mappings(lib: Lib) -> None:
    def cycle() -> None:
        comms = (c_void_p * 2)()
        assert lib.ncclCommInitAll(comms, 1, None) == 0
        kid = c_void_p()
        assert lib.ncclCommSplit(comms[0], 0, 0, byref(kid), None) == 0  # a 1-rank split
        assert lib.ncclCommDestroy(kid.value) == 0
        assert lib.ncclCommDestroy(comms[0]) == 0
        assert lib.ncclCommInitAll(comms, 2, None) == 0
        kids = [c_void_p(), c_void_p()]
        assert lib.ncclGroupStart() == 0
        for r in range(2):  # two 1-rank children
            assert lib.ncclCommSplit(comms[r], r, 0, byref(kids[r]), None) == 0
        assert lib.ncclGroupEnd() == 0
        for c in [k.value for k in kids] + list(comms):
            assert lib.ncclCommDestroy(c) == 0

    for _ in range(5):  # warm up the allocator and the cudart
        cycle()
    before = _maps()
    for _ in range(100):
        cycle()
    assert _maps() - before <= 2  # unrelated noise at most, not one per cycle


# ---- killed during init --------------------------------------------------------------------


def _shm_entries() -> set[str]:
    return set(glob.glob("/dev/shm/pynccl-lb-*"))


@pytest.mark.parametrize(
    "point",
    # one kill in the quick run; the multi-process ones with the slow tests
    [
        "creator_alone",
        pytest.param("joined_rank", marks=pytest.mark.slow),
        pytest.param("creator_with_others", marks=pytest.mark.slow),
    ],
)
def test_no_shm_entry_after_a_rank_is_killed_during_init(lib: Lib, build: Any, point: str) -> None:
    """Ranks of a 3-rank job start init one by one; one is SIGKILLed at some point."""
    before = _shm_entries()
    uid = lib.unique_id()
    started = 1 if point == "creator_alone" else 2
    env = {"PYNCCL_LOOPBACK_INIT_TIMEOUT": "30"}
    procs = []
    for r in range(started):
        (p,) = spawn(build, "orphan", uid, 3, ranks=[r], env=env)
        assert p.stdout is not None
        assert json.loads(p.stdout.readline())["event"] == "joining"
        procs.append(p)
        for _ in range(2000):  # rank 0 creates the world and listens
            if rendezvous_open(uid):
                break
            time.sleep(0.005)
    time.sleep(0.2)  # the joins are done (each takes well under a millisecond)
    victim = 1 if point == "joined_rank" else 0
    os.kill(procs[victim].pid, signal.SIGKILL)
    procs[victim].wait(timeout=30)
    for r, p in enumerate(procs):
        if r != victim:  # the survivor notices the death and its init fails
            out, err = p.communicate(timeout=30)
            assert p.returncode == 0, err[-2000:]
            done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            assert done[-1]["event"] == "init_done" and done[-1]["rc"] == REMOTE, done
            assert "exited" in done[-1]["error"], done
    assert not rendezvous_open(uid)
    assert _shm_entries() == before


# ---- duplicate device across processes -----------------------------------------------------


@pytest.mark.slow
def test_duplicate_device_across_processes(lib: Lib, build: Any) -> None:
    uid = lib.unique_id()
    procs = spawn(build, "orphan", uid, 2, env={"LB_TEST_DEVICE": "3"})
    for p in procs:
        ev = events(p, timeout=60)
        assert ev[-1]["event"] == "init_done" and ev[-1]["rc"] == INVALID_USAGE, ev
        assert "Duplicate GPU detected" in ev[-1]["error"], ev
        assert "device 3" in ev[-1]["error"], ev


@pytest.mark.slow
def test_duplicate_device_compares_physical_devices(lib: Lib, build: Any) -> None:
    """Each process sees its own CUDA_VISIBLE_DEVICES, as under a launcher: both ranks call
    themselves device 0, and only the physical device behind it decides."""

    def job(visible: tuple[str, str]) -> list[dict[str, Any]]:
        uid = lib.unique_id()
        procs = [
            spawn(
                build,
                "orphan",
                uid,
                2,
                env={"LB_TEST_DEVICE": "0", "CUDA_VISIBLE_DEVICES": v},
                ranks=[r],
            )[0]
            for r, v in enumerate(visible)
        ]
        return [events(p, timeout=60)[-1] for p in procs]

    for ev in job(("2", "5")):  # two GPUs, each process's device 0
        assert ev["event"] == "init_done" and ev["rc"] == 0, ev
    for ev in job(("4,1", "4")):  # one GPU: physical device 4 in both
        assert ev["event"] == "init_done" and ev["rc"] == INVALID_USAGE, ev
        assert "Duplicate GPU detected" in ev["error"] and "device 4" in ev["error"], ev
