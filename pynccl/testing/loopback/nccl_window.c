/*
 * NCCL memory and windows in the loopback libnccl: ncclMemAlloc/ncclMemFree,
 * ncclCommWindowRegister/Deregister and ncclWinGetUserPtr (the window pointer functions
 * of nccl_device/host.h are in nccl_props.c).
 *
 * ncclMemAlloc memory is a loopback device allocation (so every buffer check accepts
 * it) whose pages are a memfd mapped over the allocation's page-aligned middle. Peers
 * reach it directly: in a thread world a peer's window is the peer's own address; in a
 * process world each rank maps the peer's memfd (opened as /proc/<pid>/fd/<fd>) when
 * the window is registered, so the peer pointers read and write the peer's bytes.
 *
 * Registration and deregistration are collective: each rank posts its buffer in the
 * world (struct lbw_winpost), everyone checks every post the same way (flags, and for
 * NCCL_WIN_COLL_SYMMETRIC equal sizes and 4096-byte alignment), maps its peers, and a
 * second round tells everyone whether all ranks succeeded, so that all return the same
 * result.
 */
#include "nccl_lb_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define LB_PAGE 4096
#define LB_WIN_MAGIC 0x4e49574c42434e50ULL
#define LB_WIN_FLAGS_KNOWN 0x0f /* NCCL_WIN_COLL_SYMMETRIC .. NCCL_WIN_CFT_COUNTED */
#define LB_WIN_SYMMETRIC 0x01
#define LB_WIN_ALIGN 4096

LBN_UNUSED static size_t page_up(size_t v) { return (v + LB_PAGE - 1) / LB_PAGE * LB_PAGE; }

/* ---- ncclMemAlloc --------------------------------------------------------------------- */

struct lb_mem {
    struct lb_mem *next;
    char *user;   /* what ncclMemAlloc returned (page aligned) */
    void *base;   /* the loopback allocation around it */
    size_t size, maplen;
    int fd;       /* memfd backing [user, user + maplen) */
};

static pthread_mutex_t g_mem_mu = PTHREAD_MUTEX_INITIALIZER;
static struct lb_mem *g_mem;

