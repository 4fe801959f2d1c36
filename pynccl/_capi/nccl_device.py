"""The host functions of ``nccl_device/host.h`` that libnccl exports, as a prototype table.

``nccl.h`` does not declare these (the device API's host side: communicator
properties, teams, window pointers, device-communicator requirements); libnccl
exports them from 2.28.3 on. Each entry sits under its C signature (2.32.3's
``host.h``) with the first release exporting it, and :class:`~pynccl._capi.nccl.NcclLibrary`
binds them like the ``nccl.h`` table. Opaque device-side types (``ncclDevComm_t``,
requirement lists, barrier handles) are passed as pointers.

Functions returning a value rather than an ``ncclResult_t`` (``ncclTeam*``,
``ncclLLA2ACalcSlots``) are listed in :data:`VALUE_RESULTS`: their wrappers return
what C returns.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_bool, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p

from ._binding import Prototype
from .structs import NCCL_API_MAGIC, STRUCT_VERSION

__all__ = [
    "DEVICE_PROTOTYPES",
    "VALUE_RESULTS",
    "make_comm_properties",
    "ncclCommProperties_t",
    "ncclMultimemHandle_t",
    "ncclTeam_t",
]

ncclComm_t = c_void_p
ncclWindow_t = c_void_p
ncclResult_t = c_int
ncclCftLeId = c_uint32
ncclCftTeamMode_t = c_int
_ptr = c_void_p  # opaque device-side structs: ncclDevComm_t*, *Handle_t*, requirements


class ncclTeam_t(Structure):
    """``ncclTeam_t`` (``struct ncclTeam``): a rank set as (nRanks, rank, stride), by value."""

    _fields_ = [("nRanks", c_int), ("rank", c_int), ("stride", c_int)]


class ncclMultimemHandle_t(Structure):
    """``ncclMultimemHandle_t``, passed by value."""

    _fields_ = [("mcBasePtr", c_void_p)]


class ncclCommProperties_t(Structure):
    """``ncclCommProperties_t`` (2.32.3 layout, 152 bytes; the library fills it by version)."""

    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("rank", c_int),
        ("nRanks", c_int),
        ("cudaDev", c_int),
        ("nvmlDev", c_int),
        ("deviceApiSupport", c_bool),
        ("multimemSupport", c_bool),
        ("ginType", c_int),
        ("nLsaTeams", c_int),
        ("hostRmaSupport", c_bool),
        ("railedGinType", c_int),
        ("commHash", c_uint64),
        ("ginMinStride", c_int),
        ("ginConnectionType", c_int),
        ("ginSupport", c_bool * 64),
        ("devCommRuntimeVersionSize", c_size_t),
        ("cftSupport", c_bool),
        ("cftMulticastSupport", c_bool),
        ("cftCountedSupport", c_bool),
    ]


def make_comm_properties(version: int = STRUCT_VERSION) -> ncclCommProperties_t:
    """An ``ncclCommProperties_t`` as ``NCCL_COMM_PROPERTIES_INITIALIZER`` makes it.

    ``version`` is the NCCL_VERSION_CODE the caller was "compiled" against; a library
    older than it refuses the query (pass the loaded library's code to clamp).
    """
    props = ncclCommProperties_t()
    props.size = ctypes.sizeof(ncclCommProperties_t)
    props.magic = NCCL_API_MAGIC
    props.version = version
    return props


_P = Prototype

DEVICE_PROTOTYPES: dict[str, Prototype] = {
    # ncclResult_t ncclCommQueryProperties(ncclComm_t comm, ncclCommProperties_t* props);
    "ncclCommQueryProperties": _P(
        (2, 29, 2),
        ncclResult_t,
        (("comm", ncclComm_t), ("props", POINTER(ncclCommProperties_t))),
    ),
    # ncclResult_t ncclDevCommCreate(ncclComm_t comm, ncclDevCommRequirements_t const* reqs, ncclDevComm_t* outDevComm);
    "ncclDevCommCreate": _P(
        (2, 28, 3), ncclResult_t, (("comm", ncclComm_t), ("reqs", _ptr), ("outDevComm", _ptr))
    ),
    # ncclResult_t ncclDevCommDestroy(ncclComm_t comm, ncclDevComm_t const* devComm);
    "ncclDevCommDestroy": _P((2, 28, 3), ncclResult_t, (("comm", ncclComm_t), ("devComm", _ptr))),
    # ncclResult_t ncclGetLsaMultimemDevicePointer(ncclWindow_t window, size_t offset, void** outPtr);
    "ncclGetLsaMultimemDevicePointer": _P(
        (2, 29, 2),
        ncclResult_t,
        (("window", ncclWindow_t), ("offset", c_size_t), ("outPtr", POINTER(c_void_p))),
    ),
    # ncclResult_t ncclGetMultimemDevicePointer(ncclWindow_t window, size_t offset, ncclMultimemHandle_t multimem, void** outPtr);
    "ncclGetMultimemDevicePointer": _P(
        (2, 29, 2),
        ncclResult_t,
        (
            ("window", ncclWindow_t),
            ("offset", c_size_t),
            ("multimem", ncclMultimemHandle_t),
            ("outPtr", POINTER(c_void_p)),
        ),
    ),
    # ncclResult_t ncclGetLsaDevicePointer(ncclWindow_t window, size_t offset, int lsaRank, void** outPtr);
    "ncclGetLsaDevicePointer": _P(
        (2, 29, 2),
        ncclResult_t,
        (
            ("window", ncclWindow_t),
            ("offset", c_size_t),
            ("lsaRank", c_int),
            ("outPtr", POINTER(c_void_p)),
        ),
    ),
    # ncclResult_t ncclGetPeerDevicePointer(ncclWindow_t window, size_t offset, int peer, void** outPtr);
    "ncclGetPeerDevicePointer": _P(
        (2, 29, 2),
        ncclResult_t,
        (
            ("window", ncclWindow_t),
            ("offset", c_size_t),
            ("peer", c_int),
            ("outPtr", POINTER(c_void_p)),
        ),
    ),
    # ncclResult_t ncclGetMultimemDeviceLeInfo(ncclWindow_t window, size_t offset, ncclCftLeId* leId, size_t* leOffset);
    "ncclGetMultimemDeviceLeInfo": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("window", ncclWindow_t),
            ("offset", c_size_t),
            ("leId", POINTER(ncclCftLeId)),
            ("leOffset", POINTER(c_size_t)),
        ),
    ),
    # ncclResult_t ncclGetCftDeviceLeInfo(ncclWindow_t window, size_t offset, int peerCft, ncclTeam_t cftTeam, ncclCftLeId* leId, size_t* leOffset);
    "ncclGetCftDeviceLeInfo": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("window", ncclWindow_t),
            ("offset", c_size_t),
            ("peerCft", c_int),
            ("cftTeam", ncclTeam_t),
            ("leId", POINTER(ncclCftLeId)),
            ("leOffset", POINTER(c_size_t)),
        ),
    ),
    # ncclResult_t ncclGetPeerDeviceLeInfo(ncclWindow_t window, size_t offset, int peerWorld, ncclCftLeId* leId, size_t* leOffset);
    "ncclGetPeerDeviceLeInfo": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("window", ncclWindow_t),
            ("offset", c_size_t),
            ("peerWorld", c_int),
            ("leId", POINTER(ncclCftLeId)),
            ("leOffset", POINTER(c_size_t)),
        ),
    ),
    # ncclTeam_t ncclTeamWorld(ncclComm_t comm);
    "ncclTeamWorld": _P((2, 28, 3), ncclTeam_t, (("comm", ncclComm_t),)),
    # ncclTeam_t ncclTeamLsa(ncclComm_t comm);
    "ncclTeamLsa": _P((2, 28, 3), ncclTeam_t, (("comm", ncclComm_t),)),
    # ncclTeam_t ncclTeamCft(ncclComm_t comm, ncclCftTeamMode_t mode);
    "ncclTeamCft": _P((2, 31, 2), ncclTeam_t, (("comm", ncclComm_t), ("mode", ncclCftTeamMode_t))),
    # ncclTeam_t ncclTeamCftMultimem(ncclComm_t comm);
    "ncclTeamCftMultimem": _P((2, 31, 2), ncclTeam_t, (("comm", ncclComm_t),)),
    # int ncclTeamRankToWorld(ncclComm_t comm, ncclTeam_t team, int rank);
    "ncclTeamRankToWorld": _P(
        (2, 28, 3), c_int, (("comm", ncclComm_t), ("team", ncclTeam_t), ("rank", c_int))
    ),
    # int ncclTeamRankToLsa(ncclComm_t comm, ncclTeam_t team, int rank);
    "ncclTeamRankToLsa": _P(
        (2, 28, 3), c_int, (("comm", ncclComm_t), ("team", ncclTeam_t), ("rank", c_int))
    ),
    # ncclTeam_t ncclTeamRail(ncclComm_t comm);
    "ncclTeamRail": _P((2, 28, 3), ncclTeam_t, (("comm", ncclComm_t),)),
    # ncclResult_t ncclLsaBarrierCreateRequirement(ncclTeam_t team, int nBarriers, ncclLsaBarrierHandle_t* outHandle, ncclDevResourceRequirements_t* outReq);
    "ncclLsaBarrierCreateRequirement": _P(
        (2, 28, 3),
        ncclResult_t,
        (("team", ncclTeam_t), ("nBarriers", c_int), ("outHandle", _ptr), ("outReq", _ptr)),
    ),
    # ncclResult_t ncclGinBarrierCreateRequirement(ncclComm_t comm, ncclTeam_t team, int nBarriers, ncclGinBarrierHandle_t* outHandle, ncclDevResourceRequirements_t* outReq);
    "ncclGinBarrierCreateRequirement": _P(
        (2, 28, 7),
        ncclResult_t,
        (
            ("comm", ncclComm_t),
            ("team", ncclTeam_t),
            ("nBarriers", c_int),
            ("outHandle", _ptr),
            ("outReq", _ptr),
        ),
    ),
    # int ncclLLA2ACalcSlots(int maxElts, int maxEltSize);
    "ncclLLA2ACalcSlots": _P((2, 28, 3), c_int, (("maxElts", c_int), ("maxEltSize", c_int))),
    # ncclResult_t ncclLLA2ACreateRequirement(int nBlocks, int nSlots, ncclLLA2AHandle_t* outHandle, ncclDevResourceRequirements_t* outReq);
    "ncclLLA2ACreateRequirement": _P(
        (2, 28, 3),
        ncclResult_t,
        (("nBlocks", c_int), ("nSlots", c_int), ("outHandle", _ptr), ("outReq", _ptr)),
    ),
    # ncclResult_t ncclGinOutboxCreateRequirement(int nBlocks, int size_log2, ncclGinOutboxHandle* outHandle, ncclDevResourceRequirements* outReq);
    # (declared under NCCL_OS_WINDOWS in host.h, exported on Linux too)
    "ncclGinOutboxCreateRequirement": _P(
        (2, 29, 7),
        ncclResult_t,
        (("nBlocks", c_int), ("size_log2", c_int), ("outHandle", _ptr), ("outReq", _ptr)),
    ),
    # ncclResult_t ncclGinInboxA2ACreateRequirement(ncclTeam peers, int nBlocks, int size_log2, ncclGinInboxA2AHandle* outHandle, ncclDevResourceRequirements* outReq);
    "ncclGinInboxA2ACreateRequirement": _P(
        (2, 29, 7),
        ncclResult_t,
        (
            ("peers", ncclTeam_t),
            ("nBlocks", c_int),
            ("size_log2", c_int),
            ("outHandle", _ptr),
            ("outReq", _ptr),
        ),
    ),
}

#: Functions of the table whose ``int`` return is a value, not an ``ncclResult_t``.
VALUE_RESULTS: frozenset[str] = frozenset(
    {"ncclTeamRankToWorld", "ncclTeamRankToLsa", "ncclLLA2ACalcSlots"}
)
