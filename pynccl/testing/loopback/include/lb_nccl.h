/*
 * The NCCL API as the loopback libnccl sees it: our own declarations of nccl.h's
 * types and prototypes (2.32.3 layout), or, with -DLB_USE_REAL_HEADERS, the real
 * <nccl.h> so that the compiler checks every exported definition against NVIDIA's
 * prototypes.
 *
 * LB_NCCL_VERSION_CODE (default 23203) selects the release the library pretends to
 * be; the LB_HAS_* macros below say what that release had. Every exported function
 * is declared here whatever the version; nccl*.c only *define* the ones the release
 * exported (nccl-first-release.tsv), so an older build lacks the newer symbols.
 */
#ifndef PYNCCL_LB_NCCL_H
#define PYNCCL_LB_NCCL_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "lb_cuda.h"

#ifndef LB_NCCL_VERSION_CODE
#define LB_NCCL_VERSION_CODE 23203
#endif
#define LB_V(x, y, z) ((x) * 10000 + (y) * 100 + (z))
#define LB_AT_LEAST(x, y, z) (LB_NCCL_VERSION_CODE >= LB_V(x, y, z))

/* What the emulated release had (nccl-abi.md sections 1-3). */
#define LB_HAS_BF16 LB_AT_LEAST(2, 10, 3)
#define LB_HAS_AVG LB_AT_LEAST(2, 10, 3)
#define LB_HAS_FP8 LB_AT_LEAST(2, 24, 3)
#define LB_NUM_TYPES (LB_HAS_FP8 ? 12 : (LB_HAS_BF16 ? 10 : 9))
#define LB_NUM_OPS (LB_HAS_AVG ? 5 : 4)
#define LB_HAS_REMOTE_ERROR LB_AT_LEAST(2, 13, 4)
#define LB_HAS_IN_PROGRESS LB_AT_LEAST(2, 14, 3)
#define LB_HAS_TIMEOUT LB_AT_LEAST(2, 30, 3)

#ifdef LB_USE_REAL_HEADERS

#ifndef NCCL_OS_LINUX
#define NCCL_OS_LINUX 1 /* nccl.h declares ncclResetDebugInit only then */
#endif
#pragma GCC visibility push(default)
#include <nccl.h>
#pragma GCC visibility pop

#else /* our own declarations */

typedef struct ncclComm *ncclComm_t;
typedef struct ncclWindow_vidmem *ncclWindow_t;
typedef struct ncclParamHandle *ncclParamHandle_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
    ncclTimeout = 8,
    ncclNumResults = 9
} ncclResult_t;

#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL
#define NCCL_SPLIT_NOCOLOR -1
#define NCCL_API_MAGIC 0xcafebeef

/* ncclConfig_t, 2.32 layout (120 bytes); fields in release order. */
typedef struct ncclConfig_v23100 {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;            /* 2.14 */
    int cgaClusterSize;      /* 2.17 */
    int minCTAs;
    int maxCTAs;
    const char *netName;
    int splitShare;          /* 2.18 */
    int trafficClass;        /* 2.26 */
    const char *commName;    /* 2.27 */
    int collnetEnable;
    int CTAPolicy;
    int shrinkShare;
    int nvlsCTAs;
    int nChannelsPerNetPeer; /* 2.28 */
    int nvlinkCentricSched;
    int graphUsageMode;      /* 2.29 */
    int numRmaCtx;
    int maxP2pPeers;         /* 2.30.3 */
    int graphStreamOrdering; /* 2.30.7 */
    int launchOrderImplicit; /* 2.31 */
    int numRmaSig;
    int rmaEagerInit;
    int hostCftMode;
    int nvlsHostMode;        /* 2.32 */
} ncclConfig_t;

typedef struct ncclConfigExt {
    struct ncclConfigExt *next;
    struct {
        int vendorId;
        int optionId;
    } key;
    union {
        int i;
        const char *s;
        void *raw;
    } val;
} ncclConfigExt_t;

/* ncclCollConfig_t, 2.32 layout (72 bytes; 2.31 had 64, without the event). */
typedef struct ncclCollConfig_v23200 {
    size_t size;
    unsigned int magic;
    unsigned int version;
    ncclConfigExt_t *ext;
    int minCTAs;
    int maxCTAs;
    int nvlsCTAs;
    int cgaClusterSize;
    const char *algSelection;
    int forceAlgSelection;
    int CTAPolicy;
    uint64_t userProfilerTag;
    cudaEvent_t launchCompletionEvent;
} ncclCollConfig_t;

typedef struct ncclSimInfo_v22200 {
    size_t size;
    unsigned int magic;
    unsigned int version;
    float estimatedTime;
} ncclSimInfo_t;

typedef enum {
    ncclSum = 0,
    ncclProd = 1,
    ncclMax = 2,
    ncclMin = 3,
    ncclAvg = 4,
    ncclNumOps = 5,
    ncclMaxRedOp = 0x7fffffff
} ncclRedOp_t;

