"""Sphinx extension for pynccl's reference.

* ``.. nccl-functions::`` — every libnccl function pynccl binds, with the first NCCL
  release that exports it (from ``pynccl.capi.PROTOTYPES``, the table the binding uses).
* ``.. nccl-types::`` — the data types and reduction ops with their first releases.
* ``.. config-fields::`` — :class:`pynccl.Config`'s fields, their ``ncclConfig_t`` names
  and first releases (the table ``Config.to_struct`` checks against).
* ``.. cudart-functions::`` — the libcudart functions pynccl binds.
* A check of every docstring autodoc renders: an empty one is a warning, and so is one
  that names an NCCL function newer than the oldest release pynccl serves
  (:data:`OLDEST_SERVED`) without saying which release it requires (its ``major.minor``
  must appear in the text, as in "NCCL >= 2.19").
* Napoleon left out of attribute and data docstrings: pynccl writes their types as
  annotations, and their ``#:`` comments as prose ("A CUDA stream: None, an int ..."),
  which napoleon's Google style would read as "type: description".
* A check at the end of reading: every name in the ``__all__`` of each public module
  (:data:`PUBLIC_MODULES`) must be documented under that module's name; each one that is
  not is a warning, so ``sphinx-build -W`` fails.
* Public bases only: a class's private base (a mixin of a private module such as
  ``pynccl.comm._suspend``, or a name starting with ``_``) is shown as its own bases, so
  "Bases:" never names a class a reader cannot import.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from public_modules import PUBLIC_MODULES  # docs/_ext, on the path as this module is
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

#: The oldest libnccl pynccl serves (the README's range): what this has needs no note.
OLDEST_SERVED = (2, 18)

_logger = logging.getLogger(__name__)
_NCCL_NAME = re.compile(r"\bnccl[A-Z]\w*")


def _release(release: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in release)


class _Table(SphinxDirective):
    has_content = False
    widths = "auto"

    def rows(self) -> tuple[list[str], list[list[str]]]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        header, rows = self.rows()
        lines = [".. list-table::", "   :header-rows: 1", f"   :widths: {self.widths}", ""]
        for row in [header, *rows]:
            lines.append(f"   * - {row[0]}")
            lines.extend(f"     - {cell}" for cell in row[1:])
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="pynccl_docs"), 0, container)
        return list(container.children)


class NcclFunctions(_Table):
    widths = "30 14 56"

    def rows(self) -> tuple[list[str], list[list[str]]]:
        from pynccl.capi import PROTOTYPES

        rows = [
            [f"``{name}``", _release(proto.first), ", ".join(a for a, _ in proto.args) or "(none)"]
            for name, proto in sorted(PROTOTYPES.items(), key=lambda kv: (kv[1].first, kv[0]))
        ]
        return ["function", "requires NCCL ≥", "arguments"], rows


class CudartFunctions(_Table):
    def rows(self) -> tuple[list[str], list[list[str]]]:
        from pynccl.capi import CUDART_PROTOTYPES

        rows = [
            [f"``{name}``", ", ".join(a for a, _ in proto.args) or "(none)"]
            for name, proto in sorted(CUDART_PROTOTYPES.items())
        ]
        return ["function", "arguments"], rows


class NcclTypes(_Table):
    def rows(self) -> tuple[list[str], list[list[str]]]:
        from pynccl import DataType, RedOp

        rows: list[list[str]] = []
        for enum in (DataType, RedOp):
            for member in enum:
                rows.append(
                    [
                        f"``{enum.__name__}.{member.name}``",
                        f"``{member.c_name}``",
                        _release(member.first_release),
                    ]
                )
        return ["member", "C name", "requires NCCL ≥"], rows


_ATTRIBUTE_KINDS = ("attribute", "data")
_before_napoleon: dict[str, list[str]] = {}


def _save_attribute_doc(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    if what in _ATTRIBUTE_KINDS:
        _before_napoleon[name] = list(lines)


def _restore_attribute_doc(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    saved = _before_napoleon.pop(name, None)
    if what in _ATTRIBUTE_KINDS and saved is not None:
        lines[:] = saved


class ConfigFields(_Table):
    def rows(self) -> tuple[list[str], list[list[str]]]:
        from pynccl import Config
        from pynccl._capi.structs import CONFIG_FIELD_RELEASE

        rows = []
        for field, cname in Config.C_NAMES.items():
            first = CONFIG_FIELD_RELEASE[cname]
            shown = _release(first if first[2] else first[:2])
            rows.append([f"``{field}``", f"``{cname}``", shown])
        return ["field", "``ncclConfig_t`` field", "requires NCCL ≥"], rows


def _check_public_names(app: Sphinx, env: Any) -> None:
    documented = set(env.get_domain("py").objects)
    # A re-export of an object documented under another public module (pynccl.cuda's
    # StreamLike is pynccl.typing's) counts as documented: two entries would make every
    # cross-reference to it ambiguous.
    by_identity = set()
    for full in documented:
        mod, _, attr = full.rpartition(".")
        obj = getattr(importlib.import_module(mod), attr, None) if mod in PUBLIC_MODULES else None
        if obj is not None:
            by_identity.add(id(obj))
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            full = f"{module_name}.{name}"
            if full not in documented and id(getattr(module, name)) not in by_identity:
                _logger.warning(
                    "public name %s.%s (in its module's __all__) is not in the reference",
                    module_name,
                    name,
                )


def _is_type_doc(obj: Any, lines: list[str]) -> bool:
    import inspect

    doc = inspect.getdoc(type(obj))
    return bool(doc) and "\n".join(lines).strip() == doc.strip()


def _defining_comment(name: str, obj: Any) -> list[str]:
    """The ``#:`` comment of ``name``'s last part in the pynccl module that defines it."""
    import sys

    from sphinx.pycode import ModuleAnalyzer, PycodeError

    attr = name.rpartition(".")[2]
    for modname, module in sorted(sys.modules.items()):
        if not modname.startswith("pynccl") or getattr(module, attr, None) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except PycodeError:
            continue
        comment = docs.get(("", attr))
        if comment:
            return list(comment)
    return []


