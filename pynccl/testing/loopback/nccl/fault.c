/*
 * Fault tolerance of the loopback libnccl: ncclCommRevoke (2.28), ncclCommShrink (2.27),
 * ncclCommGetUniqueId + ncclCommGrow (2.29), with nccl.h's semantics:
 *
 *   Revoke  stops the in-flight and queued operations of this rank's communicator (a
 *           hung one included: every wait checks the flag, like an abort) and waits
 *           until every one has left its stream; a non-blocking comm's async state reads
 *           ncclInProgress until then. From then on only ncclCommSplit, ncclCommShrink,
 *           ncclCommAbort and ncclCommDestroy may use it ("safe for destroy, split, and
 *           shrink"), without sharing resources.
 *   Shrink  makes a child of the ranks not excluded (at least one), renumbered in order,
 *           in a world of its own (so dead excluded ranks do not matter).
 *           NCCL_SHRINK_DEFAULT first waits for the parent's operations (a hung one keeps
 *           it waiting); NCCL_SHRINK_ABORT terminates them. The parent's teardown after
 *           an abortive shrink is teardown.c's business.
 *   Grow    the root takes a fresh id from ncclCommGetUniqueId and hands it to the new
 *           ranks; it posts the id in the parent's world, where the other existing ranks
 *           read it. Everyone then joins the id's world: existing ranks keep their
 *           numbers, new ranks take theirs from the caller.
 */
#include "internal.h"

#include <string.h>

#ifndef NCCL_SHRINK_ABORT
#define NCCL_SHRINK_DEFAULT 0x00
#define NCCL_SHRINK_ABORT 0x01
#endif
#ifndef NCCL_REVOKE_DEFAULT
#define NCCL_REVOKE_DEFAULT 0x00
#endif

LBN_UNUSED static const char k_not_ready[] =
    "%s : Attempt to use communicator before the previous operation returned ncclSuccess";

/* Stop the comm's operations (first reason wins) and wake its waits: they give up until
 * the comm is quiescent (NCCL sets the abort flags, then resets them). */
LBN_UNUSED static void stop_ops(struct lb_comm *c, int why) {
    int none = LB_STOP_NONE;
    __atomic_compare_exchange_n(&c->stopped, &none, why, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    __atomic_store_n(&c->cancel, 1, __ATOMIC_RELEASE);
    lb_comm_halt(c);
    if (c->w) lbw_notify(c);
}

#if LB_AT_LEAST(2, 28, 7)
ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags) {
    const char *opname = "ncclCommRevoke";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (revokeFlags != NCCL_REVOKE_DEFAULT)
        return lb_err(ncclInvalidArgument,
                      "%s : invalid revokeFlags %d (must be NCCL_REVOKE_DEFAULT, 0)", opname,
                      revokeFlags);
    if (__atomic_load_n(&c->state, __ATOMIC_ACQUIRE) == LBC_JOINING)
        return lb_err(ncclInvalidArgument, k_not_ready, opname);
    /* NCCL: no revoke once destroy/finalize or another revoke is under way */
    if (c->finalized || __atomic_load_n(&c->stopped, __ATOMIC_ACQUIRE) == LB_STOP_REVOKED)
        return lb_err(ncclInvalidArgument, "%s : communicator %p was already %s", opname,
                      (void *)comm, c->finalized ? "finalized" : "revoked");
    stop_ops(c, LB_STOP_REVOKED);
    c->finalize_called = 1; /* as NCCL's revoke: destroy then skips commDestroySync */
    lb_gjob_abort_wait(c); /* NCCL aborts a group job in flight (ncclGroupJobAbort) */
    if (!c->blocking) return ncclInProgress; /* ncclCommGetAsyncError says when it is quiet */
    /* Every issued operation has left its stream: queued ones end at once, and the one
     * in flight stops as its waits see the revoke. */
    lb_comm_drain(c);
    __atomic_store_n(&c->cancel, 0, __ATOMIC_RELEASE);
    return ncclSuccess;
}
LB_ALIAS(ncclCommRevoke)
#endif

