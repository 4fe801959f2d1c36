/*
 * pynccl loopback libnccl: a host-memory stand-in for NVIDIA NCCL, for machines
 * without a GPU. Built by pynccl.testing.loopback.build() into libnccl.so.2, linked
 * against the loopback libcudart (lb_internal.h is the interface between the two).
 *
 * What it is: the NCCL C API with NCCL's argument checks and error reporting, and
 * real data movement between ranks that are threads of one process or processes on
 * one host (POSIX shared memory, see nccl_transport.c). Collectives run, in stream
 * order, as tasks on the loopback streams' worker threads.
 *
 * Build-time macros:
 *   LB_NCCL_VERSION_CODE  release to emulate (default 23203 = 2.32.3): ncclGetVersion,
 *                         exported symbols, data types, ops, results and ncclConfig_t
 *                         fields follow that release.
 *   LB_NULL=1             collectives and p2p check their arguments and return without
 *                         moving data (measures the binding's own per-call cost).
 *   LB_USE_REAL_HEADERS   compile against the real <nccl.h> (signature check).
 *
 * Every PYNCCL_LOOPBACK_* value is parsed strictly (lb_env.h): a malformed one makes
 * every init and split fail with ncclInvalidArgument, naming the variable and value.
 * Environment, read when a communicator is created (init or split):
 *   PYNCCL_LOOPBACK_STRICT=0         accept buffers outside loopback allocations (host
 *                                    memory) and several ranks on one device; default 1.
 *   PYNCCL_LOOPBACK_FAIL_INIT=<r>    every init returns ncclResult_t r (fault injection).
 *   PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER=<N>[:<r>]
 *                                    after N operations (collective or p2p) the comm's
 *                                    async error becomes r (default ncclSystemError),
 *                                    pending work stops, other ranks get ncclRemoteError.
 *   PYNCCL_LOOPBACK_HANG=<N>         the N-th operation (1-based) blocks until the comm
 *                                    is aborted (or another rank fails).
 *   PYNCCL_LOOPBACK_NONBLOCKING_DELAY=<K>
 *                                    a non-blocking comm becomes ready only after K more
 *                                    ncclCommGetAsyncError polls returned ncclInProgress.
 *   PYNCCL_LOOPBACK_INIT_TIMEOUT=<s> give up waiting for ranks to join after s seconds
 *                                    (default 300, fractions allowed; 0 = wait forever).
 *   NCCL_COMM_BLOCKING=0|1           overrides ncclConfig_t.blocking, like NCCL.
 *   NCCL_DEBUG=WARN|INFO|TRACE       print each error message on stderr, like NCCL.
 * Read when the world is created (the first rank to arrive decides for all):
 *   PYNCCL_LOOPBACK_CHUNK_BYTES      collective slot size per rank (pipelining chunk).
 *   PYNCCL_LOOPBACK_RING_BYTES       p2p ring size per ordered pair of ranks.
 * Read at a communicator's first collective:
 *   PYNCCL_LOOPBACK_DIRECT=0         never read peers' buffers directly (stage every
 *                                    collective through the shared-memory slots).
 * Read at load: PYNCCL_LOOPBACK_SPIN / PYNCCL_LOOPBACK_YIELDS (busy-wait tuning: pauses
 * and sched_yield()s before sleeping on the futex; default 0 below 8 cores).
 *
 * Beyond NCCL (debugging aids): ranks that issue mismatched collectives get
 * ncclInvalidUsage with a message naming both sides instead of hanging; the death of
 * a peer process, or a peer's ncclCommAbort, stops the other ranks' pending work
 * within ~0.2 s with ncclRemoteError.
 */
#include "nccl_lb_internal.h"
#include "lb_env.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

/* ---- errors and logging ------------------------------------------------------------ */

static pthread_mutex_t g_err_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_last_error[1024]; /* process-wide, never cleared (like NCCL) */
static int g_debug = -1;

static int debug_level(void) {
    int d = __atomic_load_n(&g_debug, __ATOMIC_RELAXED);
    if (d >= 0) return d;
    const char *e = getenv("NCCL_DEBUG");
    d = (e && (!strcasecmp(e, "WARN") || !strcasecmp(e, "INFO") || !strcasecmp(e, "TRACE")))
            ? 1
            : 0;
    __atomic_store_n(&g_debug, d, __ATOMIC_RELAXED);
    return d;
}

