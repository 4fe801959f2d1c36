/*
 * pynccl loopback libcudart: stream capture (above stream.c; graph.c turns what a
 * capture recorded into graphs).
 *
 * A capture sequence (cudaStreamBeginCapture .. cudaStreamEndCapture) records what is
 * enqueued on its streams as nodes instead of running it. The loopback's graph is the
 * list of those nodes in capture order, a valid (if more serial) order of CUDA's DAG:
 * every node was captured after the nodes it depends on. cudaGraphLaunch enqueues a
 * fresh copy of every node on the launch stream, in that order.
 *
 * Other streams join a capture by waiting on an event recorded inside it (a fork) and
 * must be joined back (another member stream waits on an event recorded after their
 * last node) before the capture ends, as in CUDA.
 *
 * What breaks a capture in CUDA fails here with CUDA's error and invalidates it: sync
 * or query of a capturing stream, work on the legacy stream while a blocking stream of
 * its device captures, uncaptured dependencies, task kinds that cannot be copied, and
 * the "potentially unsafe" calls (cudaMalloc, cudaFree, cudaMemcpy, cudaMemset,
 * cudaDeviceSynchronize, cudaStreamSynchronize / cudaStreamQuery and cudaEventQuery /
 * cudaEventSynchronize of anything) where the capture modes forbid them.
 *
 * CUDA's rule (cudaThreadExchangeStreamCaptureMode), by the calling thread's own
 * interaction mode: global (every thread's default) forbids unsafe calls while the
 * thread has a capture of its own under way that was not begun relaxed, or while any
 * other thread has a capture begun in global mode under way; thread-local only the
 * former; relaxed never. A relaxed thread is still refused what necessarily
 * conflicts with a capture (sync or query of a capturing stream, a captured event).
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct lb_capture {
    struct lb_capture *next;
    uint64_t id;
    enum cudaStreamCaptureMode mode;
    pthread_t thread;
    bool invalidated;
    char why[200]; /* what invalidated it */
    struct CUstream_st *origin;
    struct CUstream_st **members; /* referenced; members[0] is the origin */
    size_t nmembers, cap_members;
    lb_node *nodes;
    size_t nnodes, cap_nodes;
};

LB_HIDDEN atomic_int g_ncaptures;
static pthread_mutex_t g_cap_mu = PTHREAD_MUTEX_INITIALIZER;
static struct lb_capture *g_captures;
static uint64_t g_next_capture_id = 1;

static const char *mode_name(enum cudaStreamCaptureMode mode) {
    switch (mode) {
    case cudaStreamCaptureModeGlobal: return "cudaStreamCaptureModeGlobal";
    case cudaStreamCaptureModeThreadLocal: return "cudaStreamCaptureModeThreadLocal";
    case cudaStreamCaptureModeRelaxed: return "cudaStreamCaptureModeRelaxed";
    }
    return "?";
}

/* ---- nodes ------------------------------------------------------------------- */

LB_HIDDEN void lb_nodes_release(lb_node *nodes, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (nodes[i].release != NULL) nodes[i].release(nodes[i].arg);
    free(nodes);
}

/* ---- capture sequences (g_cap_mu held) --------------------------------------- */

static void invalidate(struct lb_capture *c, const char *fmt, ...) LB_PRINTF(2, 3);
static void invalidate(struct lb_capture *c, const char *fmt, ...) {
    if (c->invalidated) return; /* keep the first reason */
    c->invalidated = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->why, sizeof c->why, fmt, ap);
    va_end(ap);
}

static struct lb_capture *find_capture(uint64_t id) {
    for (struct lb_capture *c = g_captures; c != NULL; c = c->next)
        if (c->id == id) return c;
    return NULL;
}

static bool add_member(struct lb_capture *c, struct CUstream_st *s) {
    if (c->nmembers == c->cap_members) {
        size_t cap = c->cap_members ? 2 * c->cap_members : 4;
        struct CUstream_st **m = realloc(c->members, cap * sizeof *m);
        if (m == NULL) return false;
        c->members = m;
        c->cap_members = cap;
    }
    atomic_fetch_add(&s->refs, 1);
    c->members[c->nmembers++] = s;
    s->cap = c;
    s->cap_nodes = 0;
    s->cap_joined = s == c->origin ? 0 : UINT64_MAX; /* a fork starts unjoined */
    return true;
}

