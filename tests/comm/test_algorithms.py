"""Which algorithm ran (issue 23, pytorch#192515 "fallback is silent"): pynccl.tuning parses
NCCL's NCCL_DEBUG_SUBSYS=TUNING lines, quoted here from NCCL's source (src/enqueue.cc,
src/scheduler/symmetric_sched.cc, src/ce_coll.cc; 2.27.3 .. master), and
PYNCCL_TRACE_ALGORITHMS=1 turns them on; on the loopback, Communicator.algorithms() reports
a symmetric kernel only when both buffers lie in symmetric windows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

from pynccl import tuning
from pynccl.testing import loopback

P = "gpu01:12345:12400 [3] NCCL INFO "


def test_channel_algorithm_line() -> None:
    r = tuning.parse_line(
        P + "AllReduce: 4194304 Bytes -> Algo TREE proto LL128 channel{Lo..Hi}={0..7}"
    )
    assert r is not None
    assert (r.collective, r.nbytes, r.algorithm, r.protocol) == (
        "AllReduce",
        4194304,
        "TREE",
        "LL128",
    )
    assert (r.channels, r.symmetric, r.copy_engine, r.device) == (8, False, False, 3)


def test_symmetric_lines_of_227_and_228() -> None:
    old = P + "AllGather [Symmetric]: 1024 Bytes -> Kernel AllGather_LL nchannels 2 nthreads 512"
    new = (
        "[2026-01-02 03:04:05] "
        + P
        + "AllReduce [Symmetric]: 65536 Bytes -> Kernel AllReduce_RSxLD_AGxST nchannels 16 "
        "nthreads 512 nWorks 1"
    )
    a, b = tuning.parse([old, new])
    assert (a.collective, a.nbytes, a.algorithm, a.channels, a.symmetric) == (
        "AllGather",
        1024,
        "AllGather_LL",
        2,
        True,
    )
    assert (b.algorithm, b.protocol, b.channels, b.symmetric, b.device) == (
        "AllReduce_RSxLD_AGxST",
        None,
        16,
        True,
        3,
    )


def test_copy_engine_lines_are_symmetric_zero_cta() -> None:
    ce = tuning.parse_line(
        P + "AllGather [Copy Engine]: 8192 Bytes -> cudaMemcpy; CE synchronization with NVLS"
    )
    hce = tuning.parse_line(P + "AlltoAll [Hierarchical CE]: 4096 Bytes -> RMA proxy + CE")
    assert ce is not None and hce is not None
    assert (ce.algorithm, ce.nbytes, ce.channels, ce.symmetric, ce.copy_engine) == (
        "Copy Engine",
        8192,
        0,
        True,
        True,
    )
    assert (hce.collective, hce.algorithm) == ("AlltoAll", "Hierarchical CE")


def test_other_lines_are_skipped_and_extra_fields_tolerated() -> None:
    lines = [
        P + "comm 0x55 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0",
        P + "AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 count 4 datatype 7 op 0 root 0",
        P + "ReduceScatter_RailA2A_LsaLD : satblocks=4 bufsize=8 effbw=1.5",
        P + "AllReduce: tuner chunk size 999 exceeds buffer max 8, clamping",
        "garbage",
        "",
        # a fork's extra field after the channel range
        P + "Broadcast: 16 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={2..3} cgaClusterSize 1",
    ]
    (r,) = tuning.parse(lines)
    assert (r.collective, r.nbytes, r.algorithm, r.channels) == ("Broadcast", 16, "RING", 2)


def test_prepare_keeps_the_users_settings(tmp_path: Path) -> None:
    env = {
        tuning.ENV: "1",
        "NCCL_DEBUG_SUBSYS": "INIT,COLL",
        "NCCL_DEBUG_FILE": str(tmp_path / "x"),
    }
    assert tuning.prepare(env)
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,COLL,TUNING"
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / "x")
    env = {tuning.ENV: "1", "NCCL_DEBUG_SUBSYS": "^TUNING,NET"}
    assert tuning.prepare(env) and env["NCCL_DEBUG_SUBSYS"] == "^NET"
    assert env["NCCL_DEBUG_FILE"].endswith("%h.%p.log")
    env = {tuning.ENV: "1"}
    assert tuning.prepare(env) and env["NCCL_DEBUG_SUBSYS"] == "INIT,ENV,TUNING"
    env = {tuning.ENV: "1", "NCCL_DEBUG": "WARN"}
    assert not tuning.prepare(env) and env["NCCL_DEBUG"] == "WARN"
    with pytest.raises(ValueError, match=r"PYNCCL_TRACE_ALGORITHMS='yes': expected '1'"):
        tuning.prepare({tuning.ENV: "yes"})
    assert not tuning.prepare({})
    with pytest.raises(tuning.TracingOffError, match="set PYNCCL_TRACE_ALGORITHMS=1 before"):
        tuning.recent()


# Two ranks (threads), one all_reduce, one all_gather and one reduce_scatter each, in
# symmetric windows or in plain allocations; rank 0 prints what NCCL's tuner reported for
# them (the last 3: register_window agrees on the sizes with an all_gather of its own).
JOB = """
import json, sys, threading
import numpy as np
from pynccl import Communicator, UniqueId

