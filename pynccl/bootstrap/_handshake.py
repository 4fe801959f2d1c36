"""Rank 0's side of one rendezvous connection: read and check its frames, answer HELLO with
a challenge, check AUTH, send the sealed payload or an error frame, flush and drain (the
exchange is described in :mod:`._wire`).

:class:`Handshake` holds what every connection is checked against (world size, key,
payload); the slots a connection holds, its deadline and its selector registration belong
to whoever implements :class:`Slots` (:class:`~._admission.Admission`).
"""

from __future__ import annotations

import enum
import hmac
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ._seal import DIGEST, KEY_ENV, NONCE, mac, open_box, seal
from ._wire import (
    AUTH,
    CHALLENGE,
    ERR_AUTH,
    ERR_MISMATCH,
    ERR_PROTOCOL,
    ERR_TIMEOUT,
    FLAG_UPLOAD,
    HEADER,
    HELLO,
    HELLO_BODY,
    MAGIC,
    PAYLOAD,
    VERSION,
    error_frame,
    frame,
    hello_refusal,
    transcript,
)

__all__ = ["Conn", "Handshake", "Slots", "Standing"]

logger = logging.getLogger("pynccl.bootstrap")

LINGER = 2.0  # seconds to wait for a client's FIN after our last frame
MAX_DISCARD = 1 << 16  # bytes a closing connection may still send us
RECV_CHUNK = 4096

READ_HELLO, READ_AUTH, SENDING, CLOSING, DRAINING, PARKED = range(6)


class Standing(enum.Enum):
    """How far a connection got, which decides when it may be displaced from its slot."""

    FRESH = "fresh"  # has not said HELLO
    CHALLENGED = "challenged"  # said HELLO, has not proved the key
    REFUSED = "refused"  # answered with an error, closing
    TRUSTED = "trusted"  # proved the key: never displaced


