"""``python -m pynccl launch --flight-dir``: a 4-rank loopback job that hangs at operation #4
ends within the watchdog's timeout + 10 s, every rank's flight record is on disk (the
culprit's too), and ``python -m pynccl analyze`` names the culprit and #4 first."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.workers import _harness as h

WATCHDOG = 3.0


def _run(tmp_path: Path, mode: str, *extra: str, watchdog: float = WATCHDOG,
         code: int | None = None) -> tuple[float, str, Path]:  # fmt: skip
    flight = tmp_path / "flight"
    argv = h.launch(4, h.worker("flight.py"), "--mode", mode, "--watchdog", str(watchdog),
                    grace=2)  # fmt: skip
    argv[4:4] = ["--flight-dir", str(flight), "--dump-grace", "3", *extra]
    out = tmp_path / "out.txt"
    proc = h.start(argv, h.loopback_env(), out)
    try:
        warm = h.wait_for_output(out, lambda t: t.count("WARM ") == 4, timeout=60, procs=[proc])
        assert warm
        started = time.monotonic()
        ended = proc.wait(timeout=WATCHDOG + 30)
        took = time.monotonic() - started
    finally:
        h.stop([proc])
    text = out.read_text()
    assert ended != 0 if code is None else ended == code, text
    return took, text, flight


def _analyze(flight: Path) -> tuple[str, dict[str, object]]:
    run = [sys.executable, "-m", "pynccl", "analyze", str(flight)]
    env = h.loopback_env()
    first = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60, check=True)
    js = subprocess.run([*run, "--json"], env=env, capture_output=True, text=True, timeout=60,
                        check=True)  # fmt: skip
    return first.stdout.splitlines()[0], json.loads(js.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, culprit, first",
    [
        ("skip", 2, "rank 2 never issued operation #4 (ncclAllReduce 4096 x float32, op sum); "
                    "ranks 0, 1, 3 are waiting in it"),
        ("count", 1, "ranks disagree at operation #4: ranks 0, 2, 3 ncclAllReduce 4096 x "
                     "float32, op sum vs rank 1 ncclAllReduce 1024 x float32, op sum"),
        ("sleep", 3, "rank 3 never issued operation #4 (ncclAllReduce 4096 x float32, op sum); "
                     "ranks 0, 1, 2 are waiting in it"),
    ],
)  # fmt: skip
def test_launch_dumps_and_analyze_names_the_culprit(
    tmp_path: Path, mode: str, culprit: int, first: str
) -> None:
    took, text, flight = _run(tmp_path, mode)
    assert took < WATCHDOG + 10, (took, text)
    assert sorted(p.name for p in flight.glob("rank*.json")) == [f"rank{r}.json" for r in range(4)]
    dumps = {r: json.loads((flight / f"rank{r}.json").read_text()) for r in range(4)}
    for r, d in dumps.items():
        assert (d["format"], d["rank"], d["size"]) == ("pynccl-flight", r, 4)
        assert d["pid"] > 0 and d["host"] and d["comms"][0]["ops"][0]["seq"] == 1
    # the culprit issued 3 operations (skip, sleep) and all three completed
    ops = dumps[culprit]["comms"][0]["ops"]
    if mode != "count":
        assert [o["seq"] for o in ops] == [1, 2, 3]
        assert [o["state"] for o in ops] == ["completed"] * 3
        assert "time.sleep(600)" in dumps[culprit]["main_thread"][-1]
    line, verdict = _analyze(flight)
    assert line == first, text
    assert verdict["culprits"] == [culprit] and verdict["operation"] == 4
    assert f"flight records in {flight}" in text and first in text


@pytest.mark.slow
def test_timed_out_job_is_asked_for_its_records(tmp_path: Path) -> None:
    """No watchdog trips (100 s): the launcher's --timeout ends the job; the ranks waiting
    in synchronize() and the one asleep on the host all dump on SIGUSR1 first."""
    took, text, flight = _run(tmp_path, "sleep", "--timeout", "6", watchdog=100, code=124)
    assert "timed out after 6 s" in text and took < 6 + 10
    reasons = {json.loads(p.read_text())["reason"] for p in flight.glob("rank*.json")}
    assert len(list(flight.glob("rank*.json"))) == 4 and reasons <= {"signal SIGUSR1",
                                                                     "signal SIGTERM"}
    line, verdict = _analyze(flight)
    assert line.startswith("rank 3 never issued operation #4") and verdict["culprits"] == [3]
