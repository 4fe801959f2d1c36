"""``UniqueId``: the 128 bytes that name one communicator being created."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from ctypes import byref

from .._capi.structs import NCCL_UNIQUE_ID_BYTES, ncclUniqueId
from ..library import lib

__all__ = ["UniqueId", "as_unique_ids"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class UniqueId:
    """An ``ncclUniqueId``: 128 bytes that name one communicator being created.

    ``UniqueId()`` asks NCCL for a new one (``ncclGetUniqueId``; rank 0 does this
    and shares the bytes with the other ranks). ``bytes(uid)`` /
    ``UniqueId.from_bytes(b)``, ``uid.hex()`` / ``UniqueId.fromhex(s)``; it pickles
    and compares by value. Its ``repr`` shows only a short fingerprint: the id
    carries the root's listening address and is the key to join the job.
    """

    __slots__ = ("_struct",)

    def __init__(self, data: bytes | bytearray | memoryview | None = None) -> None:
        self._struct = ncclUniqueId()
        if data is None:
            lib().ncclGetUniqueId(byref(self._struct))
            return
        raw = bytes(data)
        if len(raw) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"a unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)} bytes")
        ctypes.memmove(byref(self._struct), raw, NCCL_UNIQUE_ID_BYTES)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> UniqueId:
        """The id whose 128 bytes are ``data``."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"UniqueId.from_bytes needs bytes, got {type(data).__name__}")
        return cls(data)

    @classmethod
    def fromhex(cls, text: str) -> UniqueId:
        """The id from its 256-character hex form (``uid.hex()``)."""
        try:
            raw = bytes.fromhex(text)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"not a hex string of {NCCL_UNIQUE_ID_BYTES} bytes") from exc
        return cls(raw)

    def __bytes__(self) -> bytes:
        return ctypes.string_at(byref(self._struct), NCCL_UNIQUE_ID_BYTES)

    def hex(self) -> str:
        """The 128 bytes as 256 hex characters."""
        return bytes(self).hex()

    @property
    def struct(self) -> ncclUniqueId:
        """The ``ncclUniqueId`` structure (pass it by value to the C functions)."""
        return self._struct

    def fingerprint(self) -> str:
        """A short digest identifying this id in logs without revealing it."""
        import hashlib  # only when asked: hashlib costs milliseconds to import

        return hashlib.sha256(bytes(self)).hexdigest()[:12]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UniqueId):
            return NotImplemented
        return bytes(self) == bytes(other)

    def __hash__(self) -> int:
        return hash(bytes(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (UniqueId.from_bytes, (bytes(self),))

    def __repr__(self) -> str:
        return f"UniqueId(<{self.fingerprint()}>)"


def as_unique_ids(unique_id: object) -> list[UniqueId]:
    """``unique_id`` (one id, 128 bytes, or a sequence of them) as a non-empty list."""
    if isinstance(unique_id, UniqueId):
        return [unique_id]
    if isinstance(unique_id, (bytes, bytearray, memoryview)):
        return [UniqueId.from_bytes(unique_id)]
    if isinstance(unique_id, Sequence) and not isinstance(unique_id, str):
        ids = [as_unique_ids(item)[0] for item in unique_id]
        if not ids:
            raise ValueError("unique_id: an empty sequence of unique ids")
        return ids
    raise TypeError(
        f"unique_id must be a UniqueId, 128 bytes or a sequence of them, got "
        f"{type(unique_id).__name__}"
    )
