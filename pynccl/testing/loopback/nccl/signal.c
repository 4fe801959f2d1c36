/*
 * One-sided operations of the loopback libnccl: ncclPutSignal, ncclSignal, ncclWaitSignal.
 *
 * Signal counts live in the communicator's world (uint64 per receiver, context, signal
 * index and sender; sized from numRmaCtx / numRmaSig at init, which every rank must
 * agree on). A put copies into the peer's window through this process's view of it
 * (window.c), then adds one to the peer's count; a wait consumes its descriptors'
 * counts: each wait reserves opCnt more signals per (peer, signal, context) when it runs
 * and blocks its stream until they have arrived.
 *
 * The operations are stream tasks of their own (no ticket in the communicator's
 * collective order: they only touch their windows and counts), captured into CUDA
 * graphs like collectives: a capture keeps a template, each launch runs a copy.
 */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LB_WIN_SYMMETRIC 0x01

#if LB_AT_LEAST(2, 29, 2)

/* ---- tasks ------------------------------------------------------------------------------ */

enum { LBS_PUT, LBS_SIGNAL, LBS_WAIT };

struct lb_sigtask {
    struct lb_comm *c; /* ref held */
    int kind;
    int tmpl; /* a CUDA graph's copy (counted in the comm's graph_refs), never run */
    int peer, sig, ctx;
    const void *src;
    size_t bytes, off;
    ncclWindow_t win;
    int n;
    ncclWaitSignalDesc_t d[];
};

/* Index of (receiver, ctx, sig, sender) in the world's counts. */
static size_t sig_index(const struct lb_comm *c, int recv, int ctx, int sig, int send) {
    return (((size_t)recv * (size_t)c->rma_ctx + (size_t)ctx) * (size_t)c->rma_sig + (size_t)sig) *
               (size_t)c->nranks +
           (size_t)send;
}

struct wait_arg {
    const struct lb_sigtask *t;
    const uint64_t *target;
};

static int waits_done(struct lb_comm *c, void *arg, int *blocker) {
    const struct wait_arg *a = arg;
    if (__atomic_load_n(&c->halt, __ATOMIC_ACQUIRE)) return 1;
    for (int i = 0; i < a->t->n; i++) {
        const ncclWaitSignalDesc_t *d = &a->t->d[i];
        size_t k = sig_index(c, c->rank, d->ctx, d->sigIdx, d->peer);
        if (__atomic_load_n(&c->sig[k], __ATOMIC_ACQUIRE) < a->target[i]) {
            *blocker = d->peer;
            return 0;
        }
    }
    return 1;
}

static ncclResult_t exec_wait(struct lb_comm *c, const struct lb_sigtask *t) {
    uint64_t small[8], *target = t->n <= 8 ? small : malloc((size_t)t->n * sizeof *target);
    if (!target) return lb_err(ncclSystemError, "rank %d: ncclWaitSignal : out of memory", c->rank);
    for (int i = 0; i < t->n; i++) {
        const ncclWaitSignalDesc_t *d = &t->d[i];
        size_t k = ((size_t)d->ctx * (size_t)c->rma_sig + (size_t)d->sigIdx) * (size_t)c->nranks +
                   (size_t)d->peer;
        target[i] = __atomic_add_fetch(&c->sig_waited[k], (uint64_t)d->opCnt, __ATOMIC_SEQ_CST);
    }
    struct wait_arg a = {t, target};
    ncclResult_t r = lbw_wait_for(c, waits_done, &a, "ncclWaitSignal");
    if (target != small) free(target);
    return r;
}

static ncclResult_t exec_put(struct lb_comm *c, const struct lb_sigtask *t) {
    if (t->kind == LBS_PUT && t->bytes) {
        void *base = NULL;
        size_t size = 0;
        pthread_mutex_lock(&c->mu); /* the window stays mapped while we copy */
        int live = lb_win_lookup(c, t->win, NULL, &size, t->peer, &base);
        if (live && base && t->off <= size && t->bytes <= size - t->off) /* to self: may overlap */
            memmove((char *)base + t->off, t->src, t->bytes);
        pthread_mutex_unlock(&c->mu);
        if (!live || !base)
            return lb_err(ncclInvalidUsage,
                          "rank %d: ncclPutSignal : window %p was deregistered before the put ran",
                          c->rank, (void *)t->win);
    }
    __atomic_add_fetch(&c->sig[sig_index(c, t->peer, t->ctx, t->sig, c->rank)], 1, __ATOMIC_SEQ_CST);
    lbw_notify(c);
    return ncclSuccess;
}

