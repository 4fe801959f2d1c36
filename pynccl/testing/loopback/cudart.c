/*
 * pynccl loopback libcudart: devices, errors, versions, library init/fini and
 * fork handling. Streams and events live in cudart_stream.c, memory in
 * cudart_mem.c, stream capture and graphs in cudart_graph.c.
 *
 * Environment, read once when the library is loaded:
 *   PYNCCL_LOOPBACK_DEVICES  number of devices (default 8, 0..1024)
 *   PYNCCL_LOOPBACK_STRICT   0: device-side copy pointers need not be allocations
 *   PYNCCL_LOOPBACK_DEBUG    1: print every error (with its detail) to stderr
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cudart_internal.h"

#define LB_DEFAULT_DEVICES 8
#define LB_MAX_DEVICES 1024
#define LB_VERSION 13000

LB_HIDDEN int g_ndev = LB_DEFAULT_DEVICES;
LB_HIDDEN int g_strict = 1;
LB_HIDDEN int g_debug = 0;
LB_HIDDEN atomic_int g_shutdown;
LB_HIDDEN atomic_int g_fork_poisoned;
static atomic_int g_fork_warned;

static _Thread_local int tls_device;
static _Thread_local cudaError_t tls_last_error;
static _Thread_local char tls_detail[384];

static int env_int(const char *name, int fallback, int lo, int hi) {
    const char *text = getenv(name);
    if (text == NULL || *text == '\0') return fallback;
    char *end = NULL;
    long value = strtol(text, &end, 10);
    if (*end != '\0' || value < lo || value > hi) {
        fprintf(stderr, "pynccl loopback cudart: ignoring %s=%s (expected an integer in [%d, %d]); "
                        "using %d\n", name, text, lo, hi, fallback);
        return fallback;
    }
    return (int)value;
}

LB_HIDDEN cudaError_t lb_fail(cudaError_t err, const char *fn, const char *fmt, ...) {
    /* cudaErrorNotReady is a status, not an error: CUDA does not record it. */
    if (err == cudaSuccess || err == cudaErrorNotReady) return err;
    tls_last_error = err;
    int n = snprintf(tls_detail, sizeof tls_detail, "%s: ", fn);
    if (n < 0 || (size_t)n >= sizeof tls_detail) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_detail + n, sizeof tls_detail - (size_t)n, fmt, ap);
    va_end(ap);
    if (g_debug) fprintf(stderr, "pynccl loopback cudart: %s (%s)\n", tls_detail, cudaGetErrorName(err));
    return err;
}

LB_HIDDEN cudaError_t lb_check_usable(const char *fn) {
    if (atomic_load_explicit(&g_fork_poisoned, memory_order_relaxed)) {
        if (!atomic_exchange(&g_fork_warned, 1))
            fprintf(stderr, "pynccl loopback cudart: this process was forked while its parent had "
                            "stream worker threads; like CUDA, the runtime cannot be used in such a "
                            "child (use the 'spawn' multiprocessing start method)\n");
        return lb_fail(cudaErrorInitializationError, fn,
                       "process forked after its parent started stream work; use 'spawn'");
    }
    if (atomic_load_explicit(&g_shutdown, memory_order_relaxed))
        return lb_fail(cudaErrorCudartUnloading, fn, "the loopback cudart is being unloaded");
    return cudaSuccess;
}

LB_HIDDEN int lb_current_device(void) { return tls_device; }

LB_HIDDEN void lb_set_thread_device(int device) { tls_device = device; }

LB_HIDDEN double lb_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---- library lifetime ---------------------------------------------------- */

static void fork_prepare(void) {
    lb_graph_fork_prepare();
    lb_streams_fork_prepare();
    lb_mem_fork_prepare();
}

static void fork_parent(void) {
    lb_mem_fork_parent();
    lb_streams_fork_parent();
    lb_graph_fork_parent();
}

static void fork_child(void) {
    lb_mem_fork_child();
    lb_streams_fork_child();
    lb_graph_fork_child();
}

__attribute__((constructor)) static void lb_cudart_init(void) {
    g_ndev = env_int("PYNCCL_LOOPBACK_DEVICES", LB_DEFAULT_DEVICES, 0, LB_MAX_DEVICES);
    g_strict = env_int("PYNCCL_LOOPBACK_STRICT", 1, 0, 1);
    g_debug = env_int("PYNCCL_LOOPBACK_DEBUG", 0, 0, 1);
    lb_streams_init();
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

__attribute__((destructor)) static void lb_cudart_fini(void) {
    atomic_store(&g_shutdown, 1);
    lb_streams_fini();
}

/* ---- errors -------------------------------------------------------------- */

const char *cudaGetErrorName(cudaError_t error) {
    switch ((int)error) {
#define LB_NAME(name, value, text) \
    case value:                    \
        return #name;
        LB_CUDA_ERRORS(LB_NAME)
#undef LB_NAME
    default:
        return "unrecognized error code";
    }
}

const char *cudaGetErrorString(cudaError_t error) {
    switch ((int)error) {
#define LB_TEXT(name, value, text) \
    case value:                    \
        return text;
        LB_CUDA_ERRORS(LB_TEXT)
#undef LB_TEXT
    default:
        return "unrecognized error code";
    }
}

cudaError_t cudaGetLastError(void) {
    cudaError_t err = tls_last_error;
    tls_last_error = cudaSuccess;
    return err;
}

cudaError_t cudaPeekAtLastError(void) { return tls_last_error; }

const char *pynccl_lb_last_error_detail(void) { return tls_detail; }

/* ---- versions ------------------------------------------------------------ */

cudaError_t cudaRuntimeGetVersion(int *runtimeVersion) {
    if (runtimeVersion == NULL)
        return lb_fail(cudaErrorInvalidValue, __func__, "runtimeVersion is NULL");
    *runtimeVersion = LB_VERSION;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *driverVersion) {
    if (driverVersion == NULL)
        return lb_fail(cudaErrorInvalidValue, __func__, "driverVersion is NULL");
    *driverVersion = LB_VERSION;
    return cudaSuccess;
}

/* ---- devices ------------------------------------------------------------- */

int pynccl_lb_device_count(void) { return g_ndev; }

int pynccl_lb_current_device(void) { return tls_device; }

cudaError_t cudaGetDeviceCount(int *count) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (count == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "count is NULL");
    *count = g_ndev;
    if (g_ndev == 0) return lb_fail(cudaErrorNoDevice, __func__, "PYNCCL_LOOPBACK_DEVICES=0");
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (device == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "device is NULL");
    if (g_ndev == 0) return lb_fail(cudaErrorNoDevice, __func__, "PYNCCL_LOOPBACK_DEVICES=0");
    *device = tls_device;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (device < 0 || device >= g_ndev)
        return lb_fail(cudaErrorInvalidDevice, __func__,
                       "device %d is out of range [0, %d) (PYNCCL_LOOPBACK_DEVICES)", device,
                       g_ndev);
    tls_device = device;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (pciBusId == NULL || len <= 0)
        return lb_fail(cudaErrorInvalidValue, __func__, "pciBusId=%p len=%d", (void *)pciBusId,
                       len);
    if (device < 0 || device >= g_ndev)
        return lb_fail(cudaErrorInvalidDevice, __func__, "device %d is out of range [0, %d)",
                       device, g_ndev);
    /* Distinct, stable, well-formed ids: bus = device + 1 (bus 0 is a host bridge). */
    unsigned bus = (unsigned)device + 1u;
    snprintf(pciBusId, (size_t)len, "%04x:%02x:00.0", bus >> 8, bus & 0xffu);
    return cudaSuccess;
}