/* Unlink c and detach its streams; the caller frees it with capture_free (unlocked). */
static void capture_unlink(struct lb_capture *c) {
    for (struct lb_capture **link = &g_captures; *link != NULL; link = &(*link)->next)
        if (*link == c) {
            *link = c->next;
            break;
        }
    for (size_t i = 0; i < c->nmembers; i++) c->members[i]->cap = NULL;
    atomic_fetch_sub(&g_ncaptures, 1);
}

static void capture_free(struct lb_capture *c) {
    for (size_t i = 0; i < c->nmembers; i++) lb_stream_put(c->members[i]);
    free(c->members);
    lb_nodes_release(c->nodes, c->nnodes);
    free(c);
}

/* A capture under way on a blocking stream of device (the legacy stream's partner). */
static struct lb_capture *blocking_capture_on(int device) {
    for (struct lb_capture *c = g_captures; c != NULL; c = c->next)
        for (size_t i = 0; i < c->nmembers; i++)
            if (c->members[i]->device == device && lb_stream_is_blocking(c->members[i]))
                return c;
    return NULL;
}

static cudaError_t implicit_fail(struct lb_capture *c, const char *fn, int device) {
    invalidate(c, "%s: work on the legacy default stream of device %d while blocking stream "
                  "%p was capturing", fn, device, (void *)c->origin);
    return lb_fail(cudaErrorStreamCaptureImplicit, fn,
                   "the legacy default stream of device %d would depend on the capture under "
                   "way on blocking stream %p (use a cudaStreamNonBlocking stream, or keep "
                   "the legacy stream idle while capturing); the capture is invalidated",
                   device, (void *)c->origin);
}

static cudaError_t invalidated_fail(struct lb_capture *c, const char *fn) {
    return lb_fail(cudaErrorStreamCaptureInvalidated, fn,
                   "the capture begun on stream %p was invalidated earlier (%s)",
                   (void *)c->origin, c->why);
}

/* ---- hooks for the stream and memory code ------------------------------------- */

LB_HIDDEN cudaError_t lb_stream_push(struct CUstream_st *s, lb_task_fn run, lb_task_fn release,
                                     lb_clone_fn clone, void *arg, uint64_t *seq, int expect) {
    if (seq != NULL) *seq = 0;
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) > 0 || expect == 1) {
        cudaError_t err = cudaSuccess;
        enum lb_cap_action act = lb_capture_task(s, run, release, clone, arg, expect, &err);
        if (act != LB_CAP_PASS || err != cudaSuccess) return err;
    }
    return lb_stream_enqueue(s, run, release, arg, seq);
}

LB_HIDDEN bool lb_capture_active(struct CUstream_st *s) {
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) == 0) return false;
    pthread_mutex_lock(&g_cap_mu);
    bool capturing = s->cap != NULL;
    pthread_mutex_unlock(&g_cap_mu);
    return capturing;
}