typedef enum {
    ncclInt8 = 0,
    ncclChar = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclInt = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclHalf = 6,
    ncclFloat32 = 7,
    ncclFloat = 7,
    ncclFloat64 = 8,
    ncclDouble = 8,
    ncclBfloat16 = 9,
    ncclFloat8e4m3 = 10,
    ncclFloat8e5m2 = 11,
    ncclNumTypes = 12
} ncclDataType_t;

typedef enum { ncclScalarDevice = 0, ncclScalarHostImmediate = 1 } ncclScalarResidence_t;

typedef enum {
    ncclStatGpuMemSuspend = 0,
    ncclStatGpuMemSuspended = 1,
    ncclStatGpuMemPersist = 2,
    ncclStatGpuMemTotal = 3
} ncclCommMemStat_t;

typedef struct {
    int opCnt;
    int peer;
    int sigIdx;
    int ctx;
} ncclWaitSignalDesc_t;

typedef struct ncclEncryptionConfig_v23200 {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int mode;
    const char *psk;
} ncclEncryptionConfig_t;

#pragma GCC visibility push(default)
/* Prototypes, in nccl.h's order. D = ncclDataType_t, S = cudaStream_t. */
ncclResult_t ncclMemAlloc(void **ptr, size_t size);
ncclResult_t ncclMemFree(void *ptr);
ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config);
ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                            ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags);
ncclResult_t ncclCommGetUniqueId(ncclComm_t comm, ncclUniqueId *uniqueId);
ncclResult_t ncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId, int rank,
                          ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                      ncclUniqueId *commIds, ncclConfig_t *config);
