/*
 * NCCL's RAS service (NCCL >= 2.24) in the loopback: a listener thread, started with the
 * process's first communicator unless NCCL_RAS_ENABLE=0, bound to 127.0.0.1 at the port
 * of NCCL_RAS_ADDR ("host:port", default 28028) with SO_REUSEPORT as NCCL does, so every
 * rank on the host shares the port and whichever accepts answers for the whole job.
 * Answers come from this process's view of its shared-memory worlds: every rank, its pid,
 * its state; a rank whose process is gone is missing and considered dead. The thread is
 * stopped (joined, sockets closed) when the last communicator goes, and at unload.
 */
#include "internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define LB_RAS_DEFAULT_PORT 28028
#define LB_RAS_PROTOCOL 2
#define LB_RAS_IDLE_MS 30000 /* a client silent this long is dropped */
#define LB_RAS_LINE 1024

struct ras_node {
    struct lb_comm *c; /* removed (lb_ras_comm_remove) before it is freed */
    struct ras_node *next;
};

struct ras_srv {
    int listen, wake[2];
    pthread_t thread;
};

static pthread_mutex_t g_ras_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ras_node *g_comms; /* g_ras_mu */
static struct ras_srv *g_srv;    /* g_ras_mu: the running listener, or NULL */

/* NCCL's WARN line, when NCCL_DEBUG asks for warnings. */
static void ras_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void ras_warn(const char *fmt, ...) {
    const char *d = getenv("NCCL_DEBUG");
    if (!d || (strcasecmp(d, "WARN") && strcasecmp(d, "INFO") && strcasecmp(d, "TRACE"))) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%d NCCL WARN [loopback] %s\n", (int)getpid(), buf);
}

static int func_of(int kind) {
    switch (kind) {
    case LB_K_BROADCAST: return 0;
    case LB_K_REDUCE: return 1;
    case LB_K_ALLGATHER: return 2;
    case LB_K_REDUCESCATTER: return 3;
    case LB_K_ALLREDUCE: return 4;
    default: return -1;
    }
}

void lb_ras_count(struct lb_comm *c, int kind) {
    int f = func_of(kind);
    if (f >= 0) __atomic_add_fetch(&c->ranks[c->rank].ras_counts[f], 1, __ATOMIC_RELEASE);
}

/* ---- the snapshot ---------------------------------------------------------------------- */

static void view_rank(struct lb_comm *c, int s, struct lb_ras_rank *r) {
    const struct lbw_rank *w = &c->ranks[s];
    uint32_t st = __atomic_load_n(&w->state, __ATOMIC_ACQUIRE);
    r->rank = s;
    r->pid = __atomic_load_n(&w->pid, __ATOMIC_ACQUIRE);
    r->dev = w->device;
    r->phys = w->phys;
    r->init_state = st == LBR_EMPTY ? ncclInProgress : ncclSuccess;
    r->finalize_called = (int)__atomic_load_n(&w->teardown, __ATOMIC_ACQUIRE);
    r->destroy_flag = st == LBR_LEFT;
    r->abort_flag = st == LBR_FAILED;
    r->async_error = 0;
    if (s == c->rank) {
        r->async_error = __atomic_load_n(&c->async, __ATOMIC_ACQUIRE);
        r->abort_flag |= __atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE) != 0;
        r->finalize_called |= c->finalize_called;
    } else if (__atomic_load_n(&c->w->broken, __ATOMIC_ACQUIRE) && c->w->broken_rank == s) {
        r->async_error = (int)c->w->broken;
    }
    r->dead = r->pid > 0 && r->pid != c->pid && !lbw_pid_alive(r->pid) && st != LBR_LEFT;
    r->missing = st == LBR_EMPTY || r->dead;
    if (st == LBR_EMPTY) r->pid = -1;
    for (int f = 0; f < LB_RAS_NFUNCS; f++)
        r->counts[f] = __atomic_load_n(&w->ras_counts[f], __ATOMIC_ACQUIRE);
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 0x100000001b3ULL;
    return h;
}

static void view_free(struct lb_ras_view *v) {
    for (int i = 0; i < v->ncomms; i++) free(v->comms[i].ranks);
    free(v->comms);
    v->comms = NULL;
    v->ncomms = 0;
}

