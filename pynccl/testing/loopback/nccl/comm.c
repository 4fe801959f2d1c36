/*
 * Communicator objects of the loopback libnccl: handles, references, state, creation
 * (a rank joining its world), splits in progress, teardown, and the revoked/shrunk/
 * suspended stops every call checks.
 *
 * comm.c and group.c call each other (as in NCCL): a comm created or split inside a
 * group is deferred to the group's end; a group item holds a reference to its comm.
 * That is the one cycle among the nccl/ files.
 */
#include "internal.h"
#include "lb_env.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

/* ---- communicator objects ----------------------------------------------------------- */

static pthread_mutex_t g_handles_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ncclComm *g_handles; /* every handle ever made (kept reachable on purpose) */

static struct ncclComm *handle_new(struct lb_comm *c) {
    struct ncclComm *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->magic = LB_HANDLE_LIVE;
    h->c = c;
    pthread_mutex_lock(&g_handles_mu);
    h->next_all = g_handles;
    g_handles = h;
    pthread_mutex_unlock(&g_handles_mu);
    c->handle = h;
    return h;
}

static void handle_kill(struct lb_comm *c) {
    struct ncclComm *h = c->handle;
    if (!h) return;
    __atomic_store_n(&h->magic, LB_HANDLE_DEAD, __ATOMIC_RELEASE);
    h->c = NULL;
    c->handle = NULL;
}

ncclResult_t lb_comm_get(ncclComm_t comm, const char *opname, struct lb_comm **out) {
    if (comm == NULL) return lb_err(ncclInvalidArgument, "%s : comm argument is NULL", opname);
    if (__atomic_load_n(&comm->magic, __ATOMIC_ACQUIRE) != LB_HANDLE_LIVE || comm->c == NULL)
        return lb_err(ncclInvalidArgument,
                      "%s : invalid communicator %p (destroyed, aborted, or not a communicator)",
                      opname, (void *)comm);
    *out = comm->c;
    return ncclSuccess;
}

/* Every PYNCCL_LOOPBACK_* variable libnccl reads, with lb_env.h's rules: checked at
 * each init and split (env_check), so a malformed value is an init error naming it; the
 * call sites below then read them with the same parsers. */
static const lb_env_spec g_env_specs[] = {
    {"PYNCCL_LOOPBACK_STRICT", LB_ENV_BOOL, 1},
    {"PYNCCL_LOOPBACK_FAIL_INIT", LB_ENV_UINT, ncclNumResults - 1},
    {"PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER", LB_ENV_COUNT_CODE, ncclNumResults - 1},
    {"PYNCCL_LOOPBACK_HANG", LB_ENV_UINT, LB_ENV_MAX_COUNT},
    {"PYNCCL_LOOPBACK_NONBLOCKING_DELAY", LB_ENV_UINT, LB_ENV_MAX_INT},
    {"PYNCCL_LOOPBACK_INIT_TIMEOUT", LB_ENV_SECONDS, 0},
    {"PYNCCL_INIT_REPORT", LB_ENV_SECONDS, 0},
    {"PYNCCL_LOOPBACK_CHUNK_BYTES", LB_ENV_UINT, LB_ENV_MAX_INT},
    {"PYNCCL_LOOPBACK_RING_BYTES", LB_ENV_UINT, LB_ENV_MAX_INT},
    {"PYNCCL_LOOPBACK_DIRECT", LB_ENV_BOOL, 1},
    {"PYNCCL_LOOPBACK_SPIN", LB_ENV_UINT, LB_ENV_MAX_INT},
    {"PYNCCL_LOOPBACK_YIELDS", LB_ENV_UINT, LB_ENV_MAX_INT},
    {"PYNCCL_LOOPBACK_RENDEZVOUS_DIR", LB_ENV_DIR, 0},
};

static ncclResult_t env_check(const char *opname) {
    char why[256];
    if (lb_env_check(g_env_specs, sizeof g_env_specs / sizeof *g_env_specs, why, sizeof why))
        return ncclSuccess;
    return lb_err(ncclInvalidArgument, "%s : %s", opname, why);
}

