"""scripts/free_threaded.sh and scripts/threads_throughput.py, cheaply: CI builds no CPython.

The script parses, documents itself, refuses unknown arguments, and with ``--no-build`` and an
empty cache says so without fetching or building anything; with an interpreter already cached
it is not run here at all (a developer runs it: it installs and runs the test suite). The
throughput script runs a tiny round on this interpreter and reports its figure's fields.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support import ROOT

SCRIPT = ROOT / "scripts" / "free_threaded.sh"
THROUGHPUT = ROOT / "scripts" / "threads_throughput.py"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=str(ROOT),
    )


def test_the_script_parses_and_is_executable() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    assert os.access(SCRIPT, os.X_OK)


def test_help_names_every_option_and_the_cache() -> None:
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for word in ("--build-only", "--no-build", "--skip-tests", "PYNCCL_CACHE_DIR", "trixie",
                 "--disable-gil", "gil_off", "Exit status"):  # fmt: skip
        assert word in proc.stdout, word
    assert not proc.stdout.startswith("#")


def test_an_unknown_argument_is_refused_by_name() -> None:
    proc = _run("--fast")
    assert proc.returncode == 2
    assert "'--fast'" in proc.stderr and "--help" in proc.stderr


def test_no_build_with_an_empty_cache_fails_without_fetching(tmp_path: Path) -> None:
    env = {**os.environ, "PYNCCL_CACHE_DIR": str(tmp_path)}
    proc = _run("--no-build", env=env)
    assert proc.returncode == 3, proc.stderr
    assert str(tmp_path / "free-threaded" / "cpython-3.13t") in proc.stderr
    assert not (tmp_path / "free-threaded").exists() or not any(
        (tmp_path / "free-threaded").iterdir()
    )


def test_the_throughput_figure_has_its_fields(lb_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(THROUGHPUT), "--calls", "200", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=120, env=lb_env, cwd=str(ROOT),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    assert result["gil"] is gil
    assert set(result["calls_per_s"]) == set(result["cpu_per_wall"]) == {"1", "2"}
    assert all(v > 0 for v in result["calls_per_s"].values())
    assert 0 < result["control"] and result["loadavg"] >= 0


def test_throughput_refuses_a_round_of_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, str(THROUGHPUT), "--calls", "0"],
        capture_output=True, text=True, timeout=60, cwd=str(ROOT),
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--calls" in proc.stderr and "got 0" in proc.stderr
