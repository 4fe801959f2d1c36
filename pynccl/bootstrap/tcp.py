"""TCP rendezvous: rank 0 serves the unique id(s) at ``MASTER_ADDR:MASTER_PORT``.

The server is a network service reachable by anything on the network, so it is
built as one:

* one selector thread, non-blocking sockets, a bounded number of concurrent
  connections, a deadline per connection (a client dripping bytes or sending
  nothing is cut off without stalling the others) and an overall deadline;
* length-prefixed, versioned frames ``magic "PNRV" | version | type | length``
  with a fixed or bounded size per message type, checked before reading the body;
* mutual HMAC-SHA256 challenge-response on the job key: the client proves the
  key before it is sent anything, and the server proves it too, so a stray
  server cannot feed a client a wrong id; the id itself travels sealed
  (encrypted and authenticated) under a per-connection session key;
* the handshake carries the world size and the client's rank, so a rank from a
  differently sized job is refused with a message saying so.

Exchange (C = rank k, S = rank 0)::

    C -> S  HELLO      flags(has key) | nonce_c[32] | rank u32 | world_size u32
    S -> C  CHALLENGE  nonce_s[32]                      (or ERROR code | text)
    C -> S  AUTH       HMAC(key, "client" | transcript)
    S -> C  PAYLOAD    HMAC(key, "server" | transcript) | seal(session, ids)
                                                        (or ERROR code | text)

where ``transcript = nonce_c | nonce_s | rank | world_size`` and
``session = HMAC(key, "session" | transcript)``. Without a key the same exchange
runs with an empty key: it still catches accidents (wrong port, another job)
but not a hostile process; an :class:`InsecureRendezvousWarning` says so.

The id and the key never appear in logs, exception messages or reprs.
"""

from __future__ import annotations

import errno
import heapq
import hmac
import ipaddress
import logging
import os
import random
import selectors
import socket
import struct
import threading
import time
from collections.abc import Mapping

from ._common import check_share_args, format_ranks
from ._seal import DIGEST, KEY_ENV, NONCE, mac, normalize_key, open_box, seal, warn_keyless
from .env import LaunchEnv, detect_launch_env
from .errors import (
    LaunchEnvError,
    RendezvousAddressError,
    RendezvousAuthError,
    RendezvousError,
    RendezvousMismatchError,
    RendezvousProtocolError,
    RendezvousTimeoutError,
)

__all__ = ["DEFAULT_MAX_PAYLOAD", "TcpRendezvous", "TcpRendezvousServer"]

logger = logging.getLogger("pynccl.bootstrap")

MAGIC = b"PNRV"
VERSION = 1
_HEADER = struct.Struct("!4sBBI")  # magic, version, type, body length
_HELLO = struct.Struct("!B32sII")  # flags, client nonce, rank, world size

HELLO, CHALLENGE, AUTH, PAYLOAD, ERROR = 1, 2, 3, 4, 5
FLAG_KEY = 0x01

ERR_PROTOCOL, ERR_AUTH, ERR_MISMATCH, ERR_TIMEOUT = 1, 2, 3, 4
_ERROR_CLASSES: dict[int, type[RendezvousError]] = {
    ERR_PROTOCOL: RendezvousProtocolError,
    ERR_AUTH: RendezvousAuthError,
    ERR_MISMATCH: RendezvousMismatchError,
    ERR_TIMEOUT: RendezvousTimeoutError,
}
MAX_ERROR_TEXT = 1024

#: Largest payload served or accepted by default (8192 unique ids).
DEFAULT_MAX_PAYLOAD = 1 << 20

_LINGER = 2.0  # seconds to wait for a client's FIN after our last frame
_MAX_DISCARD = 1 << 16  # bytes a closing connection may still send us
_RECV_CHUNK = 4096


def _frame(kind: int, body: bytes) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, kind, len(body)) + body


def _error_frame(code: int, text: str) -> bytes:
    return _frame(ERROR, bytes([code]) + text.encode("utf-8")[:MAX_ERROR_TEXT])


def _transcript(nonce_c: bytes, nonce_s: bytes, rank: int, world_size: int) -> bytes:
    return nonce_c + nonce_s + struct.pack("!II", rank, world_size)


def _clean_text(raw: bytes) -> str:
    """A peer's error text made safe to show: decoded, printable, bounded."""
    text = raw[:MAX_ERROR_TEXT].decode("utf-8", "replace")
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _check_host_port(host: object, port: object, *, allow_zero: bool) -> None:
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"host={host!r} is not a non-empty host name or address")
    low = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise ValueError(f"port={port!r} is not an integer in {low}..65535")


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is not a positive number")
    return float(value)


