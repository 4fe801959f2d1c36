"""Surviving failure, end to end on the loopback libraries with separate processes.

* a rank SIGKILLed while the others wait in a collective: they get NcclRemoteError from
  ``synchronize(timeout=...)``, the launcher exits nonzero naming the dead rank;
* a rank that dies between the id exchange and joining: init fails on the others;
* an operation hung by fault injection: the watchdog aborts, or ``synchronize(timeout=)``
  times out, naming the operation; the peer learns of the abort;
* an asynchronous error injected on one rank reaches the others as NcclRemoteError;
* a non-blocking init observed with ``wait_ready(timeout=)``.

Each scenario also checks that nothing is left: no process (nor anything in the
workers' process groups), no ``/dev/shm`` segment of the job. Workers live in
``tests/support/workers/``; every wait is bounded and every process is killed in a ``finally``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from support.workers import _harness as h


def _fields(text: str, tag: str, ranks: range) -> dict[int, dict[str, str]]:
    found = h.markers(text, tag)
    assert h.markers(text, "FAIL") == {}, text
    assert sorted(found) == list(ranks), f"expected {tag} from ranks {list(ranks)}:\n{text}"
    return found


def _words(message: str) -> str:
    """A marker's message back as text (the worker joined its words with ``|``)."""
    return message.replace("|", " ")


# -- a rank killed while the others are in a collective --------------------------------------------


@pytest.mark.slow
def test_peer_killed_mid_collective(tmp_path: Path) -> None:
    nproc, victim = 4, 3
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    argv = h.launch(nproc, h.worker("peer_death.py"), "--victim", str(victim), grace=60)
    proc = h.start(argv, h.loopback_env(), out, err)
    pids: set[int] = set()
    try:
        survivors = range(victim)

        def blocked(text: str) -> bool:
            return len(h.markers(text, "READY")) == nproc and sorted(
                h.markers(text, "BLOCKED")
            ) == list(survivors)

        text = h.wait_for_output(out, blocked, procs=[proc])
        ready = h.markers(text, "READY")
        pids = {int(f["pid"]) for f in ready.values()}
        shm = {n for pid in pids for n in h.mapped_shm(pid)}
        assert shm, "the ranks map no /dev/shm/pynccl* segment: is the loopback in use?"
        os.kill(int(ready[victim]["pid"]), signal.SIGKILL)

        (code,) = h.wait_all([proc])
        text, errors = out.read_text(), err.read_text()
        assert code == 128 + signal.SIGKILL, f"{text}\n{errors}"
        assert f"rank {victim} failed (killed by SIGKILL)" in errors, errors
        for rank, f in _fields(text, "PEER-ERROR", survivors).items():
            assert f["error"] == "NcclRemoteError", (rank, f)
            message = _words(f["message"])
            # the error carries the flight record: what was in flight on this rank
            assert "ncclAllReduce count=1024 dtype=ncclFloat32" in message, message
        h.assert_nothing_running(pids | {proc.pid})
        h.assert_no_shm(shm)
    finally:
        h.stop([proc], pids)


# -- a rank that dies before joining ---------------------------------------------------------------


@pytest.mark.slow
def test_peer_dies_before_joining(tmp_path: Path) -> None:
    size, victim = 3, 2
    port, key = h.free_port(), h.new_key()
    outs = [tmp_path / f"rank{r}.txt" for r in range(size)]
    procs = []
    try:
        for r in range(size):
            env = h.loopback_env(
                RANK=str(r),
                WORLD_SIZE=str(size),
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                PYNCCL_RENDEZVOUS_KEY=key,
                PYNCCL_LOOPBACK_INIT_TIMEOUT="3",
            )
            argv = h.python(h.worker("peer_death.py"), "--victim", str(victim), "--when", "init")
            procs.append(h.start(argv, env, outs[r]))
        # While the survivors wait in init for the victim, note the segment they share.
        shm: set[str] = set()
        deadline = time.monotonic() + h.WAIT
        while not shm and time.monotonic() < deadline:
            if all(p.poll() is not None for p in procs):
                break
            shm = set().union(*(h.mapped_shm(p.pid) for p in procs[:victim]))
            time.sleep(0.01)
        codes = h.wait_all(procs)
        texts = [o.read_text() for o in outs]
        assert codes[victim] == -signal.SIGKILL, texts[victim]
        assert codes[:victim] == [0] * victim, "\n".join(texts)
        found = _fields("".join(texts), "INIT-ERROR", range(victim))
        for rank, f in found.items():
            assert f["error"] == "NcclRemoteError", (rank, f)
            assert f"waiting for rank {victim} of {size} to join" in _words(f["message"]), f
        assert shm, "the survivors never mapped a /dev/shm/pynccl* segment"
        h.assert_nothing_running(p.pid for p in procs)
        h.assert_no_shm(shm)
    finally:
        h.stop(procs)


