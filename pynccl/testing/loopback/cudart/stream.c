/*
 * pynccl loopback libcudart: stream objects, their queues and worker threads.
 * Above core.c only; stream capture (capture.c) sits on top of this file, and so
 * does the public stream API (api.c).
 *
 * Every stream (user streams, each device's legacy default stream, each thread's
 * per-thread default stream) owns a worker thread, started on its first task, that
 * runs the stream's queue in order. A task may block (the loopback libnccl's
 * collectives wait for their peers), so streams never share a worker.
 *
 * GPU semantics kept: the legacy default stream synchronizes implicitly with the
 * blocking streams of its device (work on one waits for earlier work on the
 * other), implemented with internal "wait for stream S to reach seq N" tasks;
 * events are (generation, completed generation, timestamp) triples advanced by
 * record tasks.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#define LB_UNLOAD_WAIT_MS 500 /* running tasks' grace at unload */
#define LB_SPIN_MS 0.05 /* a synchronizer polls this long before sleeping */

LB_HIDDEN atomic_uint_fast64_t g_ticket = 1;
LB_HIDDEN atomic_long g_pending;
LB_HIDDEN atomic_int g_live_workers;


static pthread_rwlock_t g_streams_lock = PTHREAD_RWLOCK_INITIALIZER;
static lb_ptrset g_streams; /* every live stream, of every kind */

static pthread_mutex_t g_legacy_mu = PTHREAD_MUTEX_INITIALIZER;
static struct CUstream_st *_Atomic *g_legacy; /* [g_ndev], created lazily */

/* Each thread's per-thread default streams, [g_ndev], as this key's value: glibc
 * calls its destructor at thread exit (and has cleared the value by then). */
static pthread_key_t g_pt_key;

/* ---- small helpers ------------------------------------------------------- */

static void deadline_after(struct timespec *ts, long ms) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static void cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
}

static bool is_blocking(const struct CUstream_st *s) {
    return s->kind == LB_STREAM_PER_THREAD ||
           (s->kind == LB_STREAM_USER && !(s->flags & cudaStreamNonBlocking));
}

LB_HIDDEN bool lb_stream_is_blocking(const struct CUstream_st *s) { return is_blocking(s); }

LB_HIDDEN bool lb_is_default_handle(cudaStream_t h) {
    return h == NULL || h == cudaStreamLegacy || h == cudaStreamPerThread;
}

/* ---- stream objects ------------------------------------------------------ */

LB_HIDDEN void lb_stream_ref(struct CUstream_st *s) { atomic_fetch_add(&s->refs, 1); }

LB_HIDDEN void lb_stream_put(struct CUstream_st *s) {
    if (atomic_fetch_sub(&s->refs, 1) != 1) return;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_done);
    free(s);
}

LB_HIDDEN struct CUstream_st *lb_stream_new(int device, unsigned flags, enum lb_stream_kind kind) {
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    pthread_mutex_init(&s->mu, NULL);
    cond_init_monotonic(&s->cv_work);
    cond_init_monotonic(&s->cv_done);
    s->device = device;
    s->flags = flags;
    s->kind = kind;
    atomic_init(&s->refs, 1);
    pthread_rwlock_wrlock(&g_streams_lock);
    bool ok = ptrset_add(&g_streams, s);
    pthread_rwlock_unlock(&g_streams_lock);
    if (!ok) {
        lb_stream_put(s);
        return NULL;
    }
    return s;
}

static struct CUstream_st *legacy_stream(int device) {
    struct CUstream_st *s = atomic_load(&g_legacy[device]);
    if (s != NULL) return s;
    pthread_mutex_lock(&g_legacy_mu);
    s = atomic_load(&g_legacy[device]);
    if (s == NULL) {
        s = lb_stream_new(device, cudaStreamDefault, LB_STREAM_LEGACY);
        if (s != NULL) atomic_store(&g_legacy[device], s);
    }
    pthread_mutex_unlock(&g_legacy_mu);
    return s;
}

static struct CUstream_st *per_thread_stream(int device) {
    struct CUstream_st **pts = pthread_getspecific(g_pt_key);
    if (pts == NULL) {
        pts = calloc((size_t)g_ndev, sizeof *pts);
        if (pts == NULL || pthread_setspecific(g_pt_key, pts) != 0) {
            free(pts);
            return NULL;
        }
    }
    if (pts[device] == NULL) pts[device] = lb_stream_new(device, 0, LB_STREAM_PER_THREAD);
    return pts[device];
}

