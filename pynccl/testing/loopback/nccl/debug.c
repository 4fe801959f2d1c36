/*
 * NCCL_DEBUG=INFO for the loopback libnccl: NCCL-shaped INFO lines
 * ("host:pid:tid [dev] NCCL INFO ...", src/debug.cc), filtered by NCCL_DEBUG_SUBSYS
 * (INIT, COLL, TUNING, ENV, ALL; "^" inverts; default INIT and ENV, as NCCL's), written on
 * stderr or into NCCL_DEBUG_FILE (%h: host name, %p: pid, %%: a percent sign). Read once,
 * on the first line asked for.
 */
#include "internal.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>


static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_level;              /* 1 VERSION, 2 WARN, 3 INFO, 4 ABORT, 5 TRACE */
static unsigned long g_mask;
static FILE *g_out;
static char g_host[256];
static pthread_mutex_t g_out_mu = PTHREAD_MUTEX_INITIALIZER;

static int parse_level(const char *e) {
    static const char *names[] = {"VERSION", "WARN", "INFO", "ABORT", "TRACE"};
    for (int i = 0; e && i < 5; i++)
        if (!strcasecmp(e, names[i])) return i + 1;
    return 0;
}

static unsigned long subsys_bit(const char *s) {
    if (!strcasecmp(s, "INIT")) return LB_DBG_INIT;
    if (!strcasecmp(s, "COLL")) return LB_DBG_COLL;
    if (!strcasecmp(s, "TUNING")) return LB_DBG_TUNING;
    if (!strcasecmp(s, "ENV")) return LB_DBG_ENV;
    if (!strcasecmp(s, "ALL")) return LB_DBG_ALL;
    return 0; /* NCCL ignores names it does not know */
}

static unsigned long parse_mask(const char *e) {
    if (!e) return LB_DBG_INIT | LB_DBG_ENV;
    int invert = e[0] == '^';
    unsigned long mask = invert ? LB_DBG_ALL : 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", e + invert);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        unsigned long bit = subsys_bit(t);
        mask = invert ? (mask & ~bit) : (mask | bit);
    }
    return mask;
}

static FILE *open_file(const char *spec) {
    char path[PATH_MAX];
    size_t n = 0;
    for (const char *p = spec; *p && n + 1 < sizeof path; p++) {
        if (*p != '%' || !p[1]) {
            path[n++] = *p;
            continue;
        }
        char c = *++p;
        int w = c == 'h'   ? snprintf(path + n, sizeof path - n, "%s", g_host)
                : c == 'p' ? snprintf(path + n, sizeof path - n, "%d", (int)getpid())
                : c == '%' ? snprintf(path + n, sizeof path - n, "%%")
                           : snprintf(path + n, sizeof path - n, "%%%c", c);
        n = w < 0 ? n : (n + (size_t)w >= sizeof path ? sizeof path - 1 : n + (size_t)w);
    }
    path[n] = '\0';
    FILE *f = path[0] ? fopen(path, "w") : NULL;
    return f ? f : stderr; /* NCCL falls back to stderr too */
}

static void debug_init(void) {
    g_level = parse_level(getenv("NCCL_DEBUG"));
    g_mask = parse_mask(getenv("NCCL_DEBUG_SUBSYS"));
    if (gethostname(g_host, sizeof g_host - 1) != 0) snprintf(g_host, sizeof g_host, "unknown");
    char *dot = strchr(g_host, '.');
    if (dot) *dot = '\0'; /* NCCL cuts the host name at the first dot */
    const char *file = getenv("NCCL_DEBUG_FILE");
    g_out = (g_level >= 2 && file) ? open_file(file) : stderr;
}

int lb_info_on(unsigned long subsys) {
    pthread_once(&g_once, debug_init);
    return g_level >= 3 && (g_mask & subsys);
}

int lb_warn_on(void) {
    pthread_once(&g_once, debug_init);
    return g_level >= 2;
}

/* where: "" for INFO, "file:line " for WARN (NCCL's shapes). */
static void emit_as(const char *level, const char *where, int dev, const char *fmt, va_list ap) {
    char line[1024];
    int n = snprintf(line, sizeof line, "%s:%d:%d [%d] %sNCCL %s ", g_host, (int)getpid(),
                     (int)syscall(SYS_gettid), dev, where, level);
    if (n < 0 || (size_t)n >= sizeof line) return;
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    pthread_mutex_lock(&g_out_mu);
    fprintf(g_out, "%s\n", line);
    fflush(g_out);
    pthread_mutex_unlock(&g_out_mu);
}

static void emit(int dev, const char *fmt, va_list ap) { emit_as("INFO", "", dev, fmt, ap); }

/* NCCL's WARN shape: "host:pid:tid [dev] file:line NCCL WARN ...", at NCCL_DEBUG=WARN or
 * above, whatever NCCL_DEBUG_SUBSYS says. */
void lb_warn(int dev, const char *file, int line, const char *fmt, ...) {
    if (!lb_warn_on()) return;
    char where[160];
    const char *base = strrchr(file, '/');
    snprintf(where, sizeof where, "%s:%d ", base ? base + 1 : file, line);
    va_list ap;
    va_start(ap, fmt);
    emit_as("WARN", where, dev, fmt, ap);
    va_end(ap);
}

void lb_info(unsigned long subsys, int dev, const char *fmt, ...) {
    if (!lb_info_on(subsys)) return;
    va_list ap;
    va_start(ap, fmt);
    emit(dev, fmt, ap);
    va_end(ap);
}

static pthread_once_t g_banner_once = PTHREAD_ONCE_INIT;
static int g_banner_dev;

