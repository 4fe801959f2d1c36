"""Known-bad NCCL releases: the table, the warning at load and ``info``, on a loopback
libnccl that reports the release under test (its ``ncclGetVersion``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import ROOT

from pynccl import _known_bad
from pynccl.testing import loopback

# Written by hand from NCCL's release notes (the reference, not the table): the release,
# then the "fixed in" releases its warning must name.
EXPECTED = {
    "2.19.3": ["no release fixes it; workaround: NCCL_CUMEM_ENABLE=0"],
    "2.27.5": ["fixed in 2.27.7", "fixed in 2.28.7"],
    "2.29.2": ["fixed in 2.29.3"],
}
CLEAN = ["2.18.6", "2.28.9", "2.29.3", "2.32.3"]


def _env(version: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYNCCL_", "NCCL_"))}
    env.update(loopback.env(version), PYTHONPATH=str(ROOT), **extra)
    return env


def _load(version: str, **extra: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from pynccl import library\n"
        "library.load_library(); library.load_library(); library.lib()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        env=_env(version, **extra),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_table_is_well_formed() -> None:
    for issue in _known_bad.KNOWN_BAD:
        assert issue.first <= issue.last, issue
        assert issue.fixed is None or issue.fixed > issue.last, issue
        assert issue.fixed is not None or issue.workaround, issue
        assert issue.source.startswith("https://github.com/"), issue


@pytest.mark.parametrize("release", [*EXPECTED, *CLEAN])
def test_issues_for_matches_release_notes(release: str) -> None:
    triple = tuple(int(x) for x in release.split("."))
    found = [_known_bad.describe(i) for i in _known_bad.issues_for(triple)]  # type: ignore[arg-type]
    want = EXPECTED.get(release, [])
    assert len(found) == len(want), found
    for fix in want:
        assert any(fix in text for text in found), (fix, found)


def test_issues_for_rejects_a_bad_release() -> None:
    with pytest.raises(ValueError, match=r"\(major, minor, patch\)"):
        _known_bad.issues_for((2, 29))  # type: ignore[arg-type]


@pytest.mark.slow
def test_loading_a_known_bad_release_warns_once() -> None:
    proc = _load("2.29.2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("RuntimeWarning") == 1, proc.stderr
    assert "NCCL 2.29.2" in proc.stderr
    assert "fixed in 2.29.3" in proc.stderr
    assert "https://github.com/NVIDIA/nccl/releases/tag/v2.29.3-1" in proc.stderr
    assert _known_bad.ENV_SILENCE in proc.stderr  # says how to silence it


@pytest.mark.slow
def test_the_env_var_silences_the_warning() -> None:
    proc = _load("2.29.2", PYNCCL_NO_KNOWN_BAD_WARNING="1")
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_fixed_release_does_not_warn() -> None:
    proc = _load("2.29.3")
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr, proc.stderr


def _info(version: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pynccl", "info", *args],
        env=_env(version, PYNCCL_NO_KNOWN_BAD_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_info_lists_the_loaded_release_entries() -> None:
    proc = _info("2.27.5")
    assert proc.returncode == 0, proc.stderr
    assert "KNOWN ISSUES of NCCL 2.27.5" in proc.stdout
    assert "fixed in 2.27.7" in proc.stdout and "fixed in 2.28.7" in proc.stdout
    report = json.loads(_info("2.27.5", "--json").stdout)
    assert len(report["known_issues"]) == 2


@pytest.mark.slow
def test_info_says_no_known_issue() -> None:
    proc = _info("2.32.3")
    assert proc.returncode == 0, proc.stderr
    assert "no known issue in pynccl's table for NCCL 2.32.3" in proc.stdout
