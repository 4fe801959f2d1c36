"""The rendezvous wire format: frames, message types, error codes and argument checks
shared by the TCP server (:mod:`.tcp_server`) and client (:mod:`.tcp`).

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
    C -> S  AUTH       HMAC(key, "client" | transcript) [| seal(session, id)]
    S -> C  PAYLOAD    HMAC(key, "server" | transcript) | seal(session, ids)
                                                        (or ERROR code | text)

where ``transcript = nonce_c | nonce_s | rank | world_size`` and
``session = HMAC(key, "session" | transcript)``. In a world of several ids, the rank that
makes id ``i`` (:mod:`._roots`; HELLO flag ``FLAG_UPLOAD``) sends it sealed in its AUTH;
rank 0 serves every rank the ids joined, once all have come (ranks that proved the key
before then wait outside the handshake slots). Without a key the same exchange
runs with an empty key: it still catches accidents (wrong port, another job)
but not a hostile process; an :class:`InsecureRendezvousWarning` says so.

The id and the key never appear in logs, exception messages or reprs.
"""

from __future__ import annotations

import struct

from ._seal import KEY_ENV
from .errors import (
    RendezvousAuthError,
    RendezvousError,
    RendezvousMismatchError,
    RendezvousProtocolError,
    RendezvousTimeoutError,
)

MAGIC = b"PNRV"
VERSION = 1
HEADER = struct.Struct("!4sBBI")  # magic, version, type, body length
HELLO_BODY = struct.Struct("!B32sII")  # flags, client nonce, rank, world size

HELLO, CHALLENGE, AUTH, PAYLOAD, ERROR = 1, 2, 3, 4, 5
FLAG_KEY = 0x01
FLAG_UPLOAD = 0x02  # this rank makes one of the ids: its AUTH carries it, sealed

ERR_PROTOCOL, ERR_AUTH, ERR_MISMATCH, ERR_TIMEOUT = 1, 2, 3, 4
ERROR_CLASSES: dict[int, type[RendezvousError]] = {
    ERR_PROTOCOL: RendezvousProtocolError,
    ERR_AUTH: RendezvousAuthError,
    ERR_MISMATCH: RendezvousMismatchError,
    ERR_TIMEOUT: RendezvousTimeoutError,
}
MAX_ERROR_TEXT = 1024

#: Largest payload served or accepted by default (8192 unique ids).
DEFAULT_MAX_PAYLOAD = 1 << 20


def frame(kind: int, body: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, len(body)) + body


def error_frame(code: int, text: str) -> bytes:
    return frame(ERROR, bytes([code]) + text.encode("utf-8")[:MAX_ERROR_TEXT])


def transcript(nonce_c: bytes, nonce_s: bytes, rank: int, world_size: int) -> bytes:
    return nonce_c + nonce_s + struct.pack("!II", rank, world_size)


def clean_text(raw: bytes) -> str:
    """A peer's error text made safe to show: decoded, printable, bounded."""
    text = raw[:MAX_ERROR_TEXT].decode("utf-8", "replace")
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def check_host_port(host: object, port: object, *, allow_zero: bool) -> None:
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"host={host!r} is not a non-empty host name or address")
    low = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise ValueError(f"port={port!r} is not an integer in {low}..65535")


def check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is not a positive number")
    return float(value)


def hello_refusal(
    flags: int, rank: int, world_size: int, served_world: int, server_keyed: bool
) -> tuple[int, str] | None:
    """Why rank 0 refuses a HELLO (error code, text for the client), or None to go on."""
    if flags & ~(FLAG_KEY | FLAG_UPLOAD):
        return ERR_PROTOCOL, f"unknown handshake flags {flags:#x}"
    if world_size != served_world:
        return ERR_MISMATCH, (
            f"world size mismatch: this rank was started with world size {world_size} "
            f"but rank 0 serves world size {served_world} (a rank of another job?)"
        )
    if rank == 0:
        return ERR_MISMATCH, "rank 0 is the server: two processes claim rank 0"
    if rank >= world_size:
        return ERR_MISMATCH, f"rank {rank} is not below world size {world_size}"
    has_key = bool(flags & FLAG_KEY)
    if has_key and not server_keyed:
        return ERR_AUTH, (
            f"this rank has a rendezvous key but rank 0 has none: set the same {KEY_ENV} "
            "on every rank"
        )
    if not has_key and server_keyed:
        return ERR_AUTH, (
            f"rank 0 requires a rendezvous key but this rank has none: set {KEY_ENV} on every rank"
        )
    return None