WINDOWS = sys.argv[1] == "1"
uid = UniqueId()
out = {}
def rank(r):
    comm = Communicator(2, uid, r, device=r)
    bufs = [comm.mem_alloc(2048, "float32") for _ in range(2)]
    wins = [comm.register_window(b) for b in bufs] if WINDOWS else []
    a, b = bufs
    a.copy_from(np.ones(2048, dtype=np.float32))
    comm.all_reduce(a, b, count=2048)
    comm.all_gather(a, b, count=1024)
    comm.reduce_scatter(a, b, count=1024)
    comm.synchronize()
    out[r] = [(x.collective, x.nbytes, x.algorithm, x.symmetric) for x in comm.algorithms(last=3)]
    out[f"last{r}"] = len(comm.algorithms(last=1))
    for w in wins: w.close()
    comm.close()
threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


def _run(windows: bool, version: str, **env: str) -> dict[str, object]:
    child = {k: v for k, v in os.environ.items() if not k.startswith(("PYNCCL_", "NCCL_"))}
    child.update(loopback.env(version), PYTHONPATH=str(ROOT), PYNCCL_TRACE_ALGORITHMS="1", **env)
    proc = subprocess.run(
        [sys.executable, "-c", JOB, "1" if windows else "0"],
        env=child, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "NCCL INFO" not in proc.stderr  # the lines went to the trace file
    result: dict[str, object] = json.loads(proc.stdout)
    return result


@pytest.mark.slow
def test_symmetric_kernel_only_in_windows() -> None:
    plain = _run(False, "2.28.9")
    assert plain["0"] == [
        ["AllReduce", 8192, "RING", False],
        ["AllGather", 4096, "RING", False],
        ["ReduceScatter", 4096, "RING", False],
    ]
    assert plain["1"] == [] and plain["last0"] == 1  # NCCL reports on rank 0 only
    sym = _run(True, "2.28.9")
    assert sym["0"] == [
        ["AllReduce", 8192, "AllReduce_AGxLL_R", True],
        ["AllGather", 4096, "AllGather_LL", True],
        ["ReduceScatter", 4096, "ReduceScatter_LL", True],
    ]
    assert sym["1"] == []


@pytest.mark.slow
def test_tree_when_asked_and_227_reports_symmetric_on_every_rank() -> None:
    tree = _run(False, "2.28.9", NCCL_ALGO="allreduce:tree")
    assert [x[2] for x in tree["0"]] == ["TREE", "RING", "RING"]  # type: ignore[union-attr]
    old = _run(True, "2.27.7")
    for r in ("0", "1"):  # 2.27 printed the [Symmetric] line on every rank
        assert [x[2] for x in old[r]] == [  # type: ignore[union-attr]
            "AllReduce_AGxLL_R",
            "AllGather_LL",
            "ReduceScatter_LL",
        ]
