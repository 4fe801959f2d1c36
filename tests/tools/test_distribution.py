"""The distribution: a name of its own on PyPI ("pynccl" there is an unrelated project that
also imports as ``pynccl``), one source for the version, ``info`` naming a shadowing install,
and a wheel and an sdist that install into a clean venv and run a collective there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import tomllib
from support import ROOT

import pynccl
from pynccl import info

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_distribution_has_its_own_name_and_one_version_source() -> None:
    project = PYPROJECT["project"]
    assert project["name"] == info.DISTRIBUTION == "pynccl-ctypes"
    assert project["name"] != "pynccl"  # taken on PyPI by an unrelated project
    assert "version" not in project and project["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pynccl.__version__"}
    assert project["description"] == info.SUMMARY  # what tells an old install of this apart


def _fake_dist(where: Path, name: str, version: str, summary: str) -> None:
    d = where / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n"
    )


def _info_json(path: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-m", "pynccl", "info", "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    report: dict[str, object] = json.loads(out.stdout)["pynccl"]
    return report


def test_info_names_the_unrelated_pynccl_when_both_are_installed(tmp_path: Path) -> None:
    _fake_dist(tmp_path / "other", "pynccl", "0.1.2", "Python bindings to NCCL via numba")
    report = _info_json(tmp_path / "other")
    shadow = str(report["shadow"])
    assert "unrelated PyPI project 'pynccl' 0.1.2" in shadow
    assert "pip uninstall pynccl" in shadow and "pynccl-ctypes" in shadow
    # This project installed under its old name is no shadow.
    _fake_dist(tmp_path / "old", "pynccl", "0.0.9", info.SUMMARY)
    assert _info_json(tmp_path / "old")["shadow"] is None


_SMOKE = """
import importlib.metadata as m, numpy as np, pynccl, sys
from pynccl.testing import loopback
assert m.version("pynccl-ctypes") == pynccl.__version__, m.version("pynccl-ctypes")
assert not pynccl.__file__.startswith(sys.argv[1]), pynccl.__file__  # the installed copy
loopback.use()
from pynccl import Communicator
from pynccl.cuda import DeviceBuffer
comms = Communicator.init_all([0, 1])
data = [np.arange(8, dtype=np.float32) * (r + 1) for r in range(2)]
bufs = [DeviceBuffer.from_numpy(d, device=r) for r, d in enumerate(data)]
with pynccl.group():
    for c, b in zip(comms, bufs):
        c.all_reduce(b)
for c, b in zip(comms, bufs):
    c.synchronize()
    np.testing.assert_array_equal(b.to_numpy(), data[0] + data[1])
    b.close()
    c.destroy()
print("ok", pynccl.__version__)
"""


def _build(kind: str, tmp: Path) -> Path:
    """The wheel or sdist of this checkout, made by the PEP 517 backend pyproject names, from
    a copy of the sources (a build writes egg-info and build/ where it runs)."""
    src = tmp / "src"
    shutil.copytree(ROOT / "pynccl", src / "pynccl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    code = f"import setuptools.build_meta as b; print(b.build_{kind}({str(tmp / 'dist')!r}))"
    name = subprocess.run(
        [sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300,
        check=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    return tmp / "dist" / name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_the_wheel_and_the_sdist_install_into_a_clean_venv_and_run(
    kind: str, tmp_path: Path
) -> None:
    artifact = _build(kind, tmp_path)
    stem = "pynccl_ctypes-" + pynccl.__version__
    assert artifact.name == (f"{stem}-py3-none-any.whl" if kind == "wheel" else f"{stem}.tar.gz")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # numpy only for the check; the sdist builds with the setuptools pyproject asks for.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of ROOT's
    subprocess.run([*pip, str(artifact), "numpy"], check=True, timeout=600, cwd=tmp_path,
                   env=clean)  # fmt: skip
    out = subprocess.run(
        [str(py), "-c", _SMOKE, str(ROOT)], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env=clean,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"ok {pynccl.__version__}"
