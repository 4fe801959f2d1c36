/*
 * Tearing a communicator down in the loopback libnccl: ncclCommFinalize, ncclCommDestroy
 * and ncclCommAbort, waiting for what NCCL's commDestroySync (src/init.cc) waits for:
 *
 *   - every operation the communicator issued (NCCL synchronizes its device stream,
 *     which follows the launches): a collective whose peer never comes keeps finalize
 *     and destroy waiting, until an abort (here or on a peer) stops it;
 *   - every CUDA graph that captured the communicator (localPersistentRefs): destroy and
 *     abort alike poll until those graphs are destroyed;
 *   - from NCCL 2.31.2 on, an untimed barrier of the ranks, which ncclCommAbort skips
 *     (pytorch/pytorch#194679). The loopback runs it where that bites: after
 *     ncclCommShrink(NCCL_SHRINK_ABORT), whose excluded ranks abort the parent and never
 *     arrive, so the survivors' finalize or destroy of the parent never returns. Every
 *     rank's non-abort teardown marks its arrival.
 *
 * commDestroySync runs once: in ncclCommFinalize, else in destroy or abort (the abort
 * flag set: the work stops at once and there is no barrier); never after ncclCommRevoke,
 * which does its own waiting. A non-blocking communicator finalizes on a worker thread
 * (gjob.c) and reads ncclInProgress meanwhile. Destroy, like every call, is refused with
 * ncclInvalidArgument while the communicator is in progress (ncclCommEnsureReady).
 */
#include "internal.h"

int lb_comm_in_progress(struct lb_comm *c) {
    if (lb_gjob_pending(c) || __atomic_load_n(&c->nb_pending, __ATOMIC_ACQUIRE)) return 1;
#if LB_HAS_IN_PROGRESS
    if (__atomic_load_n(&c->stopped, __ATOMIC_ACQUIRE) == LB_STOP_REVOKED && !c->blocking &&
        !lb_comm_quiescent(c))
        return 1;
#endif
    return 0;
}

void lb_comm_drain(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    while (c->retired < c->issued || c->running) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

/* Until the running task (if any) has seen the abort: queued ones then do nothing. */
static void wait_running(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    while (c->running) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static void wait_graphs(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    while (c->graph_refs > 0) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static void teardown_barrier(struct lb_comm *c) {
#if LB_AT_LEAST(2, 31, 2)
    if (!c->w || __atomic_load_n(&c->state, __ATOMIC_ACQUIRE) != LBC_READY) return;
    __atomic_store_n(&c->ranks[c->rank].teardown, 1, __ATOMIC_RELEASE);
    lbw_notify(c);
    if (__atomic_load_n(&c->stopped, __ATOMIC_ACQUIRE) != LB_STOP_SHRUNK) return;
    /* No abort, broken-world or dead-peer check: NCCL's barrier is untimed. */
    lb_set_error("rank %d: ncclCommDestroy waits in NCCL 2.31.2's teardown barrier for every "
                 "rank of the communicator; ranks excluded by ncclCommShrink(NCCL_SHRINK_ABORT) "
                 "never arrive (release a parent shrunk that way with ncclCommAbort)",
                 c->rank);
    int spins = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        int s = 0;
        while (s < c->nranks && __atomic_load_n(&c->ranks[s].teardown, __ATOMIC_ACQUIRE)) s++;
        if (s == c->nranks) return;
        lbw_backoff(c, e, &spins);
    }
#else
    (void)c;
#endif
}

void lb_comm_finalize_sync(struct lb_comm *c) {
    lb_comm_drain(c);
    wait_graphs(c);
    teardown_barrier(c);
}

static ncclResult_t finalize_job(void *arg) {
    lb_comm_finalize_sync(arg);
    return ncclSuccess;
}

static const char k_in_progress[] =
    "%s : Attempt to use communicator before the previous operation returned ncclSuccess";

#if LB_AT_LEAST(2, 14, 3)
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    const char *opname = "ncclCommFinalize";
    if (comm == NULL) return ncclSuccess;
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (c->finalized)
        return lb_err(ncclInvalidArgument, "%s : comm %p was already finalized", opname,
                      (void *)comm);
    if (__atomic_load_n(&c->stopped, __ATOMIC_ACQUIRE) == LB_STOP_REVOKED)
        return lb_err(ncclInvalidUsage,
                      "%s : comm %p was revoked: only ncclCommSplit, ncclCommShrink, "
                      "ncclCommAbort and ncclCommDestroy may follow ncclCommRevoke",
                      opname, (void *)comm);
    if (__atomic_load_n(&c->state, __ATOMIC_ACQUIRE) == LBC_JOINING || lb_comm_in_progress(c))
        return lb_err(ncclInvalidArgument, k_in_progress, opname);
    c->finalized = c->finalize_called = 1;
    if (!c->blocking) return lb_gjob_start(&c, 1, finalize_job, c); /* in progress till done */
    lb_comm_ref(c); /* an abort from another thread may tear it down meanwhile */
    lb_comm_finalize_sync(c);
    lb_comm_unref(c);
    return ncclSuccess;
}
LB_ALIAS(ncclCommFinalize)
#endif

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    const char *opname = "ncclCommDestroy";
    if (comm == NULL) return ncclSuccess;
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (lb_comm_in_progress(c)) return lb_err(ncclInvalidArgument, k_in_progress, opname);
    lb_comm_ref(c);
    if (!c->finalize_called) { /* the implicit finalize (commReclaim -> commDestroySync) */
        c->finalize_called = 1;
        lb_comm_finalize_sync(c);
    }
    int failed = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE) != LBC_READY;
    lb_comm_teardown(c, failed ? LBR_FAILED : LBR_LEFT);
    lb_comm_unref(c);
    return ncclSuccess;
}
LB_ALIAS(ncclCommDestroy)

#if LB_AT_LEAST(2, 4, 2)
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm == NULL) return ncclSuccess;
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, "ncclCommAbort", &c);
    if (r != ncclSuccess) return r;
    lb_comm_ref(c);
    __atomic_store_n(&c->aborted, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&c->cancel, 1, __ATOMIC_RELEASE);
    lb_comm_halt(c);
    if (c->w) /* tell the other ranks; keep this process's last error */
        lbw_break(c, LB_HAS_REMOTE_ERROR ? ncclRemoteError : ncclSystemError, 0,
                  "rank %d called ncclCommAbort", c->rank);
    lb_gjob_abort_wait(c);
    wait_running(c); /* running tasks see the abort within a sleep period */
    if (!c->finalize_called) wait_graphs(c); /* commReclaim -> commDestroySync, abort too */
    lb_comm_teardown(c, LBR_FAILED);
    lb_comm_unref(c);
    return ncclSuccess;
}
LB_ALIAS(ncclCommAbort)
#endif
