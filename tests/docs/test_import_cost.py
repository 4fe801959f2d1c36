"""What importing pynccl costs, held structurally (the timings are scripts/bench_import.py's).

Each check runs a fresh interpreter with ``-S -E`` (no site, so no editable-install finder
whose own imports would hide pynccl's) and records the modules a statement adds to
``sys.modules``: ``import pynccl`` adds nothing but the package, and the first use of the
object API leaves out the modules that cost milliseconds (``typing`` with ``re`` and
``contextlib``, ``dataclasses``, ``hashlib``, ``threading``, ...), the discovery rules and
the prototype tables (built on first load), the watchdog and everything above the object
layer. The lazy re-exports must give exactly the objects of the modules they come from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import ROOT

import pynccl

#: Standard-library modules that cost ~0.3-3 ms each and that no import of pynccl needs.
HEAVY_STDLIB = frozenset(
    {
        "argparse",
        "contextlib",
        "dataclasses",
        "hashlib",
        "importlib",
        "inspect",
        "json",
        "logging",
        "pathlib",
        "random",
        "re",
        "socket",
        "subprocess",
        "tempfile",
        "threading",
        "typing",
        "warnings",
        "weakref",
    }
)
THIRD_PARTY = frozenset({"numpy", "ml_dtypes", "torch", "cupy", "cuda", "nvidia"})
#: pynccl modules that the first use of the object API must not import.
LATER = (
    "pynccl._loader",  # library discovery: on first load
    "pynccl._capi.nccl",  # the prototype tables: on first load
    "pynccl._capi.nccl_device",
    "pynccl._capi.cudart",
    "pynccl.comm._watchdog",  # on start_watchdog()
    "pynccl.comm._from_env",
    "pynccl.bootstrap",
    "pynccl.perf",
    "pynccl.launch",
    "pynccl.info",
    "pynccl.testing",
    "pynccl.typing",
)


def added_modules(statement: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules ``statement`` adds to ``sys.modules`` in a fresh interpreter (with
    ``env`` added to this process's environment)."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import json; base = set(sys.modules)\n"
        f"{statement}\n"
        "print(json.dumps(sorted(set(sys.modules) - base)))"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-E", "-c", code],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
    ).stdout  # fmt: skip
    return set(json.loads(out.splitlines()[-1]))


def _later(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.startswith(LATER))


def _top(mods: set[str]) -> set[str]:
    return {m.partition(".")[0] for m in mods}


def test_import_pynccl_imports_only_the_package() -> None:
    assert added_modules("import pynccl") == {"pynccl"}


def test_first_use_of_the_object_api_leaves_out_heavy_modules() -> None:
    mods = added_modules("from pynccl import Communicator")
    assert "pynccl.comm._communicator" in mods  # the statement did import the object API
    assert sorted(mods & HEAVY_STDLIB) == []
    assert sorted(_top(mods) & THIRD_PARTY) == []
    assert _later(mods) == []


#: What the first collective may still import, and why: the communicator's finalizer
#: (``weakref.finalize``, comm/_handle.py) is made when it adopts its handle.
FIRST_CALL_ALLOWED = frozenset({"weakref"})
FIRST_COLLECTIVE = (
    "from pynccl import Communicator, DeviceBuffer, UniqueId\n"
    "comm = Communicator(1, UniqueId(), 0, device=0)\n"
    "buf = DeviceBuffer(1024, 'float32')\n"
    "comm.all_reduce(buf, buf)\n"
    "comm.synchronize()\n"
    "buf.close()\n"
    "comm.destroy()"
)


def test_first_collective_leaves_out_heavy_modules() -> None:
    # Loading the libraries, making a communicator and a buffer and issuing a collective
    # (on the loopback) import no regex engine (`re`), `warnings`, `threading` or
    # `contextlib` (~0.5-1.5 ms each): locks and thread-locals come from `_thread`,
    # warnings are imported only when there is one to give.
    from pynccl.testing import loopback

    mods = added_modules(FIRST_COLLECTIVE, loopback.env())
    assert {"pynccl._loader", "pynccl._capi.nccl", "pynccl.cuda._graph"} <= mods
    assert sorted(mods & HEAVY_STDLIB - FIRST_CALL_ALLOWED) == []
    assert sorted(_top(mods) & THIRD_PARTY) == []


@pytest.mark.parametrize(
    "statement",
    [
        "from pynccl import group",
        "from pynccl import lib, version",
        "from pynccl import NcclError, DataType, RedOp, as_datatype",
    ],
)
def test_light_names_need_no_ctypes(statement: str) -> None:
    mods = added_modules(statement)
    assert sorted(m for m in mods if m == "ctypes" or m.startswith("ctypes.")) == []
    assert sorted(mods & HEAVY_STDLIB) == []
    assert _later(mods) == []


def test_first_load_brings_in_the_tables() -> None:
    # The deferred modules are imported where they are needed: by the first load.
    mods = added_modules(
        "import pynccl.library as L\n"
        "try:\n"
        "    L.load_library('/nonexistent/libnccl.so.2')\n"
        "except Exception as e:\n"
        "    assert type(e).__name__ == 'LibraryNotFoundError', repr(e)\n"
        "else:\n"
        "    raise SystemExit('loaded a file that does not exist')"
    )
    assert {"pynccl._loader", "pynccl._capi.nccl", "pynccl._capi.nccl_device"} <= mods


def test_every_public_name_resolves_to_its_module_object() -> None:
    from pynccl import comm, cuda, dtypes, enums, errors, groups, library

    homes = {
        "comm": comm,
        "cuda": cuda,
        "dtypes": dtypes,
        "enums": enums,
        "errors": errors,
        "groups": groups,
        "library": library,
    }
    for name, module in pynccl._LAZY.items():
        assert getattr(pynccl, name) is getattr(homes[module], name), name
    assert set(pynccl.__all__) == set(pynccl._LAZY) | {"__version__"}
    assert set(pynccl.__all__) <= set(dir(pynccl))


def test_star_import_and_submodules_in_a_fresh_interpreter() -> None:
    # `from pynccl import *` resolves every lazy name; the submodules `import pynccl`
    # used to import eagerly are still attributes of the package.
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "import pynccl\n"
        "assert pynccl.errors.NcclError.__name__ == 'NcclError'\n"
        "assert pynccl.enums.DataType is pynccl.DataType\n"
        "assert pynccl.dtypes.as_datatype is pynccl.as_datatype\n"
        "ns = {}\n"
        "exec('from pynccl import *', ns)\n"
        "missing = sorted(set(pynccl.__all__) - set(ns))\n"
        "assert not missing, missing\n"
        "print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-E", "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'pynccl' has no attribute 'no_such_name'"):
        pynccl.no_such_name  # noqa: B018
    assert not hasattr(pynccl, "comm_typo")
