"""The watchdog watches operations issued inside a group (issue 24).

Inside ``pynccl.group()`` NCCL enqueues nothing on the stream until the outermost
``ncclGroupEnd``: an event recorded at the call itself completes at once (on a GPU and on
the loopback alike), so a grouped operation that then hangs — a send whose peer never
posts the matching recv, the commonest hang there is — went unseen. Here a 2-rank
:class:`ThreadWorld` with the watchdog on: rank 0 sends inside a group (nested or not, a
non-blocking communicator's group too), rank 1 never posts the recv, and the watchdog must
trip within its timeout (plus slack), naming the grouped send from the flight record; a
group that completes is watched while it runs (``started`` in the dump, ``analyze`` says
who is waiting) and leaves nothing pending and no warning; a simulated group launches
nothing and leaves nothing to watch.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.wait import wait_for
from support.worlds import ThreadWorld

import pynccl
from pynccl import analyze, library
from pynccl.comm import CollConfig, Communicator, Config, PersistentOp, _flight
from pynccl.cuda import DeviceBuffer
from pynccl.errors import NcclTimeoutError
from pynccl.groups import group

pytestmark = pytest.mark.usefixtures("lb")

#: Elements of each send: 512 KiB, more than the loopback's p2p ring between two ranks
#: holds (256 KiB), so a send completes only once its recv is posted — as in NCCL, whose
#: sender waits for the receiver's buffer credits.
N = 1 << 17
#: The watchdog's timeout where an operation is meant to hang, and the slack a loaded
#: machine may add before the trip is seen.
HANG_T = 0.5
SLACK = 5.0


@contextlib.contextmanager
def _world(timeout: float, config: Config | None = None) -> Iterator[ThreadWorld]:
    """Two ranks, each with its watchdog (polling every 20 ms); aborted at the end if any
    rank was aborted (the peer of a hung send is left with work that never ends)."""
    world = ThreadWorld(2, config=config)
    try:
        world.run(lambda r, c: c.start_watchdog(timeout, interval=0.02))
        yield world
    finally:
        world.broken = world.broken or any(c.state != "ready" for c in world.comms.values())
        world.close()


def _send(comm: Communicator, buf: DeviceBuffer, form: str) -> PersistentOp | None:
    """The send in one of the forms that reach the watchdog by different ways: the fast
    path (raw pointers keep nothing for the group; a buffer is kept), a persistent
    operation (its own prebuilt call, returned for closing), and — NCCL has per-call
    configs for collectives only — an all_reduce with a config (ncclAllReduceConfig,
    recorded by the checked path itself), which rank 1 never joins."""
    if form == "persistent":
        op = comm.send_init(buf, 1)
        op()
        return op
    if form == "raw":
        comm.send(buf.ptr, 1, count=N, dtype="float32")
    elif form == "config":
        comm.all_reduce(buf, config=CollConfig(max_ctas=2))
    else:
        comm.send(buf, 1)
    return None


def _groups(depth: int) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for _ in range(depth):
        stack.enter_context(group())
    return stack


def _dumps(world: ThreadWorld) -> list[dict[str, Any]]:
    """One dump per rank, as each rank's process would write it (one communicator each)."""
    now = time.time()
    return [{"rank": r, "size": 2, "time": now, "comms": [{**_flight._comm_record(c), "index": 0}]}
            for r, c in world.comms.items()]  # fmt: skip


def _hang_in_a_group(world: ThreadWorld, depth: int, form: str) -> dict[str, Any]:
    """Rank 0 sends to rank 1 inside ``depth`` nested groups; rank 1 never posts the recv.
    What rank 0 saw: the send's number, whether and how fast its watchdog tripped."""
    comm = world.comms[0]
    buf = DeviceBuffer(N, "float32", device=0)
    op = None
    try:
        seq = comm.flight_seq + 1
        with _groups(depth):
            op = _send(comm, buf, form)
        ended = time.monotonic()
        tripped = wait_for(lambda: comm.state == "aborted", HANG_T + SLACK)
        after = time.monotonic() - ended
        # The dump as the trip left it: once the watchdog's thread has stopped (the abort
        # ends the hung work, and a running watchdog would see its event complete).
        wait_for(lambda: not any(t.name == "pynccl-watchdog-rank0" for t in threading.enumerate()),
                 SLACK)  # fmt: skip
        return {"seq": seq, "tripped": tripped, "after": after, "error": comm.error,
                "dump": _dumps(world)}  # fmt: skip
    finally:
        if comm.state != "aborted":
            comm.abort()  # the old behaviour: nothing tripped, the send would wait for ever
        if op is not None:
            op.close()
        buf.close()


