"""``UniqueId``: the 128 bytes that name one communicator being created; and what makes
a handle from them, checked before any C call: the constructor's arguments
(:func:`init_args`), ``ncclCommInitRank*`` (:func:`init_rank`), ``ncclCommInitAll``'s
devices (:func:`init_all_devices`), and the rank and size of a handle made elsewhere
(:func:`rank_and_size`)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from ctypes import byref, c_int, c_void_p

from .._capi.structs import NCCL_UNIQUE_ID_BYTES, ncclUniqueId
from .._limits import (
    C_INT_MAX,
    check_c_int,
    check_device_ordinal,
    check_index,
    check_on_hang,
    check_timeout,
)
from ..enums import Result
from ..library import lib
from ._config import Config

__all__ = [
    "UniqueId",
    "as_unique_ids",
    "init_all_devices",
    "init_args",
    "init_rank",
    "rank_and_size",
]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .._capi.nccl import NcclLibrary
    from .._capi.structs import ncclConfig_t


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


def init_args(
    L: NcclLibrary, nranks: object, rank: object, device: object, config: object,
    watchdog_timeout: object, watchdog_on_hang: object,
) -> tuple[int, int, int | None]:  # fmt: skip
    """``Communicator(...)``'s arguments, checked in order: ``(nranks, rank, device)``."""
    nranks = check_c_int(nranks, "nranks", 1, C_INT_MAX)
    rank = check_index(rank, "rank", nranks, f"for a communicator of size {nranks}")
    if device is not None:
        device = check_device_ordinal(device)
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a pynccl.Config, got {type(config).__name__}")
    if watchdog_timeout is not None:
        check_timeout(watchdog_timeout, "watchdog_timeout")
    if check_on_hang(watchdog_on_hang, "watchdog_on_hang") == "revoke":
        L.require("watchdog_on_hang='revoke'", L.PROTOTYPES["ncclCommRevoke"].first)
    return nranks, rank, device


def init_rank(
    L: NcclLibrary, ids: list[UniqueId], nranks: int, rank: int, cfg: ncclConfig_t | None
) -> tuple[int | None, bool]:
    """``ncclCommInitRank`` (``...Config`` with ``cfg``; ``...Scalable`` — NCCL >= 2.23
    — with several ids): the new handle, and whether a non-blocking init is pending."""
    from ._init_report import init_report

    with init_report(L, bytes(ids[0]), rank, nranks):
        result, handle = _init_call(L, ids, nranks, rank, cfg)
    return handle, result == Result.IN_PROGRESS


def _init_call(
    L: NcclLibrary, ids: list[UniqueId], nranks: int, rank: int, cfg: ncclConfig_t | None
) -> tuple[int, int | None]:
    """The one C call of :func:`init_rank`: its result and the handle it wrote."""
    comm = c_void_p()
    if len(ids) > 1:
        L.require("ncclCommInitRankScalable (several unique ids)", (2, 23, 4))
        id_array = (ncclUniqueId * len(ids))(*(uid.struct for uid in ids))
        result = L.ncclCommInitRankScalable(
            byref(comm), nranks, rank, len(ids), id_array, None if cfg is None else byref(cfg)
        )
    elif cfg is not None:
        result = L.ncclCommInitRankConfig(byref(comm), nranks, ids[0].struct, rank, byref(cfg))
    else:
        result = L.ncclCommInitRank(byref(comm), nranks, ids[0].struct, rank)
    return int(result), comm.value


def init_all_devices(devices: Sequence[int] | int) -> list[int]:
    """``init_all``'s devices: a list of distinct device ordinals, or a count."""
    if isinstance(devices, Sequence):
        devs = [check_device_ordinal(d, "devices") for d in devices]
    else:
        devs = list(range(check_c_int(devices, "devices", 0)))
    if not devs:
        raise ValueError("init_all needs at least one device")
    if len(set(devs)) != len(devs):
        raise ValueError(f"devices has duplicates: {devs}")
    return devs


def rank_and_size(L: NcclLibrary, handle: int) -> tuple[int, int]:
    """``ncclCommUserRank`` and ``ncclCommCount`` of ``handle``."""
    value = c_int()
    L.ncclCommUserRank(handle, byref(value))
    rank = value.value
    L.ncclCommCount(handle, byref(value))
    return rank, value.value
