/*
 * pynccl loopback libcudart, the leaf every other file builds on: configuration
 * (environment and visible devices), errors and the calling thread's state, the
 * clock, sets of live handles, versions. Nothing here calls another cudart file.
 *
 * Files, bottom to top (each calls only those before it): core.c, stream.c (stream
 * objects and their worker threads), capture.c (stream capture), graph.c (graphs),
 * event.c, mem.c (memory and copies), api.c (devices, the stream API and the hooks for
 * libnccl), init.c (library load, unload and fork).
 *
 * Environment, read once when the library is loaded (strictly, see lb_env.h: a
 * malformed value makes every call fail with cudaErrorInvalidValue, naming it):
 *   PYNCCL_LOOPBACK_DEVICES  physical devices (default 8, 0..1024)
 *   PYNCCL_LOOPBACK_STRICT   0: device-side copy pointers need not be allocations
 *   PYNCCL_LOOPBACK_DEBUG    1: print every error (with its detail) to stderr
 *   CUDA_VISIBLE_DEVICES     as CUDA: which physical devices are visible, in what order
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "lb_env.h"

#define LB_DEFAULT_DEVICES 8
#define LB_VERSION 13000

LB_HIDDEN int g_ndev = LB_DEFAULT_DEVICES;
LB_HIDDEN int g_nphys = LB_DEFAULT_DEVICES;
LB_HIDDEN int g_phys[LB_MAX_DEVICES];
LB_HIDDEN bool g_visible_set;
LB_HIDDEN int g_strict = 1;
LB_HIDDEN int g_debug = 0;
LB_HIDDEN atomic_int g_shutdown;
LB_HIDDEN atomic_int g_fork_poisoned;
static atomic_int g_fork_warned;
static char g_env_error[256]; /* set at load: a malformed PYNCCL_LOOPBACK_* value */
static atomic_int g_env_warned;

static _Thread_local int tls_device;
static _Thread_local cudaError_t tls_last_error;
static _Thread_local char tls_detail[384];
/* The thread's stream capture interaction mode (cudaThreadExchangeStreamCaptureMode);
 * zero is cudaStreamCaptureModeGlobal, CUDA's default for every thread. */
static _Thread_local int tls_capture_mode;
static _Thread_local bool tls_in_host_fn; /* running a cudaLaunchHostFunc function */

/* ---- configuration -------------------------------------------------------- */

/* CUDA's rule: a comma-separated list of device indices, enumerated in that order;
 * the list ends at the first entry that is not a valid index (not a number, out of
 * range, or a repeat), so "0,2,-1,1" shows physical devices 0 and 2. Spaces around
 * an entry are ignored. The loopback's devices have no UUIDs: a "GPU-..." entry is
 * invalid too. Unset: every device, in order; empty: none. */
static int parse_visible(const char *text, int nphys, int *map) {
    int n = 0;
    for (const char *p = text; n < nphys;) {
        while (*p == ' ' || *p == '\t') p++;
        unsigned long long v;
        const char *end;
        if (!lb_parse_digits(p, (unsigned long long)nphys - 1, &v, &end)) break;
        p = end;
        while (*p == ' ' || *p == '\t') p++;
        if (*p != ',' && *p != '\0') break;
        bool repeat = false;
        for (int i = 0; i < n; i++) repeat = repeat || map[i] == (int)v;
        if (repeat) break;
        map[n++] = (int)v;
        if (*p == '\0') break;
        p++;
    }
    return n;
}

LB_HIDDEN void lb_config_load(void) {
    static const lb_env_spec specs[] = {
        {"PYNCCL_LOOPBACK_DEVICES", LB_ENV_UINT, LB_MAX_DEVICES},
        {"PYNCCL_LOOPBACK_STRICT", LB_ENV_BOOL, 1},
        {"PYNCCL_LOOPBACK_DEBUG", LB_ENV_BOOL, 1},
    };
    for (int i = 0; i < LB_MAX_DEVICES; i++) g_phys[i] = i;
    if (!lb_env_check(specs, sizeof specs / sizeof *specs, g_env_error, sizeof g_env_error))
        return; /* the defaults stay; every call reports g_env_error */
    unsigned long long ndev;
    bool strict, debug;
    lb_env_uint("PYNCCL_LOOPBACK_DEVICES", LB_DEFAULT_DEVICES, LB_MAX_DEVICES, &ndev, NULL, 0);
    lb_env_bool("PYNCCL_LOOPBACK_STRICT", true, &strict, NULL, 0);
    lb_env_bool("PYNCCL_LOOPBACK_DEBUG", false, &debug, NULL, 0);
    g_nphys = (int)ndev;
    g_strict = strict;
    g_debug = debug;
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    g_visible_set = visible != NULL;
    g_ndev = visible != NULL ? parse_visible(visible, g_nphys, g_phys) : g_nphys;
}

