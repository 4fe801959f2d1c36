/*
 * Collectives, point-to-point and groups of the loopback libnccl.
 *
 * Every call checks its arguments synchronously, the way NCCL does (comm, readiness,
 * root/peer, type, op, sizes, and - the loopback's strict mode - that each buffer lies
 * inside a loopback allocation on the comm's device), then either queues the op in
 * the calling thread's group or launches it at once as a group of one.
 *
 * A launch makes one task per communicator (its collectives in issue order, then all
 * its p2p ops, which progress together) and enqueues it on the stream of the comm's
 * first op; other streams of the same comm in the group are joined with events, as
 * NCCL does. Tasks of one communicator run in issue order even across streams (a
 * per-comm ticket), since they share the communicator's world.
 *
 * With LB_NULL the ops are checked and dropped: no task, no data movement.
 */
#include "nccl_lb_internal.h"

#include <stdlib.h>
#include <string.h>

/* Optional cudart entry points (multi-stream groups, launch events). */
#pragma weak cudaEventCreateWithFlags
#pragma weak cudaEventRecord
#pragma weak cudaStreamWaitEvent
#pragma weak cudaEventDestroy

static const char *const k_kind[LB_K_COUNT] = {"AllReduce", "Broadcast",     "Reduce",
                                               "AllGather", "ReduceScatter", "AlltoAll",
                                               "Gather",    "Scatter",       "Send",
                                               "Recv"};

const char *lb_kind_name(int kind) { return (kind >= 0 && kind < LB_K_COUNT) ? k_kind[kind] : "?"; }

const char *lb_op_name(int op) {
    static const char *const names[] = {"sum", "prod", "max", "min", "avg"};
    if (op >= 0 && op < LB_NUM_OPS) return names[op];
    return op >= LB_NUM_OPS ? "premulsum" : "?";
}

static int is_default_stream(cudaStream_t s) {
    return s == NULL || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

/* ---- thread-local groups -------------------------------------------------------------- */

enum { LBG_OP, LBG_INIT, LBG_SPLIT };

struct lb_gitem {
    int type;
    struct lb_comm *c; /* ref held (OP, INIT) */
    cudaStream_t stream;
    struct lb_op op;
    struct lb_split *split;
};

static __thread int t_depth;
static __thread int t_err;
static __thread int t_blocking = -1;
static __thread struct lb_gitem *t_items;
static __thread int t_n, t_cap;

int lb_group_depth(void) { return t_depth; }

ncclResult_t lb_group_error(ncclResult_t r) {
    if (r != ncclSuccess && r != ncclInProgress && t_depth > 0 && t_err == ncclSuccess) t_err = r;
    return r;
}

ncclResult_t lb_group_join_mode(int blocking, const char *opname) {
    if (t_depth == 0) return ncclSuccess;
    if (t_blocking < 0) {
        t_blocking = blocking;
    } else if (t_blocking != blocking) {
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : Blocking and nonblocking communicators are not allowed "
                                     "in the same group.",
                                     opname));
    }
    return ncclSuccess;
}

static ncclResult_t push(const struct lb_gitem *it) {
    if (t_n == t_cap) {
        int cap = t_cap ? 2 * t_cap : 16;
        struct lb_gitem *n = realloc(t_items, (size_t)cap * sizeof *n);
        if (!n) return lb_group_error(lb_err(ncclSystemError, "ncclGroup : out of memory"));
        t_items = n;
        t_cap = cap;
    }
    t_items[t_n++] = *it;
    if (it->c) lb_comm_ref(it->c);
    return ncclSuccess;
}

ncclResult_t lb_group_defer_init(struct lb_comm *c) {
    struct lb_gitem it;
    memset(&it, 0, sizeof it);
    it.type = LBG_INIT;
    it.c = c;
    return push(&it);
}

ncclResult_t lb_group_defer_split(struct lb_split *s) {
    struct lb_gitem it;
    memset(&it, 0, sizeof it);
    it.type = LBG_SPLIT;
    it.split = s;
    ncclResult_t r = push(&it);
    if (r != ncclSuccess) lb_split_free(s);
    return r;
}

