/*
 * Communicator creation API of the loopback libnccl: ncclCommInitRank*, ncclCommInitAll,
 * ncclCommSplit, and the queries (ncclCommGetAsyncError, Count, CuDevice, UserRank).
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

/* The world of a ncclCommInitRankScalable with nId > 1 ids: NCCL splits the ranks into nId
 * groups, each bootstrapped by the root that made its id, the roots linked in a ring; the
 * loopback's one world is named from every id in order, so that a rank passing other ids
 * (or another nId) meets no one, as it would reach a root of its own in NCCL, and waits
 * (PYNCCL_LOOPBACK_INIT_TIMEOUT names who never came). One id names the world itself. */
static void world_uid(const unsigned char *ids, int nid, unsigned char *out) {
    memcpy(out, ids, NCCL_UNIQUE_ID_BYTES);
    if (nid == 1) return;
    uint64_t h = 0xcbf29ce484222325ULL ^ (uint64_t)(uint32_t)nid;
    for (size_t i = 0; i < (size_t)nid * NCCL_UNIQUE_ID_BYTES; i++) h = (h ^ ids[i]) * 0x100000001b3ULL;
    lb_derive_uid(ids, h, out);
}

static ncclResult_t init_rank(ncclComm_t *newcomm, int nranks, const unsigned char *ids, int nid,
                              int rank, const ncclConfig_t *config, const char *opname) {
    if (newcomm == NULL) return lb_err(ncclInvalidArgument, "%s : newcomm argument is NULL", opname);
    *newcomm = NULL;
    ncclResult_t r = lb_fail_init_injected(opname);
    if (r != ncclSuccess) return lb_group_error(r);
    if (nid > 1 && nid > nranks) /* NCCL: up to one id per rank */
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : improper usage of ncclCommInitRank: nId = %d, nranks=%d",
                                     opname, nid, nranks));
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return lb_group_error(
            lb_err(ncclInvalidArgument, "%s : Invalid rank requested : %d/%d", opname, rank, nranks));
    for (int i = 0; i < nid; i++) {
        if (lb_uid_valid(ids + (size_t)i * NCCL_UNIQUE_ID_BYTES)) continue;
        if (nid == 1)
            return lb_group_error(lb_err(
                ncclInvalidArgument,
                "%s : commId was not produced by the loopback's ncclGetUniqueId", opname));
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : commIds[%d] was not produced by the loopback's "
                                     "ncclGetUniqueId",
                                     opname, i));
    }
    ncclConfig_t cfg;
    r = lb_parse_config(config, &cfg, opname);
    if (r != ncclSuccess) return lb_group_error(r);
    unsigned char uid[NCCL_UNIQUE_ID_BYTES];
    world_uid(ids, nid, uid);
    return lb_comm_start(uid, nranks, rank, pynccl_lb_current_device(), &cfg, opname, newcomm);
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    return init_rank(comm, nranks, (const unsigned char *)commId.internal, 1, rank, NULL,
                     "ncclCommInitRank");
}
LB_ALIAS(ncclCommInitRank)

#if LB_AT_LEAST(2, 14, 3)
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
    return init_rank(comm, nranks, (const unsigned char *)commId.internal, 1, rank, config,
                     "ncclCommInitRankConfig");
}
LB_ALIAS(ncclCommInitRankConfig)
#endif

#if LB_AT_LEAST(2, 23, 4)
ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                      ncclUniqueId *commIds, ncclConfig_t *config) {
    const char *opname = "ncclCommInitRankScalable";
    if (nId < 1 || commIds == NULL) {
        if (newcomm) *newcomm = NULL;
        return lb_err(ncclInvalidArgument, "%s : invalid nId %d or commIds %p", opname, nId,
                      (void *)commIds);
    }
    /* every rank passes the same ids in the same order: all of them name the world */
    return init_rank(newcomm, nranks, (const unsigned char *)commIds, nId, myrank, config, opname);
}
LB_ALIAS(ncclCommInitRankScalable)
#endif

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    const char *opname = "ncclCommInitAll";
    if (comms == NULL) return lb_err(ncclInvalidArgument, "%s : comms argument is NULL", opname);
    if (ndev < 1) return lb_err(ncclInvalidArgument, "%s : invalid ndev %d", opname, ndev);
    ncclResult_t r = lb_fail_init_injected(opname);
    if (r != ncclSuccess) return r;
    int ndevices = pynccl_lb_device_count();
    for (int i = 0; i < ndev; i++) {
        int d = devlist ? devlist[i] : i;
        if (d < 0 || d >= ndevices)
            return lb_err(ncclInvalidArgument, "%s : invalid device %d at devlist[%d] (%d devices)",
                          opname, d, i, ndevices);
        for (int j = 0; j < i; j++)
            if ((devlist ? devlist[j] : j) == d)
                return lb_err(ncclInvalidUsage, "%s : duplicate device %d in devlist", opname, d);
    }
    unsigned char uid[NCCL_UNIQUE_ID_BYTES];
    lb_make_uid(uid);
    ncclConfig_t cfg;
    lb_parse_config(NULL, &cfg, opname);
    cfg.blocking = 1;
    struct lb_comm **cs = calloc((size_t)ndev, sizeof *cs);
    if (!cs) return lb_err(ncclSystemError, "%s : out of memory", opname);
    for (int i = 0; i < ndev && r == ncclSuccess; i++)
        r = lb_comm_create(uid, ndev, i, devlist ? devlist[i] : i, &cfg, opname, &cs[i]);
    for (int i = 0; i < ndev && r == ncclSuccess; i++) r = lb_comm_progress(cs[i], 1);
    for (int i = 0; i < ndev; i++) {
        if (r == ncclSuccess) {
            comms[i] = cs[i]->handle;
        } else {
            comms[i] = NULL;
            if (cs[i]) lb_comm_abandon(cs[i]);
        }
    }
    free(cs);
    return r;
}
LB_ALIAS(ncclCommInitAll)

