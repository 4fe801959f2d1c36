/*
 * Private to the loopback libcudart (cudart*.c): shared state and helpers.
 *
 * Locking rules (no global lock is ever held while a task runs):
 *   - g_streams (rwlock): the set of live streams; taken before any stream mutex.
 *   - a stream's mu: its queue and counters; never held together with another
 *     stream's mu or an event's mu.
 *   - an event's mu: its generation counters.
 *   - g_allocs (rwlock, cudart_mem.c): the allocation registry, a leaf lock.
 */
#ifndef PYNCCL_LB_CUDART_INTERNAL_H
#define PYNCCL_LB_CUDART_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "lb_cuda.h"
#include "lb_internal.h"

#define LB_HIDDEN __attribute__((visibility("hidden")))
#define LB_PRINTF(f, a) __attribute__((format(printf, f, a)))

typedef struct lb_task {
    struct lb_task *next;
    lb_task_fn run;
    lb_task_fn release;
    void *arg;
    uint64_t ticket; /* global push order, for deferred frees */
} lb_task;

enum lb_stream_kind { LB_STREAM_USER, LB_STREAM_LEGACY, LB_STREAM_PER_THREAD };

struct CUstream_st {
    pthread_mutex_t mu;
    pthread_cond_t cv_work; /* the worker waits here for tasks */
    pthread_cond_t cv_done; /* synchronizers wait here for progress */
    lb_task *head, *tail;
    uint64_t enq_seq;  /* tasks pushed so far */
    uint64_t done_seq; /* tasks finished (run or discarded) so far */
    uint64_t running_ticket;
    bool running;
    /* Implicit synchronization with the legacy default stream (blocking streams only):
     * synced_legacy (guarded by mu): the legacy seq this stream already waits for;
     * synced_by_legacy (guarded by the legacy stream's mu): this stream's seq the
     * legacy stream already waits for. */
    uint64_t synced_legacy;
    uint64_t synced_by_legacy;
    int device;
    unsigned flags;
    enum lb_stream_kind kind;
    bool worker_started, worker_exited, stopping, worker_claimed;
    pthread_t worker;
    atomic_int refs;
};

struct CUevent_st {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t gen;      /* records so far */
    uint64_t done_gen; /* newest record whose task has run */
    double time_ms;    /* monotonic clock when done_gen's task ran */
    unsigned flags;
    int device;
    atomic_int refs;
};

/* cudart.c */
LB_HIDDEN extern int g_ndev;
LB_HIDDEN extern int g_strict;
LB_HIDDEN extern int g_debug;
LB_HIDDEN extern atomic_int g_shutdown;
LB_HIDDEN extern atomic_int g_fork_poisoned;
LB_HIDDEN cudaError_t lb_fail(cudaError_t err, const char *fn, const char *fmt, ...)
    LB_PRINTF(3, 4);
LB_HIDDEN cudaError_t lb_check_usable(const char *fn);
LB_HIDDEN int lb_current_device(void);
LB_HIDDEN void lb_set_thread_device(int device);
LB_HIDDEN double lb_now_ms(void);

/* cudart_stream.c */
LB_HIDDEN extern atomic_uint_fast64_t g_ticket;
LB_HIDDEN extern atomic_long g_pending; /* tasks pushed and not yet finished */
LB_HIDDEN extern atomic_int g_live_workers;
LB_HIDDEN cudaError_t lb_stream_get(cudaStream_t handle, const char *fn,
                                    struct CUstream_st **out);
LB_HIDDEN void lb_stream_put(struct CUstream_st *s);
LB_HIDDEN cudaError_t lb_stream_push(struct CUstream_st *s, lb_task_fn run, lb_task_fn release,
                                     void *arg, uint64_t *seq);
LB_HIDDEN void lb_stream_wait_seq(struct CUstream_st *s, uint64_t seq);
LB_HIDDEN uint64_t lb_min_pending_ticket(void);
LB_HIDDEN void lb_streams_fork_prepare(void);
LB_HIDDEN void lb_streams_fork_parent(void);
LB_HIDDEN void lb_streams_fork_child(void);
LB_HIDDEN void lb_streams_init(void);
LB_HIDDEN void lb_streams_fini(void);

/* cudart_mem.c */
LB_HIDDEN void lb_mem_reap(void);
LB_HIDDEN void lb_mem_fork_prepare(void);
LB_HIDDEN void lb_mem_fork_parent(void);
LB_HIDDEN void lb_mem_fork_child(void);

#endif
