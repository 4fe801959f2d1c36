"""Init that names who is missing: while ``Communicator(...)`` blocks in
``ncclCommInitRank``, a line on stderr every ``PYNCCL_INIT_REPORT`` seconds naming the ranks
that have not called init (the loopback tells; real NCCL does not), and the loopback's own
NCCL-shaped WARN lines (NCCL_DEBUG=WARN) saying the same, and at its init timeout."""

from __future__ import annotations

import _thread
import re
import sys
import threading
import time
from typing import Any

import pytest
from support.child import run_ranks

from pynccl.comm import Communicator, UniqueId
from pynccl.comm._init_report import UNKNOWN, init_report

LINE = re.compile(
    r"^pynccl init: rank (\d) has waited (\d+) s in ncclCommInitRank for a communicator of "
    r"size 3; rank 2 of 3 has not arrived; arrived: ranks 0-1$"
)


def _report_threads() -> int:
    """Threads started through ``_thread`` still alive (the report's timer is one)."""
    return int(_thread._count())


def test_waiting_ranks_name_the_late_rank_then_init_completes(
    lb: Any, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_INIT_REPORT", "0.5")
    before = _report_threads()
    uid = UniqueId()
    comms: dict[int, Communicator] = {}

    def rank(r: int) -> None:
        comms[r] = Communicator(3, uid, r, device=r)

    early = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in early:
        t.start()
    time.sleep(2.2)  # rank 2 is late: about four lines from each of ranks 0 and 1
    assert _report_threads() == before + 4  # two ranks, two timers
    late = threading.Thread(target=rank, args=(2,))
    late.start()
    for t in [*early, late]:
        t.join(30)
    try:
        assert sorted(comms) == [0, 1, 2]
        assert [c.size for c in comms.values()] == [3, 3, 3]
    finally:
        for c in comms.values():
            c.destroy()
    assert _report_threads() == before
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("pynccl init:")]
    by_rank: dict[int, list[int]] = {0: [], 1: []}
    for ln in lines:
        m = LINE.match(ln)
        assert m, ln
        by_rank[int(m.group(1))].append(int(m.group(2)))
    for r, waited in by_rank.items():
        assert len(waited) >= 2, (r, err)
        assert waited == sorted(waited) and waited[-1] <= 3, (r, waited)


def test_no_lines_and_no_thread_when_off(
    lb: Any, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_INIT_REPORT", "0")
    before = _report_threads()
    with Communicator(1, UniqueId(), 0, device=0) as comm:
        assert comm.size == 1
    assert "pynccl init:" not in capfd.readouterr().err
    assert _report_threads() == before


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_malformed_interval_is_refused_before_init(
    lb: Any, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("PYNCCL_INIT_REPORT", value)
    before = _report_threads()
    with pytest.raises(ValueError, match="PYNCCL_INIT_REPORT") as info:
        Communicator(1, UniqueId(), 0, device=0)
    assert value in str(info.value)
    assert _report_threads() == before


class _RealNccl:
    """A library without the loopback's hook, as real NCCL is."""

    def extension(self, name: str) -> None:
        assert name == "pynccl_lb_init_missing"


def test_real_nccl_says_it_cannot_know(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_INIT_REPORT", "0.2")
    before = _report_threads()
    with init_report(_RealNccl(), bytes(128), 4, 16):  # type: ignore[arg-type]
        time.sleep(0.5)
    err = capfd.readouterr().err.splitlines()
    assert err, "no line written"
    for ln in err:
        assert ln.startswith(
            "pynccl init: rank 4 has waited 0 s in ncclCommInitRank for a communicator of size 16; "
        ), ln
        assert ln.endswith(UNKNOWN)
        assert "NCCL_RAS" in ln and "python -m pynccl ras" in ln
    assert _report_threads() == before


_RANK = r"""
import os, sys
from pynccl.comm import Communicator, UniqueId
from pynccl.errors import NcclError
rank = int(os.environ["RANK_ARG"])
try:
    Communicator(3, UniqueId.from_bytes(bytes.fromhex(sys.argv[1])), rank, device=rank)
except NcclError as e:
    print("RESULT released", type(e).__name__, flush=True)
else:
    print("RESULT made", flush=True)
"""


@pytest.mark.slow
def test_processes_name_the_rank_that_never_calls_init(lb: Any, lb_env: dict[str, str]) -> None:
    env = {
        **lb_env,
        "PYNCCL_INIT_REPORT": "1",
        "PYNCCL_LOOPBACK_INIT_TIMEOUT": "3.5",
        "NCCL_DEBUG": "WARN",
    }
    uid = bytes(UniqueId()).hex()
    started = time.monotonic()
    # ranks 0 and 1 of 3 start together; rank 2 never does
    results = run_ranks(["-c", _RANK, uid], [{**env, "RANK_ARG": str(r)} for r in (0, 1)], 60)
    assert time.monotonic() - started < 60
    assert len(results) == 2
    for r, (rc, out, err) in enumerate(results):
        assert "not a variable pynccl reads" not in err
        assert rc == 0, err
        assert "RESULT released" in out, (out, err)
        py = [ln for ln in err.splitlines() if ln.startswith("pynccl init:")]
        assert len(py) >= 2, err
        for ln in py:
            m = LINE.match(ln)
            assert m and int(m.group(1)) == r, ln
        warn = [ln for ln in err.splitlines() if " NCCL WARN ncclCommInitRank : rank" in ln]
        assert any(
            re.search(
                rf"\[{r}\] initwait\.c:\d+ NCCL WARN ncclCommInitRank : rank {r} has waited "
                r"\d+ s for rank 2 of 3 to join \(arrived: 0-1; PYNCCL_INIT_REPORT\)$",
                ln,
            )
            for ln in warn
        ), err
    # the rank that reaches the timeout first says it gives up; the other sees it broken
    assert any(
        re.search(
            r"NCCL WARN ncclCommInitRank : rank \d has waited [34] s for rank 2 of 3 to "
            r"join, giving up \(arrived: 0-1;",
            ln,
        )
        for _, _, err in results
        for ln in err.splitlines()
    ), results


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