LB_HIDDEN enum lb_cap_action lb_capture_task(struct CUstream_st *s, lb_task_fn run,
                                             lb_task_fn release, lb_clone_fn clone, void *arg,
                                             int expect, cudaError_t *err) {
    const char *fn = "stream capture";
    *err = cudaSuccess;
    pthread_mutex_lock(&g_cap_mu);
    struct lb_capture *c = s->cap;
    enum lb_cap_action act = LB_CAP_PASS;
    if (c != NULL && expect == 0) {
        *err = lb_fail(cudaErrorIllegalState, "pynccl_lb_stream_enqueue2",
                       "stream %p began capturing while the task was prepared to run "
                       "(a concurrent cudaStreamBeginCapture?)", (void *)s);
    } else if (c == NULL && expect == 1) {
        *err = lb_fail(cudaErrorIllegalState, "pynccl_lb_stream_enqueue2",
                       "stream %p is not capturing (a concurrent cudaStreamEndCapture?)",
                       (void *)s);
    } else if (c != NULL && c->invalidated) {
        *err = invalidated_fail(c, fn);
    } else if (c != NULL && clone == NULL) {
        invalidate(c, "a task that cannot be copied into a graph was enqueued on stream %p",
                   (void *)s);
        *err = lb_fail(cudaErrorStreamCaptureUnsupported, "pynccl_lb_stream_enqueue",
                       "stream %p is capturing and this task cannot be captured (no clone "
                       "callback: use pynccl_lb_stream_enqueue2); the capture is invalidated",
                       (void *)s);
    } else if (c != NULL) {
        if (c->nnodes == c->cap_nodes) {
            size_t cap = c->cap_nodes ? 2 * c->cap_nodes : 16;
            lb_node *nodes = realloc(c->nodes, cap * sizeof *nodes);
            if (nodes == NULL) {
                pthread_mutex_unlock(&g_cap_mu);
                *err = lb_fail(cudaErrorMemoryAllocation, fn, "out of host memory");
                return LB_CAP_PASS;
            }
            c->nodes = nodes;
            c->cap_nodes = cap;
        }
        c->nodes[c->nnodes++] = (lb_node){run, release, clone, arg};
        s->cap_nodes++;
        act = LB_CAP_DONE;
    } else if (s->kind == LB_STREAM_LEGACY && (c = blocking_capture_on(s->device)) != NULL) {
        *err = implicit_fail(c, fn, s->device);
    }
    pthread_mutex_unlock(&g_cap_mu);
    return act;
}

LB_HIDDEN cudaError_t lb_capture_unsafe(const char *fn) {
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) == 0) return cudaSuccess;
    enum cudaStreamCaptureMode tmode = lb_thread_capture_mode();
    if (tmode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
    pthread_t self = pthread_self();
    struct lb_capture *culprit = NULL;
    pthread_mutex_lock(&g_cap_mu);
    for (struct lb_capture *c = g_captures; c != NULL; c = c->next) {
        bool mine = pthread_equal(c->thread, self);
        if ((mine && c->mode != cudaStreamCaptureModeRelaxed) ||
            (!mine && tmode == cudaStreamCaptureModeGlobal &&
             c->mode == cudaStreamCaptureModeGlobal)) {
            invalidate(c, "%s was called during the capture (%s)", fn, mode_name(c->mode));
            if (culprit == NULL) culprit = c;
        }
    }
    cudaError_t err = cudaSuccess;
    if (culprit != NULL)
        err = lb_fail(cudaErrorStreamCaptureUnsupported, fn,
                      "not permitted while stream %p is being captured by %s in %s (a "
                      "capture-unsafe call from a thread in %s: see "
                      "cudaThreadExchangeStreamCaptureMode); the capture is invalidated",
                      (void *)culprit->origin,
                      pthread_equal(culprit->thread, self) ? "this thread" : "another thread",
                      mode_name(culprit->mode), mode_name(tmode));
    pthread_mutex_unlock(&g_cap_mu);
    return err;
}

LB_HIDDEN cudaError_t lb_capture_sync(struct CUstream_st *s, const char *fn) {
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) == 0) return cudaSuccess;
    cudaError_t err = cudaSuccess;
    pthread_mutex_lock(&g_cap_mu);
    struct lb_capture *c = s->cap;
    if (c != NULL) {
        invalidate(c, "%s of capturing stream %p", fn, (void *)s);
        err = lb_fail(cudaErrorStreamCaptureUnsupported, fn,
                      "stream %p is capturing: its work runs only when the graph is launched, "
                      "so it cannot be waited for or queried; the capture is invalidated",
                      (void *)s);
    } else if (s->kind == LB_STREAM_LEGACY && (c = blocking_capture_on(s->device)) != NULL) {
        err = implicit_fail(c, fn, s->device);
    }
    pthread_mutex_unlock(&g_cap_mu);
    return err;
}