/* The memfd and offset backing [p, p + bytes), if it lies in one ncclMemAlloc block. */
LBN_UNUSED static int mem_find(const void *p, size_t bytes, int *fd, size_t *off) {
    int found = 0;
    pthread_mutex_lock(&g_mem_mu);
    for (struct lb_mem *m = g_mem; m; m = m->next) {
        const char *q = p;
        if (q >= m->user && q <= m->user + m->size && bytes <= (size_t)(m->user + m->size - q)) {
            *fd = m->fd;
            *off = (size_t)(q - m->user);
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&g_mem_mu);
    return found;
}

#if LB_AT_LEAST(2, 19, 1)
ncclResult_t ncclMemAlloc(void **ptr, size_t size) {
    if (ptr == NULL || size == 0)
        return lb_err(ncclInvalidArgument, "ncclMemAlloc : invalid arguments ptr %p size %zu",
                      (void *)ptr, size);
    size_t maplen = page_up(size);
    if (maplen < size || maplen + LB_PAGE < maplen)
        return lb_err(ncclInvalidArgument, "ncclMemAlloc : size %zu is too large", size);
    struct lb_mem *m = calloc(1, sizeof *m);
    if (!m) return lb_err(ncclSystemError, "ncclMemAlloc : out of memory");
    int e = pynccl_lb_malloc(&m->base, maplen + LB_PAGE, pynccl_lb_current_device());
    if (e != 0) {
        free(m);
        return lb_err(ncclUnhandledCudaError, "ncclMemAlloc : Cuda failure %d '%s' allocating %zu bytes",
                      e, cudaGetErrorString((cudaError_t)e), size);
    }
    m->user = (char *)(((uintptr_t)m->base + LB_PAGE - 1) & ~(uintptr_t)(LB_PAGE - 1));
    m->size = size;
    m->maplen = maplen;
    m->fd = memfd_create("pynccl-lb-ncclMemAlloc", MFD_CLOEXEC);
    int err = m->fd < 0 ? errno : 0;
    if (!err && ftruncate(m->fd, (off_t)maplen) != 0) err = errno;
    if (!err && mmap(m->user, maplen, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, m->fd, 0) ==
                    MAP_FAILED)
        err = errno;
    if (err) {
        if (m->fd >= 0) close(m->fd);
        pynccl_lb_free(m->base);
        free(m);
        return lb_err(ncclSystemError, "ncclMemAlloc : cannot map %zu bytes of shareable memory: %s",
                      size, strerror(err));
    }
    pthread_mutex_lock(&g_mem_mu);
    m->next = g_mem;
    g_mem = m;
    pthread_mutex_unlock(&g_mem_mu);
    *ptr = m->user;
    return ncclSuccess;
}
LB_ALIAS(ncclMemAlloc)

ncclResult_t ncclMemFree(void *ptr) {
    if (ptr == NULL) return ncclSuccess;
    struct lb_mem *m = NULL;
    pthread_mutex_lock(&g_mem_mu);
    for (struct lb_mem **pp = &g_mem; *pp; pp = &(*pp)->next) {
        if ((*pp)->user == ptr) {
            m = *pp;
            *pp = m->next;
            break;
        }
    }
    pthread_mutex_unlock(&g_mem_mu);
    void *base = ptr;
    if (m) {
        /* give the allocator its private pages back (peers keep the memfd they mapped) */
        mmap(m->user, m->maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
             -1, 0);
        close(m->fd);
        base = m->base;
        free(m);
    }
    int e = pynccl_lb_free(base);
    if (e != 0)
        return lb_err(ncclUnhandledCudaError, "ncclMemFree : Cuda failure %d '%s' freeing %p", e,
                      cudaGetErrorString((cudaError_t)e), ptr);
    return ncclSuccess;
}
LB_ALIAS(ncclMemFree)
#endif

/* ---- windows ---------------------------------------------------------------------------- */

struct lb_win {
    uint64_t magic;
    struct lb_win *next;  /* the comm's list (c->mu) */
    struct lb_win *gnext; /* every live window (g_win_mu) */
    struct lb_comm *c;
    char *user;
    size_t size;
    int flags, nranks;
    char **peer;     /* each rank's window as addressed from this process */
    size_t *psize;   /* each rank's window size */
    void **maps;     /* mappings of peers' memfds (NULL where the peer is in-process) */
    size_t *maplens;
};

static pthread_mutex_t g_win_mu = PTHREAD_MUTEX_INITIALIZER;
static struct lb_win *g_wins;

static void win_free(struct lb_win *w) {
    if (!w) return;
    for (int p = 0; w->maps && p < w->nranks; p++)
        if (w->maps[p]) munmap(w->maps[p], w->maplens[p]);
    w->magic = 0;
    free(w->peer);
    free(w->psize);
    free(w->maps);
    free(w->maplens);
    free(w);
}

/* Remove w from the global list (the comm's list is the caller's business). */
static void win_unpublish(struct lb_win *w) {
    pthread_mutex_lock(&g_win_mu);
    for (struct lb_win **pp = &g_wins; *pp; pp = &(*pp)->gnext) {
        if (*pp == w) {
            *pp = w->gnext;
            break;
        }
    }
    pthread_mutex_unlock(&g_win_mu);
}

void lb_win_release_all(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    struct lb_win *w = c->wins;
    c->wins = NULL;
    pthread_mutex_unlock(&c->mu);
    while (w) {
        struct lb_win *n = w->next;
        win_unpublish(w);
        win_free(w);
        w = n;
    }
}

struct lb_win *lb_win_find(struct lb_comm *c, const void *p, size_t bytes, int flags) {
    const char *q = p;
    for (struct lb_win *w = c->wins; w; w = w->next)
        if ((w->flags & flags) == flags && q >= w->user && q <= w->user + w->size &&
            bytes <= (size_t)(w->user + w->size - q))
            return w;
    return NULL;
}

int lb_win_lookup(struct lb_comm *c, ncclWindow_t win, void **user, size_t *size, int peer,
                  void **peer_base) {
    for (struct lb_win *w = c->wins; w; w = w->next) {
        if ((void *)w != (void *)win) continue;
        if (user) *user = w->user;
        if (size) *size = peer >= 0 && peer < w->nranks ? w->psize[peer] : w->size;
        if (peer_base) *peer_base = peer >= 0 && peer < w->nranks ? w->peer[peer] : NULL;
        return 1;
    }
    return 0;
}

int lb_win_peer(ncclWindow_t window, int peer, int *nranks, char **base, size_t *size) {
    int found = 0;
    pthread_mutex_lock(&g_win_mu);
    for (struct lb_win *w = g_wins; w; w = w->gnext) {
        if ((void *)w == (void *)window && w->magic == LB_WIN_MAGIC) {
            *nranks = w->nranks;
            if (peer >= 0 && peer < w->nranks) {
                *base = w->peer[peer];
                *size = w->psize[peer];
            }
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&g_win_mu);
    return found;
}

#if LB_AT_LEAST(2, 27, 3)

/* ---- the collective rounds ---------------------------------------------------------------- */

struct round {
    uint64_t seq;
};

static int all_read(struct lb_comm *c, void *arg, int *blocker) {
    uint64_t seq = ((struct round *)arg)->seq;
    for (int s = 0; s < c->nranks; s++) {
        if (__atomic_load_n(&c->ranks[s].win.read, __ATOMIC_ACQUIRE) + 1 < seq) {
            *blocker = s;
            return 0;
        }
    }
    return 1;
}

static int all_posted(struct lb_comm *c, void *arg, int *blocker) {
    uint64_t seq = ((struct round *)arg)->seq;
    for (int s = 0; s < c->nranks; s++) {
        if (__atomic_load_n(&c->ranks[s].win.seq, __ATOMIC_ACQUIRE) < seq) {
            *blocker = s;
            return 0;
        }
    }
    return 1;
}

static ncclResult_t round_error(struct lb_comm *c, ncclResult_t r, const char *opname) {
    if (r == LB_ABORTED)
        return lb_err(LB_HAS_REMOTE_ERROR ? ncclRemoteError : ncclSystemError,
                      "%s : communicator aborted", opname);
    lb_comm_fail(c, r, NULL);
    return r;
}

/* Post *mine as this rank's part of the next round and wait for everyone's post. */
static ncclResult_t round_post(struct lb_comm *c, const struct lbw_winpost *mine, uint64_t *seq_out,
                               const char *opname) {
    struct round rd = {c->win_rounds + 1};
    ncclResult_t r = lbw_wait_for(c, all_read, &rd, opname);
    if (r != ncclSuccess) return round_error(c, r, opname);
    struct lbw_winpost *me = &c->ranks[c->rank].win;
    me->addr = mine->addr;
    me->size = mine->size;
    me->fdoff = mine->fdoff;
    me->fd = mine->fd;
    me->flags = mine->flags;
    me->kind = mine->kind;
    me->status = mine->status;
    __atomic_store_n(&me->seq, rd.seq, __ATOMIC_RELEASE);
    lbw_notify(c);
    r = lbw_wait_for(c, all_posted, &rd, opname);
    if (r != ncclSuccess) return round_error(c, r, opname);
    *seq_out = rd.seq;
    return ncclSuccess;
}

static void round_done(struct lb_comm *c, uint64_t seq) {
    c->win_rounds = seq;
    __atomic_store_n(&c->ranks[c->rank].win.read, seq, __ATOMIC_RELEASE);
    lbw_notify(c);
}

/* Second round: every rank says whether its part succeeded. Returns the first failure. */
static ncclResult_t round_agree(struct lb_comm *c, int kind, ncclResult_t mine, int *bad_rank,
                                const char *opname) {
    struct lbw_winpost p;
    memset(&p, 0, sizeof p);
    p.kind = kind;
    p.status = (int32_t)mine;
    uint64_t seq;
    ncclResult_t r = round_post(c, &p, &seq, opname);
    if (r != ncclSuccess) return r;
    ncclResult_t first = ncclSuccess;
    *bad_rank = -1;
    for (int s = 0; s < c->nranks && first == ncclSuccess; s++) {
        if (c->ranks[s].win.status != ncclSuccess) {
            first = (ncclResult_t)c->ranks[s].win.status;
            *bad_rank = s;
        }
    }
    round_done(c, seq);
    return first;
}

/* This rank's buffer checks, before posting (a failure is posted, not returned early, so
 * that the peers are not left waiting). */
static ncclResult_t local_checks(struct lb_comm *c, void *buff, size_t size, int flags,
                                 struct lbw_winpost *post, const char *opname) {
    post->addr = (uint64_t)(uintptr_t)buff;
    post->size = size;
    post->flags = flags;
    post->fd = -1;
    if (flags & ~LB_WIN_FLAGS_KNOWN)
        return lb_err(ncclInvalidArgument, "%s : invalid window flags 0x%x", opname, flags);
    int dev = -1;
    if (c->strict && !pynccl_lb_find_alloc(buff, size, &dev))
        return lb_err(ncclInvalidArgument,
                      "%s : buffer %p (%zu bytes) does not lie inside a loopback device "
                      "allocation (ncclMemAlloc / cudaMalloc)",
                      opname, buff, size);
    if (c->strict && dev != c->dev)
        return lb_err(ncclInvalidArgument, "%s : buffer %p is on device %d but the communicator is on device %d",
                      opname, buff, dev, c->dev);
    int fd;
    size_t off;
    if (mem_find(buff, size, &fd, &off)) {
        post->fd = fd;
        post->fdoff = off;
    }
    for (int s = 0; s < c->nranks; s++) {
        if (c->ranks[s].pid != c->pid && post->fd < 0)
            return lb_err(ncclInvalidArgument,
                          "%s : buffer %p (%zu bytes) was not allocated with ncclMemAlloc, so rank "
                          "%d (another process) cannot map it",
                          opname, buff, size, s);
    }
    return ncclSuccess;
}

/* Checks every rank makes on everyone's posts (so all reach the same verdict). */
static ncclResult_t global_checks(struct lb_comm *c, const char *opname) {
    const struct lbw_winpost *p0 = &c->ranks[0].win;
    for (int s = 0; s < c->nranks; s++) {
        const struct lbw_winpost *p = &c->ranks[s].win;
        if (p->kind != 1)
            return lb_err(ncclInvalidUsage,
                          "%s : rank %d called ncclCommWindowDeregister while rank %d registers "
                          "a window: window calls must match on every rank",
                          opname, s, c->rank);
        if (p->status != ncclSuccess)
            return s == c->rank ? (ncclResult_t)p->status
                                : lb_err((ncclResult_t)p->status,
                                         "%s : rank %d could not register its window", opname, s);
        if (p->flags != p0->flags)
            return lb_err(ncclInvalidUsage,
                          "%s : window flags differ between ranks (rank 0: 0x%x, rank %d: 0x%x)",
                          opname, p0->flags, s, p->flags);
    }
    if (!(p0->flags & LB_WIN_SYMMETRIC)) return ncclSuccess;
    for (int s = 0; s < c->nranks; s++) {
        const struct lbw_winpost *p = &c->ranks[s].win;
        if (p->size != p0->size)
            return lb_err(ncclInvalidUsage,
                          "%s : NCCL_WIN_COLL_SYMMETRIC needs the same size on every rank, but "
                          "rank 0 registers %llu bytes and rank %d %llu",
                          opname, (unsigned long long)p0->size, s, (unsigned long long)p->size);
        if (p->addr % LB_WIN_ALIGN != 0)
            return lb_err(ncclInvalidUsage,
                          "%s : NCCL_WIN_COLL_SYMMETRIC needs buffers aligned to "
                          "NCCL_WIN_REQUIRED_ALIGNMENT (%d bytes), but rank %d's buffer 0x%llx is not",
                          opname, LB_WIN_ALIGN, s, (unsigned long long)p->addr);
    }
    return ncclSuccess;
}

/* Build this rank's view of everyone's window from the posts. */
static ncclResult_t map_peers(struct lb_comm *c, struct lb_win *w, const char *opname) {
    int R = c->nranks;
    w->peer = calloc((size_t)R, sizeof *w->peer);
    w->psize = calloc((size_t)R, sizeof *w->psize);
    w->maps = calloc((size_t)R, sizeof *w->maps);
    w->maplens = calloc((size_t)R, sizeof *w->maplens);
    if (!w->peer || !w->psize || !w->maps || !w->maplens)
        return lb_err(ncclSystemError, "%s : out of memory", opname);
    for (int s = 0; s < R; s++) {
        const struct lbw_winpost *p = &c->ranks[s].win;
        w->psize[s] = p->size;
        if (c->ranks[s].pid == c->pid) {
            w->peer[s] = (char *)(uintptr_t)p->addr;
            continue;
        }
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)c->ranks[s].pid, (int)p->fd);
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0)
            return lb_err(ncclSystemError, "%s : cannot open rank %d's memory (%s): %s", opname, s,
                          path, strerror(errno));
        size_t moff = p->fdoff & ~(size_t)(LB_PAGE - 1);
        size_t len = page_up(p->fdoff - moff + p->size);
        void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)moff);
        int e = errno;
        close(fd);
        if (m == MAP_FAILED)
            return lb_err(ncclSystemError, "%s : cannot map rank %d's window (%zu bytes): %s", opname,
                          s, len, strerror(e));
        w->maps[s] = m;
        w->maplens[s] = len;
        w->peer[s] = (char *)m + (p->fdoff - moff);
    }
    return ncclSuccess;
}

