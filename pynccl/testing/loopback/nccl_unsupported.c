/*
 * The part of nccl.h 2.32.3 the loopback does not implement: windows and one-sided
 * signals, the parameter API and encryption (shrink/grow/revoke are in nccl_fault.c,
 * suspend/resume and memory statistics in nccl_suspend.c). The symbols exist (with
 * nccl.h's exact prototypes, from the release that introduced each) so that bindings
 * resolve them; each call returns ncclInvalidUsage and says so in ncclGetLastError.
 */
#include "nccl_lb_internal.h"

LBN_UNUSED static ncclResult_t unsupported(const char *fn) {
    return lb_err(ncclInvalidUsage, "%s is not implemented by the pynccl loopback libnccl", fn);
}

#if LB_AT_LEAST(2, 27, 3)
ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win,
                                    int winFlags) {
    (void)comm, (void)buff, (void)size, (void)winFlags;
    if (win) *win = NULL;
    return unsupported("ncclCommWindowRegister");
}
LB_ALIAS(ncclCommWindowRegister)

ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
    (void)comm, (void)win;
    return unsupported("ncclCommWindowDeregister");
}
LB_ALIAS(ncclCommWindowDeregister)
#endif

#if LB_AT_LEAST(2, 29, 2)
ncclResult_t ncclWinGetUserPtr(ncclComm_t comm, ncclWindow_t win, void **outUserPtr) {
    (void)comm, (void)win;
    if (outUserPtr) *outUserPtr = NULL;
    return unsupported("ncclWinGetUserPtr");
}
LB_ALIAS(ncclWinGetUserPtr)

ncclResult_t ncclPutSignal(const void *localbuff, size_t count, ncclDataType_t datatype, int peer,
                           ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx,
                           unsigned int flags, ncclComm_t comm, cudaStream_t stream) {
    (void)localbuff, (void)count, (void)datatype, (void)peer, (void)peerWin, (void)peerWinOffset;
    (void)sigIdx, (void)ctx, (void)flags, (void)comm, (void)stream;
    return unsupported("ncclPutSignal");
}
LB_ALIAS(ncclPutSignal)

ncclResult_t ncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm,
                        cudaStream_t stream) {
    (void)peer, (void)sigIdx, (void)ctx, (void)flags, (void)comm, (void)stream;
    return unsupported("ncclSignal");
}
LB_ALIAS(ncclSignal)

ncclResult_t ncclWaitSignal(int nDesc, ncclWaitSignalDesc_t *signalDescs, ncclComm_t comm,
                            cudaStream_t stream) {
    (void)nDesc, (void)signalDescs, (void)comm, (void)stream;
    return unsupported("ncclWaitSignal");
}
LB_ALIAS(ncclWaitSignal)
#endif

#if LB_AT_LEAST(2, 30, 3)
ncclResult_t ncclParamBind(ncclParamHandle_t *out, const char *key) {
    (void)key;
    if (out) *out = NULL;
    return unsupported("ncclParamBind");
}
LB_ALIAS(ncclParamBind)

#define LB_PARAM_GET(NAME, T)                        \
    ncclResult_t NAME(ncclParamHandle_t h, T *out) { \
        (void)h, (void)out;                          \
        return unsupported(#NAME);                   \
    }                                                \
    LB_ALIAS(NAME)

LB_PARAM_GET(ncclParamGetI8, int8_t)
LB_PARAM_GET(ncclParamGetI16, int16_t)
LB_PARAM_GET(ncclParamGetI32, int32_t)
LB_PARAM_GET(ncclParamGetI64, int64_t)
LB_PARAM_GET(ncclParamGetU8, uint8_t)
LB_PARAM_GET(ncclParamGetU16, uint16_t)
LB_PARAM_GET(ncclParamGetU32, uint32_t)
LB_PARAM_GET(ncclParamGetU64, uint64_t)
LB_PARAM_GET(ncclParamGetStr, const char *)

ncclResult_t ncclParamGet(ncclParamHandle_t h, void *out, int maxLen, int *len) {
    (void)h, (void)out, (void)maxLen;
    if (len) *len = 0;
    return unsupported("ncclParamGet");
}
LB_ALIAS(ncclParamGet)

ncclResult_t ncclParamGetParameter(const char *key, const char **value, int *valueLen) {
    (void)key;
    if (value) *value = NULL;
    if (valueLen) *valueLen = 0;
    return unsupported("ncclParamGetParameter");
}
LB_ALIAS(ncclParamGetParameter)

ncclResult_t ncclParamGetAllParameterKeys(const char ***table, int *tableLen) {
    if (table) *table = NULL;
    if (tableLen) *tableLen = 0;
    return unsupported("ncclParamGetAllParameterKeys");
}
LB_ALIAS(ncclParamGetAllParameterKeys)

void ncclParamDumpAll(void) {} /* nothing to dump */
LB_ALIAS(ncclParamDumpAll)
#endif

#if LB_AT_LEAST(2, 32, 3)
ncclResult_t ncclSetEncryption(const ncclEncryptionConfig_t *config) {
    (void)config;
    return unsupported("ncclSetEncryption");
}
LB_ALIAS(ncclSetEncryption)
#endif
