/*
 * NCCL memory and windows in the loopback libnccl: ncclMemAlloc/ncclMemFree, the window
 * objects and their lookups, and a communicator's RMA state (signal counts, set up at
 * init). Registration, deregistration and ncclWinGetUserPtr are in winreg.c, the window
 * pointer functions of nccl_device/host.h in props.c.
 *
 * ncclMemAlloc memory is a loopback device allocation (so every buffer check accepts
 * it) whose pages are a memfd mapped over the allocation's page-aligned middle. Peers
 * reach it directly: in a thread world a peer's window is the peer's own address; in a
 * process world each rank maps the peer's memfd (opened as /proc/<pid>/fd/<fd>) when
 * the window is registered, so the peer pointers read and write the peer's bytes.
 */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define LB_PAGE 4096

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

int lb_mem_find(const void *p, size_t bytes, int *fd, size_t *off) {
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

/* ---- window objects --------------------------------------------------------------------- */

static pthread_mutex_t g_win_mu = PTHREAD_MUTEX_INITIALIZER;
static struct lb_win *g_wins;

/* A peer's window mapped into this process is device memory of the peer's device for
 * the cudart's checks (cudaMemcpy, cudaPointerGetAttributes), as a UVA peer pointer is
 * on a GPU. */
void lb_win_map_register(struct lb_win *w, int peer, int device) {
    w->mapreg[peer] = pynccl_lb_register_foreign_range(w->maps[peer], w->maplens[peer],
                                                       device) == 0;
}

void lb_win_free(struct lb_win *w) {
    if (!w) return;
    for (int p = 0; w->maps && p < w->nranks; p++) {
        if (!w->maps[p]) continue;
        if (w->mapreg[p]) pynccl_lb_unregister_foreign_range(w->maps[p]);
        munmap(w->maps[p], w->maplens[p]);
    }
    free(w->mapreg);
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
        lb_win_free(w);
        w = n;
    }
}

void lb_win_publish(struct lb_comm *c, struct lb_win *w) {
    w->magic = LB_WIN_MAGIC;
    pthread_mutex_lock(&c->mu);
    w->next = c->wins;
    c->wins = w;
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_lock(&g_win_mu);
    w->gnext = g_wins;
    g_wins = w;
    pthread_mutex_unlock(&g_win_mu);
}

void lb_win_unlink(struct lb_comm *c, struct lb_win *w) {
    pthread_mutex_lock(&c->mu);
    for (struct lb_win **pp = &c->wins; *pp; pp = &(*pp)->next) {
        if (*pp == w) {
            *pp = w->next;
            break;
        }
    }
    pthread_mutex_unlock(&c->mu);
    win_unpublish(w);
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

/* ---- a communicator's RMA state ------------------------------------------------------ */

#define LB_RMA_MAX_BYTES (64u << 20) /* cap on the world's signal area */

ncclResult_t lb_rma_setup(struct lb_comm *c, const ncclConfig_t *cfg, const char *opname) {
    int nctx = 1, nsig = 1;
#if LB_AT_LEAST(2, 29, 0)
    if (cfg->numRmaCtx != NCCL_CONFIG_UNDEF_INT) nctx = cfg->numRmaCtx;
#endif
#if LB_AT_LEAST(2, 31, 0)
    if (cfg->numRmaSig != NCCL_CONFIG_UNDEF_INT) nsig = cfg->numRmaSig;
#endif
    (void)cfg;
    if (nctx < 0 || nsig < 0)
        return lb_err(ncclInvalidArgument, "%s : Invalid config numRmaCtx %d / numRmaSig %d",
                      opname, nctx, nsig);
    size_t R = (size_t)c->nranks;
    if ((double)R * (double)R * nctx * nsig * 8.0 > LB_RMA_MAX_BYTES)
        return lb_err(ncclInvalidArgument,
                      "%s : numRmaCtx=%d x numRmaSig=%d signals for %d ranks exceed the loopback's "
                      "%u MiB of signal space",
                      opname, nctx, nsig, c->nranks, LB_RMA_MAX_BYTES >> 20);
    c->rma_ctx = nctx;
    c->rma_sig = nsig;
    size_t n = R * (size_t)nctx * (size_t)nsig;
    c->sig_waited = calloc(n ? n : 1, sizeof *c->sig_waited);
    if (!c->sig_waited) return lb_err(ncclSystemError, "%s : out of memory", opname);
    return ncclSuccess;
}

void lb_rma_quiesce(struct lb_comm *c) {
    pthread_mutex_lock(&c->mu);
    while (c->rma_running) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

void lb_rma_free(struct lb_comm *c) {
    lb_win_release_all(c);
    free(c->sig_waited);
    c->sig_waited = NULL;
}