void lb_vset_error(const char *fmt, va_list ap) {
    char buf[sizeof g_last_error];
    vsnprintf(buf, sizeof buf, fmt, ap);
    pthread_mutex_lock(&g_err_mu);
    memcpy(g_last_error, buf, sizeof buf);
    pthread_mutex_unlock(&g_err_mu);
    if (debug_level()) fprintf(stderr, "%d NCCL WARN [loopback] %s\n", (int)getpid(), buf);
}

void lb_set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    lb_vset_error(fmt, ap);
    va_end(ap);
}

ncclResult_t lb_err(ncclResult_t r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    lb_vset_error(fmt, ap);
    va_end(ap);
    return r;
}

uint64_t lb_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

long long lb_env_ll(const char *name, long long dflt) {
    const char *s = getenv(name);
    if (!s || !*s) return dflt;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 0);
    if (errno || end == s) return dflt;
    return v;
}

/* ---- versions and error strings ---------------------------------------------------- */

ncclResult_t ncclGetVersion(int *version) {
    if (version == NULL) return lb_err(ncclInvalidArgument, "ncclGetVersion : version argument is NULL");
    *version = LB_NCCL_VERSION_CODE;
    return ncclSuccess;
}
LB_ALIAS(ncclGetVersion)

const char *ncclGetErrorString(ncclResult_t result) {
    switch ((int)result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
#if LB_HAS_REMOTE_ERROR
    case ncclRemoteError: return "remote process exited or there was a network error";
#endif
#if LB_HAS_IN_PROGRESS
    case ncclInProgress: return "NCCL operation in progress";
#endif
#if LB_HAS_TIMEOUT
    case ncclTimeout: return "timeout";
#endif
    default: return "unknown result code";
    }
}
LB_ALIAS(ncclGetErrorString)

#if LB_AT_LEAST(2, 13, 4)
const char *ncclGetLastError(ncclComm_t comm) {
    (void)comm; /* NCCL ignores it: the buffer is process-wide */
    return g_last_error;
}
LB_ALIAS(ncclGetLastError)
#endif

#if LB_AT_LEAST(2, 24, 3)
void ncclResetDebugInit(void) { __atomic_store_n(&g_debug, -1, __ATOMIC_RELAXED); }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations" /* deprecated in nccl.h 2.32 */
LB_ALIAS(ncclResetDebugInit)
#pragma GCC diagnostic pop
#endif

/* ---- unique ids ---------------------------------------------------------------------
 * Layout (128 bytes): [0,8) random magic (non-zero) | [8,24) a sockaddr_in for
 * 127.0.0.1:<random port>, like NCCL's root address | [64,80) random tag |
 * [80,88) "PYNCCLLB" | rest zero. The world's shm name comes from magic and tag. */

static const char k_uid_sig[8] = {'P', 'Y', 'N', 'C', 'C', 'L', 'L', 'B'};

static void fill_random(unsigned char *p, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(p + got, n - got, 0);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        break;
    }
    if (got < n) { /* no getrandom: /dev/urandom, then a weak fallback */
        int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            while (got < n) {
                ssize_t r = read(fd, p + got, n - got);
                if (r <= 0) break;
                got += (size_t)r;
            }
            close(fd);
        }
        uint64_t x = lb_now_ns() ^ ((uint64_t)getpid() << 32);
        for (; got < n; got++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            p[got] = (unsigned char)x;
        }
    }
}

static void make_uid(unsigned char *u) {
    memset(u, 0, NCCL_UNIQUE_ID_BYTES);
    fill_random(u, 8);
    if (!u[0]) u[0] = 1;
    fill_random(u + 64, 16);
    u[8] = 2; /* AF_INET, little-endian sa_family */
    fill_random(u + 10, 2);
    u[12] = 127;
    u[15] = 1;
    memcpy(u + 80, k_uid_sig, sizeof k_uid_sig);
}

static int uid_valid(const unsigned char *u) { return memcmp(u + 80, k_uid_sig, sizeof k_uid_sig) == 0; }

void lb_make_uid(unsigned char *u) { make_uid(u); }
int lb_uid_valid(const unsigned char *u) { return uid_valid(u); }

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
    if (uniqueId == NULL) return lb_err(ncclInvalidArgument, "GetUniqueId : out argument is NULL");
    make_uid((unsigned char *)uniqueId->internal);
    return ncclSuccess;
}
LB_ALIAS(ncclGetUniqueId)

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

