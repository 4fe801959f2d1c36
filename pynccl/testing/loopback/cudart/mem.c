/*
 * pynccl loopback libcudart: "device" memory (aligned host memory in a registry),
 * copies, memsets and pointer attributes.
 *
 * The registry is a sorted array of allocations under a rwlock: lookups (several
 * per collective) are a binary search under the read lock.
 *
 * cudaFree synchronizes the allocation's device first, as CUDA's does: work queued
 * on that device's streams before the call (a collective still pending on the
 * memory) completes before the memory goes. After that the allocation leaves the
 * registry (later lookups fail, as on a GPU), but the memory is released only when
 * every task pushed before the free has finished: work of another device that still
 * touches it (a peer's collective), or ncclMemFree (pynccl_lb_free, which does not
 * synchronize), never sees it freed.
 *
 * Host synchronization as CUDA documents it ("API synchronization behavior"): the
 * synchronous cudaMemset and a device-to-device cudaMemcpy only enqueue on the legacy
 * default stream and return; a host-to-device cudaMemcpy (all host memory here is
 * pageable) waits for the work queued on the legacy stream, stages the source (the
 * caller may reuse it at once) and returns before the copy lands; device-to-host and host-to-host copies
 * return once done. The Async variants are ordered on their stream and read their
 * source when they run.
 *
 * Peer mappings (pynccl_lb_register_foreign_range, lb_internal.h) sit in the registry
 * beside the allocations: device memory to every check, but never freed here.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define LB_ALIGNMENT 256

typedef struct {
    uintptr_t base;
    size_t size;
    int device;
    bool foreign; /* a registered peer mapping, not an allocation */
} lb_alloc;

static pthread_rwlock_t g_allocs_lock = PTHREAD_RWLOCK_INITIALIZER;
static lb_alloc *g_allocs;
static size_t g_nallocs, g_cap;

typedef struct lb_grave {
    struct lb_grave *next;
    void *base;
    uint64_t ticket; /* tasks with a smaller ticket may still use the memory */
} lb_grave;

static pthread_mutex_t g_graves_mu = PTHREAD_MUTEX_INITIALIZER;
static lb_grave *g_graves;
static atomic_long g_ngraves;

