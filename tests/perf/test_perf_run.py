"""``python -m pynccl perf`` runs on the loopback: nccl-tests' flags doing what they do there,
integer avg, -T per wait, and the progress line (shown on a terminal, quiet when piped)."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.perf import perf_env, run_perf, table_rows


@pytest.fixture(scope="module")
def loopback_ready(lb_env: dict[str, str]) -> None:
    """The loopback is built (cached) before the runs, or they skip saying why."""


def _skip_if_avg_refused(proc: subprocess.CompletedProcess[str]) -> None:
    if proc.returncode != 0 and "op 'avg' is not defined for integer type" in proc.stderr:
        pytest.skip("this branch's object API refuses integer avg (the comm rebuild accepts it)")


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_integer_avg_and_all_ops_keep_it() -> None:
    # -o all on an integer type: every op, avg included (NCCL's: sum / nranks, truncated
    # toward zero), each checked against numpy on 3 ranks (so the division is not exact).
    proc = run_perf("-g", "3", "-o", "all", "-d", "int32,uint8", "-b", "96", "-e", "96K",
                    "-f", "32", "-n", "1", "-w", "0", "-c", "1")  # fmt: skip
    _skip_if_avg_refused(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    ops = [(r[2], r[3]) for r in rows]
    for dtype in ("int32", "uint8"):
        for op in ("sum", "prod", "max", "min", "avg", "mulsum"):
            assert ops.count((dtype, op)) == 3
    assert all(r[8] == "0" and r[12] == "0" for r in rows)
    avg = run_perf("-g", "2", "-o", "avg", "-d", "int32", "-b", "1K", "-e", "1K", "-n", "1")
    assert avg.returncode == 0, avg.stderr
    assert [r[3] for r in table_rows(avg.stdout)] == ["avg"]


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
@pytest.mark.parametrize(
    "flags",
    [
        # aggregated iterations in one group, wait and barrier after each, NULL stream,
        # misaligned buffers, two cycles
        ("-m", "2", "-z", "1", "-y", "1", "-u", "3", "-N", "2", "-d", "half"),
        ("all_gather", "-m", "3", "-z", "2", "-u", "1", "-d", "int64"),
        ("reduce_scatter", "-z", "3", "-a", "3", "-G", "0", "-o", "max"),
        ("all_to_all", "-G", "2", "-m", "2", "-t", "2", "-g", "1"),  # graphs of groups
    ],
)
def test_nccl_tests_flags_run_and_check(flags: tuple[str, ...]) -> None:
    proc = run_perf(*flags, "-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "-c", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    cycles = 2 if "-N" in flags else 1
    assert [r[0] for r in rows] == ["1024", "4096", "16384"] * cycles
    assert all(r[8] == "0" for r in rows), proc.stdout
    assert "# Out of bounds values : 0 OK" in proc.stdout
    if "-m" in flags:
        assert f"agg iters: {flags[flags.index('-m') + 1]} " in proc.stdout
    if "-u" in flags:
        assert f"unalign: {flags[flags.index('-u') + 1]}" in proc.stdout
    if "-z" in flags:
        assert "# Blocking Enabled:" in proc.stdout
    if "-t" in flags:
        assert "# nThread 2 nGpus 1 " in proc.stdout
        assert proc.stdout.count("#  Rank ") == 2


@pytest.mark.usefixtures("loopback_ready")
def test_ngpus_in_the_header_follows_g() -> None:
    proc = run_perf("-g", "3", "-b", "64", "-e", "64", "-n", "1")
    assert proc.returncode == 0, proc.stderr
    assert "# nThread 1 nGpus 3 " in proc.stdout
    assert [line.split()[2] for line in proc.stdout.splitlines() if "#  Rank" in line] == [
        "0",
        "1",
        "2",
    ]


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_timeout_bounds_each_wait_not_the_run(tmp_path: Path) -> None:
    # -T 2 on a sweep of over 3 s (both ranks pause 0.5 s on the host before each of its
    # 6 rows, outside any wait): fine, no single wait takes that long.
    slow = tmp_path / "slow" / "sitecustomize.py"
    slow.parent.mkdir()
    slow.write_text(
        textwrap.dedent("""
        import time
        from pynccl.perf import _bench
        _orig = _bench._Bench._row
        def _row(self, *a, **k):
            time.sleep(0.5)
            return _orig(self, *a, **k)
        _bench._Bench._row = _row
    """)
    )
    env = {"PYTHONPATH": os.pathsep.join((str(slow.parent), str(ROOT)))}
    start = time.monotonic()
    proc = run_perf("-g", "2", "-T", "2", "-b", "1K", "-e", "32K", "-f", "2", "-n", "2",
                    extra_env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(table_rows(proc.stdout)) == 6
    assert time.monotonic() - start > 3
    # A rank that stops answering: its peer's wait times out, as nccl-tests says it.
    hook = tmp_path / "hook" / "sitecustomize.py"
    hook.parent.mkdir()
    hook.write_text(
        textwrap.dedent("""
        import os, time
        if os.environ.get("RANK") == "1":
            from pynccl.perf import _bench
            _orig = _bench._Bench.run_case
            def run_case(self, *a, **k):
                time.sleep(60)  # never joins the sweep's collectives in time
            _bench._Bench.run_case = run_case
    """)
    )
    env = {"PYTHONPATH": os.pathsep.join((str(hook.parent), str(ROOT)))}
    start = time.monotonic()
    proc = run_perf("-g", "2", "-T", "2", "-b", "1K", "-e", "1K", "-n", "1", extra_env=env)
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Test timeout (2s) on rank 0" in proc.stdout
    assert "a wait took longer than -T 2 s" in proc.stderr
    assert took < 40, took


class _FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from pynccl.perf import _report

    err = _FakeTty()
    monkeypatch.setattr(sys, "stderr", err)
    with _report._progress("building", delay=0.0):
        time.sleep(1.3)
    text = err.getvalue()
    assert "\r# building ... 0 s" in text and "\r# building ... 1 s" in text
    assert text.endswith("\r\x1b[K")  # taken off at the end
    out = io.StringIO()
    console = _report._Console(out, total=2)
    console.line("   row 1")
    assert "\r# 1/2 rows done, 0 s ..." in err.getvalue()
    console.close()
    assert out.getvalue() == "   row 1\n"  # the table itself never holds the status line


def test_loopback_build_shows_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    from pynccl.perf import _run
    from pynccl.testing import loopback

    err = _FakeTty()
    monkeypatch.setattr(sys, "stderr", err)

    def slow_env(*_a: Any, **_k: Any) -> dict[str, str]:
        time.sleep(1.2)
        return {"X": "1"}

    monkeypatch.setattr(loopback, "env", slow_env)
    assert _run._loopback_env() == {"X": "1"}
    assert "# preparing pynccl's loopback libraries (compiled on first use) ... 1 s" in (
        err.getvalue()
    )


def test_quiet_when_piped() -> None:
    err = io.StringIO()  # not a terminal
    from pynccl.perf import _report

    old, sys.stderr = sys.stderr, err
    try:
        with _report._progress("building", delay=0.0):
            time.sleep(0.1)
        console = _report._Console(io.StringIO(), total=1)
        console.line("row")
        console.close()
    finally:
        sys.stderr = old
    assert err.getvalue() == ""


@pytest.mark.usefixtures("loopback_ready")
def test_rows_and_progress_through_the_launcher_on_a_terminal() -> None:
    # stderr on a pseudo-terminal, stdout piped: the status line goes to the terminal
    # only, and each row reaches stdout as soon as it is done.
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pynccl", "perf", "-g", "2", "-b", "1K", "-e", "4K", "-f", "2",
         "-n", "2"],
        env=perf_env(),
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    out, _ = proc.communicate(timeout=120)
    tty = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        tty += chunk
    os.close(master)
    assert proc.returncode == 0
    assert "\r" not in out and "rows done" not in out
    assert b"/3 rows done" in tty
    assert len(table_rows(out)) == 3
