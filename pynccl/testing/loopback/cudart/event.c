/*
 * pynccl loopback libcudart: events. An event is a (generation, completed
 * generation, timestamp) triple: cudaEventRecord enqueues a task that completes the
 * generation it took; cudaStreamWaitEvent enqueues a task that waits for it. Inside a
 * stream capture, records and waits become capture dependencies (capture.c).
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "internal.h"

static pthread_rwlock_t g_events_lock = PTHREAD_RWLOCK_INITIALIZER;
static lb_ptrset g_events;

static void event_put(struct CUevent_st *e) {
    if (atomic_fetch_sub(&e->refs, 1) != 1) return;
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

static cudaError_t event_get(cudaEvent_t h, const char *fn, struct CUevent_st **out) {
    pthread_rwlock_rdlock(&g_events_lock);
    bool live = h != NULL && ptrset_has(&g_events, h);
    if (live) atomic_fetch_add(&h->refs, 1);
    pthread_rwlock_unlock(&g_events_lock);
    if (!live)
        return lb_fail(cudaErrorInvalidResourceHandle, fn, "event %p is not a live event",
                       (void *)h);
    *out = h;
    return cudaSuccess;
}

/* event_get for a host-side wait or query: refused (and released) while a capture
 * forbids that: always for an event recorded inside a capture under way
 * (lb_capture_event_check), and as a "potentially unsafe" call where the capture modes
 * say so (CUDA refuses cudaEventQuery from another thread during a global capture:
 * PyTorch's watchdog hit it). */
static cudaError_t event_get_host(cudaEvent_t h, const char *fn, struct CUevent_st **out) {
    cudaError_t err = event_get(h, fn, out);
    if (err) return err;
    if ((err = lb_capture_event_check(*out, fn)) || (err = lb_capture_unsafe(fn)))
        event_put(*out);
    return err;
}

typedef struct {
    struct CUevent_st *event;
    uint64_t gen;
} lb_event_task;

static void record_run(void *arg) {
    lb_event_task *r = arg;
    struct CUevent_st *e = r->event;
    double now = lb_now_ms();
    pthread_mutex_lock(&e->mu);
    if (r->gen > e->done_gen) {
        e->done_gen = r->gen;
        e->time_ms = now;
    }
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static void event_wait_run(void *arg) {
    lb_event_task *w = arg;
    struct CUevent_st *e = w->event;
    pthread_mutex_lock(&e->mu);
    while (e->done_gen < w->gen) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

static void event_task_release(void *arg) {
    lb_event_task *r = arg;
    event_put(r->event);
    free(r);
}

/* An external event wait captured into a graph (cudaEventWaitExternal): each launch
 * waits for the event's most recent record as of that launch. */
static void *event_wait_clone(void *arg, int launch) {
    const lb_event_task *w = arg;
    lb_event_task *copy = malloc(sizeof *copy);
    if (copy == NULL) return NULL;
    atomic_fetch_add(&w->event->refs, 1);
    copy->event = w->event;
    copy->gen = 0;
    if (launch) {
        pthread_mutex_lock(&w->event->mu);
        copy->gen = w->event->gen;
        pthread_mutex_unlock(&w->event->mu);
    }
    return copy;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (event == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "event is NULL");
    const unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
    if ((flags & ~known) ||
        ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming)))
        return lb_fail(cudaErrorInvalidValue, __func__,
                       "flags=%#x (cudaEventInterprocess needs cudaEventDisableTiming)", flags);
    if (g_ndev == 0) return lb_no_device(__func__);
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (e == NULL) return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->flags = flags;
    e->device = lb_current_device();
    atomic_init(&e->refs, 1);
    pthread_rwlock_wrlock(&g_events_lock);
    bool ok = ptrset_add(&g_events, e);
    pthread_rwlock_unlock(&g_events_lock);
    if (!ok) {
        event_put(e);
        return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    }
    *event = e;
    return cudaSuccess;
}