# -- injected faults: hangs, the watchdog, asynchronous errors -------------------------------------

LAST_OP = "ncclAllGather count=5 dtype=ncclFloat64"
FIRST_OP = "#1 ncclAllReduce count=8 dtype=ncclFloat32 op=sum"  # numbered from #1


def _run_faults(tmp_path: Path, mode: str) -> dict[int, dict[str, str]]:
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    sync = tmp_path / "barrier"
    sync.mkdir()
    argv = h.launch(2, h.worker("faults.py"), "--mode", mode, "--sync-dir", str(sync))
    proc = h.start(argv, h.loopback_env(), out, err)
    pids: set[int] = set()
    try:
        (code,) = h.wait_all([proc])  # bounded: a rank hanging at exit fails here
        text = out.read_text()
        pids = {int(f["pid"]) for f in h.markers(text, "READY").values()}
        assert code == 0, f"{text}\n{err.read_text()}"
        assert "Traceback" not in err.read_text(), err.read_text()
        found = _fields(text, "RESULT", range(2))
        h.assert_nothing_running(pids | {proc.pid})
        return found
    finally:
        h.stop([proc], pids)


@pytest.mark.slow
def test_watchdog_aborts_a_hung_operation(tmp_path: Path) -> None:
    results = _run_faults(tmp_path, "watchdog")
    hung, peer = results[1], results[0]
    assert hung["error"] == "NcclTimeoutError", hung
    assert hung["state"] == "aborted"
    # the next call raises the very error the watchdog recorded, with the flight record
    assert hung["next"] == "NcclTimeoutError" and hung["same"] == "True", hung
    message = _words(hung["message"])
    assert "watchdog aborted the communicator" in message, message
    assert f"#2 {LAST_OP}" in message and FIRST_OP in message, message
    assert hung["watchdog_threads"] == "0"
    # the peer's own watchdog saw the abort as a remote error and aborted too
    assert peer["error"] == "NcclRemoteError" and peer["where"] == "watchdog", peer
    assert peer["state"] == "aborted" and peer["next"] == "NcclRemoteError", peer
    assert peer["watchdog_threads"] == "0"


@pytest.mark.slow
def test_synchronize_timeout_on_a_hung_operation(tmp_path: Path) -> None:
    results = _run_faults(tmp_path, "synchronize")
    hung, peer = results[1], results[0]
    assert hung["error"] == "NcclTimeoutError" and hung["where"] == "synchronize", hung
    message = _words(hung["message"])
    assert "did not finish within 1 s" in message, message
    assert f"Last operation issued: #2 {LAST_OP}" in message, message
    assert FIRST_OP in message, message
    # synchronize aborted the communicator: it cannot be used any more
    assert hung["state"] == "aborted" and hung["next"] == "NcclInvalidUsage", hung
    # the peer, blocked in the same all_gather, learns that rank 1 aborted
    assert peer["error"] == "NcclRemoteError", peer
    assert "rank 1 called ncclCommAbort" in _words(peer["message"]), peer


def test_async_error_reaches_the_peer(tmp_path: Path) -> None:
    results = _run_faults(tmp_path, "async-error")
    failed, peer = results[1], results[0]
    # PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER=1: the second operation fails with ncclSystemError
    assert failed["error"] == "NcclSystemError" and failed["where"] == "synchronize", failed
    assert LAST_OP in _words(failed["message"]), failed
    assert peer["error"] == "NcclRemoteError", peer
    assert "rank 1 failed" in _words(peer["message"]), peer


# -- non-blocking init -----------------------------------------------------------------------------


@pytest.mark.slow
def test_non_blocking_init_with_timeout(tmp_path: Path) -> None:
    nproc = 3
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    # ready only after 40 more polls: a 20 ms wait_ready polls at most ~7 times
    env = h.loopback_env(PYNCCL_LOOPBACK_NONBLOCKING_DELAY="40")
    proc = h.start(h.launch(nproc, h.worker("nonblocking.py")), env, out, err)
    try:
        (code,) = h.wait_all([proc])
        text = out.read_text()
        assert code == 0, f"{text}\n{err.read_text()}"
        for rank, f in _fields(text, "NB-OK", range(nproc)).items():
            assert f["created"] == "initializing", (rank, f)
            assert f["first_wait"] == "NcclTimeoutError", (rank, f)
            assert f["after_first_wait"] == "initializing", (rank, f)
            assert f["ready"] == "ready", (rank, f)
    finally:
        h.stop([proc])