static void sig_run(void *arg) {
    struct lb_sigtask *t = arg;
    struct lb_comm *c = t->c;
    pthread_mutex_lock(&c->mu);
    int halted = __atomic_load_n(&c->halt, __ATOMIC_ACQUIRE);
    if (!halted) c->rma_running++;
    pthread_mutex_unlock(&c->mu);
    if (halted) return;
    ncclResult_t r = t->kind == LBS_WAIT ? exec_wait(c, t) : exec_put(c, t);
    if (r != ncclSuccess) lb_comm_fail(c, r, NULL);
    pthread_mutex_lock(&c->mu);
    c->rma_running--;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void graph_ref(struct lb_comm *c, int delta) {
    pthread_mutex_lock(&c->mu);
    c->graph_refs += delta;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void sig_release(void *arg) {
    struct lb_sigtask *t = arg;
    if (t->tmpl) graph_ref(t->c, -1);
    lb_comm_unref(t->c);
    free(t);
}

static size_t task_size(const struct lb_sigtask *t) {
    return sizeof *t + (size_t)t->n * sizeof t->d[0];
}

static void *sig_clone(void *arg, int launch) {
    /* no per-run resources: a wait reserves its counts when it runs */
    const struct lb_sigtask *t = arg;
    struct lb_sigtask *copy = malloc(task_size(t));
    if (!copy) return NULL;
    memcpy(copy, t, task_size(t));
    copy->tmpl = !launch;
    lb_comm_ref(t->c);
    if (!launch) graph_ref(t->c, 1); /* a graph keeps this comm: destroy waits for it */
    return copy;
}

/* Queue t on stream (or into the capture under way there); takes t in every case. */
static ncclResult_t sig_enqueue(struct lb_comm *c, cudaStream_t stream, struct lb_sigtask *t,
                                const char *opname) {
#if LB_NULL
    (void)c, (void)stream, (void)opname;
    free(t);
    return ncclSuccess;
#else
    int cur = pynccl_lb_current_device(), switched = 0;
    if (cur != c->dev && lb_is_default_stream(stream)) {
        cudaSetDevice(c->dev); /* the default streams mean the comm's device's */
        switched = 1;
    }
    int capturing = pynccl_lb_stream_capturing(stream) > 0;
    t->c = c;
    t->tmpl = capturing;
    lb_comm_ref(c);
    if (capturing) graph_ref(c, 1);
    int e = pynccl_lb_stream_enqueue2(stream, sig_run, sig_release, sig_clone, t, capturing);
    if (switched) cudaSetDevice(cur);
    if (e != 0) {
        if (capturing) graph_ref(c, -1);
        lb_comm_unref(c);
        free(t);
        return lb_err(ncclUnhandledCudaError, "%s : Cuda failure '%s' on stream %p (%s)", opname,
                      cudaGetErrorString((cudaError_t)e), (void *)stream,
                      pynccl_lb_last_error_detail());
    }
    return ncclSuccess;
#endif
}

/* ---- argument checks (NCCL's wording where it has one) ------------------------------------ */

static ncclResult_t check_index(const struct lb_comm *c, int sig, int ctx, const char *opname,
                                const char *where) {
#if LB_AT_LEAST(2, 31, 0)
    const int nctx = c->rma_ctx, nsig = c->rma_sig;
#else /* one context and one signal until numRmaSig (2.31) */
    const int nctx = c->rma_ctx < 1 ? c->rma_ctx : 1, nsig = 1;
#endif
    if (ctx < 0 || ctx >= nctx)
        return lb_err(ncclInvalidArgument,
                      "%s : %sContext %d is invalid (the communicator has numRmaCtx=%d contexts)",
                      opname, where, ctx, nctx);
    if (sig < 0 || sig >= nsig)
        return lb_err(ncclInvalidArgument,
                      "%s : %sSignal index %d is invalid (the communicator has numRmaSig=%d signals)",
                      opname, where, sig, nsig);
    return ncclSuccess;
}

/* NCCL's rmaTaskAppend: host RMA needs ncclCommProperties_t.hostRmaSupport (props.c). */
static ncclResult_t check_host_rma(const struct lb_comm *c, const char *opname) {
    if (c->rma_ctx > 0) return ncclSuccess;
    return lb_err(ncclInvalidArgument,
                  "%s : One sided RMA: host RMA is not supported in this communicator "
                  "(numRmaCtx=0)",
                  opname);
}

static ncclResult_t check_peer(const struct lb_comm *c, int peer, const char *opname) {
    if (peer < 0 || peer >= c->nranks)
        return lb_err(ncclInvalidArgument, "%s : invalid peer %d (peer should be in the 0..%d range)",
                      opname, peer, c->nranks - 1);
    return ncclSuccess;
}

static ncclResult_t common_checks(ncclComm_t comm, int peer, int sig, int ctx, unsigned flags,
                                  cudaStream_t stream, const char *opname, struct lb_comm **out) {
    ncclResult_t r = lb_comm_get(comm, opname, out);
    if (r != ncclSuccess) return r;
    struct lb_comm *c = *out;
    if ((r = lb_comm_ensure_ready(c, opname)) != ncclSuccess) return r;
    if ((r = check_peer(c, peer, opname)) != ncclSuccess) return r;
    if ((r = check_host_rma(c, opname)) != ncclSuccess) return r;
    if ((r = check_index(c, sig, ctx, opname, "")) != ncclSuccess) return r;
    if (flags != 0) return lb_err(ncclInvalidArgument, "%s : Flags %u is invalid (must be 0)", opname, flags);
    return lb_check_stream(c, stream, opname);
}

ncclResult_t ncclPutSignal(const void *localbuff, size_t count, ncclDataType_t datatype, int peer,
                           ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx,
                           unsigned int flags, ncclComm_t comm, cudaStream_t stream) {
    const char *opname = "ncclPutSignal";
    struct lb_comm *c;
    ncclResult_t r = common_checks(comm, peer, sigIdx, ctx, flags, stream, opname, &c);
    if (r != ncclSuccess) return lb_group_error(r);
    if ((int)datatype < 0 || (int)datatype >= LB_NUM_TYPES)
        return lb_group_error(lb_err(ncclInvalidArgument, "%s : invalid type %d", opname, (int)datatype));
    size_t bytes;
    if (__builtin_mul_overflow(count, lb_type_size(datatype), &bytes))
        return lb_group_error(lb_err(ncclInvalidArgument, "%s : count %zu of %s overflows the address space",
                                     opname, count, lb_type_name(datatype)));
    if (peerWin == NULL) return lb_group_error(lb_err(ncclInvalidArgument, "%s: peerWin is NULL", opname));
    if (localbuff == NULL) return lb_group_error(lb_err(ncclInvalidArgument, "%s: srcBuff is NULL", opname));
    void *base = NULL;
    size_t psize = 0;
    pthread_mutex_lock(&c->mu);
    int known = lb_win_lookup(c, peerWin, NULL, &psize, peer, &base);
    int src_ok = lb_win_find(c, localbuff, bytes, LB_WIN_SYMMETRIC) != NULL;
    pthread_mutex_unlock(&c->mu);
    if (!known)
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : window %p is not registered with communicator %p", opname,
                                     (void *)peerWin, (void *)comm));
    if (!src_ok)
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s: srcWinHost is not in a valid symmetric window (localbuff "
                                     "%p, %zu bytes)",
                                     opname, localbuff, bytes));
    if (peerWinOffset > psize || bytes > psize - peerWinOffset)
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : %zu bytes at offset %zu do not fit in rank %d's window of "
                                     "%zu bytes",
                                     opname, bytes, peerWinOffset, peer, psize));
    struct lb_sigtask *t = calloc(1, sizeof *t);
    if (!t) return lb_group_error(lb_err(ncclSystemError, "%s : out of memory", opname));
    t->kind = LBS_PUT;
    t->peer = peer;
    t->sig = sigIdx;
    t->ctx = ctx;
    t->src = localbuff;
    t->bytes = bytes;
    t->off = peerWinOffset;
    t->win = peerWin;
    return lb_group_error(sig_enqueue(c, stream, t, opname));
}
LB_ALIAS(ncclPutSignal)

