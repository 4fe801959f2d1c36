"""Id sharing: TCP (incl. hostile and broken peers), store, MPI and file backends, from_env."""

from __future__ import annotations

import logging
import os
import re
import selectors
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import types
import warnings

import pytest
from support.wait import per_rank
from support.workers._harness import free_port
from support.workers.kv_store import DictStore

from pynccl.bootstrap import (
    FileRendezvous,
    InsecureRendezvousWarning,
    LaunchEnvError,
    MpiRendezvous,
    Rendezvous,
    RendezvousAddressError,
    RendezvousAuthError,
    RendezvousError,
    RendezvousMismatchError,
    RendezvousProtocolError,
    RendezvousTimeoutError,
    StoreRendezvous,
    TcpRendezvous,
    TcpRendezvousServer,
    from_env,
)
from pynccl.bootstrap import _wire as wire

HOST = "127.0.0.1"
OK_TIMEOUT = 60.0  # generous: success must not depend on the machine's load
KEY = "0123456789abcdef-job-key"


def _payload(nids: int = 1) -> bytes:
    return os.urandom(128 * nids)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def no_leaks():
    """Every thread, socket and descriptor a test opens is gone when it ends."""
    threads, fds = threading.active_count(), _fds()
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (threading.active_count() > threads or _fds() > fds):
        time.sleep(0.02)
    assert threading.active_count() <= threads
    assert _fds() <= fds


def _server(payload, world_size, key=KEY, **kw):
    kw.setdefault("timeout", OK_TIMEOUT)
    return TcpRendezvousServer(
        payload, host=HOST, port=0, world_size=world_size, key=key, **kw
    ).start()


def _fetch(port, rank, world_size, key=KEY, timeout=OK_TIMEOUT):
    return TcpRendezvous(HOST, port, key).fetch(rank=rank, world_size=world_size, timeout=timeout)


def _raw(port):
    s = socket.create_connection((HOST, port), timeout=OK_TIMEOUT)
    return s


def _read_reply(sock) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _error_text(reply: bytes) -> str:
    magic, version, kind, length = struct.unpack("!4sBBI", reply[:10])
    assert (magic, version, kind) == (b"PNRV", 1, wire.ERROR)
    return reply[11 : 10 + length].decode()


# -- TCP: the good path -------------------------------------------------------------------------


def test_tcp_many_ranks_get_the_same_payload(no_leaks):
    payload = _payload(3)
    n = 48
    with _server(payload, n) as server:
        results = per_rank(lambda r: _fetch(server.address[1], r, n), range(1, n))
        server.wait()
        assert server.served_ranks == frozenset(range(1, n))
    assert results == {r: payload for r in range(1, n)}


def test_tcp_share_on_every_rank(no_leaks):
    payload = _payload()
    n = 6
    port = free_port()
    rdzv = TcpRendezvous(HOST, port, KEY)

    def rank(r):
        return rdzv.share(payload if r == 0 else None, rank=r, world_size=n, timeout=OK_TIMEOUT)

    results = per_rank(rank, range(n))
    assert results == {r: payload for r in range(n)}


