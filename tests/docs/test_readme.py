"""The README's runnable parts stay true: the low-level example runs, Quick start has two lines."""

from __future__ import annotations

import re
import subprocess
import sys

from support import ROOT

README = (ROOT / "README.md").read_text()


def test_quick_start_holds_two_commands() -> None:
    block = re.search(r"## Quick start\n.*?```sh\n(.*?)```", README, re.S)
    assert block is not None
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) == 2
    assert lines[0].endswith("python -m pynccl perf")
    assert "pytest" in lines[1] and "[test]" in lines[1]


def test_low_level_example_runs_on_the_loopback() -> None:
    section = README[README.index("## The low-level layer") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None and "ncclAllReduce" in code.group(1)
    proc = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(2, 32, 3)" in proc.stdout