static void release_items(struct lb_gitem *items, int n) {
    for (int i = 0; i < n; i++) {
        if (items[i].type == LBG_SPLIT && items[i].split) lb_split_free(items[i].split);
        if (items[i].c) lb_comm_unref(items[i].c);
    }
    free(items);
}

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
static ncclResult_t enqueue_task(struct lb_comm *c, const struct lb_gitem *items, const int *idx,
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
                ret = enqueue_task(items[i].c, items, idx, m);
            }
        }
        free(done);
    }
    free(idx);
    release_items(items, n);
    if (ret == ncclSuccess && !blocking && n > 0) ret = ncclInProgress;
    return ret;
}

ncclResult_t ncclGroupStart(void) {
    if (t_depth == 0) {
        t_err = ncclSuccess;
        t_blocking = -1;
    }
    t_depth++;
    return ncclSuccess;
}
LB_ALIAS(ncclGroupStart)

/* Pop one level; at the outermost, hand the items to *items (NULL when nested). */
static ncclResult_t group_pop(struct lb_gitem **items, int *n, int *blocking) {
    *items = NULL;
    *n = 0;
    if (t_depth == 0) return lb_err(ncclInvalidUsage, "ncclGroupEnd: not in a group call.");
    if (--t_depth > 0) return ncclSuccess;
    *items = t_items;
    *n = t_n;
    *blocking = t_blocking != 0;
    t_items = NULL;
    t_n = t_cap = 0;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    struct lb_gitem *items;
    int n, blocking = 1;
    ncclResult_t r = group_pop(&items, &n, &blocking);
    if (r != ncclSuccess || t_depth > 0) return r;
    if (t_err != ncclSuccess) {
        r = (ncclResult_t)t_err;
        t_err = ncclSuccess;
        release_items(items, n);
        lb_win_group_end(1);
        return r;
    }
    if ((r = lb_win_group_end(0)) != ncclSuccess) { /* window calls first, as in NCCL */
        release_items(items, n);
        return r;
    }
    return group_launch(items, n, blocking, 0);
}
LB_ALIAS(ncclGroupEnd)