const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);
void ncclResetDebugInit(void);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);
ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle);
ncclResult_t ncclCommDeregister(const ncclComm_t comm, void *handle);
ncclResult_t ncclCommSuspend(ncclComm_t comm, int flags);
ncclResult_t ncclCommResume(ncclComm_t comm);
ncclResult_t ncclCommMemStats(ncclComm_t comm, ncclCommMemStat_t stat, uint64_t *value);
ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win,
                                    int winFlags);
ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
ncclResult_t ncclWinGetUserPtr(ncclComm_t comm, ncclWindow_t win, void **outUserPtr);
ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm);
ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);
ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                        ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                        cudaStream_t stream);
ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
                       ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count,
                          ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGather(const void *sendbuff, void *recvbuff, size_t count,
                        ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclScatter(const void *sendbuff, void *recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllReduceConfig(const void *sendbuff, void *recvbuff, size_t count,
                                 ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                 cudaStream_t stream, const ncclCollConfig_t *config);
ncclResult_t ncclBroadcastConfig(const void *sendbuff, void *recvbuff, size_t count,
                                 ncclDataType_t datatype, int root, ncclComm_t comm,
                                 cudaStream_t stream, const ncclCollConfig_t *config);
ncclResult_t ncclReduceConfig(const void *sendbuff, void *recvbuff, size_t count,
                              ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                              cudaStream_t stream, const ncclCollConfig_t *config);
ncclResult_t ncclAllGatherConfig(const void *sendbuff, void *recvbuff, size_t sendcount,
                                 ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream,
                                 const ncclCollConfig_t *config);
ncclResult_t ncclReduceScatterConfig(const void *sendbuff, void *recvbuff, size_t recvcount,
                                     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                     cudaStream_t stream, const ncclCollConfig_t *config);
ncclResult_t ncclAlltoAllConfig(const void *sendbuff, void *recvbuff, size_t count,
                                ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream,
                                const ncclCollConfig_t *config);
ncclResult_t ncclGatherConfig(const void *sendbuff, void *recvbuff, size_t count,
                              ncclDataType_t datatype, int root, ncclComm_t comm,
                              cudaStream_t stream, const ncclCollConfig_t *config);
ncclResult_t ncclScatterConfig(const void *sendbuff, void *recvbuff, size_t count,
                               ncclDataType_t datatype, int root, ncclComm_t comm,
                               cudaStream_t stream, const ncclCollConfig_t *config);
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclPutSignal(const void *localbuff, size_t count, ncclDataType_t datatype, int peer,
                           ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx,
                           unsigned int flags, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm,
                        cudaStream_t stream);
ncclResult_t ncclWaitSignal(int nDesc, ncclWaitSignalDesc_t *signalDescs, ncclComm_t comm,
                            cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t *simInfo);
ncclResult_t ncclSetEncryption(const ncclEncryptionConfig_t *config);
ncclResult_t ncclParamBind(ncclParamHandle_t *out, const char *key);
ncclResult_t ncclParamGetI8(ncclParamHandle_t h, int8_t *out);
ncclResult_t ncclParamGetI16(ncclParamHandle_t h, int16_t *out);
ncclResult_t ncclParamGetI32(ncclParamHandle_t h, int32_t *out);
ncclResult_t ncclParamGetI64(ncclParamHandle_t h, int64_t *out);
ncclResult_t ncclParamGetU8(ncclParamHandle_t h, uint8_t *out);
ncclResult_t ncclParamGetU16(ncclParamHandle_t h, uint16_t *out);
ncclResult_t ncclParamGetU32(ncclParamHandle_t h, uint32_t *out);
ncclResult_t ncclParamGetU64(ncclParamHandle_t h, uint64_t *out);
ncclResult_t ncclParamGetStr(ncclParamHandle_t h, const char **out);
ncclResult_t ncclParamGet(ncclParamHandle_t h, void *out, int maxLen, int *len);
ncclResult_t ncclParamGetParameter(const char *key, const char **value, int *valueLen);
ncclResult_t ncclParamGetAllParameterKeys(const char ***table, int *tableLen);
void ncclParamDumpAll(void);
#pragma GCC visibility pop

#endif /* LB_USE_REAL_HEADERS */

/* The host functions of nccl_device/host.h the loopback exports (not in nccl.h, so
 * declared here in both modes; layouts from the 2.32.3 headers). */
typedef struct ncclTeam {
    int nRanks, rank, stride;
} ncclTeam_t;

typedef struct ncclMultimemHandle {
    void *mcBasePtr;
} ncclMultimemHandle_t;

/* ncclCommProperties_t, 2.32.3 layout; the ginType fields are 4-byte enums. */
typedef struct ncclCommProperties {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int rank;
    int nRanks;
    int cudaDev;
    int nvmlDev;
    _Bool deviceApiSupport;
    _Bool multimemSupport;
    int ginType;
    int nLsaTeams;
    _Bool hostRmaSupport;
    int railedGinType;
    uint64_t commHash;
    int ginMinStride;
    int ginConnectionType;
    _Bool ginSupport[64];
    size_t devCommRuntimeVersionSize;
    _Bool cftSupport;
    _Bool cftMulticastSupport;
    _Bool cftCountedSupport;
} ncclCommProperties_t;

#pragma GCC visibility push(default)
ncclResult_t ncclCommQueryProperties(ncclComm_t comm, ncclCommProperties_t *props);
ncclResult_t ncclGetLsaMultimemDevicePointer(ncclWindow_t window, size_t offset, void **outPtr);
ncclResult_t ncclGetMultimemDevicePointer(ncclWindow_t window, size_t offset,
                                          ncclMultimemHandle_t multimem, void **outPtr);
ncclResult_t ncclGetLsaDevicePointer(ncclWindow_t window, size_t offset, int lsaRank, void **outPtr);
ncclResult_t ncclGetPeerDevicePointer(ncclWindow_t window, size_t offset, int peer, void **outPtr);
ncclTeam_t ncclTeamWorld(ncclComm_t comm);
ncclTeam_t ncclTeamLsa(ncclComm_t comm);
ncclTeam_t ncclTeamRail(ncclComm_t comm);
int ncclTeamRankToWorld(ncclComm_t comm, ncclTeam_t team, int rank);
int ncclTeamRankToLsa(ncclComm_t comm, ncclTeam_t team, int rank);
#pragma GCC visibility pop

/* Layouts pynccl's ctypes structures assume (LP64); checked in both modes. */
_Static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId size");
_Static_assert(sizeof(ncclConfig_t) == 120, "ncclConfig_t size");
_Static_assert(offsetof(ncclConfig_t, splitShare) == 40, "splitShare offset");
_Static_assert(offsetof(ncclConfig_t, commName) == 48, "commName offset");
_Static_assert(offsetof(ncclConfig_t, graphStreamOrdering) == 92, "graphStreamOrdering offset");
_Static_assert(offsetof(ncclConfig_t, nvlsHostMode) == 112, "nvlsHostMode offset");
_Static_assert(sizeof(ncclCollConfig_t) == 72, "ncclCollConfig_t size");
_Static_assert(offsetof(ncclCollConfig_t, forceAlgSelection) == 48, "forceAlgSelection offset");
_Static_assert(offsetof(ncclCollConfig_t, userProfilerTag) == 56, "userProfilerTag offset");
_Static_assert(sizeof(ncclSimInfo_t) == 24, "ncclSimInfo_t size");
_Static_assert(sizeof(ncclEncryptionConfig_t) == 32, "ncclEncryptionConfig_t size");
_Static_assert(sizeof(ncclWaitSignalDesc_t) == 16, "ncclWaitSignalDesc_t size");
_Static_assert(sizeof(ncclCommProperties_t) == 152, "ncclCommProperties_t size");
_Static_assert(offsetof(ncclCommProperties_t, commHash) == 56, "commHash offset");
_Static_assert(offsetof(ncclCommProperties_t, cftCountedSupport) == 146, "cftCountedSupport offset");

#endif /* PYNCCL_LB_NCCL_H */
