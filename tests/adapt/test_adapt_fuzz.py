"""Fuzzing as_buffer with malformed ``__cuda_array_interface__`` dicts, DLPack capsules and
raw-pointer arguments (tests/support/fuzz_adapt.py), in a child process: a crash there (the
SIGSEGVs an unchecked ndim or NULL shape pointer gave) fails this test instead of
killing pytest.

The child asserts, case by case, that each input is either accepted with a usable result
or refused with TypeError/ValueError naming the buffer; here we check that it finished
cleanly and that the fuzz was not vacuous (it both accepted and refused inputs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from support import ROOT, SUPPORT

EXAMPLES = 150  # per fuzz; derandomized, so every run tries the same cases (~3 s in all)


def test_fuzz_as_buffer_never_crashes() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "faulthandler",
            str(SUPPORT / "fuzz_adapt.py"),
            str(EXAMPLES),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode < 0:
        died = signal.Signals(-proc.returncode).name
        raise AssertionError(f"the fuzz child died of {died}:\n{proc.stderr[-4000:]}")
    assert proc.returncode == 0, proc.stderr[-6000:]
    runs = {entry["fuzz"]: entry for entry in map(json.loads, proc.stdout.splitlines())}
    assert set(runs) == {"fuzz_cai", "fuzz_dlpack", "fuzz_raw"}
    for name, outcomes in runs.items():
        assert outcomes.get("accepted", 0) > 0, (name, outcomes)
        assert outcomes.get("TypeError", 0) > 0 and outcomes.get("ValueError", 0) > 0, (
            name,
            outcomes,
        )
