"""What makes a handle, checked before any C call: the constructor's arguments
(:func:`init_args`), ``ncclCommInitRank*`` (:func:`init_rank`), ``ncclCommInitAll``'s
devices (:func:`init_all_devices`), and the rank and size of a handle made elsewhere
(:func:`rank_and_size`)."""

from __future__ import annotations

from collections.abc import Sequence
from ctypes import byref, c_int, c_void_p

from .._limits import (
    C_INT_MAX,
    check_c_int,
    check_device_ordinal,
    check_index,
    check_on_hang,
    check_timeout,
)
from ..enums import Result
from ._config import Config
from ._uid import UniqueId

__all__ = ["init_all_devices", "init_args", "init_rank", "rank_and_size"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .._capi.nccl import NcclLibrary
    from .._capi.structs import ncclConfig_t


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
    from .._capi.structs import ncclUniqueId

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
    return comm.value, result == Result.IN_PROGRESS


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