/* Fills v from the registered communicators; 0 when out of memory. */
static int view_build(struct lb_ras_view *v) {
    uint64_t t0 = lb_now_ns();
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    pthread_mutex_lock(&g_ras_mu);
    int n = 0;
    for (struct ras_node *e = g_comms; e; e = e->next) n++;
    v->comms = calloc(n ? (size_t)n : 1, sizeof *v->comms);
    int ok = v->comms != NULL;
    struct ras_node *e = g_comms;
    for (int i = 0; ok && i < n; i++, e = e->next) {
        struct lb_comm *c = e->c;
        int dup = 0; /* several ranks of one communicator in this process: reported once */
        for (int j = 0; j < v->ncomms && !dup; j++) dup = v->comms[j].hash == c->hash;
        if (dup) continue;
        struct lb_ras_comm *o = &v->comms[v->ncomms];
        o->ranks = calloc((size_t)c->nranks, sizeof *o->ranks);
        if (!o->ranks) ok = 0;
        if (!ok) break;
        v->ncomms++;
        o->hash = c->hash;
        o->size = c->nranks;
        o->host_hash = fnv(0xcbf29ce484222325ULL, host, strlen(host));
        int32_t creator = c->w->creator_pid;
        o->pid_hash = fnv(0xcbf29ce484222325ULL, &creator, sizeof creator);
        for (int s = 0; s < c->nranks; s++) {
            view_rank(c, s, &o->ranks[s]);
            o->nmissing += o->ranks[s].missing;
        }
    }
    pthread_mutex_unlock(&g_ras_mu);
    v->secs = (double)(lb_now_ns() - t0) / 1e9;
    if (!ok) view_free(v);
    return ok;
}

/* ---- one client ---------------------------------------------------------------------- */

static int send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return 0;
        p += k;
        n -= (size_t)k;
    }
    return 1;
}

static int send_status(int fd, int json, int verbose) {
    struct lb_ras_view v = {0};
    char *out = view_build(&v) ? lb_ras_format(&v, json, verbose) : NULL;
    view_free(&v);
    int ok = out ? send_all(fd, out, strlen(out)) : send_all(fd, "ERROR: out of memory\n", 21);
    free(out);
    return ok;
}

/* Answers one command line. Returns 1 to keep reading, 0 when the exchange is over. */
static int answer(int fd, char *cmd, int *json) {
    char reply[LB_RAS_LINE + 64];
    if (strncasecmp(cmd, "client protocol ", 16) == 0) {
        snprintf(reply, sizeof reply, "SERVER PROTOCOL %d\n", LB_RAS_PROTOCOL);
    } else if (strncasecmp(cmd, "timeout ", 8) == 0) {
        char *end = NULL;
        long t = strtol(cmd + 8, &end, 10);
        if (t < 0 || end == cmd + 8 || *end != '\0')
            snprintf(reply, sizeof reply, "ERROR: Invalid timeout value %s\n", cmd + 8);
        else
            snprintf(reply, sizeof reply, "OK\n"); /* the loopback answers at once */
#if LB_AT_LEAST(2, 28, 7)
    } else if (strncasecmp(cmd, "set format ", 11) == 0) {
        const char *f = cmd + 11;
        if (strcasecmp(f, "text") == 0 || strcasecmp(f, "json") == 0) {
            *json = strcasecmp(f, "json") == 0;
            snprintf(reply, sizeof reply, "OK\n");
        } else {
            snprintf(reply, sizeof reply, "ERROR: Invalid format %s\n", f);
        }
#endif
    } else if (strcasecmp(cmd, "status") == 0 || strcasecmp(cmd, "verbose status") == 0) {
        send_status(fd, *json, strcasecmp(cmd, "status") != 0);
        return 0;
    } else {
        snprintf(reply, sizeof reply, "ERROR: Unknown command %s\n", cmd);
    }
    return send_all(fd, reply, strlen(reply));
}

static void serve(const struct ras_srv *srv, int fd) {
    char buf[LB_RAS_LINE];
    size_t used = 0;
    int json = 0;
    for (;;) {
        struct pollfd p[2] = {{fd, POLLIN, 0}, {srv->wake[0], POLLIN, 0}};
        int k = poll(p, 2, LB_RAS_IDLE_MS);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0 || p[1].revents) return;
        ssize_t got = recv(fd, buf + used, sizeof buf - 1 - used, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return;
        used += (size_t)got;
        char *nl;
        while ((nl = memchr(buf, '\n', used)) != NULL) {
            *nl = '\0';
            if (nl > buf && nl[-1] == '\r') nl[-1] = '\0';
            if (!answer(fd, buf, &json)) return;
            size_t rest = used - (size_t)(nl + 1 - buf);
            memmove(buf, nl + 1, rest);
            used = rest;
        }
        if (used == sizeof buf - 1) return; /* an excessively long line, as NCCL drops */
    }
}