/* Resolve a user handle to a referenced stream (put it when done). */
LB_HIDDEN cudaError_t lb_stream_get(cudaStream_t h, const char *fn, struct CUstream_st **out) {
    if (lb_is_default_handle(h)) {
        int dev = lb_current_device();
        if (dev >= g_ndev) return lb_no_device(fn);
        struct CUstream_st *s = h == cudaStreamPerThread ? per_thread_stream(dev)
                                                          : legacy_stream(dev);
        if (s == NULL) return lb_fail(cudaErrorMemoryAllocation, fn, "cannot create a stream");
        lb_stream_ref(s);
        *out = s;
        return cudaSuccess;
    }
    pthread_rwlock_rdlock(&g_streams_lock);
    bool live = ptrset_has(&g_streams, h);
    if (live) lb_stream_ref(h);
    pthread_rwlock_unlock(&g_streams_lock);
    if (!live)
        return lb_fail(cudaErrorInvalidResourceHandle, fn, "stream %p is not a live stream",
                       (void *)h);
    *out = h;
    return cudaSuccess;
}

/* ---- the worker ---------------------------------------------------------- */

static void *worker_main(void *arg) {
    struct CUstream_st *s = arg;
    char name[16];
    snprintf(name, sizeof name, "lb-%s-d%d",
             s->kind == LB_STREAM_LEGACY ? "legacy" : s->kind == LB_STREAM_USER ? "strm" : "pts",
             s->device);
    pthread_setname_np(pthread_self(), name);
    lb_set_thread_device(s->device); /* tasks run "on" their stream's device */
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->head == NULL && !s->stopping) pthread_cond_wait(&s->cv_work, &s->mu);
        lb_task *t = s->head;
        if (t == NULL) break; /* stopping and drained */
        s->head = t->next;
        if (s->head == NULL) s->tail = NULL;
        s->running = true;
        s->running_ticket = t->ticket;
        pthread_mutex_unlock(&s->mu);
        t->run(t->arg);
        if (t->release != NULL) t->release(t->arg);
        free(t);
        pthread_mutex_lock(&s->mu);
        s->running = false;
        __atomic_store_n(&s->done_seq, s->done_seq + 1, __ATOMIC_RELEASE); /* see wait_seq */
        atomic_fetch_sub(&g_pending, 1);
        pthread_cond_broadcast(&s->cv_done);
    }
    s->worker_exited = true;
    pthread_cond_broadcast(&s->cv_done);
    pthread_mutex_unlock(&s->mu);
    atomic_fetch_sub(&g_live_workers, 1);
    lb_stream_put(s); /* the worker's own reference */
    return NULL;
}

/* Start s's worker; s->mu held. Signals stay with the application's threads. */
static bool worker_start(struct CUstream_st *s) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    lb_stream_ref(s);
    atomic_fetch_add(&g_live_workers, 1);
    int rc = pthread_create(&s->worker, NULL, worker_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        atomic_fetch_sub(&g_live_workers, 1);
        atomic_fetch_sub(&s->refs, 1); /* s->refs >= 2 here: never the last */
        return false;
    }
    s->worker_started = true;
    return true;
}

/* Stop s's worker (s->mu not held): join it if it exits within timeout_ms, else
 * detach it (it finishes its queue, then exits and drops its reference). */
LB_HIDDEN void lb_stream_retire(struct CUstream_st *s, long timeout_ms, const char *why) {
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_cond_broadcast(&s->cv_work);
    if (!s->worker_started || s->worker_claimed) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    s->worker_claimed = true;
    bool self = pthread_equal(pthread_self(), s->worker);
    if (!self) {
        struct timespec deadline;
        deadline_after(&deadline, timeout_ms);
        while (!s->worker_exited)
            if (pthread_cond_timedwait(&s->cv_done, &s->mu, &deadline) == ETIMEDOUT) break;
    }
    bool exited = s->worker_exited;
    uint64_t left = s->enq_seq - s->done_seq;
    pthread_mutex_unlock(&s->mu);
    if (exited) {
        pthread_join(s->worker, NULL);
    } else {
        pthread_detach(s->worker);
        if (why != NULL)
            fprintf(stderr, "pynccl loopback cudart: %s: a stream of device %d still had %llu "
                            "task(s) after %ld ms (one is blocked?); its worker thread exits when "
                            "they finish\n", why, s->device, (unsigned long long)left, timeout_ms);
    }
}