#if LB_AT_LEAST(2, 22, 3)
ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t *simInfo) {
    struct lb_gitem *items;
    int n, blocking = 1;
    ncclResult_t r = group_pop(&items, &n, &blocking);
    if (r != ncclSuccess || t_depth > 0) return r; /* nested: simInfo is ignored */
    if (t_err != ncclSuccess) {
        r = (ncclResult_t)t_err;
        t_err = ncclSuccess;
        release_items(items, n);
        lb_win_group_end(1);
        return r;
    }
    if ((r = lb_win_group_end(0)) != ncclSuccess) {
        release_items(items, n);
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
            release_items(items, n);
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

/* ---- argument checks -------------------------------------------------------------------- */

static ncclResult_t resolve_op(struct lb_comm *c, struct lb_op *op, const char *opname) {
    int api = op->api_op, dt = op->dtype;
    struct lb_redop *r = &op->rop;
    memset(r, 0, sizeof *r);
    r->api_op = api;
    if (api < 0) return lb_err(ncclInvalidArgument, "%s : invalid reduction operation %d", opname, api);
    if (api < LB_NUM_OPS) {
        switch (api) {
        case ncclSum: r->kind = LB_R_SUM; break;
        case ncclProd: r->kind = LB_R_PROD; break;
        case ncclMax: r->kind = LB_R_MAX; break;
        case ncclMin: r->kind = LB_R_MIN; break;
        default: /* ncclAvg: NCCL's SumPostDiv for integers, PreMulSum(1/n) for floats */
            if (lb_type_is_float(dt)) {
                r->kind = LB_R_PREMULSUM;
                r->scalar = lb_scalar_from_double(dt, 1.0 / c->nranks);
            } else {
                r->kind = LB_R_SUMPOSTDIV;
                r->divisor = c->nranks;
            }
            break;
        }
        return ncclSuccess;
    }
    int idx = api - LB_NUM_OPS;
    pthread_mutex_lock(&c->mu);
    int known = idx < c->nuops && c->uops[idx].used;
    struct lb_userop u;
    if (known) u = c->uops[idx];
    pthread_mutex_unlock(&c->mu);
    if (!known)
        return lb_err(ncclInvalidArgument, "%s : reduction operation %d unknown to this communicator",
                      opname, api);
    if (u.dtype != dt)
        return lb_err(ncclInvalidArgument,
                      "%s : Data type supplied to user-created ncclRedOp_t does not match type "
                      "given to reduction operation (%s vs %s)",
                      opname, lb_type_name(dt), lb_type_name(u.dtype));
    r->kind = LB_R_PREMULSUM;
    r->scalar = u.imm;
    r->scalar_is_ptr = u.residence == ncclScalarDevice;
    r->scalar_ptr = u.ptr;
    return ncclSuccess;
}

static ncclResult_t check_buf(const struct lb_comm *c, const void *p, size_t bytes,
                              const char *name, const char *opname) {
    if (bytes == 0) return ncclSuccess;
    if (p == NULL) return lb_err(ncclInvalidArgument, "%s : %s argument is NULL", opname, name);
    if (!c->strict) return ncclSuccess;
    int dev = -1;
    if (!pynccl_lb_find_alloc(p, bytes, &dev))
        return lb_err(ncclInvalidArgument,
                      "%s : %s %p (%zu bytes) does not lie inside a loopback device allocation "
                      "(cudaMalloc / ncclMemAlloc); set PYNCCL_LOOPBACK_STRICT=0 to allow host "
                      "memory",
                      opname, name, p, bytes);
    if (dev != c->dev)
        return lb_err(ncclInvalidArgument, "%s : %s allocated on device %d mismatchs with NCCL device %d",
                      opname, name, dev, c->dev);
    return ncclSuccess;
}

static int has_root(int kind) {
    return kind == LB_K_BROADCAST || kind == LB_K_REDUCE || kind == LB_K_GATHER ||
           kind == LB_K_SCATTER;
}

static ncclResult_t check_args(struct lb_comm *c, struct lb_op *op, cudaStream_t stream,
                               const char *opname) {
    ncclResult_t r = lb_comm_ensure_ready(c, opname);
    if (r != ncclSuccess) return r;
    const int R = c->nranks, me = c->rank, kind = op->kind;
    const int p2p = kind == LB_K_SEND || kind == LB_K_RECV;
    if (p2p || has_root(kind)) {
        if (op->root < 0 || op->root >= R)
            return lb_err(ncclInvalidArgument, "%s : invalid %s %d (%s should be in the 0..%d range)",
                          opname, p2p ? "peer" : "root", op->root, p2p ? "peer" : "root", R - 1);
    } else {
        op->root = -1;
    }
    if ((int)op->dtype < 0 || (int)op->dtype >= LB_NUM_TYPES)
        return lb_err(ncclInvalidArgument, "%s : invalid type %d (NCCL %d.%d.%d has %d types)",
                      opname, (int)op->dtype, LB_NCCL_VERSION_CODE / 10000,
                      LB_NCCL_VERSION_CODE / 100 % 100, LB_NCCL_VERSION_CODE % 100, LB_NUM_TYPES);
    if (kind == LB_K_ALLREDUCE || kind == LB_K_REDUCE || kind == LB_K_REDUCESCATTER) {
        if ((r = resolve_op(c, op, opname)) != ncclSuccess) return r;
    } else {
        memset(&op->rop, 0, sizeof op->rop);
        op->rop.kind = LB_R_SUM;
        op->api_op = -1;
    }
    size_t E = lb_type_size(op->dtype), nb, all;
    if (__builtin_mul_overflow(op->count, E, &nb) || __builtin_mul_overflow(nb, (size_t)R, &all) ||
        all > (size_t)PTRDIFF_MAX)
        return lb_err(ncclInvalidArgument, "%s : count %zu of %s overflows the address space", opname,
                      op->count, lb_type_name(op->dtype));
    size_t s = 0, rv = 0;
    const int is_root = me == op->root;
    switch (kind) {
    case LB_K_ALLREDUCE: s = nb; rv = nb; break;
    case LB_K_BROADCAST: s = is_root ? nb : 0; rv = nb; break;
    case LB_K_REDUCE: s = nb; rv = is_root ? nb : 0; break;
    case LB_K_ALLGATHER: s = nb; rv = all; break;
    case LB_K_REDUCESCATTER: s = all; rv = nb; break;
    case LB_K_ALLTOALL: s = all; rv = all; break;
    case LB_K_GATHER: s = nb; rv = is_root ? all : 0; break;
    case LB_K_SCATTER: s = is_root ? all : 0; rv = nb; break;
    case LB_K_SEND: s = nb; break;
    case LB_K_RECV: rv = nb; break;
    default: break;
    }
    if ((r = check_buf(c, op->sbuf, s, "sendbuff", opname)) != ncclSuccess) return r;
    if ((r = check_buf(c, op->rbuf, rv, "recvbuff", opname)) != ncclSuccess) return r;
    int sdev = pynccl_lb_stream_device(stream);
    if (sdev < 0)
        return lb_err(ncclUnhandledCudaError,
                      "%s : Cuda failure 'invalid resource handle': stream %p is not a live "
                      "loopback stream",
                      opname, (void *)stream);
    if (c->strict && !is_default_stream(stream) && sdev != c->dev)
        return lb_err(ncclInvalidArgument,
                      "%s : stream %p belongs to device %d but the communicator is on device %d",
                      opname, (void *)stream, sdev, c->dev);
    return ncclSuccess;
}

static ncclResult_t submit(struct lb_comm *c, cudaStream_t stream, const struct lb_op *op,
                           const char *opname) {
    if (op->kind < LB_K_SEND && op->count == 0) return ncclSuccess; /* NCCL drops empty ones */
#if LB_NULL
    (void)c;
    (void)stream;
    (void)opname;
    return ncclSuccess;
#else
    struct lb_gitem it;
    memset(&it, 0, sizeof it);
    it.type = LBG_OP;
    it.c = c;
    it.stream = stream;
    it.op = *op;
    if (t_depth > 0) {
        ncclResult_t r = lb_group_join_mode(c->blocking, opname);
        if (r != ncclSuccess) return r;
        return push(&it);
    }
    int idx = 0;
    return enqueue_task(c, &it, &idx, 1);
#endif
}

static ncclResult_t run_op(struct lb_op *op, ncclComm_t comm, cudaStream_t stream,
                           const char *opname) {
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r == ncclSuccess) r = check_args(c, op, stream, opname);
    if (r == ncclSuccess) r = submit(c, stream, op, opname);
    return lb_group_error(r);
}

static struct lb_op mkop(int kind, const void *s, void *r, size_t count, ncclDataType_t dt, int op,
                         int root) {
    struct lb_op o;
    memset(&o, 0, sizeof o);
    o.kind = kind;
    o.sbuf = s;
    o.rbuf = r;
    o.count = count;
    o.dtype = (int)dt;
    o.api_op = op;
    o.root = root;
    return o;
}

/* ---- the API -------------------------------------------------------------------------- */

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_ALLREDUCE, sendbuff, recvbuff, count, datatype, (int)op, -1);
    return run_op(&o, comm, stream, "AllReduce");
}
LB_ALIAS(ncclAllReduce)

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_BROADCAST, sendbuff, recvbuff, count, datatype, -1, root);
    return run_op(&o, comm, stream, "Broadcast");
}
LB_ALIAS(ncclBroadcast)

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
                       ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_BROADCAST, buff, buff, count, datatype, -1, root);
    return run_op(&o, comm, stream, "Broadcast");
}
LB_ALIAS(ncclBcast)

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                        ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                        cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_REDUCE, sendbuff, recvbuff, count, datatype, (int)op, root);
    return run_op(&o, comm, stream, "Reduce");
}
LB_ALIAS(ncclReduce)

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, -1, -1);
    return run_op(&o, comm, stream, "AllGather");
}
LB_ALIAS(ncclAllGather)

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, (int)op, -1);
    return run_op(&o, comm, stream, "ReduceScatter");
}
LB_ALIAS(ncclReduceScatter)

