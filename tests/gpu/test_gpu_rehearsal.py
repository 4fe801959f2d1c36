"""scripts/gpu_check.sh and tests/gpu/test_gpu.py rehearsed on the loopback libraries.

The GPU checks run only where a GPU is lent, which is rarely, and then on a tight
time budget: ``PYNCCL_GPU_REHEARSAL=1`` runs the whole script here - the gpu-marked
tests (every collective on one rank, several ranks in one process, graph capture
and replay through ``pynccl.cuda.Graph``, ``perf -G``) and its perf steps - on the
loopback libraries, so a mistake in them shows up in every test run rather than on
the one day a GPU is there. What needs CuPy, torch or cuda.core skips, as it does
on a GPU machine without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT

needs_timeout = pytest.mark.skipif(
    shutil.which("timeout") is None, reason="needs coreutils' timeout"
)
STATUSES = {"ok", "FAIL", "skipped", "error", "timeout"}


def _gpu_check(tmp_path: Path, **extra: str) -> str:
    env = {
        **os.environ,
        "PYNCCL_GPU_REHEARSAL": "1",
        "PYTHON": sys.executable,
        "GPU_CHECK_LOG_DIR": str(tmp_path),
        **extra,
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
    return out


def _probe_names() -> list[str]:
    out = subprocess.run(
        [sys.executable, "scripts/gpu_probes.py", "--list"],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split()[0] for line in out.splitlines()]


def _probe_lines(text: str) -> list[dict[str, Any]]:
    """The probes' JSON lines; each must be one well-formed object with a known status."""
    rows = [json.loads(line) for line in text.splitlines() if line.startswith('{"probe"')]
    for row in rows:
        assert row["status"] in STATUSES, row
        if row["status"] == "skipped":
            assert row["reason"], row
    return rows


def test_gpu_check_script_is_valid_bash() -> None:
    proc = subprocess.run(
        ["bash", "-n", "scripts/gpu_check.sh"], cwd=str(ROOT), capture_output=True
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
@needs_timeout
def test_gpu_check_script_passes_on_the_loopback(tmp_path: Path) -> None:
    out = _gpu_check(tmp_path)
    assert "RESULT: REHEARSAL OK" in out and "REHEARSAL: on the loopback" in out
    assert "1 rank only" not in out  # two (loopback) devices: every multi-rank path ran
    summary = out[out.index("pynccl GPU check summary") :]
    for step in ("info", "probes", "pytest-gpu", "perf-all_reduce", "perf-all_reduce-graph"):
        assert re.search(rf"^{step} +ok ", summary, re.M), summary
    # one JSON line per probe, none broken; what needs torch/CuPy or a real GPU says why
    rows = _probe_lines((tmp_path / "probes.log").read_text())
    assert [r["probe"] for r in rows] == _probe_names()
    assert not [r for r in rows if r["status"] in ("error", "timeout")], rows
    by_name = {r["probe"]: r for r in rows}
    for name in ("watchdog-torch-graph", "caching-allocator-keepalive", "cai-cupy-side-stream"):
        assert by_name[name]["status"] == "skipped", by_name[name]
        assert re.search(r"torch|cupy", by_name[name]["reason"]), by_name[name]
    assert by_name["basic"]["status"] == "ok"
    assert by_name["watchdog-events-device"]["status"] != "skipped"  # two devices here
    assert re.search(r"^perf-every-collective +ok .*0 OK", summary, re.M), summary
    # every collective, several ranks, graphs, perf -G: the checks that need no array library
    passed = re.search(r"^pytest-gpu .* (\d+) passed", summary, re.M)
    assert passed is not None and int(passed.group(1)) >= 4, summary
    pytest_log = (tmp_path / "pytest-gpu.log").read_text()
    for line in pytest_log.splitlines():
        # Only what needs a library (or a GPU) the rehearsal lacks; the Ray example runs
        # on the loopback in test_examples.
        if line.startswith("SKIPPED"):
            assert re.search(r"cupy|torch|cuda\.core|ray|needs an NVIDIA GPU", line), line


@needs_timeout
def test_one_visible_gpu_says_1_rank_only(tmp_path: Path) -> None:
    # With one device, the multi-rank paths are skipped: the summary must say so, never
    # a plain OK for what was not run.
    out = _gpu_check(
        tmp_path,
        PYNCCL_GPU_REHEARSAL_DEVICES="1",
        GPU_CHECK_STEPS="info probes perf-all_reduce",
        GPU_CHECK_PROBES="basic watchdog-events-device abortive-shrink-destroy",
    )
    assert "# 1 rank only: one GPU is visible" in out
    summary = out[out.index("pynccl GPU check summary") :]
    assert re.search(r"^probes +ok .*; 1 rank only$", summary, re.M), summary
    assert re.search(r"^perf-all_reduce +ok .*; 1 rank only$", summary, re.M), summary
    assert "pytest-gpu" not in summary  # not asked for: not run, not listed
    assert re.search(r"^RESULT: REHEARSAL OK, 1 rank only \(", out, re.M), out[-2000:]
    rows = {r["probe"]: r for r in _probe_lines((tmp_path / "probes.log").read_text())}
    assert sorted(rows) == ["abortive-shrink-destroy", "basic", "watchdog-events-device"]
    assert rows["basic"]["status"] == "ok"
    for name in ("watchdog-events-device", "abortive-shrink-destroy"):
        assert rows[name]["status"] == "skipped"
        assert rows[name]["reason"].startswith("1 rank only: needs 2 GPUs, 1 visible")


@pytest.mark.parametrize("module", ["cupy", "torch"])
def test_probes_without_the_array_library_say_skipped(module: str, tmp_path: Path) -> None:
    # Outside a rehearsal, a probe of a library that is not installed prints one JSON
    # line, "skipped", naming it (before any CUDA call: this machine has no GPU). Where
    # the library is installed, a package of its name first on the path hides it.
    hidden = tmp_path / module
    hidden.mkdir()
    (hidden / "__init__.py").write_text(f"raise ImportError({'No module named ' + module!r})\n")
    name = {"cupy": "cai-cupy-side-stream", "torch": "caching-allocator-keepalive"}[module]
    env = {k: v for k, v in os.environ.items() if k != "PYNCCL_GPU_REHEARSAL"}
    env["PYTHONPATH"] = os.pathsep.join((str(tmp_path), str(ROOT)))
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_probes.py", name],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = _probe_lines(proc.stdout)
    assert row["probe"] == name and row["status"] == "skipped"
    assert f"{module} is not installed" in row["reason"]
    assert proc.stdout.splitlines()[-1] == "# probes: 1 skipped"


def test_probes_out_of_budget_are_skipped_not_run() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_probes.py", "--budget", "0", "basic", "dangling-stream"],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = _probe_lines(proc.stdout)
    assert [(r["probe"], r["status"], r["reason"]) for r in rows] == [
        ("basic", "skipped", "out of time (--budget)"),
        ("dangling-stream", "skipped", "out of time (--budget)"),
    ]
