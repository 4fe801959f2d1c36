"""Suspend and resume in the object API: ``suspend``, ``resume``, ``with comm.suspended():``
and ``mem_stats``, on the loopback (thread worlds, results against numpy).

The loopback gives the world's data pages back once every rank is suspended; as NCCL's,
``mem_stats()`` then reports ``gpu_mem_suspended`` 1 and keeps the tracked totals
(``gpu_mem_suspend``, ``gpu_mem_persist``, ``gpu_mem_total``) as they were. Every call on
a suspended communicator raises NcclInvalidUsage saying so before any C call; teardown
works from the suspended state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.reference import small_ints
from support.worlds import ThreadWorld, use_loopback

import pynccl
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer, Graph, Stream, set_device
from pynccl.enums import MemStat, SuspendFlag
from pynccl.errors import NcclInvalidArgument, NcclInvalidUsage, NotSupportedError

COUNT = 4096
KEYS = {"gpu_mem_suspend", "gpu_mem_suspended", "gpu_mem_persist", "gpu_mem_total"}


@pytest.fixture(autouse=True)
def _loopback(lb: Any) -> None:
    """Every test of this module runs on the default loopback (NCCL 2.32)."""


def data(rank: int) -> np.ndarray:
    return small_ints(11, rank, COUNT)


def checked_all_reduce(comm: Communicator, me: int, members: list[int]) -> None:
    """Sum all_reduce of data(me), asserted against numpy over members."""
    set_device(comm.device)
    with DeviceBuffer.from_numpy(data(me), device=comm.device) as buf:
        comm.all_reduce(buf)
        comm.synchronize(timeout=30)
        got = buf.to_numpy()
    np.testing.assert_array_equal(got, np.sum([data(m) for m in members], axis=0))


@pytest.fixture
def world() -> Iterator[ThreadWorld]:
    w = ThreadWorld(4)
    try:
        yield w
    finally:
        w.broken = True  # abort whatever a failed test left behind
        w.close()


def refused_calls(r: int, comm: Communicator) -> dict[str, str]:
    """What each call on a suspended communicator raises (all NcclInvalidUsage)."""
    buf = DeviceBuffer(16, "float32", device=r)
    calls = {
        "all_reduce": lambda: comm.all_reduce(buf),
        "send": lambda: comm.send(buf, peer=(r + 1) % comm.size),
        "synchronize": lambda: comm.synchronize(timeout=5),
        "split": lambda: comm.split(0),
        "register": lambda: comm.register(buf),
        "finalize": comm.finalize,
        "revoke": comm.revoke,
        "shrink": lambda: comm.shrink([]),
        "grow_id": comm.grow_id,
        "suspend": comm.suspend,
    }
    out = {}
    for name, call in calls.items():
        with pytest.raises(NcclInvalidUsage) as info:
            call()
        out[name] = str(info.value)
    buf.close()
    return out


def test_suspend_resume_around_collectives_with_mem_stats_moving(world: ThreadWorld) -> None:
    everyone = [0, 1, 2, 3]
    world.run(lambda r, c: checked_all_reduce(c, r, everyone))
    before = world.run(lambda r, c: c.mem_stats())
    for stats in before.values():
        assert set(stats) == KEYS
        assert stats["gpu_mem_suspend"] > 0 and stats["gpu_mem_persist"] > 0
        assert stats["gpu_mem_suspended"] == 0
        assert stats["gpu_mem_total"] == stats["gpu_mem_suspend"] + stats["gpu_mem_persist"]

    world.run(lambda r, c: c.suspend())
    assert all(c.state == "suspended" for c in world.comms.values())
    during = world.run(lambda r, c: c.mem_stats())  # every rank suspended: pages given back
    for r, stats in during.items():
        # NCCL (src/mem_manager.cc) keeps what it tracks while released: only the flag moves.
        assert stats == {**before[r], "gpu_mem_suspended": 1}
    refused = world.run(refused_calls)
    for r, texts in refused.items():
        for name, text in texts.items():
            if name == "suspend":
                assert text == f"communicator rank {r} is already suspended; call resume() first"
            else:
                assert text == f"communicator rank {r} is suspended; call resume() first", name
    assert all(c.state == "suspended" for c in world.comms.values())  # nothing changed it

    world.run(lambda r, c: c.resume())
    assert world.run(lambda r, c: c.mem_stats()) == before
    world.run(lambda r, c: checked_all_reduce(c, r, everyone))


def test_suspended_context_manager_resumes_also_on_an_exception(world: ThreadWorld) -> None:
    def run(r: int, comm: Communicator) -> Any:
        with comm.suspended() as same:
            assert same is comm and comm.state == "suspended"
        assert comm.state == "ready"
        with pytest.raises(KeyError, match="from the block"):
            with comm.suspended(SuspendFlag.MEM):
                raise KeyError("from the block")
        checked_all_reduce(comm, r, [0, 1, 2, 3])
        return str(comm.state)

    assert world.run(run) == {r: "ready" for r in range(4)}


def test_argument_errors_and_resume_when_not_suspended() -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    try:
        with pytest.raises(NcclInvalidUsage, match="rank 0 is not suspended; resume"):
            comm.resume()
        with pytest.raises(ValueError, match=r"flags=0x2 has bits that are no SuspendFlag"):
            comm.suspend(2)
        with pytest.raises(TypeError, match=r"flags must be an int, got float 1\.0"):
            comm.suspend(1.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"flags=-1 is out of range"):
            comm.suspend(-1)
        with pytest.raises(NcclInvalidArgument, match="invalid flags 0x0"):
            comm.suspend(0)  # NCCL's own refusal: the state does not change
        assert comm.state == "ready"
        assert comm.mem_stats()["gpu_mem_suspended"] == 0
        assert [k.upper() for k in comm.mem_stats()] == [m.name for m in MemStat]
    finally:
        comm.destroy()


@pytest.mark.parametrize("how", ["destroy", "abort"])
def test_teardown_from_the_suspended_state(how: str) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    comm.suspend()
    getattr(comm, how)()
    assert comm.state == ("destroyed" if how == "destroy" else "aborted")
    for call in (comm.resume, comm.mem_stats, comm.suspend):
        with pytest.raises(NcclInvalidUsage, match=f"rank 0 is {comm.state}; it cannot be used"):
            call()


def test_nonblocking_communicators_suspend_and_resume() -> None:
    with ThreadWorld(2, config=Config(blocking=False)) as w:
        w.run(lambda r, c: c.wait_ready(timeout=30))
        w.run(lambda r, c: c.suspend())
        assert w.run(lambda r, c: c.mem_stats()["gpu_mem_suspended"]) == {0: 1, 1: 1}
        w.run(lambda r, c: c.resume())
        w.run(lambda r, c: checked_all_reduce(c, r, [0, 1]))


def test_suspend_and_resume_refused_while_capturing() -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    blocking = Stream()
    g = Graph()
    try:
        with g.capture(blocking, "global"):
            with pytest.raises(NcclInvalidUsage, match="ncclCommSuspend cannot run while"):
                comm.suspend()
            assert comm.mem_stats()["gpu_mem_suspended"] == 0  # touches no stream
        assert g.captured and comm.state == "ready"
        comm.suspend()
        with g.capture(blocking, "global"):
            with pytest.raises(NcclInvalidUsage, match="ncclCommResume cannot run while"):
                comm.resume()
        assert g.captured and comm.state == "suspended"
        comm.resume()
    finally:
        g.close()
        blocking.close()
        comm.destroy()


def test_an_older_release_raises_not_supported_naming_2_29_7() -> None:
    with use_loopback("2.27.3"):
        comm = Communicator(1, UniqueId(), 0, device=0)
        try:
            for name, call in (
                ("suspend", comm.suspend),
                ("resume", comm.resume),
                ("mem_stats", comm.mem_stats),
                ("suspend", lambda: comm.suspended().__enter__()),
            ):
                with pytest.raises(NotSupportedError) as info:
                    call()
                text = str(info.value)
                assert f"Communicator.{name} (ncclComm" in text and "NCCL >= 2.29.7" in text
            assert comm.state == "ready"
        finally:
            comm.destroy()
    assert pynccl.version() >= (2, 29, 7)


@pytest.mark.parametrize("share", ["config", "environment", "none"])
def test_suspend_refused_while_communicators_share_the_memory_manager(
    share: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NCCL (src/mem_manager.cc): a split_share parent and its children share one memory
    # manager, and neither may be suspended (or resumed) while another of them lives.
    if share == "environment":
        monkeypatch.setenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", "1")
    config = Config(split_share=True) if share == "config" else None
    with ThreadWorld(2, config=config) as w:

        def body(r: int, comm: Communicator) -> list[str]:
            child = comm.split(0)
            assert child is not None
            texts = []
            if share != "none":
                for who in (comm, child):
                    with pytest.raises(NcclInvalidUsage) as info:
                        who.suspend()
                    texts.append(str(info.value))
                    assert who.state == "ready"  # refused before NCCL: nothing changed
                child.destroy()  # the last sharer gone: allowed again
            comm.suspend()
            comm.resume()
            checked_all_reduce(comm, r, [0, 1])
            if share == "none":
                child.destroy()
            return texts

        out = w.run(body)
    for texts in out.values():
        if share == "none":
            assert texts == []
            continue
        assert len(texts) == 2
        for text in texts:
            assert text.startswith("ncclCommSuspend: ")
            want = "Memory suspend not supported with split_share communicators (refCount=2)"
            assert want in text