LB_HIDDEN const char *lb_devices_origin(void) {
    return g_visible_set ? "CUDA_VISIBLE_DEVICES" : "PYNCCL_LOOPBACK_DEVICES";
}

/* ---- errors and the calling thread --------------------------------------- */

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
    if (g_env_error[0] != '\0') {
        if (!atomic_exchange(&g_env_warned, 1))
            fprintf(stderr, "pynccl loopback cudart: %s; every call of this process fails with "
                            "cudaErrorInvalidValue (read when the library loaded)\n", g_env_error);
        return lb_fail(cudaErrorInvalidValue, fn, "%s", g_env_error);
    }
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
    /* CUDA: "the host function must not make any CUDA API calls. Attempting to use a
     * CUDA API may result in cudaErrorNotPermitted"; here it always does. */
    if (tls_in_host_fn)
        return lb_fail(cudaErrorNotPermitted, fn,
                       "called from a host function (cudaLaunchHostFunc), which must not make "
                       "CUDA API calls");
    return cudaSuccess;
}

LB_HIDDEN cudaError_t lb_no_device(const char *fn) {
    if (g_visible_set && g_nphys > 0)
        return lb_fail(cudaErrorNoDevice, fn,
                       "CUDA_VISIBLE_DEVICES leaves none of the %d loopback devices visible",
                       g_nphys);
    return lb_fail(cudaErrorNoDevice, fn, "PYNCCL_LOOPBACK_DEVICES=0");
}

LB_HIDDEN cudaError_t lb_bad_device(const char *fn, int device) {
    return lb_fail(cudaErrorInvalidDevice, fn, "device %d is out of range [0, %d) (%s)", device,
                   g_ndev, lb_devices_origin());
}

LB_HIDDEN int lb_current_device(void) { return tls_device; }

LB_HIDDEN void lb_set_thread_device(int device) { tls_device = device; }

LB_HIDDEN enum cudaStreamCaptureMode lb_thread_capture_mode(void) {
    return (enum cudaStreamCaptureMode)tls_capture_mode;
}

LB_HIDDEN void lb_set_thread_capture_mode(enum cudaStreamCaptureMode mode) {
    tls_capture_mode = (int)mode;
}

LB_HIDDEN void lb_set_in_host_fn(bool in) { tls_in_host_fn = in; }

LB_HIDDEN double lb_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---- a sorted set of pointers (live handles), binary-searched ------------ */

static size_t ptrset_lower(const lb_ptrset *set, const void *p) {
    size_t lo = 0, hi = set->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if ((uintptr_t)set->items[mid] < (uintptr_t)p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

LB_HIDDEN bool ptrset_has(const lb_ptrset *set, const void *p) {
    size_t i = ptrset_lower(set, p);
    return i < set->n && set->items[i] == p;
}

LB_HIDDEN bool ptrset_add(lb_ptrset *set, void *p) {
    if (set->n == set->cap) {
        size_t cap = set->cap ? set->cap * 2 : 16;
        void **items = realloc(set->items, cap * sizeof *items);
        if (items == NULL) return false;
        set->items = items;
        set->cap = cap;
    }
    size_t i = ptrset_lower(set, p);
    memmove(set->items + i + 1, set->items + i, (set->n - i) * sizeof *set->items);
    set->items[i] = p;
    set->n++;
    return true;
}

LB_HIDDEN bool ptrset_del(lb_ptrset *set, const void *p) {
    size_t i = ptrset_lower(set, p);
    if (i >= set->n || set->items[i] != p) return false;
    memmove(set->items + i, set->items + i + 1, (set->n - i - 1) * sizeof *set->items);
    set->n--;
    return true;
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