/* ---- pushing tasks ------------------------------------------------------- */

typedef struct {
    struct CUstream_st *target;
    uint64_t seq;
} lb_stream_wait;

static void wait_stream_run(void *arg) {
    lb_stream_wait *w = arg;
    lb_stream_wait_seq(w->target, w->seq);
}

static void wait_stream_release(void *arg) {
    lb_stream_wait *w = arg;
    lb_stream_put(w->target);
    free(w);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

LB_HIDDEN void lb_stream_wait_seq(struct CUstream_st *s, uint64_t seq) {
    /* Short work (a small copy) finishes within microseconds, far less than a futex
     * sleep and wake-up costs: poll briefly before blocking. */
    double until = 0;
    for (unsigned i = 0;; i++) {
        if (__atomic_load_n(&s->done_seq, __ATOMIC_ACQUIRE) >= seq) return;
        if ((i & 63) == 0) {
            double now = lb_now_ms();
            if (until == 0)
                until = now + LB_SPIN_MS;
            else if (now > until)
                break;
        }
        cpu_relax();
    }
    pthread_mutex_lock(&s->mu);
    while (s->done_seq < seq) pthread_cond_wait(&s->cv_done, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

static void push_locked(struct CUstream_st *s, lb_task *t) {
    /* g_pending first: a deferred free that sees a ticket also sees the count. */
    atomic_fetch_add(&g_pending, 1);
    t->ticket = atomic_fetch_add(&g_ticket, 1);
    t->next = NULL;
    if (s->tail != NULL)
        s->tail->next = t;
    else
        s->head = t;
    s->tail = t;
    s->enq_seq++;
}

static lb_task *wait_task_new(struct CUstream_st *target, uint64_t seq) {
    lb_task *t = malloc(sizeof *t);
    lb_stream_wait *w = malloc(sizeof *w);
    if (t == NULL || w == NULL) {
        free(t);
        free(w);
        return NULL;
    }
    w->target = target;
    w->seq = seq;
    t->run = wait_stream_run;
    t->release = wait_stream_release;
    t->arg = w;
    return t;
}

/* Pending work s must wait for before its next task (legacy-stream semantics).
 * Returns the number of snapshots in *out (malloc'd), or -1 on allocation failure. */
static long implicit_waits(struct CUstream_st *s, lb_snap **out) {
    *out = NULL;
    if (s->kind == LB_STREAM_LEGACY) return lb_sync_targets(s, s->device, LB_SYNC_PEERS, out);
    if (!is_blocking(s)) return 0;
    struct CUstream_st *legacy = atomic_load(&g_legacy[s->device]);
    if (legacy == NULL) return 0;
    pthread_mutex_lock(&legacy->mu);
    uint64_t seq = legacy->done_seq < legacy->enq_seq ? legacy->enq_seq : 0;
    pthread_mutex_unlock(&legacy->mu);
    if (seq == 0) return 0;
    lb_snap *snap = malloc(sizeof *snap);
    if (snap == NULL) return -1;
    lb_stream_ref(legacy); /* legacy streams live until unload */
    snap->stream = legacy;
    snap->seq = seq;
    *out = snap;
    return 1;
}

LB_HIDDEN cudaError_t lb_push_fail(cudaError_t err, const char *fn, const void *stream) {
    if (err >= cudaErrorStreamCaptureUnsupported && err <= cudaErrorStreamCaptureWrongThread)
        return err; /* the capture code said why */
    if (err == cudaErrorIllegalState) return err;
    return lb_fail(err, fn, "cannot enqueue on stream %p", stream);
}

LB_HIDDEN cudaError_t lb_stream_enqueue(struct CUstream_st *s, lb_task_fn run,
                                        lb_task_fn release, void *arg, uint64_t *seq) {
    if (seq != NULL) *seq = 0;
    lb_task *task = malloc(sizeof *task);
    if (task == NULL) return cudaErrorMemoryAllocation;
    task->run = run;
    task->release = release;
    task->arg = arg;

    lb_snap *snaps;
    long nsnaps = implicit_waits(s, &snaps);
    if (nsnaps < 0) {
        free(task);
        return cudaErrorMemoryAllocation;
    }
    lb_task **waits = nsnaps ? calloc((size_t)nsnaps, sizeof *waits) : NULL;
    bool ok = nsnaps == 0 || waits != NULL;
    for (long i = 0; ok && i < nsnaps; i++) {
        waits[i] = wait_task_new(snaps[i].stream, snaps[i].seq);
        ok = waits[i] != NULL;
    }

    cudaError_t err = cudaSuccess;
    pthread_mutex_lock(&s->mu);
    if (!ok)
        err = cudaErrorMemoryAllocation;
    else if (s->stopping)
        err = atomic_load(&g_shutdown) ? cudaErrorCudartUnloading : cudaErrorInvalidResourceHandle;
    else if (!s->worker_started && !worker_start(s))
        err = cudaErrorMemoryAllocation;
    if (err == cudaSuccess) {
        for (long i = 0; i < nsnaps; i++) {
            /* Skip a wait an earlier task of this queue already covers. */
            uint64_t *covered = s->kind == LB_STREAM_LEGACY ? &snaps[i].stream->synced_by_legacy
                                                            : &s->synced_legacy;
            if (snaps[i].seq > *covered) {
                *covered = snaps[i].seq;
                push_locked(s, waits[i]);
                waits[i] = NULL; /* now owned by the queue, with its stream reference */
                snaps[i].stream = NULL;
            }
        }
        push_locked(s, task);
        task = NULL;
        if (seq != NULL) *seq = s->enq_seq;
        pthread_cond_signal(&s->cv_work);
    }
    pthread_mutex_unlock(&s->mu);

    for (long i = 0; i < nsnaps; i++) {
        if (waits != NULL && waits[i] != NULL) {
            free(waits[i]->arg);
            free(waits[i]);
        }
        if (snaps[i].stream != NULL) lb_stream_put(snaps[i].stream);
    }
    free(waits);
    free(snaps);
    free(task);
    return err;
}

/* ---- synchronization targets --------------------------------------------- */

/* Snapshot (stream, enq_seq) of every stream with pending work in scope: for a
 * synchronize of s, s itself plus (legacy stream) the device's blocking streams; every
 * stream of `device`; or what the legacy stream s waits for before its next task, the
 * device's other blocking streams. */
LB_HIDDEN long lb_sync_targets(struct CUstream_st *s, int device, enum lb_sync_scope scope,
                               lb_snap **out) {
    pthread_rwlock_rdlock(&g_streams_lock);
    lb_snap *snaps = malloc((g_streams.n + 1) * sizeof *snaps);
    long n = 0;
    for (size_t i = 0; snaps != NULL && i < g_streams.n; i++) {
        struct CUstream_st *t = g_streams.items[i];
        bool take;
        if (scope == LB_SYNC_DEVICE)
            take = t->device == device;
        else if (scope == LB_SYNC_PEERS)
            take = t != s && t->device == s->device && is_blocking(t);
        else
            take = t == s || (s->kind == LB_STREAM_LEGACY && t->device == s->device &&
                              is_blocking(t));
        if (!take) continue;
        pthread_mutex_lock(&t->mu);
        if (t->done_seq < t->enq_seq) {
            snaps[n].stream = t;
            snaps[n].seq = t->enq_seq;
            lb_stream_ref(t);
            n++;
        }
        pthread_mutex_unlock(&t->mu);
    }
    pthread_rwlock_unlock(&g_streams_lock);
    *out = snaps;
    return snaps == NULL ? -1 : n;
}

LB_HIDDEN void lb_wait_snaps(lb_snap *snaps, long n) {
    for (long i = 0; i < n; i++) {
        lb_stream_wait_seq(snaps[i].stream, snaps[i].seq);
        lb_stream_put(snaps[i].stream);
    }
    free(snaps);
}

LB_HIDDEN uint64_t lb_min_pending_ticket(void) {
    if (atomic_load(&g_pending) == 0) return UINT64_MAX;
    uint64_t min = UINT64_MAX;
    pthread_rwlock_rdlock(&g_streams_lock);
    for (size_t i = 0; i < g_streams.n; i++) {
        struct CUstream_st *t = g_streams.items[i];
        pthread_mutex_lock(&t->mu);
        uint64_t oldest = t->running ? t->running_ticket
                          : t->head != NULL ? t->head->ticket
                                            : UINT64_MAX;
        pthread_mutex_unlock(&t->mu);
        if (oldest < min) min = oldest;
    }
    pthread_rwlock_unlock(&g_streams_lock);
    return min;
}

int pynccl_lb_stream_device(void *stream) {
    if (atomic_load(&g_fork_poisoned)) return -1;
    if (lb_is_default_handle(stream)) return lb_current_device() < g_ndev ? lb_current_device() : -1;
    pthread_rwlock_rdlock(&g_streams_lock);
    int dev = ptrset_has(&g_streams, stream) ? ((struct CUstream_st *)stream)->device : -1;
    pthread_rwlock_unlock(&g_streams_lock);
    return dev;
}

/* Remove s from the set of live streams (false: it was not live). */
LB_HIDDEN bool lb_stream_unlink(struct CUstream_st *s) {
    pthread_rwlock_wrlock(&g_streams_lock);
    bool live = ptrset_del(&g_streams, s);
    pthread_rwlock_unlock(&g_streams_lock);
    return live;
}

LB_HIDDEN void lb_streams_init(void (*per_thread_exit)(void *)) {
    g_legacy = calloc((size_t)g_ndev + 1, sizeof *g_legacy);
    pthread_key_create(&g_pt_key, per_thread_exit);
}

/* At unload (process exit): work not yet started is dropped, as a GPU context's
 * would be (its memory is left to the exit); running tasks get a short, bounded
 * time to finish, so that a task blocked forever (a collective waiting for a dead peer) cannot hang the exit. */
LB_HIDDEN void lb_streams_fini(void) {
    pthread_rwlock_rdlock(&g_streams_lock);
    size_t n = g_streams.n;
    struct CUstream_st **all = malloc((n + 1) * sizeof *all);
    if (all != NULL)
        for (size_t i = 0; i < n; i++) {
            all[i] = g_streams.items[i];
            lb_stream_ref(all[i]);
        }
    pthread_rwlock_unlock(&g_streams_lock);
    if (all == NULL) return;
    for (size_t i = 0; i < n; i++) {
        struct CUstream_st *s = all[i];
        pthread_mutex_lock(&s->mu);
        lb_task *dropped = s->head;
        uint64_t count = 0;
        for (lb_task *t = dropped; t != NULL; t = t->next) count++;
        s->head = s->tail = NULL;
        __atomic_store_n(&s->done_seq, s->done_seq + count, __ATOMIC_RELEASE);
        atomic_fetch_sub(&g_pending, (long)count);
        s->stopping = true;
        pthread_cond_broadcast(&s->cv_work);
        pthread_cond_broadcast(&s->cv_done);
        pthread_mutex_unlock(&s->mu);
        /* Neither callback runs: libnccl (which depends on us) has already been
         * finalized, so its release functions may touch freed state. */
        while (dropped != NULL) {
            lb_task *next = dropped->next;
            free(dropped);
            dropped = next;
        }
    }
    struct timespec deadline;
    deadline_after(&deadline, LB_UNLOAD_WAIT_MS);
    for (size_t i = 0; i < n; i++) {
        struct CUstream_st *s = all[i];
        pthread_mutex_lock(&s->mu);
        bool mine = s->worker_started && !s->worker_claimed;
        if (mine) {
            s->worker_claimed = true;
            bool self = pthread_equal(pthread_self(), s->worker); /* a task called exit() */
            while (!self && !s->worker_exited)
                if (pthread_cond_timedwait(&s->cv_done, &s->mu, &deadline) == ETIMEDOUT) break;
        }
        bool exited = s->worker_exited;
        pthread_mutex_unlock(&s->mu);
        if (mine) {
            if (exited)
                pthread_join(s->worker, NULL);
            else
                pthread_detach(s->worker); /* blocked in a task: the process exit ends it */
        }
    }
    /* The streams themselves are left allocated: a detached worker may still use them. */
    free(all);
}

LB_HIDDEN void lb_streams_fork_prepare(void) {
    pthread_mutex_lock(&g_legacy_mu);
    pthread_rwlock_wrlock(&g_streams_lock);
}

LB_HIDDEN void lb_streams_fork_parent(void) {
    pthread_rwlock_unlock(&g_streams_lock);
    pthread_mutex_unlock(&g_legacy_mu);
}

LB_HIDDEN void lb_streams_fork_child(void) {
    pthread_rwlock_init(&g_streams_lock, NULL);
    pthread_mutex_init(&g_legacy_mu, NULL);
    /* Workers are not copied by fork: their streams would never make progress. */
    if (atomic_load(&g_live_workers) > 0) atomic_store(&g_fork_poisoned, 1);
}
