"""Rank 0's side of the TCP rendezvous: a selector-driven server that hands the payload
to every other rank (the wire format and the handshake are described in :mod:`._wire`).

It is a network service reachable by anything on the network, so it is built as
one: one selector thread, non-blocking sockets, a bounded number of concurrent
connections, a deadline per connection (a client dripping bytes or sending
nothing is cut off without stalling the others) and an overall deadline.
"""

from __future__ import annotations

import heapq
import hmac
import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections import deque

from ._common import check_share_args, ranks_phrase
from ._net import open_listener
from ._progress import arrived_phrase, missing_report, say
from ._progress import report_interval as _report_interval
from ._seal import DIGEST, KEY_ENV, NONCE, mac, normalize_key, seal
from ._wire import (
    AUTH,
    CHALLENGE,
    DEFAULT_MAX_PAYLOAD,
    ERR_AUTH,
    ERR_PROTOCOL,
    ERR_TIMEOUT,
    HEADER,
    HELLO,
    HELLO_BODY,
    MAGIC,
    PAYLOAD,
    VERSION,
    check_host_port,
    check_positive,
    error_frame,
    frame,
    hello_refusal,
    transcript,
)
from .errors import RendezvousError, RendezvousTimeoutError

__all__ = ["TcpRendezvousServer"]

logger = logging.getLogger("pynccl.bootstrap")

_LINGER = 2.0  # seconds to wait for a client's FIN after our last frame
_MAX_DISCARD = 1 << 16  # bytes a closing connection may still send us
_RECV_CHUNK = 4096
_GRACE = 0.5  # seconds a handshake keeps its slot before a waiting connection may displace it
_BACKLOG = 65535  # the kernel caps it at net.core.somaxconn
_ACCEPT_BATCH = 512  # accepts per round, so that reads interleave with a flood of arrivals


_READ_HELLO, _READ_AUTH, _SENDING, _CLOSING, _DRAINING = range(5)


class _Waiting:
    """An accepted connection in the lobby: not read from, watched only for its first bytes."""

    __slots__ = ("peer", "sock")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer


class _Conn:
    __slots__ = (
        "closed",
        "deadline",
        "discarded",
        "inbuf",
        "nonce_c",
        "nonce_s",
        "outbuf",
        "peer",
        "pool",
        "rank",
        "since",
        "sock",
        "state",
        "writing",
    )

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.since = time.monotonic()  # when it got its slot
        self.state = _READ_HELLO
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.rank: int | None = None
        self.nonce_c = b""
        self.nonce_s = b""
        self.discarded = 0
        self.closed = False
        self.writing = False  # registered for EVENT_WRITE
        self.pool: dict[_Conn, None] | None = None  # the eviction pool it sits in, if any