#if LB_AT_LEAST(2, 18, 1)
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
    const char *opname = "ncclCommSplit";
    struct lb_comm *p;
    ncclResult_t r = lb_comm_get(comm, opname, &p);
    if (r != ncclSuccess) return lb_group_error(r);
    if (newcomm == NULL)
        return lb_group_error(lb_err(ncclInvalidArgument, "%s : newcomm argument is NULL", opname));
    r = lb_comm_ensure_ready_revoked(p, opname); /* revoked: "safe for ... split" */
    if (r != ncclSuccess) return lb_group_error(r);
    *newcomm = NULL;
    if (color < 0 && color != NCCL_SPLIT_NOCOLOR)
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : invalid color %d (a color is >= 0, or "
                                     "NCCL_SPLIT_NOCOLOR)",
                                     opname, color));
    r = lb_fail_init_injected(opname);
    if (r != ncclSuccess) return lb_group_error(r);
    struct lb_split *s = calloc(1, sizeof *s);
    if (!s) return lb_group_error(lb_err(ncclSystemError, "%s : out of memory", opname));
    if (config) {
        r = lb_parse_config(config, &s->config, opname);
        if (r != ncclSuccess) {
            free(s);
            return lb_group_error(r);
        }
    } else {
        lb_config_of(p, &s->config); /* NULL config: inherit the parent's */
    }
    int in_group = lb_group_depth() > 0;
    if (in_group && (r = lb_group_join_mode(p->blocking, opname)) != ncclSuccess) {
        free(s);
        return r;
    }
    lb_comm_ref(p);
    s->parent = p;
    s->seq = ++p->nsplits;
    s->color = color;
    s->key = key;
    s->out = newcomm;
    r = lbw_split_post(p, s->seq, color, key);
    if (r != ncclSuccess) {
        lb_split_free(s);
        return lb_group_error(r);
    }
    if (in_group) {
        r = lb_group_defer_split(s);
        if (r != ncclSuccess) return r;
        return p->blocking ? ncclSuccess : ncclInProgress;
    }
    if (!p->blocking) {
        lb_split_defer(s); /* *newcomm is written by a later poll */
        return ncclInProgress;
    }
    r = lb_split_progress(s, 1);
    lb_split_free(s);
    return r;
}
LB_ALIAS(ncclCommSplit)
#endif

/* ---- queries --------------------------------------------------------------------------- */

#if LB_AT_LEAST(2, 4, 2)
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, "ncclGetAsyncError", &c);
    if (r != ncclSuccess) return r;
    if (asyncError == NULL)
        return lb_err(ncclInvalidArgument, "ncclGetAsyncError : asyncError argument is NULL");
    lb_splits_progress_all();
    int st = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
    if (st == LBC_JOINING) {
        *asyncError = lb_comm_progress(c, 0);
        return ncclSuccess;
    }
    if (__atomic_load_n(&c->stopped, __ATOMIC_ACQUIRE) == LB_STOP_REVOKED) {
        *asyncError = lb_comm_revoke_state(c);
        return ncclSuccess;
    }
    int a = __atomic_load_n(&c->async, __ATOMIC_ACQUIRE);
    if (a == ncclSuccess && lb_gjob_pending(c)) { /* a non-blocking group end or finalize */
        int poison = __atomic_load_n(&c->poison, __ATOMIC_ACQUIRE);
        *asyncError = poison ? (ncclResult_t)poison : ncclInProgress;
        lb_gjob_polled(c); /* after the read: this poll's answer is the in-progress one */
        return ncclSuccess;
    }
    if (a == ncclSuccess && __atomic_load_n(&c->nb_pending, __ATOMIC_ACQUIRE)) {
        *asyncError = ncclInProgress;
        return ncclSuccess;
    }
    if (a == ncclSuccess && st == LBC_READY && c->w) {
        ncclResult_t b = lbw_broken(c);
        if (b != ncclSuccess) {
            lb_comm_fail(c, b, NULL);
            a = b;
        }
    }
    *asyncError = (ncclResult_t)a;
    return ncclSuccess;
}
LB_ALIAS(ncclCommGetAsyncError)
#endif

static ncclResult_t query(ncclComm_t comm, int *out, const char *opname, const char *argname,
                          struct lb_comm **cp) {
    ncclResult_t r = lb_comm_get(comm, opname, cp);
    if (r != ncclSuccess) return r;
    if (out == NULL) return lb_err(ncclInvalidArgument, "%s : %s argument is NULL", opname, argname);
    int st = __atomic_load_n(&(*cp)->state, __ATOMIC_ACQUIRE);
    if (st == LBC_JOINING || lb_gjob_pending(*cp))
        return lb_err(ncclInvalidArgument,
                      "%s : Attempt to use communicator before the previous operation returned "
                      "ncclSuccess",
                      opname);
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    struct lb_comm *c;
    ncclResult_t r = query(comm, count, "CommCount", "count", &c);
    if (r == ncclSuccess) *count = c->nranks;
    return r;
}
LB_ALIAS(ncclCommCount)

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    struct lb_comm *c;
    ncclResult_t r = query(comm, device, "CommCuDevice", "device", &c);
    if (r == ncclSuccess) *device = c->dev;
    return r;
}
LB_ALIAS(ncclCommCuDevice)

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    struct lb_comm *c;
    ncclResult_t r = query(comm, rank, "CommUserRank", "rank", &c);
    if (r == ncclSuccess) *rank = c->rank;
    return r;
}
LB_ALIAS(ncclCommUserRank)