LB_HIDDEN enum lb_cap_action lb_capture_record(struct CUevent_st *e, struct CUstream_st *s,
                                               cudaError_t *err) {
    *err = cudaSuccess;
    enum lb_cap_action act = LB_CAP_PASS;
    pthread_mutex_lock(&g_cap_mu);
    struct lb_capture *c = s->cap;
    if (c != NULL && c->invalidated) {
        *err = invalidated_fail(c, "cudaEventRecord");
    } else if (c != NULL) {
        /* No node: the event now stands for "s's work captured so far". */
        e->cap_id = c->id;
        e->cap_src = s;
        e->cap_count = s->cap_nodes;
        act = LB_CAP_DONE;
    } else {
        e->cap_id = 0; /* an ordinary record (if the push succeeds) */
    }
    pthread_mutex_unlock(&g_cap_mu);
    return act;
}

LB_HIDDEN enum lb_cap_action lb_capture_wait(struct CUstream_st *s, struct CUevent_st *e,
                                             unsigned flags, cudaError_t *err) {
    const char *fn = "cudaStreamWaitEvent";
    *err = cudaSuccess;
    enum lb_cap_action act = LB_CAP_PASS;
    pthread_mutex_lock(&g_cap_mu);
    struct lb_capture *ce = e->cap_id ? find_capture(e->cap_id) : NULL;
    struct lb_capture *c = s->cap;
    if (ce != NULL && c == ce) {
        /* In-capture dependency: capture order already satisfies it. A wait on a
         * member's latest work joins that member back. */
        for (size_t i = 0; i < c->nmembers; i++) {
            struct CUstream_st *m = c->members[i];
            if (m == e->cap_src && m != s && e->cap_count == m->cap_nodes) m->cap_joined = m->cap_nodes;
        }
        act = LB_CAP_DONE;
    } else if (ce != NULL && c != NULL) {
        invalidate(c, "%s: stream %p waited on an event of another capture", fn, (void *)s);
        *err = lb_fail(cudaErrorStreamCaptureMerge, fn,
                       "stream %p (capturing from %p) waited on an event recorded in the "
                       "capture begun on %p; the capture is invalidated",
                       (void *)s, (void *)c->origin, (void *)ce->origin);
    } else if (ce != NULL && ce->invalidated) {
        *err = invalidated_fail(ce, fn);
    } else if (ce != NULL && s->kind == LB_STREAM_LEGACY) {
        *err = implicit_fail(ce, fn, s->device);
    } else if (ce != NULL) {
        if (add_member(ce, s)) /* fork: s joins the capture */
            act = LB_CAP_DONE;
        else
            *err = lb_fail(cudaErrorMemoryAllocation, fn, "out of host memory");
    } else if (c != NULL && c->invalidated) {
        *err = invalidated_fail(c, fn);
    } else if (c != NULL && (flags & cudaEventWaitExternal)) {
        act = LB_CAP_NODE;
    } else if (c != NULL) {
        pthread_mutex_lock(&e->mu);
        bool recorded = e->gen > 0;
        pthread_mutex_unlock(&e->mu);
        if (recorded) {
            invalidate(c, "%s: stream %p waited on an event recorded outside the capture", fn,
                       (void *)s);
            *err = lb_fail(cudaErrorStreamCaptureIsolation, fn,
                           "capturing stream %p waited on event %p, last recorded outside the "
                           "capture (record it before cudaStreamBeginCapture is not enough: "
                           "use cudaEventWaitExternal); the capture is invalidated",
                           (void *)s, (void *)e);
        } else {
            act = LB_CAP_DONE; /* never recorded: nothing to wait for */
        }
    } else if (s->kind == LB_STREAM_LEGACY && (c = blocking_capture_on(s->device)) != NULL) {
        *err = implicit_fail(c, fn, s->device);
    }
    pthread_mutex_unlock(&g_cap_mu);
    return act;
}