def _check_release_note(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    if what == "module":
        return
    if what in _ATTRIBUTE_KINDS and _is_type_doc(obj, lines):
        # autodoc fell back on the docstring of the value's type (str, dict): the name is
        # re-exported, and its #: comment sits where it is defined.
        lines[:] = _defining_comment(name, obj)
    if not any(line.strip() for line in lines):
        _logger.warning("%s has no docstring", name)
        return
    from pynccl.capi import PROTOTYPES

    text = "\n".join(lines)
    for cname in sorted(set(_NCCL_NAME.findall(text))):
        proto = PROTOTYPES.get(cname)
        if proto is None or tuple(proto.first[:2]) <= OLDEST_SERVED:
            continue
        needed = _release(proto.first[:2])
        if not re.search(rf"\b{re.escape(needed)}\b", text):
            _logger.warning(
                "%s names %s (first in NCCL %s) but does not say it requires NCCL >= %s",
                name,
                cname,
                _release(proto.first),
                needed,
            )


#: Re-exports documented under a second public module -> the entry they repeat. Marked as
#: aliases, so the inventory has them but an unqualified cross-reference (a signature's
#: ``StreamLike``) resolves to the original, not to two targets.
_REEXPORTS = {"pynccl.cuda.StreamLike": "pynccl.typing.StreamLike"}


def _mark_reexports(app: Sphinx, env: Any) -> None:
    objects = env.get_domain("py").objects
    for alias, original in _REEXPORTS.items():
        if alias in objects and original in objects:
            objects[alias] = objects[alias]._replace(aliased=True)


def _is_private(cls: Any) -> bool:
    module = getattr(cls, "__module__", "") or ""
    if not module.startswith("pynccl"):
        return False
    return cls.__name__.startswith("_") or any(p.startswith("_") for p in module.split("."))


def _public_bases(app: Any, name: str, obj: Any, options: Any, bases: list[Any]) -> None:
    """Replace each private base by its own bases (recursively), each class once."""
    out: list[Any] = []

    def add(cls: Any) -> None:
        if isinstance(cls, type) and _is_private(cls):
            for base in cls.__bases__:
                add(base)
        elif cls not in out:
            out.append(cls)

    for base in bases:
        add(base)
    if len(out) > 1 and object in out:
        out.remove(object)
    bases[:] = out or [object]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("nccl-functions", NcclFunctions)
    app.add_directive("cudart-functions", CudartFunctions)
    app.add_directive("nccl-types", NcclTypes)
    app.add_directive("config-fields", ConfigFields)
    # Napoleon's listener has the default priority, 500: save before it, restore after.
    app.connect("autodoc-process-docstring", _save_attribute_doc, priority=400)
    app.connect("autodoc-process-docstring", _restore_attribute_doc, priority=600)
    app.connect("autodoc-process-docstring", _check_release_note)
    app.connect("env-check-consistency", _check_public_names)
    app.connect("env-check-consistency", _mark_reexports)
    app.connect("autodoc-process-bases", _public_bases)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
