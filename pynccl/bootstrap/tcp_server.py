"""Rank 0's side of the TCP rendezvous: a selector-driven server that hands the payload
to every other rank (the wire format and the handshake are described in :mod:`._wire`).

One selector thread runs two parts, each through the other's public surface: who holds
a slot (:class:`~._admission.Admission`: the lobby, the slots, eviction, the listener)
and what is said on each connection (:class:`~._handshake.Handshake`). This module runs
the loop and keeps who was served.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Sequence

from ._admission import Admission, Waiting, check_slots
from ._common import ranks_phrase
from ._handshake import Conn, Handshake
from ._net import open_listener
from ._progress import arrived_phrase, missing_report, say
from ._progress import report_interval as _report_interval
from ._roots import check_parts_args
from ._seal import normalize_key
from ._wire import DEFAULT_MAX_PAYLOAD, check_host_port, check_positive
from .errors import RendezvousError, RendezvousTimeoutError

__all__ = ["TcpRendezvousServer"]

logger = logging.getLogger("pynccl.bootstrap")

_BACKLOG = 65535  # the kernel caps it at net.core.somaxconn


def _wake_pair() -> tuple[socket.socket, socket.socket]:
    """A socket pair that close() writes to, to wake the selector thread."""
    pair = socket.socketpair()
    for sock in pair:
        sock.setblocking(False)
    return pair


def _checked_payload(
    payload: bytes,
    world_size: int,
    timeout: float,
    makers: Sequence[int],
    max_payload: int,
) -> bytes:
    """``payload`` as bytes once the server's arguments are checked (``ValueError`` naming
    the bad one otherwise)."""
    _, data = check_parts_args(payload, 0, world_size, makers, timeout)
    assert data is not None  # rank 0 always makes the first part
    if len(data) * len(makers) > max_payload:
        raise ValueError(
            f"payload of {len(data)} bytes x {len(makers)} part(s) exceeds "
            f"max_payload={max_payload}"
        )
    return data


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

    With ``makers`` (increasing ranks from 0; see :mod:`._roots`), ``payload`` is rank 0's
    part and rank ``makers[i]`` uploads part ``i`` (as long) in its handshake; ranks
    that proved the key before every part came wait outside the slots, and every rank
    is served the parts joined (:attr:`payload`, :meth:`wait_payload`).

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
        makers: Sequence[int] = (0,),
    ) -> None:
        check_host_port(host, port, allow_zero=True)
        data = _checked_payload(payload, world_size, timeout, makers, max_payload)
        check_slots(max_connections)
        self._payload = data if len(makers) == 1 else None
        self._ready = threading.Event()  # the payload is whole (or the server stopped)
        self._host = host
        self._world_size = world_size
        key_bytes = normalize_key(key)
        self._keyed = key_bytes is not None
        self._timeout = float(timeout)
        # a handshake may never outlast the rendezvous: slots must free up within it
        conn_timeout = min(check_positive("connection_timeout", connection_timeout), self._timeout)
        self._served: set[int] = set()
        self._hosts: dict[int, str] = {}  # rank -> the address it connected from
        self._report = _report_interval(report_interval)
        self._started = 0.0
        self._next_report = float("inf")
        self._rejections: list[str] = []
        self._lock = threading.Lock()
        self._stop = False
        self._releasing = False
        self._finished = threading.Event()
        self._outcome = "not started"
        self._crash: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._deadline = 0.0

        listener = open_listener(host, port, bind, backlog=_BACKLOG)
        self._port = int(listener.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        slots = Admission(
            listener, self._sel, max_connections=max_connections, conn_timeout=conn_timeout,
            port=self._port,
        )  # fmt: skip
        self._admission, self._max_conns = slots, max_connections
        self._handshake = Handshake(
            data, makers=makers, complete=self._on_complete, world_size=world_size,
            key=key_bytes, conn_timeout=conn_timeout, slots=slots, served=self._on_served,
            refused=self._on_refused,
        )  # fmt: skip
        self._wake_r, self._wake_w = _wake_pair()

    # -- public --------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` clients should connect to (the real port when 0 was asked)."""
        return self._host, self._port

    @property
    def evicted(self) -> int:
        """Unauthenticated connections dropped so far to make room for waiting ones."""
        return self._admission.evicted

    @property
    def served_ranks(self) -> frozenset[int]:
        """Ranks that have been handed the payload so far."""
        with self._lock:
            return frozenset(self._served)

    @property
    def payload(self) -> bytes | None:
        """What every rank is served: the parts joined in ``makers``' order once all came
        (rank 0's own part first), else ``None``."""
        return self._payload

    def wait_payload(self, timeout: float | None = None) -> bytes:
        """Block until every part came and return the payload; raise as :meth:`wait` does
        if the server stopped first (``timeout`` bounds this wait only)."""
        if self._thread is None:
            raise RuntimeError("TcpRendezvousServer.wait_payload() before start()")
        if not self._ready.wait(timeout):
            makers = ranks_phrase(self._handshake.missing_makers())
            raise RendezvousTimeoutError(
                f"rank 0: the ids made by {makers} have not all come after {timeout} s"
            )
        if self._payload is None:
            self.wait(0)  # raises why it stopped
            raise RendezvousError("rank 0: the rendezvous server stopped before every id came")
        return self._payload

    def start(self) -> TcpRendezvousServer:
        """Start serving from a daemon thread; returns ``self``."""
        if self._payload is not None:
            self._ready.set()
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
            detail = self._missing_ids()
            if self.evicted:
                detail += (
                    f"; {self.evicted} unauthenticated connection(s) were dropped at the "
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
            f"world_size={self._world_size}, keyed={self._keyed}, "
            f"state={self._outcome!r})"
        )

    # -- internals -------------------------------------------------------------------------

    def _missing(self) -> str:
        with self._lock:
            return ranks_phrase(set(range(1, self._world_size)) - self._served)

    def _missing_ids(self) -> str:
        """Which makers' ids never came and who waited for them ("" when none is missing)."""
        makers, came = self._handshake.missing_makers(), self._handshake.waiting_ranks()
        s, them = ("", "it") if len(makers) == 1 else ("s", "them")
        waited = f"; {ranks_phrase(came)} came and waited for {them}" if came else ""
        why = f"; the id{s} made by {ranks_phrase(makers)} never came{waited}"
        return why + " (do all ranks use the same nids?)" if makers else ""

    def _say_missing(self, now: float, why: str) -> None:
        with self._lock:
            missing = set(range(1, self._world_size)) - self._served
            line = missing_report(missing, self._world_size, self._hosts, now - self._started)
        say(f"rank 0 at {self._host}:{self._port}{why}: {line}")

    def _on_served(self, conn: Conn) -> None:
        assert conn.rank is not None
        with self._lock:
            if conn.rank in self._served:
                logger.warning(
                    "rendezvous: rank %d (%s) fetched the id again", conn.rank, conn.peer
                )
            self._served.add(conn.rank)
            self._hosts[conn.rank] = conn.peer.rpartition(":")[0]

    def _on_complete(self, payload: bytes) -> None:
        self._payload = payload
        self._ready.set()

    def _on_refused(self, conn: Conn, reason: str) -> None:
        who = conn.peer if conn.rank is None else f"{conn.peer} (rank {conn.rank})"
        logger.warning("rendezvous on port %d: refused %s: %s", self._port, who, reason)
        with self._lock:
            self._rejections.append(f"{who}: {reason}")
            del self._rejections[:-20]

    def _run(self) -> None:
        try:
            self._sel.register(self._wake_r, selectors.EVENT_READ, None)
            self._admission.open(self._deadline)
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
            self._ready.set()

    def _release(self) -> None:
        with self._lock:
            if self._releasing:
                return
            self._releasing = True
        self._admission.release()
        self._sel.close()
        with self._lock:  # close() may be writing to the wake socket
            self._wake_r.close()
            self._wake_w.close()

    def _loop(self) -> None:
        need = self._world_size - 1
        admission, handshake = self._admission, self._handshake
        listener = admission.listener
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
            for conn in admission.due(now):
                handshake.expire(conn)
            admission.admit(now)
            if now >= self._next_report:
                self._say_missing(now, "")
                self._next_report = now + self._report
            wake = min(self._deadline, self._next_report, admission.wake_at())
            accept = False
            for skey, mask in self._sel.select(max(0.0, wake - now)):
                data = skey.data
                if data is None:
                    try:
                        self._wake_r.recv(64)
                    except BlockingIOError:
                        pass
                elif data is listener:
                    accept = True
                elif isinstance(data, Waiting):  # it spoke: ahead of the silent ones
                    admission.spoke(data)
                else:
                    assert isinstance(data, Conn)
                    if mask & selectors.EVENT_READ and not data.closed:
                        handshake.readable(data)
                    if mask & selectors.EVENT_WRITE and not data.closed:
                        handshake.flush(data)
            if accept:
                admission.accept()
