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
 * still owns `arg`. Such a task cannot be captured: on a capturing stream this
 * fails with cudaErrorStreamCaptureUnsupported and invalidates the capture (use
 * pynccl_lb_stream_enqueue2). */
LB_EXPORT int pynccl_lb_stream_enqueue(void *stream, lb_task_fn run, lb_task_fn release, void *arg);

/* Stream capture (cudaStreamBeginCapture ... cudaStreamEndCapture, then
 * cudaGraphInstantiate / cudaGraphLaunch). A task enqueued on a capturing stream is
 * not run: it becomes a node of the graph being captured, and every graph launch
 * enqueues a fresh copy of it. Copies are made by the enqueuer's `clone`:
 *
 *   clone(arg, launch) returns a new, independent arg (NULL: out of memory).
 *     launch == 0: the copy is a template, kept by a graph or an executable graph
 *                  (cudaGraphInstantiate, or a graph launched into a capturing
 *                  stream); it is only ever released, never run.
 *     launch == 1: the copy is about to be enqueued by cudaGraphLaunch, right after
 *                  this call and in launch order: take per-run resources (a
 *                  communicator's sequence number) now. It is then run and
 *                  released like any task, or released without running if the
 *                  enqueue fails.
 *   Templates are released with `release` (so `release` must tell a template from a
 *   run copy if that matters) when their graph / capture / executable graph goes.
 *
 * `clone` is called on the application's thread (never on a stream worker) and
 * without any loopback cudart lock held. */
typedef void *(*lb_clone_fn)(void *arg, int launch);

/* Capture state of a stream (NULL/legacy/per-thread resolved as above):
 * 0 not capturing, 1 capturing (active or invalidated), -1 not a live stream. */
LB_EXPORT int pynccl_lb_stream_capturing(void *stream);

/* pynccl_lb_stream_enqueue with a clone callback (may be NULL: the task then cannot
 * be captured). `capture` says what the caller prepared `arg` for: 0 a task to run
 * (pynccl_lb_stream_enqueue's contract), 1 a template for the capture under way on
 * `stream` (see above). If the stream's capture state does not match, nothing is
 * taken and cudaErrorIllegalState is returned (the caller raced a concurrent
 * begin/end capture). Errors, as for pynccl_lb_stream_enqueue, leave `arg` with
 * the caller; in particular, on a capturing stream:
 *   cudaErrorStreamCaptureUnsupported  clone is NULL (the capture is invalidated);
 *   cudaErrorStreamCaptureInvalidated  the capture was invalidated earlier. */
LB_EXPORT int pynccl_lb_stream_enqueue2(void *stream, lb_task_fn run, lb_task_fn release,
                                        lb_clone_fn clone, void *arg, int capture);

/* Device of a stream handle (resolving NULL/legacy/per-thread as above);
 * -1 if the handle is not a live stream. */
LB_EXPORT int pynccl_lb_stream_device(void *stream);

/* 1 if [ptr, ptr+nbytes) lies inside one live loopback allocation
 * (cudaMalloc / ncclMemAlloc), with *device set to its device; else 0.
 * nbytes == 0 only checks that ptr is inside (or one past the end of) an allocation. */
LB_EXPORT int pynccl_lb_find_alloc(const void *ptr, size_t nbytes, int *device);

/* Number of live events (created and not yet destroyed), for leak checks. */
LB_EXPORT long pynccl_lb_live_events(void);

/* The calling thread's current device (cudaGetDevice without the error path). */
LB_EXPORT int pynccl_lb_current_device(void);

/* Number of visible loopback devices: PYNCCL_LOOPBACK_DEVICES (default 8) physical
 * devices, selected and renumbered by CUDA_VISIBLE_DEVICES as CUDA does. */
LB_EXPORT int pynccl_lb_device_count(void);

/* The physical device behind visible ordinal `device` (what identifies a device across
 * processes whose CUDA_VISIBLE_DEVICES differ); -1 if it is not a visible ordinal. */
LB_EXPORT int pynccl_lb_device_physical(int device);

/* Allocation for ncclMemAlloc/ncclMemFree (same registry as cudaMalloc). */
LB_EXPORT int pynccl_lb_malloc(void **ptr, size_t size, int device);
LB_EXPORT int pynccl_lb_free(void *ptr);

/* Leak counter (a test hook, not in CUDA): the number of live allocations (cudaMalloc and
 * ncclMemAlloc, not peer mappings) of `device` (-1: every device), and their bytes in
 * *bytes (may be NULL). An allocation stops counting when cudaFree / ncclMemFree takes it
 * out of the registry, as its address stops being valid on a GPU. */
LB_EXPORT long pynccl_lb_live_allocations(int device, size_t *bytes);

/* Peer mappings. On a GPU a peer's window, mapped into this process (a "peer
 * pointer"), is an ordinary UVA device address: copies, memsets and collectives take
 * it. The loopback libnccl maps another process's window memory at an address the
 * cudart knows nothing of; registering [ptr, ptr + size) makes it device memory of
 * `device` (-1: the calling thread's current device) for every check here
 * (cudaMemcpy, cudaMemset, cudaPointerGetAttributes, pynccl_lb_find_alloc), as long as
 * it stays registered. It is not an allocation: cudaFree / pynccl_lb_free refuse it.
 * Register after mapping; unregister (by the same ptr) before unmapping, once no
 * queued work touches it any more. Returns 0 or a cudaError_t value:
 *   cudaErrorInvalidValue   NULL ptr, size 0, a wrapping range, a range overlapping a
 *                           live allocation or mapping; unregister: ptr is not the
 *                           start of a registered mapping;
 *   cudaErrorInvalidDevice  device is neither -1 nor a visible ordinal. */
LB_EXPORT int pynccl_lb_register_foreign_range(void *ptr, size_t size, int device);
LB_EXPORT int pynccl_lb_unregister_foreign_range(void *ptr);

#ifdef __cplusplus
}
#endif
#endif