static struct lb_comm *comm_alloc(int nranks, int rank, int dev) {
    struct lb_comm *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->srcs = calloc((size_t)nranks, sizeof *c->srcs);
    c->scalars = calloc((size_t)nranks, sizeof *c->scalars);
    if (!c->srcs || !c->scalars) {
        free(c->srcs);
        free(c->scalars);
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->refs = 1;
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
    return c;
}

static void comm_free(struct lb_comm *c) {
    lb_rma_free(c);
    if (c->w) lbw_leave(c, LBR_LEFT);
    while (c->regs) {
        struct lb_reg *r = c->regs;
        c->regs = r->next;
        free(r);
    }
    free(c->uops);
    free(c->srcs);
    free(c->scalars);
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

ncclResult_t lb_comm_ensure_ready(struct lb_comm *c, const char *opname) {
    int st = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
    if (st == LBC_FAILED) return (ncclResult_t)__atomic_load_n(&c->async, __ATOMIC_ACQUIRE);
    if (st != LBC_READY || __atomic_load_n(&c->nb_pending, __ATOMIC_ACQUIRE))
        return lb_err(ncclInvalidArgument,
                      "%s : Attempt to use communicator before the previous operation returned "
                      "ncclSuccess",
                      opname);
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
    return lb_comm_check_stopped(c, opname);
}

ncclResult_t lb_comm_progress(struct lb_comm *c, int blocking) {
    int st = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
    if (st == LBC_READY) return ncclSuccess;
    if (st == LBC_FAILED) return (ncclResult_t)__atomic_load_n(&c->async, __ATOMIC_ACQUIRE);
    const char *opname = "ncclCommInitRank";
    ncclResult_t r = blocking ? lbw_wait_joined(c, opname) : lbw_check_joined(c, opname);
    if (r == ncclInProgress) return r;
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
    __atomic_store_n(&c->state, LBC_READY, __ATOMIC_RELEASE);
    return ncclSuccess;
}

static void drop_splits_of(struct lb_comm *parent);

/* Tear down after the comm's tasks stopped: leave the world, kill the handle. */
static void comm_teardown(struct lb_comm *c, enum lbw_rank_state state) {
    lb_comm_halt(c);
    lb_rma_quiesce(c); /* signal tasks leave the world before it is unmapped */
    drop_splits_of(c);
    handle_kill(c);
    lbw_leave(c, state);
    lb_comm_unref(c);
}

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
    return ncclSuccess;
}
#undef U

static void apply_config(struct lb_comm *c, const ncclConfig_t *cfg) {
    c->blocking = cfg->blocking;
    c->split_share = cfg->splitShare;
    c->comm_name = cfg->commName;
}

void lb_config_of(const struct lb_comm *c, ncclConfig_t *cfg) {
    config_defaults(cfg);
    cfg->blocking = c->blocking;
    cfg->splitShare = c->split_share;
    cfg->commName = c->comm_name;
#if LB_AT_LEAST(2, 29, 0)
    cfg->numRmaCtx = c->rma_ctx;
#endif
#if LB_AT_LEAST(2, 31, 0)
    cfg->numRmaSig = c->rma_sig;
#endif
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
static ncclResult_t comm_create(const unsigned char *uid, int nranks, int rank, int dev,
                                const ncclConfig_t *cfg, const char *opname,
                                struct lb_comm **out) {
    struct lb_comm *c = comm_alloc(nranks, rank, dev);
    if (!c) return lb_err(ncclSystemError, "%s : out of memory", opname);
    memcpy(c->uid, uid, NCCL_UNIQUE_ID_BYTES);
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) h = (h ^ c->uid[i]) * 0x100000001b3ULL;
    c->hash = h;
    apply_config(c, cfg);
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
    if (!handle_new(c)) {
        lbw_leave(c, LBR_FAILED);
        comm_free(c);
        return lb_err(ncclSystemError, "%s : out of memory", opname);
    }
    *out = c;
    return ncclSuccess;
}

/* A blocking init failed after the handle was made: undo everything. */
static void comm_abandon(struct lb_comm *c) { comm_teardown(c, LBR_FAILED); }

static ncclResult_t init_rank(ncclComm_t *newcomm, int nranks, const unsigned char *uid, int rank,
                              const ncclConfig_t *config, const char *opname) {
    if (newcomm == NULL) return lb_err(ncclInvalidArgument, "%s : newcomm argument is NULL", opname);
    *newcomm = NULL;
    ncclResult_t r = lb_fail_init_injected(opname);
    if (r != ncclSuccess) return lb_group_error(r);
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return lb_group_error(
            lb_err(ncclInvalidArgument, "%s : Invalid rank requested : %d/%d", opname, rank, nranks));
    if (!uid_valid(uid))
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : commId was not produced by the loopback's "
                                     "ncclGetUniqueId",
                                     opname));
    ncclConfig_t cfg;
    r = lb_parse_config(config, &cfg, opname);
    if (r != ncclSuccess) return lb_group_error(r);
    return lb_comm_start(uid, nranks, rank, pynccl_lb_current_device(), &cfg, opname, newcomm);
}

