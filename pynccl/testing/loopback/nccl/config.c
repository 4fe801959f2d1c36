/*
 * ncclConfig_t of the loopback libnccl: defaults, per-release parsing and
 * validation, and a communicator's copy of it.
 */
#include "internal.h"

#include <string.h>

/* ---- ncclConfig_t ---------------------------------------------------------------------
 * NCCL's parseCommConfig, per release: copy min(size, sizeof in this release) over the
 * defaults, check the magic, reset the fields newer than config->version, validate,
 * apply NCCL_COMM_BLOCKING. */

#if LB_AT_LEAST(2, 32, 0)
#define LB_CONFIG_SIZE sizeof(ncclConfig_t)
#elif LB_AT_LEAST(2, 31, 0)
#define LB_CONFIG_SIZE offsetof(ncclConfig_t, nvlsHostMode)
#elif LB_AT_LEAST(2, 30, 3)
#define LB_CONFIG_SIZE offsetof(ncclConfig_t, launchOrderImplicit)
#elif LB_AT_LEAST(2, 29, 0)
#define LB_CONFIG_SIZE offsetof(ncclConfig_t, maxP2pPeers)
#elif LB_AT_LEAST(2, 28, 0)
#define LB_CONFIG_SIZE offsetof(ncclConfig_t, graphUsageMode)
#elif LB_AT_LEAST(2, 27, 0)
#define LB_CONFIG_SIZE offsetof(ncclConfig_t, nChannelsPerNetPeer)
#elif LB_AT_LEAST(2, 18, 0)
#define LB_CONFIG_SIZE offsetof(ncclConfig_t, commName)
#elif LB_AT_LEAST(2, 17, 0)
#define LB_CONFIG_SIZE offsetof(ncclConfig_t, splitShare)
#else
#define LB_CONFIG_SIZE offsetof(ncclConfig_t, cgaClusterSize)
#endif

#define U NCCL_CONFIG_UNDEF_INT

static void config_defaults(ncclConfig_t *d) {
    memset(d, 0, sizeof *d);
    d->size = LB_CONFIG_SIZE;
    d->magic = NCCL_API_MAGIC;
    d->version = LB_NCCL_VERSION_CODE;
    d->blocking = d->cgaClusterSize = d->minCTAs = d->maxCTAs = U;
    d->netName = NULL;
    d->splitShare = d->trafficClass = U;
    d->commName = NULL;
    d->collnetEnable = d->CTAPolicy = d->shrinkShare = d->nvlsCTAs = U;
    d->nChannelsPerNetPeer = d->nvlinkCentricSched = d->graphUsageMode = d->numRmaCtx = U;
    d->maxP2pPeers = d->graphStreamOrdering = U;
    d->launchOrderImplicit = d->numRmaSig = d->rmaEagerInit = d->hostCftMode = U;
    d->nvlsHostMode = U;
}

/* Fields newer than `version` (or than this release) go back to their defaults. */
static void config_reset_newer(ncclConfig_t *c, unsigned version, const ncclConfig_t *d) {
#define OLDER(x, y, z) (version < (unsigned)LB_V(x, y, z))
    if (OLDER(2, 14, 0)) c->blocking = d->blocking;
    if (OLDER(2, 17, 0)) {
        c->cgaClusterSize = d->cgaClusterSize;
        c->minCTAs = d->minCTAs;
        c->maxCTAs = d->maxCTAs;
        c->netName = d->netName;
    }
    if (!LB_AT_LEAST(2, 27, 0)) return; /* 2.18-2.26 only checked up to 2.17 */
    if (OLDER(2, 25, 0)) c->trafficClass = d->trafficClass;
    if (OLDER(2, 27, 0)) {
        c->collnetEnable = d->collnetEnable;
        c->CTAPolicy = d->CTAPolicy;
        c->shrinkShare = d->shrinkShare;
        c->nvlsCTAs = d->nvlsCTAs;
    }
    if (OLDER(2, 28, 0)) {
        c->nChannelsPerNetPeer = d->nChannelsPerNetPeer;
        c->nvlinkCentricSched = d->nvlinkCentricSched;
    }
    if (OLDER(2, 29, 0)) {
        c->graphUsageMode = d->graphUsageMode;
        c->numRmaCtx = d->numRmaCtx;
    }
    if (OLDER(2, 30, 0)) c->maxP2pPeers = d->maxP2pPeers;
    if (OLDER(2, 30, 5)) c->graphStreamOrdering = d->graphStreamOrdering;
    if (OLDER(2, 31, 0)) {
        c->launchOrderImplicit = d->launchOrderImplicit;
        c->numRmaSig = d->numRmaSig;
        c->rmaEagerInit = d->rmaEagerInit;
        c->hostCftMode = d->hostCftMode;
        c->nvlsHostMode = d->nvlsHostMode;
    }
#undef OLDER
}

/* Fields this release does not have are ignored (they lie past its sizeof, or in
 * padding that later releases filled). */
static void config_drop_unknown(ncclConfig_t *c, const ncclConfig_t *d) {
#if !LB_AT_LEAST(2, 26, 0)
    c->trafficClass = d->trafficClass;
#endif
#if !LB_AT_LEAST(2, 30, 7)
    c->graphStreamOrdering = d->graphStreamOrdering;
#endif
    (void)c;
    (void)d;
}

