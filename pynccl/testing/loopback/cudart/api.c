/*
 * pynccl loopback libcudart: the public device and stream API, and the enqueue hooks
 * of the loopback libnccl (lb_internal.h). Devices are the visible ones (core.c:
 * CUDA_VISIBLE_DEVICES over PYNCCL_LOOPBACK_DEVICES physical devices); an ordinal
 * here is always a visible one.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

/* Bounded waits for a worker to finish: cudaStreamDestroy, thread exit. */
#define LB_DESTROY_WAIT_MS 10000
#define LB_THREAD_EXIT_WAIT_MS 2000

/* ---- devices --------------------------------------------------------------- */

int pynccl_lb_device_count(void) { return g_ndev; }

int pynccl_lb_current_device(void) { return lb_current_device(); }

int pynccl_lb_device_physical(int device) {
    return device >= 0 && device < g_ndev ? g_phys[device] : -1;
}

cudaError_t cudaGetDeviceCount(int *count) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (count == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "count is NULL");
    *count = g_ndev;
    if (g_ndev == 0) return lb_no_device(__func__);
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (device == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "device is NULL");
    if (g_ndev == 0) return lb_no_device(__func__);
    *device = lb_current_device();
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (g_ndev == 0) return lb_no_device(__func__);
    if (device < 0 || device >= g_ndev) return lb_bad_device(__func__, device);
    lb_set_thread_device(device);
    return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (pciBusId == NULL || len <= 0)
        return lb_fail(cudaErrorInvalidValue, __func__, "pciBusId=%p len=%d", (void *)pciBusId,
                       len);
    if (g_ndev == 0) return lb_no_device(__func__);
    if (device < 0 || device >= g_ndev) return lb_bad_device(__func__, device);
    /* Distinct, stable, well-formed ids of the physical device: bus = physical + 1
     * (bus 0 is a host bridge), so CUDA_VISIBLE_DEVICES renumbers but never renames. */
    unsigned bus = (unsigned)g_phys[device] + 1u;
    snprintf(pciBusId, (size_t)len, "%04x:%02x:00.0", bus >> 8, bus & 0xffu);
    return cudaSuccess;
}

