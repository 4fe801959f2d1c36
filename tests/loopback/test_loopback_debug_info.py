"""NCCL_DEBUG=INFO on the loopback libnccl: NCCL-shaped INFO lines (the version banner, the
comm line, the config, Init COMPLETE, a collective's COLL and TUNING lines) in NCCL's
prefix format, filtered by NCCL_DEBUG_SUBSYS, written to NCCL_DEBUG_FILE when set. The
formats are NCCL's own (src/debug.cc, src/init.cc, src/enqueue.cc), written out here."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

from pynccl.testing import loopback

# A 2-rank loopback job: two threads, one communicator each, one all_reduce of 4096 float32.
JOB = """
import threading
import numpy as np
from pynccl import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer

uid = UniqueId()
def rank(r):
    comm = Communicator(2, uid, r, device=r)
    x = DeviceBuffer.from_numpy(np.ones(4096, dtype=np.float32), device=r)
    comm.all_reduce(x)
    comm.synchronize()
    comm.close()
threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
for t in threads: t.start()
for t in threads: t.join()
"""

HOST = socket.gethostname().split(".")[0]
PREFIX = rf"^{re.escape(HOST)}:(\d+):(\d+) \[(\d)\] NCCL INFO "


def _run(**env: str) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith(("PYNCCL_", "NCCL_"))}
    child.update(loopback.env("2.28.9"), PYTHONPATH=str(ROOT), **env)
    proc = subprocess.run(
        [sys.executable, "-c", JOB], env=child, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _info(text: str) -> list[re.Match[str]]:
    return [m for m in (re.match(PREFIX + "(.*)$", ln) for ln in text.splitlines()) if m]


@pytest.mark.slow
def test_info_prints_init_lines_in_nccl_format() -> None:
    proc = _run(NCCL_DEBUG="INFO")
    lines = _info(proc.stderr)
    bodies = [m.group(4) for m in lines]
    assert bodies.count("NCCL version 2.28.9+cuda13.0") == 1, proc.stderr  # once a process
    for r in (0, 1):
        comm = [
            b
            for b in bodies
            if re.fullmatch(
                rf"comm 0x[0-9a-f]+ rank {r} nRanks 2 nNodes 1 localRanks 2 localRank {r} MNNVL 0",
                b,
            )
        ]
        assert len(comm) == 1, proc.stderr
        done = [
            b
            for b in bodies
            if re.fullmatch(
                rf"ncclCommInitRank comm 0x[0-9a-f]+ rank {r} nranks 2 cudaDev {r} "
                r".* - Init COMPLETE",
                b,
            )
        ]
        assert len(done) == 1, proc.stderr
    assert any(b.startswith("Comm config Blocking set to 1") for b in bodies), proc.stderr
    for m in lines:
        assert int(m.group(1)) > 0 and int(m.group(2)) > 0  # pid and tid
    # default subsystems are INIT and ENV: no COLL or TUNING lines
    assert not any("opCount" in b or "-> Algo" in b for b in bodies), proc.stderr


@pytest.mark.slow
def test_subsys_selects_coll_and_tuning() -> None:
    proc = _run(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="COLL,TUNING")
    bodies = [m.group(4) for m in _info(proc.stderr)]
    coll = [b for b in bodies if b.startswith("AllReduce: opCount")]
    assert len(coll) == 2, proc.stderr  # one per rank
    assert all("count 4096 datatype 7 op 0 root -1" in b and "[nranks=2]" in b for b in coll)
    tuning = [b for b in bodies if "-> Algo" in b]
    assert tuning == ["AllReduce: 16384 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..0}"], (
        proc.stderr
    )  # rank 0 only, as NCCL
    assert not any("Init COMPLETE" in b for b in bodies)  # INIT is not selected
    assert any(b.startswith("NCCL version") for b in bodies)  # the banner is ALL


@pytest.mark.slow
def test_subsys_inverted() -> None:
    proc = _run(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="^INIT,ENV")
    bodies = [m.group(4) for m in _info(proc.stderr)]
    assert any(b.startswith("AllReduce: opCount") for b in bodies)
    assert any("-> Algo" in b for b in bodies)
    assert not any("Init COMPLETE" in b or b.startswith("Comm config") for b in bodies)


@pytest.mark.slow
def test_warn_prints_no_info_lines() -> None:
    proc = _run(NCCL_DEBUG="WARN")
    assert "NCCL INFO" not in proc.stderr


@pytest.mark.slow
def test_debug_file_with_host_and_pid(tmp_path: Path) -> None:
    proc = _run(NCCL_DEBUG="INFO", NCCL_DEBUG_FILE=str(tmp_path / "nccl.%h.%p.%%.log"))
    assert "NCCL INFO" not in proc.stderr
    files = list(tmp_path.iterdir())
    assert len(files) == 1, files
    m = re.fullmatch(rf"nccl\.{re.escape(HOST)}\.(\d+)\.%\.log", files[0].name)
    assert m, files[0].name
    lines = _info(files[0].read_text())
    assert lines and all(x.group(1) == m.group(1) for x in lines)  # %p is the writer's pid
    assert any("Init COMPLETE" in x.group(4) for x in lines)