/* Index of the first allocation whose base is > p. */
static size_t alloc_upper(uintptr_t p) {
    size_t lo = 0, hi = g_nallocs;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g_allocs[mid].base <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The allocation containing [p, p + nbytes) (nbytes 0: p may be one past the end). */
static const lb_alloc *alloc_find_locked(uintptr_t p, size_t nbytes) {
    size_t i = alloc_upper(p);
    if (i == 0) return NULL;
    const lb_alloc *a = &g_allocs[i - 1];
    size_t off = p - a->base;
    if (off > a->size || nbytes > a->size - off) return NULL;
    return a;
}

int pynccl_lb_find_alloc(const void *ptr, size_t nbytes, int *device) {
    pthread_rwlock_rdlock(&g_allocs_lock);
    const lb_alloc *a = alloc_find_locked((uintptr_t)ptr, nbytes);
    int dev = a != NULL ? a->device : -1;
    pthread_rwlock_unlock(&g_allocs_lock);
    if (a == NULL) return 0;
    if (device != NULL) *device = dev;
    return 1;
}

/* Release graves whose memory no pending task can touch any more. */
LB_HIDDEN void lb_mem_reap(void) {
    if (atomic_load(&g_ngraves) == 0) return;
    uint64_t min = lb_min_pending_ticket();
    lb_grave *dead = NULL;
    pthread_mutex_lock(&g_graves_mu);
    for (lb_grave **link = &g_graves; *link != NULL;) {
        lb_grave *g = *link;
        if (g->ticket <= min) {
            *link = g->next;
            g->next = dead;
            dead = g;
            atomic_fetch_sub(&g_ngraves, 1);
        } else {
            link = &g->next;
        }
    }
    pthread_mutex_unlock(&g_graves_mu);
    while (dead != NULL) {
        lb_grave *next = dead->next;
        free(dead->base);
        free(dead);
        dead = next;
    }
}

/* Insert a into the sorted registry (write lock held); false when out of memory. */
static bool alloc_insert_locked(lb_alloc a) {
    if (g_nallocs == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 64;
        lb_alloc *grown = realloc(g_allocs, cap * sizeof *grown);
        if (grown == NULL) return false;
        g_allocs = grown;
        g_cap = cap;
    }
    size_t i = alloc_upper(a.base);
    memmove(g_allocs + i + 1, g_allocs + i, (g_nallocs - i) * sizeof *g_allocs);
    g_allocs[i] = a;
    g_nallocs++;
    return true;
}

static cudaError_t lb_malloc(const char *fn, void **ptr, size_t size, int device) {
    cudaError_t err = lb_check_usable(fn);
    if (err) return err;
    if ((err = lb_capture_unsafe(fn))) return err;
    if (ptr == NULL) return lb_fail(cudaErrorInvalidValue, fn, "devPtr is NULL");
    if (g_ndev == 0) return lb_no_device(fn);
    if (device < 0 || device >= g_ndev) return lb_bad_device(fn, device);
    if (size == 0) { /* as CUDA: success, and a NULL pointer */
        *ptr = NULL;
        return cudaSuccess;
    }
    lb_mem_reap();
    void *p = NULL;
    if (posix_memalign(&p, LB_ALIGNMENT, size) != 0)
        return lb_fail(cudaErrorMemoryAllocation, fn, "cannot allocate %zu bytes", size);
    pthread_rwlock_wrlock(&g_allocs_lock);
    bool ok = alloc_insert_locked((lb_alloc){(uintptr_t)p, size, device, false});
    pthread_rwlock_unlock(&g_allocs_lock);
    if (!ok) {
        free(p);
        return lb_fail(cudaErrorMemoryAllocation, fn, "out of host memory for the registry");
    }
    *ptr = p;
    return cudaSuccess;
}

/* Wait for the work queued so far on the streams of ptr's device (if ptr is the start
 * of a live allocation: the caller reports the other cases). */
static void sync_alloc_device(const void *ptr) {
    pthread_rwlock_rdlock(&g_allocs_lock);
    size_t i = alloc_upper((uintptr_t)ptr);
    int device = i > 0 && g_allocs[i - 1].base == (uintptr_t)ptr && !g_allocs[i - 1].foreign
                     ? g_allocs[i - 1].device
                     : -1;
    pthread_rwlock_unlock(&g_allocs_lock);
    if (device < 0) return;
    lb_snap *snaps;
    long n = lb_sync_targets(NULL, device, LB_SYNC_DEVICE, &snaps);
    if (n >= 0) lb_wait_snaps(snaps, n); /* out of memory: the graves still protect it */
}

static cudaError_t lb_free(const char *fn, void *ptr, bool sync) {
    cudaError_t err = lb_check_usable(fn);
    if (err) return err;
    if ((err = lb_capture_unsafe(fn))) return err;
    if (ptr == NULL) return cudaSuccess;
    if (sync) sync_alloc_device(ptr);
    uintptr_t p = (uintptr_t)ptr;
    pthread_rwlock_wrlock(&g_allocs_lock);
    size_t i = alloc_upper(p);
    bool exact = i > 0 && g_allocs[i - 1].base == p;
    bool inside = !exact && i > 0 && p - g_allocs[i - 1].base < g_allocs[i - 1].size;
    bool foreign = (exact || inside) && g_allocs[i - 1].foreign;
    if (exact && !foreign) {
        memmove(g_allocs + i - 1, g_allocs + i, (g_nallocs - i) * sizeof *g_allocs);
        g_nallocs--;
    }
    pthread_rwlock_unlock(&g_allocs_lock);
    if (foreign)
        return lb_fail(cudaErrorInvalidValue, fn,
                       "%p is in a peer mapping registered by libnccl (a window of another "
                       "process), not an allocation: it cannot be freed", ptr);
    if (inside)
        return lb_fail(cudaErrorInvalidDevicePointer, fn,
                       "%p is inside an allocation but is not its start", ptr);
    if (!exact)
        return lb_fail(cudaErrorInvalidValue, fn,
                       "%p is not a live loopback allocation (double free?)", ptr);
    uint64_t ticket = atomic_load(&g_ticket);
    if (lb_min_pending_ticket() >= ticket) {
        free(ptr);
    } else {
        lb_grave *g = malloc(sizeof *g);
        if (g == NULL) return cudaSuccess; /* leak rather than risk a use after free */
        g->base = ptr;
        g->ticket = ticket;
        pthread_mutex_lock(&g_graves_mu);
        g->next = g_graves;
        g_graves = g;
        atomic_fetch_add(&g_ngraves, 1);
        pthread_mutex_unlock(&g_graves_mu);
    }
    lb_mem_reap();
    return cudaSuccess;
}

int pynccl_lb_malloc(void **ptr, size_t size, int device) {
    return lb_malloc("pynccl_lb_malloc", ptr, size, device);
}

int pynccl_lb_free(void *ptr) { return lb_free("pynccl_lb_free", ptr, false); }

long pynccl_lb_live_allocations(int device, size_t *bytes) {
    long n = 0;
    size_t total = 0;
    pthread_rwlock_rdlock(&g_allocs_lock);
    for (size_t i = 0; i < g_nallocs; i++) {
        const lb_alloc *a = &g_allocs[i];
        if (a->foreign || (device >= 0 && a->device != device)) continue;
        n++;
        total += a->size;
    }
    pthread_rwlock_unlock(&g_allocs_lock);
    if (bytes != NULL) *bytes = total;
    return n;
}

int pynccl_lb_register_foreign_range(void *ptr, size_t size, int device) {
    const char *fn = "pynccl_lb_register_foreign_range";
    cudaError_t err = lb_check_usable(fn);
    if (err) return err;
    uintptr_t p = (uintptr_t)ptr;
    if (ptr == NULL || size == 0 || p + size < p)
        return lb_fail(cudaErrorInvalidValue, fn, "[%p, +%zu) is not a range of memory", ptr,
                       size);
    if (device == -1) device = lb_current_device();
    if (device < 0 || device >= g_ndev) return lb_bad_device(fn, device);
    pthread_rwlock_wrlock(&g_allocs_lock);
    size_t i = alloc_upper(p);
    bool overlap = (i > 0 && p - g_allocs[i - 1].base < g_allocs[i - 1].size) ||
                   (i < g_nallocs && g_allocs[i].base < p + size);
    bool ok = !overlap && alloc_insert_locked((lb_alloc){p, size, device, true});
    pthread_rwlock_unlock(&g_allocs_lock);
    if (overlap)
        return lb_fail(cudaErrorInvalidValue, fn,
                       "[%p, +%zu) overlaps a live allocation or registered mapping", ptr, size);
    if (!ok) return lb_fail(cudaErrorMemoryAllocation, fn, "out of host memory for the registry");
    return cudaSuccess;
}

int pynccl_lb_unregister_foreign_range(void *ptr) {
    const char *fn = "pynccl_lb_unregister_foreign_range";
    cudaError_t err = lb_check_usable(fn);
    if (err) return err;
    uintptr_t p = (uintptr_t)ptr;
    pthread_rwlock_wrlock(&g_allocs_lock);
    size_t i = alloc_upper(p);
    bool found = i > 0 && g_allocs[i - 1].base == p && g_allocs[i - 1].foreign;
    if (found) {
        memmove(g_allocs + i - 1, g_allocs + i, (g_nallocs - i) * sizeof *g_allocs);
        g_nallocs--;
    }
    pthread_rwlock_unlock(&g_allocs_lock);
    if (!found)
        return lb_fail(cudaErrorInvalidValue, fn, "%p is not the start of a registered mapping",
                       ptr);
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **devPtr, size_t size) {
    return lb_malloc(__func__, devPtr, size, lb_current_device());
}

cudaError_t cudaFree(void *devPtr) { return lb_free(__func__, devPtr, true); }

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (attributes == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "attributes is NULL");
    memset(attributes, 0, sizeof *attributes);
    uintptr_t p = (uintptr_t)ptr;
    pthread_rwlock_rdlock(&g_allocs_lock);
    const lb_alloc *a = alloc_find_locked(p, 1);
    int dev = a != NULL ? a->device : cudaInvalidDeviceId;
    pthread_rwlock_unlock(&g_allocs_lock);
    if (a != NULL) {
        attributes->type = cudaMemoryTypeDevice;
        attributes->device = dev;
        attributes->devicePointer = (void *)ptr;
    } else {
        attributes->type = cudaMemoryTypeUnregistered;
        attributes->device = cudaInvalidDeviceId;
        attributes->hostPointer = (void *)ptr;
    }
    return cudaSuccess;
}

