"""The layering rule, held by the import graph: a module imports only from its own layer
or below, function-level imports included (only ``if TYPE_CHECKING:`` blocks, which never
run, are left out); ``bootstrap`` exchanges bytes and imports nothing above the
vocabulary, never ``comm``. Package ``__init__`` facades may re-export lazily (by
``importlib.import_module`` strings, which are not import statements).

Layers (docs/architecture.md, adjusted where the code shows better): the vocabulary
(enums, errors, dtypes, _limits, typing) sits at the bottom, since the ctypes layer raises
typed errors; ``pynccl.testing`` (the loopback) sits beside the tools, which run on it
with ``--loopback``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from support import ROOT as REPO_ROOT

ROOT = REPO_ROOT / "pynccl"

# (prefix, layer): the longest matching prefix decides.
LAYERS: list[tuple[str, int]] = [
    ("pynccl", 0),  # the package facade: its eager imports are the vocabulary only
    ("pynccl.enums", 0),
    ("pynccl.errors", 0),
    ("pynccl.dtypes", 0),
    ("pynccl._limits", 0),
    ("pynccl._closable", 0),
    ("pynccl.typing", 0),
    ("pynccl.bootstrap", 0),
    ("pynccl._loader", 1),
    ("pynccl._capi", 2),
    ("pynccl.capi", 2),
    ("pynccl.library", 2),
    ("pynccl.cuda", 4),
    ("pynccl._adapt", 5),
    ("pynccl.comm", 6),
    ("pynccl.groups", 6),
    ("pynccl.watchdog", 6),
    ("pynccl.launch", 7),
    ("pynccl.perf", 7),
    ("pynccl.interop", 7),
    ("pynccl.info", 7),
    ("pynccl.ras", 7),
    ("pynccl.__main__", 7),
    ("pynccl.testing", 7),
]

#: Upward edges known today, each with the reason it stays for now. Keep this empty.
KNOWN: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every pynccl module ``name`` imports at run time (at any depth in the file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found.update(subs if len(subs) == len(node.names) else [target, *subs])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


def layer(name: str) -> int:
    best = max((p for p, _ in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


@functools.lru_cache(maxsize=1)
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    for name in _modules():
        layer(name)  # raises ValueError (max of nothing) for a module no prefix covers


def test_no_upward_import() -> None:
    upward = sorted(
        (a, b, layer(a), layer(b))
        for a, deps in graph().items()
        for b in deps
        if layer(b) > layer(a) and (a, b) not in KNOWN
    )
    assert not upward, "upward imports (module, imported, layers):\n" + "\n".join(
        f"  {a} ({la}) -> {b} ({lb})" for a, b, la, lb in upward
    )


def test_known_exceptions_still_exist() -> None:
    edges = {(a, b) for a, deps in graph().items() for b in deps}
    assert KNOWN <= edges, f"fixed, remove from KNOWN: {KNOWN - edges}"


def test_bootstrap_exchanges_bytes_only() -> None:
    for name, deps in graph().items():
        if name.startswith("pynccl.bootstrap"):
            bad = {d for d in deps if not d.startswith("pynccl.bootstrap") and layer(d) > 0}
            assert not bad, f"{name} imports {bad}"
            assert not any(d.startswith("pynccl.comm") for d in deps)


def test_the_checker_sees_function_level_imports(tmp_path: Path) -> None:
    # The rule is only as good as its parser: a function-level upward import is found,
    # one under TYPE_CHECKING is not.
    modules = {"pynccl.x": tmp_path / "x.py", "pynccl.comm": tmp_path / "c.py"}
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .comm import A\n"
        "def f():\n    from . import comm\n"
    )
    modules["pynccl.x"].write_text(src)
    assert _imports("pynccl.x", modules["pynccl.x"], modules) == {"pynccl.comm"}
    modules["pynccl.x"].write_text(src.replace("def f():\n    from . import comm\n", ""))
    assert _imports("pynccl.x", modules["pynccl.x"], modules) == set()