LB_HIDDEN cudaError_t lb_capture_event_check(struct CUevent_st *e, const char *fn) {
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) == 0) return cudaSuccess;
    cudaError_t err = cudaSuccess;
    pthread_mutex_lock(&g_cap_mu);
    struct lb_capture *c = e->cap_id ? find_capture(e->cap_id) : NULL;
    if (c != NULL) {
        invalidate(c, "%s of event %p, recorded inside the capture", fn, (void *)e);
        err = lb_fail(cudaErrorCapturedEvent, fn,
                      "event %p was last recorded inside the capture under way on stream %p: "
                      "it completes only when the graph runs; the capture is invalidated",
                      (void *)e, (void *)c->origin);
    }
    pthread_mutex_unlock(&g_cap_mu);
    return err;
}

LB_HIDDEN void lb_capture_stream_gone(struct CUstream_st *s) {
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) == 0) return;
    struct lb_capture *dead = NULL;
    bool member = false;
    pthread_mutex_lock(&g_cap_mu);
    struct lb_capture *c = s->cap;
    if (c != NULL && c->origin == s) {
        capture_unlink(c); /* nothing can end it any more */
        dead = c;
    } else if (c != NULL) {
        invalidate(c, "stream %p was destroyed while forked into the capture", (void *)s);
        for (size_t i = 0; i < c->nmembers; i++)
            if (c->members[i] == s) {
                c->members[i] = c->members[--c->nmembers];
                member = true;
                break;
            }
        s->cap = NULL;
    }
    pthread_mutex_unlock(&g_cap_mu);
    if (member) lb_stream_put(s);
    if (dead != NULL) capture_free(dead);
}

/* ---- the capture API ----------------------------------------------------------- */

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if ((int)mode < (int)cudaStreamCaptureModeGlobal || (int)mode > (int)cudaStreamCaptureModeRelaxed)
        return lb_fail(cudaErrorInvalidValue, __func__, "mode=%d is not a cudaStreamCaptureMode",
                       (int)mode);
    if (stream == NULL || stream == cudaStreamLegacy)
        return lb_fail(cudaErrorStreamCaptureUnsupported, __func__,
                       "the legacy default stream cannot be captured (use a stream of your own)");
    struct CUstream_st *s;
    if ((err = lb_stream_get(stream, __func__, &s))) return err;
    struct lb_capture *c = calloc(1, sizeof *c);
    if (c == NULL) {
        lb_stream_put(s);
        return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    }
    c->mode = mode;
    c->thread = pthread_self();
    c->origin = s;
    pthread_mutex_lock(&g_cap_mu);
    if (s->cap != NULL) {
        struct lb_capture *other = s->cap;
        pthread_mutex_unlock(&g_cap_mu);
        free(c);
        lb_stream_put(s);
        return lb_fail(cudaErrorIllegalState, __func__,
                       "stream %p is already capturing (the capture begun on %p)", (void *)stream,
                       (void *)other->origin);
    }
    if (!add_member(c, s)) {
        pthread_mutex_unlock(&g_cap_mu);
        free(c);
        lb_stream_put(s);
        return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    }
    c->id = g_next_capture_id++;
    c->next = g_captures;
    g_captures = c;
    atomic_fetch_add(&g_ncaptures, 1);
    pthread_mutex_unlock(&g_cap_mu);
    lb_stream_put(s); /* the capture holds its own reference */
    return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (mode == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "mode is NULL");
    if ((int)*mode < (int)cudaStreamCaptureModeGlobal ||
        (int)*mode > (int)cudaStreamCaptureModeRelaxed)
        return lb_fail(cudaErrorInvalidValue, __func__,
                       "*mode=%d is not a cudaStreamCaptureMode", (int)*mode);
    enum cudaStreamCaptureMode old = lb_thread_capture_mode();
    lb_set_thread_capture_mode(*mode);
    *mode = old;
    return cudaSuccess;
}

/* cudaStreamEndCapture's checks: on success the capture begun on s is over and its
 * nodes (in capture order) are the caller's. */
