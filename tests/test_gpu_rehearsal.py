"""scripts/gpu_check.sh and tests/test_gpu.py rehearsed on the loopback libraries.

The GPU checks run only where a GPU is lent, which is rarely, and then on a tight
time budget: ``PYNCCL_GPU_REHEARSAL=1`` runs the whole script here - the gpu-marked
tests (every collective on one rank, several ranks in one process, graph capture
and replay through ``pynccl.cuda.Graph``, ``perf -G``) and its perf steps - on the
loopback libraries, so a mistake in them shows up in every test run rather than on
the one day a GPU is there. What needs CuPy, torch or cuda.core skips, as it does
on a GPU machine without them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_gpu_check_script_passes_on_the_loopback(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYNCCL_GPU_REHEARSAL": "1",
        "PYTHON": sys.executable,
        "GPU_CHECK_LOG_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "RESULT: REHEARSAL OK" in out and "REHEARSAL: on the loopback" in out
    summary = out[out.index("pynccl GPU check summary") :]
    for step in ("info", "pytest-gpu", "perf-all_reduce", "perf-all_reduce-graph"):
        assert re.search(rf"^{step} +ok ", summary, re.M), summary
    assert re.search(r"^perf-every-collective +ok .*0 OK", summary, re.M), summary
    # every collective, several ranks, graphs, perf -G: the checks that need no array library
    passed = re.search(r"^pytest-gpu .* (\d+) passed", summary, re.M)
    assert passed is not None and int(passed.group(1)) >= 4, summary
    pytest_log = (tmp_path / "pytest-gpu.log").read_text()
    for line in pytest_log.splitlines():
        if line.startswith("SKIPPED"):  # only what needs a library this machine lacks
            assert re.search(r"cupy|torch|cuda\.core|needs an NVIDIA GPU", line), line