/* ---- the stream API ------------------------------------------------------ */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (pStream == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "pStream is NULL");
    if (flags & ~(unsigned)cudaStreamNonBlocking)
        return lb_fail(cudaErrorInvalidValue, __func__,
                       "flags=%#x (expected cudaStreamDefault or cudaStreamNonBlocking)", flags);
    if (g_ndev == 0) return lb_no_device(__func__);
    struct CUstream_st *s = lb_stream_new(lb_current_device(), flags, LB_STREAM_USER);
    if (s == NULL) return lb_fail(cudaErrorMemoryAllocation, __func__, "cannot create a stream");
    *pStream = s;
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *pStream) {
    return cudaStreamCreateWithFlags(pStream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (lb_is_default_handle(stream))
        return lb_fail(cudaErrorInvalidResourceHandle, __func__,
                       "a default stream (%p) cannot be destroyed", (void *)stream);
    if (!lb_stream_unlink(stream))
        return lb_fail(cudaErrorInvalidResourceHandle, __func__, "stream %p is not a live stream",
                       (void *)stream);
    lb_capture_stream_gone(stream);
    /* Like CUDA, queued work still completes; unlike CUDA, wait for it (bounded). */
    lb_stream_retire(stream, LB_DESTROY_WAIT_MS, __func__);
    lb_stream_put(stream);
    return cudaSuccess;
}

/* What cudaStreamSynchronize and cudaStreamQuery share: check the stream (and that a
 * capture allows waiting on it), then snapshot the work it must wait for (*n >= 0). */
static cudaError_t stream_wait_targets(cudaStream_t stream, const char *fn, lb_snap **snaps,
                                       long *n) {
    cudaError_t err = lb_check_usable(fn);
    if (err) return err;
    struct CUstream_st *s;
    if ((err = lb_stream_get(stream, fn, &s))) return err;
    /* A capturing stream (or the legacy stream it would implicitly join) can never be
     * waited for; any other stream cannot where the capture modes forbid it. */
    if ((err = lb_capture_sync(s, fn)) || (err = lb_capture_unsafe(fn))) {
        lb_stream_put(s);
        return err;
    }
    *n = lb_sync_targets(s, s->device, LB_SYNC_SELF, snaps);
    lb_stream_put(s);
    if (*n < 0) return lb_fail(cudaErrorMemoryAllocation, fn, "out of host memory");
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    lb_snap *snaps;
    long n;
    cudaError_t err = stream_wait_targets(stream, __func__, &snaps, &n);
    if (err) return err;
    lb_wait_snaps(snaps, n);
    lb_mem_reap();
    return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    lb_snap *snaps;
    long n;
    cudaError_t err = stream_wait_targets(stream, __func__, &snaps, &n);
    if (err) return err;
    for (long i = 0; i < n; i++) lb_stream_put(snaps[i].stream);
    free(snaps);
    return n > 0 ? cudaErrorNotReady : cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (g_ndev == 0) return lb_no_device(__func__);
    if ((err = lb_capture_unsafe(__func__))) return err;
    lb_snap *snaps;
    long n = lb_sync_targets(NULL, lb_current_device(), LB_SYNC_DEVICE, &snaps);
    if (n < 0) return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    lb_wait_snaps(snaps, n);
    lb_mem_reap();
    return cudaSuccess;
}

/* cudaLaunchHostFunc: fn(userData) as a task of the stream, run by its worker after
 * the work queued before it, holding back the work queued after it; on a capturing
 * stream it becomes a graph node (every launch calls fn again). */
typedef struct {
    cudaHostFn_t fn;
    void *user_data;
} lb_host_fn;

static void host_fn_run(void *arg) {
    const lb_host_fn *h = arg;
    lb_set_in_host_fn(true);
    h->fn(h->user_data);
    lb_set_in_host_fn(false);
}

static void *host_fn_clone(void *arg, int launch) {
    (void)launch;
    lb_host_fn *copy = malloc(sizeof *copy);
    if (copy != NULL) *copy = *(const lb_host_fn *)arg;
    return copy;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (fn == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "fn is NULL");
    struct CUstream_st *s;
    if ((err = lb_stream_get(stream, __func__, &s))) return err;
    lb_host_fn *h = malloc(sizeof *h);
    if (h == NULL) {
        lb_stream_put(s);
        return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    }
    h->fn = fn;
    h->user_data = userData;
    err = lb_stream_push(s, host_fn_run, free, host_fn_clone, h, NULL, -1);
    lb_stream_put(s);
    if (err) {
        free(h);
        return lb_push_fail(err, __func__, (void *)stream);
    }
    return cudaSuccess;
}

/* A thread's per-thread default streams die with the thread (the destructor of
 * stream.c's thread key, given to it by init.c). */
LB_HIDDEN void lb_per_thread_streams_exit(void *value) {
    struct CUstream_st **pts = value;
    for (int d = 0; d < g_ndev; d++) {
        struct CUstream_st *s = pts[d];
        if (s == NULL) continue;
        lb_stream_unlink(s);
        lb_capture_stream_gone(s);
        lb_stream_retire(s, LB_THREAD_EXIT_WAIT_MS, "thread exit");
        lb_stream_put(s);
    }
    free(pts);
}

/* ---- hooks for the loopback libnccl -------------------------------------- */

int pynccl_lb_stream_enqueue(void *stream, lb_task_fn run, lb_task_fn release, void *arg) {
    const char *fn = "pynccl_lb_stream_enqueue";
    cudaError_t err = lb_check_usable(fn);
    if (err) return err;
    if (run == NULL) return lb_fail(cudaErrorInvalidValue, fn, "run is NULL");
    struct CUstream_st *s;
    if ((err = lb_stream_get(stream, fn, &s))) return err;
    err = lb_stream_push(s, run, release, NULL, arg, NULL, -1);
    lb_stream_put(s);
    return err ? lb_push_fail(err, fn, stream) : cudaSuccess;
}

int pynccl_lb_stream_enqueue2(void *stream, lb_task_fn run, lb_task_fn release,
                              lb_clone_fn clone, void *arg, int capture) {
    const char *fn = "pynccl_lb_stream_enqueue2";
    cudaError_t err = lb_check_usable(fn);
    if (err) return err;
    if (run == NULL) return lb_fail(cudaErrorInvalidValue, fn, "run is NULL");
    if (capture != 0 && capture != 1)
        return lb_fail(cudaErrorInvalidValue, fn, "capture=%d (expected 0 or 1)", capture);
    struct CUstream_st *s;
    if ((err = lb_stream_get(stream, fn, &s))) return err;
    err = lb_stream_push(s, run, release, clone, arg, NULL, capture);
    lb_stream_put(s);
    return err ? lb_push_fail(err, fn, stream) : cudaSuccess;
}