def test_tcp_clients_before_server_retry_until_it_appears(no_leaks):
    payload = _payload()
    port = free_port()
    results: dict[int, object] = {}
    threads = [
        threading.Thread(target=lambda r=r: results.__setitem__(r, _fetch(port, r, 4)))
        for r in (1, 2, 3)
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the clients are retrying against a closed port
    server = TcpRendezvousServer(
        payload, host=HOST, port=port, world_size=4, key=KEY, timeout=OK_TIMEOUT
    ).start()
    for t in threads:
        t.join(OK_TIMEOUT)
    server.wait()
    server.close()
    assert results == {1: payload, 2: payload, 3: payload}


def test_tcp_world_of_one_needs_no_network():
    payload = _payload()
    assert TcpRendezvous(HOST, 1, KEY).share(payload, rank=0, world_size=1, timeout=1) == payload


def test_tcp_background_serving(no_leaks):
    payload = _payload()
    port = free_port()
    rdzv = TcpRendezvous(HOST, port, KEY, wait_for_all=False)
    assert rdzv.share(payload, rank=0, world_size=3, timeout=OK_TIMEOUT) == payload
    results = per_rank(lambda r: _fetch(port, r, 3), (1, 2))
    assert results == {1: payload, 2: payload}  # the daemon thread then exits by itself


def test_tcp_keyless_works_with_a_warning(no_leaks):
    payload = _payload()
    port = free_port()
    rdzv = TcpRendezvous(HOST, port, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = per_rank(
            lambda r: rdzv.share(
                payload if r == 0 else None, rank=r, world_size=2, timeout=OK_TIMEOUT
            ),
            (0, 1),
        )
    assert results == {0: payload, 1: payload}
    assert any(issubclass(w.category, InsecureRendezvousWarning) for w in caught)


# -- TCP: refused clients -----------------------------------------------------------------------


def test_tcp_wrong_key_is_rejected_and_others_still_served(no_leaks, caplog):
    payload = _payload()
    with _server(payload, 3) as server:
        port = server.address[1]
        with pytest.raises(RendezvousAuthError, match="key rejected"):
            _fetch(port, 1, 3, key="another-jobs-key")
        assert per_rank(lambda r: _fetch(port, r, 3), (1, 2)) == {1: payload, 2: payload}
        server.wait()
    assert "key rejected" in caplog.text


@pytest.mark.parametrize(
    ("server_key", "client_key", "words"),
    [(KEY, None, "rank 0 requires a rendezvous key"), (None, KEY, "rank 0 has none")],
)
def test_tcp_key_on_one_side_only(no_leaks, server_key, client_key, words):
    with _server(_payload(), 2, key=server_key) as server:
        with pytest.raises(RendezvousAuthError, match=words):
            _fetch(server.address[1], 1, 2, key=client_key)


def test_tcp_world_size_mismatch(no_leaks):
    with _server(_payload(), 4) as server:
        with pytest.raises(RendezvousMismatchError, match="world size 8 but rank 0 serves"):
            _fetch(server.address[1], 3, 8)


def test_tcp_second_rank_zero(no_leaks):
    with _server(_payload(), 2) as server:
        with socket.create_connection(server.address, timeout=OK_TIMEOUT) as s:
            s.sendall(wire.frame(wire.HELLO, struct.pack("!B32sII", 1, bytes(32), 0, 2)))
            assert "two processes claim rank 0" in _error_text(_read_reply(s))


# -- TCP: hostile and broken clients ------------------------------------------------------------


def test_tcp_garbage_truncated_oversized_and_old_versions(no_leaks, caplog):
    caplog.set_level(logging.DEBUG, logger="pynccl.bootstrap")
    payload = _payload()
    with _server(payload, 3) as server:
        port = server.address[1]
        with _raw(port) as s:  # an HTTP client on the wrong port
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert "bad magic" in _error_text(_read_reply(s))
        with _raw(port) as s:  # a length prefix of 4 GiB
            s.sendall(struct.pack("!4sBBI", b"PNRV", 1, wire.HELLO, 0xFFFFFFFF))
            assert "oversized" in _error_text(_read_reply(s))
        with _raw(port) as s:  # a future protocol version
            s.sendall(struct.pack("!4sBBI", b"PNRV", 9, wire.HELLO, 41) + bytes(41))
            assert "version 9 is not supported" in _error_text(_read_reply(s))
        with _raw(port) as s:  # out of order: AUTH before HELLO
            s.sendall(struct.pack("!4sBBI", b"PNRV", 1, wire.AUTH, 32) + bytes(32))
            assert "message type 3 where 1 expected" in _error_text(_read_reply(s))
        s = _raw(port)  # truncated: half a HELLO, then the client vanishes
        s.sendall(struct.pack("!4sBBI", b"PNRV", 1, wire.HELLO, 41) + bytes(10))
        s.close()
        # legitimate ranks are served all along
        assert per_rank(lambda r: _fetch(port, r, 3), (1, 2)) == {1: payload, 2: payload}
        server.wait()
    assert "truncated" in caplog.text


def _drip_until_cut_off(sock, data: bytes) -> bytes:
    """Slowloris: one byte every 0.1 s, until the server answers; returns its answer."""
    sock.settimeout(0.1)
    reply, i = b"", 0
    while True:
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            if i < len(data):
                try:
                    sock.sendall(data[i : i + 1])
                except OSError:
                    return reply
                i += 1
            continue
        except OSError:
            return reply
        if not chunk:
            return reply
        reply += chunk


def test_tcp_silent_and_dripping_clients_time_out_without_stalling_others(no_leaks, caplog):
    payload = _payload()
    with _server(payload, 3, connection_timeout=1.0) as server:
        port = server.address[1]
        silent = _raw(port)
        drip = _raw(port)
        hello = struct.pack("!4sBBI", b"PNRV", 1, wire.HELLO, 41) + bytes(41)
        drip.sendall(hello[:1])
        # a legitimate rank is served while both are still connected
        assert _fetch(port, 1, 3) == payload
        assert "not completed within 1 s" in _error_text(_drip_until_cut_off(drip, hello[1:]))
        assert "not completed within 1 s" in _error_text(_read_reply(silent))
        silent.close()
        drip.close()
        assert _fetch(port, 2, 3) == payload
        server.wait()
    assert caplog.text.count("not completed") == 2


def test_tcp_connection_bound_does_not_stall_service(no_leaks):
    # with room for 2 connections, two idle clients are cut off and the real rank gets in
    payload = _payload()
    with _server(payload, 2, connection_timeout=0.5, max_connections=2) as server:
        idle = [_raw(server.address[1]) for _ in range(2)]
        assert _fetch(server.address[1], 1, 2) == payload
        server.wait()
        for s in idle:
            s.close()


class _Flood:
    """``n`` connections to ``port`` that never finish a handshake: silent, or (``hello``)
    sending a valid HELLO that claims a key and then never answering the challenge. With
    ``reconnect``, each one the server drops is replaced at once, from a thread (a client
    bent on holding every slot)."""

    def __init__(self, port: int, n: int, *, reconnect: bool, hello: bool) -> None:
        self.port = port
        self.hello = hello
        self.sel = selectors.DefaultSelector()
        for _ in range(n):
            self._open(_raw(port))
        self.reconnects = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run) if reconnect else None
        if self.thread is not None:
            self.thread.start()

    def _open(self, sock: socket.socket) -> None:
        if self.hello:  # rank 1 of the right world size: nothing secret in a HELLO
            sock.sendall(wire.frame(wire.HELLO, struct.pack("!B32sII", 1, bytes(32), 1, 4)))
        self.sel.register(sock, selectors.EVENT_READ)

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.02):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock.recv(4096):
                        continue  # a challenge: left unanswered
                except OSError:
                    pass
                self.sel.unregister(sock)
                sock.close()
                try:
                    self._open(socket.create_connection((HOST, self.port), timeout=1.0))
                except OSError:
                    continue  # the server is gone: it served everyone
                self.reconnects += 1

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(OK_TIMEOUT)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.sel.close()