# -- server -----------------------------------------------------------------------------------

_READ_HELLO, _READ_AUTH, _SENDING, _CLOSING, _DRAINING = range(5)


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
        "rank",
        "sock",
        "state",
        "writing",
    )

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.state = _READ_HELLO
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.rank: int | None = None
        self.nonce_c = b""
        self.nonce_s = b""
        self.discarded = 0
        self.closed = False
        self.writing = False  # registered for EVENT_WRITE


def _resolve_bind(host: str, port: int, bind: str | None) -> tuple[socket.AddressFamily, str]:
    """Where rank 0 listens: loopback stays loopback, other addresses listen on all interfaces
    once we know ``host`` is one of ours (so a wrong MASTER_ADDR fails here, not as a hang)."""
    if bind is not None:
        try:
            fam = socket.AF_INET6 if ipaddress.ip_address(bind).version == 6 else socket.AF_INET
        except ValueError:
            fam = socket.AF_INET
        return fam, bind
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RendezvousAddressError(
            f"rank 0 cannot resolve the rendezvous host {host!r} (MASTER_ADDR): {e}"
        ) from None
    addrs = [(info[0], str(info[4][0])) for info in infos]
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for _, a in addrs):
        return addrs[0]
    local = []
    for fam, addr in addrs:
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as probe:
                probe.bind((addr, 0))
            local.append(fam)
        except OSError:
            continue
    if not local:
        shown = ", ".join(a for _, a in addrs)
        raise RendezvousAddressError(
            f"rank 0 cannot listen on {host}:{port}: {host} ({shown}) is not an address of "
            f"this machine ({socket.gethostname()}); MASTER_ADDR must name rank 0's host"
        )
    if socket.AF_INET in local:
        return socket.AF_INET, "0.0.0.0"
    return socket.AF_INET6, "::"


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
        max_connections: int = 1024,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        bind: str | None = None,
    ) -> None:
        _check_host_port(host, port, allow_zero=True)
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
        self._conn_timeout = _check_positive("connection_timeout", connection_timeout)
        self._max_conns = max_connections
        self._served: set[int] = set()
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

        family, bind_host = _resolve_bind(host, port, bind)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind_host, port))
            sock.listen(min(max(world_size, 128), 4096))
        except OSError as e:
            sock.close()
            why = (
                "the port is already in use (another job, or a previous run still "
                "holding it); choose another MASTER_PORT"
                if e.errno == errno.EADDRINUSE
                else str(e)
            )
            err = RendezvousAddressError(
                f"rank 0 cannot listen on {host}:{port} (bound {bind_host}:{port}): {why}"
            )
            err.errno = e.errno
            raise err from None
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
            self._deadline = time.monotonic() + self._timeout
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
                f"rank 0: still waiting for ranks {self._missing()} after {timeout} s"
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
            if self._rejections:
                detail = "; refused meanwhile: " + "; ".join(self._rejections[-5:])
            raise RendezvousTimeoutError(
                f"rank 0: ranks {self._missing()} of {self._world_size} did not fetch the id "
                f"from {self._host}:{self._port} within {self._timeout:g} s (did they start, "
                f"with the same MASTER_ADDR/MASTER_PORT?){detail}"
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
            return format_ranks(set(range(1, self._world_size)) - self._served)

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
            wake = self._deadline
            if self._heap:
                wake = min(wake, self._heap[0][0])
            for skey, mask in self._sel.select(max(0.0, wake - now)):
                data = skey.data
                if data is None:
                    try:
                        self._wake_r.recv(64)
                    except BlockingIOError:
                        pass
                elif data is self._listener:
                    self._accept()
                else:
                    assert isinstance(data, _Conn)
                    if mask & selectors.EVENT_READ and not data.closed:
                        self._on_readable(data)
                    if mask & selectors.EVENT_WRITE and not data.closed:
                        self._flush(data)

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

    def _accept(self) -> None:
        while len(self._conns) < self._max_conns:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: keep serving those already connected
                logger.warning("rendezvous: accept failed on port %d: %s", self._port, e)
                return
            sock.setblocking(False)
            peer = f"{addr[0]}:{addr[1]}"
            conn = _Conn(sock, peer, 0.0)
            self._push_deadline(conn, min(time.monotonic() + self._conn_timeout, self._deadline))
            with self._lock:
                self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
        self._set_listening(False)  # at the connection bound: leave the rest in the backlog

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        with self._lock:
            self._conns.pop(conn.sock.fileno(), None)
        conn.sock.close()
        if not self._releasing and not self._listening and len(self._conns) < self._max_conns:
            self._set_listening(True)

    def _note(self, conn: _Conn, reason: str) -> None:
        who = conn.peer if conn.rank is None else f"{conn.peer} (rank {conn.rank})"
        logger.warning("rendezvous on port %d: refused %s: %s", self._port, who, reason)
        with self._lock:
            self._rejections.append(f"{who}: {reason}")
            del self._rejections[:-20]

    def _reject(self, conn: _Conn, code: int, reason: str, *, linger: bool = True) -> None:
        self._note(conn, reason)
        conn.inbuf.clear()
        conn.outbuf += _error_frame(code, reason)
        conn.state = _CLOSING
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
        if len(buf) < _HEADER.size:
            if not MAGIC.startswith(bytes(buf[:4])):
                self._reject(conn, ERR_PROTOCOL, "not a pynccl rendezvous message (bad magic)")
            return
        magic, version, kind, length = _HEADER.unpack_from(buf)
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
        expected, size = (HELLO, _HELLO.size) if conn.state == _READ_HELLO else (AUTH, DIGEST)
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
        end = _HEADER.size + size
        if len(buf) < end:
            return
        if len(buf) > end:
            self._reject(conn, ERR_PROTOCOL, "unexpected bytes after a message")
            return
        body = bytes(buf[_HEADER.size : end])
        buf.clear()
        if expected == HELLO:
            self._on_hello(conn, body)
        else:
            self._on_auth(conn, body)

    def _on_hello(self, conn: _Conn, body: bytes) -> None:
        flags, nonce_c, rank, world_size = _HELLO.unpack(body)
        conn.rank = rank
        if flags & ~FLAG_KEY:
            self._reject(conn, ERR_PROTOCOL, f"unknown handshake flags {flags:#x}")
            return
        if world_size != self._world_size:
            self._reject(
                conn,
                ERR_MISMATCH,
                f"world size mismatch: this rank was started with world size {world_size} "
                f"but rank 0 serves world size {self._world_size} (a rank of another job?)",
            )
            return
        if rank == 0:
            self._reject(conn, ERR_MISMATCH, "rank 0 is the server: two processes claim rank 0")
            return
        if rank >= world_size:
            self._reject(conn, ERR_MISMATCH, f"rank {rank} is not below world size {world_size}")
            return
        has_key = bool(flags & FLAG_KEY)
        if has_key and self._key is None:
            self._reject(
                conn,
                ERR_AUTH,
                f"this rank has a rendezvous key but rank 0 has none: set the same {KEY_ENV} "
                "on every rank",
            )
            return
        if not has_key and self._key is not None:
            self._reject(
                conn,
                ERR_AUTH,
                f"rank 0 requires a rendezvous key but this rank has none: set {KEY_ENV} "
                "on every rank",
            )
            return
        conn.nonce_c = nonce_c
        conn.nonce_s = os.urandom(NONCE)
        conn.state = _READ_AUTH
        conn.outbuf += _frame(CHALLENGE, conn.nonce_s)
        self._flush(conn)

    def _on_auth(self, conn: _Conn, body: bytes) -> None:
        assert conn.rank is not None
        key = self._key or b""
        transcript = _transcript(conn.nonce_c, conn.nonce_s, conn.rank, self._world_size)
        if not hmac.compare_digest(body, mac(key, b"pynccl-rdzv client", transcript)):
            self._reject(
                conn,
                ERR_AUTH,
                f"rendezvous key rejected: this rank's {KEY_ENV} differs from rank 0's",
            )
            return
        session = mac(key, b"pynccl-rdzv session", transcript)
        proof = mac(key, b"pynccl-rdzv server", transcript)
        conn.state = _SENDING
        conn.outbuf += _frame(PAYLOAD, proof + seal(session, self._payload))
        self._flush(conn)


# -- client and the Rendezvous object ---------------------------------------------------------


class _Retry(Exception):
    """The server went away before saying anything: try again (it may be restarting)."""


class TcpRendezvous:
    """Share the id over TCP: rank 0 serves at ``host:port``, the others fetch it.

    ``key`` is the job's secret (``str`` or ``bytes``; ``None`` or empty: no key,
    with an :class:`InsecureRendezvousWarning`). Every rank must use the same
    host, port and key. On rank 0 :meth:`share` serves until every other rank
    has the payload and returns it (``wait_for_all=False``: returns at once and
    keeps serving from a daemon thread until done or ``timeout``, logging
    failures instead of raising them). On the other ranks it connects with
    exponential backoff until ``timeout``.

    ``connection_timeout`` bounds each client's handshake on the server;
    ``max_connections`` bounds concurrent connections; ``bind`` overrides the
    address rank 0 listens on (default: ``host`` if it is a loopback address,
    else all interfaces after checking that ``host`` is local).
    """

    def __init__(
        self,
        host: str,
        port: int,
        key: str | bytes | None = None,
        *,
        connection_timeout: float = 30.0,
        max_connections: int = 1024,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        bind: str | None = None,
        wait_for_all: bool = True,
    ) -> None:
        _check_host_port(host, port, allow_zero=False)
        _check_positive("connection_timeout", connection_timeout)
        if isinstance(max_payload, bool) or not isinstance(max_payload, int) or max_payload < 1:
            raise ValueError(f"max_payload={max_payload!r} is not a positive integer")
        self.host = host
        self.port = port
        self._key = normalize_key(key)
        self.connection_timeout = float(connection_timeout)
        self.max_connections = max_connections
        self.max_payload = max_payload
        self.bind = bind
        self.wait_for_all = wait_for_all

    @classmethod
    def from_env(
        cls,
        env: LaunchEnv | None = None,
        environ: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> TcpRendezvous:
        """Build from ``MASTER_ADDR``/``MASTER_PORT`` (via :func:`detect_launch_env`) and
        ``PYNCCL_RENDEZVOUS_KEY``; extra keyword arguments go to the constructor."""
        if environ is None:
            environ = os.environ
        if env is None:
            env = detect_launch_env(environ)
        if env.master_addr is None or env.master_port is None:
            raise LaunchEnvError(
                f"{env.launcher} launch detected but MASTER_ADDR/MASTER_PORT are not set, so "
                "the TCP rendezvous has no address: export them (rank 0's host and a free "
                "port), or share the id another way (from_env(mpi_comm=...), store=..., "
                "file=...)",
                env.launcher,
            )
        return cls(env.master_addr, env.master_port, environ.get(KEY_ENV), **kwargs)  # type: ignore[arg-type]

    @property
    def keyed(self) -> bool:
        """Whether a key protects this rendezvous."""
        return self._key is not None

    def __repr__(self) -> str:
        return f"TcpRendezvous(host={self.host!r}, port={self.port}, keyed={self.keyed})"

    def share(
        self,
        payload: bytes | None,
        *,
        rank: int,
        world_size: int,
        timeout: float,
    ) -> bytes:
        """Rank 0: serve ``payload`` and return it; other ranks: return rank 0's payload."""
        data = check_share_args(payload, rank, world_size, timeout)
        if world_size == 1:
            assert data is not None
            return data
        if self._key is None:
            warn_keyless(f"the TCP rendezvous at {self.host}:{self.port}")
        if rank == 0:
            assert data is not None
            server = self.serve(data, world_size=world_size, timeout=timeout)
            if not self.wait_for_all:
                return data
            try:
                server.wait()
            finally:
                server.close()
            return data
        return self.fetch(rank=rank, world_size=world_size, timeout=timeout)

    def serve(self, payload: bytes, *, world_size: int, timeout: float) -> TcpRendezvousServer:
        """Start and return rank 0's server (for callers that manage it themselves)."""
        server = TcpRendezvousServer(
            payload,
            host=self.host,
            port=self.port,
            world_size=world_size,
            key=self._key,
            timeout=timeout,
            connection_timeout=self.connection_timeout,
            max_connections=self.max_connections,
            max_payload=self.max_payload,
            bind=self.bind,
        )
        return server.start()

    def fetch(self, *, rank: int, world_size: int, timeout: float) -> bytes:
        """Connect to rank 0 (retrying with backoff) and return the payload it serves."""
        check_share_args(None, rank, world_size, timeout)
        if rank == 0:
            raise ValueError("rank 0 serves the payload; it cannot fetch it")
        where = f"{self.host}:{self.port}"
        deadline = time.monotonic() + timeout
        delay = 0.01
        attempts = 0
        last: str = "no attempt made"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousTimeoutError(
                    f"rank {rank}: could not fetch the id from rank 0 at {where} within "
                    f"{timeout:g} s after {attempts} attempt(s); last error: {last}. Is rank 0 "
                    "running, with the same MASTER_ADDR/MASTER_PORT?"
                )
            attempts += 1
            try:
                sock = socket.create_connection((self.host, self.port), timeout=remaining)
            except OSError as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                try:
                    with sock:
                        return self._handshake(sock, rank, world_size, deadline, where)
                except _Retry as e:
                    last = str(e)
            # jittered exponential backoff so that a thousand ranks do not retry in lockstep
            time.sleep(min(delay * random.uniform(0.5, 1.0), max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)

    def _handshake(
        self, sock: socket.socket, rank: int, world_size: int, deadline: float, where: str
    ) -> bytes:
        key = self._key or b""
        nonce_c = os.urandom(NONCE)
        flags = FLAG_KEY if self._key is not None else 0
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(_frame(HELLO, _HELLO.pack(flags, nonce_c, rank, world_size)))
        except OSError as e:
            raise _Retry(f"{type(e).__name__}: {e}") from None
        nonce_s = self._read(sock, CHALLENGE, NONCE, rank, deadline, where, first=True)
        transcript = _transcript(nonce_c, nonce_s, rank, world_size)
        try:
            sock.sendall(_frame(AUTH, mac(key, b"pynccl-rdzv client", transcript)))
        except OSError as e:
            raise RendezvousProtocolError(
                f"rank {rank}: connection to rank 0 at {where} lost during the handshake: {e}"
            ) from None
        body = self._read(sock, PAYLOAD, 2 * DIGEST + self.max_payload, rank, deadline, where)
        if len(body) < 2 * DIGEST or not hmac.compare_digest(
            body[:DIGEST], mac(key, b"pynccl-rdzv server", transcript)
        ):
            raise RendezvousAuthError(
                f"rank {rank}: the server at {where} could not prove it knows this job's "
                f"rendezvous key: it is not this job's rank 0 (another job on the same port, or "
                f"a different {KEY_ENV})"
            )
        payload = open_box(mac(key, b"pynccl-rdzv session", transcript), body[DIGEST:])
        if payload is None:
            raise RendezvousProtocolError(
                f"rank {rank}: the payload from {where} failed its integrity check"
            )
        return payload

    def _read(
        self,
        sock: socket.socket,
        kind: int,
        limit: int,
        rank: int,
        deadline: float,
        where: str,
        *,
        first: bool = False,
    ) -> bytes:
        header = self._recv_exact(sock, _HEADER.size, rank, deadline, where, first=first)
        magic, version, got, length = _HEADER.unpack(header)
        if magic != MAGIC:
            raise RendezvousProtocolError(
                f"rank {rank}: {where} is not a pynccl rendezvous server (it answered "
                f"{header[:4]!r}); is MASTER_PORT taken by another service?"
            )
        if version != VERSION:
            raise RendezvousProtocolError(
                f"rank {rank}: rank 0 at {where} speaks rendezvous protocol version {version}, "
                f"this rank {VERSION}: mixed pynccl versions?"
            )
        if got == ERROR:
            if not 1 <= length <= 1 + MAX_ERROR_TEXT:
                raise RendezvousProtocolError(
                    f"rank {rank}: malformed error message ({length} bytes) from {where}"
                )
            body = self._recv_exact(sock, length, rank, deadline, where)
            cls = _ERROR_CLASSES.get(body[0], RendezvousError)
            raise cls(f"rank {rank}: rank 0 at {where} refused this rank: {_clean_text(body[1:])}")
        if got != kind:
            raise RendezvousProtocolError(
                f"rank {rank}: message type {got} from {where} where {kind} was expected"
            )
        if length > limit:
            raise RendezvousProtocolError(
                f"rank {rank}: {where} announced a {length}-byte message, over the "
                f"{limit}-byte limit"
            )
        return self._recv_exact(sock, length, rank, deadline, where)

    @staticmethod
    def _recv_exact(
        sock: socket.socket,
        n: int,
        rank: int,
        deadline: float,
        where: str,
        *,
        first: bool = False,
    ) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousTimeoutError(
                    f"rank {rank}: rank 0 at {where} accepted the connection but did not "
                    "finish the handshake within the timeout"
                )
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(n - len(buf))
            except socket.timeout:
                continue
            except OSError as e:
                if first and not buf:
                    raise _Retry(f"{type(e).__name__}: {e}") from None
                raise RendezvousProtocolError(
                    f"rank {rank}: connection to rank 0 at {where} lost: {e}"
                ) from None
            if not chunk:
                if first and not buf:
                    raise _Retry("the server closed the connection before answering")
                raise RendezvousProtocolError(
                    f"rank {rank}: connection closed by {where} after {len(buf)} of {n} bytes "
                    "(truncated message)"
                )
            buf += chunk
        return bytes(buf)