static void *ras_main(void *arg) {
    const struct ras_srv *srv = arg;
    for (;;) {
        struct pollfd p[2] = {{srv->listen, POLLIN, 0}, {srv->wake[0], POLLIN, 0}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return NULL;
        }
        if (p[1].revents) return NULL;
        int fd = accept4(srv->listen, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        struct timeval tv = {.tv_sec = 5}; /* a client that stops reading is dropped */
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        serve(srv, fd);
        close(fd);
    }
}

/* ---- start and stop -------------------------------------------------------------------- */

static int ras_port(void) {
    const char *a = getenv("NCCL_RAS_ADDR");
    if (!a || !*a) return LB_RAS_DEFAULT_PORT;
    const char *colon = strrchr(a, ':');
    char *end = NULL;
    long port = colon ? strtol(colon + 1, &end, 10) : -1;
    if (!colon || end == colon + 1 || *end != '\0' || port < 0 || port > 65535) {
        ras_warn("NCCL_RAS_ADDR=%s is not host:port (port 0-65535); RAS not started", a);
        return -1;
    }
    return (int)port;
}

static void srv_close(struct ras_srv *srv) {
    if (srv->listen >= 0) close(srv->listen);
    if (srv->wake[0] >= 0) close(srv->wake[0]);
    if (srv->wake[1] >= 0) close(srv->wake[1]);
    free(srv);
}

/* The listener, or NULL when RAS is off or cannot listen (never an init error). */
static struct ras_srv *ras_start(int dev) {
#if !LB_AT_LEAST(2, 24, 3)
    return NULL; /* RAS came with NCCL 2.24 */
#endif
    const char *en = getenv("NCCL_RAS_ENABLE");
    int port = ras_port();
    struct ras_srv *srv = (en && strcmp(en, "0") == 0) || port < 0 ? NULL : malloc(sizeof *srv);
    if (!srv) return NULL;
    srv->wake[0] = srv->wake[1] = -1;
    int one = 1;
    srv->listen = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (srv->listen < 0 || setsockopt(srv->listen, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        setsockopt(srv->listen, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) ||
        bind(srv->listen, (struct sockaddr *)&sa, sizeof sa) || listen(srv->listen, 64) ||
        pipe2(srv->wake, O_CLOEXEC)) {
        ras_warn("RAS failed to establish a client listening socket at 127.0.0.1:%d: %s", port,
                 strerror(errno));
        srv_close(srv);
        return NULL;
    }
    if (pthread_create(&srv->thread, NULL, ras_main, srv) != 0) {
        srv_close(srv);
        return NULL;
    }
    lb_info(LB_DBG_INIT, dev, "RAS client listening socket at 127.0.0.1:%d", port);
    return srv;
}

/* Stops a listener taken out of g_srv (g_ras_mu not held). */
static void ras_stop(struct ras_srv *srv) {
    if (!srv) return;
    (void)!write(srv->wake[1], "x", 1);
    pthread_join(srv->thread, NULL);
    srv_close(srv);
}

/* fork: a child has no listener thread; it closes its copies of the listener's sockets, so
 * that no connection is queued where nobody accepts, and starts its own with its first comm. */
static void ras_fork_prepare(void) { pthread_mutex_lock(&g_ras_mu); }
static void ras_fork_parent(void) { pthread_mutex_unlock(&g_ras_mu); }
static void ras_fork_child(void) {
    if (g_srv) srv_close(g_srv);
    g_srv = NULL;
    pthread_mutex_unlock(&g_ras_mu);
}
static pthread_once_t g_fork_once = PTHREAD_ONCE_INIT;
static void ras_fork_hooks(void) { pthread_atfork(ras_fork_prepare, ras_fork_parent, ras_fork_child); }

void lb_ras_comm_add(struct lb_comm *c) {
    pthread_once(&g_fork_once, ras_fork_hooks);
    struct ras_node *e = malloc(sizeof *e);
    if (!e) return; /* RAS does not see this communicator: never an init error */
    e->c = c;
    pthread_mutex_lock(&g_ras_mu);
    e->next = g_comms;
    g_comms = e;
    if (!g_srv) g_srv = ras_start(c->dev);
    pthread_mutex_unlock(&g_ras_mu);
}

void lb_ras_comm_remove(struct lb_comm *c) {
    struct ras_node *gone = NULL;
    pthread_mutex_lock(&g_ras_mu);
    for (struct ras_node **pp = &g_comms; *pp; pp = &(*pp)->next) {
        if ((*pp)->c == c) {
            gone = *pp;
            *pp = gone->next;
            break;
        }
    }
    struct ras_srv *stop = gone && g_comms == NULL ? g_srv : NULL;
    if (stop) g_srv = NULL;
    pthread_mutex_unlock(&g_ras_mu);
    ras_stop(stop);
    free(gone);
}

__attribute__((destructor)) static void ras_unload(void) {
    pthread_mutex_lock(&g_ras_mu);
    struct ras_srv *stop = g_srv;
    g_srv = NULL;
    pthread_mutex_unlock(&g_ras_mu);
    ras_stop(stop);
}