@pytest.mark.parametrize(
    "reconnect, hello",
    [(False, False), (True, False), (True, True)],
    ids=["idle", "reconnecting", "reconnecting-challenged"],
)
def test_tcp_ranks_served_under_connection_exhaustion(no_leaks, reconnect, hello):
    # 200 connections that never finish a handshake against 64 slots, with the default
    # per-connection timeout (30 s) longer than the rendezvous timeout: every rightful rank
    # is still served, promptly.
    payload, size, timeout = _payload(), 4, 20.0
    with _server(payload, size, timeout=timeout, max_connections=64) as server:
        port = server.address[1]
        flood = _Flood(port, 200, reconnect=reconnect, hello=hello)
        try:
            elapsed: dict[int, float] = {}

            def rank(r: int) -> bytes:
                start = time.monotonic()
                got = _fetch(port, r, size, timeout=timeout)
                elapsed[r] = time.monotonic() - start
                return got

            results = per_rank(rank, range(1, size))
            assert results == {r: payload for r in range(1, size)}, results
            server.wait(timeout=5.0)
            assert max(elapsed.values()) < timeout / 2, elapsed
            if reconnect:
                assert flood.reconnects > 0  # the flood really refilled the slots
        finally:
            flood.close()


# -- TCP: broken or stray servers, as seen by a client ------------------------------------------


class _FakeServer:
    """Accepts one connection and answers with whatever ``respond(sock)`` sends."""

    def __init__(self, respond):
        self.sock = socket.create_server((HOST, 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._run, args=(respond,))
        self.thread.start()

    def _run(self, respond):
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(OK_TIMEOUT)
            respond(conn)
            try:
                conn.shutdown(socket.SHUT_WR)  # whatever was not sent is truncated
                _read_reply(conn)  # until the client hangs up
            except OSError:
                pass

    def close(self):
        self.thread.join(OK_TIMEOUT)
        self.sock.close()


def _recv_frame(conn):
    head = b""
    while len(head) < 10:
        head += conn.recv(10 - len(head))
    length = struct.unpack("!4sBBI", head)[3]
    body = b""
    while len(body) < length:
        body += conn.recv(length - len(body))
    return body


def _challenge_then(conn, tail: bytes):
    _recv_frame(conn)  # HELLO
    conn.sendall(wire.frame(wire.CHALLENGE, bytes(32)))
    _recv_frame(conn)  # AUTH
    conn.sendall(tail)


@pytest.mark.parametrize(
    ("respond", "error", "words"),
    [
        (
            lambda c: c.sendall(b"SSH-2.0-OpenSSH_9.2\r\n"),
            RendezvousProtocolError,
            "not a pynccl rendezvous server",
        ),
        (
            lambda c: _challenge_then(c, wire.frame(wire.PAYLOAD, bytes(64 + 128))),
            RendezvousAuthError,
            "could not prove it knows",
        ),
        (
            lambda c: _challenge_then(
                c, struct.pack("!4sBBI", b"PNRV", 1, wire.PAYLOAD, 0xFFFFFFF0)
            ),
            RendezvousProtocolError,
            "over the",
        ),
        (
            lambda c: _challenge_then(
                c, struct.pack("!4sBBI", b"PNRV", 1, wire.PAYLOAD, 192) + bytes(50)
            ),
            RendezvousProtocolError,
            "truncated",
        ),
        (
            lambda c: c.sendall(struct.pack("!4sBBI", b"PNRV", 2, wire.CHALLENGE, 32)),
            RendezvousProtocolError,
            "protocol version 2",
        ),
    ],
    ids=["garbage", "stray-server", "oversized", "truncated", "version"],
)
def test_tcp_client_facing_a_bad_server(no_leaks, respond, error, words):
    fake = _FakeServer(respond)
    try:
        with pytest.raises(error, match=words):
            _fetch(fake.port, 1, 2, timeout=20)
    finally:
        fake.close()


def test_tcp_server_that_never_appears(no_leaks):
    port = free_port()
    with pytest.raises(RendezvousTimeoutError) as info:
        _fetch(port, 2, 4, timeout=1.0)
    message = str(info.value)
    assert f"rank 2: could not fetch the id from rank 0 at {HOST}:{port} within 1 s" in message
    assert "Connection refused" in message


def test_tcp_server_names_one_missing_rank_in_the_singular(no_leaks):
    server = _server(_payload(), 2, timeout=1.0)
    with pytest.raises(RendezvousTimeoutError, match=r"rank 0: rank 1 of 2 did not fetch"):
        server.wait()
    server.close()


def test_tcp_server_times_out_naming_missing_ranks(no_leaks):
    payload = _payload()
    server = _server(payload, 6, timeout=2.0)
    port = server.address[1]
    assert _fetch(port, 2, 6) == payload
    with pytest.raises(RendezvousTimeoutError, match=r"ranks 1, 3-5 of 6 did not fetch"):
        server.wait()
    server.close()
    with pytest.raises(RendezvousTimeoutError):  # the port is closed now
        _fetch(port, 1, 6, timeout=0.5)


def test_tcp_port_conflict(no_leaks):
    with socket.create_server((HOST, 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousAddressError) as info:
            TcpRendezvousServer(_payload(), host=HOST, port=port, world_size=2, key=KEY)
    assert f"{HOST}:{port}" in str(info.value)
    assert "already in use" in str(info.value)
    assert info.value.errno == 98
    assert isinstance(info.value, OSError)


def test_tcp_master_addr_not_on_this_host(no_leaks):
    with pytest.raises(RendezvousAddressError, match="is not an address of this machine"):
        TcpRendezvousServer(_payload(), host="192.0.2.1", port=0, world_size=2, key=KEY)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"host": "", "port": 1}, "host"),
        ({"host": HOST, "port": 70000}, "port=70000"),
        ({"host": HOST, "port": 1, "connection_timeout": 0}, "connection_timeout=0"),
    ],
)
def test_tcp_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TcpRendezvous(**kwargs)