def _names_the_grouped_send(seen: dict[str, Any], function: str = "ncclSend") -> None:
    assert seen["tripped"], "the watchdog never saw the grouped send hang"
    assert seen["after"] < HANG_T + SLACK
    error, seq = seen["error"], seen["seq"]
    assert isinstance(error, NcclTimeoutError), repr(error)
    assert error.function == function
    assert f"operation #{seq} did not complete within {HANG_T:g} s" in str(error)
    record = {item[0]: item for item in error.flight_record}
    assert record[seq][1] == function
    line = next(ln for ln in str(error).splitlines() if f"#{seq} {function}" in ln)
    assert "[group " in line and ("peer=1" in line or function != "ncclSend"), line


@pytest.mark.parametrize("form", ["buffer", "raw", "config", "persistent"])
@pytest.mark.parametrize("depth", [1, 2], ids=["group", "nested"])
def test_a_grouped_operation_never_matched_trips_the_watchdog(depth: int, form: str) -> None:
    # The record names a config call by its C function (ncclAllReduceConfig).
    config = form == "config"
    function, what = ("ncclAllReduceConfig", "op sum") if config else ("ncclSend", "peer 1")
    with _world(HANG_T) as world:
        seen = _hang_in_a_group(world, depth, form)
    _names_the_grouped_send(seen, function)
    # The dump and analyze label it: issued in a group, started (its stream is in it), and
    # the rank that never issued its recv is the culprit.
    dumps = seen["dump"]
    op = next(o for o in dumps[0]["comms"][0]["ops"] if o["seq"] == seen["seq"])
    assert op["function"] == function and op["group"] > 0 and op["state"] == "started"
    verdict = analyze.analyze(dumps)
    assert verdict["culprits"] == [1], verdict
    assert verdict["verdict"].startswith(
        f"rank 1 never issued operation #{seen['seq']} ({function} {N} x float32, {what}, "
        f"group {op['group']}); rank 0 is waiting in it"
    ), verdict


def test_a_group_that_completes_is_watched_while_it_runs_and_leaves_nothing() -> None:
    data = np.arange(N, dtype=np.float32) * 3 - 7
    posted = threading.Event()
    seen: dict[str, Any] = {}

    def one(r: int, comm: Communicator) -> np.ndarray | None:
        buf = DeviceBuffer.from_numpy(data, device=0) if r == 0 else DeviceBuffer(
            N, "float32", device=1)  # fmt: skip
        try:
            if r == 0:
                seq = comm.flight_seq + 1
                with group():
                    comm.send(buf, 1)
                seen["seq"], seen["while"] = seq, _dumps(world)
                posted.set()
            else:
                assert posted.wait(60)
                with group():
                    comm.recv(buf, 0)
            comm.synchronize(timeout=60)
            return None if r == 0 else buf.to_numpy()
        finally:
            buf.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _world(30.0) as world:
            got = world.run(one)
            # While rank 1 had not posted its recv, the send was on rank 0's stream, and
            # not done: analyze says who it waits for.
            ops = seen["while"][0]["comms"][0]["ops"]
            op = next(o for o in ops if o["seq"] == seen["seq"])
            assert (op["state"], op["group"] > 0) == ("started", True), op
            verdict = analyze.analyze(seen["while"])
            assert verdict["culprits"] == [1] and "rank 0 is waiting in it" in verdict["verdict"]
            # Once it ran: every operation completed, nothing pending, no fault.
            after = _dumps(world)
            for d, comm in zip(after, world.comms.values()):
                record = d["comms"][0]
                assert record["watchdog"]["completed"] == comm.flight_seq, record
                assert {o["state"] for o in record["ops"]} == {"completed"}, record
            assert analyze.analyze(after)["culprits"] == []  # a matched send/recv: no fault
            states = {r: c.state for r, c in world.comms.items()}
    np.testing.assert_array_equal(got[1], data)
    assert states == {0: "ready", 1: "ready"}
    assert [str(w.message) for w in caught if "watchdog" in str(w.message)] == []


def test_a_non_blocking_groups_send_is_watched_once_launched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The group end returns ncclInProgress; NCCL launches from its own thread once ready
    # (here after 5 polls of the asynchronous error): the send hangs after that.
    with _world(HANG_T, Config(blocking=False)) as world:
        world.run(lambda r, c: c.wait_ready(timeout=60))
        monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", "5")
        seen = _hang_in_a_group(world, 1, "buffer")
    _names_the_grouped_send(seen)