class TcpRendezvousServer:
    """Rank 0's side: serves ``payload`` to ranks 1..world_size-1, then closes.

    The listening socket is bound in the constructor, so a port conflict or a
    non-local address raises :class:`RendezvousAddressError` right away. Call
    :meth:`start` to serve from a background thread and :meth:`wait` to block
    until every rank got the payload (raising :class:`RendezvousTimeoutError`
    that names the missing ranks otherwise). The thread stops and every socket is
    closed when all ranks are served, when ``timeout`` (counted from
    :meth:`start`) passes, or on :meth:`close`. Misbehaving clients are refused
    with an error frame and logged on the ``pynccl.bootstrap`` logger; they do
    not stop the server. ``port=0`` picks a free port (see :attr:`address`).

    Rightful ranks are served whatever other connections do: a handshake must
    finish within ``connection_timeout`` (capped at ``timeout``), and at most
    ``max_connections`` handshakes hold a slot at once. Connections beyond them are
    accepted at once (a full listen queue would drop their SYNs and cost seconds of
    retries) and wait unread, in arrival order, in a lobby bounded by the file
    descriptor limit. Each takes the next free slot, or displaces the oldest
    unauthenticated handshake that has held its slot for 0.5 s (at most
    ``connection_timeout``): refused ones first (at once), then those that sent
    nothing, then those challenged; only ranks that proved the key keep their slot.
    So ranks arriving together never displace each other's handshakes, and idle or
    hostile connections hold a slot for half a second at a time.

    While it waits, every ``report_interval`` seconds (default
    ``$PYNCCL_RENDEZVOUS_REPORT``, else 30; 0: never) and at the timeout it writes one
    line on stderr naming the ranks that have not arrived and the hosts of those that did.
    """

    def __init__(
        self,
        payload: bytes,
        *,
        host: str,
        port: int,
        world_size: int,
        key: str | bytes | None = None,
        timeout: float = 300.0,
        connection_timeout: float = 30.0,
        report_interval: float | None = None,
        max_connections: int = 1024,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        bind: str | None = None,
    ) -> None:
        check_host_port(host, port, allow_zero=True)
        data = check_share_args(payload, 0, world_size, timeout)
        assert data is not None  # rank 0 always gets its payload back
        if len(data) > max_payload:
            raise ValueError(f"payload of {len(data)} bytes exceeds max_payload={max_payload}")
        if (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or (max_connections < 1)
        ):
            raise ValueError(f"max_connections={max_connections!r} is not a positive integer")
        self._payload = data
        self._host = host
        self._world_size = world_size
        self._key = normalize_key(key)
        self._timeout = float(timeout)
        # a handshake may never outlast the rendezvous: slots must free up within it
        self._conn_timeout = min(
            check_positive("connection_timeout", connection_timeout), self._timeout
        )
        self._max_conns = max_connections
        # Unauthenticated connections, oldest first, in the order they are evicted when every
        # slot is taken: refused ones still closing, then silent ones, then those challenged.
        self._doomed: dict[_Conn, None] = {}
        self._fresh: dict[_Conn, None] = {}
        self._challenged: dict[_Conn, None] = {}
        self._evicted = 0
        self._grace = min(_GRACE, self._conn_timeout)
        # Accepted connections waiting for a slot, oldest first, unread: those that sent
        # something (a rank's HELLO comes with its connection) go before silent ones.
        self._silent: dict[_Waiting, None] = {}
        self._spoken: deque[_Waiting] = deque()
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fds = 1 << 20 if soft == resource.RLIM_INFINITY else soft
        self._lobby_cap = max(64, min(1 << 16, fds // 2 - max_connections))
        self._admit_at = float("inf")  # when the oldest handshake may be displaced
        self._served: set[int] = set()
        self._hosts: dict[int, str] = {}  # rank -> the address it connected from
        self._report = _report_interval(report_interval)
        self._started = 0.0
        self._next_report = float("inf")
        self._rejections: list[str] = []
        self._conns: dict[int, _Conn] = {}
        self._heap: list[tuple[float, int, _Conn]] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = False
        self._releasing = False
        self._finished = threading.Event()
        self._outcome = "not started"
        self._crash: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._deadline = 0.0

        sock = open_listener(host, port, bind, backlog=_BACKLOG)
        sock.setblocking(False)
        self._listener = sock
        self._listening = False
        self._port = int(sock.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    # -- public --------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` clients should connect to (the real port when 0 was asked)."""
        return self._host, self._port

    @property
    def served_ranks(self) -> frozenset[int]:
        """Ranks that have been handed the payload so far."""
        with self._lock:
            return frozenset(self._served)

    def start(self) -> TcpRendezvousServer:
        """Start serving from a daemon thread; returns ``self``."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("TcpRendezvousServer.start() called twice")
            if self._stop:
                raise RuntimeError("TcpRendezvousServer is closed")
            self._started = time.monotonic()
            self._deadline = self._started + self._timeout
            if self._report > 0:
                self._next_report = self._started + self._report
            self._thread = threading.Thread(
                target=self._run, name=f"pynccl-rendezvous:{self._port}", daemon=True
            )
            self._outcome = "running"
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> None:
        """Block until every rank was served; raise if the server gave up or failed.

        ``timeout`` bounds this wait only (``None``: until the server's own
        deadline); when it passes first, :class:`RendezvousTimeoutError` is raised
        and the server keeps running.
        """
        if self._thread is None:
            raise RuntimeError("TcpRendezvousServer.wait() before start()")
        if not self._finished.wait(timeout):
            raise RendezvousTimeoutError(
                f"rank 0: still waiting for {self._missing()} after {timeout} s"
            )
        if self._crash is not None:
            raise RendezvousError(
                f"rank 0: the rendezvous server at {self._host}:{self._port} failed: "
                f"{self._crash!r}"
            ) from self._crash
        if self._outcome == "done":
            return
        if self._outcome == "timeout":
            detail = ""
            if self._evicted:
                detail += (
                    f"; {self._evicted} unauthenticated connection(s) were dropped at the "
                    f"bound of {self._max_conns}"
                )
            if self._rejections:
                detail += "; refused meanwhile: " + "; ".join(self._rejections[-5:])
            with self._lock:
                arrived = arrived_phrase(self._hosts)
            raise RendezvousTimeoutError(
                f"rank 0: {self._missing()} of {self._world_size} did not fetch the id "
                f"from {self._host}:{self._port} within {self._timeout:g} s (did they start, "
                f"with the same MASTER_ADDR/MASTER_PORT?); arrived: {arrived}{detail}"
            )
        raise RendezvousError(f"rank 0: the rendezvous server was closed ({self._outcome})")

    def close(self) -> None:
        """Stop serving and release the thread and every socket (idempotent)."""
        with self._lock:
            self._stop = True
            thread = self._thread
            if thread is not None:
                try:
                    self._wake_w.send(b"x")
                except OSError:
                    pass  # already closed by the thread, or the wake buffer is full
        if thread is not None:
            if thread is not threading.current_thread():
                thread.join()
        else:
            self._release()

    def __enter__(self) -> TcpRendezvousServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TcpRendezvousServer(host={self._host!r}, port={self._port}, "
            f"world_size={self._world_size}, keyed={self._key is not None}, "
            f"state={self._outcome!r})"
        )

    # -- internals -------------------------------------------------------------------------

    def _missing(self) -> str:
        with self._lock:
            return ranks_phrase(set(range(1, self._world_size)) - self._served)

    def _say_missing(self, now: float, why: str) -> None:
        with self._lock:
            missing = set(range(1, self._world_size)) - self._served
            line = missing_report(missing, self._world_size, self._hosts, now - self._started)
        say(f"rank 0 at {self._host}:{self._port}{why}: {line}")

    def _run(self) -> None:
        try:
            self._sel.register(self._wake_r, selectors.EVENT_READ, None)
            self._set_listening(True)
            self._loop()
        except BaseException as e:  # reported by wait(); the thread must not die silently
            self._crash = e
            self._outcome = "failed"
            logger.error("rendezvous server on port %d failed: %r", self._port, e)
        finally:
            if self._outcome == "timeout":
                self._say_missing(time.monotonic(), ", giving up")
                logger.warning(
                    "rendezvous on port %d: gave up after %g s; ranks %s never fetched the id",
                    self._port,
                    self._timeout,
                    self._missing(),
                )
            self._release()
            self._finished.set()

    def _release(self) -> None:
        with self._lock:
            if self._releasing:
                return
            self._releasing = True
            conns = list(self._conns.values())
        for conn in conns:
            self._drop(conn)
        for waiting in [*self._silent, *self._spoken]:
            waiting.sock.close()
        self._silent.clear()
        self._spoken.clear()
        self._listener.close()
        self._sel.close()
        with self._lock:  # close() may be writing to the wake socket
            self._wake_r.close()
            self._wake_w.close()

    def _set_listening(self, on: bool) -> None:
        if on and not self._listening:
            self._sel.register(self._listener, selectors.EVENT_READ, self._listener)
        elif not on and self._listening:
            self._sel.unregister(self._listener)
        self._listening = on

    def _loop(self) -> None:
        need = self._world_size - 1
        while True:
            with self._lock:
                if self._stop:
                    self._outcome = "closed"
                    return
                if len(self._served) >= need:
                    self._outcome = "done"
                    return
            now = time.monotonic()
            if now >= self._deadline:
                self._outcome = "timeout"
                return
            self._expire(now)
            self._admit(now)
            if now >= self._next_report:
                self._say_missing(now, "")
                self._next_report = now + self._report
            wake = min(self._deadline, self._next_report, self._admit_at)
            if self._heap:
                wake = min(wake, self._heap[0][0])
            accept = False
            for skey, mask in self._sel.select(max(0.0, wake - now)):
                data = skey.data
                if data is None:
                    try:
                        self._wake_r.recv(64)
                    except BlockingIOError:
                        pass
                elif data is self._listener:
                    accept = True
                elif isinstance(data, _Waiting):  # it spoke: ahead of the silent ones
                    self._sel.unregister(data.sock)
                    del self._silent[data]
                    self._spoken.append(data)
                else:
                    assert isinstance(data, _Conn)
                    if mask & selectors.EVENT_READ and not data.closed:
                        self._on_readable(data)
                    if mask & selectors.EVENT_WRITE and not data.closed:
                        self._flush(data)
            if accept:
                self._accept()

    def _expire(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            deadline, _, conn = heapq.heappop(self._heap)
            if conn.closed or deadline != conn.deadline:
                continue
            if conn.state in (_READ_HELLO, _READ_AUTH):
                self._reject(
                    conn,
                    ERR_TIMEOUT,
                    f"handshake not completed within {self._conn_timeout:g} s",
                    linger=False,
                )
            else:
                self._drop(conn)

    def _push_deadline(self, conn: _Conn, deadline: float) -> None:
        conn.deadline = deadline
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, conn))

    def _lobby_size(self) -> int:
        return len(self._silent) + len(self._spoken)

    def _accept(self) -> None:
        """Take what the listen queue holds into the lobby (bounded): the kernel's queue
        never overflows while the lobby has room."""
        for _ in range(_ACCEPT_BATCH):
            if self._lobby_size() >= self._lobby_cap:
                self._set_listening(False)  # _admit listens again once the lobby moves
                break
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # EMFILE and friends: keep serving those already connected
                logger.warning("rendezvous: accept failed on port %d: %s", self._port, e)
                break
            sock.setblocking(False)
            waiting = _Waiting(sock, f"{addr[0]}:{addr[1]}")
            if len(self._conns) < self._max_conns and not self._lobby_size():
                self._take(waiting, time.monotonic())
            else:
                self._silent[waiting] = None
                self._sel.register(sock, selectors.EVENT_READ, waiting)
        self._admit(time.monotonic())

    def _admit(self, now: float) -> None:
        """Give waiting connections a slot, those that spoke first: a free slot, or (for one
        that spoke) one whose handshake may be displaced (see the class docstring)."""
        self._admit_at = float("inf")
        while self._spoken or self._silent:
            if len(self._conns) < self._max_conns:
                if self._spoken:
                    self._take(self._spoken.popleft(), now)
                else:
                    waiting = next(iter(self._silent))
                    del self._silent[waiting]
                    self._take(waiting, now, watched=True)
            elif self._spoken and self._evict(now):
                self._take(self._spoken.popleft(), now)
            else:
                break
        if not self._listening and not self._releasing and self._lobby_size() < self._lobby_cap:
            self._set_listening(True)

    def _take(self, waiting: _Waiting, now: float, *, watched: bool = False) -> None:
        """Give ``waiting`` a slot: its handshake starts (``watched``: still registered)."""
        conn = _Conn(waiting.sock, waiting.peer, min(now + self._conn_timeout, self._deadline))
        self._push_deadline(conn, conn.deadline)
        with self._lock:
            self._conns[conn.sock.fileno()] = conn
        if watched:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        else:
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
        self._move(conn, self._fresh)

    def _move(self, conn: _Conn, pool: dict[_Conn, None] | None) -> None:
        """Put ``conn`` at the young end of the eviction ``pool`` (None: not evictable)."""
        if conn.pool is not None:
            conn.pool.pop(conn, None)
        conn.pool = pool
        if pool is not None:
            pool[conn] = None

    def _evict(self, now: float) -> bool:
        """Drop the oldest unauthenticated connection that may be displaced to make room for
        one waiting in the lobby; False (and when to ask again) if none may be yet. A client
        dropped before it was answered reconnects (see :meth:`TcpRendezvous.fetch`)."""
        victim = next(iter(self._doomed), None)  # refused: no grace
        if victim is None:
            oldest = [next(iter(p)) for p in (self._fresh, self._challenged) if p]
            victim = next((c for c in oldest if now - c.since >= self._grace), None)
            if victim is None:
                if oldest:
                    self._admit_at = min(c.since for c in oldest) + self._grace
                return False
        self._evicted += 1
        logger.info(
            "rendezvous on port %d: all %d connection slots taken; dropped %s, the oldest "
            "unauthenticated one",
            self._port,
            self._max_conns,
            victim.peer,
        )
        self._drop(victim)
        return True

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._move(conn, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        with self._lock:
            self._conns.pop(conn.sock.fileno(), None)
        conn.sock.close()

    def _note(self, conn: _Conn, reason: str) -> None:
        who = conn.peer if conn.rank is None else f"{conn.peer} (rank {conn.rank})"
        logger.warning("rendezvous on port %d: refused %s: %s", self._port, who, reason)
        with self._lock:
            self._rejections.append(f"{who}: {reason}")
            del self._rejections[:-20]

    def _reject(self, conn: _Conn, code: int, reason: str, *, linger: bool = True) -> None:
        self._note(conn, reason)
        conn.inbuf.clear()
        conn.outbuf += error_frame(code, reason)
        conn.state = _CLOSING
        self._move(conn, self._doomed)
        if not linger:
            self._push_deadline(conn, time.monotonic() + 0.5)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.outbuf:
                n = conn.sock.send(conn.outbuf)
                del conn.outbuf[:n]
        except (BlockingIOError, InterruptedError):
            if not conn.writing:
                self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
                conn.writing = True
            return
        except OSError as e:
            logger.info("rendezvous: lost %s while sending: %s", conn.peer, e)
            self._drop(conn)
            return
        if conn.writing:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
            conn.writing = False
        if conn.state == _SENDING:
            assert conn.rank is not None
            with self._lock:
                if conn.rank in self._served:
                    logger.warning(
                        "rendezvous: rank %d (%s) fetched the id again", conn.rank, conn.peer
                    )
                self._served.add(conn.rank)
                self._hosts[conn.rank] = conn.peer.rpartition(":")[0]
        if conn.state in (_SENDING, _CLOSING):
            conn.state = _DRAINING
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._drop(conn)
                return
            self._push_deadline(conn, min(conn.deadline, time.monotonic() + _LINGER))

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            logger.info("rendezvous: lost %s: %s", conn.peer, e)
            self._drop(conn)
            return
        if conn.state == _DRAINING or conn.state == _CLOSING:
            conn.discarded += len(data)
            if not data or conn.discarded > _MAX_DISCARD:
                self._drop(conn)
            return
        if not data:
            if conn.inbuf:
                self._note(
                    conn,
                    f"connection closed mid-message after {len(conn.inbuf)} "
                    "bytes (truncated message)",
                )
            elif conn.state == _READ_AUTH:
                self._note(conn, "connection closed during the handshake")
            else:
                logger.debug("rendezvous: %s connected and closed without a word", conn.peer)
            self._drop(conn)
            return
        conn.inbuf += data
        self._parse(conn)

    def _parse(self, conn: _Conn) -> None:
        buf = conn.inbuf
        if len(buf) < HEADER.size:
            if not MAGIC.startswith(bytes(buf[:4])):
                self._reject(conn, ERR_PROTOCOL, "not a pynccl rendezvous message (bad magic)")
            return
        magic, version, kind, length = HEADER.unpack_from(buf)
        if magic != MAGIC:
            self._reject(conn, ERR_PROTOCOL, "not a pynccl rendezvous message (bad magic)")
            return
        if version != VERSION:
            self._reject(
                conn,
                ERR_PROTOCOL,
                f"protocol version {version} is not supported (rank 0 speaks {VERSION}): "
                "mixed pynccl versions?",
            )
            return
        expected, size = (HELLO, HELLO_BODY.size) if conn.state == _READ_HELLO else (AUTH, DIGEST)
        if kind != expected:
            self._reject(conn, ERR_PROTOCOL, f"message type {kind} where {expected} expected")
            return
        if length != size:
            self._reject(
                conn,
                ERR_PROTOCOL,
                f"message length {length} where exactly {size} bytes are expected"
                + (" (oversized)" if length > size else ""),
            )
            return
        end = HEADER.size + size
        if len(buf) < end:
            return
        if len(buf) > end:
            self._reject(conn, ERR_PROTOCOL, "unexpected bytes after a message")
            return
        body = bytes(buf[HEADER.size : end])
        buf.clear()
        if expected == HELLO:
            self._on_hello(conn, body)
        else:
            self._on_auth(conn, body)

    def _on_hello(self, conn: _Conn, body: bytes) -> None:
        flags, nonce_c, rank, world_size = HELLO_BODY.unpack(body)
        conn.rank = rank
        refusal = hello_refusal(flags, rank, world_size, self._world_size, self._key is not None)
        if refusal is not None:
            self._reject(conn, *refusal)
            return
        conn.nonce_c = nonce_c
        conn.nonce_s = os.urandom(NONCE)
        conn.state = _READ_AUTH
        self._move(conn, self._challenged)
        conn.outbuf += frame(CHALLENGE, conn.nonce_s)
        self._flush(conn)

    def _on_auth(self, conn: _Conn, body: bytes) -> None:
        assert conn.rank is not None
        key = self._key or b""
        tx = transcript(conn.nonce_c, conn.nonce_s, conn.rank, self._world_size)
        if not hmac.compare_digest(body, mac(key, b"pynccl-rdzv client", tx)):
            self._reject(
                conn,
                ERR_AUTH,
                f"rendezvous key rejected: this rank's {KEY_ENV} differs from rank 0's",
            )
            return
        session = mac(key, b"pynccl-rdzv session", tx)
        proof = mac(key, b"pynccl-rdzv server", tx)
        conn.state = _SENDING
        self._move(conn, None)  # authenticated: never evicted
        conn.outbuf += frame(PAYLOAD, proof + seal(session, self._payload))
        self._flush(conn)