@pytest.mark.parametrize(
    ("payload", "rank", "world_size", "timeout", "error"),
    [
        (b"x", 2, 2, 1.0, ValueError),
        (b"x", 0, 0, 1.0, ValueError),
        (b"x", 0, 2, 0, ValueError),
        (b"x", 0, 2, float("nan"), ValueError),
        (None, 0, 2, 1.0, TypeError),
        (b"", 0, 2, 1.0, ValueError),
        (b"x", True, 2, 1.0, ValueError),
    ],
)
def test_share_argument_checks(payload, rank, world_size, timeout, error):
    for backend in (TcpRendezvous(HOST, 1, KEY), StoreRendezvous(DictStore())):
        with pytest.raises(error):
            backend.share(payload, rank=rank, world_size=world_size, timeout=timeout)


def test_ids_and_keys_never_leak(no_leaks, caplog):
    """Every failure path above, collected: no message, log record or repr shows the id."""
    caplog.set_level(logging.DEBUG)
    payload = _payload()
    texts: list[str] = []
    with _server(payload, 3, connection_timeout=0.5) as server:
        port = server.address[1]
        texts.append(repr(server))
        for key, ws in (("bad", 3), (None, 3), (KEY, 5)):
            try:
                _fetch(port, 1, ws, key=key, timeout=5)
            except RendezvousError as e:
                texts += [str(e), repr(e)]
        with _raw(port) as s:
            s.sendall(b"\x00" * 64)
            _read_reply(s)
        texts.append(repr(TcpRendezvous(HOST, port, KEY)))
        per_rank(lambda r: _fetch(port, r, 3), (1, 2))
        server.wait()
    texts.append(caplog.text)
    blob = "\n".join(texts)
    assert len(texts) > 8
    for secret in (payload.hex(), repr(payload), KEY, payload[:16].hex()):
        assert secret not in blob


# -- key-value store ----------------------------------------------------------------------------


class _NoneStore(DictStore):
    def get(self, key):
        return self.data.get(key)


class _BlockingStore:
    """Like torch.distributed.Store: get() blocks until the key exists; values become bytes."""

    def __init__(self):
        self.data = {}
        self.cond = threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout=OK_TIMEOUT):
                raise RuntimeError("store timeout")
            return self.data[key]


@pytest.mark.parametrize("store_cls", [DictStore, _NoneStore, _BlockingStore])
def test_store_many_ranks_and_repeated_rendezvous(store_cls):
    store = store_cls()
    rdzv = StoreRendezvous(store, prefix="job7")
    n = 5
    first, second = _payload(2), _payload(2)

    def rank(r):
        if r != 0:
            time.sleep(0.01 * r)
        got = [
            rdzv.share(p if r == 0 else None, rank=r, world_size=n, timeout=OK_TIMEOUT)
            for p in (first, second)
        ]
        return got

    results = per_rank(rank, reversed(range(n)))  # the readers start first
    assert results == {r: [first, second] for r in range(n)}
    assert sorted(store.data) == ["job7/uid/0", "job7/uid/1"]