static void parse_fail_after(struct lb_comm *c) {
    bool set;
    unsigned long long n;
    int code;
    lb_env_count_code("PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER", LB_ENV_MAX_COUNT, ncclNumResults - 1,
                      &set, &n, &code, ncclSystemError, NULL, 0);
    c->fail_after = set ? (long long)n : -1;
    c->fail_code = code;
}

/* NCCL's per-communicator work FIFO (init.cc: NCCL_WORK_FIFO_BYTES, default 1 MiB; a
 * value that is not a power of two is ignored, at most 1 GiB). Launches that find it
 * full block the issuing thread until earlier work retires (launch.c). */
#define LB_WORK_FIFO_DEFAULT ((size_t)1 << 20)
static size_t work_fifo_bytes(void) {
    long long v = lb_env_ll("NCCL_WORK_FIFO_BYTES", (long long)LB_WORK_FIFO_DEFAULT);
    if (v <= 0 || (v & (v - 1)) != 0) return LB_WORK_FIFO_DEFAULT;
    return v > (1LL << 30) ? (size_t)1 << 30 : (size_t)v;
}

static struct lb_comm *comm_alloc(int nranks, int rank, int dev) {
    struct lb_comm *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->srcs = calloc((size_t)nranks, sizeof *c->srcs);
    c->scalars = calloc((size_t)nranks, sizeof *c->scalars);
    c->p2p_conn = calloc((size_t)nranks, 1);
    if (!c->srcs || !c->scalars || !c->p2p_conn) {
        free(c->srcs);
        free(c->scalars);
        free(c->p2p_conn);
        free(c);
        return NULL;
    }
    c->mm_refs = malloc(sizeof *c->mm_refs);
    if (!c->mm_refs) {
        free(c->srcs);
        free(c->scalars);
        free(c->p2p_conn);
        free(c);
        return NULL;
    }
    *c->mm_refs = 1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->refs = 1;
    c->fifo_cap = work_fifo_bytes();
    c->rv_fd = c->seg_fd = -1;
    c->nranks = nranks;
    c->rank = rank;
    c->dev = dev;
    c->pid = getpid();
    c->blocking = 1;
    c->state = LBC_JOINING;
    c->async = ncclSuccess;
    bool strict;
    unsigned long long hang, delay;
    double tmo;
    lb_env_bool("PYNCCL_LOOPBACK_STRICT", true, &strict, NULL, 0);
    c->strict = strict;
    parse_fail_after(c);
    lb_env_uint("PYNCCL_LOOPBACK_HANG", 0, LB_ENV_MAX_COUNT, &hang, NULL, 0);
    c->hang_at = (long long)hang;
    lb_env_uint("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", 0, LB_ENV_MAX_INT, &delay, NULL, 0);
    c->nb_polls_left = (int)delay;
    lb_env_seconds("PYNCCL_LOOPBACK_INIT_TIMEOUT", 300, &tmo, NULL, 0);
    c->init_deadline_ns = tmo > 0 ? lb_now_ns() + (uint64_t)(tmo * 1e9) : 0;
    lb_init_report_setup(c);
    return c;
}

static void comm_free(struct lb_comm *c) {
    lb_ras_comm_remove(c); /* a no-op once teardown removed it */
    lb_joining_remove(c); /* before the world is unmapped: the query reads it */
    lb_rma_free(c);
    if (c->w) lbw_leave(c, LBR_LEFT); /* unmapped at the last reference (see teardown) */
    if (__atomic_sub_fetch(c->mm_refs, 1, __ATOMIC_ACQ_REL) == 0) free(c->mm_refs);
    while (c->regs) {
        struct lb_reg *r = c->regs;
        c->regs = r->next;
        free(r);
    }
    free(c->uops);
    free(c->srcs);
    free(c->scalars);
    free(c->p2p_conn);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

void lb_comm_ref(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    c->refs++;
    pthread_mutex_unlock(&c->mu);
}

void lb_comm_unref(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left == 0) comm_free(c);
}