ncclResult_t ncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm,
                        cudaStream_t stream) {
    const char *opname = "ncclSignal";
    struct lb_comm *c;
    ncclResult_t r = common_checks(comm, peer, sigIdx, ctx, flags, stream, opname, &c);
    if (r != ncclSuccess) return lb_group_error(r);
    struct lb_sigtask *t = calloc(1, sizeof *t);
    if (!t) return lb_group_error(lb_err(ncclSystemError, "%s : out of memory", opname));
    t->kind = LBS_SIGNAL;
    t->peer = peer;
    t->sig = sigIdx;
    t->ctx = ctx;
    return lb_group_error(sig_enqueue(c, stream, t, opname));
}
LB_ALIAS(ncclSignal)

ncclResult_t ncclWaitSignal(int nDesc, ncclWaitSignalDesc_t *signalDescs, ncclComm_t comm,
                            cudaStream_t stream) {
    const char *opname = "ncclWaitSignal";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r == ncclSuccess) r = lb_comm_ensure_ready(c, opname);
    if (r != ncclSuccess) return lb_group_error(r);
    if (signalDescs == NULL || nDesc <= 0)
        return lb_group_error(lb_err(ncclInvalidArgument, "%s: invalid arguments", opname));
    for (int i = 0; i < nDesc; i++) {
        const ncclWaitSignalDesc_t *d = &signalDescs[i];
        char where[48];
        snprintf(where, sizeof where, "descriptor %d: ", i);
        if (d->opCnt <= 0)
            return lb_group_error(lb_err(ncclInvalidArgument,
                                         "%s: descriptor %d has invalid opCnt %d", opname, i, d->opCnt));
        if ((r = check_peer(c, d->peer, opname)) != ncclSuccess) return lb_group_error(r);
        if ((r = check_host_rma(c, opname)) != ncclSuccess) return lb_group_error(r);
        if ((r = check_index(c, d->sigIdx, d->ctx, opname, where)) != ncclSuccess)
            return lb_group_error(r);
    }
    if ((r = lb_check_stream(c, stream, opname)) != ncclSuccess) return lb_group_error(r);
    struct lb_sigtask *t = calloc(1, sizeof *t + (size_t)nDesc * sizeof t->d[0]);
    if (!t) return lb_group_error(lb_err(ncclSystemError, "%s : out of memory", opname));
    t->kind = LBS_WAIT;
    t->n = nDesc;
    memcpy(t->d, signalDescs, (size_t)nDesc * sizeof t->d[0]);
    return lb_group_error(sig_enqueue(c, stream, t, opname));
}
LB_ALIAS(ncclWaitSignal)
#endif