def test_store_timeout_and_mismatch():
    store = DictStore()
    with pytest.raises(RendezvousTimeoutError, match="'pynccl/uid/0' did not appear"):
        StoreRendezvous(store).share(None, rank=1, world_size=2, timeout=0.3)
    StoreRendezvous(store, prefix="p").share(_payload(), rank=0, world_size=4, timeout=1)
    with pytest.raises(RendezvousMismatchError, match="world size 4"):
        StoreRendezvous(store, prefix="p").share(None, rank=1, world_size=2, timeout=1)
    store.data["q/uid/0"] = "something else"
    with pytest.raises(RendezvousProtocolError, match="did not write"):
        StoreRendezvous(store, prefix="q").share(None, rank=1, world_size=2, timeout=1)


class _CountingStore(DictStore):
    """A client of a shared server (``data``), with torch's add(key, n) -> new value."""

    def __init__(self, data):
        self.data = data

    def add(self, key, amount):
        self.data[key] = int(self.data.get(key, 0)) + amount
        return self.data[key]


def test_store_counter_lives_in_the_store():
    # A second communicator over fresh clients of the same server (new processes, a new
    # from_env) must read the second id, not the first (issue 22, item 2).
    server: dict = {}
    first, second = _payload(), _payload()
    for payload in (first, second):
        clients = [_CountingStore(server) for _ in range(2)]  # fresh objects each time
        got = per_rank(
            lambda r, c=clients, p=payload: StoreRendezvous(c[r], prefix="job").share(
                p if r == 0 else None, rank=r, world_size=2, timeout=OK_TIMEOUT
            ),
            [1, 0],  # the reader first: a stale key would be read at once
        )
        assert got == {0: payload, 1: payload}
    assert server["job/count/0"] == server["job/count/1"] == 2


def test_store_add_must_count():
    class Odd(DictStore):
        def add(self, key, amount):
            return "ok"

    with pytest.raises(RendezvousProtocolError, match=r"store.add\('p/count/0', 1\) returned 'ok'"):
        StoreRendezvous(Odd(), prefix="p").share(_payload(), rank=0, world_size=2, timeout=1)


class _CheckStore(DictStore):
    """torch's semantics: check([keys]) says whether they exist; get() of a missing key
    blocks until the store's own timeout and then raises, which must never decide ours."""

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        if key not in self.data:
            raise AssertionError("get() of a missing key: the store's timeout, not ours")
        return self.data[key].encode()


def test_store_polls_check_and_keeps_its_own_timeout():
    store = _CheckStore()
    with pytest.raises(RendezvousTimeoutError, match=r"within 0\.3 s"):
        StoreRendezvous(store).share(None, rank=1, world_size=2, timeout=0.3)
    payload = _payload()
    got = per_rank(
        lambda r: StoreRendezvous(store, prefix="c").share(
            payload if r == 0 else None, rank=r, world_size=3, timeout=OK_TIMEOUT
        ),
        [2, 1, 0],
    )
    assert got == {r: payload for r in range(3)}


def test_store_needs_set_and_get():
    with pytest.raises(TypeError, match="no get"):
        StoreRendezvous(types.SimpleNamespace(set=lambda k, v: None))


# -- MPI ----------------------------------------------------------------------------------------


class _FakeComm:
    """bcast over threads, as mpi4py's lowercase bcast behaves (root's object to all)."""

    def __init__(self, shared, rank, size):
        self.shared, self.rank, self.size = shared, rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def bcast(self, obj, root=0):
        if self.rank == root:
            self.shared["value"] = obj
        self.shared["barrier"].wait(OK_TIMEOUT)
        return self.shared["value"]


def test_mpi_fake_communicator():
    n = 4
    shared = {"barrier": threading.Barrier(n)}
    payload = _payload()

    def rank(r):
        return MpiRendezvous(_FakeComm(shared, r, n)).share(
            payload if r == 0 else None, rank=r, world_size=n, timeout=OK_TIMEOUT
        )

    assert per_rank(rank, range(n)) == {r: payload for r in range(n)}


def test_mpi_mismatch_and_type_checks():
    with pytest.raises(RendezvousMismatchError, match="size is 4 but the NCCL size is 2"):
        MpiRendezvous(_FakeComm({}, 0, 4)).share(b"x", rank=0, world_size=2, timeout=1)
    with pytest.raises(TypeError, match="bcast"):
        MpiRendezvous(object())


