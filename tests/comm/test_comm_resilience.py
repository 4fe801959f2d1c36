"""Fault tolerance in the object API: ``revoke``, ``shrink``, ``grow_id`` / ``grow`` /
``Communicator.join`` and the watchdog's ``on_hang="revoke"``, on the loopback.

Thread worlds (a thread per rank) and 4-process worlds (tests/support/workers/resilience.py):
shrink after a rank is SIGKILLed, revoke of a hung receive then shrink, grow from 2 to 4
ranks, each followed by an all_reduce checked against numpy; argument errors refused
before any C call; older releases refused with NotSupportedError naming the release.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support import SUPPORT
from support.reference import small_ints
from support.worlds import RankThreads, ThreadWorld, use_loopback

import pynccl
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer, Graph, Stream, set_device
from pynccl.errors import NcclInvalidUsage, NotSupportedError

WORKER = SUPPORT / "workers" / "resilience.py"
COUNT = 1000


@pytest.fixture(autouse=True)
def _loopback(lb: Any) -> None:
    """Every test of this module runs on the default loopback (NCCL 2.32)."""


def data(rank: int, count: int = COUNT) -> np.ndarray:
    return small_ints(7, rank, count)


def checked_all_reduce(comm: Communicator, me: int, members: list[int]) -> None:
    """Sum all_reduce of data(me) on comm, asserted against numpy over members. The
    calling thread works on comm's device (the legacy stream of another device would
    wait for that device's blocking streams: a rank's copies must not queue behind a
    peer's collective), on a stream of its own."""
    set_device(comm.device)
    stream = Stream(device=comm.device)
    with DeviceBuffer.from_numpy(data(me), device=comm.device) as buf:
        comm.all_reduce(buf, stream=stream)
        comm.synchronize(stream, timeout=30)
        got = buf.to_numpy()
    stream.close()
    want = np.sum([data(m) for m in members], axis=0, dtype=np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.fixture
def world4() -> Iterator[ThreadWorld]:
    w = ThreadWorld(4)
    try:
        yield w
    finally:
        w.broken = True  # abort: a failed test may have left work pending
        w.close()


def hang_and_revoke(w: ThreadWorld) -> dict[int, Any]:
    """Rank 0 posts a recv from rank 1 that no send matches (it hangs); every rank then
    revokes. Returns what each rank's next calls raised."""

    def run(r: int, comm: Communicator) -> Any:
        buf = DeviceBuffer(64, "float32", device=r)
        stream = Stream(device=r)
        stalled = False
        if r == 0:
            comm.recv(buf, peer=1, stream=stream)
            time.sleep(0.2)
            stalled = not stream.query()  # the recv hangs on the stream
        comm.revoke()
        comm.revoke()  # a second revoke does nothing
        stream.synchronize()  # the revoked recv no longer holds the stream
        stream.close()
        errors = {}
        for name, call in (
            ("all_reduce", lambda: comm.all_reduce(buf)),
            ("synchronize", lambda: comm.synchronize(timeout=5)),
            ("suspend", lambda: comm.suspend()),
            ("grow_id", lambda: comm.grow_id()),
            ("finalize", lambda: comm.finalize()),
        ):
            with pytest.raises(NcclInvalidUsage) as info:
                call()
            errors[name] = str(info.value)
        buf.close()
        return stalled, str(comm.state), errors

    return w.run(run)


# ---- shrink -----------------------------------------------------------------------------------


def test_shrink_renumbers_the_remaining_ranks(world4: ThreadWorld) -> None:
    def run(r: int, comm: Communicator) -> Any:
        if r in (1, 3):
            return None
        child = comm.shrink([3, 1])  # any order
        try:
            checked_all_reduce(child, r, [0, 2])
            return child.rank, child.size, child.device, str(child.state)
        finally:
            child.destroy()

    got = world4.run(run)
    assert got == {0: (0, 2, 0, "ready"), 1: None, 2: (1, 2, 2, "ready"), 3: None}
    world4.run(lambda r, c: checked_all_reduce(c, r, [0, 1, 2, 3]))  # the parent still works


def test_shrink_argument_errors_are_refused_before_any_call(world4: ThreadWorld) -> None:
    comm = world4.comms[0]

    def refused(exc: type[BaseException], words: str, *args: Any, **kw: Any) -> None:
        with pytest.raises(exc, match=words):
            comm.shrink(*args, **kw)

    refused(TypeError, r"exclude must be a sequence of ranks, got int 1", 1)
    refused(TypeError, r"exclude must be a sequence of ranks, got str", "1")
    refused(ValueError, r"exclude\[1\]=4 is out of range; expected 0 <= exclude\[1\] < 4", [1, 4])
    refused(ValueError, r"exclude\[0\]=-1 is out of range", [-1])
    refused(TypeError, r"exclude\[0\] must be an int, got float 1.0", [1.0])
    refused(TypeError, r"exclude\[0\] must be an int, got bool True", [True])
    refused(ValueError, r"exclude names rank 2 twice", [2, 3, 2])
    refused(ValueError, r"exclude names rank 0, the caller", [0])
    refused(TypeError, r"abort must be a bool, got int 1", [1], abort=1)
    refused(TypeError, r"config must be a pynccl.Config, got dict", [1], config={})
    assert comm.state == "ready"
    with pytest.raises(NcclInvalidUsage, match="ncclCommShrink cannot be issued inside a group"):
        with pynccl.group():
            comm.shrink([1])
    world4.run(lambda r, c: checked_all_reduce(c, r, [0, 1, 2, 3]))  # nothing was issued


def test_shrink_with_a_config_and_numpy_ranks(world4: ThreadWorld) -> None:
    def run(r: int, comm: Communicator) -> Any:
        if r == 2:
            return None
        child = comm.shrink((np.int64(2),), config=Config(blocking=False))
        try:
            assert child.state == "ready"  # shrink returns the child once it is ready
            checked_all_reduce(child, r, [0, 1, 3])
            return child.rank, child.size
        finally:
            child.destroy()

    assert world4.run(run) == {0: (0, 3), 1: (1, 3), 2: None, 3: (2, 3)}


# ---- revoke ----------------------------------------------------------------------------------


def test_revoke_stops_a_hung_recv_then_the_survivors_shrink(world4: ThreadWorld) -> None:
    seen = hang_and_revoke(world4)
    assert seen[0][0] is True
    for r, (_, state, errors) in seen.items():
        assert state == "revoked"
        for name, text in errors.items():
            assert text == (
                f"communicator rank {r} is revoked; only split(), shrink(), destroy() or abort() "
                "are possible"
            ), name

    def survive(r: int, comm: Communicator) -> Any:
        if r == 3:
            return None
        child = comm.shrink([3], abort=True)
        try:
            checked_all_reduce(child, r, [0, 1, 2])
            return child.rank, child.size
        finally:
            child.destroy()

    assert world4.run(survive) == {0: (0, 3), 1: (1, 3), 2: (2, 3), 3: None}
    assert all(c.state == "revoked" for c in world4.comms.values())
    world4.run(lambda r, c: c.destroy())  # destroy works from the revoked state
    # ... and after shrink(abort=True) it aborts (NCCL >= 2.31.2's destroy would wait for
    # the ranks that aborted): the survivors end aborted, rank 3 destroyed.
    states = {r: c.state for r, c in world4.comms.items()}
    assert states == {0: "aborted", 1: "aborted", 2: "aborted", 3: "destroyed"}


def test_revoke_from_another_thread_ends_a_waiting_synchronize() -> None:
    with ThreadWorld(2) as w:
        w.broken = True

        def run(r: int, comm: Communicator) -> Any:
            buf = DeviceBuffer(64, "float32", device=r)
            try:
                if r == 1:
                    comm.revoke()
                    return None
                comm.recv(buf, peer=1)  # never matched
                errors: list[BaseException] = []

                def revoke_later() -> None:
                    try:
                        comm.revoke()
                    except BaseException as exc:  # reported below
                        errors.append(exc)

                timer = threading.Timer(0.2, revoke_later)
                timer.start()
                with pytest.raises(NcclInvalidUsage) as info:
                    comm.synchronize(timeout=20)  # the work was stopped, not done: it says so
                timer.join()
                assert errors == []
                return str(info.value)
            finally:
                buf.close()

        text = w.run(run)[0]
        assert text == (
            "communicator rank 0 is revoked; only split(), shrink(), destroy() or abort() "
            "are possible"
        )
        w.run(lambda r, c: c.destroy())  # destroy works from the revoked state
        assert all(c.state == "destroyed" for c in w.comms.values())


def test_nonblocking_revoke_waits_until_quiescent_then_shrink() -> None:
    with ThreadWorld(3, config=Config(blocking=False)) as w:
        w.broken = True  # abort at the end, whatever happens

        def run(r: int, comm: Communicator) -> Any:
            comm.wait_ready(timeout=30)
            buf = DeviceBuffer(64, "float32", device=r)
            stream = Stream(device=r)
            if r == 0:
                comm.recv(buf, peer=1, stream=stream)  # never matched
                time.sleep(0.2)
                assert not stream.query()
            comm.revoke()  # ncclInProgress at first: returns once quiescent
            assert comm.state == "revoked"
            stream.synchronize()
            if r == 2:  # the rank the others leave out (NCCL refuses an empty exclusion)
                stream.close()
                buf.close()
                return None
            child = comm.shrink([2], abort=True)
            try:
                assert child.state == "ready"
                checked_all_reduce(child, r, [0, 1])
                return child.rank, child.size
            finally:
                child.destroy()
                stream.close()
                buf.close()

        assert w.run(run) == {0: (0, 2), 1: (1, 2), 2: None}


def test_revoke_refused_after_teardown_and_while_capturing() -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    blocking = Stream()
    g = Graph()
    with g.capture(blocking, "global"):
        for call, name in (
            (comm.revoke, "ncclCommRevoke"),
            (lambda: comm.shrink([]), "ncclCommShrink"),
            (comm.grow_id, "ncclCommGetUniqueId"),
            (lambda: comm.grow(2), "ncclCommGrow"),
            (lambda: Communicator.join(2, UniqueId(), 1, device=0), "ncclCommGrow"),
        ):
            with pytest.raises(NcclInvalidUsage, match=f"{name} cannot run while a stream"):
                call()
    assert g.captured  # nothing above invalidated the capture
    g.close()
    blocking.close()
    assert comm.state == "ready"
    comm.destroy()
    for call in (comm.revoke, lambda: comm.shrink([]), comm.grow_id, lambda: comm.grow(2)):
        with pytest.raises(NcclInvalidUsage, match="communicator rank 0 is destroyed"):
            call()


# ---- grow / join -----------------------------------------------------------------------------


def test_grow_from_2_to_4_ranks_in_threads() -> None:
    w = ThreadWorld(2)
    ids: queue.Queue[UniqueId] = queue.Queue()
    made: dict[int, Communicator] = {}
    errors: list[BaseException] = []

    def newcomer(r: int) -> None:
        try:
            made[r] = Communicator.join(4, ids.get(timeout=30), r, device=r)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def existing(r: int, comm: Communicator) -> Communicator:
        if r == 0:
            gid = comm.grow_id()
            assert isinstance(gid, UniqueId)
            for _ in range(2):
                ids.put(gid)
            return comm.grow(4, gid)
        return comm.grow(4)

    threads = [threading.Thread(target=newcomer, args=(r,)) for r in (2, 3)]
    try:
        for t in threads:
            t.start()
        made.update(w.run(existing))
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
        assert {r: (c.rank, c.size, c.device) for r, c in made.items()} == {
            r: (r, 4, r) for r in range(4)
        }
        threads = RankThreads(4)  # the grown communicators, a thread per rank
        try:
            threads.run(lambda r: checked_all_reduce(made[r], r, [0, 1, 2, 3]))
            threads.run(lambda r: made.pop(r).destroy())
        finally:
            threads.close()
        w.run(lambda r, c: checked_all_reduce(c, r, [0, 1]))  # the parent still works
    finally:
        for comm in made.values():
            comm.abort()
        w.close()


def test_grow_and_join_argument_errors(world4: ThreadWorld) -> None:
    comm = world4.comms[0]
    with pytest.raises(ValueError, match=r"nranks=4 is out of range; expected 5 <= nranks"):
        comm.grow(4)
    with pytest.raises(TypeError, match=r"nranks must be an int, got float 5\.0"):
        comm.grow(5.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a unique id is 128 bytes, got 3 bytes"):
        comm.grow(5, b"abc")
    with pytest.raises(ValueError, match="unique_id must be one unique id"):
        comm.grow(5, [UniqueId(), UniqueId()])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"config must be a pynccl\.Config"):
        comm.grow(5, config=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank=4 is out of range; expected 0 <= rank < 4"):
        Communicator.join(4, UniqueId(), 4)
    with pytest.raises(ValueError, match=r"device=-1 is out of range"):
        Communicator.join(4, UniqueId(), 3, device=-1)
    with pytest.raises(TypeError, match="unique_id must be a UniqueId"):
        Communicator.join(4, "id", 3)  # type: ignore[arg-type]
    # NCCL's own refusals come back as its errors
    with pytest.raises(pynccl.NcclInvalidArgument, match="not produced by"):
        Communicator.join(4, bytes(128), 3, device=3)
    gid = comm.grow_id()
    with pytest.raises(NcclInvalidUsage, match="not consumed"):
        comm.grow_id()
    assert isinstance(gid, UniqueId) and comm.state == "ready"


# ---- the watchdog: on_hang="revoke" ------------------------------------------------------------


def test_watchdog_on_hang_revoke_then_shrink(world4: ThreadWorld) -> None:
    comm0 = world4.comms[0]
    with pytest.raises(ValueError, match="on_hang must be 'abort' or 'revoke', got 'kill'"):
        comm0.start_watchdog(1.0, on_hang="kill")
    with pytest.raises(ValueError, match="on_hang must be 'abort' or 'revoke', got 1"):
        comm0.start_watchdog(1.0, on_hang=1)  # type: ignore[arg-type]
    assert comm0._watch is None

    def run(r: int, comm: Communicator) -> Any:
        buf = DeviceBuffer(64, "float32", device=r)
        try:
            if r != 0:
                return None
            comm.start_watchdog(0.3, on_hang="revoke")
            comm.recv(buf, peer=1)  # never matched: hangs until revoked
            start = time.monotonic()
            with pytest.raises(pynccl.NcclTimeoutError) as waited:
                comm.synchronize(timeout=20)  # returns once the watchdog revoked the recv
            assert time.monotonic() - start < 10
            with pytest.raises(pynccl.NcclTimeoutError) as info:
                comm.all_reduce(buf)
            assert info.value is waited.value
            return str(comm.state), str(info.value), comm.error is info.value
        finally:
            buf.close()

    seen = world4.run(run)
    state, text, recorded = seen[0]
    assert state == "revoked" and recorded
    assert "operation #1 did not complete within 0.3 s; the watchdog revoked" in text
    assert "#1 ncclRecv" in text and "peer=1" in text
    assert not comm0._watch  # the watchdog let go, and its thread ends (promptly)
    deadline = time.monotonic() + 5
    while any(t.name.startswith("pynccl-watchdog") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the watchdog thread did not end"
        time.sleep(0.01)

    def survive(r: int, comm: Communicator) -> Any:
        if r != 0:
            comm.revoke()  # the others revoke too (their peers' operations are gone)
        if r == 3:
            return None
        child = comm.shrink([3], abort=True)
        try:
            checked_all_reduce(child, r, [0, 1, 2])
            return child.size
        finally:
            child.destroy()

    assert world4.run(survive) == {0: 3, 1: 3, 2: 3, 3: None}


def test_watchdog_on_hang_from_the_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="watchdog_on_hang must be 'abort' or 'revoke', got 'x'"):
        Communicator(1, UniqueId(), 0, device=0, watchdog_timeout=1.0, watchdog_on_hang="x")
    monkeypatch.setenv("PYNCCL_LOOPBACK_HANG", "1")  # this communicator's first operation hangs
    comm = Communicator(1, UniqueId(), 0, device=0, watchdog_timeout=0.3, watchdog_on_hang="revoke")
    monkeypatch.delenv("PYNCCL_LOOPBACK_HANG")  # not the child's
    buf = DeviceBuffer(16, "float32", device=0)
    try:
        assert comm._watch is not None and comm._watch.on_hang == "revoke"
        comm.all_reduce(buf)  # hangs until revoked
        with pytest.raises(pynccl.NcclTimeoutError, match="the watchdog revoked"):
            comm.synchronize(timeout=20)
        assert comm.state == "revoked"
    finally:
        comm.destroy()  # works from the revoked state
        buf.close()
    assert comm.state == "destroyed"


# ---- older releases --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "refused"),
    [
        ("2.24.3", {"shrink": "2.27.3", "revoke": "2.28.7", "grow_id": "2.29.2"}),
        ("2.27.3", {"revoke": "2.28.7", "grow_id": "2.29.2", "grow": "2.29.2"}),
    ],
)
def test_older_releases_raise_not_supported_naming_the_release(
    version: str, refused: dict[str, str]
) -> None:
    with use_loopback(version):
        comm = Communicator(1, UniqueId(), 0, device=0)
        try:
            calls = {
                "shrink": lambda: comm.shrink([]),
                "revoke": comm.revoke,
                "grow_id": comm.grow_id,
                "grow": lambda: comm.grow(2),
            }
            for name, release in refused.items():
                with pytest.raises(NotSupportedError, match=f"requires NCCL >= {release}"):
                    calls[name]()
            with pytest.raises(NotSupportedError, match=r"Communicator.join \(ncclCommGrow\)"):
                Communicator.join(2, UniqueId(), 1)
            with pytest.raises(NotSupportedError, match=r"on_hang='revoke'.*2\.28\.7"):
                comm.start_watchdog(5.0, on_hang="revoke")
            with pytest.raises(NotSupportedError, match=r"watchdog_on_hang='revoke'.*2\.28\.7"):
                Communicator(1, UniqueId(), 0, watchdog_timeout=5.0, watchdog_on_hang="revoke")
            if "shrink" not in refused:  # supported: it goes on to check its arguments
                with pytest.raises(ValueError, match="at least one rank"):
                    comm.shrink([])
            assert comm.state == "ready"
        finally:
            comm.destroy()


# ---- 4-process worlds ------------------------------------------------------------------------


class Procs:
    """Worker processes whose JSON lines are read by a thread each, with timeouts."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen[str]] = []
        self.lines: list[queue.Queue[dict[str, Any] | None]] = []

    def start(self, *args: str) -> int:
        p = subprocess.Popen(
            [sys.executable, "-u", str(WORKER), *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        q: queue.Queue[dict[str, Any] | None] = queue.Queue()

        def pump() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                q.put(json.loads(line) if line.startswith("{") else {"event": "text", "t": line})
            q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        self.procs.append(p)
        self.lines.append(q)
        return len(self.procs) - 1

    def event(self, i: int, name: str, timeout: float = 60) -> dict[str, Any]:
        """The next event called ``name`` from process i (others before it are skipped)."""
        deadline = time.monotonic() + timeout
        skipped = []
        while True:
            try:
                item = self.lines[i].get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"process {i}: no {name!r} within {timeout} s: {skipped}"
                ) from None
            if item is None:
                raise AssertionError(f"process {i} ended before {name!r}: {skipped}")
            if item["event"] == name:
                return item
            skipped.append(item)

    def wait(self, i: int, timeout: float = 60) -> int:
        return self.procs[i].wait(timeout=timeout)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            assert p.stdout is not None
            p.stdout.close()


@pytest.fixture
def procs(lb_env: dict[str, str]) -> Iterator[Procs]:
    shm_before = set(os.listdir("/dev/shm"))
    made = Procs(lb_env)
    try:
        yield made
    finally:
        made.close()
    for p in made.procs:  # no child survives, and none left shared memory behind
        assert p.poll() is not None
    assert {n for n in os.listdir("/dev/shm") if "pynccl" in n} <= shm_before


def test_shrink_after_a_rank_is_sigkilled_in_4_processes(procs: Procs) -> None:
    uid, n, victim = UniqueId().hex(), 4, 2
    for r in range(n):
        procs.start("shrink", uid, str(n), str(r), str(victim))
    for r in range(n):
        assert procs.event(r, "ready")["ok"] is True
    os.kill(procs.procs[victim].pid, signal.SIGKILL)
    assert procs.wait(victim) == -signal.SIGKILL
    for r in range(n):
        if r == victim:
            continue
        parent = procs.event(r, "parent")
        assert parent["error"] == "NcclRemoteError" and parent["state"] == "ready", parent
        child = procs.event(r, "child")
        assert child == {"event": "child", "rank": r - (r > victim), "size": 3, "ok": True}
        assert procs.event(r, "exit") == {"event": "exit", "ok": True}
        assert procs.wait(r) == 0


@pytest.mark.slow
def test_grow_from_2_to_4_processes(procs: Procs) -> None:
    uid = UniqueId().hex()
    for r in range(2):
        procs.start("grow_old", uid, "2", str(r), "4")
    gid = procs.event(0, "grow_id")["uid"]
    for r in (2, 3):
        procs.start("grow_new", gid, "4", str(r))
    for r in range(4):
        assert procs.event(r, "grown") == {"event": "grown", "rank": r, "size": 4, "ok": True}
        assert procs.event(r, "exit") == {"event": "exit", "ok": True}
        assert procs.wait(r) == 0
