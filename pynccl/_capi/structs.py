"""ctypes mirrors of nccl.h 2.32.3's structs, with NCCL's initialisers.

Versioned structs (``ncclConfig_t``, ``ncclCollConfig_t``, ``ncclSimInfo_t``)
always carry the 2.32 layout and ``version = 23203``: every release from 2.14
copies ``min(size, its own sizeof)`` and has no upper bound on version or size
(see nccl-abi.md §3). An older library silently ignores fields it does not
know, so :func:`config_fields_check` refuses those before the struct is used.
"""

from __future__ import annotations

import ctypes
from ctypes import (
    POINTER,
    Structure,
    Union,
    c_char,
    c_char_p,
    c_float,
    c_int,
    c_long,
    c_size_t,
    c_uint,
    c_uint64,
    c_void_p,
)

from ..enums import Release
from ..errors import NotSupportedError

TYPE_CHECKING = False  # `typing` costs milliseconds to import
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

__all__ = [
    "CONFIG_FIELD_RELEASE",
    "NCCL_API_MAGIC",
    "NCCL_CONFIG_UNDEF_INT",
    "NCCL_SIM_INFO_MAGIC",
    "NCCL_SPLIT_NOCOLOR",
    "NCCL_UNIQUE_ID_BYTES",
    "STRUCT_VERSION",
    "config_fields_check",
    "cudaPointerAttributes",
    "make_coll_config",
    "make_config",
    "make_sim_info",
    "ncclCollConfig_t",
    "ncclConfigExt_t",
    "ncclConfig_t",
    "ncclEncryptionConfig_t",
    "ncclSimInfo_t",
    "ncclUniqueId",
    "ncclWaitSignalDesc_t",
]

NCCL_UNIQUE_ID_BYTES = 128
NCCL_API_MAGIC = 0xCAFEBEEF
NCCL_SIM_INFO_MAGIC = 0x74685283
NCCL_CONFIG_UNDEF_INT = -(2**31)  # INT_MIN
NCCL_SPLIT_NOCOLOR = -1
#: NCCL_VERSION_CODE of the header these layouts come from (2.32.3).
STRUCT_VERSION = 23203


class ncclUniqueId(Structure):
    """``typedef struct { char internal[128]; } ncclUniqueId;`` — passed by value."""

    _fields_ = [("internal", c_char * NCCL_UNIQUE_ID_BYTES)]


class ncclConfig_t(Structure):
    """``ncclConfig_t`` (``struct ncclConfig_v23100``), 120 bytes on x86-64."""

    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("blocking", c_int),
        ("cgaClusterSize", c_int),
        ("minCTAs", c_int),
        ("maxCTAs", c_int),
        ("netName", c_char_p),
        ("splitShare", c_int),
        ("trafficClass", c_int),
        ("commName", c_char_p),
        ("collnetEnable", c_int),
        ("CTAPolicy", c_int),
        ("shrinkShare", c_int),
        ("nvlsCTAs", c_int),
        ("nChannelsPerNetPeer", c_int),
        ("nvlinkCentricSched", c_int),
        ("graphUsageMode", c_int),
        ("numRmaCtx", c_int),
        ("maxP2pPeers", c_int),
        ("graphStreamOrdering", c_int),
        ("launchOrderImplicit", c_int),
        ("numRmaSig", c_int),
        ("rmaEagerInit", c_int),
        ("hostCftMode", c_int),
        ("nvlsHostMode", c_int),
    ]


