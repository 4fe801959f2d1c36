/*
 * Launching the loopback libnccl's operations: tasks on the loopback streams, and
 * ncclGroupEnd / ncclGroupSimulateEnd, which launch the items of the thread's group
 * (group.c); an op issued outside a group is launched at once as a group of one
 * (enqueue.c checks its arguments first).
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
    struct lb_op ops[];
};

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
    if (!t->tmpl && !t->ran && !__atomic_load_n(&t->c->halt, __ATOMIC_ACQUIRE)) {
        /* it holds a ticket that will never run: the peers (and later tasks) would wait */
        lb_comm_fail(t->c, ncclInvalidUsage,
                     "rank %d: a %s was dropped before it ran (its stream was destroyed, or a "
                     "CUDA graph launch failed part way)",
                     t->c->rank, lb_kind_name(t->ops[0].kind));
    }
    lb_comm_unref(t->c);
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
    lb_comm_ref(t->c);
    if (launch) {
        pthread_mutex_lock(&t->c->mu);
        copy->seq = t->c->issued++;
        pthread_mutex_unlock(&t->c->mu);
    }
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
    struct lb_task *t = malloc(sizeof *t + (size_t)n * sizeof(struct lb_op));
    if (!t) return lb_err(ncclSystemError, "ncclGroupEnd : out of memory");
    t->c = c;
    t->ran = 0;
    t->tmpl = 0;
    t->seq = 0;
    t->nops = n;
    t->ncoll = ncoll;
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
    ncclResult_t ret = join_streams(streams, ns, 1);
    if (ret == ncclSuccess && launch_event && cudaEventRecord) cudaEventRecord(launch_event, streams[0]);
    if (ret == ncclSuccess && capturing) {
        t->tmpl = 1;
        lb_comm_ref(c);
        int e = pynccl_lb_stream_enqueue2(streams[0], task_run, task_release, task_clone, t, 1);
        if (e != 0) {
            lb_comm_unref(c);
            ret = lb_err(ncclUnhandledCudaError,
                         "%s : Cuda failure '%s' capturing on stream %p (%s)",
                         lb_kind_name(items[idx[0]].op.kind), cudaGetErrorString((cudaError_t)e),
                         (void *)streams[0], pynccl_lb_last_error_detail());
        } else {
            t = NULL; /* the capture owns the template */
        }
    } else if (ret == ncclSuccess) {
        lb_comm_ref(c);
        pthread_mutex_lock(&c->mu);
        t->seq = c->issued++;
        pthread_mutex_unlock(&c->mu);
        int e = pynccl_lb_stream_enqueue2(streams[0], task_run, task_release, task_clone, t, 0);
        if (e != 0) {
            pthread_mutex_lock(&c->mu);
            if (c->issued == t->seq + 1)
                c->issued--;
            else
                __atomic_store_n(&c->halt, 1, __ATOMIC_RELEASE);
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
    return ret;
}

/* Launch a group's items (taken from the thread-local list by the caller). */
static ncclResult_t group_launch(struct lb_gitem *items, int n, int blocking, int simulate) {
    ncclResult_t ret = ncclSuccess;
    /* inits and splits first: a split's child joins its world before anyone waits */
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
    int *idx = NULL;
    int nops = 0;
    for (int i = 0; i < n; i++) nops += items[i].type == LBG_OP;
    if (nops && !simulate && ret == ncclSuccess) {
        idx = malloc((size_t)nops * sizeof *idx);
        char *done = calloc((size_t)n, 1);
        if (!idx || !done) {
            ret = lb_err(ncclSystemError, "ncclGroupEnd : out of memory");
        } else {
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
    }
    free(idx);
    lb_group_release(items, n);
    if (ret == ncclSuccess && !blocking && n > 0) ret = ncclInProgress;
    return ret;
}


ncclResult_t ncclGroupEnd(void) {
    struct lb_gitem *items;
    int n, blocking = 1;
    ncclResult_t err, r = lb_group_pop(&items, &n, &blocking, &err);
    if (r != ncclSuccess || lb_group_depth() > 0) return r;
    if (err != ncclSuccess) {
        r = err;
        lb_group_release(items, n);
        lb_win_group_end(1);
        return r;
    }
    if ((r = lb_win_group_end(0)) != ncclSuccess) { /* window calls first, as in NCCL */
        lb_group_release(items, n);
        return r;
    }
    return group_launch(items, n, blocking, 0);
}
LB_ALIAS(ncclGroupEnd)

#if LB_AT_LEAST(2, 22, 3)
ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t *simInfo) {
    struct lb_gitem *items;
    int n, blocking = 1;
    ncclResult_t err, r = lb_group_pop(&items, &n, &blocking, &err);
    if (r != ncclSuccess || lb_group_depth() > 0) return r; /* nested: simInfo is ignored */
    if (err != ncclSuccess) {
        r = err;
        lb_group_release(items, n);
        lb_win_group_end(1);
        return r;
    }
    if ((r = lb_win_group_end(0)) != ncclSuccess) {
        lb_group_release(items, n);
        return r;
    }
    ncclSimInfo_t info;
    size_t real = 0;
    if (simInfo) {
        memcpy(&real, &simInfo->size, sizeof real);
        if (real > sizeof info) real = sizeof info;
        memset(&info, 0, sizeof info);
        memcpy(&info, simInfo, real);
        if (info.magic != 0x74685283u) {
            lb_group_release(items, n);
            return lb_err(ncclInvalidArgument,
                          "ncclSimInfo_t argument not initialized via NCCL_SIM_INFO_INITIALIZER");
        }
    }
    /* a crude model of a fast interconnect: 5 us per op plus 20 GB/s (us) */
    double us = 0;
    int nops = 0;
    for (int i = 0; i < n; i++) {
        if (items[i].type != LBG_OP) continue;
        nops++;
        us += 5.0 + (double)(items[i].op.count * lb_type_size(items[i].op.dtype)) / 20e3;
    }
    r = group_launch(items, n, blocking, 1);
    if (simInfo && nops && (r == ncclSuccess || r == ncclInProgress)) {
        info.estimatedTime = (float)us;
        memcpy(simInfo, &info, real);
    }
    return r;
}
LB_ALIAS(ncclGroupSimulateEnd)
#endif