#define BAD_IF(cond, field)                                                                  \
    do {                                                                                     \
        if (cond)                                                                            \
            return lb_err(ncclInvalidArgument, "%s : Invalid config " #field                 \
                          " attribute value %d", opname, c->field);                          \
    } while (0)

static ncclResult_t config_validate(const ncclConfig_t *c, const char *opname) {
    BAD_IF(c->blocking != U && c->blocking != 0 && c->blocking != 1, blocking);
    BAD_IF(c->cgaClusterSize != U && c->cgaClusterSize < 0, cgaClusterSize);
    BAD_IF(c->minCTAs != U && c->minCTAs <= 0, minCTAs);
    BAD_IF(c->maxCTAs != U && c->maxCTAs <= 0, maxCTAs);
    BAD_IF(c->minCTAs != U && c->maxCTAs != U && c->minCTAs > c->maxCTAs, minCTAs);
#if LB_AT_LEAST(2, 18, 0)
    BAD_IF(c->splitShare != U && c->splitShare != 0 && c->splitShare != 1, splitShare);
#endif
#if LB_AT_LEAST(2, 27, 0)
    BAD_IF(c->collnetEnable != U && (c->collnetEnable < 0 || c->collnetEnable > 1), collnetEnable);
    BAD_IF(c->CTAPolicy != U && (c->CTAPolicy & ~3), CTAPolicy);
    BAD_IF(c->shrinkShare != U && c->shrinkShare != 0 && c->shrinkShare != 1, shrinkShare);
    BAD_IF(c->nvlsCTAs != U && c->nvlsCTAs <= 0, nvlsCTAs);
#endif
#if LB_AT_LEAST(2, 28, 0)
    BAD_IF(c->nChannelsPerNetPeer != U && (c->nChannelsPerNetPeer <= 0 || c->nChannelsPerNetPeer > 64),
           nChannelsPerNetPeer);
    BAD_IF(c->nvlinkCentricSched != U && c->nvlinkCentricSched != 0 && c->nvlinkCentricSched != 1,
           nvlinkCentricSched);
#endif
#if LB_AT_LEAST(2, 29, 0)
    BAD_IF(c->graphUsageMode != U && (c->graphUsageMode < 0 || c->graphUsageMode > 2),
           graphUsageMode);
    BAD_IF(c->numRmaCtx != U && c->numRmaCtx < 0, numRmaCtx);
#endif
#if LB_AT_LEAST(2, 30, 3)
    BAD_IF(c->maxP2pPeers != U && c->maxP2pPeers <= 0, maxP2pPeers);
#endif
#if LB_AT_LEAST(2, 30, 7)
    BAD_IF(c->graphStreamOrdering != U && c->graphStreamOrdering != 0 && c->graphStreamOrdering != 1,
           graphStreamOrdering);
#endif
    return ncclSuccess;
}
#undef BAD_IF

/* out: the effective config (blocking resolved to 0/1). */
ncclResult_t lb_parse_config(const ncclConfig_t *user, ncclConfig_t *out, const char *opname) {
    ncclConfig_t d;
    config_defaults(&d);
    *out = d;
    if (user) {
        size_t real;
        memcpy(&real, &user->size, sizeof real);
        if (real > LB_CONFIG_SIZE) real = LB_CONFIG_SIZE;
        memcpy(out, user, real);
        if (out->magic != NCCL_API_MAGIC)
            return lb_err(ncclInvalidArgument,
                          "%s : ncclConfig_t argument not initialized via NCCL_CONFIG_INITIALIZER "
                          "(magic 0x%x)",
                          opname, out->magic);
        config_drop_unknown(out, &d);
        config_reset_newer(out, out->version, &d);
    }
    ncclResult_t r = config_validate(out, opname);
    if (r != ncclSuccess) return r;
    long long env_blocking = lb_env_ll("NCCL_COMM_BLOCKING", U);
    if (env_blocking == 0 || env_blocking == 1) out->blocking = (int)env_blocking;
    if (out->blocking == U) out->blocking = 1;
#if !LB_HAS_IN_PROGRESS
    out->blocking = 1;
#endif
    if (out->splitShare == U) out->splitShare = 0;
    if (out->shrinkShare == U) out->shrinkShare = 0;
    return ncclSuccess;
}
#undef U

void lb_apply_config(struct lb_comm *c, const ncclConfig_t *cfg) {
    c->blocking = cfg->blocking;
    c->split_share = cfg->splitShare;
    c->shrink_share = cfg->shrinkShare;
    c->comm_name = cfg->commName;
}

void lb_config_of(const struct lb_comm *c, ncclConfig_t *cfg) {
    config_defaults(cfg);
    cfg->blocking = c->blocking;
    cfg->splitShare = c->split_share;
    cfg->shrinkShare = c->shrink_share;
    cfg->commName = c->comm_name;
#if LB_AT_LEAST(2, 29, 0)
    cfg->numRmaCtx = c->rma_ctx;
#endif
#if LB_AT_LEAST(2, 31, 0)
    cfg->numRmaSig = c->rma_sig;
#endif
}