static void banner(void) {
    lb_info(LB_DBG_ALL, g_banner_dev, "NCCL version %d.%d.%d+cuda13.0", LB_NCCL_VERSION_CODE / 10000,
            LB_NCCL_VERSION_CODE / 100 % 100, LB_NCCL_VERSION_CODE % 100);
}

void lb_info_comm_ready(const struct lb_comm *c) {
    if (!lb_info_on(LB_DBG_ALL)) return;
    g_banner_dev = c->dev;
    pthread_once(&g_banner_once, banner);
    const void *h = c->handle;
    lb_info(LB_DBG_INIT, c->dev, "comm %p rank %d nRanks %d nNodes 1 localRanks %d localRank %d MNNVL 0",
            h, c->rank, c->nranks, c->nranks, c->rank);
    lb_info(LB_DBG_INIT | LB_DBG_ENV, c->dev,
            "Comm config Blocking set to %d, splitShare %d, shrinkShare %d, commName %s", c->blocking,
            c->split_share, c->shrink_share, c->comm_name ? c->comm_name : "(null)");
    lb_info(LB_DBG_INIT, c->dev, "1 coll channels, 0 collnet channels, 0 nvls channels, 1 p2p channels, 1 p2p channels per peer");
    lb_info(LB_DBG_INIT, c->dev,
            "ncclCommInitRank comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %x commId 0x%llx - Init COMPLETE",
            h, c->rank, c->nranks, c->dev, c->dev, (c->dev + 1) << 12, (unsigned long long)c->hash);
}

/* NCCL_ALGO names Tree for all_reduce ("tree", "ring,tree", "allreduce:tree"; "^..." excludes):
 * the loopback's tuner follows it, as NCCL's does, and otherwise reports RING. */
static int algo_tree(void) {
    const char *e = getenv("NCCL_ALGO");
    if (!e || e[0] == '^') return 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", e);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",;", &save); t; t = strtok_r(NULL, ",;", &save)) {
        char *colon = strchr(t, ':');
        if (colon && strncasecmp(t, "allreduce:", 10)) continue;
        if (!strcasecmp(colon ? colon + 1 : t, "tree")) return 1;
    }
    return 0;
}

/* NCCL's symmetric kernels (2.27+, src/sym_kernels.cc): all_gather of any type; all_reduce and
 * reduce_scatter with sum over 16/32-bit and fp8 floats; both buffers in windows registered with
 * NCCL_WIN_COLL_SYMMETRIC. The loopback has no multicast (NVLS), so only the LL and LD/ST kernels
 * are candidates; LL wins for small messages and is never used at 4 GiB of bus bytes or more. */
static const char *sym_kernel(struct lb_comm *c, const struct lb_op *op, size_t bytes,
                              int in_windows) {
    if (!LB_AT_LEAST(2, 27, 3) || !in_windows) return NULL;
    int flt = op->dtype == ncclFloat16 || op->dtype == ncclFloat32 || op->dtype == ncclBfloat16 ||
              op->dtype == ncclFloat8e4m3 || op->dtype == ncclFloat8e5m2;
    int red_ok = op->api_op == ncclSum && flt;
    if (op->kind == LB_K_ALLREDUCE ? !red_ok : op->kind == LB_K_REDUCESCATTER ? !red_ok
                                             : op->kind != LB_K_ALLGATHER)
        return NULL;
    size_t bus = op->kind == LB_K_ALLREDUCE ? bytes : bytes * (size_t)c->nranks;
    if (bus >= ((size_t)64 << 30)) return NULL;
    int ll = bus < ((size_t)4 << 30) && bus <= 64 * 1024; /* the LL kernels' latency edge */
    switch (op->kind) {
    case LB_K_ALLREDUCE: return ll ? "AllReduce_AGxLL_R" : "AllReduce_RSxLD_AGxST";
    case LB_K_ALLGATHER: return ll ? "AllGather_LL" : "AllGather_ST";
    default: return ll ? "ReduceScatter_LL" : "ReduceScatter_LD";
    }
}

void lb_info_coll(struct lb_comm *c, const struct lb_op *op, const char *opname, const void *stream,
                  int in_windows) {
    if (!strncmp(opname, "nccl", 4)) opname += 4; /* NCCL names it "AllReduce" */
    if (lb_info_on(LB_DBG_COLL))
        lb_info(LB_DBG_COLL, c->dev,
                "%s: opCount %llx sendbuff %p recvbuff %p count %zu datatype %d op %d root %d comm %p "
                "[nranks=%d] stream %p",
                opname, (unsigned long long)c->issued, op->sbuf, (void *)op->rbuf, op->count, op->dtype,
                op->api_op, op->root, (const void *)c->handle, c->nranks, stream);
    if (op->kind >= LB_K_SEND || !lb_info_on(LB_DBG_TUNING)) return;
    size_t bytes = op->count * lb_type_size(op->dtype);
    const char *k = sym_kernel(c, op, bytes, in_windows);
    /* NCCL 2.27 printed the symmetric line on every rank, 2.28+ on rank 0 only; the
     * "Algo" line is rank 0's since 2.19 (src/enqueue.cc, src/scheduler/symmetric_sched.cc). */
    if (k && (c->rank == 0 || !LB_AT_LEAST(2, 28, 3)))
        lb_info(LB_DBG_TUNING, c->dev, "%s [Symmetric]: %zu Bytes -> Kernel %s nchannels %d nthreads %d%s",
                opname, bytes, k, 1, 512, LB_AT_LEAST(2, 28, 3) ? " nWorks 1" : "");
    else if (!k && c->rank == 0)
        lb_info(LB_DBG_TUNING, c->dev, "%s: %zu Bytes -> Algo %s proto SIMPLE channel{Lo..Hi}={0..0}", opname,
                bytes, op->kind == LB_K_ALLREDUCE && algo_tree() ? "TREE" : "RING");
}
