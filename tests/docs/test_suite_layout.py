"""The test suite's own shape: tests in folders by layer, a quick run (the README's
``pytest -q``) that leaves the slow tests out yet still covers every folder, and CI that
runs the slow ones after it rather than dropping them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from support import ROOT, TESTS

#: What is not a folder of tests.
NOT_LAYERS = {"support", "golden", "__pycache__"}


def _is_slow(node: ast.expr) -> bool:
    """``pytest.mark.slow`` (or a list naming it), as a decorator or a pytestmark value."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_slow(e) for e in node.elts)
    return ast.unparse(node) == "pytest.mark.slow"


def _quick_tests(path: Path) -> list[str]:
    """The test functions of ``path`` that the quick run keeps: not marked slow, in a
    module not marked slow as a whole (parametrized cases marked one by one still leave
    the others quick)."""
    tree = ast.parse(path.read_text())
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
        ):
            if _is_slow(stmt.value):
                return []
    return [
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef)
        and f.name.startswith("test_")
        and not any(_is_slow(d) for d in f.decorator_list)
    ]


def _layers() -> list[Path]:
    return sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name not in NOT_LAYERS)


def test_tests_live_in_folders_by_layer() -> None:
    layers = _layers()
    assert {p.name for p in layers} >= {"capi", "cuda_runtime", "adapt", "comm", "loopback"}
    for layer in layers:
        assert list(layer.glob("test_*.py")), f"tests/{layer.name}/ holds no test module"


def test_the_quick_run_covers_every_layer() -> None:
    # The README's command skips the slow tests: each folder must keep some of its own.
    for layer in _layers():
        quick = [t for m in sorted(layer.glob("test_*.py")) for t in _quick_tests(m)]
        assert quick, f"every test of tests/{layer.name}/ is marked slow"


def test_the_readme_command_is_the_quick_run() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert re.search(r"""-m\s+(['"])not slow\1""", options["addopts"]), options["addopts"]
    assert any(m.startswith("slow:") for m in options["markers"])


def test_ci_runs_the_slow_tests_after_the_readme_command() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script  # a failing (or empty: exit 5) slow run fails CI
    readme_run = script.index('bash -c "$test_cmd"')
    slow = re.search(r"^\.venv/bin/python -m pytest [^\n]*-m slow\s*$", script, re.M)
    assert slow is not None, "no `pytest -m slow` line in .ci/run"
    assert slow.start() > readme_run
