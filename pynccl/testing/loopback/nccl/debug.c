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
    g_out = (g_level >= 3 && file) ? open_file(file) : stderr;
}

int lb_info_on(unsigned long subsys) {
    pthread_once(&g_once, debug_init);
    return g_level >= 3 && (g_mask & subsys);
}

static void emit(int dev, const char *fmt, va_list ap) {
    char line[1024];
    int n = snprintf(line, sizeof line, "%s:%d:%d [%d] NCCL INFO ", g_host, (int)getpid(),
                     (int)syscall(SYS_gettid), dev);
    if (n < 0 || (size_t)n >= sizeof line) return;
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    pthread_mutex_lock(&g_out_mu);
    fprintf(g_out, "%s\n", line);
    fflush(g_out);
    pthread_mutex_unlock(&g_out_mu);
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

void lb_info_coll(const struct lb_comm *c, const struct lb_op *op, const char *opname,
                  const void *stream) {
    if (!strncmp(opname, "nccl", 4)) opname += 4; /* NCCL names it "AllReduce" */
    if (lb_info_on(LB_DBG_COLL))
        lb_info(LB_DBG_COLL, c->dev,
                "%s: opCount %llx sendbuff %p recvbuff %p count %zu datatype %d op %d root %d comm %p "
                "[nranks=%d] stream %p",
                opname, (unsigned long long)c->issued, op->sbuf, (void *)op->rbuf, op->count, op->dtype,
                op->api_op, op->root, (const void *)c->handle, c->nranks, stream);
    if (c->rank == 0 && op->kind < LB_K_SEND && lb_info_on(LB_DBG_TUNING)) /* NCCL: rank 0 */
        lb_info(LB_DBG_TUNING, c->dev, "%s: %zu Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..0}",
                opname, op->count * lb_type_size(op->dtype));
}