def test_mpi_real_mpiexec(tmp_path):
    pytest.importorskip("mpi4py")
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip install mpich) is not installed")
    script = tmp_path / "share.py"
    script.write_text(
        "import os\n"
        "from mpi4py import MPI\n"
        "from pynccl.bootstrap import MpiRendezvous\n"
        "c = MPI.COMM_WORLD\n"
        "p = os.urandom(256) if c.Get_rank() == 0 else None\n"
        "got = MpiRendezvous(c).share(p, rank=c.Get_rank(), world_size=c.Get_size(), timeout=9)\n"
        "mine = p.hex() if p else '-'\n"
        "with open(os.path.join(os.path.dirname(__file__), f'out{c.Get_rank()}'), 'w') as f:\n"
        "    f.write(f'{c.Get_rank()} {got.hex()} {mine}')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    subprocess.run(
        [mpiexec, "-n", "3", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    rows = [(tmp_path / f"out{r}").read_text().split() for r in range(3)]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    root_payload = rows[0][2]
    assert len(root_payload) == 512
    assert all(r[1] == root_payload for r in rows)


# -- file ---------------------------------------------------------------------------------------


def test_file_many_ranks_mode_and_cleanup(tmp_path):
    path = tmp_path / "uid"
    payload = _payload(2)
    n = 5
    mode = []

    def rank(r):
        if r == 1:  # rank 0's file is there, and private, before anyone read it
            deadline = time.monotonic() + OK_TIMEOUT
            while not path.exists():
                assert time.monotonic() < deadline
                time.sleep(0.005)
            mode.append(stat.S_IMODE(path.stat().st_mode))
        return FileRendezvous(path, KEY).share(
            payload if r == 0 else None, rank=r, world_size=n, timeout=OK_TIMEOUT
        )

    results = per_rank(rank, reversed(range(n)))
    assert results == {r: payload for r in range(n)}
    assert mode == [0o600]
    assert list(tmp_path.iterdir()) == []  # file, temp file and acks removed


def _stale_file(path, key) -> bytes:
    """The bytes rank 0 of another job leaves at ``path``."""
    other = FileRendezvous(path, key, poll_interval=0.01)

    def abandoned_rank0():
        with pytest.raises(RendezvousTimeoutError):
            other.share(_payload(), rank=0, world_size=2, timeout=1.0)

    t = threading.Thread(target=abandoned_rank0)
    t.start()
    deadline = time.monotonic() + OK_TIMEOUT
    while True:
        try:
            data = path.read_bytes()
            break
        except FileNotFoundError:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    t.join()
    return data


def test_file_stale_file_from_another_job_is_ignored(tmp_path):
    path = tmp_path / "uid"
    stale = _stale_file(path, "previous-run-key")
    path.write_bytes(stale)
    with pytest.raises(RendezvousTimeoutError, match="not written by this job"):
        FileRendezvous(path, KEY).share(None, rank=1, world_size=2, timeout=0.5)
    payload = _payload()

    def rank(r):
        if r == 0:
            time.sleep(0.3)  # rank 1 polls the stale file meanwhile
        return FileRendezvous(path, KEY).share(
            payload if r == 0 else None, rank=r, world_size=2, timeout=OK_TIMEOUT
        )

    assert per_rank(rank, (1, 0)) == {0: payload, 1: payload}


def test_file_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("PYNCCL_RENDEZVOUS_KEY", raising=False)
    with pytest.raises(ValueError, match="needs a key"):
        FileRendezvous(tmp_path / "uid")
    with pytest.raises(ValueError, match="does not exist"):
        FileRendezvous(tmp_path / "no" / "uid", KEY)
    with pytest.raises(RendezvousTimeoutError, match=r"ranks 1-2 of 3 did not read"):
        FileRendezvous(tmp_path / "uid", KEY).share(_payload(), rank=0, world_size=3, timeout=0.3)
    assert list(tmp_path.iterdir()) == []
    path = tmp_path / "uid2"
    path.write_bytes(_stale_file(path, KEY))  # same key, other world size
    with pytest.raises(RendezvousMismatchError, match="world size 2"):
        FileRendezvous(path, KEY).share(None, rank=1, world_size=3, timeout=5)


def test_backends_satisfy_the_protocol():
    for backend in (
        TcpRendezvous(HOST, 1),
        StoreRendezvous(DictStore()),
        MpiRendezvous(_FakeComm({}, 0, 1)),
    ):
        assert isinstance(backend, Rendezvous)


# -- from_env -----------------------------------------------------------------------------------


class _FakeUniqueId:
    made = 0

    def __init__(self, data=None):
        if data is None:
            _FakeUniqueId.made += 1
            data = os.urandom(128)
        self.data = bytes(data)

    @classmethod
    def from_bytes(cls, data):
        return cls(data)

    def __bytes__(self):
        return self.data


class _FakeCommunicator:
    def __init__(
        self, nranks, unique_id, rank, *, device=None, config=None, stream=None,
        watchdog_timeout=None,
    ):  # fmt: skip
        self.args = (nranks, unique_id, rank, device, config)
        self.watchdog_timeout = watchdog_timeout


@pytest.fixture
def fake_comm(monkeypatch):
    module = types.ModuleType("pynccl.comm")
    module.UniqueId = _FakeUniqueId
    module.Communicator = _FakeCommunicator
    monkeypatch.setitem(sys.modules, "pynccl.comm", module)
    return module


def _torchrun_env(rank, n, port, **extra):
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(n),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(n),
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port),
        "PYNCCL_RENDEZVOUS_KEY": KEY,
    }
    env.update(extra)
    return env