ncclResult_t lb_comm_start(const unsigned char *uid, int nranks, int rank, int dev,
                           const ncclConfig_t *cfg, const char *opname, ncclComm_t *newcomm) {
    int in_group = lb_group_depth() > 0;
    if (in_group) {
        ncclResult_t r = lb_group_join_mode(cfg->blocking, opname);
        if (r != ncclSuccess) return r;
    }
    struct lb_comm *c;
    ncclResult_t r = comm_create(uid, nranks, rank, dev, cfg, opname, &c);
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
        comm_abandon(c);
    }
    return r;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    return init_rank(comm, nranks, (const unsigned char *)commId.internal, rank, NULL,
                     "ncclCommInitRank");
}
LB_ALIAS(ncclCommInitRank)

#if LB_AT_LEAST(2, 14, 3)
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
    return init_rank(comm, nranks, (const unsigned char *)commId.internal, rank, config,
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
    /* every rank passes the same ids; the first one names the world */
    return init_rank(newcomm, nranks, (const unsigned char *)commIds[0].internal, myrank, config,
                     opname);
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
    make_uid(uid);
    ncclConfig_t cfg;
    lb_parse_config(NULL, &cfg, opname);
    cfg.blocking = 1;
    struct lb_comm **cs = calloc((size_t)ndev, sizeof *cs);
    if (!cs) return lb_err(ncclSystemError, "%s : out of memory", opname);
    for (int i = 0; i < ndev && r == ncclSuccess; i++)
        r = comm_create(uid, ndev, i, devlist ? devlist[i] : i, &cfg, opname, &cs[i]);
    for (int i = 0; i < ndev && r == ncclSuccess; i++) r = lb_comm_progress(cs[i], 1);
    for (int i = 0; i < ndev; i++) {
        if (r == ncclSuccess) {
            comms[i] = cs[i]->handle;
        } else {
            comms[i] = NULL;
            if (cs[i]) comm_abandon(cs[i]);
        }
    }
    free(cs);
    return r;
}
LB_ALIAS(ncclCommInitAll)

/* ---- split ----------------------------------------------------------------------------- */

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

uint64_t lb_mix64(uint64_t x) { return mix64(x); }

/* The id of a child world (split, shrink): the parent's, with its random parts salted. */
void lb_derive_uid(const unsigned char *parent, uint64_t salt, unsigned char *uid) {
    memcpy(uid, parent, NCCL_UNIQUE_ID_BYTES);
    uint64_t m, t0, t1;
    memcpy(&m, uid, 8);
    memcpy(&t0, uid + 64, 8);
    memcpy(&t1, uid + 72, 8);
    m = mix64(m ^ salt) | 1;
    t0 = mix64(t0 ^ salt);
    t1 = mix64(t1 ^ m);
    memcpy(uid, &m, 8);
    memcpy(uid + 64, &t0, 8);
    memcpy(uid + 72, &t1, 8);
}