/* ---- copies and memsets: stream tasks ------------------------------------ */

typedef struct {
    void *dst;
    const void *src;
    size_t count;
    int value; /* memset only */
} lb_mem_task;

static void copy_run(void *arg) {
    lb_mem_task *t = arg;
    memmove(t->dst, t->src, t->count);
}

static void *mem_clone(void *arg, int launch) {
    (void)launch;
    lb_mem_task *copy = malloc(sizeof *copy);
    if (copy != NULL) *copy = *(const lb_mem_task *)arg;
    return copy;
}

static void set_run(void *arg) {
    lb_mem_task *t = arg;
    memset(t->dst, t->value, t->count);
}

/* A staged host-to-device copy: the source bytes, taken at the call. */
typedef struct {
    void *dst;
    size_t count;
    unsigned char bytes[];
} lb_staged;

static void staged_run(void *arg) {
    lb_staged *t = arg;
    memcpy(t->dst, t->bytes, t->count);
}

static void *staged_clone(void *arg, int launch) {
    (void)launch;
    const lb_staged *t = arg;
    lb_staged *copy = malloc(sizeof *copy + t->count);
    if (copy != NULL) memcpy(copy, t, sizeof *copy + t->count);
    return copy;
}

static cudaError_t check_device_range(const char *fn, const char *what, const void *ptr,
                                      size_t count) {
    if (!g_strict || pynccl_lb_find_alloc(ptr, count, NULL)) return cudaSuccess;
    return lb_fail(cudaErrorInvalidValue, fn,
                   "%s [%p, +%zu) is not inside one loopback allocation or registered peer "
                   "mapping (PYNCCL_LOOPBACK_STRICT=0 allows host pointers)", what, ptr, count);
}

