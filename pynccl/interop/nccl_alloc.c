/*
 * pynccl's allocator shim for torch.cuda.memory.CUDAPluggableAllocator: ncclMemAlloc /
 * ncclMemFree of the libnccl pynccl loaded, on the device torch asks for.
 *
 * C only, no CUDA or torch headers: the two libraries are opened by path at
 * pynccl_shim_init (the paths pynccl loaded them from, so dlopen returns the same handles)
 * and the few functions used are looked up by name. Built on demand with the system C
 * compiler and cached by source hash, as the loopback libraries are.
 *
 * torch's signatures (torch/csrc/cuda/CUDAPluggableAllocator.h):
 *   void *alloc(ssize_t size, int device, cudaStream_t stream);
 *   void free(void *ptr, ssize_t size, int device, cudaStream_t stream);
 * ncclMemAlloc allocates on the current device: the shim makes `device` current for the
 * call and restores the previous one. ncclMemFree is not stream-ordered; torch frees a
 * pool's segment only after synchronizing it (emptying the cache, destroying the pool).
 * A failed allocation returns NULL, which torch reports as out of memory; the NCCL
 * result of the last failure is kept for pynccl_shim_last_error.
 */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/types.h>

typedef int (*mem_alloc_t)(void **, size_t);
typedef int (*mem_free_t)(void *);
typedef int (*get_device_t)(int *);
typedef int (*set_device_t)(int);

static mem_alloc_t g_alloc;
static mem_free_t g_free;
static get_device_t g_get_device;
static set_device_t g_set_device;
static int g_last_error;
static char g_init_error[512];

__attribute__((visibility("default"))) int pynccl_shim_init(const char *nccl, const char *cudart) {
    void *n = dlopen(nccl, RTLD_NOW | RTLD_LOCAL);
    void *c = n ? dlopen(cudart, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!n || !c) {
        snprintf(g_init_error, sizeof g_init_error, "%s", dlerror());
        return -1;
    }
    g_alloc = (mem_alloc_t)dlsym(n, "ncclMemAlloc");
    g_free = (mem_free_t)dlsym(n, "ncclMemFree");
    g_get_device = (get_device_t)dlsym(c, "cudaGetDevice");
    g_set_device = (set_device_t)dlsym(c, "cudaSetDevice");
    if (!g_alloc || !g_free || !g_get_device || !g_set_device) {
        snprintf(g_init_error, sizeof g_init_error,
                 "%s lacks ncclMemAlloc/ncclMemFree (NCCL >= 2.19) or %s lacks "
                 "cudaGetDevice/cudaSetDevice", nccl, cudart);
        g_alloc = NULL;
        return -2;
    }
    return 0;
}

__attribute__((visibility("default"))) const char *pynccl_shim_init_error(void) {
    return g_init_error;
}

__attribute__((visibility("default"))) int pynccl_shim_last_error(void) { return g_last_error; }

/* Make `device` current; *previous gets the device to restore (-1: nothing to restore). */
static int enter(int device, int *previous) {
    *previous = -1;
    int cur = -1;
    int e = g_get_device(&cur);
    if (e) return e;
    if (cur == device) return 0;
    e = g_set_device(device);
    if (!e) *previous = cur;
    return e;
}

static void leave(int previous) {
    if (previous >= 0) g_set_device(previous);
}

__attribute__((visibility("default"))) void *pynccl_nccl_alloc(ssize_t size, int device,
                                                               void *stream) {
    (void)stream;
    void *ptr = NULL;
    int previous;
    if (!g_alloc) {
        g_last_error = -1;
        return NULL;
    }
    if (size <= 0) return NULL;
    int e = enter(device, &previous);
    if (e) {
        g_last_error = 1000 + e; /* a CUDA error, offset so it cannot be read as NCCL's */
        return NULL;
    }
    e = g_alloc(&ptr, (size_t)size);
    leave(previous);
    if (e) {
        g_last_error = e;
        return NULL;
    }
    return ptr;
}

__attribute__((visibility("default"))) void pynccl_nccl_free(void *ptr, ssize_t size, int device,
                                                             void *stream) {
    (void)size;
    (void)stream;
    int previous;
    if (!g_free || ptr == NULL) return;
    int e = enter(device, &previous);
    if (e) {
        g_last_error = 1000 + e;
        return;
    }
    e = g_free(ptr);
    leave(previous);
    if (e) g_last_error = e;
}
