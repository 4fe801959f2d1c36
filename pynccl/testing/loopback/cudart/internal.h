/*
 * Private to the loopback libcudart (the files of cudart/): shared state and helpers.
 *
 * Locking rules (no global lock is ever held while a task runs):
 *   - g_streams (rwlock): the set of live streams; taken before any stream mutex.
 *   - a stream's mu: its queue and counters; never held together with another
 *     stream's mu or an event's mu.
 *   - an event's mu: its generation counters.
 *   - g_allocs (rwlock, mem.c): the allocation registry, a leaf lock.
 *   - g_cap_mu (capture.c): every capture's state, and the capture fields of
 *     streams and events; a leaf lock (no callback runs under it).
 *   - g_graph_mu (graph.c): the live graph / executable graph sets, a leaf lock.
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

/* A node of a graph being captured, a graph or an executable graph: a template task
 * (see lb_internal.h for clone's contract). */
typedef struct {
    lb_task_fn run;
    lb_task_fn release;
    lb_clone_fn clone;
    void *arg;
} lb_node;

struct lb_capture;

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
    /* Stream capture (g_cap_mu): the capture this stream belongs to (as its origin or
     * forked into it by an event wait), the nodes it added, and how many of them a
     * wait of another member stream covered (the fork is joined when equal). */
    struct lb_capture *cap;
    uint64_t cap_nodes, cap_joined;
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
    /* (g_cap_mu) last recorded inside capture cap_id (0: not), on cap_src after its
     * cap_count-th node; compared only, never dereferenced. */
    uint64_t cap_id;
    const struct CUstream_st *cap_src;
    uint64_t cap_count;
};

/* A sorted set of pointers (live handles), binary-searched (core.c). */
typedef struct {
    void **items;
    size_t n, cap;
} lb_ptrset;

/* A stream and how far its queue reached (enq_seq) when the snapshot was taken. */
typedef struct {
    struct CUstream_st *stream; /* referenced */
    uint64_t seq;
} lb_snap;

/* What lb_sync_targets snapshots: the stream (and, for the legacy stream, the device's
 * blocking streams), every stream of a device, or the legacy stream's implicit waits
 * (the device's other blocking streams). */
enum lb_sync_scope { LB_SYNC_SELF, LB_SYNC_DEVICE, LB_SYNC_PEERS };

#define LB_MAX_DEVICES 1024

/* Each file below calls only the files declared above it (tests/loopback/test_loopback_build.py
 * checks that the call graph is a DAG). */

/* core.c: configuration, errors, the calling thread, the clock, pointer sets. */
LB_HIDDEN extern int g_ndev;   /* visible devices */
LB_HIDDEN extern int g_nphys;  /* PYNCCL_LOOPBACK_DEVICES */
LB_HIDDEN extern int g_phys[LB_MAX_DEVICES]; /* visible ordinal -> physical device */
LB_HIDDEN extern bool g_visible_set;         /* CUDA_VISIBLE_DEVICES is set */
LB_HIDDEN extern int g_strict;
LB_HIDDEN extern int g_debug;
LB_HIDDEN extern atomic_int g_shutdown;
LB_HIDDEN extern atomic_int g_fork_poisoned;
LB_HIDDEN void lb_config_load(void);
LB_HIDDEN const char *lb_devices_origin(void);
LB_HIDDEN cudaError_t lb_fail(cudaError_t err, const char *fn, const char *fmt, ...)
    LB_PRINTF(3, 4);
/* Every API call starts here: a malformed environment, a poisoned fork, unloading. */
LB_HIDDEN cudaError_t lb_check_usable(const char *fn);
LB_HIDDEN cudaError_t lb_no_device(const char *fn);
LB_HIDDEN cudaError_t lb_bad_device(const char *fn, int device);
LB_HIDDEN int lb_current_device(void);
LB_HIDDEN void lb_set_thread_device(int device);
/* The calling thread's stream capture interaction mode (default: global). */
LB_HIDDEN enum cudaStreamCaptureMode lb_thread_capture_mode(void);
LB_HIDDEN void lb_set_thread_capture_mode(enum cudaStreamCaptureMode mode);
/* Set while the thread runs a host function: every API call then fails (800). */
LB_HIDDEN void lb_set_in_host_fn(bool in);
LB_HIDDEN double lb_now_ms(void);
LB_HIDDEN bool ptrset_has(const lb_ptrset *set, const void *p);
LB_HIDDEN bool ptrset_add(lb_ptrset *set, void *p);
LB_HIDDEN bool ptrset_del(lb_ptrset *set, const void *p);

/* stream.c: stream objects, queues and workers (capture-blind). */
LB_HIDDEN extern atomic_uint_fast64_t g_ticket;
LB_HIDDEN extern atomic_long g_pending; /* tasks pushed and not yet finished */
LB_HIDDEN extern atomic_int g_live_workers;
LB_HIDDEN bool lb_is_default_handle(cudaStream_t h);
LB_HIDDEN struct CUstream_st *lb_stream_new(int device, unsigned flags, enum lb_stream_kind kind);
LB_HIDDEN void lb_stream_ref(struct CUstream_st *s);
LB_HIDDEN cudaError_t lb_stream_get(cudaStream_t handle, const char *fn,
                                    struct CUstream_st **out);
LB_HIDDEN void lb_stream_put(struct CUstream_st *s);
LB_HIDDEN bool lb_stream_unlink(struct CUstream_st *s);
/* Stop s's worker: join it if it drains within timeout_ms, else detach it. */
LB_HIDDEN void lb_stream_retire(struct CUstream_st *s, long timeout_ms, const char *why);
/* Queue a task on s to run (no capture check: see lb_stream_push); *seq: its number. */
LB_HIDDEN cudaError_t lb_stream_enqueue(struct CUstream_st *s, lb_task_fn run,
                                        lb_task_fn release, void *arg, uint64_t *seq);
