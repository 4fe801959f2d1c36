/*
 * Window registration and deregistration in the loopback libnccl (NCCL 2.27.3+).
 *
 * Registration is collective. Each call is one operation of two rounds over the world's
 * per-rank posts (struct lbw_winpost). Round 1: every rank posts its buffer with the
 * result of its own checks; everyone checks every post the same way (matching flags;
 * below 2.30.7, equal sizes for NCCL_WIN_COLL_SYMMETRIC) and maps its peers' memory
 * (window.c). Round 2: every rank posts whether its part succeeded, so that all return
 * the same result (NCCL would leave the others in its bootstrap barrier).
 *
 * What a rank may register, as NCCL's ncclDevrWindowRegisterInGroup (dev_runtime.cc):
 * only memory of ncclMemAlloc (NCCL: cuMem/VMM allocations; cudaMalloc memory fails in
 * cuMemRetainAllocationHandle), at NCCL_WIN_REQUIRED_ALIGNMENT from the allocation's
 * start, whatever the flags. PYNCCL_LOOPBACK_STRICT=0 lifts these buffer rules.
 *
 * Deregistration is local to the rank, at once, outside any group, as in NCCL.
 *
 * Inside ncclGroupStart/End registrations queue in the calling thread and run at the
 * outermost group end (launch.c), in waves of one operation per communicator whose posts
 * all go out before anyone waits: one thread may drive every rank (ncclCommInitAll), as
 * NCCL allows; a non-blocking group runs them on its worker thread (gjob.c). Outside a
 * group an operation is a group of one. Both calls switch the thread to relaxed capture
 * mode, as NCCL does, so that they are legal during a CUDA-graph capture.
 * ncclWinGetUserPtr (2.29.2) closes the file.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define LB_PAGE 4096
#define LB_WIN_FLAGS_KNOWN 0x0f /* NCCL_WIN_COLL_SYMMETRIC .. NCCL_WIN_CFT_COUNTED */
#define LB_WIN_SYMMETRIC 0x01
#define LB_WIN_ALIGN 4096 /* NCCL_WIN_REQUIRED_ALIGNMENT */
enum { LBW_REGISTER = 1 };

/* Relaxed capture mode for the calling thread (dev_runtime.cc does the same around
 * window registration); returns the mode to restore. */
LBN_UNUSED static enum cudaStreamCaptureMode relax_capture(void) {
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    return mode;
}

LBN_UNUSED static void restore_capture(enum cudaStreamCaptureMode mode) {
    cudaThreadExchangeStreamCaptureMode(&mode);
}

static __thread struct lb_wop *t_ops; /* the thread's group's queued operations */
static __thread int t_nops, t_capops;


#if LB_AT_LEAST(2, 27, 3)

static size_t page_up(size_t v) { return (v + LB_PAGE - 1) / LB_PAGE * LB_PAGE; }

/* One registration. */
struct lb_wop {
    struct lb_comm *c; /* ref held */
    int kind;
    void *buff;
    size_t size;
    int flags;
    ncclWindow_t *out;  /* receives the handle */
    struct lb_win *win; /* the one being built */
    uint64_t seq;       /* round posted */
    ncclResult_t r;     /* result so far */
    const char *opname;
};

/* ---- rounds ------------------------------------------------------------------------------ */

static int all_read(struct lb_comm *c, void *arg, int *blocker) {
    uint64_t seq = *(uint64_t *)arg;
    for (int s = 0; s < c->nranks; s++) {
        if (__atomic_load_n(&c->ranks[s].win.read, __ATOMIC_ACQUIRE) + 1 < seq) {
            *blocker = s;
            return 0;
        }
    }
    return 1;
}