void lb_split_free(struct lb_split *s) {
    if (s->child) comm_abandon(s->child);
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
    lb_derive_uid(p->uid, mix64(s->seq * 0x100000001ULL + (uint64_t)(uint32_t)s->color), uid);
    struct lb_comm *child;
    r = comm_create(uid, n, mine, p->dev, &s->config, "ncclCommSplit", &child);
    if (r != ncclSuccess) return r;
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

#if LB_AT_LEAST(2, 18, 1)
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
    const char *opname = "ncclCommSplit";
    struct lb_comm *p;
    ncclResult_t r = lb_comm_get(comm, opname, &p);
    if (r != ncclSuccess) return lb_group_error(r);
    if (newcomm == NULL)
        return lb_group_error(lb_err(ncclInvalidArgument, "%s : newcomm argument is NULL", opname));
    r = lb_comm_ensure_ready(p, opname);
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
static void progress_all_splits(void) {
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

#if LB_AT_LEAST(2, 4, 2)
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, "ncclGetAsyncError", &c);
    if (r != ncclSuccess) return r;
    if (asyncError == NULL)
        return lb_err(ncclInvalidArgument, "ncclGetAsyncError : asyncError argument is NULL");
    if (__atomic_load_n(&g_splits, __ATOMIC_ACQUIRE)) progress_all_splits();
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
    if (st == LBC_JOINING)
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

/* ---- teardown -------------------------------------------------------------------------- */

/* Wait until every task issued on c has completed (or the comm halted). */
void lb_comm_drain(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    while (!__atomic_load_n(&c->halt, __ATOMIC_ACQUIRE) && c->completed < c->issued)
        pthread_cond_wait(&c->cv, &c->mu);
    while (c->running) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

#if LB_AT_LEAST(2, 14, 3)
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    if (comm == NULL) return ncclSuccess;
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, "ncclCommFinalize", &c);
    if (r != ncclSuccess) return r;
    if (c->finalized)
        return lb_err(ncclInvalidArgument, "ncclCommFinalize : comm %p was already finalized",
                      (void *)comm);
    if (__atomic_load_n(&c->stopped, __ATOMIC_ACQUIRE) == LB_STOP_REVOKED)
        return lb_err(ncclInvalidUsage,
                      "ncclCommFinalize : comm %p was revoked: only ncclCommShrink, "
                      "ncclCommAbort and ncclCommDestroy may follow ncclCommRevoke",
                      (void *)comm);
    if (__atomic_load_n(&c->state, __ATOMIC_ACQUIRE) == LBC_JOINING)
        return lb_err(ncclInvalidArgument,
                      "ncclCommFinalize : Attempt to use communicator before the previous "
                      "operation returned ncclSuccess");
    lb_comm_drain(c);
    c->finalized = 1;
    return ncclSuccess;
}
LB_ALIAS(ncclCommFinalize)
#endif

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (comm == NULL) return ncclSuccess;
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, "ncclCommDestroy", &c);
    if (r != ncclSuccess) return r;
    lb_comm_drain(c); /* implicit finalize */
    int failed = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE) != LBC_READY;
    comm_teardown(c, failed ? LBR_FAILED : LBR_LEFT);
    return ncclSuccess;
}
LB_ALIAS(ncclCommDestroy)

#if LB_AT_LEAST(2, 4, 2)
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm == NULL) return ncclSuccess;
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, "ncclCommAbort", &c);
    if (r != ncclSuccess) return r;
    __atomic_store_n(&c->aborted, 1, __ATOMIC_RELEASE);
    lb_comm_halt(c);
    if (c->w) /* tell the other ranks; keep this process's last error */
        lbw_break(c, LB_HAS_REMOTE_ERROR ? ncclRemoteError : ncclSystemError, 0,
                  "rank %d called ncclCommAbort", c->rank);
    lb_comm_drain(c); /* running tasks see the abort within a sleep period */
    comm_teardown(c, LBR_FAILED);
    return ncclSuccess;
}
LB_ALIAS(ncclCommAbort)
#endif

/* ---- memory ------------------------------------------------------------------------------ */

#if LB_AT_LEAST(2, 19, 1)
/* ncclMemAlloc / ncclMemFree: nccl_window.c */

ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
    const char *opname = "ncclCommRegister";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if ((r = lb_comm_ensure_ready(c, opname)) != ncclSuccess) return r;
    if (buff == NULL || size == 0 || handle == NULL)
        return lb_err(ncclInvalidArgument, "%s : invalid buffer %p, size %zu or handle %p", opname,
                      buff, size, (void *)handle);
    int dev = -1;
    if (c->strict && !pynccl_lb_find_alloc(buff, size, &dev))
        return lb_err(ncclInvalidArgument,
                      "%s : buffer %p (%zu bytes) does not lie inside a loopback device "
                      "allocation",
                      opname, buff, size);
    struct lb_reg *reg = calloc(1, sizeof *reg);
    if (!reg) return lb_err(ncclSystemError, "%s : out of memory", opname);
    reg->buff = buff;
    reg->size = size;
    pthread_mutex_lock(&c->mu);
    reg->next = c->regs;
    c->regs = reg;
    pthread_mutex_unlock(&c->mu);
    *handle = reg;
    return ncclSuccess;
}
LB_ALIAS(ncclCommRegister)