class Conn:
    """One connection holding a slot: its socket and how far its exchange got."""

    __slots__ = (
        "closed",
        "deadline",
        "discarded",
        "inbuf",
        "nonce_c",
        "nonce_s",
        "outbuf",
        "part",
        "peer",
        "pool",
        "rank",
        "reply",
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
        self.state = READ_HELLO
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.rank: int | None = None
        self.nonce_c = b""
        self.nonce_s = b""
        self.discarded = 0
        self.closed = False
        self.writing = False  # registered for EVENT_WRITE
        self.pool: dict[Conn, None] | None = None  # the eviction pool it sits in, if any
        self.part: int | None = None  # the index of the id it uploads, if it makes one
        self.reply = (b"", b"")  # (proof, session) while it waits for the ids (PARKED)


class Slots(Protocol):
    """What a handshake needs of the slots its connections hold."""

    def drop(self, conn: Conn) -> None: ...

    def mark(self, conn: Conn, standing: Standing) -> None: ...

    def set_deadline(self, conn: Conn, deadline: float) -> None: ...

    def want_write(self, conn: Conn, on: bool) -> None: ...

    def park(self, conn: Conn) -> None: ...


class Handshake:
    """The rendezvous exchange on each connection that holds a slot.

    ``payload`` is rank 0's part; ``makers[i]`` (i >= 1) uploads part ``i``, of the same
    length, in its AUTH. Ranks that proved the key before every part came wait parked
    (out of the slots, one connection per rank); ``complete(payload)`` is called once
    with all parts joined. ``served(conn)`` is called once ``conn``'s payload left in
    full; ``refused(conn, reason)`` for every refusal (what the server logs and keeps for
    its timeout error).
    """

    def __init__(
        self,
        payload: bytes,
        *,
        makers: Sequence[int] = (0,),
        complete: Callable[[bytes], None],
        world_size: int,
        key: bytes | None,
        conn_timeout: float,
        slots: Slots,
        served: Callable[[Conn], None],
        refused: Callable[[Conn, str], None],
    ) -> None:
        self._parts: list[bytes | None] = [payload] + [None] * (len(makers) - 1)
        self._part_of = {rank: i for i, rank in enumerate(makers) if i}
        self._makers = list(makers)
        self._upload_size = DIGEST + len(payload)  # a sealed part
        self._payload = payload if len(makers) == 1 else None
        self._to_come = len(makers) - 1  # parts not uploaded yet
        self._complete = complete
        self._parked: dict[int, Conn] = {}  # rank -> its connection waiting for the ids
        self._world_size = world_size
        self._key = key
        self._conn_timeout = conn_timeout
        self._slots = slots
        self._served = served
        self._refused = refused

    def missing_makers(self) -> list[int]:
        """The ranks whose ids have not come yet (none once every id came)."""
        return [m for m, part in zip(self._makers, self._parts) if part is None]

    def waiting_ranks(self) -> list[int]:
        """The ranks that proved the key and waited for those ids (none once all came)."""
        return sorted(self._parked)

    def expire(self, conn: Conn) -> None:
        """``conn``'s deadline passed: refuse an unfinished handshake, drop the rest."""
        if conn.state in (READ_HELLO, READ_AUTH):
            self.reject(
                conn,
                ERR_TIMEOUT,
                f"handshake not completed within {self._conn_timeout:g} s",
                linger=False,
            )
        else:
            self._slots.drop(conn)

    def reject(self, conn: Conn, code: int, reason: str, *, linger: bool = True) -> None:
        """Answer ``conn`` with an error frame and close it once that is sent."""
        self._refused(conn, reason)
        conn.inbuf.clear()
        conn.outbuf += error_frame(code, reason)
        conn.state = CLOSING
        self._slots.mark(conn, Standing.REFUSED)
        if not linger:
            self._slots.set_deadline(conn, time.monotonic() + 0.5)
        self.flush(conn)

    def flush(self, conn: Conn) -> None:
        """Send what ``conn`` has pending; once its last frame left, half-close and drain."""
        try:
            while conn.outbuf:
                n = conn.sock.send(conn.outbuf)
                del conn.outbuf[:n]
        except (BlockingIOError, InterruptedError):
            self._slots.want_write(conn, True)
            return
        except OSError as e:
            logger.info("rendezvous: lost %s while sending: %s", conn.peer, e)
            self._slots.drop(conn)
            return
        self._slots.want_write(conn, False)
        if conn.state == SENDING:
            self._served(conn)
        if conn.state in (SENDING, CLOSING):
            conn.state = DRAINING
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._slots.drop(conn)
                return
            self._slots.set_deadline(conn, min(conn.deadline, time.monotonic() + LINGER))

    def readable(self, conn: Conn) -> None:
        """Read what ``conn`` sent and act on every complete message."""
        try:
            data = conn.sock.recv(RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            logger.info("rendezvous: lost %s: %s", conn.peer, e)
            self._slots.drop(conn)
            return
        if conn.state == PARKED:  # it may only wait: gone (it reconnects) or speaking out of turn
            logger.info("rendezvous: %s left or spoke while waiting for the ids", conn.peer)
            self._slots.drop(conn)
            return
        if conn.state == DRAINING or conn.state == CLOSING:
            conn.discarded += len(data)
            if not data or conn.discarded > MAX_DISCARD:
                self._slots.drop(conn)
            return
        if not data:
            if conn.inbuf:
                self._refused(
                    conn,
                    f"connection closed mid-message after {len(conn.inbuf)} "
                    "bytes (truncated message)",
                )
            elif conn.state == READ_AUTH:
                self._refused(conn, "connection closed during the handshake")
            else:
                logger.debug("rendezvous: %s connected and closed without a word", conn.peer)
            self._slots.drop(conn)
            return
        conn.inbuf += data
        self._parse(conn)

    def _parse(self, conn: Conn) -> None:
        buf = conn.inbuf
        if len(buf) < HEADER.size:
            if not MAGIC.startswith(bytes(buf[:4])):
                self.reject(conn, ERR_PROTOCOL, "not a pynccl rendezvous message (bad magic)")
            return
        magic, version, kind, length = HEADER.unpack_from(buf)
        if magic != MAGIC:
            self.reject(conn, ERR_PROTOCOL, "not a pynccl rendezvous message (bad magic)")
            return
        if version != VERSION:
            self.reject(
                conn,
                ERR_PROTOCOL,
                f"protocol version {version} is not supported (rank 0 speaks {VERSION}): "
                "mixed pynccl versions?",
            )
            return
        if conn.state == READ_HELLO:
            expected, size = HELLO, HELLO_BODY.size
        else:
            expected, size = AUTH, DIGEST + (0 if conn.part is None else self._upload_size)
        if kind != expected:
            self.reject(conn, ERR_PROTOCOL, f"message type {kind} where {expected} expected")
            return
        if length != size:
            self.reject(
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
            self.reject(conn, ERR_PROTOCOL, "unexpected bytes after a message")
            return
        body = bytes(buf[HEADER.size : end])
        buf.clear()
        if expected == HELLO:
            self._on_hello(conn, body)
        else:
            self._on_auth(conn, body)

    def _on_hello(self, conn: Conn, body: bytes) -> None:
        flags, nonce_c, rank, world_size = HELLO_BODY.unpack(body)
        conn.rank = rank
        refusal = hello_refusal(flags, rank, world_size, self._world_size, self._key is not None)
        if refusal is not None:
            self.reject(conn, *refusal)
            return
        disagree = self._upload_refusal(rank, bool(flags & FLAG_UPLOAD))
        if disagree is not None:
            self.reject(conn, ERR_MISMATCH, disagree)
            return
        conn.part = self._part_of.get(rank)
        conn.nonce_c = nonce_c
        conn.nonce_s = os.urandom(NONCE)
        conn.state = READ_AUTH
        self._slots.mark(conn, Standing.CHALLENGED)
        conn.outbuf += frame(CHALLENGE, conn.nonce_s)
        self.flush(conn)

    def _upload_refusal(self, rank: int, uploads: bool) -> str | None:
        """Why a rank that does (not) offer an id is refused, or None when it agrees with
        rank 0 on who makes the ids."""
        if uploads == (rank in self._part_of):
            return None
        makers = ", ".join(map(str, self._makers[:8])) + (", ..." if len(self._makers) > 8 else "")
        does = "offers an id" if uploads else "makes no id"
        return (
            f"rank {rank} {does} but rank 0 takes {len(self._makers)} id(s) made by ranks "
            f"{makers}: the ranks disagree on the number of ids (nids)"
        )

    def _on_auth(self, conn: Conn, body: bytes) -> None:
        assert conn.rank is not None
        key = self._key or b""
        tx = transcript(conn.nonce_c, conn.nonce_s, conn.rank, self._world_size)
        body, upload = body[:DIGEST], body[DIGEST:]
        if not hmac.compare_digest(body, mac(key, b"pynccl-rdzv client", tx)):
            self.reject(
                conn,
                ERR_AUTH,
                f"rendezvous key rejected: this rank's {KEY_ENV} differs from rank 0's",
            )
            return
        session = mac(key, b"pynccl-rdzv session", tx)
        proof = mac(key, b"pynccl-rdzv server", tx)
        if conn.part is not None and not self._take_part(conn, session, upload):
            return
        self._slots.mark(conn, Standing.TRUSTED)  # authenticated: never evicted
        if self._payload is None:  # wait for the other ids, out of the slots
            conn.state = PARKED
            conn.reply = (proof, session)
            old = self._parked.pop(conn.rank, None)
            if old is not None:  # a rank that reconnected: only its newest connection waits
                self._slots.drop(old)
            self._parked[conn.rank] = conn
            self._slots.park(conn)
            return
        self._send(conn, proof, session)
        if self._parked and self._payload is not None:
            parked, self._parked = list(self._parked.values()), {}
            for waiting in parked:
                if not waiting.closed:
                    self._send(waiting, *waiting.reply)

    def _send(self, conn: Conn, proof: bytes, session: bytes) -> None:
        assert self._payload is not None
        conn.state = SENDING
        conn.outbuf += frame(PAYLOAD, proof + seal(session, self._payload))
        self.flush(conn)

    def _take_part(self, conn: Conn, session: bytes, upload: bytes) -> bool:
        """Keep the id ``conn`` uploaded (False: refused); the last one completes the ids."""
        assert conn.part is not None
        part = open_box(session, upload)
        if part is None:
            self.reject(conn, ERR_AUTH, "the id this rank uploaded failed its integrity check")
            return False
        known = self._parts[conn.part]
        if known is not None and not hmac.compare_digest(known, part):
            self.reject(
                conn,
                ERR_MISMATCH,
                f"rank {conn.rank} uploaded id {conn.part} again, but a different one "
                "(restarted? every rank must start over)",
            )
            return False
        if known is None:
            self._parts[conn.part] = part
            self._to_come -= 1
            if not self._to_come:
                self._payload = b"".join(p for p in self._parts if p is not None)
                self._complete(self._payload)
        return True