LB_HIDDEN cudaError_t lb_capture_end(struct CUstream_st *s, const char *fn, lb_node **nodes,
                                     size_t *n) {
    cudaError_t err = cudaSuccess;
    struct lb_capture *c, *ended = NULL;
    *nodes = NULL;
    *n = 0;
    pthread_mutex_lock(&g_cap_mu);
    c = s->cap;
    if (c == NULL) {
        err = lb_fail(cudaErrorIllegalState, fn, "stream %p is not capturing", (void *)s);
    } else if (c->origin != s) {
        invalidate(c, "%s on stream %p, forked into the capture", fn, (void *)s);
        err = lb_fail(cudaErrorStreamCaptureUnmatched, fn,
                      "the capture was begun on stream %p, not %p; the capture is invalidated",
                      (void *)c->origin, (void *)s);
    } else if (c->mode != cudaStreamCaptureModeRelaxed &&
               !pthread_equal(c->thread, pthread_self())) {
        err = lb_fail(cudaErrorStreamCaptureWrongThread, fn,
                      "the capture on stream %p was begun by another thread in %s: end it there "
                      "(or begin it in cudaStreamCaptureModeRelaxed)",
                      (void *)s, mode_name(c->mode));
    } else {
        capture_unlink(c);
        ended = c;
        if (c->invalidated) {
            err = lb_fail(cudaErrorStreamCaptureInvalidated, fn,
                          "the capture on stream %p was invalidated (%s); no graph", (void *)s,
                          c->why);
        } else {
            for (size_t i = 1; i < c->nmembers && !err; i++)
                if (c->members[i]->cap_joined != c->members[i]->cap_nodes)
                    err = lb_fail(cudaErrorStreamCaptureUnjoined, fn,
                                  "stream %p was forked into the capture by an event wait but "
                                  "its work was not joined back (record an event on it and make "
                                  "stream %p wait on it); no graph",
                                  (void *)c->members[i], (void *)s);
        }
        if (!err) {
            *nodes = c->nodes;
            *n = c->nnodes;
            c->nodes = NULL;
            c->nnodes = 0;
        }
    }
    pthread_mutex_unlock(&g_cap_mu);
    if (ended != NULL) capture_free(ended);
    return err;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream,
                                  enum cudaStreamCaptureStatus *pCaptureStatus) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (pCaptureStatus == NULL)
        return lb_fail(cudaErrorInvalidValue, __func__, "pCaptureStatus is NULL");
    struct CUstream_st *s;
    if ((err = lb_stream_get(stream, __func__, &s))) return err;
    enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) > 0) {
        pthread_mutex_lock(&g_cap_mu);
        struct lb_capture *c = s->cap;
        if (c != NULL)
            status = c->invalidated ? cudaStreamCaptureStatusInvalidated
                                    : cudaStreamCaptureStatusActive;
        else if (s->kind == LB_STREAM_LEGACY && (c = blocking_capture_on(s->device)) != NULL)
            /* as CUDA: an error, and the capture is not invalidated */
            err = lb_fail(cudaErrorStreamCaptureImplicit, __func__,
                          "the legacy default stream of device %d is implicitly synchronized "
                          "with blocking stream %p, which is capturing",
                          s->device, (void *)c->origin);
        pthread_mutex_unlock(&g_cap_mu);
    }
    lb_stream_put(s);
    if (!err) *pCaptureStatus = status;
    return err;
}

int pynccl_lb_stream_capturing(void *stream) {
    if (atomic_load(&g_fork_poisoned)) return -1;
    struct CUstream_st *s;
    if (lb_stream_get(stream, "pynccl_lb_stream_capturing", &s)) return -1;
    int capturing = 0;
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) > 0) {
        pthread_mutex_lock(&g_cap_mu);
        capturing = s->cap != NULL;
        pthread_mutex_unlock(&g_cap_mu);
    }
    lb_stream_put(s);
    return capturing;
}

/* ---- fork ------------------------------------------------------------------------ */

LB_HIDDEN void lb_capture_fork_prepare(void) { pthread_mutex_lock(&g_cap_mu); }

LB_HIDDEN void lb_capture_fork_parent(void) { pthread_mutex_unlock(&g_cap_mu); }

LB_HIDDEN void lb_capture_fork_child(void) { pthread_mutex_init(&g_cap_mu, NULL); }
