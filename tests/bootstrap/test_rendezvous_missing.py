"""Who is missing from a rendezvous: rank 0 names the ranks that have not arrived (and the
hosts of those that did) every ``PYNCCL_RENDEZVOUS_REPORT`` seconds, at the timeout and in
the timeout error; a waiting rank says that rank 0 is the one missing."""

from __future__ import annotations

import re
import threading
import time

import pytest
from support.workers._harness import free_port

from pynccl.bootstrap import RendezvousTimeoutError, TcpRendezvous, TcpRendezvousServer
from pynccl.bootstrap._progress import report_interval

HOST = "127.0.0.1"
KEY = "missing-test-key"


def _fetch(port: int, rank: int, world_size: int, timeout: float = 10.0) -> bytes:
    return TcpRendezvous(HOST, port, KEY).fetch(rank=rank, world_size=world_size, timeout=timeout)


@pytest.mark.slow
def test_rank_zero_names_the_ranks_that_never_arrive(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_RENDEZVOUS_REPORT", "0.4")
    server = TcpRendezvousServer(
        b"id", host=HOST, port=0, world_size=8, key=KEY, timeout=2.5
    ).start()
    port = server.address[1]
    # ranks 1, 3 and 4 arrive; 2 and 5-7 never do
    fetchers = [threading.Thread(target=_fetch, args=(port, r, 8)) for r in (1, 3, 4)]
    for t in fetchers:
        t.start()
    for t in fetchers:
        t.join(10)
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as info:
        server.wait()
    server.close()
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert "ranks 2, 5-7 of 8 did not fetch the id" in message
    assert "arrived: ranks 1, 3-4 from 127.0.0.1" in message
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("pynccl rendezvous: rank 0 at")]
    waiting = [ln for ln in lines if "giving up" not in ln]
    assert len(waiting) >= 3, err  # about one every 0.4 s over 2.5 s
    for line in lines:
        assert "ranks 2, 5-7 of 8 have not arrived after" in line, line
        assert "arrived: ranks 1, 3-4 from 127.0.0.1" in line, line
    assert "giving up" in lines[-1], lines
    assert re.search(r"after [23] s", lines[-1]), lines[-1]


@pytest.mark.slow
def test_zero_turns_the_progress_lines_off(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_RENDEZVOUS_REPORT", "0")
    server = TcpRendezvousServer(
        b"id", host=HOST, port=0, world_size=2, key=KEY, timeout=1.0
    ).start()
    with pytest.raises(RendezvousTimeoutError, match=r"rank 1 of 2 .*arrived: none"):
        server.wait()
    server.close()
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "pynccl rendezvous" in ln]
    assert len(lines) == 1 and "giving up" in lines[0], lines
    assert "rank 1 of 2 has not arrived" in lines[0]


@pytest.mark.slow
def test_a_waiting_rank_says_rank_zero_is_missing(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYNCCL_RENDEZVOUS_REPORT", "0.3")
    port = free_port()
    with pytest.raises(RendezvousTimeoutError):
        _fetch(port, 2, 4, timeout=1.5)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("pynccl rendezvous: rank 2:")]
    assert len(lines) >= 2, err
    assert f"rank 0 at {HOST}:{port} has not served the id after" in lines[0]


@pytest.mark.parametrize("text", ["soon", "-1", "inf", "nan"])
def test_a_bad_interval_is_named(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("PYNCCL_RENDEZVOUS_REPORT", text)
    with pytest.raises(ValueError, match="PYNCCL_RENDEZVOUS_REPORT"):
        report_interval()
    with pytest.raises(ValueError, match="PYNCCL_RENDEZVOUS_REPORT"):
        TcpRendezvousServer(b"id", host=HOST, port=0, world_size=2, key=KEY)


def test_interval_default_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYNCCL_RENDEZVOUS_REPORT", raising=False)
    assert report_interval() == 30.0
    assert report_interval(2) == 2.0
    with pytest.raises(ValueError, match=r"report_interval=-2"):
        report_interval(-2)
