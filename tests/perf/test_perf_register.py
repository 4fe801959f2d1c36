"""``python -m pynccl perf -R 1|2`` on the loopback: nccl-tests' local_register (buffers from
ncclMemAlloc, registered with ncclCommRegister, or in symmetric windows), results checked
against numpy, and its refusals (an unknown level, a library too old for it)."""

from __future__ import annotations

from typing import Any

import pytest
from support.perf import run_perf, table_rows


@pytest.fixture(scope="module")
def loopback_ready(lb_env: dict[str, str]) -> None:
    """The loopback is built (cached) before the runs, or they skip saying why."""


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
@pytest.mark.parametrize(
    "flags",
    [
        ("-R", "1"),
        ("-R", "2"),
        ("all_gather", "-R", "2", "-u", "1"),
        ("reduce_scatter", "-R", "1", "-G", "2", "-g", "4"),  # registered buffers in graphs
        ("all_to_all", "-R", "2", "-m", "2"),
    ],
)
def test_registered_runs_check_out(flags: tuple[str, ...]) -> None:
    proc = run_perf(*flags, "-b", "4K", "-e", "64K", "-f", "4", "-n", "2", "-c", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    assert [r[0] for r in rows] == ["4096", "16384", "65536"]
    assert all(r[8] == "0" for r in rows), proc.stdout
    assert "# Out of bounds values : 0 OK" in proc.stdout


@pytest.mark.usefixtures("loopback_ready")
def test_unknown_level_is_refused() -> None:
    proc = run_perf("-R", "3")
    assert proc.returncode == 2
    assert "-R 3: expected 0 (plain buffers), 1 (registered) or 2 (symmetric windows)" in (
        proc.stderr
    )


@pytest.mark.parametrize(
    ("level", "what"),
    [
        ("2", "-R 2: symmetric windows (ncclMemAlloc, ncclCommWindowRegister) need NCCL >= 2.27.3; "
         "the loaded libnccl is 2.24.3"),
        ("1", None),  # 2.24.3 has ncclCommRegister (2.19)
    ],
)  # fmt: skip
def test_levels_need_their_release(level: str, what: str | None) -> None:
    from support.worlds import loopback_build

    from pynccl.testing import loopback

    loopback_build("2.24.3")
    env: dict[str, Any] = dict(loopback.env("2.24.3"))
    proc = run_perf("-R", level, "-b", "4K", "-e", "4K", "-n", "1", extra_env=env)
    if what is None:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "# Out of bounds values : 0 OK" in proc.stdout
    else:
        assert proc.returncode != 0
        assert what in proc.stdout + proc.stderr