void lb_comm_halt(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    __atomic_store_n(&c->halt, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void lb_comm_fail(struct lb_comm *c, ncclResult_t code, const char *fmt, ...) {
    char msg[512] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        lb_set_error("%s", msg);
    }
    if (code == LB_ABORTED) {
        lb_comm_halt(c);
        return;
    }
    int expected = ncclSuccess;
    __atomic_compare_exchange_n(&c->async, &expected, (int)code, 0, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    lb_comm_halt(c);
    if (c->w && !__atomic_load_n(&c->w->broken, __ATOMIC_ACQUIRE)) {
        ncclResult_t others = code == ncclInvalidUsage ? ncclInvalidUsage
                                                       : (LB_HAS_REMOTE_ERROR ? ncclRemoteError
                                                                              : ncclSystemError);
        if (fmt)
            lbw_break(c, others, 0, "rank %d failed: %s", c->rank, msg);
        else
            lbw_break(c, others, 0, "rank %d failed with %s", c->rank, ncclGetErrorString(code));
    }
}

void lb_comm_set_async(struct lb_comm *c, ncclResult_t r) {
    int expected = ncclSuccess;
    __atomic_compare_exchange_n(&c->async, &expected, (int)r, 0, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    lb_comm_halt(c);
}

void lb_comm_share_memory(struct lb_comm *child, struct lb_comm *parent) {
    if (child->mm_refs == parent->mm_refs) return;
    if (__atomic_sub_fetch(child->mm_refs, 1, __ATOMIC_ACQ_REL) == 0) free(child->mm_refs);
    __atomic_add_fetch(parent->mm_refs, 1, __ATOMIC_ACQ_REL);
    child->mm_refs = parent->mm_refs;
}

/* NCCL's ncclCommEnsureReady: the async error, or ncclInvalidArgument while the comm
 * is in progress (joining, a non-blocking group end, finalize, split or revoke in
 * flight); then the loopback's stops. A revoked comm passes for split and shrink. */
static ncclResult_t ensure(struct lb_comm *c, const char *opname, int revoked_ok) {
    int st = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
    if (st == LBC_FAILED) return (ncclResult_t)__atomic_load_n(&c->async, __ATOMIC_ACQUIRE);
    int revoked = __atomic_load_n(&c->stopped, __ATOMIC_ACQUIRE) == LB_STOP_REVOKED;
    if (st != LBC_READY || __atomic_load_n(&c->nb_pending, __ATOMIC_ACQUIRE) ||
        lb_gjob_pending(c) || (revoked && lb_comm_revoke_state(c) == ncclInProgress)) {
        /* NCCL's failed call on a non-blocking comm also sets its async result (until the
         * group job in flight ends and sets it again): the polls read the error meanwhile */
        if (!c->blocking && lb_gjob_pending(c))
            __atomic_store_n(&c->poison, (int)ncclInvalidArgument, __ATOMIC_RELEASE);
        return lb_err(ncclInvalidArgument,
                      "%s : Attempt to use communicator before the previous operation returned "
                      "ncclSuccess",
                      opname);
    }
    int a = __atomic_load_n(&c->async, __ATOMIC_ACQUIRE);
    if (a != ncclSuccess) return (ncclResult_t)a;
    ncclResult_t b = lbw_broken(c);
    if (b != ncclSuccess) {
        lb_comm_fail(c, b, NULL);
        return b;
    }
    if (c->finalized)
        return lb_err(ncclInvalidUsage, "%s : communicator %p was finalized", opname,
                      (void *)c->handle);
    if (revoked && revoked_ok) return ncclSuccess;
    return lb_comm_check_stopped(c, opname);
}

ncclResult_t lb_comm_ensure_ready(struct lb_comm *c, const char *opname) {
    return ensure(c, opname, 0);
}

ncclResult_t lb_comm_ensure_ready_revoked(struct lb_comm *c, const char *opname) {
    return ensure(c, opname, 1);
}

ncclResult_t lb_comm_progress(struct lb_comm *c, int blocking) {
    int st = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
    if (st == LBC_READY) return ncclSuccess;
    if (st == LBC_FAILED) return (ncclResult_t)__atomic_load_n(&c->async, __ATOMIC_ACQUIRE);
    const char *opname = "ncclCommInitRank";
    ncclResult_t r = blocking ? lbw_wait_joined(c, opname) : lbw_check_joined(c, opname);
    if (r == ncclInProgress) return r;
    lb_joining_remove(c);
    if (r != ncclSuccess) {
        __atomic_store_n(&c->async, (int)r, __ATOMIC_RELEASE);
        __atomic_store_n(&c->state, LBC_FAILED, __ATOMIC_RELEASE);
        __atomic_store_n(&c->halt, 1, __ATOMIC_RELEASE);
        return r;
    }
    if (!blocking && c->nb_polls_left > 0) {
        c->nb_polls_left--;
        return ncclInProgress;
    }
    lb_info_comm_ready(c);
    __atomic_store_n(&c->state, LBC_READY, __ATOMIC_RELEASE);
    return ncclSuccess;
}

static void drop_splits_of(struct lb_comm *parent);

/* Tear down after the comm's tasks stopped: leave the world, kill the handle. Once only
 * (a destroy waiting in another thread and an abort may both get here); the world stays
 * mapped until the last reference goes, since such a waiting call may still read it. */
void lb_comm_teardown(struct lb_comm *c, enum lbw_rank_state state) {
    pthread_mutex_lock(&c->mu);
    int first = c->handle != NULL;
    if (first) handle_kill(c);
    pthread_mutex_unlock(&c->mu);
    if (!first) return;
    lb_ras_comm_remove(c);
    lb_comm_halt(c);
    lb_rma_quiesce(c); /* signal tasks are done with the world */
    drop_splits_of(c);
    lbw_depart(c, state);
    lb_comm_unref(c);
}

/* ---- init ------------------------------------------------------------------------------ */

ncclResult_t lb_fail_init_injected(const char *opname) {
    ncclResult_t r = env_check(opname);
    if (r != ncclSuccess) return r;
    unsigned long long code;
    lb_env_uint("PYNCCL_LOOPBACK_FAIL_INIT", 0, ncclNumResults - 1, &code, NULL, 0);
    if (code == 0) return ncclSuccess;
    return lb_err((ncclResult_t)code, "%s : failing on purpose (PYNCCL_LOOPBACK_FAIL_INIT=%llu)",
                  opname, code);
}

/* Create a comm object for `rank` and join its world; the comm is JOINING. */
ncclResult_t lb_comm_create(const unsigned char *uid, int nranks, int rank, int dev,
                                const ncclConfig_t *cfg, const char *opname,
                                struct lb_comm **out) {
    struct lb_comm *c = comm_alloc(nranks, rank, dev);
    if (!c) return lb_err(ncclSystemError, "%s : out of memory", opname);
    memcpy(c->uid, uid, NCCL_UNIQUE_ID_BYTES);
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) h = (h ^ c->uid[i]) * 0x100000001b3ULL;
    c->hash = h;
    lb_apply_config(c, cfg);
    ncclResult_t r = lb_rma_setup(c, cfg, opname);
    if (r != ncclSuccess) {
        comm_free(c);
        return r;
    }
    r = lbw_join(c, opname);
    if (r != ncclSuccess) {
        comm_free(c);
        return r;
    }
    lb_joining_add(c);
    if (!handle_new(c)) {
        lbw_leave(c, LBR_FAILED);
        comm_free(c);
        return lb_err(ncclSystemError, "%s : out of memory", opname);
    }
    lb_ras_comm_add(c);
    *out = c;
    return ncclSuccess;
}

/* A blocking init failed after the handle was made: undo everything. */
void lb_comm_abandon(struct lb_comm *c) { lb_comm_teardown(c, LBR_FAILED); }

ncclResult_t lb_comm_start(const unsigned char *uid, int nranks, int rank, int dev,
                           const ncclConfig_t *cfg, const char *opname, ncclComm_t *newcomm) {
    int in_group = lb_group_depth() > 0;
    if (in_group) {
        ncclResult_t r = lb_group_join_mode(cfg->blocking, opname);
        if (r != ncclSuccess) return r;
    }
    struct lb_comm *c;
    ncclResult_t r = lb_comm_create(uid, nranks, rank, dev, cfg, opname, &c);
    if (r != ncclSuccess) return lb_group_error(r);
    *newcomm = c->handle;
    if (in_group) {
        r = lb_group_defer_init(c);
        if (r != ncclSuccess) return r;
        return c->blocking ? ncclSuccess : ncclInProgress;
    }
    if (!c->blocking) return ncclInProgress;
    r = lb_comm_progress(c, 1);
    if (r != ncclSuccess) {
        *newcomm = NULL;
        lb_comm_abandon(c);
    }
    return r;
}

/* ---- splits ---------------------------------------------------------------------------- */

void lb_split_free(struct lb_split *s) {
    if (s->child) lb_comm_abandon(s->child);
    lb_comm_unref(s->parent);
    free(s);
}

/* Stage 0 -> 1: read everyone's (color, key), create and join the child's world. */
static ncclResult_t split_gather(struct lb_split *s, int blocking) {
    struct lb_comm *p = s->parent;
    int R = p->nranks;
    int *colors = malloc(2 * (size_t)R * sizeof(int));
    if (!colors) return lb_err(ncclSystemError, "ncclCommSplit : out of memory");
    int *keys = colors + R, done = 0;
    ncclResult_t r = lbw_split_gather(p, s->seq, colors, keys, blocking, &done);
    if (r != ncclSuccess || !done) {
        free(colors);
        return r != ncclSuccess ? r : ncclInProgress;
    }
    s->stage = 1;
    if (s->color == NCCL_SPLIT_NOCOLOR) {
        free(colors);
        return ncclSuccess;
    }
    /* child rank: order by (key, parent rank) among the ranks of my color */
    int n = 0, mine = 0;
    for (int q = 0; q < R; q++) {
        if (colors[q] != s->color) continue;
        if (keys[q] < s->key || (keys[q] == s->key && q < p->rank)) mine++;
        n++;
    }
    free(colors);
    unsigned char uid[NCCL_UNIQUE_ID_BYTES];
    lb_derive_uid(p->uid, lb_mix64(s->seq * 0x100000001ULL + (uint64_t)(uint32_t)s->color), uid);
    struct lb_comm *child;
    r = lb_comm_create(uid, n, mine, p->dev, &s->config, "ncclCommSplit", &child);
    if (r != ncclSuccess) return r;
    /* NCCL: the parent's splitShare; never from a revoked parent */
    if (p->split_share && __atomic_load_n(&p->stopped, __ATOMIC_ACQUIRE) != LB_STOP_REVOKED)
        lb_comm_share_memory(child, p);
    s->child = child;
    return ncclSuccess;
}

ncclResult_t lb_split_progress(struct lb_split *s, int blocking) {
    if (s->stage == 0) {
        ncclResult_t r = split_gather(s, blocking);
        if (r != ncclSuccess) return r;
    }
    if (s->stage == 1) {
        if (s->child) {
            ncclResult_t r = lb_comm_progress(s->child, blocking);
            if (r != ncclSuccess) return r;
            *s->out = s->child->handle;
            s->child = NULL; /* handed to the user */
        }
        s->stage = 2;
    }
    return ncclSuccess;
}

/* Group end, pass 1: everyone's post is there (made at call time); join the child. */
ncclResult_t lb_split_stage_join(struct lb_split *s) {
    return s->stage == 0 ? split_gather(s, 1) : ncclSuccess;
}

static pthread_mutex_t g_splits_mu = PTHREAD_MUTEX_INITIALIZER;
static struct lb_split *g_splits; /* every nonblocking split in progress in this process */

void lb_split_defer(struct lb_split *s) {
    pthread_mutex_lock(&g_splits_mu);
    s->next = g_splits;
    g_splits = s;
    __atomic_add_fetch(&s->parent->nb_pending, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_splits_mu);
}

/* One non-blocking step for every pending split; finished ones leave the list. */
void lb_splits_progress_all(void) {
    if (!__atomic_load_n(&g_splits, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&g_splits_mu);
    for (struct lb_split **pp = &g_splits; *pp;) {
        struct lb_split *s = *pp;
        ncclResult_t r = lb_split_progress(s, 0);
        if (r == ncclInProgress) {
            pp = &s->next;
            continue;
        }
        *pp = s->next;
        if (r != ncclSuccess) lb_comm_fail(s->parent, r, NULL);
        __atomic_sub_fetch(&s->parent->nb_pending, 1, __ATOMIC_RELEASE);
        lb_split_free(s);
    }
    pthread_mutex_unlock(&g_splits_mu);
}

static void drop_splits_of(struct lb_comm *parent) {
    pthread_mutex_lock(&g_splits_mu);
    for (struct lb_split **pp = &g_splits; *pp;) {
        struct lb_split *s = *pp;
        if (s->parent != parent) {
            pp = &s->next;
            continue;
        }
        *pp = s->next;
        __atomic_sub_fetch(&parent->nb_pending, 1, __ATOMIC_RELEASE);
        lb_split_free(s);
    }
    pthread_mutex_unlock(&g_splits_mu);
}

/* ---- streams ----------------------------------------------------------------------------- */

int lb_is_default_stream(cudaStream_t s) {
    return s == NULL || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

ncclResult_t lb_check_stream(const struct lb_comm *c, cudaStream_t stream, const char *opname) {
    int sdev = pynccl_lb_stream_device(stream);
    if (sdev < 0)
        return lb_err(ncclUnhandledCudaError,
                      "%s : Cuda failure 'invalid resource handle': stream %p is not a live "
                      "loopback stream",
                      opname, (void *)stream);
    if (c->strict && !lb_is_default_stream(stream) && sdev != c->dev)
        return lb_err(ncclInvalidArgument,
                      "%s : stream %p belongs to device %d but the communicator is on device %d",
                      opname, (void *)stream, sdev, c->dev);
    return ncclSuccess;
}

/* ---- stops: revoked, shrunk, suspended ------------------------------------------------ */

ncclResult_t lb_comm_check_stopped(struct lb_comm *c, const char *opname) {
    int st = __atomic_load_n(&c->stopped, __ATOMIC_ACQUIRE);
    if (st == LB_STOP_REVOKED)
        return lb_err(ncclInvalidUsage,
                      "%s : communicator %p was revoked (ncclCommRevoke): only ncclCommSplit, "
                      "ncclCommShrink, ncclCommAbort and ncclCommDestroy may use it",
                      opname, (void *)c->handle);
    if (st == LB_STOP_SHRUNK)
        return lb_err(ncclInvalidUsage,
                      "%s : communicator %p was shrunk with NCCL_SHRINK_ABORT, which terminated "
                      "its operations: destroy or abort it",
                      opname, (void *)c->handle);
    if (__atomic_load_n(&c->suspended, __ATOMIC_ACQUIRE))
        return lb_err(ncclInvalidUsage,
                      "%s : communicator %p is suspended (ncclCommSuspend): call ncclCommResume "
                      "first",
                      opname, (void *)c->handle);
    return ncclSuccess;
}

int lb_comm_quiescent(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    int q = c->retired >= c->issued && c->running == 0 && c->rma_running == 0;
    pthread_mutex_unlock(&c->mu);
    return q;
}

ncclResult_t lb_comm_revoke_state(struct lb_comm *c) {
    int a = __atomic_load_n(&c->async, __ATOMIC_ACQUIRE);
    if (a != ncclSuccess) return (ncclResult_t)a;
#if LB_HAS_IN_PROGRESS
    if (!lb_comm_quiescent(c)) return ncclInProgress;
#endif
    /* quiescent: NCCL resets the abort flags, so that split and shrink can talk again */
    __atomic_store_n(&c->cancel, 0, __ATOMIC_RELEASE);
    return ncclSuccess;
}