@pytest.mark.parametrize("nids", [1, 3])
def test_from_env_tcp(no_leaks, fake_comm, nids):
    n = 4
    port = free_port()
    results = per_rank(
        lambda r: from_env(
            environ=_torchrun_env(r, n, port), nids=nids, timeout=OK_TIMEOUT, watchdog_timeout=7.5
        ),
        range(n),
    )
    assert all(results[r].watchdog_timeout == 7.5 for r in range(n))
    args = [results[r].args for r in range(n)]
    for r, (nranks, _uid, rank, device, config) in enumerate(args):
        assert (nranks, rank, device, config) == (n, r, r, None)
    ids = [[bytes(u) for u in (a[1] if nids > 1 else [a[1]])] for a in args]
    assert all(x == ids[0] for x in ids)
    assert len(ids[0]) == nids and len(set(ids[0])) == nids


@pytest.mark.parametrize(
    ("world", "scalable", "expected"),
    [(4, True, 1), (512, True, 1), (513, True, 2), (1537, True, 4), (65536, True, 128),
     (1537, False, 1)],
)  # fmt: skip
def test_from_env_chooses_the_number_of_ids_from_the_world_size(
    fake_comm, monkeypatch, world, scalable, expected
):
    # NCCL advises one unique id (bootstrap root) per 128 to 1,024 ranks for
    # ncclCommInitRankScalable: ceil(world / 512) ids where the library has it, one where it
    # does not; id i is made by the first rank of NCCL's group i, which takes part here
    module = sys.modules["pynccl.comm._from_env"]
    monkeypatch.setattr(module, "_has_scalable_init", lambda: scalable)
    store = DictStore()
    makers = [i * (world // expected) + min(i, world % expected) for i in range(expected)]
    done = per_rank(
        lambda r: from_env(rank=r, world_size=world, store=store, device=0, timeout=OK_TIMEOUT),
        sorted({*makers, world - 1}),
    )
    comms = [done[0], done[world - 1]]
    ids = [[bytes(u) for u in (c.args[1] if isinstance(c.args[1], list) else [c.args[1]])]
           for c in comms]  # fmt: skip
    assert len(ids[0]) == expected and len(set(ids[0])) == expected
    assert ids[1] == ids[0]
    assert all(c.args[0] == world for c in comms)
    if expected > 1:  # how many ranks each root serves, as NCCL advises
        assert 128 <= world / expected <= 1024


def test_from_env_knows_whether_the_library_has_scalable_init():
    from pynccl.comm import _from_env
    from pynccl.library import lib

    L = lib()
    expected = L.version >= (2, 23, 4) and L.has("ncclCommInitRankScalable")
    assert _from_env._has_scalable_init() is expected


def test_from_env_store_file_and_device(fake_comm, tmp_path):
    store = DictStore()
    environ = dict(_torchrun_env(0, 2, 1), CUDA_VISIBLE_DEVICES="5,6")
    results = per_rank(
        lambda r: from_env(
            environ={**environ, "RANK": str(r), "LOCAL_RANK": str(r)},
            store=store,
            timeout=OK_TIMEOUT,
        ),
        range(2),
    )
    assert [results[r].args[3] for r in range(2)] == [0, 1]
    assert bytes(results[0].args[1]) == bytes(results[1].args[1])
    slurm = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "localhost",
    }
    results = per_rank(
        lambda r: from_env(
            environ={**slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            file=tmp_path / "uid",
            device=7,
            timeout=OK_TIMEOUT,
        ),
        range(2),
    )
    assert bytes(results[0].args[1]) == bytes(results[1].args[1])
    assert results[1].args[3] == 7


def test_from_env_errors(fake_comm, tmp_path):
    mpich = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}
    with pytest.raises(LaunchEnvError, match="mpich launch detected but the TCP rendezvous") as e:
        from_env(environ=mpich)
    assert "MASTER_ADDR is not set" in str(e.value) and "MASTER_PORT is not set" in str(e.value)
    with pytest.raises(ValueError, match="at most one of"):
        from_env(environ=mpich, store=DictStore(), file=tmp_path / "x")
    with pytest.raises(ValueError, match="nids=0"):
        from_env(environ=mpich, nids=0)
    with pytest.raises(LaunchEnvError, match="no launcher detected"):
        from_env(environ={})
    store = DictStore()
    StoreRendezvous(store).share(_payload(2), rank=0, world_size=2, timeout=1)
    with pytest.raises(RendezvousProtocolError, match="expects nids=1"):
        from_env(environ=mpich, store=store, nids=1)


def test_from_env_with_rank_and_world_size(fake_comm):
    # no launcher at all (Ray actors, a process pool): the caller says where it sits
    store = DictStore()
    results = per_rank(
        lambda r: from_env(
            rank=r,
            world_size=3,
            store=store,
            environ={"CUDA_VISIBLE_DEVICES": str(4 + r)},  # one GPU each, as Ray gives it
            timeout=OK_TIMEOUT,
        ),
        [2, 1, 0],
    )
    assert [results[r].args[2:4] for r in range(3)] == [(r, 0) for r in range(3)]
    assert {bytes(results[r].args[1]) for r in range(3)} == {bytes(results[0].args[1])}
    assert from_env(rank=0, world_size=1, local_rank=0, environ={}).args[3] == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"rank": 0}, ValueError, "world_size= is missing"),
        ({"world_size": 2}, ValueError, "rank= is missing"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank=2 is out of range"),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size=0 is out of range"),
        ({"rank": True, "world_size": 2}, TypeError, "rank must be an int"),
        ({"rank": 0, "world_size": 2, "local_rank": -1}, ValueError, "local_rank=-1"),
        ({"local_rank": 0}, ValueError, "local_rank= goes with rank="),
    ],
)
def test_from_env_rank_and_world_size_errors(fake_comm, kwargs, error, words):
    with pytest.raises(error, match=re.escape(words)):
        from_env(environ={}, store=DictStore(), timeout=1, **kwargs)


