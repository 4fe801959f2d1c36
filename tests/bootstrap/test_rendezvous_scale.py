"""The TCP rendezvous server with more ranks than connection slots: ranks arriving together
wait their turn instead of displacing each other's handshakes, the listen queue never
overflows, and idle connections still give way to ranks."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from pynccl.bootstrap import TcpRendezvous, TcpRendezvousServer

HOST = "127.0.0.1"
KEY = "scale-test-key"
OK_TIMEOUT = 60.0


def _fetch_all(port: int, world: int) -> dict[int, object]:
    """Ranks 1..world-1 fetch at once, one thread each; {rank: payload or exception}."""
    client = TcpRendezvous(HOST, port, KEY)
    go = threading.Barrier(world - 1)
    got: dict[int, object] = {}

    def rank(r: int) -> None:
        go.wait()
        try:
            got[r] = client.fetch(rank=r, world_size=world, timeout=OK_TIMEOUT)
        except BaseException as e:  # collected for the assertion
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * OK_TIMEOUT)
    return got


def test_ranks_beyond_the_slots_wait_instead_of_displacing_each_other(caplog):
    # 95 ranks against 4 slots, all at once: before, every arrival beyond the slots dropped the
    # oldest unfinished handshake (a rank), which reconnected and dropped another in turn.
    payload, world = os.urandom(128), 96
    caplog.set_level(logging.INFO, logger="pynccl.bootstrap")
    server = TcpRendezvousServer(
        payload, host=HOST, port=0, world_size=world, key=KEY, timeout=OK_TIMEOUT, max_connections=4
    ).start()
    try:
        got = _fetch_all(server.address[1], world)
        server.wait(OK_TIMEOUT)
    finally:
        server.close()
    assert got == {r: payload for r in range(1, world)}
    # a rank's handshake is displaced only after holding its slot for half a second, which a
    # loaded machine may rarely reach; before, most arrivals displaced one
    assert caplog.text.count("connection slots taken") <= 5, caplog.text.count("slots taken")


def test_listen_queue_never_overflows_under_idle_connections():
    # 400 idle connections against 8 slots and a 3-rank world: each connect completes at once
    # (no dropped SYN, whose retry costs a client 1 s, then 3 s, ...), and the ranks are served.
    payload = os.urandom(128)
    server = TcpRendezvousServer(
        payload, host=HOST, port=0, world_size=3, key=KEY, timeout=OK_TIMEOUT, max_connections=8
    ).start()
    idle: list[socket.socket] = []
    try:
        port = server.address[1]
        start = time.monotonic()
        for _ in range(400):
            idle.append(socket.create_connection((HOST, port), timeout=OK_TIMEOUT))
        # each connect is answered by the kernel, so a slow one means a dropped SYN
        assert time.monotonic() - start < 0.9 * 2, "a SYN was dropped: the listen queue overflowed"
        got = _fetch_all(port, 3)
        server.wait(OK_TIMEOUT)
    finally:
        server.close()
        for s in idle:
            s.close()
    assert got == {1: payload, 2: payload}


@pytest.mark.slow
def test_flood_of_reconnecting_idle_connections_repeatedly():
    # the reverted grace of an earlier attempt stalled ranks for 20 s in one run of three under
    # this flood: run it several times
    from test_rendezvous import _Flood  # the flood of test_rendezvous.py

    for _ in range(5):
        payload = os.urandom(128)
        server = TcpRendezvousServer(
            payload, host=HOST, port=0, world_size=4, key=KEY, timeout=20.0, max_connections=64
        ).start()
        flood = _Flood(server.address[1], 200, reconnect=True, hello=False)
        try:
            start = time.monotonic()
            got = _fetch_all(server.address[1], 4)
            elapsed = time.monotonic() - start
            server.wait(5.0)
        finally:
            server.close()
            flood.close()
        assert got == {r: payload for r in range(1, 4)}
        assert elapsed < 5.0, elapsed


_FD_BOUND_SERVER = """
import logging, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from pynccl.bootstrap import TcpRendezvousServer
failed = []
class Count(logging.Handler):
    def emit(self, record):
        if "accept failed" in record.getMessage():
            failed.append(record)
logging.getLogger("pynccl.bootstrap").addHandler(Count())
server = TcpRendezvousServer(b"x" * 128, host="127.0.0.1", port=0, world_size=500,
                             key="k", timeout=2.5, max_connections=8).start()
print(server.address[1], flush=True)
try:
    server.wait()
except Exception:
    pass
server.close()
print(len(failed), flush=True)
"""


def test_out_of_descriptors_with_nothing_to_drop_the_listener_rests() -> None:
    # Rank 0 may open 40 descriptors and 60 silent connections come: accept() fails with
    # EMFILE while the listener stays readable. It must rest between tries (before, the
    # loop spun on it, a warning per pass: thousands in the 2.5 s the server lives).
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    server = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", _FD_BOUND_SERVER],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    socks: list[socket.socket] = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        for _ in range(60):
            socks.append(socket.create_connection((HOST, port), timeout=5))
        out, _ = server.communicate(timeout=30)
    finally:
        for s in socks:
            s.close()
        if server.poll() is None:
            server.kill()
            server.wait()
    failures = int(out.split()[-1])
    assert 1 <= failures <= 2.5 / 0.05 + 10, failures
