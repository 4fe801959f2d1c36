"""``python -m pynccl perf`` run as a user runs it, for the tests of tests/perf/."""

from __future__ import annotations

import os
import subprocess
import sys

from support import ROOT

__all__ = ["perf_env", "run_perf", "table_rows"]


def perf_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without launcher or PYNCCL_ variables (a rank's would make perf
    one rank of a job), the repository importable, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYNCCL_") or k in ("PYNCCL_CACHE_DIR",)
    }
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def run_perf(
    *args: str, extra_env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m pynccl perf ARGS`` in a fresh process (no GPU: the loopback)."""
    return subprocess.run(
        [sys.executable, "-m", "pynccl", "perf", *args],
        env=perf_env(extra_env),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def table_rows(stdout: str) -> list[list[str]]:
    """perf's table: every line that is not a comment, split into fields."""
    return [line.split() for line in stdout.splitlines() if line and not line.startswith("#")]
