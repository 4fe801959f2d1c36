"""The API reference (docs/, Sphinx) documents every public name, and nothing that is not one.

Read from the reStructuredText sources, so this runs without Sphinx; CI builds the
reference itself with warnings as errors (``sphinx-build -W``), where docs/_ext checks the
same thing on the built inventory and the "requires NCCL >= x" notes.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from typing import Any

import pytest
from support import ROOT

DOCS = ROOT / "docs"


def _public_modules() -> tuple[str, ...]:
    """docs/_ext/public_modules.py's list (plain Python: no Sphinx needed)."""
    spec = importlib.util.spec_from_file_location(
        "public_modules", DOCS / "_ext" / "public_modules.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.PUBLIC_MODULES)


PUBLIC_MODULES = _public_modules()

_DIRECTIVE = re.compile(
    r"^\.\. (?:auto(?:class|function|data|exception|attribute)|py:(?:data|function|class)|"
    r"automodule|py:module|currentmodule|py:currentmodule):: *([\w.]+)",
    re.M,
)
_MODULE = re.compile(r"^\.\. (?:automodule|py:module|currentmodule|py:currentmodule)::", re.M)


def documented_names() -> set[str]:
    """Every object a reference page documents, by its full dotted name."""
    names: set[str] = set()
    for page in sorted((DOCS / "reference").glob("*.rst")):
        text = page.read_text()
        module = ""
        for match in _DIRECTIVE.finditer(text):
            target = match.group(1)
            if _MODULE.match(match.group(0)):
                module = target
            elif target.startswith("pynccl."):
                names.add(target)
            else:  # a py:data NAME inside the current module, as Sphinx resolves it
                names.add(f"{module}.{target}")
    return names


def public_names() -> set[str]:
    return {f"{m}.{name}" for m in PUBLIC_MODULES for name in importlib.import_module(m).__all__}


def _object(full: str) -> object:
    module, _, attr = full.rpartition(".")
    return getattr(importlib.import_module(module), attr, None)


def test_every_public_name_is_in_the_reference() -> None:
    # A re-export documented under another public module (pynccl.comm.Communicator is
    # pynccl.Communicator) counts, as in docs/_ext's check of the built inventory.
    documented = documented_names()
    seen = {id(_object(n)) for n in documented if n.rpartition(".")[0] in PUBLIC_MODULES}
    missing = sorted(n for n in public_names() - documented if id(_object(n)) not in seen)
    assert missing == [], f"public names with no entry under docs/reference/: {missing}"


def test_the_names_the_readme_uses_are_in_the_reference() -> None:
    # Issue 22: the README uses these; the reference lacked them.
    names = documented_names()
    for full in (
        "pynccl.comm.State",
        "pynccl.enums.SuspendFlag",
        "pynccl.enums.MemStat",
        "pynccl.enums.ShrinkFlag",
        "pynccl.enums.WinFlag",
        "pynccl.cuda.StreamLike",
        "pynccl.groups.Group",
        "pynccl.groups.SimulatedGroup",
        "pynccl.watchdog.Watchdog",
        "pynccl.watchdog.FlightRecord",
    ):
        assert full in names, full


def _ext() -> object:
    pytest.importorskip("sphinx", reason="the docs extra (pip install -e '.[docs]')")
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        return importlib.import_module("pynccl_docs")
    finally:
        sys.path.remove(str(DOCS / "_ext"))


def test_bases_shown_are_public() -> None:
    # "Bases:" must not name a private mixin (Communicator's Suspend, Resilience... of
    # pynccl.comm._*); each is replaced by its own public bases.
    ext: Any = _ext()
    classes = [obj for obj in map(_object, public_names()) if isinstance(obj, type)]
    assert any(ext._is_private(b) for cls in classes for b in cls.__bases__)  # there are some
    for cls in classes:
        bases = list(cls.__bases__)
        ext._public_bases(None, cls.__qualname__, cls, None, bases)
        private = [b for b in bases if ext._is_private(b)]
        assert private == [], f"{cls.__qualname__} shows {private}"
        assert bases, cls
    import pynccl

    shown = list(pynccl.Communicator.__bases__)
    ext._public_bases(None, "Communicator", pynccl.Communicator, None, shown)
    assert shown == [object]


def test_the_reference_documents_no_name_that_is_not_public() -> None:
    stale = sorted(documented_names() - public_names())
    assert stale == [], f"docs/reference/ documents names no module exports: {stale}"


def test_every_public_module_has_a_page() -> None:
    modules = set()
    for page in (DOCS / "reference").glob("*.rst"):
        modules |= set(re.findall(r"^\.\. automodule:: *(\S+)", page.read_text(), re.M))
    assert modules == set(PUBLIC_MODULES)
    index = (DOCS / "index.rst").read_text()
    for page in (DOCS / "reference").glob("*.rst"):
        assert f"reference/{page.stem}" in index, f"{page.name} is not in index.rst's toctree"


def test_the_build_checks_the_same_modules() -> None:
    # docs/_ext/pynccl_docs.py warns (so `sphinx-build -W` fails) for an undocumented name.
    ext: Any = _ext()
    assert tuple(ext.PUBLIC_MODULES) == PUBLIC_MODULES


def test_every_example_is_in_the_examples_page() -> None:
    page = (DOCS / "examples.rst").read_text()
    for example in sorted((ROOT / "examples").glob("*.py")):
        assert f".. literalinclude:: ../examples/{example.name}" in page
        assert f"``{example.name}``" in page


def test_values_written_into_the_reference_are_the_real_ones() -> None:
    # `.. py:data:: NAME` / `:value: V` entries restate a constant: they must not drift.
    import ast

    checked = 0
    for page in sorted((DOCS / "reference").glob("*.rst")):
        text = page.read_text()
        module = re.search(r"^\.\. automodule:: *(\S+)", text, re.M)
        assert module is not None
        for name, value in re.findall(r"^\.\. py:data:: (\w+)\n +:value: (.+)$", text, re.M):
            actual = getattr(importlib.import_module(module.group(1)), name)
            assert ast.literal_eval(value) == actual, f"{page.name}: {name} is {actual!r}"
            checked += 1
    assert checked >= 6