#if LB_AT_LEAST(2, 28, 3)
ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count,
                          ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_ALLTOALL, sendbuff, recvbuff, count, datatype, -1, -1);
    return run_op(&o, comm, stream, "AlltoAll");
}
LB_ALIAS(ncclAlltoAll)

ncclResult_t ncclGather(const void *sendbuff, void *recvbuff, size_t count,
                        ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_GATHER, sendbuff, recvbuff, count, datatype, -1, root);
    return run_op(&o, comm, stream, "Gather");
}
LB_ALIAS(ncclGather)

ncclResult_t ncclScatter(const void *sendbuff, void *recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_SCATTER, sendbuff, recvbuff, count, datatype, -1, root);
    return run_op(&o, comm, stream, "Scatter");
}
LB_ALIAS(ncclScatter)
#endif

#if LB_AT_LEAST(2, 7, 3)
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_SEND, sendbuff, NULL, count, datatype, -1, peer);
    return run_op(&o, comm, stream, "Send");
}
LB_ALIAS(ncclSend)

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_RECV, NULL, recvbuff, count, datatype, -1, peer);
    return run_op(&o, comm, stream, "Recv");
}
LB_ALIAS(ncclRecv)
#endif

/* ---- the 2.31+ *Config variants ------------------------------------------------------------
 * 2.31.2 rejected size < 64 and copied 64 bytes; 2.32.3 copies min(size, 72). Both check
 * forceAlgSelection and CTAPolicy; NULL means the plain call. */

