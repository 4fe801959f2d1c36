/*
 * pynccl loopback libnccl: a host-memory stand-in for NVIDIA NCCL, for machines
 * without a GPU. Built by pynccl.testing.loopback.build() into libnccl.so.2, linked
 * against the loopback libcudart (lb_internal.h is the interface between the two).
 *
 * What it is: the NCCL C API with NCCL's argument checks and error reporting, and
 * real data movement between ranks that are threads of one process or processes on
 * one host (shared memory, see world.c). Collectives run, in stream
 * order, as tasks on the loopback streams' worker threads.
 *
 * core.c is the leaf every other file builds on: errors and logging, the environment,
 * the clock, versions and error strings, unique ids, kind and op names. Nothing here
 * calls another nccl file.
 *
 * Files, bottom to top (each calls only those before it, but for the pair comm/group):
 * core.c, reduce.c (element types and reductions), debug.c (NCCL_DEBUG=INFO lines),
 * crypto.c (ncclSetEncryption),
 * param.c (the parameter API), config.c (ncclConfig_t), sync.c (waits, broken worlds,
 * dead peers), initwait.c (the inits under way, and the ranks they wait for), world.c (a
 * communicator's shared-memory world: create, join, leave),
 * ras_fmt.c and ras.c (NCCL's RAS service: its reports, and the listener thread answering
 * from the worlds of this process's communicators), exec.c (collectives over the world),
 * p2p.c (send/recv rings), window.c (ncclMemAlloc, window objects, a comm's RMA state),
 * comm.c and group.c (communicator objects and the calling thread's open group: the one cycle, as in NCCL, since a comm made inside
 * a group is deferred to its end and a group item holds its comm), gjob.c (jobs on worker
 * threads: non-blocking group ends and finalize), teardown.c (finalize, destroy, abort
 * and what they wait for), init.c (init, split, queries), fault.c (revoke, shrink, grow),
 * suspend.c, redop.c (registration, user reduction ops), props.c (properties, teams),
 * signal.c (one-sided put/signal/wait), winreg.c (window registration), launch.c (tasks
 * on the streams, the work queue, ncclGroupEnd), enqueue.c (the collective and p2p entry
 * points).
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
 *                                    ncclCommGetAsyncError polls returned ncclInProgress;
 *                                    read at each non-blocking group end (an operation
 *                                    outside a group included) and finalize too: their
 *                                    worker waits for K such polls of its comms first.
 *   NCCL_WORK_FIFO_BYTES=<2^k>       a communicator's work queue, like NCCL's work FIFO
 *                                    (default 1 MiB): a launch that finds it full blocks
 *                                    the issuing thread until earlier work has run.
 *   PYNCCL_LOOPBACK_INIT_TIMEOUT=<s> give up waiting for ranks to join after s seconds
 *                                    (default 300, fractions allowed; 0 = wait forever).
 *   PYNCCL_INIT_REPORT=<s>           while init waits, a WARN line naming the ranks not
 *                                    joined yet every s seconds and at the timeout
 *                                    (default 30; 0 = none; shown with NCCL_DEBUG=WARN|INFO).
 *   NCCL_COMM_BLOCKING=0|1           overrides ncclConfig_t.blocking, like NCCL.
 *   NCCL_DEBUG=WARN|INFO|TRACE       print each error message on stderr, like NCCL.
 * Read when the world is created (the first rank to arrive decides for all):
 *   PYNCCL_LOOPBACK_CHUNK_BYTES      collective slot size per rank (pipelining chunk).
 *   PYNCCL_LOOPBACK_RING_BYTES       p2p ring size per ordered pair of ranks.
 *   PYNCCL_LOOPBACK_RENDEZVOUS_DIR=<dir>  ranks meet through a socket file there instead
 *                                    of an abstract socket (which is per network namespace).
 * Read at a communicator's first collective:
 *   PYNCCL_LOOPBACK_DIRECT=0         never read peers' buffers directly (stage every
 *                                    collective through the shared-memory slots).
 * Read at load: PYNCCL_LOOPBACK_SPIN / PYNCCL_LOOPBACK_YIELDS (busy-wait tuning: pauses
 * and sched_yield()s before sleeping on the futex; default 0 below 8 cores).
 *
 * As strict as NCCL where NCCL is asynchronous, prohibits or blocks: a non-blocking
 * group end launches later from a worker thread, every communicator of the group reading
 * ncclInProgress meanwhile (gjob.c); finalize, revoke and default shrink wait for the
 * communicator's outstanding work; destroy and abort wait while a CUDA graph that
 * captured the communicator lives; after ncclCommShrink(NCCL_SHRINK_ABORT) the parent's
 * destroy hangs from 2.31.2 on, as NCCL's does (teardown.c).
 *
 * Beyond NCCL (debugging aids): ranks that issue mismatched collectives get
 * ncclInvalidUsage with a message naming both sides instead of hanging; the death of
 * a peer process, or a peer's ncclCommAbort, stops the other ranks' pending work
 * within ~0.2 s with ncclRemoteError.
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

/* ---- child ids ---------------------------------------------------------------------- */

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

/* ---- names --------------------------------------------------------------------------- */

#define LB_X_COLL(Name, KIND, since, config_since, args, count, send, recv) \
    [LB_K_##KIND] = {#Name, LB_HAS_ROOT_##args, LB_HAS_OP_##args, 0, LB_SPAN_##send, LB_SPAN_##recv},
#define LB_X_P2P(Name, KIND, send, recv) \
    [LB_K_##KIND] = {#Name, 0, 0, 1, LB_SPAN_##send, LB_SPAN_##recv},
static const struct lb_kind_info k_kinds[LB_K_COUNT] = {LB_COLLECTIVES(LB_X_COLL) LB_P2P(LB_X_P2P)};
#undef LB_X_COLL
#undef LB_X_P2P
static const struct lb_kind_info k_no_kind = {"?", 0, 0, 0, LB_SPAN_ZERO, LB_SPAN_ZERO};

const struct lb_kind_info *lb_kind(int kind) {
    return (kind >= 0 && kind < LB_K_COUNT) ? &k_kinds[kind] : &k_no_kind;
}

const char *lb_kind_name(int kind) { return lb_kind(kind)->name; }

size_t lb_span_bytes(int span, size_t nb, size_t all, int is_root) {
    switch (span) {
    case LB_SPAN_NB: return nb;
    case LB_SPAN_ALL: return all;
    case LB_SPAN_ROOT_NB: return is_root ? nb : 0;
    case LB_SPAN_ROOT_ALL: return is_root ? all : 0;
    default: return 0;
    }
}

const char *lb_op_name(int op) {
    static const char *const names[] = {"sum", "prod", "max", "min", "avg"};
    if (op >= 0 && op < LB_NUM_OPS) return names[op];
    return op >= LB_NUM_OPS ? "premulsum" : "?";
}
