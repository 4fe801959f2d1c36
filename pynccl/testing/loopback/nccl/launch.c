/*
 * Launching the loopback libnccl's operations: tasks on the loopback streams, and
 * ncclGroupEnd / ncclGroupSimulateEnd, which launch the items of the thread's group
 * (group.c); an op issued outside a group is launched at once as a group of one
 * (enqueue.c checks its arguments first). A non-blocking group's launch is a worker
 * thread's (gjob.c).
 *
 * Each communicator has a bounded work queue, as NCCL's work FIFO: a launch takes the
 * FIFO bytes of its work items until it has run, and a launch that finds the queue full
 * blocks the issuing thread (NCCL_WORK_FIFO_BYTES). Tasks are counted as they retire (run
 * or are dropped), which is what finalize, revoke and default shrink wait for; graph
 * copies of captured tasks are counted as the communicator's persistent references,
 * which destroy and abort wait for (teardown.c).
 *
 * A launch makes one task per communicator (its collectives in issue order, then all
 * its p2p ops, which progress together) and enqueues it on the stream of the comm's
 * first op; other streams of the same comm in the group are joined with events, as
 * NCCL does. Tasks of one communicator run in issue order even across streams (a
 * per-comm ticket), since they share the communicator's world.
 *
 * With LB_NULL the ops are checked and dropped: no task, no data movement.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

/* Optional cudart entry points (multi-stream groups, launch events). */
#pragma weak cudaEventCreateWithFlags
#pragma weak cudaEventRecord
#pragma weak cudaStreamWaitEvent
#pragma weak cudaEventDestroy

/* ---- tasks ------------------------------------------------------------------------------ */

struct lb_task {
    struct lb_comm *c; /* ref held */
    uint64_t seq;      /* the comm's ticket: tasks run in this order */
    int ran;
    int tmpl;          /* a graph's template (captured): never run, has no ticket */
    int nops, ncoll;   /* ops[0..ncoll) collectives, then p2p */
    size_t fifo_bytes; /* its room in the comm's work queue (0: a graph launch's copy) */
    struct lb_op ops[];
};

/* The bytes a launch takes in NCCL's work FIFO (src/include/device.h): one
 * ncclDevWorkBatch, then an ncclDevWorkColl per collective, an ncclDevWorkP2p per p2p. */
#define LB_WORK_BATCH_BYTES 16
#define LB_WORK_COLL_BYTES 144
#define LB_WORK_P2P_BYTES 48

static size_t work_bytes(int ncoll, int np2p) {
    return LB_WORK_BATCH_BYTES + (size_t)ncoll * LB_WORK_COLL_BYTES +
           (size_t)np2p * LB_WORK_P2P_BYTES;
}

/* Wait (c->mu held) for room in c's work queue, as NCCL's waitWorkFifoAvailable spins
 * until the device consumed enough: the issuing thread blocks while earlier work of the
 * comm has not run. A launch bigger than the whole queue waits for it to be empty. */
static ncclResult_t fifo_reserve(struct lb_comm *c, size_t bytes, const char *what) {
    int waited = 0;
    while (c->fifo_used > 0 && c->fifo_used + bytes > c->fifo_cap) {
        waited = 1;
        if (__atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE)) break;
        pthread_cond_wait(&c->cv, &c->mu);
    }
    /* an abort while this launch waited ends it (the room an abort frees comes after) */
    if (waited && __atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE))
        return lb_err(ncclInternalError,
                      "%s : communicator aborted while its work queue (NCCL_WORK_FIFO_BYTES = "
                      "%zu) was full",
                      what, c->fifo_cap);
    c->fifo_used += bytes;
    return ncclSuccess;
}

