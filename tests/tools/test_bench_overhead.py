"""scripts/bench_overhead.py runs through the public API and prints what it promises.

A smoke run of a few variants (two rounds of a few calls: the figures are not judged, the
shape of the report is): every selected variant with its floor, a ratio and a verdict, the
spread of the raw forms, the cost of ``with group(): pass`` and the summary of misses.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from support import ROOT

SCRIPT = ROOT / "scripts" / "bench_overhead.py"


def test_the_script_uses_only_the_public_api() -> None:
    # The object API's internals (comm/_codegen, _spec, ...) are being rewritten: the
    # benchmark measures what users write, so it imports nothing private of pynccl's.
    tree = ast.parse(SCRIPT.read_text())
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            modules.add(node.module or "")
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    ours = sorted(m for m in modules if m.startswith("pynccl"))
    assert ours == ["pynccl", "pynccl.testing"], ours


def test_a_quick_run_reports_every_selected_variant() -> None:
    forms = "enum|str|fresh|stream-int|CAI|DLPack|DevBuf|persistent"
    only = rf"^all_reduce ({forms})$|^send\+recv enum$|group"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "2", "--calls", "20", "--only", only],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(
            r"(\S+ \S+)\s+(\d+)(?:\s+([\d.]+)\s+([\d.]+)\s+<= ([\d.]+)x (ok|MISSED))?$", line
        )
        if m:
            rows[m.group(1)] = m.groups()[1:]
    want = {f"all_reduce {f}" for f in ("enum", "str", "fresh", "stream-int", "CAI", "DLPack",
                                        "DevBuf", "persistent")} | {"send+recv enum"}  # fmt: skip
    assert want <= set(rows), sorted(want - set(rows))
    # Each timed next to its floor, and only those floors besides.
    floors = {"all_reduce floor", "all_reduce floor(fresh)", "all_reduce floor(stream)",
              "all_reduce floor(CAI)", "all_reduce floor(DLPack)", "send+recv floor"}  # fmt: skip
    assert set(rows) == want | floors
    targets = {"enum": 1.2, "str": 1.2, "fresh": 1.2, "stream-int": 1.2, "CAI": 1.8,
               "DLPack": 1.8, "DevBuf": 1.8, "persistent": 0.8}  # fmt: skip
    for form, target in targets.items():
        _ns, ratio, _best, shown, verdict = rows[f"all_reduce {form}"]
        assert float(shown) == target
        if abs(float(ratio) - target) > 0.005:  # shown rounded: at the target it may say either
            assert verdict == ("ok" if float(ratio) <= target else "MISSED")
    assert rows["send+recv enum"][3] == "1.50"
    assert "spread between a row's raw forms" in out.stdout
    assert re.search(r"^  all_reduce\s+\d+%", out.stdout, re.M)
    assert re.search(r"^with group\(\): pass\s+[+-]\d+ (instructions|ns)", out.stdout, re.M)
    assert re.search(r"^\d+ target\(s\) missed", out.stdout, re.M)