#: First NCCL release whose ncclConfig_t has each user field (nccl-abi.md §3).
CONFIG_FIELD_RELEASE: dict[str, Release] = {
    "blocking": (2, 14, 0),
    "cgaClusterSize": (2, 17, 0),
    "minCTAs": (2, 17, 0),
    "maxCTAs": (2, 17, 0),
    "netName": (2, 17, 0),
    "splitShare": (2, 18, 0),
    "trafficClass": (2, 26, 0),
    "commName": (2, 27, 0),
    "collnetEnable": (2, 27, 0),
    "CTAPolicy": (2, 27, 0),
    "shrinkShare": (2, 27, 0),
    "nvlsCTAs": (2, 27, 0),
    "nChannelsPerNetPeer": (2, 28, 0),
    "nvlinkCentricSched": (2, 28, 0),
    "graphUsageMode": (2, 29, 0),
    "numRmaCtx": (2, 29, 0),
    "maxP2pPeers": (2, 30, 3),
    "graphStreamOrdering": (2, 30, 5),
    "launchOrderImplicit": (2, 31, 0),
    "numRmaSig": (2, 31, 0),
    "rmaEagerInit": (2, 31, 0),
    "hostCftMode": (2, 31, 0),
    "nvlsHostMode": (2, 32, 0),
}
_STRING_FIELDS = frozenset({"netName", "commName"})


def config_fields_check(fields: Mapping[str, Any], loaded: Release) -> None:
    """Refuse config fields unknown to this binding or to the loaded library."""
    for name in fields:
        release = CONFIG_FIELD_RELEASE.get(name)
        if release is None:
            raise ValueError(
                f"unknown ncclConfig_t field {name!r}; expected one of "
                + ", ".join(CONFIG_FIELD_RELEASE)
            )
        if loaded < release:
            raise NotSupportedError(
                f"ncclConfig_t.{name}",
                release,
                loaded,
                "an older library would silently ignore it",
            )
    if loaded < (2, 14, 0) and fields:
        raise NotSupportedError("ncclConfig_t", (2, 14, 3), loaded)


def make_config(
    fields: Mapping[str, Any] | None = None, loaded: Release | None = None
) -> ncclConfig_t:
    """An ``ncclConfig_t`` as ``NCCL_CONFIG_INITIALIZER`` makes it, with ``fields`` set.

    ``fields`` uses the C field names (``blocking``, ``commName``, ...); ``None``
    values stay undefined. With ``loaded`` (the library version), fields that
    release lacks raise :class:`~pynccl.NotSupportedError`.
    """
    fields = {k: v for k, v in (fields or {}).items() if v is not None}
    if loaded is not None:
        config_fields_check(fields, loaded)
    cfg = ncclConfig_t()
    cfg.size = ctypes.sizeof(ncclConfig_t)
    cfg.magic = NCCL_API_MAGIC
    cfg.version = STRUCT_VERSION
    for field in ncclConfig_t._fields_[3:]:
        name = field[0]
        if name not in _STRING_FIELDS:
            setattr(cfg, name, NCCL_CONFIG_UNDEF_INT)
    for name, value in fields.items():
        if name not in CONFIG_FIELD_RELEASE:
            raise ValueError(f"unknown ncclConfig_t field {name!r}")
        if name in _STRING_FIELDS:
            if not isinstance(value, (str, bytes)):
                raise TypeError(f"ncclConfig_t.{name} must be str, got {type(value).__name__}")
            # The Structure keeps the bytes object alive (commName is stored, not copied).
            setattr(cfg, name, value.encode() if isinstance(value, str) else value)
        else:
            if isinstance(value, bool):
                value = int(value)
            if not isinstance(value, int) or not -(2**31) <= value < 2**31:
                raise ValueError(f"ncclConfig_t.{name} must be a 32-bit int, got {value!r}")
            setattr(cfg, name, value)
    return cfg


class ncclConfigExt_t(Structure):
    """``ncclConfigExt_t`` (2.31+): a vendor key/value option list node."""


class _ConfigExtKey(Structure):
    _fields_ = [("vendorId", c_int), ("optionId", c_int)]


class _ConfigExtVal(Union):
    _fields_ = [("i", c_int), ("s", c_char_p), ("raw", c_void_p)]


ncclConfigExt_t._fields_ = [
    ("next", POINTER(ncclConfigExt_t)),
    ("key", _ConfigExtKey),
    ("val", _ConfigExtVal),
]


