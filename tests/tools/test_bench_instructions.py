"""scripts/bench_instructions.py counts what it says, where valgrind is installed.

A short run (loops of 100 and 300 calls) of one variant and its floor: both counted, the
variant's ratio to its floor as printed is the quotient of the two counts, and the variant —
the same C call behind a Python method — costs more than the bare call. The script's child
loops are the ones ``bench_overhead.py`` times (its ``build_variants``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from support import ROOT

SCRIPT = ROOT / "scripts" / "bench_instructions.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("valgrind") is None,
                       reason="valgrind is not installed (apt-get install valgrind)"),
]  # fmt: skip


def test_a_variant_and_its_floor_are_counted_and_compared() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", r"^all_reduce enum$", "--calls", "100"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"(all_reduce \S+)\s+(\d+)(?:\s+([\d.]+)\s+<= ([\d.]+)x (ok|MISSED))?$", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    assert set(rows) == {"all_reduce floor", "all_reduce enum"}, out.stdout
    floor, enum = int(rows["all_reduce floor"][0]), int(rows["all_reduce enum"][0])
    assert 1_000 < floor < enum < 10 * floor  # a ctypes call is thousands of instructions
    _, ratio, target, verdict = rows["all_reduce enum"]
    assert abs(float(ratio) - enum / floor) <= 0.006  # printed with two decimals
    assert float(target) == 1.2
    assert verdict == ("ok" if enum / floor <= 1.2 else "MISSED")
