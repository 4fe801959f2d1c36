/*
 * The part of nccl.h 2.32.3 the loopback does not implement yet: shrink/grow/revoke,
 * suspend/resume and memory statistics. The symbols exist (with nccl.h's exact
 * prototypes, from the release that introduced each) so that bindings resolve them; each call returns
 * ncclInvalidUsage and says so in ncclGetLastError.
 */
#include "nccl_lb_internal.h"

LBN_UNUSED static ncclResult_t unsupported(const char *fn) {
    return lb_err(ncclInvalidUsage, "%s is not implemented by the pynccl loopback libnccl", fn);
}

#if LB_AT_LEAST(2, 27, 3)
ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                            ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags) {
    (void)comm, (void)excludeRanksList, (void)excludeRanksCount, (void)config, (void)shrinkFlags;
    if (newcomm) *newcomm = NULL;
    return unsupported("ncclCommShrink");
}
LB_ALIAS(ncclCommShrink)
#endif

#if LB_AT_LEAST(2, 28, 7)
ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags) {
    (void)comm, (void)revokeFlags;
    return unsupported("ncclCommRevoke");
}
LB_ALIAS(ncclCommRevoke)
#endif

#if LB_AT_LEAST(2, 29, 2)
ncclResult_t ncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId, int rank,
                          ncclComm_t *newcomm, ncclConfig_t *config) {
    (void)comm, (void)nRanks, (void)uniqueId, (void)rank, (void)config;
    if (newcomm) *newcomm = NULL;
    return unsupported("ncclCommGrow");
}
LB_ALIAS(ncclCommGrow)
#endif

#if LB_AT_LEAST(2, 29, 7)
ncclResult_t ncclCommSuspend(ncclComm_t comm, int flags) {
    (void)comm, (void)flags;
    return unsupported("ncclCommSuspend");
}
LB_ALIAS(ncclCommSuspend)

ncclResult_t ncclCommResume(ncclComm_t comm) {
    (void)comm;
    return unsupported("ncclCommResume");
}
LB_ALIAS(ncclCommResume)

ncclResult_t ncclCommMemStats(ncclComm_t comm, ncclCommMemStat_t stat, uint64_t *value) {
    (void)comm, (void)stat;
    if (value) *value = 0;
    return unsupported("ncclCommMemStats");
}
LB_ALIAS(ncclCommMemStats)
#endif