static void graph_ref(struct lb_comm *c, int delta) {
    pthread_mutex_lock(&c->mu);
    c->graph_refs += delta;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void task_exec(struct lb_comm *c, struct lb_task *t) {
    for (int i = 0; i < t->nops; i++) {
        int p2p = i >= t->ncoll;
        int last = p2p ? t->nops : i + 1; /* the p2p batch counts as all its ops */
        for (int k = i; k < last; k++) {
            uint64_t n = ++c->nexec;
            if (c->hang_at > 0 && n == (uint64_t)c->hang_at) {
                lb_comm_fail(c, lbx_hang(c), NULL);
                return;
            }
            if (c->fail_after >= 0 && n > (uint64_t)c->fail_after) {
                lb_comm_fail(c, (ncclResult_t)c->fail_code,
                             "rank %d: async error %d injected after %lld operations "
                             "(PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER)",
                             c->rank, c->fail_code, c->fail_after);
                return;
            }
        }
        ncclResult_t r = p2p ? lbx_exec_p2p(c, &t->ops[i], t->nops - i) : lbx_exec_coll(c, &t->ops[i]);
        if (r != ncclSuccess) {
            lb_comm_fail(c, r, NULL);
            return;
        }
        if (p2p) return;
    }
}

static void task_run(void *arg) {
    struct lb_task *t = arg;
    struct lb_comm *c = t->c;
    t->ran = 1;
    pthread_mutex_lock(&c->mu);
    while (c->completed != t->seq && !__atomic_load_n(&c->halt, __ATOMIC_ACQUIRE))
        pthread_cond_wait(&c->cv, &c->mu);
    c->running++;
    pthread_mutex_unlock(&c->mu);
    if (!__atomic_load_n(&c->halt, __ATOMIC_ACQUIRE)) task_exec(c, t);
    pthread_mutex_lock(&c->mu);
    c->running--;
    if (c->completed == t->seq) c->completed = t->seq + 1;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void task_release(void *arg) {
    struct lb_task *t = arg;
    struct lb_comm *c = t->c;
    if (!t->tmpl && !t->ran && !__atomic_load_n(&c->halt, __ATOMIC_ACQUIRE)) {
        /* it holds a ticket that will never run: the peers (and later tasks) would wait */
        lb_comm_fail(c, ncclInvalidUsage,
                     "rank %d: a %s was dropped before it ran (its stream was destroyed, or a "
                     "CUDA graph launch failed part way)",
                     c->rank, lb_kind_name(t->ops[0].kind));
    }
    pthread_mutex_lock(&c->mu);
    if (t->tmpl) {
        c->graph_refs--; /* a graph (or capture) that held this copy is gone */
    } else {
        c->retired++;
        c->fifo_used -= t->fifo_bytes;
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    lb_comm_unref(c);
    free(t);
}

/* A copy of a captured task: a template (launch 0) or, for a graph launch, a task
 * with the comm's next ticket, so that every rank's replays match in issue order
 * (NCCL too assigns a captured collective's order when the graph is launched). */
static void *task_clone(void *arg, int launch) {
    const struct lb_task *t = arg;
    size_t size = sizeof *t + (size_t)t->nops * sizeof(struct lb_op);
    struct lb_task *copy = malloc(size);
    if (!copy) return NULL;
    memcpy(copy, t, size);
    copy->ran = 0;
    copy->tmpl = !launch;
    copy->seq = 0;
    copy->fifo_bytes = 0; /* NCCL keeps a graph's work in persistent buffers */
    lb_comm_ref(t->c);
    pthread_mutex_lock(&t->c->mu);
    if (launch)
        copy->seq = t->c->issued++;
    else
        t->c->graph_refs++; /* NCCL's localPersistentRefs: destroy waits for it */
    pthread_mutex_unlock(&t->c->mu);
    return copy;
}

/* Join streams[1..n) into streams[0] before the task (when), or after it. */
static ncclResult_t join_streams(cudaStream_t *streams, int n, int before) {
    if (n < 2) return ncclSuccess;
    if (!cudaEventCreateWithFlags || !cudaEventRecord || !cudaStreamWaitEvent || !cudaEventDestroy)
        return lb_err(ncclInvalidUsage, "ncclGroupEnd : several streams for one communicator "
                                        "need the loopback cudart's events");
    for (int i = 1; i < n; i++) {
        cudaEvent_t ev;
        cudaStream_t from = before ? streams[i] : streams[0];
        cudaStream_t to = before ? streams[0] : streams[i];
        if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess)
            return lb_err(ncclUnhandledCudaError, "ncclGroupEnd : cudaEventCreateWithFlags failed");
        int e = cudaEventRecord(ev, from);
        if (e == cudaSuccess) e = cudaStreamWaitEvent(to, ev, 0);
        cudaEventDestroy(ev);
        if (e != cudaSuccess)
            return lb_err(ncclUnhandledCudaError, "ncclGroupEnd : Cuda failure '%s' joining streams",
                          cudaGetErrorString((cudaError_t)e));
    }
    return ncclSuccess;
}

/* NCCL connects the p2p peers of a group before launching any of it (ncclGroupEnd's
 * preconnect): reserve the ring of every send among items[idx[0..n)] (p2p.c). */
static ncclResult_t connect_sends(const struct lb_gitem *items, const int *idx, int n) {
    for (int k = 0; k < n; k++) {
        const struct lb_gitem *it = &items[idx ? idx[k] : k];
        if (it->type != LBG_OP || it->op.kind != LB_K_SEND) continue;
        ncclResult_t r = lb_p2p_connect(it->c, it->op.root);
        if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
}

/* One task for communicator c made of items[idx[0..n)], in issue order. */
ncclResult_t lb_enqueue_task(struct lb_comm *c, const struct lb_gitem *items, const int *idx,
                                 int n) {
    int ncoll = 0, self_send = 0, self_recv = 0;
    for (int k = 0; k < n; k++) {
        const struct lb_op *op = &items[idx[k]].op;
        if (op->kind < LB_K_SEND)
            ncoll++;
        else if (op->root == c->rank)
            op->kind == LB_K_SEND ? self_send++ : self_recv++;
    }
    if (self_send != self_recv)
        return lb_err(ncclInvalidUsage, self_send > self_recv
                                            ? "Trying to send to self without a matching recv"
                                            : "Trying to recv to self without a matching send");
    ncclResult_t cr = connect_sends(items, idx, n);
    if (cr != ncclSuccess) return cr;
    struct lb_task *t = malloc(sizeof *t + (size_t)n * sizeof(struct lb_op));
    if (!t) return lb_err(ncclSystemError, "ncclGroupEnd : out of memory");
    t->c = c;
    t->ran = 0;
    t->tmpl = 0;
    t->seq = 0;
    t->nops = n;
    t->ncoll = ncoll;
    t->fifo_bytes = 0;
    int a = 0, b = ncoll;
    cudaEvent_t launch_event = NULL;
    for (int k = 0; k < n; k++) {
        const struct lb_op *op = &items[idx[k]].op;
        t->ops[op->kind < LB_K_SEND ? a++ : b++] = *op;
        if (op->launch_event) launch_event = op->launch_event;
    }

    cudaStream_t streams[16];
    int ns = 0;
    for (int k = 0; k < n; k++) {
        cudaStream_t s = items[idx[k]].stream;
        int seen = 0;
        for (int j = 0; j < ns; j++) seen |= streams[j] == s;
        if (!seen && ns < 16) streams[ns++] = s;
    }
    /* Under stream capture the task becomes a graph template (see task_clone). The
     * loopback records a graph as one ordered list, so it captures one stream per
     * communicator only. */
    int capturing = 0;
    for (int j = 0; j < ns; j++) {
        int cs = pynccl_lb_stream_capturing(streams[j]);
        if (cs > 0 && ns > 1) {
            free(t);
            return lb_err(ncclInvalidUsage,
                          "ncclGroupEnd : stream %p is being captured into a CUDA graph, and "
                          "this group gives the communicator (rank %d) %d streams: the "
                          "loopback captures a communicator's operations on one stream only",
                          (void *)streams[j], c->rank, ns);
        }
        if (j == 0) capturing = cs > 0;
    }
    int cur = pynccl_lb_current_device(), switched = 0;
    if (cur != c->dev) {
        /* the default streams mean the comm's device's, as NCCL sets it before launching */
        cudaSetDevice(c->dev);
        switched = 1;
    }
    lb_comm_ref(c); /* an abort may release a launch blocked on the full queue: keep c */
    ncclResult_t ret = join_streams(streams, ns, 1);
    if (ret == ncclSuccess && launch_event && cudaEventRecord) cudaEventRecord(launch_event, streams[0]);
    if (ret == ncclSuccess && capturing) {
        t->tmpl = 1;
        lb_comm_ref(c);
        graph_ref(c, 1);
        int e = pynccl_lb_stream_enqueue2(streams[0], task_run, task_release, task_clone, t, 1);
        if (e != 0) {
            graph_ref(c, -1);
            lb_comm_unref(c);
            ret = lb_err(ncclUnhandledCudaError,
                         "%s : Cuda failure '%s' capturing on stream %p (%s)",
                         lb_kind_name(items[idx[0]].op.kind), cudaGetErrorString((cudaError_t)e),
                         (void *)streams[0], pynccl_lb_last_error_detail());
        } else {
            t = NULL; /* the capture owns the template */
        }
    } else if (ret == ncclSuccess) {
        pthread_mutex_lock(&c->mu);
        ret = fifo_reserve(c, work_bytes(ncoll, n - ncoll), lb_kind_name(items[idx[0]].op.kind));
        if (ret == ncclSuccess) {
            t->fifo_bytes = work_bytes(ncoll, n - ncoll);
            t->seq = c->issued++;
        }
        pthread_mutex_unlock(&c->mu);
    }
    if (t && ret == ncclSuccess && !capturing) {
        lb_comm_ref(c);
        int e = pynccl_lb_stream_enqueue2(streams[0], task_run, task_release, task_clone, t, 0);
        if (e != 0) {
            pthread_mutex_lock(&c->mu);
            c->fifo_used -= t->fifo_bytes;
            if (c->issued == t->seq + 1) {
                c->issued--;
            } else { /* a later ticket exists: this one can never run in order */
                __atomic_store_n(&c->halt, 1, __ATOMIC_RELEASE);
                c->retired++;
            }
            pthread_cond_broadcast(&c->cv);
            pthread_mutex_unlock(&c->mu);
            lb_comm_unref(c);
            free(t);
            t = NULL;
            ret = lb_err(ncclUnhandledCudaError, "%s : Cuda failure '%s' launching on stream %p",
                         lb_kind_name(items[idx[0]].op.kind), cudaGetErrorString((cudaError_t)e),
                         (void *)streams[0]);
        } else {
            t = NULL;
            ret = join_streams(streams, ns, 0);
        }
    }
    free(t);
    if (switched) cudaSetDevice(cur);
    lb_comm_unref(c);
    return ret;
}

ncclResult_t lb_launch_ops(struct lb_gitem *items, int n) {
    int nops = 0;
    for (int i = 0; i < n; i++) nops += items[i].type == LBG_OP;
    if (!nops) return ncclSuccess;
    ncclResult_t ret = ncclSuccess;
    int *idx = malloc((size_t)nops * sizeof *idx);
    char *done = calloc((size_t)n, 1);
    if (!idx || !done) {
        ret = lb_err(ncclSystemError, "ncclGroupEnd : out of memory");
    } else if ((ret = connect_sends(items, NULL, n)) == ncclSuccess) { /* before any launch */
        for (int i = 0; i < n && ret == ncclSuccess; i++) {
            if (items[i].type != LBG_OP || done[i]) continue;
            int m = 0;
            for (int j = i; j < n; j++) {
                if (items[j].type == LBG_OP && items[j].c == items[i].c) {
                    idx[m++] = j;
                    done[j] = 1;
                }
            }
            ret = lb_enqueue_task(items[i].c, items, idx, m);
        }
    }
    free(done);
    free(idx);
    return ret;
}

struct group_job {
    struct lb_gitem *items;
    int n;
    struct lb_wop *ops;
    int nops;
};

static ncclResult_t group_job_run(void *arg) {
    struct group_job *g = arg;
    ncclResult_t r = g->nops ? lb_win_run(g->ops, g->nops) : ncclSuccess; /* windows first */
    if (r == ncclSuccess) r = lb_launch_ops(g->items, g->n);
    lb_group_release(g->items, g->n);
    free(g);
    return r;
}

ncclResult_t lb_launch_async(struct lb_gitem *items, int n, struct lb_wop *ops, int nops) {
    struct group_job *g = malloc(sizeof *g);
    struct lb_comm **comms = malloc((size_t)(n + nops + 1) * sizeof *comms);
    if (!g || !comms) {
        free(g);
        free(comms);
        lb_group_release(items, n);
        lb_win_drop(ops, nops);
        return lb_err(ncclSystemError, "ncclGroupEnd : out of memory");
    }
    int nc = 0;
    for (int i = 0; i < n; i++)
        if (items[i].type == LBG_OP) comms[nc++] = items[i].c;
    for (int i = 0; i < nops; i++) comms[nc++] = lb_win_op_comm(ops, i);
    *g = (struct group_job){items, n, ops, nops};
    ncclResult_t r = lb_gjob_start(comms, nc, group_job_run, g);
    free(comms);
    return r;
}

/* Inits and splits of a group's items: a blocking group waits for them, a non-blocking
 * one leaves them to the polls of ncclCommGetAsyncError (comm.c). */
static ncclResult_t group_comms(struct lb_gitem *items, int n, int blocking) {
    ncclResult_t ret = ncclSuccess;
    /* a split's child joins its world before anyone waits */
    for (int i = 0; i < n && ret == ncclSuccess; i++)
        if (items[i].type == LBG_SPLIT && blocking) ret = lb_split_stage_join(items[i].split);
    for (int i = 0; i < n; i++) {
        if (items[i].type == LBG_INIT && blocking && ret == ncclSuccess) {
            ncclResult_t r = lb_comm_progress(items[i].c, 1);
            if (r != ncclSuccess) ret = r;
        } else if (items[i].type == LBG_SPLIT) {
            struct lb_split *s = items[i].split;
            if (blocking && ret == ncclSuccess) {
                ncclResult_t r = lb_split_progress(s, 1);
                if (r != ncclSuccess) ret = r;
            } else if (!blocking) {
                lb_split_defer(s);
                items[i].split = NULL; /* owned by the pending list now */
            }
        }
    }
    return ret;
}

/* The outermost group end: the group's items (group.c) and window registrations
 * (winreg.c), its first error so far; launched, or given to a worker (gjob.c). */
static ncclResult_t group_finish(struct lb_gitem *items, int n, int blocking, struct lb_wop *ops,
                                 int nops, ncclResult_t err, int simulate) {
    if (err == ncclSuccess) err = group_comms(items, n, blocking);
    if (err != ncclSuccess) {
        lb_group_release(items, n);
        lb_win_drop(ops, nops);
        return err;
    }
    int launches = nops;
    for (int i = 0; i < n; i++) launches += items[i].type == LBG_OP;
    if (!blocking && launches && !simulate) return lb_launch_async(items, n, ops, nops);
    ncclResult_t r = nops ? lb_win_run(ops, nops) : ncclSuccess; /* windows first, as NCCL */
    if (r == ncclSuccess && !simulate) r = lb_launch_ops(items, n);
    lb_group_release(items, n);
    if (r == ncclSuccess && !blocking && n > 0) r = ncclInProgress;
    return r;
}

static ncclResult_t group_end(int simulate) {
    struct lb_gitem *items;
    int n, blocking = 1;
    ncclResult_t err, r = lb_group_pop(&items, &n, &blocking, &err);
    if (r != ncclSuccess || lb_group_depth() > 0) return r;
    struct lb_wop *ops;
    int nops = lb_win_group_take(&ops);
    return group_finish(items, n, blocking, ops, nops, err, simulate);
}

ncclResult_t ncclGroupEnd(void) { return group_end(0); }
LB_ALIAS(ncclGroupEnd)

#if LB_AT_LEAST(2, 22, 3)
ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t *simInfo) {
    struct lb_gitem *items;
    int n, blocking = 1;
    ncclResult_t err, r = lb_group_pop(&items, &n, &blocking, &err);
    if (r != ncclSuccess || lb_group_depth() > 0) return r; /* nested: simInfo is ignored */
    struct lb_wop *ops;
    int nops = lb_win_group_take(&ops);
    ncclSimInfo_t info;
    size_t real = 0;
    if (simInfo && err == ncclSuccess) {
        memcpy(&real, &simInfo->size, sizeof real);
        if (real > sizeof info) real = sizeof info;
        memset(&info, 0, sizeof info);
        memcpy(&info, simInfo, real);
        if (info.magic != 0x74685283u)
            err = lb_err(ncclInvalidArgument,
                         "ncclSimInfo_t argument not initialized via NCCL_SIM_INFO_INITIALIZER");
    }
    /* a crude model of a fast interconnect: 5 us per op plus 20 GB/s (us) */
    double us = 0;
    int nsim = 0;
    for (int i = 0; i < n; i++) {
        if (items[i].type != LBG_OP) continue;
        nsim++;
        us += 5.0 + (double)(items[i].op.count * lb_type_size(items[i].op.dtype)) / 20e3;
    }
    r = group_finish(items, n, blocking, ops, nops, err, 1);
    if (simInfo && nsim && (r == ncclSuccess || r == ncclInProgress)) {
        info.estimatedTime = (float)us;
        memcpy(simInfo, &info, real);
    }
    return r;
}
LB_ALIAS(ncclGroupSimulateEnd)
#endif