/* What the host waits for (CUDA's "API synchronization behavior"). */
enum mem_sync {
    MEM_ASYNC,  /* nothing: stream ordered (the Async calls, memset, device to device) */
    MEM_WAIT,   /* the operation itself (to host memory, host to host) */
    MEM_STAGED, /* the stream's earlier work, then the source is staged (pageable to device) */
};

/* Enqueue a copy (set == false) or memset on stream, waiting as `sync` says. */
static cudaError_t mem_op(const char *fn, bool set, void *dst, const void *src, int value,
                          size_t count, cudaStream_t stream, enum mem_sync sync) {
    struct CUstream_st *s;
    cudaError_t err = lb_stream_get(stream, fn, &s);
    if (err) return err;
    if (count == 0) {
        lb_stream_put(s);
        return cudaSuccess;
    }
    void *arg;
    lb_task_fn run;
    lb_clone_fn clone;
    if (sync == MEM_STAGED) {
        /* "A stream sync is performed before the copy is initiated": the work queued on
         * the stream itself (refused first where waiting on it is: the legacy stream
         * behind a capturing blocking one). The copy then waits, as any legacy-stream
         * work does, for the device's blocking streams, but the host does not. */
        if ((err = lb_capture_sync(s, fn))) {
            lb_stream_put(s);
            return err;
        }
        pthread_mutex_lock(&s->mu);
        uint64_t queued = s->enq_seq;
        pthread_mutex_unlock(&s->mu);
        lb_stream_wait_seq(s, queued);
        lb_staged *st = count <= SIZE_MAX - sizeof *st ? malloc(sizeof *st + count) : NULL;
        if (st == NULL) {
            lb_stream_put(s);
            return lb_fail(cudaErrorMemoryAllocation, fn, "cannot stage %zu bytes", count);
        }
        st->dst = dst;
        st->count = count;
        memcpy(st->bytes, src, count);
        arg = st;
        run = staged_run;
        clone = staged_clone;
    } else {
        lb_mem_task *t = malloc(sizeof *t);
        if (t == NULL) {
            lb_stream_put(s);
            return lb_fail(cudaErrorMemoryAllocation, fn, "out of host memory");
        }
        *t = (lb_mem_task){dst, src, count, value};
        arg = t;
        run = set ? set_run : copy_run;
        clone = mem_clone;
    }
    uint64_t seq = 0;
    err = lb_stream_push(s, run, free, clone, arg, &seq, -1);
    if (err) {
        free(arg);
        lb_stream_put(s);
        return lb_push_fail(err, fn, (void *)stream);
    }
    if (sync == MEM_WAIT) {
        lb_stream_wait_seq(s, seq);
        lb_mem_reap();
    }
    lb_stream_put(s);
    return cudaSuccess;
}