class ncclCollConfig_t(Structure):
    """``ncclCollConfig_t`` (``struct ncclCollConfig_v23200``, 2.31+), 72 bytes."""

    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("ext", POINTER(ncclConfigExt_t)),
        ("minCTAs", c_int),
        ("maxCTAs", c_int),
        ("nvlsCTAs", c_int),
        ("cgaClusterSize", c_int),
        ("algSelection", c_char_p),
        ("forceAlgSelection", c_int),
        ("CTAPolicy", c_int),
        ("userProfilerTag", c_uint64),
        ("launchCompletionEvent", c_void_p),
    ]


#: First release whose ncclCollConfig_t has each user field.
COLL_CONFIG_FIELD_RELEASE: dict[str, Release] = {
    "minCTAs": (2, 31, 0),
    "maxCTAs": (2, 31, 0),
    "nvlsCTAs": (2, 31, 0),
    "cgaClusterSize": (2, 31, 0),
    "algSelection": (2, 31, 0),
    "forceAlgSelection": (2, 31, 0),
    "CTAPolicy": (2, 31, 0),
    "userProfilerTag": (2, 31, 0),
    "launchCompletionEvent": (2, 32, 0),
}


def make_coll_config(
    fields: Mapping[str, Any] | None = None, loaded: Release | None = None
) -> ncclCollConfig_t:
    """An ``ncclCollConfig_t`` as ``NCCL_COLLCONFIG_INITIALIZER`` makes it, with ``fields``."""
    fields = {k: v for k, v in (fields or {}).items() if v is not None}
    for name in fields:
        release = COLL_CONFIG_FIELD_RELEASE.get(name)
        if release is None:
            raise ValueError(
                f"unknown ncclCollConfig_t field {name!r}; expected one of "
                + ", ".join(COLL_CONFIG_FIELD_RELEASE)
            )
        if loaded is not None and loaded < release:
            raise NotSupportedError(f"ncclCollConfig_t.{name}", release, loaded)
    cfg = ncclCollConfig_t()
    cfg.size = ctypes.sizeof(ncclCollConfig_t)
    cfg.magic = NCCL_API_MAGIC
    cfg.version = STRUCT_VERSION
    for name in ("minCTAs", "maxCTAs", "nvlsCTAs", "cgaClusterSize", "CTAPolicy"):
        setattr(cfg, name, NCCL_CONFIG_UNDEF_INT)
    cfg.forceAlgSelection = 1
    cfg.userProfilerTag = 0
    for name, value in fields.items():
        if name == "algSelection":
            setattr(cfg, name, value.encode() if isinstance(value, str) else value)
        else:
            setattr(cfg, name, value)
    return cfg


class ncclSimInfo_t(Structure):
    """``ncclSimInfo_t`` (``struct ncclSimInfo_v22200``, 2.22.3+), 24 bytes."""

    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("estimatedTime", c_float),
    ]


def make_sim_info() -> ncclSimInfo_t:
    """An ``ncclSimInfo_t`` as ``NCCL_SIM_INFO_INITIALIZER`` makes it."""
    return ncclSimInfo_t(ctypes.sizeof(ncclSimInfo_t), NCCL_SIM_INFO_MAGIC, STRUCT_VERSION, -1.0)


class ncclWaitSignalDesc_t(Structure):
    """``ncclWaitSignalDesc_t`` (2.29.2+)."""

    _fields_ = [("opCnt", c_int), ("peer", c_int), ("sigIdx", c_int), ("ctx", c_int)]


class ncclEncryptionConfig_t(Structure):
    """``ncclEncryptionConfig_t`` (``struct ncclEncryptionConfig_v23200``, 2.32.3+)."""

    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("mode", c_int),
        ("psk", c_char_p),
    ]


class cudaPointerAttributes(Structure):
    """``struct cudaPointerAttributes`` (CUDA 13 layout; large enough for CUDA 12's)."""

    _fields_ = [
        ("type", c_int),
        ("device", c_int),
        ("devicePointer", c_void_p),
        ("hostPointer", c_void_p),
        ("reserved", c_long * 8),
    ]