long pynccl_lb_live_events(void) {
    pthread_rwlock_rdlock(&g_events_lock);
    long n = (long)g_events.n;
    pthread_rwlock_unlock(&g_events_lock);
    return n;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) {
    return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    pthread_rwlock_wrlock(&g_events_lock);
    bool live = event != NULL && ptrset_del(&g_events, event);
    pthread_rwlock_unlock(&g_events_lock);
    if (!live)
        return lb_fail(cudaErrorInvalidResourceHandle, __func__, "event %p is not a live event",
                       (void *)event);
    event_put(event); /* queued record/wait tasks hold their own references */
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    struct CUevent_st *e;
    struct CUstream_st *s;
    if ((err = event_get(event, __func__, &e))) return err;
    if ((err = lb_stream_get(stream, __func__, &s))) {
        event_put(e);
        return err;
    }
    if (e->device != s->device) {
        int edev = e->device, sdev = s->device;
        event_put(e);
        lb_stream_put(s);
        return lb_fail(cudaErrorInvalidResourceHandle, __func__,
                       "event of device %d recorded on a stream of device %d", edev, sdev);
    }
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) > 0) {
        enum lb_cap_action act = lb_capture_record(e, s, &err);
        if (act == LB_CAP_DONE || err) {
            event_put(e);
            lb_stream_put(s);
            return err;
        }
    }
    lb_event_task *r = malloc(sizeof *r);
    if (r == NULL) {
        event_put(e);
        lb_stream_put(s);
        return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    }
    pthread_mutex_lock(&e->mu);
    uint64_t gen = ++e->gen;
    pthread_mutex_unlock(&e->mu);
    r->event = e; /* the task owns the reference taken by event_get */
    r->gen = gen;
    err = lb_stream_push(s, record_run, event_task_release, NULL, r, NULL, -1);
    lb_stream_put(s);
    if (err) {
        pthread_mutex_lock(&e->mu);
        if (e->gen == gen) e->gen--; /* the record never happened */
        pthread_mutex_unlock(&e->mu);
        event_task_release(r);
        return lb_push_fail(err, __func__, (void *)stream);
    }
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (flags & ~(unsigned)cudaEventWaitExternal)
        return lb_fail(cudaErrorInvalidValue, __func__, "flags=%#x", flags);
    struct CUevent_st *e;
    struct CUstream_st *s;
    if ((err = event_get(event, __func__, &e))) return err;
    if ((err = lb_stream_get(stream, __func__, &s))) {
        event_put(e);
        return err;
    }
    enum lb_cap_action act = LB_CAP_PASS;
    if (atomic_load_explicit(&g_ncaptures, memory_order_relaxed) > 0) {
        act = lb_capture_wait(s, e, flags, &err);
        if (act == LB_CAP_DONE || err) {
            event_put(e);
            lb_stream_put(s);
            return err;
        }
    }
    pthread_mutex_lock(&e->mu);
    uint64_t gen = e->gen;
    bool done = act == LB_CAP_PASS && e->done_gen >= gen; /* also true if never recorded */
    pthread_mutex_unlock(&e->mu);
    lb_event_task *w = done ? NULL : malloc(sizeof *w);
    if (done) {
        event_put(e);
    } else if (w == NULL) {
        event_put(e);
        err = cudaErrorMemoryAllocation;
    } else {
        w->event = e;
        w->gen = gen; /* an external wait node takes the generation at each launch */
        err = lb_stream_push(s, event_wait_run, event_task_release,
                             act == LB_CAP_NODE ? event_wait_clone : NULL, w, NULL, -1);
        if (err) event_task_release(w);
    }
    lb_stream_put(s);
    return err ? lb_push_fail(err, __func__, (void *)stream) : cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    struct CUevent_st *e;
    if ((err = event_get_host(event, __func__, &e))) return err;
    pthread_mutex_lock(&e->mu);
    bool done = e->done_gen >= e->gen;
    pthread_mutex_unlock(&e->mu);
    event_put(e);
    return done ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    struct CUevent_st *e;
    if ((err = event_get_host(event, __func__, &e))) return err;
    pthread_mutex_lock(&e->mu);
    uint64_t gen = e->gen;
    while (e->done_gen < gen) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    event_put(e);
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (ms == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "ms is NULL");
    struct CUevent_st *ev[2];
    if ((err = event_get(start, __func__, &ev[0]))) return err;
    if ((err = event_get(end, __func__, &ev[1]))) {
        event_put(ev[0]);
        return err;
    }
    for (int i = 0; i < 2; i++)
        if ((err = lb_capture_event_check(ev[i], __func__))) {
            event_put(ev[0]);
            event_put(ev[1]);
            return err;
        }
    double t[2] = {0, 0};
    bool recorded = true, done = true, timing = true;
    for (int i = 0; i < 2; i++) {
        pthread_mutex_lock(&ev[i]->mu);
        recorded = recorded && ev[i]->gen > 0;
        done = done && ev[i]->done_gen >= ev[i]->gen;
        timing = timing && !(ev[i]->flags & cudaEventDisableTiming);
        t[i] = ev[i]->time_ms;
        pthread_mutex_unlock(&ev[i]->mu);
        event_put(ev[i]);
    }
    if (!timing)
        return lb_fail(cudaErrorInvalidResourceHandle, __func__,
                       "an event was created with cudaEventDisableTiming");
    if (!recorded)
        return lb_fail(cudaErrorInvalidResourceHandle, __func__, "an event was never recorded");
    if (!done) return cudaErrorNotReady;
    *ms = (float)(t[1] - t[0]);
    return cudaSuccess;
}

/* ---- fork ------------------------------------------------------------------ */

LB_HIDDEN void lb_events_fork_prepare(void) { pthread_rwlock_wrlock(&g_events_lock); }

LB_HIDDEN void lb_events_fork_parent(void) { pthread_rwlock_unlock(&g_events_lock); }

LB_HIDDEN void lb_events_fork_child(void) { pthread_rwlock_init(&g_events_lock, NULL); }