#if LB_AT_LEAST(2, 27, 3)
ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                            ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags) {
    const char *opname = "ncclCommShrink";
    struct lb_comm *p;
    ncclResult_t r = lb_comm_get(comm, opname, &p);
    if (r != ncclSuccess) return lb_group_error(r);
    if (newcomm == NULL)
        return lb_group_error(lb_err(ncclInvalidArgument, "%s : newcomm argument is NULL", opname));
    *newcomm = NULL;
    if (shrinkFlags != NCCL_SHRINK_DEFAULT && shrinkFlags != NCCL_SHRINK_ABORT)
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : invalid shrinkFlags %d (NCCL_SHRINK_DEFAULT or "
                                     "NCCL_SHRINK_ABORT)",
                                     opname, shrinkFlags));
    const int R = p->nranks;
    if (excludeRanksList == NULL || excludeRanksCount <= 0) /* NCCL: PtrCheck, then count > 0 */
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : invalid excludeRanksCount %d with excludeRanksList "
                                     "%p: the exclusion list must name at least one rank",
                                     opname, excludeRanksCount, (void *)excludeRanksList));
    if (excludeRanksCount >= R)
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : invalid excludeRanksCount %d with excludeRanksList %p "
                                     "(the communicator has %d ranks)",
                                     opname, excludeRanksCount, (void *)excludeRanksList, R));
    int below = 0;
    uint64_t salt = lb_mix64(0x534852494e4bULL ^ (uint64_t)excludeRanksCount); /* "SHRINK" */
    for (int i = 0; i < excludeRanksCount; i++) {
        int x = excludeRanksList[i];
        if (x < 0 || x >= R)
            return lb_group_error(lb_err(ncclInvalidArgument,
                                         "%s : excludeRanksList[%d] = %d is not a rank of the "
                                         "communicator (0..%d)",
                                         opname, i, x, R - 1));
        for (int j = 0; j < i; j++)
            if (excludeRanksList[j] == x)
                return lb_group_error(lb_err(ncclInvalidArgument,
                                             "%s : rank %d appears twice in excludeRanksList",
                                             opname, x));
        if (x == p->rank)
            return lb_group_error(lb_err(ncclInvalidArgument,
                                         "%s : rank %d is in excludeRanksList: excluded ranks do "
                                         "not call ncclCommShrink",
                                         opname, x));
        below += x < p->rank;
        salt += lb_mix64((uint64_t)x + 1); /* the same whatever the list's order */
    }
    if (__atomic_load_n(&p->state, __ATOMIC_ACQUIRE) == LBC_JOINING || lb_comm_in_progress(p))
        return lb_group_error(lb_err(ncclInvalidArgument, k_not_ready, opname));
    if ((r = lb_fail_init_injected(opname)) != ncclSuccess) return lb_group_error(r);
    ncclConfig_t cfg;
    if (config) {
        if ((r = lb_parse_config(config, &cfg, opname)) != ncclSuccess) return lb_group_error(r);
    } else {
        lb_config_of(p, &cfg); /* NULL config: inherit the parent's */
    }
    int revoked = __atomic_load_n(&p->stopped, __ATOMIC_ACQUIRE) == LB_STOP_REVOKED;
    if (shrinkFlags == NCCL_SHRINK_ABORT) stop_ops(p, LB_STOP_SHRUNK);
    /* DEFAULT: the parent's operations finish first (a hung one keeps this waiting);
     * ABORT: they stop, then the abort flags are reset */
    lb_comm_drain(p);
    if (shrinkFlags == NCCL_SHRINK_ABORT) __atomic_store_n(&p->cancel, 0, __ATOMIC_RELEASE);
    unsigned char uid[NCCL_UNIQUE_ID_BYTES];
    lb_derive_uid(p->uid, lb_mix64(salt ^ ++p->nshrinks), uid);
    r = lb_comm_start(uid, R - excludeRanksCount, p->rank - below, p->dev, &cfg, opname,
                      newcomm);
    /* NCCL shares the parent's resources in default mode with shrinkShare, never once
     * revoked */
    if (*newcomm && shrinkFlags == NCCL_SHRINK_DEFAULT && p->shrink_share && !revoked)
        lb_comm_share_memory((*newcomm)->c, p);
    return r;
}
LB_ALIAS(ncclCommShrink)
#endif