#if LB_AT_LEAST(2, 31, 2)
#if LB_AT_LEAST(2, 32, 0)
#define LB_COLLCONFIG_SIZE sizeof(ncclCollConfig_t)
#else
#define LB_COLLCONFIG_SIZE offsetof(ncclCollConfig_t, launchCompletionEvent)
#endif

static ncclResult_t coll_config(const ncclCollConfig_t *cfg, struct lb_op *op, const char *opname) {
    if (cfg == NULL) return ncclSuccess;
    size_t size;
    memcpy(&size, &cfg->size, sizeof size);
#if !LB_AT_LEAST(2, 32, 0)
    if (size < LB_COLLCONFIG_SIZE)
        return lb_err(ncclInvalidArgument, "%s : ncclCollConfig_t size %zu is smaller than %zu",
                      opname, size, (size_t)LB_COLLCONFIG_SIZE);
#endif
    ncclCollConfig_t c;
    memset(&c, 0, sizeof c);
    c.forceAlgSelection = 1;
    c.CTAPolicy = NCCL_CONFIG_UNDEF_INT;
    memcpy(&c, cfg, size < LB_COLLCONFIG_SIZE ? size : LB_COLLCONFIG_SIZE);
    if (c.magic != NCCL_API_MAGIC)
        return lb_err(ncclInvalidArgument,
                      "%s : ncclCollConfig_t argument not initialized via "
                      "NCCL_COLLCONFIG_INITIALIZER (magic 0x%x)",
                      opname, c.magic);
    if (c.forceAlgSelection != 0 && c.forceAlgSelection != 1)
        return lb_err(ncclInvalidArgument, "%s : Invalid collConfig forceAlgSelection value %d",
                      opname, c.forceAlgSelection);
    if (c.CTAPolicy != NCCL_CONFIG_UNDEF_INT && (c.CTAPolicy < 0 || c.CTAPolicy > 3))
        return lb_err(ncclInvalidArgument, "%s : Invalid collConfig CTAPolicy value %d", opname,
                      c.CTAPolicy);
#if LB_AT_LEAST(2, 32, 0)
    if (size >= sizeof(ncclCollConfig_t)) op->launch_event = c.launchCompletionEvent;
#else
    (void)op;
#endif
    return ncclSuccess;
}