static int all_posted(struct lb_comm *c, void *arg, int *blocker) {
    uint64_t seq = *(uint64_t *)arg;
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

/* Post *p as this rank's part of the comm's next round (once everyone has read the
 * previous one). */
static void round_post(struct lb_wop *o, const struct lbw_winpost *p) {
    struct lb_comm *c = o->c;
    uint64_t seq = c->win_rounds + 1;
    ncclResult_t r = lbw_wait_for(c, all_read, &seq, o->opname);
    if (r != ncclSuccess) {
        o->r = round_error(c, r, o->opname);
        o->seq = 0;
        return;
    }
    struct lbw_winpost *me = &c->ranks[c->rank].win;
    me->addr = p->addr;
    me->size = p->size;
    me->fdoff = p->fdoff;
    me->fd = p->fd;
    me->flags = p->flags;
    me->kind = p->kind;
    me->status = p->status;
    __atomic_store_n(&me->seq, seq, __ATOMIC_RELEASE);
    lbw_notify(c);
    o->seq = seq;
}

/* Wait for everyone's post of o's round; 0 if the round failed (o->r says why). */
static int round_wait(struct lb_wop *o) {
    if (!o->seq) return 0;
    ncclResult_t r = lbw_wait_for(o->c, all_posted, &o->seq, o->opname);
    if (r == ncclSuccess) return 1;
    o->r = round_error(o->c, r, o->opname);
    return 0;
}

static void round_done(struct lb_wop *o) {
    struct lb_comm *c = o->c;
    c->win_rounds = o->seq;
    __atomic_store_n(&c->ranks[c->rank].win.read, o->seq, __ATOMIC_RELEASE);
    lbw_notify(c);
}

/* ---- checks and mapping -------------------------------------------------------------------- */

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
                      "allocation (ncclMemAlloc)",
                      opname, buff, size);
    if (c->strict && dev != c->dev)
        return lb_err(ncclInvalidArgument, "%s : buffer %p is on device %d but the communicator is on device %d",
                      opname, buff, dev, c->dev);
    int fd = -1;
    size_t off = 0;
    int vmm = lb_mem_find(buff, size, &fd, &off);
    if (vmm) {
        post->fd = fd;
        post->fdoff = off;
    }
    if (c->strict && !vmm)
        return lb_err(ncclUnhandledCudaError,
                      "%s : Cuda failure 'invalid argument' (cuMemRetainAllocationHandle): "
                      "buffer %p (%zu bytes) does not lie in one ncclMemAlloc allocation; NCCL "
                      "registers windows only from cuMem (VMM) memory, never cudaMalloc's",
                      opname, buff, size);
    if (c->strict && off % LB_WIN_ALIGN != 0) /* off: from the allocation's start */
        return lb_err(ncclInvalidArgument,
                      "%s : Window address must be suitably aligned: buffer %p is %zu bytes into "
                      "its allocation, not a multiple of NCCL_WIN_REQUIRED_ALIGNMENT (%d), "
                      "whatever the window flags",
                      opname, buff, off, LB_WIN_ALIGN);
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
        if (p->status != ncclSuccess)
            return s == c->rank ? (ncclResult_t)p->status
                                : lb_err((ncclResult_t)p->status,
                                         "%s : rank %d could not register its window", opname, s);
        if (p->flags != p0->flags)
            return lb_err(ncclInvalidUsage,
                          "%s : window flags differ between ranks (rank 0: 0x%x, rank %d: 0x%x)",
                          opname, p0->flags, s, p->flags);
    }
#if !LB_AT_LEAST(2, 30, 7) /* from 2.30.7 "size may differ across ranks" */
    if (!(p0->flags & LB_WIN_SYMMETRIC)) return ncclSuccess;
    for (int s = 0; s < c->nranks; s++) {
        const struct lbw_winpost *p = &c->ranks[s].win;
        if (p->size != p0->size)
            return lb_err(ncclInvalidUsage,
                          "%s : NCCL_WIN_COLL_SYMMETRIC needs the same size on every rank before "
                          "NCCL 2.30.7, but rank 0 registers %llu bytes and rank %d %llu",
                          opname, (unsigned long long)p0->size, s, (unsigned long long)p->size);
    }
#endif
    return ncclSuccess;
}

/* This process's ordinal of a physical device (CUDA_VISIBLE_DEVICES may renumber it),
 * or fallback when it is not visible here. */
static int local_device(int phys, int fallback) {
    for (int d = 0; d < pynccl_lb_device_count(); d++)
        if (pynccl_lb_device_physical(d) == phys) return d;
    return fallback;
}

/* Build this rank's view of everyone's window from the posts. */
static ncclResult_t map_peers(struct lb_comm *c, struct lb_win *w, const char *opname) {
    int R = c->nranks;
    w->peer = calloc((size_t)R, sizeof *w->peer);
    w->psize = calloc((size_t)R, sizeof *w->psize);
    w->maps = calloc((size_t)R, sizeof *w->maps);
    w->maplens = calloc((size_t)R, sizeof *w->maplens);
    w->mapreg = calloc((size_t)R, 1);
    if (!w->peer || !w->psize || !w->maps || !w->maplens || !w->mapreg)
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
        lb_win_map_register(w, s, local_device(c->ranks[s].phys, c->dev));
    }
    return ncclSuccess;
}