/* cudaMemcpyDefault resolved as UVA does, by where the pointers are. */
static enum cudaMemcpyKind resolve_kind(enum cudaMemcpyKind kind, const void *dst,
                                        const void *src, size_t count) {
    if (kind != cudaMemcpyDefault) return kind;
    bool d = pynccl_lb_find_alloc(dst, count, NULL), s = pynccl_lb_find_alloc(src, count, NULL);
    return s ? (d ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
             : (d ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
}

/* sync: cudaMemcpy (false: cudaMemcpyAsync, stream ordered). */
static cudaError_t memcpy_checked(const char *fn, void *dst, const void *src, size_t count,
                                  enum cudaMemcpyKind kind, cudaStream_t stream, bool sync) {
    cudaError_t err = lb_check_usable(fn);
    if (err) return err;
    if ((int)kind < (int)cudaMemcpyHostToHost || (int)kind > (int)cudaMemcpyDefault)
        return lb_fail(cudaErrorInvalidMemcpyDirection, fn, "kind=%d", (int)kind);
    if (count > 0 && (dst == NULL || src == NULL))
        return lb_fail(cudaErrorInvalidValue, fn, "dst=%p src=%p for %zu bytes", dst, src, count);
    if (count > 0 && (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice) &&
        (err = check_device_range(fn, "dst", dst, count)))
        return err;
    if (count > 0 && (kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice) &&
        (err = check_device_range(fn, "src", src, count)))
        return err;
    enum mem_sync how = MEM_ASYNC;
    if (sync && count > 0) {
        enum cudaMemcpyKind k = resolve_kind(kind, dst, src, count);
        how = k == cudaMemcpyDeviceToDevice ? MEM_ASYNC
              : k == cudaMemcpyHostToDevice ? MEM_STAGED
                                            : MEM_WAIT;
    }
    return mem_op(fn, false, dst, src, 0, count, stream, how);
}

static cudaError_t memset_checked(const char *fn, void *devPtr, int value, size_t count,
                                  cudaStream_t stream) {
    cudaError_t err = lb_check_usable(fn);
    if (err) return err;
    if (count > 0 && devPtr == NULL)
        return lb_fail(cudaErrorInvalidValue, fn, "devPtr is NULL for %zu bytes", count);
    if (count > 0 && (err = check_device_range(fn, "devPtr", devPtr, count))) return err;
    /* Asynchronous to the host, synchronous variant or not (no pinned or managed memory
     * here, where CUDA's cudaMemset would wait). */
    return mem_op(fn, true, devPtr, NULL, (unsigned char)value, count, stream, MEM_ASYNC);
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
    cudaError_t err = lb_capture_unsafe(__func__);
    if (err) return err;
    return memcpy_checked(__func__, dst, src, count, kind, NULL, true);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
    return memcpy_checked(__func__, dst, src, count, kind, stream, false);
}

cudaError_t cudaMemset(void *devPtr, int value, size_t count) {
    cudaError_t err = lb_capture_unsafe(__func__);
    if (err) return err;
    return memset_checked(__func__, devPtr, value, count, NULL);
}

cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream) {
    return memset_checked(__func__, devPtr, value, count, stream);
}

/* ---- fork ---------------------------------------------------------------- */

LB_HIDDEN void lb_mem_fork_prepare(void) {
    pthread_rwlock_wrlock(&g_allocs_lock);
    pthread_mutex_lock(&g_graves_mu);
}

LB_HIDDEN void lb_mem_fork_parent(void) {
    pthread_mutex_unlock(&g_graves_mu);
    pthread_rwlock_unlock(&g_allocs_lock);
}

LB_HIDDEN void lb_mem_fork_child(void) {
    pthread_mutex_init(&g_graves_mu, NULL);
    pthread_rwlock_init(&g_allocs_lock, NULL);
}
