"""Child Python processes for the tests: one run that must succeed, or ranks started together.

A library is loaded process-wide (libnccl, libcudart) and a job needs several processes,
so many tests run their code in fresh interpreters; these helpers start them alike, bound
every wait (120 s by default) and never leave one running.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_python(
    args: Sequence[str], env: Mapping[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python *args`` from the repository root with exactly ``env``; it must exit 0
    (a failure shows the child's stderr)."""
    proc = subprocess.run(
        [sys.executable, *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    """The JSON document a child printed as its last line of output."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_ranks(
    args: Sequence[str], envs: Sequence[Mapping[str, str]], timeout: float = 120
) -> list[tuple[int, str, str]]:
    """``python *args`` once per environment of ``envs``, all started before any is
    waited for (the ranks of one job); ``(returncode, stdout, stderr)`` of each. Each
    wait is bounded by ``timeout``; whatever still runs afterwards is killed."""
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def result_line(out: str) -> str:
    """The last line a rank printed starting with ``RESULT `` (IndexError: none)."""
    return [line for line in out.splitlines() if line.startswith("RESULT ")][-1]