/* ---- the two rounds of a wave ---------------------------------------------------------------- */

static void first_post(struct lb_wop *o) {
    struct lb_comm *c = o->c;
    if (!c->w || __atomic_load_n(&c->halt, __ATOMIC_ACQUIRE)) { /* destroyed in the group */
        o->r = lb_err(ncclInvalidUsage,
                      "%s : the communicator was destroyed or aborted before the group ended",
                      o->opname);
        o->seq = 0;
        return;
    }
    struct lbw_winpost p;
    memset(&p, 0, sizeof p);
    p.kind = o->kind;
    p.fd = -1;
    if (o->kind == LBW_REGISTER)
        p.status = (int32_t)local_checks(o->c, o->buff, o->size, o->flags, &p, o->opname);
    round_post(o, &p);
}

static void first_conclude(struct lb_wop *o) {
    struct lb_comm *c = o->c;
    if (!round_wait(o)) return;
    ncclResult_t v = global_checks(c, o->opname);
    if (v == ncclSuccess) {
        struct lb_win *w = calloc(1, sizeof *w);
        if (!w) {
            v = lb_err(ncclSystemError, "%s : out of memory", o->opname);
        } else {
            w->c = c;
            w->user = o->buff;
            w->size = o->size;
            w->flags = o->flags;
            w->nranks = c->nranks;
            o->win = w;
            v = map_peers(c, w, o->opname);
        }
    }
    round_done(o);
    o->r = v;
}

static void second_post(struct lb_wop *o) {
    if (!o->seq) return; /* the first round failed: the world is broken or aborted */
    struct lbw_winpost p;
    memset(&p, 0, sizeof p);
    p.kind = o->kind;
    p.fd = -1;
    p.status = (int32_t)o->r;
    round_post(o, &p);
}

static void second_conclude(struct lb_wop *o) {
    ncclResult_t mine = o->r;
    if (!round_wait(o)) return;
    struct lb_comm *c = o->c;
    for (int s = 0; s < c->nranks; s++) {
        ncclResult_t st = (ncclResult_t)c->ranks[s].win.status;
        if (st != ncclSuccess && mine == ncclSuccess) {
            o->r = lb_err(st, "%s : rank %d could not complete its part (%s)", o->opname, s,
                          ncclGetErrorString(st));
            break;
        }
    }
    round_done(o);
}

static void finish(struct lb_wop *o) {
    if (o->r == ncclSuccess) {
        lb_win_publish(o->c, o->win);
        *o->out = (ncclWindow_t)(void *)o->win;
    } else {
        lb_win_free(o->win);
    }
    lb_comm_unref(o->c);
}

/* Run ops[0..n) in waves of one per communicator; returns the first failure. */
static ncclResult_t run_ops(struct lb_wop *ops, int n) {
    int *wave = malloc((size_t)(n ? n : 1) * sizeof *wave);
    char *taken = calloc((size_t)(n ? n : 1), 1);
    ncclResult_t first = ncclSuccess;
    if (!wave || !taken) {
        first = lb_err(ncclSystemError, "ncclGroupEnd : out of memory");
        for (int i = 0; i < n; i++) lb_comm_unref(ops[i].c);
        n = 0;
    }
    for (int left = n; left > 0;) {
        int m = 0;
        for (int i = 0; i < n; i++) {
            int busy = taken[i];
            for (int k = 0; k < m && !busy; k++) busy = ops[wave[k]].c == ops[i].c;
            if (busy) continue;
            wave[m++] = i;
            taken[i] = 1;
        }
        for (int k = 0; k < m; k++) first_post(&ops[wave[k]]);
        for (int k = 0; k < m; k++) first_conclude(&ops[wave[k]]);
        for (int k = 0; k < m; k++) second_post(&ops[wave[k]]);
        for (int k = 0; k < m; k++) second_conclude(&ops[wave[k]]);
        for (int k = 0; k < m; k++) {
            if (first == ncclSuccess) first = ops[wave[k]].r;
            finish(&ops[wave[k]]);
        }
        left -= m;
    }
    free(wave);
    free(taken);
    return first;
}

