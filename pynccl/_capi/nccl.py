"""The NCCL prototype table and the low-level library object.

One entry per function of nccl.h 2.32.3, each under its C signature, with the
first NCCL release that exports it. Functions are bound lazily on first use
and cached as instance attributes, so after the first call an
``L.ncclAllReduce(...)`` is one attribute lookup, one generated Python frame
and the ctypes call. A function the loaded library does not export becomes a
callable that raises :class:`~pynccl.NotSupportedError` naming the function,
the release that added it and the loaded version.

Why pure ctypes: no compiled extension to build per Python / CUDA / NCCL
version, ``CDLL`` releases the GIL around every call (blocking NCCL calls do
not stall other Python threads), and one binding serves every libnccl from
2.18 to 2.32 by feature detection.
"""

from __future__ import annotations

import ctypes
from ctypes import (
    POINTER,
    c_char_p,
    c_int,
    c_int8,
    c_int16,
    c_int32,
    c_int64,
    c_size_t,
    c_uint,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)

from ..enums import DataType, RedOp, Release, Result, release_str
from ..errors import NcclError, NotSupportedError
from ._binding import BoundLibrary, Prototype
from ._enumargs import C_DATATYPE, C_REDOP
from .nccl_device import DEVICE_PROTOTYPES, VALUE_RESULTS
from .structs import (
    ncclCollConfig_t,
    ncclConfig_t,
    ncclEncryptionConfig_t,
    ncclSimInfo_t,
    ncclUniqueId,
    ncclWaitSignalDesc_t,
)

TYPE_CHECKING = False  # `typing` costs milliseconds to import
if TYPE_CHECKING:
    from typing import Any

__all__ = ["C_DATATYPE", "C_REDOP", "PROTOTYPES", "NcclLibrary", "Prototype", "decode_version"]

# Opaque handles and enums, named as in nccl.h.
ncclComm_t = c_void_p
ncclWindow_t = c_void_p
ncclParamHandle_t = c_void_p
cudaStream_t = c_void_p
ncclResult_t = c_int
ncclDataType_t = c_int
ncclRedOp_t = c_int
ncclScalarResidence_t = c_int
ncclCommMemStat_t = c_int


_P = Prototype