LB_HIDDEN cudaError_t lb_push_fail(cudaError_t err, const char *fn, const void *stream);
LB_HIDDEN bool lb_stream_is_blocking(const struct CUstream_st *s);
LB_HIDDEN void lb_stream_wait_seq(struct CUstream_st *s, uint64_t seq);
/* Snapshot what a synchronize must wait for: s (and, s legacy, its device's blocking
 * streams), or every stream of device; -1 when out of memory. */
LB_HIDDEN long lb_sync_targets(struct CUstream_st *s, int device, enum lb_sync_scope scope,
                               lb_snap **out);
LB_HIDDEN void lb_wait_snaps(lb_snap *snaps, long n); /* waits, puts and frees */
LB_HIDDEN uint64_t lb_min_pending_ticket(void);
LB_HIDDEN void lb_streams_init(void (*per_thread_exit)(void *));
LB_HIDDEN void lb_streams_fini(void);
LB_HIDDEN void lb_streams_fork_prepare(void);
LB_HIDDEN void lb_streams_fork_parent(void);
LB_HIDDEN void lb_streams_fork_child(void);

/* capture.c: stream capture. Every hook is a no-op costing one atomic load while no
 * capture is under way (g_ncaptures == 0). */
LB_HIDDEN extern atomic_int g_ncaptures;
enum lb_cap_action { LB_CAP_PASS, LB_CAP_DONE, LB_CAP_NODE };
/* Enqueue a task on s, or - s capturing - record it as a node (clone NULL: refused).
 * expect: -1 either, 0 / 1 only if s is not / is capturing (else cudaErrorIllegalState).
 * Capture errors already carry their detail (lb_push_fail keeps it). */
LB_HIDDEN cudaError_t lb_stream_push(struct CUstream_st *s, lb_task_fn run, lb_task_fn release,
                                     lb_clone_fn clone, void *arg, uint64_t *seq, int expect);
/* Records the task (LB_CAP_DONE, arg taken), refuses it (*err set, arg not taken), or
 * lets it through (LB_CAP_PASS). */
LB_HIDDEN enum lb_cap_action lb_capture_task(struct CUstream_st *s, lb_task_fn run,
                                             lb_task_fn release, lb_clone_fn clone, void *arg,
                                             int expect, cudaError_t *err);
LB_HIDDEN bool lb_capture_active(struct CUstream_st *s);
/* A "potentially unsafe" call (cudaMalloc, cudaFree, synchronous copies and memsets,
 * stream / event / device synchronizes and queries): refused with
 * cudaErrorStreamCaptureUnsupported where the captures' modes and the calling thread's
 * interaction mode forbid it, invalidating the captures that forbid it. */
LB_HIDDEN cudaError_t lb_capture_unsafe(const char *fn);
/* cudaStreamSynchronize / cudaStreamQuery of s. */
LB_HIDDEN cudaError_t lb_capture_sync(struct CUstream_st *s, const char *fn);
/* cudaEventRecord(e, s): LB_CAP_DONE if recorded into s's capture, else PASS or *err. */
LB_HIDDEN enum lb_cap_action lb_capture_record(struct CUevent_st *e, struct CUstream_st *s,
                                               cudaError_t *err);
/* cudaStreamWaitEvent(s, e): DONE (dependency handled by the capture), NODE (record
 * an external wait node), PASS (ordinary wait) or *err. */
LB_HIDDEN enum lb_cap_action lb_capture_wait(struct CUstream_st *s, struct CUevent_st *e,
                                             unsigned flags, cudaError_t *err);
/* cudaEventQuery / Synchronize / ElapsedTime: cudaErrorCapturedEvent if e was last
 * recorded inside a capture still under way. */
LB_HIDDEN cudaError_t lb_capture_event_check(struct CUevent_st *e, const char *fn);
/* s is being destroyed: it leaves its capture (ending it if s is the origin). */
LB_HIDDEN void lb_capture_stream_gone(struct CUstream_st *s);
/* cudaStreamEndCapture's checks; on success *nodes[0..*n) are the caller's. */
LB_HIDDEN cudaError_t lb_capture_end(struct CUstream_st *s, const char *fn, lb_node **nodes,
                                     size_t *n);
LB_HIDDEN void lb_nodes_release(lb_node *nodes, size_t n);
LB_HIDDEN void lb_capture_fork_prepare(void);
LB_HIDDEN void lb_capture_fork_parent(void);
LB_HIDDEN void lb_capture_fork_child(void);

/* graph.c: graphs and executable graphs (the public API only, and fork hooks). */
LB_HIDDEN void lb_graph_fork_prepare(void);
LB_HIDDEN void lb_graph_fork_parent(void);
LB_HIDDEN void lb_graph_fork_child(void);

/* event.c: events (the public API only, and fork hooks). */
LB_HIDDEN void lb_events_fork_prepare(void);
LB_HIDDEN void lb_events_fork_parent(void);
LB_HIDDEN void lb_events_fork_child(void);

/* mem.c: allocations, copies and memsets. */
LB_HIDDEN void lb_mem_reap(void);
LB_HIDDEN void lb_mem_fork_prepare(void);
LB_HIDDEN void lb_mem_fork_parent(void);
LB_HIDDEN void lb_mem_fork_child(void);

/* api.c: devices, the stream API, libnccl's enqueue hooks. */
LB_HIDDEN void lb_per_thread_streams_exit(void *value);

/* init.c: load, unload, fork (calls everything above). */

#endif