static ncclResult_t one_job(void *arg) {
    ncclResult_t r = run_ops(arg, 1);
    free(arg);
    return r;
}

/* Queue o in the thread's group, or run it now (a non-blocking comm: a group of one,
 * launched by a worker). Takes the comm ref o holds. */
static ncclResult_t submit(struct lb_wop *o) {
    if (lb_group_depth() == 0) {
        if (o->c->blocking) return run_ops(o, 1);
        struct lb_wop *one = malloc(sizeof *one);
        if (!one) {
            lb_comm_unref(o->c);
            return lb_err(ncclSystemError, "%s : out of memory", o->opname);
        }
        *one = *o;
        return lb_gjob_start(&one->c, 1, one_job, one);
    }
    ncclResult_t r = lb_group_join_mode(o->c->blocking, o->opname);
    if (r != ncclSuccess) {
        lb_comm_unref(o->c);
        return r;
    }
    if (t_nops == t_capops) {
        int cap = t_capops ? 2 * t_capops : 8;
        struct lb_wop *grown = realloc(t_ops, (size_t)cap * sizeof *grown);
        if (!grown) {
            lb_comm_unref(o->c);
            return lb_group_error(lb_err(ncclSystemError, "%s : out of memory", o->opname));
        }
        t_ops = grown;
        t_capops = cap;
    }
    t_ops[t_nops++] = *o;
    return ncclSuccess;
}

ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win,
                                    int winFlags) {
    const char *opname = "ncclCommWindowRegister";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return lb_group_error(r);
    if (win == NULL)
        return lb_group_error(lb_err(ncclInvalidArgument, "%s : win argument is NULL", opname));
    *win = NULL;
    if (buff == NULL || size == 0)
        return lb_group_error(
            lb_err(ncclInvalidArgument, "%s : invalid pointer %p / size %zu", opname, buff, size));
    if ((r = lb_comm_ensure_ready(c, opname)) != ncclSuccess) return lb_group_error(r);
    struct lb_wop o = {c, LBW_REGISTER, buff, size, winFlags, win, NULL, 0, ncclSuccess, opname};
    lb_comm_ref(c);
    enum cudaStreamCaptureMode mode = relax_capture();
    r = lb_group_error(submit(&o));
    restore_capture(mode);
    return r;
}
LB_ALIAS(ncclCommWindowRegister)

/* Local to this rank, at once: the peers' views of this rank's window stay theirs to drop
 * (a process world keeps the memory mapped until they do). */
ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
    const char *opname = "ncclCommWindowDeregister";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (win == NULL) return ncclSuccess;
    enum cudaStreamCaptureMode mode = relax_capture();
    pthread_mutex_lock(&c->mu);
    int known = lb_win_lookup(c, win, NULL, NULL, -1, NULL);
    pthread_mutex_unlock(&c->mu);
    if (known) {
        struct lb_win *w = (struct lb_win *)(void *)win;
        lb_win_unlink(c, w);
        lb_win_free(w);
    }
    restore_capture(mode);
    if (!known)
        return lb_err(ncclInvalidArgument, "%s : window %p is not registered with communicator %p",
                      opname, (void *)win, (void *)comm);
    return ncclSuccess;
}
LB_ALIAS(ncclCommWindowDeregister)
#endif /* 2.27.3 */

int lb_win_group_take(struct lb_wop **ops) {
    int n = t_nops;
    *ops = t_ops;
    t_ops = NULL;
    t_nops = t_capops = 0;
    return n;
}

ncclResult_t lb_win_run(struct lb_wop *ops, int n) {
    ncclResult_t r = ncclSuccess;
#if LB_AT_LEAST(2, 27, 3)
    if (n) r = run_ops(ops, n);
#else
    (void)n;
#endif
    free(ops);
    return r;
}

void lb_win_drop(struct lb_wop *ops, int n) {
#if LB_AT_LEAST(2, 27, 3)
    for (int i = 0; i < n; i++) lb_comm_unref(ops[i].c);
#else
    (void)n;
#endif
    free(ops);
}

struct lb_comm *lb_win_op_comm(const struct lb_wop *ops, int i) {
#if LB_AT_LEAST(2, 27, 3)
    return ops[i].c;
#else
    (void)ops, (void)i;
    return NULL;
#endif
}

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
