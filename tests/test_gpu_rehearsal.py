"""tests/test_gpu.py rehearsed on the loopback libraries (``PYNCCL_GPU_REHEARSAL=1``).

The GPU checks run only where a GPU is lent, which is rarely: rehearsing them here
runs their child scripts - every collective on one rank, several ranks in one
process, graph capture and replay through ``pynccl.cuda.Graph``, ``perf -G`` - so a
mistake in them shows up in every CI run, not on the one day a GPU is there. What
needs CuPy, torch or cuda.core skips, as it does on a GPU machine without them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_checks_pass_on_the_loopback() -> None:
    env = {**os.environ, "PYNCCL_GPU_REHEARSAL": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            "tests/test_gpu.py",
        ],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = re.search(r"(\d+) passed", proc.stdout)
    # every collective, several ranks, graphs, perf -G: the checks that need no array library
    assert passed is not None and int(passed.group(1)) >= 4, proc.stdout
    for line in proc.stdout.splitlines():
        if line.startswith("SKIPPED"):
            assert re.search(r"cupy|torch|cuda\.core", line), line