static ncclResult_t window_api_checks(struct lb_comm *c, const char *opname) {
    ncclResult_t r = lb_comm_ensure_ready(c, opname);
    if (r != ncclSuccess) return r;
    if (lb_group_depth() > 0)
        return lb_err(ncclInvalidUsage,
                      "%s : the loopback does not defer window calls inside ncclGroupStart/End; "
                      "call it outside a group",
                      opname);
    return ncclSuccess;
}

ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win,
                                    int winFlags) {
    const char *opname = "ncclCommWindowRegister";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (win == NULL) return lb_err(ncclInvalidArgument, "%s : win argument is NULL", opname);
    *win = NULL;
    if (buff == NULL || size == 0)
        return lb_err(ncclInvalidArgument, "%s : invalid pointer %p / size %zu", opname, buff, size);
    if ((r = window_api_checks(c, opname)) != ncclSuccess) return r;

    struct lbw_winpost post;
    memset(&post, 0, sizeof post);
    post.kind = 1;
    ncclResult_t local = local_checks(c, buff, size, winFlags, &post, opname);
    post.status = (int32_t)local;
    uint64_t seq;
    if ((r = round_post(c, &post, &seq, opname)) != ncclSuccess) return r;
    ncclResult_t verdict = global_checks(c, opname);
    struct lb_win *w = NULL;
    if (verdict == ncclSuccess) {
        w = calloc(1, sizeof *w);
        if (!w) {
            verdict = lb_err(ncclSystemError, "%s : out of memory", opname);
        } else {
            w->magic = LB_WIN_MAGIC;
            w->c = c;
            w->user = buff;
            w->size = size;
            w->flags = winFlags;
            w->nranks = c->nranks;
            verdict = map_peers(c, w, opname);
        }
    }
    round_done(c, seq);
    /* everyone's own failure was decided alike above, except a failure to map */
    int bad = -1;
    ncclResult_t agreed = round_agree(c, 1, verdict, &bad, opname);
    if (agreed != ncclSuccess || verdict != ncclSuccess) {
        win_free(w);
        if (verdict != ncclSuccess) return verdict;
        if (bad >= 0)
            return lb_err(agreed, "%s : rank %d could not map its peers' windows", opname, bad);
        return agreed;
    }
    pthread_mutex_lock(&c->mu);
    w->next = c->wins;
    c->wins = w;
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_lock(&g_win_mu);
    w->gnext = g_wins;
    g_wins = w;
    pthread_mutex_unlock(&g_win_mu);
    *win = (ncclWindow_t)(void *)w;
    return ncclSuccess;
}
LB_ALIAS(ncclCommWindowRegister)

ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
    const char *opname = "ncclCommWindowDeregister";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (win == NULL) return ncclSuccess;
    pthread_mutex_lock(&c->mu);
    int known = lb_win_lookup(c, win, NULL, NULL, -1, NULL);
    pthread_mutex_unlock(&c->mu);
    if (!known)
        return lb_err(ncclInvalidArgument, "%s : window %p is not registered with communicator %p",
                      opname, (void *)win, (void *)comm);
    if ((r = window_api_checks(c, opname)) != ncclSuccess) return r;
    struct lbw_winpost post;
    memset(&post, 0, sizeof post);
    post.kind = 2;
    post.fd = -1;
    uint64_t seq;
    if ((r = round_post(c, &post, &seq, opname)) != ncclSuccess) return r;
    ncclResult_t verdict = ncclSuccess;
    for (int s = 0; s < c->nranks && verdict == ncclSuccess; s++)
        if (c->ranks[s].win.kind != 2)
            verdict = lb_err(ncclInvalidUsage,
                             "%s : rank %d registers a window while rank %d deregisters one: "
                             "window calls must match on every rank",
                             opname, s, c->rank);
    round_done(c, seq);
    if (verdict != ncclSuccess) return verdict;
    struct lb_win *w = (struct lb_win *)(void *)win;
    pthread_mutex_lock(&c->mu);
    for (struct lb_win **pp = &c->wins; *pp; pp = &(*pp)->next) {
        if (*pp == w) {
            *pp = w->next;
            break;
        }
    }
    pthread_mutex_unlock(&c->mu);
    win_unpublish(w);
    win_free(w);
    return ncclSuccess;
}
LB_ALIAS(ncclCommWindowDeregister)
#endif /* 2.27.3 */

#if LB_AT_LEAST(2, 29, 2)
ncclResult_t ncclWinGetUserPtr(ncclComm_t comm, ncclWindow_t win, void **outUserPtr) {
    const char *opname = "ncclWinGetUserPtr";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (outUserPtr == NULL)
        return lb_err(ncclInvalidArgument, "%s : outUserPtr argument is NULL", opname);
    if (win == NULL) return lb_err(ncclInvalidArgument, "%s : win argument is NULL", opname);
    pthread_mutex_lock(&c->mu);
    int known = lb_win_lookup(c, win, outUserPtr, NULL, -1, NULL);
    pthread_mutex_unlock(&c->mu);
    if (!known)
        return lb_err(ncclInvalidArgument, "%s : window %p is not registered with communicator %p",
                      opname, (void *)win, (void *)comm);
    return ncclSuccess;
}
LB_ALIAS(ncclWinGetUserPtr)

#endif /* 2.29.2 */
