"""What an ended group holds, checked against the loopback's real stream order.

A group end records one event per stream its kept arrays were used on, taking the event
from a per-device pool; an event goes back to the pool only once it has completed. These
tests hold a stream busy with a host task (the loopback runs stream work on its own
thread, as a GPU does), so that the order the objects are let go in can be read against
what has actually run, and use :class:`pynccl.testing.allocator.CachingAllocator`, whose
freed blocks are poisoned at once: a buffer let go too early shows in the results, which
are compared with numpy.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from support.cudart import HostGate, bind

from pynccl import library
from pynccl.comm import Communicator, UniqueId, _held
from pynccl.cuda import Stream
from pynccl.groups import group, release_done
from pynccl.testing.allocator import CachingAllocator

N = 1024

pytestmark = pytest.mark.usefixtures("lb")


def data(seed: int) -> np.ndarray:
    return np.arange(N, dtype=np.float32) * seed + seed


def test_a_reused_event_keeps_a_later_group_until_its_own_stream_has_run(
    solo_comm: Communicator,
) -> None:
    comm = solo_comm
    # NCCL orders one communicator's operations across streams: the idle stream's groups
    # use a communicator of their own, so that they do not queue behind the busy one.
    other = Communicator(1, UniqueId(), 0, device=0)
    rt = bind(library.cudart().path)
    # Non-blocking: the idle stream (and the pool's copies on it) never waits for the busy
    # one, as a blocking stream would through the legacy stream.
    busy, free = Stream(non_blocking=True), Stream(non_blocking=True)
    with CachingAllocator(device=0, stream=free) as pool:
        # A group on an idle stream: its event completes and goes back to the pool.
        x, y = pool.from_numpy(data(1)), pool.empty(N, "float32")
        with group():
            comm.all_reduce(x, y, stream=free)
        free.synchronize()
        release_done()
        assert release_done() == 0
        np.testing.assert_array_equal(y.to_numpy(), data(1))
        pooled = list(_held._POOL.get(0, []))
        assert pooled  # what the next group end records with
        with HostGate(rt, busy.handle) as gate:
            assert gate.started.wait(30)
            a, b = pool.from_numpy(data(2)), pool.empty(N, "float32")
            ref = weakref.ref(a)
            with group():  # its event is a pooled one, recorded behind the gate
                comm.all_reduce(a, b, stream=busy)
            del a
            gc.collect()
            # Other groups end and poll meanwhile, on the idle stream.
            for seed in range(3, 6):
                c, d = pool.from_numpy(data(seed)), pool.empty(N, "float32")
                with group():
                    other.all_reduce(c, d, stream=free)
                del c
                free.synchronize()
                np.testing.assert_array_equal(d.to_numpy(), data(seed))
            gc.collect()
            assert release_done() >= 1 and ref() is not None  # not run: still held
            # A block freed now would be handed out at once, and poisoned meanwhile.
            assert not gate.ran_out
        busy.synchronize()  # the gate opened: the all_reduce has run
        release_done()
        gc.collect()
        assert ref() is None and release_done() == 0
        np.testing.assert_array_equal(b.to_numpy(), data(2))  # not the poison
    other.destroy()
    busy.close()
    free.close()


def test_a_group_end_polls_earlier_groups_not_its_own(solo_comm: Communicator) -> None:
    # Each end asks after the groups before it (their streams may well have passed); its
    # own event was recorded a moment ago, so it is left to the next end.
    comm = solo_comm
    s = Stream(non_blocking=True)
    with CachingAllocator(device=0, stream=s) as pool:
        refs = []
        for seed in range(1, 4):
            a, b = pool.from_numpy(data(seed)), pool.empty(N, "float32")
            refs.append(weakref.ref(a))
            with group():
                comm.all_reduce(a, b, stream=s)
            del a
            s.synchronize()
            gc.collect()
            # Every earlier group has been let go by this end; this one is held.
            assert [r() is None for r in refs] == [True] * (seed - 1) + [False]
            np.testing.assert_array_equal(b.to_numpy(), data(seed))
        release_done()
        gc.collect()
        assert all(r() is None for r in refs) and release_done() == 0
    s.close()


def test_a_group_on_two_streams_is_held_until_both_have_run(solo_comm: Communicator) -> None:
    # Two calls of one communicator on an idle stream, then one of another communicator on
    # a busy one: the group's arrays (also the first call's) wait for the busy stream too.
    comm = solo_comm
    other = Communicator(1, UniqueId(), 0, device=0)
    rt = bind(library.cudart().path)
    busy, free = Stream(non_blocking=True), Stream(non_blocking=True)
    with CachingAllocator(device=0, stream=free) as pool:
        with HostGate(rt, busy.handle) as gate:
            assert gate.started.wait(30)
            xs = [pool.from_numpy(data(seed)) for seed in (1, 2, 3)]
            ys = [pool.empty(N, "float32") for _ in xs]
            refs = [weakref.ref(x) for x in xs]
            with group():
                comm.all_reduce(xs[0], ys[0], stream=free)
                comm.all_reduce(xs[1], ys[1], stream=free)
                other.all_reduce(xs[2], ys[2], stream=busy)
            del xs
            free.synchronize()
            gc.collect()
            assert release_done() == 1 and all(r() is not None for r in refs)
            assert not gate.ran_out
        busy.synchronize()
        release_done()
        gc.collect()
        assert all(r() is None for r in refs) and release_done() == 0
        for seed, y in zip((1, 2, 3), ys):
            np.testing.assert_array_equal(y.to_numpy(), data(seed))
    other.destroy()
    busy.close()
    free.close()
