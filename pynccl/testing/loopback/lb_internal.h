/*
 * Internal interface between the loopback libcudart and the loopback libnccl.
 *
 * Not part of any public ABI: the loopback libnccl links against the loopback
 * libcudart (soname libpynccl_loopback_cudart.so, found through the RUNPATH the
 * builder sets to that cudart build's cache directory)
 * and uses these hooks to enqueue work on streams and to check that a pointer
 * lies inside a loopback cudaMalloc allocation.
 */
#ifndef PYNCCL_LB_INTERNAL_H
#define PYNCCL_LB_INTERNAL_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LB_EXPORT __attribute__((visibility("default")))

/* A unit of work run by a stream's worker thread, in stream order.
 * `run` is called once on the worker; `arg` is owned by the task.
 * `release` (may be NULL) is called after `run`, or instead of it if the
 * stream is destroyed with the task still queued. */
/* (cudart engineer) What the loopback cudart actually does: cudaStreamDestroy
 * runs every queued task (so `release` always follows `run`); only at process exit
 * are still-queued tasks dropped, and then neither callback is called (libnccl has
 * already been finalized by then). `run` executes on the stream's own worker
 * thread, whose current device (pynccl_lb_current_device) is the stream's device.
 * A task may block (e.g. waiting for peers): other streams are unaffected, but the
 * destructor gives running tasks only ~0.5 s at exit before leaving them behind. */
typedef void (*lb_task_fn)(void *arg);

/* Enqueue a task on `stream` (a cudaStream_t as passed by the user:
 * NULL or cudaStreamLegacy = the calling thread's current device's legacy
 * default stream; cudaStreamPerThread = that thread's per-thread stream).
 * Returns 0 (cudaSuccess) or a cudaError_t value (invalid handle, ...).
 * On an error nothing was queued and neither callback is called: the caller
 * still owns `arg`. */
LB_EXPORT int pynccl_lb_stream_enqueue(void *stream, lb_task_fn run, lb_task_fn release, void *arg);

/* Device of a stream handle (resolving NULL/legacy/per-thread as above);
 * -1 if the handle is not a live stream. */
LB_EXPORT int pynccl_lb_stream_device(void *stream);

/* 1 if [ptr, ptr+nbytes) lies inside one live loopback allocation
 * (cudaMalloc / ncclMemAlloc), with *device set to its device; else 0.
 * nbytes == 0 only checks that ptr is inside (or one past the end of) an allocation. */
LB_EXPORT int pynccl_lb_find_alloc(const void *ptr, size_t nbytes, int *device);

/* The calling thread's current device (cudaGetDevice without the error path). */
LB_EXPORT int pynccl_lb_current_device(void);

/* Number of loopback devices (PYNCCL_LOOPBACK_DEVICES, default 8). */
LB_EXPORT int pynccl_lb_device_count(void);

/* Allocation for ncclMemAlloc/ncclMemFree (same registry as cudaMalloc). */
LB_EXPORT int pynccl_lb_malloc(void **ptr, size_t size, int device);
LB_EXPORT int pynccl_lb_free(void *ptr);

#ifdef __cplusplus
}
#endif
#endif