PROTOTYPES: dict[str, Prototype] = {
    # ncclResult_t ncclMemAlloc(void** ptr, size_t size);
    "ncclMemAlloc": _P((2, 19, 1), ncclResult_t, (("ptr", POINTER(c_void_p)), ("size", c_size_t))),
    # ncclResult_t ncclMemFree(void *ptr);
    "ncclMemFree": _P((2, 19, 1), ncclResult_t, (("ptr", c_void_p),)),
    # ncclResult_t ncclGetVersion(int *version);
    "ncclGetVersion": _P((2, 3, 5), ncclResult_t, (("version", POINTER(c_int)),)),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
    "ncclGetUniqueId": _P((2, 3, 5), ncclResult_t, (("uniqueId", POINTER(ncclUniqueId)),)),
    # ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config);
    "ncclCommInitRankConfig": _P(
        (2, 14, 3),
        ncclResult_t,
        (
            ("comm", POINTER(ncclComm_t)),
            ("nranks", c_int),
            ("commId", ncclUniqueId),
            ("rank", c_int),
            ("config", POINTER(ncclConfig_t)),
        ),
    ),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
    "ncclCommInitRank": _P(
        (2, 3, 5),
        ncclResult_t,
        (
            ("comm", POINTER(ncclComm_t)),
            ("nranks", c_int),
            ("commId", ncclUniqueId),
            ("rank", c_int),
        ),
    ),
    # ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist);
    "ncclCommInitAll": _P(
        (2, 3, 5),
        ncclResult_t,
        (("comm", POINTER(ncclComm_t)), ("ndev", c_int), ("devlist", POINTER(c_int))),
    ),
    # ncclResult_t ncclCommFinalize(ncclComm_t comm);
    "ncclCommFinalize": _P((2, 14, 3), ncclResult_t, (("comm", ncclComm_t),)),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm);
    "ncclCommDestroy": _P((2, 3, 5), ncclResult_t, (("comm", ncclComm_t),)),
    # ncclResult_t ncclCommAbort(ncclComm_t comm);
    "ncclCommAbort": _P((2, 4, 2), ncclResult_t, (("comm", ncclComm_t),)),
    # ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags);
    "ncclCommRevoke": _P((2, 28, 7), ncclResult_t, (("comm", ncclComm_t), ("revokeFlags", c_int))),
    # ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t* config);
    "ncclCommSplit": _P(
        (2, 18, 1),
        ncclResult_t,
        (
            ("comm", ncclComm_t),
            ("color", c_int),
            ("key", c_int),
            ("newcomm", POINTER(ncclComm_t)),
            ("config", POINTER(ncclConfig_t)),
        ),
    ),
    # ncclResult_t ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount, ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);
    "ncclCommShrink": _P(
        (2, 27, 3),
        ncclResult_t,
        (
            ("comm", ncclComm_t),
            ("excludeRanksList", POINTER(c_int)),
            ("excludeRanksCount", c_int),
            ("newcomm", POINTER(ncclComm_t)),
            ("config", POINTER(ncclConfig_t)),
            ("shrinkFlags", c_int),
        ),
    ),
    # ncclResult_t ncclCommGetUniqueId(ncclComm_t comm, ncclUniqueId* uniqueId);
    "ncclCommGetUniqueId": _P(
        (2, 29, 2), ncclResult_t, (("comm", ncclComm_t), ("uniqueId", POINTER(ncclUniqueId)))
    ),
    # ncclResult_t ncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId* uniqueId, int rank, ncclComm_t* newcomm, ncclConfig_t* config);
    "ncclCommGrow": _P(
        (2, 29, 2),
        ncclResult_t,
        (
            ("comm", ncclComm_t),
            ("nRanks", c_int),
            ("uniqueId", POINTER(ncclUniqueId)),
            ("rank", c_int),
            ("newcomm", POINTER(ncclComm_t)),
            ("config", POINTER(ncclConfig_t)),
        ),
    ),
    # ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId, ncclUniqueId* commIds, ncclConfig_t* config);
    "ncclCommInitRankScalable": _P(
        (2, 23, 4),
        ncclResult_t,
        (
            ("newcomm", POINTER(ncclComm_t)),
            ("nranks", c_int),
            ("myrank", c_int),
            ("nId", c_int),
            ("commIds", POINTER(ncclUniqueId)),
            ("config", POINTER(ncclConfig_t)),
        ),
    ),
    # const char* ncclGetErrorString(ncclResult_t result);
    "ncclGetErrorString": _P((2, 3, 5), c_char_p, (("result", ncclResult_t),)),
    # const char* ncclGetLastError(ncclComm_t comm);
    "ncclGetLastError": _P((2, 13, 4), c_char_p, (("comm", ncclComm_t),)),
    # void ncclResetDebugInit();
    "ncclResetDebugInit": _P((2, 24, 3), None, ()),
    # ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
    "ncclCommGetAsyncError": _P(
        (2, 4, 2), ncclResult_t, (("comm", ncclComm_t), ("asyncError", POINTER(ncclResult_t)))
    ),
    # ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
    "ncclCommCount": _P((2, 3, 5), ncclResult_t, (("comm", ncclComm_t), ("count", POINTER(c_int)))),
    # ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
    "ncclCommCuDevice": _P(
        (2, 3, 5), ncclResult_t, (("comm", ncclComm_t), ("device", POINTER(c_int)))
    ),
    # ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
    "ncclCommUserRank": _P(
        (2, 3, 5), ncclResult_t, (("comm", ncclComm_t), ("rank", POINTER(c_int)))
    ),
    # ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle);
    "ncclCommRegister": _P(
        (2, 19, 1),
        ncclResult_t,
        (
            ("comm", ncclComm_t),
            ("buff", c_void_p),
            ("size", c_size_t),
            ("handle", POINTER(c_void_p)),
        ),
    ),
    # ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* handle);
    "ncclCommDeregister": _P(
        (2, 19, 1), ncclResult_t, (("comm", ncclComm_t), ("handle", c_void_p))
    ),
    # ncclResult_t ncclCommSuspend(ncclComm_t comm, int flags);
    "ncclCommSuspend": _P((2, 29, 7), ncclResult_t, (("comm", ncclComm_t), ("flags", c_int))),
    # ncclResult_t ncclCommResume(ncclComm_t comm);
    "ncclCommResume": _P((2, 29, 7), ncclResult_t, (("comm", ncclComm_t),)),
    # ncclResult_t ncclCommMemStats(ncclComm_t comm, ncclCommMemStat_t stat, uint64_t* value);
    "ncclCommMemStats": _P(
        (2, 29, 7),
        ncclResult_t,
        (("comm", ncclComm_t), ("stat", ncclCommMemStat_t), ("value", POINTER(c_uint64))),
    ),
    # ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags);
    "ncclCommWindowRegister": _P(
        (2, 27, 3),
        ncclResult_t,
        (
            ("comm", ncclComm_t),
            ("buff", c_void_p),
            ("size", c_size_t),
            ("win", POINTER(ncclWindow_t)),
            ("winFlags", c_int),
        ),
    ),
    # ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
    "ncclCommWindowDeregister": _P(
        (2, 27, 3), ncclResult_t, (("comm", ncclComm_t), ("win", ncclWindow_t))
    ),
    # ncclResult_t ncclWinGetUserPtr(ncclComm_t comm, ncclWindow_t win, void** outUserPtr);
    "ncclWinGetUserPtr": _P(
        (2, 29, 2),
        ncclResult_t,
        (("comm", ncclComm_t), ("win", ncclWindow_t), ("outUserPtr", POINTER(c_void_p))),
    ),
    # ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype, ncclScalarResidence_t residence, ncclComm_t comm);
    "ncclRedOpCreatePreMulSum": _P(
        (2, 11, 4),
        ncclResult_t,
        (
            ("op", POINTER(ncclRedOp_t)),
            ("scalar", c_void_p),
            ("datatype", ncclDataType_t),
            ("residence", ncclScalarResidence_t),
            ("comm", ncclComm_t),
        ),
    ),
    # ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);
    "ncclRedOpDestroy": _P((2, 11, 4), ncclResult_t, (("op", ncclRedOp_t), ("comm", ncclComm_t))),
    # ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
    "ncclReduce": _P(
        (2, 3, 5),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("op", ncclRedOp_t),
            ("root", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
    "ncclBcast": _P(
        (2, 3, 5),
        ncclResult_t,
        (
            ("buff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("root", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
    "ncclBroadcast": _P(
        (2, 3, 5),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("root", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    "ncclAllReduce": _P(
        (2, 3, 5),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("op", ncclRedOp_t),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    "ncclReduceScatter": _P(
        (2, 3, 5),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("recvcount", c_size_t),
            ("datatype", ncclDataType_t),
            ("op", ncclRedOp_t),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
    "ncclAllGather": _P(
        (2, 3, 5),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("sendcount", c_size_t),
            ("datatype", ncclDataType_t),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
    "ncclAlltoAll": _P(
        (2, 28, 3),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
    "ncclGather": _P(
        (2, 28, 3),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("root", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
    "ncclScatter": _P(
        (2, 28, 3),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("root", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclAllReduceConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
    "ncclAllReduceConfig": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("op", ncclRedOp_t),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
            ("config", POINTER(ncclCollConfig_t)),
        ),
    ),
    # ncclResult_t ncclBroadcastConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
    "ncclBroadcastConfig": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("root", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
            ("config", POINTER(ncclCollConfig_t)),
        ),
    ),
    # ncclResult_t ncclReduceConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
    "ncclReduceConfig": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("op", ncclRedOp_t),
            ("root", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
            ("config", POINTER(ncclCollConfig_t)),
        ),
    ),
    # ncclResult_t ncclAllGatherConfig(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
    "ncclAllGatherConfig": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("sendcount", c_size_t),
            ("datatype", ncclDataType_t),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
            ("config", POINTER(ncclCollConfig_t)),
        ),
    ),
    # ncclResult_t ncclReduceScatterConfig(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
    "ncclReduceScatterConfig": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("recvcount", c_size_t),
            ("datatype", ncclDataType_t),
            ("op", ncclRedOp_t),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
            ("config", POINTER(ncclCollConfig_t)),
        ),
    ),
    # ncclResult_t ncclAlltoAllConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
    "ncclAlltoAllConfig": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
            ("config", POINTER(ncclCollConfig_t)),
        ),
    ),
    # ncclResult_t ncclGatherConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
    "ncclGatherConfig": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("root", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
            ("config", POINTER(ncclCollConfig_t)),
        ),
    ),
    # ncclResult_t ncclScatterConfig(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config);
    "ncclScatterConfig": _P(
        (2, 31, 2),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("root", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
            ("config", POINTER(ncclCollConfig_t)),
        ),
    ),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream);
    "ncclSend": _P(
        (2, 7, 3),
        ncclResult_t,
        (
            ("sendbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("peer", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream);
    "ncclRecv": _P(
        (2, 7, 3),
        ncclResult_t,
        (
            ("recvbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("peer", c_int),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclPutSignal(const void* localbuff, size_t count, ncclDataType_t datatype, int peer, ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream);
    "ncclPutSignal": _P(
        (2, 29, 2),
        ncclResult_t,
        (
            ("localbuff", c_void_p),
            ("count", c_size_t),
            ("datatype", ncclDataType_t),
            ("peer", c_int),
            ("peerWin", ncclWindow_t),
            ("peerWinOffset", c_size_t),
            ("sigIdx", c_int),
            ("ctx", c_int),
            ("flags", c_uint),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream);
    "ncclSignal": _P(
        (2, 29, 2),
        ncclResult_t,
        (
            ("peer", c_int),
            ("sigIdx", c_int),
            ("ctx", c_int),
            ("flags", c_uint),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclWaitSignal(int nDesc, ncclWaitSignalDesc_t* signalDescs, ncclComm_t comm, cudaStream_t stream);
    "ncclWaitSignal": _P(
        (2, 29, 2),
        ncclResult_t,
        (
            ("nDesc", c_int),
            ("signalDescs", POINTER(ncclWaitSignalDesc_t)),
            ("comm", ncclComm_t),
            ("stream", cudaStream_t),
        ),
    ),
    # ncclResult_t ncclGroupStart();
    "ncclGroupStart": _P((2, 3, 5), ncclResult_t, ()),
    # ncclResult_t ncclGroupEnd();
    "ncclGroupEnd": _P((2, 3, 5), ncclResult_t, ()),
    # ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* simInfo);
    "ncclGroupSimulateEnd": _P((2, 22, 3), ncclResult_t, (("simInfo", POINTER(ncclSimInfo_t)),)),
    # ncclResult_t ncclSetEncryption(const ncclEncryptionConfig_t* config);
    "ncclSetEncryption": _P(
        (2, 32, 3), ncclResult_t, (("config", POINTER(ncclEncryptionConfig_t)),)
    ),
    # ncclResult_t ncclParamBind(ncclParamHandle_t* out, const char* key);
    "ncclParamBind": _P(
        (2, 30, 3), ncclResult_t, (("out", POINTER(ncclParamHandle_t)), ("key", c_char_p))
    ),
    # ncclResult_t ncclParamGetI8(ncclParamHandle_t h, int8_t* out);
    "ncclParamGetI8": _P(
        (2, 30, 3), ncclResult_t, (("h", ncclParamHandle_t), ("out", POINTER(c_int8)))
    ),
    # ncclResult_t ncclParamGetI16(ncclParamHandle_t h, int16_t* out);
    "ncclParamGetI16": _P(
        (2, 30, 3), ncclResult_t, (("h", ncclParamHandle_t), ("out", POINTER(c_int16)))
    ),
    # ncclResult_t ncclParamGetI32(ncclParamHandle_t h, int32_t* out);
    "ncclParamGetI32": _P(
        (2, 30, 3), ncclResult_t, (("h", ncclParamHandle_t), ("out", POINTER(c_int32)))
    ),
    # ncclResult_t ncclParamGetI64(ncclParamHandle_t h, int64_t* out);
    "ncclParamGetI64": _P(
        (2, 30, 3), ncclResult_t, (("h", ncclParamHandle_t), ("out", POINTER(c_int64)))
    ),
    # ncclResult_t ncclParamGetU8(ncclParamHandle_t h, uint8_t* out);
    "ncclParamGetU8": _P(
        (2, 30, 3), ncclResult_t, (("h", ncclParamHandle_t), ("out", POINTER(c_uint8)))
    ),
    # ncclResult_t ncclParamGetU16(ncclParamHandle_t h, uint16_t* out);
    "ncclParamGetU16": _P(
        (2, 30, 3), ncclResult_t, (("h", ncclParamHandle_t), ("out", POINTER(c_uint16)))
    ),
    # ncclResult_t ncclParamGetU32(ncclParamHandle_t h, uint32_t* out);
    "ncclParamGetU32": _P(
        (2, 30, 3), ncclResult_t, (("h", ncclParamHandle_t), ("out", POINTER(c_uint32)))
    ),
    # ncclResult_t ncclParamGetU64(ncclParamHandle_t h, uint64_t* out);
    "ncclParamGetU64": _P(
        (2, 30, 3), ncclResult_t, (("h", ncclParamHandle_t), ("out", POINTER(c_uint64)))
    ),
    # ncclResult_t ncclParamGetStr(ncclParamHandle_t h, const char** out);
    "ncclParamGetStr": _P(
        (2, 30, 3), ncclResult_t, (("h", ncclParamHandle_t), ("out", POINTER(c_char_p)))
    ),
    # ncclResult_t ncclParamGet(ncclParamHandle_t h, void* out, int maxLen, int* len);
    "ncclParamGet": _P(
        (2, 30, 3),
        ncclResult_t,
        (("h", ncclParamHandle_t), ("out", c_void_p), ("maxLen", c_int), ("len", POINTER(c_int))),
    ),
    # ncclResult_t ncclParamGetParameter(const char* key, const char** value, int* valueLen);
    "ncclParamGetParameter": _P(
        (2, 30, 3),
        ncclResult_t,
        (("key", c_char_p), ("value", POINTER(c_char_p)), ("valueLen", POINTER(c_int))),
    ),
    # ncclResult_t ncclParamGetAllParameterKeys(const char*** table, int* tableLen);
    "ncclParamGetAllParameterKeys": _P(
        (2, 30, 3),
        ncclResult_t,
        (("table", POINTER(POINTER(c_char_p))), ("tableLen", POINTER(c_int))),
    ),
    # void ncclParamDumpAll(void);
    "ncclParamDumpAll": _P((2, 30, 3), None, ()),
}


def decode_version(code: int) -> Release:
    """Decode ``NCCL_VERSION_CODE``: X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after."""
    if code >= 10000:
        return (code // 10000, code % 10000 // 100, code % 100)
    return (code // 1000, code % 1000 // 100, code % 100)


class NcclLibrary(BoundLibrary):
    """A loaded libnccl: its functions by their C names, checked and version-aware.

    ``L.ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)``
    takes raw pointers / handles as ints (or ctypes objects), returns
    ``Result.SUCCESS`` (or ``Result.IN_PROGRESS`` on a non-blocking
    communicator) and raises the :class:`~pynccl.NcclError` subclass for any
    other result. ``const char*`` functions return ``str``; ``void`` ones
    ``None``. ``L.raw(name)`` is the bare ctypes function, unchecked; ``L.has(name)``
    tells whether the library exports it. The host functions of ``nccl_device/host.h``
    (:mod:`pynccl._capi.nccl_device`) are bound the same way.
    """

    PROTOTYPES = {**PROTOTYPES, **DEVICE_PROTOTYPES}  # nccl.h, then nccl_device/host.h
    VALUE_RESULTS = VALUE_RESULTS
    OK = Result.SUCCESS
    KIND = "NCCL"
    ENUM_ARGS = {"datatype": (DataType, C_DATATYPE), "op": (RedOp, C_REDOP)}

    version: Release

    def __init__(self, cdll: ctypes.CDLL, path: str = "", rule: str = "explicit") -> None:
        super().__init__(cdll, path, rule)
        code = c_int(0)
        try:
            rc = self.raw("ncclGetVersion")(ctypes.byref(code))
        except NotSupportedError:
            raise OSError(f"{self.path} is not a libnccl: it lacks ncclGetVersion") from None
        if rc != 0:
            raise NcclError(rc, "ncclGetVersion", f"cannot read the version of {self.path}")
        #: ``NCCL_VERSION_CODE`` as the library reports it (e.g. 23203).
        self.version_code: int = code.value
        #: ``(major, minor, patch)``.
        self.version = decode_version(code.value)

    def __repr__(self) -> str:
        return f"<NcclLibrary {release_str(self.version)} from {self.path!r} ({self.rule})>"

    def error_string(self, result: int) -> str:
        """``ncclGetErrorString(result)``."""
        text = self.raw("ncclGetErrorString")(result)
        return "" if text is None else str(text.decode("utf-8", "replace"))

    def last_error(self) -> str:
        """``ncclGetLastError(NULL)`` (NCCL >= 2.13.4): the last warning NCCL logged."""
        try:
            text = self.raw("ncclGetLastError")(None)
        except NotSupportedError:
            return ""
        return "" if text is None else str(text.decode("utf-8", "replace"))

    def make_error(self, result: int, function: str) -> NcclError:
        """The :class:`NcclError` for ``result`` from ``function``, with NCCL's own texts."""
        try:
            name = Result(result).c_name
        except ValueError:
            name = f"result {result}"
        text = f"{name}: {self.error_string(result)}"
        last = self.last_error().strip()
        if last:
            text += f" (NCCL's last error: {last})"
        return NcclError(result, function, text)

    def _fail(self, code: int, function: str) -> Any:
        if code == Result.IN_PROGRESS:
            return Result.IN_PROGRESS
        raise self.make_error(code, function)

    def require(self, feature: str, release: Release) -> None:
        """Raise :class:`NotSupportedError` if the loaded version is older than ``release``."""
        if self.version < release:
            raise NotSupportedError(feature, release, self.version)
