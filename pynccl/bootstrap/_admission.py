"""Who gets a handshake slot on rank 0's rendezvous server: the lobby, the slots, the
eviction of stale unauthenticated handshakes, the per-connection deadlines and when the
listening socket is watched (see :class:`~.tcp_server.TcpRendezvousServer` for the policy).

A plain class used by the server's one selector thread; it knows connections only as
:class:`~._handshake.Conn` records and never speaks the protocol.
"""

from __future__ import annotations

import errno
import heapq
import logging
import resource
import selectors
import socket
import time
from collections import deque
from collections.abc import Iterator

from ._handshake import Conn, Standing

__all__ = ["ACCEPT_BATCH", "EMFILE_REST", "GRACE", "Admission", "Waiting", "check_slots"]

logger = logging.getLogger("pynccl.bootstrap")

GRACE = 0.5  # seconds a handshake keeps its slot before a waiting connection may displace it
ACCEPT_BATCH = 512  # accepts per round, so that reads interleave with a flood of arrivals
EMFILE_REST = 0.05  # seconds the listener rests when out of descriptors with nothing to drop


def check_slots(max_connections: object) -> int:
    """``max_connections`` if it is a positive integer; ``ValueError`` naming it if not."""
    if (
        isinstance(max_connections, bool)
        or not isinstance(max_connections, int)
        or max_connections < 1
    ):
        raise ValueError(f"max_connections={max_connections!r} is not a positive integer")
    return max_connections


class Waiting:
    """An accepted connection in the lobby: not read from, watched only for its first bytes."""

    __slots__ = ("peer", "sock")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer


class Admission:
    """The slots (at most ``max_connections`` handshakes at once), the lobby of accepted
    connections waiting for one, and the eviction pools of unauthenticated handshakes.

    Connections it admits are registered on ``sel`` with themselves as data; lobby entries
    with their :class:`Waiting`; the listener with itself. Deadlines (handshake timeouts
    and lingering closes) are kept here; :meth:`due` hands back those that passed.
    """

    def __init__(
        self,
        listener: socket.socket,
        sel: selectors.BaseSelector,
        *,
        max_connections: int,
        conn_timeout: float,
        port: int,
    ) -> None:
        self.listener = listener
        self._sel = sel
        self._port = port
        self._max_conns = max_connections
        self._conn_timeout = conn_timeout
        self._grace = min(GRACE, conn_timeout)
        self._deadline = float("inf")  # the rendezvous's own, set by open()
        # Unauthenticated connections, oldest first, in the order they are evicted when every
        # slot is taken: refused ones still closing, then silent ones, then those challenged.
        self._pools: dict[Standing, dict[Conn, None] | None] = {
            Standing.REFUSED: {},
            Standing.FRESH: {},
            Standing.CHALLENGED: {},
            Standing.TRUSTED: None,
        }
        self.evicted = 0
        # Accepted connections waiting for a slot, oldest first, unread: those that sent
        # something (a rank's HELLO comes with its connection) go before silent ones.
        self._silent: dict[Waiting, None] = {}
        self._spoken: deque[Waiting] = deque()
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fds = 1 << 20 if soft == resource.RLIM_INFINITY else soft
        self._lobby_cap = max(64, min(1 << 16, fds // 2 - max_connections))
        self._admit_at = float("inf")  # when the oldest handshake may be displaced
        # Out of descriptors with no waiting rank to drop: the listener rests until then
        # (0: not resting), or the loop would spin on a listener that stays readable.
        self._rest_until = 0.0
        self._conns: dict[int, Conn] = {}  # fd -> a connection holding a slot
        self._parked: dict[int, Conn] = {}  # fd -> one that proved the key, waiting for ids
        self._heap: list[tuple[float, int, Conn]] = []
        self._seq = 0
        self._listening = False
        self._released = False

    # -- the listener and the lobby ----------------------------------------------------------

    def open(self, deadline: float) -> None:
        """Start watching the listener; no handshake outlives ``deadline``."""
        self._deadline = deadline
        self._set_listening(True)

    def _set_listening(self, on: bool) -> None:
        if on and not self._listening:
            self._sel.register(self.listener, selectors.EVENT_READ, self.listener)
        elif not on and self._listening:
            self._sel.unregister(self.listener)
        self._listening = on

    def _lobby_size(self) -> int:
        return len(self._silent) + len(self._spoken)

    def accept(self) -> None:
        """Take what the listen queue holds into the lobby (bounded): the kernel's queue
        never overflows while the lobby has room."""
        for _ in range(ACCEPT_BATCH):
            if self._lobby_size() >= self._lobby_cap:
                self._set_listening(False)  # admit() listens again once the lobby moves
                break
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # EMFILE and friends: keep serving those already connected
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._parked:
                    # ranks waiting for an id hold the descriptors that the rank making it
                    # needs: the longest waiting one goes (it reconnects; its upload stays)
                    self.drop(next(iter(self._parked.values())))
                    continue
                logger.warning("rendezvous: accept failed on port %d: %s", self._port, e)
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._rest_until = time.monotonic() + EMFILE_REST
                    self._set_listening(False)
                break
            sock.setblocking(False)
            waiting = Waiting(sock, f"{addr[0]}:{addr[1]}")
            if len(self._conns) < self._max_conns and not self._lobby_size():
                self._take(waiting, time.monotonic())
            else:
                self._silent[waiting] = None
                self._sel.register(sock, selectors.EVENT_READ, waiting)
        self.admit(time.monotonic())

    def spoke(self, waiting: Waiting) -> None:
        """``waiting`` sent its first bytes: it goes ahead of the silent ones."""
        self._sel.unregister(waiting.sock)
        del self._silent[waiting]
        self._spoken.append(waiting)

    def admit(self, now: float) -> None:
        """Give waiting connections a slot, those that spoke first: a free slot, or (for one
        that spoke) one whose handshake may be displaced."""
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
        if (
            not self._listening
            and not self._released
            and self._lobby_size() < self._lobby_cap
            and now >= self._rest_until
        ):
            self._rest_until = 0.0
            self._set_listening(True)

    def _take(self, waiting: Waiting, now: float, *, watched: bool = False) -> None:
        """Give ``waiting`` a slot: its handshake starts (``watched``: still registered)."""
        conn = Conn(waiting.sock, waiting.peer, min(now + self._conn_timeout, self._deadline))
        self.set_deadline(conn, conn.deadline)
        self._conns[conn.sock.fileno()] = conn
        if watched:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        else:
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
        self.mark(conn, Standing.FRESH)

    # -- the slots -----------------------------------------------------------------------

    def mark(self, conn: Conn, standing: Standing) -> None:
        """Put ``conn`` at the young end of the eviction pool of its ``standing`` (trusted:
        none, never evicted)."""
        if conn.pool is not None:
            conn.pool.pop(conn, None)
        pool = self._pools[standing]
        conn.pool = pool
        if pool is not None:
            pool[conn] = None

    def _evict(self, now: float) -> bool:
        """Drop the oldest unauthenticated connection that may be displaced to make room for
        one waiting in the lobby; False (and when to ask again) if none may be yet. A client
        dropped before it was answered reconnects (see :meth:`TcpRendezvous.fetch`)."""
        pools = self._pools
        victim = next(iter(pools[Standing.REFUSED] or ()), None)  # refused: no grace
        if victim is None:
            oldest = [
                next(iter(p)) for p in (pools[Standing.FRESH], pools[Standing.CHALLENGED]) if p
            ]
            victim = next((c for c in oldest if now - c.since >= self._grace), None)
            if victim is None:
                if oldest:
                    self._admit_at = min(c.since for c in oldest) + self._grace
                return False
        self.evicted += 1
        logger.info(
            "rendezvous on port %d: all %d connection slots taken; dropped %s, the oldest "
            "unauthenticated one",
            self._port,
            self._max_conns,
            victim.peer,
        )
        self.drop(victim)
        return True

    def park(self, conn: Conn) -> None:
        """``conn`` proved the key and waits for ids still to come: it frees its slot and
        waits until the rendezvous's deadline (the handshake bounds it, one per rank), or
        until descriptors run out: then the longest waiting one goes, to let a maker in."""
        if self._conns.pop(conn.sock.fileno(), None) is not None:
            self._parked[conn.sock.fileno()] = conn
        self.set_deadline(conn, self._deadline)

    def want_write(self, conn: Conn, on: bool) -> None:
        """Watch ``conn`` for room to write (``on``) or for reading only."""
        if on != conn.writing:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
            self._sel.modify(conn.sock, events, conn)
            conn.writing = on

    def drop(self, conn: Conn) -> None:
        """Close ``conn`` and free its slot (idempotent)."""
        if conn.closed:
            return
        conn.closed = True
        self.mark(conn, Standing.TRUSTED)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is None:
            self._parked.pop(fd, None)
        conn.sock.close()

    # -- deadlines -----------------------------------------------------------------------

    def set_deadline(self, conn: Conn, deadline: float) -> None:
        """``conn`` is due at ``deadline`` (replacing any earlier one)."""
        conn.deadline = deadline
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, conn))

    def due(self, now: float) -> Iterator[Conn]:
        """The open connections whose deadline passed by ``now``, earliest first."""
        while self._heap and self._heap[0][0] <= now:
            deadline, _, conn = heapq.heappop(self._heap)
            if not conn.closed and deadline == conn.deadline:
                yield conn

    def wake_at(self) -> float:
        """When the next deadline passes or a handshake may next be displaced."""
        wake = min(self._admit_at, self._rest_until or self._admit_at)
        return min(wake, self._heap[0][0]) if self._heap else wake

    def release(self) -> None:
        """Close every connection, the lobby and the listener (idempotent)."""
        if self._released:
            return
        self._released = True
        for conn in [*self._conns.values(), *self._parked.values()]:
            self.drop(conn)
        for waiting in [*self._silent, *self._spoken]:
            waiting.sock.close()
        self._silent.clear()
        self._spoken.clear()
        self.listener.close()