static ncclResult_t run_op_config(struct lb_op *op, ncclComm_t comm, cudaStream_t stream,
                                  const ncclCollConfig_t *cfg, const char *opname) {
    ncclResult_t r = coll_config(cfg, op, opname);
    if (r != ncclSuccess) return lb_group_error(r);
    return run_op(op, comm, stream, opname);
}

ncclResult_t ncclAllReduceConfig(const void *sendbuff, void *recvbuff, size_t count,
                                 ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                 cudaStream_t stream, const ncclCollConfig_t *config) {
    struct lb_op o = mkop(LB_K_ALLREDUCE, sendbuff, recvbuff, count, datatype, (int)op, -1);
    return run_op_config(&o, comm, stream, config, "AllReduce");
}
LB_ALIAS(ncclAllReduceConfig)

ncclResult_t ncclBroadcastConfig(const void *sendbuff, void *recvbuff, size_t count,
                                 ncclDataType_t datatype, int root, ncclComm_t comm,
                                 cudaStream_t stream, const ncclCollConfig_t *config) {
    struct lb_op o = mkop(LB_K_BROADCAST, sendbuff, recvbuff, count, datatype, -1, root);
    return run_op_config(&o, comm, stream, config, "Broadcast");
}
LB_ALIAS(ncclBroadcastConfig)

ncclResult_t ncclReduceConfig(const void *sendbuff, void *recvbuff, size_t count,
                              ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                              cudaStream_t stream, const ncclCollConfig_t *config) {
    struct lb_op o = mkop(LB_K_REDUCE, sendbuff, recvbuff, count, datatype, (int)op, root);
    return run_op_config(&o, comm, stream, config, "Reduce");
}
LB_ALIAS(ncclReduceConfig)

ncclResult_t ncclAllGatherConfig(const void *sendbuff, void *recvbuff, size_t sendcount,
                                 ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream,
                                 const ncclCollConfig_t *config) {
    struct lb_op o = mkop(LB_K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, -1, -1);
    return run_op_config(&o, comm, stream, config, "AllGather");
}
LB_ALIAS(ncclAllGatherConfig)

ncclResult_t ncclReduceScatterConfig(const void *sendbuff, void *recvbuff, size_t recvcount,
                                     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                     cudaStream_t stream, const ncclCollConfig_t *config) {
    struct lb_op o = mkop(LB_K_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, (int)op, -1);
    return run_op_config(&o, comm, stream, config, "ReduceScatter");
}
LB_ALIAS(ncclReduceScatterConfig)

ncclResult_t ncclAlltoAllConfig(const void *sendbuff, void *recvbuff, size_t count,
                                ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream,
                                const ncclCollConfig_t *config) {
    struct lb_op o = mkop(LB_K_ALLTOALL, sendbuff, recvbuff, count, datatype, -1, -1);
    return run_op_config(&o, comm, stream, config, "AlltoAll");
}
LB_ALIAS(ncclAlltoAllConfig)

ncclResult_t ncclGatherConfig(const void *sendbuff, void *recvbuff, size_t count,
                              ncclDataType_t datatype, int root, ncclComm_t comm,
                              cudaStream_t stream, const ncclCollConfig_t *config) {
    struct lb_op o = mkop(LB_K_GATHER, sendbuff, recvbuff, count, datatype, -1, root);
    return run_op_config(&o, comm, stream, config, "Gather");
}
LB_ALIAS(ncclGatherConfig)

ncclResult_t ncclScatterConfig(const void *sendbuff, void *recvbuff, size_t count,
                               ncclDataType_t datatype, int root, ncclComm_t comm,
                               cudaStream_t stream, const ncclCollConfig_t *config) {
    struct lb_op o = mkop(LB_K_SCATTER, sendbuff, recvbuff, count, datatype, -1, root);
    return run_op_config(&o, comm, stream, config, "Scatter");
}
LB_ALIAS(ncclScatterConfig)
#endif
