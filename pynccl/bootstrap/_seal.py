"""Keyed helpers shared by the TCP and file rendezvous: HMAC-SHA256 proofs and a sealed box.

Only the standard library is used. The sealed box is encrypt-then-MAC with a
keystream of HMAC-SHA256 blocks in counter mode (HMAC as a PRF), so that an id
in flight or on disk is neither readable nor forgeable without the job key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import warnings

__all__ = ["KEY_ENV", "InsecureRendezvousWarning", "mac", "normalize_key", "open_box", "seal"]

#: Environment variable holding the job's rendezvous key.
KEY_ENV = "PYNCCL_RENDEZVOUS_KEY"

DIGEST = 32  # bytes of an HMAC-SHA256
NONCE = 32


class InsecureRendezvousWarning(UserWarning):
    """A rendezvous runs without a key: anyone who can reach it can read or replace the id."""


def normalize_key(key: str | bytes | bytearray | None) -> bytes | None:
    """The key as bytes, or ``None`` for "no key" (``None`` or empty)."""
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode("utf-8")
    elif not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"rendezvous key must be str or bytes, not {type(key).__name__}")
    return bytes(key) if key else None


def warn_keyless(where: str) -> None:
    """Warn once per call site that ``where`` runs without a key."""
    warnings.warn(
        f"{where} runs without a rendezvous key ({KEY_ENV} is not set): any process that "
        "can reach it can read the unique id or hand out a wrong one; `python -m pynccl "
        f"launch` sets a fresh key for you, otherwise export the same random {KEY_ENV} "
        "on all ranks",
        InsecureRendezvousWarning,
        stacklevel=3,
    )


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``label`` and ``parts``; labels keep the roles' proofs apart."""
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _keystream_xor(session: bytes, data: bytes) -> bytes:
    blocks = bytearray()
    for counter in range((len(data) + DIGEST - 1) // DIGEST):
        blocks += mac(session, b"stream", counter.to_bytes(8, "big"))
    n = len(data)
    return (int.from_bytes(data, "big") ^ int.from_bytes(bytes(blocks[:n]), "big")).to_bytes(
        n, "big"
    )


def seal(session: bytes, plaintext: bytes) -> bytes:
    """``tag || ciphertext`` under the session key."""
    ct = _keystream_xor(session, plaintext)
    return mac(session, b"tag", ct) + ct


def open_box(session: bytes, box: bytes) -> bytes | None:
    """The plaintext of :func:`seal`'s output, or ``None`` if the tag does not verify."""
    if len(box) < DIGEST:
        return None
    tag, ct = box[:DIGEST], box[DIGEST:]
    if not hmac.compare_digest(tag, mac(session, b"tag", ct)):
        return None
    return _keystream_xor(session, ct)


def nonce() -> bytes:
    """A fresh random nonce."""
    return os.urandom(NONCE)