def test_a_non_blocking_group_still_in_progress_past_the_timeout_is_aborted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Never ready: the "in progress past the timeout" rule, not an event, aborts it.
    with _world(HANG_T, Config(blocking=False)) as world:
        world.run(lambda r, c: c.wait_ready(timeout=60))
        monkeypatch.setenv("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", str(10**9))
        seen = _hang_in_a_group(world, 1, "buffer")
    assert seen["tripped"] and seen["after"] < HANG_T + SLACK
    assert isinstance(seen["error"], NcclTimeoutError)
    assert "was not ready within" in str(seen["error"])


def test_a_simulated_group_leaves_nothing_to_watch(lb: Any) -> None:
    if library.lib().version < (2, 22, 3):
        pytest.skip("ncclGroupSimulateEnd needs NCCL >= 2.22.3")
    with _world(HANG_T) as world:
        comm = world.comms[0]
        buf = DeviceBuffer(N, "float32", device=0)
        try:
            with group(simulate=True):
                comm.send(buf, 1)  # planned, never launched: rank 1 posts nothing
            time.sleep(HANG_T * 4)
            assert comm.state == "ready", comm.error
            record = _flight._comm_record(comm)
            assert record["watchdog"]["verdict"] is None
        finally:
            buf.close()


def _op(seq: int, function: str, peer: int, group_no: int) -> dict[str, Any]:
    return {"seq": seq, "function": function, "count": N, "dtype": "ncclFloat32", "peer": peer,
            "stream": 0, "group": group_no, "state": "completed"}  # fmt: skip


def test_analyze_takes_a_matched_grouped_exchange_for_no_fault() -> None:
    # Written by hand as two ranks' dumps: a grouped send on rank 0 and its recv on rank 1
    # (NCCL pairs them by peer, not by function), then one all_reduce that rank 1 sized
    # differently. Only the all_reduce is a disagreement.
    reduce_ = {"function": "ncclAllReduce", "dtype": "ncclFloat32", "op": "sum", "stream": 0,
               "group": 0, "state": "completed"}  # fmt: skip
    dumps = [
        {"rank": r, "size": 2, "time": 0.0, "comms": [{"index": 0, "rank": r, "size": 2,
         "state": "ready", "ops": [_op(1, fn, 1 - r, 3 + r), {**reduce_, "seq": 2, "count": n}]}]}
        for r, fn, n in ((0, "ncclSend", 8), (1, "ncclRecv", 9))
    ]  # fmt: skip
    verdict = analyze.analyze(dumps)
    assert verdict["operation"] == 2 and verdict["culprits"] == [1], verdict
    assert verdict["verdict"].startswith("ranks disagree at operation #2: rank 0 ncclAllReduce 8")
    dumps[0]["comms"][0]["ops"].pop()
    dumps[1]["comms"][0]["ops"].pop()
    assert analyze.analyze(dumps)["culprits"] == []


def test_a_thread_that_ends_with_its_group_open_leaves_no_grouped_work_behind() -> None:
    # A thread that ends inside a group never launches it; the watchdog must forget what it
    # issued there. Else a later thread given the same ident (they are reused) found the
    # dead thread's list and never asked to hear of its own group's end: its hung send went
    # unwatched.
    with _world(HANG_T) as world:
        comm = world.comms[0]
        buf = DeviceBuffer(N, "float32", device=0)
        try:

            def ends_inside_a_group() -> None:
                pynccl.group_start()
                comm.send(buf, 1)  # queued in a group that never ends

            first = threading.Thread(target=ends_inside_a_group)
            first.start()
            first.join()
            ident = first.ident
            seen: dict[str, Any] = {}

            def hangs_in_a_group() -> None:
                if threading.get_ident() != ident:
                    return
                seen["reused"] = True
                with group():
                    comm.send(buf, 1)  # rank 1 never posts the recv

            for _ in range(50):  # until a thread gets the dead one's ident
                t = threading.Thread(target=hangs_in_a_group)
                t.start()
                t.join()
                if seen:
                    break
            if not seen:
                pytest.skip("no new thread was given the ended thread's ident")
            tripped = wait_for(lambda: comm.state == "aborted", HANG_T + SLACK)
            assert tripped, "the watchdog never saw the second thread's grouped send hang"
            assert isinstance(comm.error, NcclTimeoutError), repr(comm.error)
        finally:
            if comm.state != "aborted":
                comm.abort()  # the old behaviour: nothing tripped, the send would wait for ever
            buf.close()