#if LB_AT_LEAST(2, 29, 2)
ncclResult_t ncclCommGetUniqueId(ncclComm_t comm, ncclUniqueId *uniqueId) {
    const char *opname = "ncclCommGetUniqueId";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (uniqueId == NULL)
        return lb_err(ncclInvalidArgument, "%s : uniqueId argument is NULL", opname);
    if ((r = lb_comm_ensure_ready(c, opname)) != ncclSuccess) return r;
    if (c->grow_pending)
        return lb_err(ncclInvalidUsage,
                      "%s : the previous unique id of communicator %p was not consumed by "
                      "ncclCommGrow yet",
                      opname, (void *)comm);
    lb_make_uid(c->grow_uid);
    c->grow_pending = 1;
    memcpy(uniqueId->internal, c->grow_uid, NCCL_UNIQUE_ID_BYTES);
    return ncclSuccess;
}
LB_ALIAS(ncclCommGetUniqueId)

static int grow_posted(struct lb_comm *c, void *seq) {
    return __atomic_load_n(&c->w->grow_seq, __ATOMIC_ACQUIRE) >= *(const uint64_t *)seq;
}

ncclResult_t ncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId, int rank,
                          ncclComm_t *newcomm, ncclConfig_t *config) {
    const char *opname = "ncclCommGrow";
    if (newcomm == NULL)
        return lb_group_error(lb_err(ncclInvalidArgument, "%s : newcomm argument is NULL", opname));
    *newcomm = NULL;
    ncclResult_t r = lb_fail_init_injected(opname);
    if (r != ncclSuccess) return lb_group_error(r);
    ncclConfig_t cfg;
    if (comm == NULL) { /* a new rank */
        if (uniqueId == NULL)
            return lb_group_error(lb_err(ncclInvalidArgument,
                                         "%s : a new rank (comm NULL) needs the uniqueId of the "
                                         "grow",
                                         opname));
        const unsigned char *uid = (const unsigned char *)uniqueId->internal;
        if (!lb_uid_valid(uid))
            return lb_group_error(lb_err(ncclInvalidArgument,
                                         "%s : uniqueId was not produced by the loopback's "
                                         "ncclCommGetUniqueId",
                                         opname));
        if (nRanks < 1 || rank < 0 || rank >= nRanks)
            return lb_group_error(lb_err(ncclInvalidArgument,
                                         "%s : Invalid rank requested : %d/%d", opname, rank,
                                         nRanks));
        if ((r = lb_parse_config(config, &cfg, opname)) != ncclSuccess) return lb_group_error(r);
        return lb_comm_start(uid, nRanks, rank, pynccl_lb_current_device(), &cfg, opname, newcomm);
    }
    struct lb_comm *p;
    if ((r = lb_comm_get(comm, opname, &p)) != ncclSuccess) return lb_group_error(r);
    if ((r = lb_comm_ensure_ready(p, opname)) != ncclSuccess) return lb_group_error(r);
    if (rank != -1)
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : an existing rank passes rank -1 (it keeps its number "
                                     "%d), got %d",
                                     opname, p->rank, rank));
    if (nRanks <= p->nranks)
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : nRanks %d must exceed the communicator's %d ranks",
                                     opname, nRanks, p->nranks));
    if (config) {
        if ((r = lb_parse_config(config, &cfg, opname)) != ncclSuccess) return lb_group_error(r);
    } else {
        lb_config_of(p, &cfg);
    }
    unsigned char uid[NCCL_UNIQUE_ID_BYTES];
    uint64_t seq = p->ngrows + 1;
    if (uniqueId) { /* the root: post the id for the other existing ranks */
        if (!p->grow_pending || memcmp(uniqueId->internal, p->grow_uid, sizeof uid) != 0)
            return lb_group_error(lb_err(ncclInvalidUsage,
                                         "%s : uniqueId was not made by ncclCommGetUniqueId on "
                                         "this communicator, or was already consumed",
                                         opname));
        memcpy(uid, p->grow_uid, sizeof uid);
        memcpy(p->w->grow_uid, uid, sizeof uid);
        __atomic_store_n(&p->w->grow_seq, seq, __ATOMIC_RELEASE);
        lbw_notify(p);
        p->grow_pending = 0; /* consumed */
    } else {
        if ((r = lbw_wait_until(p, grow_posted, &seq, opname)) != ncclSuccess)
            return lb_group_error(r);
        memcpy(uid, p->w->grow_uid, sizeof uid);
    }
    p->ngrows = seq;
    return lb_comm_start(uid, nRanks, p->rank, p->dev, &cfg, opname, newcomm);
}
LB_ALIAS(ncclCommGrow)
#endif
