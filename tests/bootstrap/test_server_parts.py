"""The rendezvous server's shape (issue 22): composed of plain parts, each module small.

* ``tcp_server.py`` runs the selector loop; ``_admission.py`` decides who holds a slot
  (lobby, slots, eviction, the listener); ``_handshake.py`` speaks the protocol on one
  connection. Each module is at most 400 lines and each function at most 60 lines of code.
* The parts are plain classes (no base class, no ``super()``), and no module reads a
  private name off anything but ``self``/``cls``: the parts use each other's public surface.
* What the server counts of its parts is public: ``evicted``.
"""

from __future__ import annotations

import ast
import socket
import time

import pytest
from support import ROOT

from pynccl.bootstrap import TcpRendezvous, TcpRendezvousServer

BOOTSTRAP = ROOT / "pynccl" / "bootstrap"
SERVER = {
    "tcp_server": ["TcpRendezvousServer"],
    "_admission": ["Admission"],
    "_handshake": ["Handshake"],
}
HOST = "127.0.0.1"
KEY = "parts-test-key"


def _tree(module: str) -> ast.Module:
    return ast.parse((BOOTSTRAP / f"{module}.py").read_text())


def _code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = (fn.end_lineno or fn.lineno) - fn.lineno + 1
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        lines -= (first.end_lineno or first.lineno) - first.lineno + 1
    return lines


@pytest.mark.parametrize("module", sorted(SERVER))
def test_server_modules_and_functions_are_small(module: str) -> None:
    n = len((BOOTSTRAP / f"{module}.py").read_text().splitlines())
    assert n <= 400, f"{module}.py has {n} lines (at most 400)"
    long = [
        f"{node.name}: {_code_lines(node)} lines"
        for node in ast.walk(_tree(module))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > 60
    ]
    assert not long, f"{module}.py: functions over 60 lines: {long}"


def _foreign_private_reads(tree: ast.Module) -> list[str]:
    """``x._name`` where ``x`` is not ``self``/``cls`` (dunders aside)."""
    return [
        f"{ast.unparse(node)} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]


@pytest.mark.parametrize("module", sorted(SERVER))
def test_server_parts_use_each_others_public_surface(module: str) -> None:
    tree = _tree(module)
    assert not _foreign_private_reads(tree)
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for name in SERVER[module]:
        assert classes[name].bases == [], f"{module}.{name} has bases: a part is a plain class"
        calls = [n for n in ast.walk(classes[name]) if isinstance(n, ast.Call)]
        assert not any(isinstance(c.func, ast.Name) and c.func.id == "super" for c in calls)


def test_the_private_read_check_finds_one() -> None:
    tree = ast.parse("def f(self, a):\n    return self._x, a._y, self._z._w, a.__len__\n")
    assert _foreign_private_reads(tree) == ["a._y (line 2)", "self._z._w (line 2)"]


def test_server_counts_the_connections_it_displaced() -> None:
    # one slot: a silent connection holds it, then a rank arrives and displaces it after the
    # 0.5 s grace (the class docstring's policy); the count is what bench_rendezvous prints
    payload = b"p" * 128
    server = TcpRendezvousServer(
        payload, host=HOST, port=0, world_size=2, key=KEY, timeout=30.0, max_connections=1
    ).start()
    try:
        assert server.evicted == 0
        with socket.create_connection(server.address) as idle:
            time.sleep(0.1)  # the idle connection takes the slot first
            start = time.monotonic()
            got = TcpRendezvous(HOST, server.address[1], KEY).fetch(
                rank=1, world_size=2, timeout=30.0
            )
            waited = time.monotonic() - start
            server.wait(30.0)
            assert idle.recv(1) == b""  # closed by the server
    finally:
        server.close()
    assert got == payload
    assert server.evicted == 1
    assert 0.3 <= waited < 10.0, waited