ncclResult_t ncclCommDeregister(const ncclComm_t comm, void *handle) {
    const char *opname = "ncclCommDeregister";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    pthread_mutex_lock(&c->mu);
    for (struct lb_reg **pp = &c->regs; *pp; pp = &(*pp)->next) {
        if (*pp == handle) {
            struct lb_reg *reg = *pp;
            *pp = reg->next;
            pthread_mutex_unlock(&c->mu);
            free(reg);
            return ncclSuccess;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return lb_err(ncclInvalidArgument, "%s : handle %p is not registered with communicator %p",
                  opname, handle, (void *)comm);
}
LB_ALIAS(ncclCommDeregister)
#endif

/* ---- user reduction ops -------------------------------------------------------------------- */

#if LB_AT_LEAST(2, 11, 4)
ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
    const char *opname = "ncclRedOpCreatePreMulSum";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if ((r = lb_comm_ensure_ready(c, opname)) != ncclSuccess) return r;
    if (op == NULL) return lb_err(ncclInvalidArgument, "%s : op argument is NULL", opname);
    if (scalar == NULL) return lb_err(ncclInvalidArgument, "%s : scalar argument is NULL", opname);
    if ((int)datatype < 0 || (int)datatype >= LB_NUM_TYPES)
        return lb_err(ncclInvalidArgument, "%s : invalid type %d", opname, (int)datatype);
    if (residence != ncclScalarDevice && residence != ncclScalarHostImmediate)
        return lb_err(ncclInvalidArgument, "%s : invalid scalar residence %d", opname,
                      (int)residence);
    size_t E = lb_type_size(datatype);
    if (residence == ncclScalarDevice && c->strict && !pynccl_lb_find_alloc(scalar, E, NULL))
        return lb_err(ncclInvalidArgument,
                      "%s : device scalar %p does not lie inside a loopback device allocation",
                      opname, scalar);
    pthread_mutex_lock(&c->mu);
    int idx = 0;
    while (idx < c->nuops && c->uops[idx].used) idx++;
    if (idx == c->nuops) {
        int cap = c->nuops ? 2 * c->nuops : 4;
        struct lb_userop *u = realloc(c->uops, (size_t)cap * sizeof *u);
        if (!u) {
            pthread_mutex_unlock(&c->mu);
            return lb_err(ncclSystemError, "%s : out of memory", opname);
        }
        memset(u + c->nuops, 0, (size_t)(cap - c->nuops) * sizeof *u);
        c->uops = u;
        c->nuops = cap;
    }
    struct lb_userop *u = &c->uops[idx];
    u->used = 1;
    u->dtype = (int)datatype;
    u->residence = (int)residence;
    u->imm = 0;
    u->ptr = NULL;
    if (residence == ncclScalarHostImmediate)
        memcpy(&u->imm, scalar, E);
    else
        u->ptr = scalar;
    pthread_mutex_unlock(&c->mu);
    *op = (ncclRedOp_t)(LB_NUM_OPS + idx);
    return ncclSuccess;
}
LB_ALIAS(ncclRedOpCreatePreMulSum)

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
    const char *opname = "ncclRedOpDestroy";
    if ((int)op >= 0 && (int)op < LB_NUM_OPS)
        return lb_err(ncclInvalidArgument, "%s : operator is a NCCL builtin.", opname);
    if ((int)op < 0) return lb_err(ncclInvalidArgument, "%s :  operator is garbage.", opname);
    if (comm == NULL) return lb_err(ncclInvalidArgument, "%s : invalid communicator passed.", opname);
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    int idx = (int)op - LB_NUM_OPS;
    pthread_mutex_lock(&c->mu);
    int ok = idx < c->nuops && c->uops[idx].used;
    if (ok) c->uops[idx].used = 0;
    pthread_mutex_unlock(&c->mu);
    if (!ok) return lb_err(ncclInvalidArgument, "%s : operator unknown to this communicator.", opname);
    return ncclSuccess;
}
LB_ALIAS(ncclRedOpDestroy)
#endif