def test_from_env_mpi_comm_gives_the_size_pmix_does_not(fake_comm):
    # PMIx alone (prterun): PMIX_RANK and no size; the MPI communicator knows it
    n = 3
    shared = {"barrier": threading.Barrier(n)}
    results = per_rank(
        lambda r: from_env(
            environ={
                "PMIX_RANK": str(r),
                "PMIX_NAMESPACE": "prterun-h-1@1",
                "CUDA_VISIBLE_DEVICES": "0",
            },
            mpi_comm=_FakeComm(shared, r, n),
            timeout=OK_TIMEOUT,
        ),
        range(n),
    )
    assert [results[r].args[0] for r in range(n)] == [n] * n
    assert [results[r].args[2] for r in range(n)] == list(range(n))
    with pytest.raises(LaunchEnvError, match="mpi_comm="):
        from_env(environ={"PMIX_RANK": "0"}, store=DictStore(), timeout=1)


def test_from_env_one_gpu_pod_without_local_rank(fake_comm, monkeypatch):
    # a Kubeflow PyTorchJob pod: RANK/WORLD_SIZE/MASTER_*, one GPU, no LOCAL_RANK
    module = sys.modules[from_env.__module__]
    monkeypatch.setattr(module, "_device_count", lambda: 1)
    pod = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": HOST, "MASTER_PORT": "1"}
    store = DictStore()
    StoreRendezvous(store).share(_payload(), rank=0, world_size=2, timeout=1)
    assert from_env(environ=pod, store=store, timeout=OK_TIMEOUT).args[3] == 0
    monkeypatch.setattr(module, "_device_count", lambda: 8)
    with pytest.raises(LaunchEnvError, match="gives no local rank and CUDA sees 8 devices"):
        from_env(environ=pod, store=store, timeout=OK_TIMEOUT)


def test_from_env_store_after_a_torchrun_restart(fake_comm):
    # torchrun --max-restarts: attempt 0's rank 0 shared an id and rank 1 died before
    # reading it. In attempt 1 (new processes, fresh store clients) every rank must meet
    # on a new id, not attempt 0's (issue 22, item 2).
    server: dict = {}
    base = {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": HOST,
        "MASTER_PORT": "1",
        "TORCHELASTIC_RUN_ID": "job9",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    attempt0 = {**base, "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    old = from_env(environ=attempt0, store=_CountingStore(server), timeout=OK_TIMEOUT)
    results = per_rank(
        lambda r: from_env(
            environ={**base, "RANK": str(r), "TORCHELASTIC_RESTART_COUNT": "1"},
            store=_CountingStore(server),
            timeout=OK_TIMEOUT,
        ),
        [1, 0],  # the reader first: attempt 0's key would be read at once
    )
    new = {bytes(results[r].args[1]) for r in range(2)}
    assert len(new) == 1 and new != {bytes(old.args[1])}
    assert any(k.startswith("pynccl/run-job9/attempt-1/") for k in server)


def _can_bind(host: str) -> bool:
    try:
        with socket.create_server(
            (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        ):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["localhost", "::1"])
def test_tcp_other_loopback_spellings(no_leaks, host):
    if not _can_bind("::1" if host == "::1" else "127.0.0.1"):
        pytest.skip(f"cannot listen on {host} here")
    payload = _payload()
    with TcpRendezvousServer(
        payload, host=host, port=0, world_size=2, key=KEY, timeout=OK_TIMEOUT
    ).start() as server:
        got = TcpRendezvous(host, server.address[1], KEY).fetch(
            rank=1, world_size=2, timeout=OK_TIMEOUT
        )
        server.wait()
    assert got == payload
