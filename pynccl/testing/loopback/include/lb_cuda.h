/*
 * The slice of the CUDA runtime API that the loopback libraries implement or use.
 *
 * By default these are our own declarations, so the loopback builds without the
 * CUDA toolkit. With -DLB_USE_REAL_HEADERS the real <cuda_runtime_api.h> is used
 * instead: the compiler then checks every exported definition against NVIDIA's
 * prototypes, and the _Static_asserts below check our constant values against
 * driver_types.h. Handle types are pointers to the same struct tags as CUDA's, so
 * the loopback can define struct CUstream_st / CUevent_st itself.
 */
#ifndef PYNCCL_LB_CUDA_H
#define PYNCCL_LB_CUDA_H

#include <stddef.h>

#include "lb_internal.h"

/* X(name, value, string): every cudaError_t the loopback returns. Names and values
 * as in driver_types.h; strings as the real libcudart's cudaGetErrorString. */
#define LB_CUDA_ERRORS(X)                                                                   \
    X(cudaSuccess, 0, "no error")                                                           \
    X(cudaErrorInvalidValue, 1, "invalid argument")                                         \
    X(cudaErrorMemoryAllocation, 2, "out of memory")                                        \
    X(cudaErrorInitializationError, 3, "initialization error")                              \
    X(cudaErrorCudartUnloading, 4, "driver shutting down")                                  \
    X(cudaErrorInvalidDevicePointer, 17, "invalid device pointer")                          \
    X(cudaErrorInvalidMemcpyDirection, 21, "invalid copy direction for memcpy")             \
    X(cudaErrorInsufficientDriver, 35,                                                      \
      "CUDA driver version is insufficient for CUDA runtime version")                       \
    X(cudaErrorNoDevice, 100, "no CUDA-capable device is detected")                         \
    X(cudaErrorInvalidDevice, 101, "invalid device ordinal")                                \
    X(cudaErrorInvalidResourceHandle, 400, "invalid resource handle")                       \
    X(cudaErrorIllegalState, 401, "the operation cannot be performed in the present state") \
    X(cudaErrorNotReady, 600, "device not ready")                                           \
    X(cudaErrorNotPermitted, 800, "operation not permitted")                                \
    X(cudaErrorNotSupported, 801, "operation not supported")                               \
    X(cudaErrorStreamCaptureUnsupported, 900,                                               \
      "operation not permitted when stream is capturing")                                   \
    X(cudaErrorStreamCaptureInvalidated, 901,                                               \
      "operation failed due to a previous error during capture")                            \
    X(cudaErrorStreamCaptureMerge, 902,                                                     \
      "operation would result in a merge of separate capture sequences")                    \
    X(cudaErrorStreamCaptureUnmatched, 903,                                                 \
      "capture was not ended in the same stream as it began")                               \
    X(cudaErrorStreamCaptureUnjoined, 904, "capturing stream has unjoined work")            \
    X(cudaErrorStreamCaptureIsolation, 905,                                                 \
      "dependency created on uncaptured work in another stream")                            \
    X(cudaErrorStreamCaptureImplicit, 906,                                                  \
      "operation would make the legacy stream depend on a capturing blocking stream")       \
    X(cudaErrorCapturedEvent, 907,                                                          \
      "operation not permitted on an event last recorded in a capturing stream")            \
    X(cudaErrorStreamCaptureWrongThread, 908,                                               \
      "attempt to terminate a thread-local capture sequence from another thread")           \
    X(cudaErrorUnknown, 999, "unknown error")

#define LB_MEMCPY_KINDS(X)              \
    X(cudaMemcpyHostToHost, 0)          \
    X(cudaMemcpyHostToDevice, 1)        \
    X(cudaMemcpyDeviceToHost, 2)        \
    X(cudaMemcpyDeviceToDevice, 3)      \
    X(cudaMemcpyDefault, 4)

#define LB_MEMORY_TYPES(X)              \
    X(cudaMemoryTypeUnregistered, 0)    \
    X(cudaMemoryTypeHost, 1)            \
    X(cudaMemoryTypeDevice, 2)          \
    X(cudaMemoryTypeManaged, 3)

#define LB_CAPTURE_STATUSES(X)              \
    X(cudaStreamCaptureStatusNone, 0)       \
    X(cudaStreamCaptureStatusActive, 1)     \
    X(cudaStreamCaptureStatusInvalidated, 2)

#define LB_CAPTURE_MODES(X)                 \
    X(cudaStreamCaptureModeGlobal, 0)       \
    X(cudaStreamCaptureModeThreadLocal, 1)  \
    X(cudaStreamCaptureModeRelaxed, 2)

/* Flags: macros in driver_types.h. */
#define LB_FLAGS(X)                     \
    X(cudaStreamDefault, 0x00)          \
    X(cudaStreamNonBlocking, 0x01)      \
    X(cudaEventDefault, 0x00)           \
    X(cudaEventBlockingSync, 0x01)      \
    X(cudaEventDisableTiming, 0x02)     \
    X(cudaEventInterprocess, 0x04)      \
    X(cudaEventWaitDefault, 0x00)       \
    X(cudaEventWaitExternal, 0x01)      \
    X(cudaInvalidDeviceId, -2)

#ifdef LB_USE_REAL_HEADERS

#include <cuda_runtime_api.h>

#define LB_CHECK_ERROR(name, value, text) \
    _Static_assert(name == value, #name " differs from driver_types.h");
#define LB_CHECK_CONST(name, value) \
    _Static_assert(name == value, #name " differs from driver_types.h");
LB_CUDA_ERRORS(LB_CHECK_ERROR)
LB_MEMCPY_KINDS(LB_CHECK_CONST)
LB_MEMORY_TYPES(LB_CHECK_CONST)
LB_CAPTURE_STATUSES(LB_CHECK_CONST)
LB_CAPTURE_MODES(LB_CHECK_CONST)
LB_FLAGS(LB_CHECK_CONST)
#undef LB_CHECK_ERROR
#undef LB_CHECK_CONST

#else /* our own declarations */

#define LB_ENUM_ERROR(name, value, text) name = value,
#define LB_ENUM_CONST(name, value) name = value,
typedef enum cudaError { LB_CUDA_ERRORS(LB_ENUM_ERROR) } cudaError_t;
enum cudaMemcpyKind { LB_MEMCPY_KINDS(LB_ENUM_CONST) };
enum cudaMemoryType { LB_MEMORY_TYPES(LB_ENUM_CONST) };
enum cudaStreamCaptureStatus { LB_CAPTURE_STATUSES(LB_ENUM_CONST) };
enum cudaStreamCaptureMode { LB_CAPTURE_MODES(LB_ENUM_CONST) };
enum { LB_FLAGS(LB_ENUM_CONST) };
#undef LB_ENUM_ERROR
#undef LB_ENUM_CONST

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef void (*cudaHostFn_t)(void *userData);

#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)

struct cudaPointerAttributes {
    enum cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
    long reserved[8];
};

#define LB_API LB_EXPORT
LB_API cudaError_t cudaGetDeviceCount(int *count);
LB_API cudaError_t cudaGetDevice(int *device);
LB_API cudaError_t cudaSetDevice(int device);
LB_API cudaError_t cudaDeviceSynchronize(void);
LB_API cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device);
LB_API cudaError_t cudaStreamCreate(cudaStream_t *pStream);
LB_API cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags);
LB_API cudaError_t cudaStreamDestroy(cudaStream_t stream);
LB_API cudaError_t cudaStreamSynchronize(cudaStream_t stream);
LB_API cudaError_t cudaStreamQuery(cudaStream_t stream);
LB_API cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
LB_API cudaError_t cudaStreamIsCapturing(cudaStream_t stream,
                                         enum cudaStreamCaptureStatus *pCaptureStatus);
LB_API cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
LB_API cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph);
LB_API cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode);
LB_API cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData);
LB_API cudaError_t cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph,
                                        unsigned long long flags);
LB_API cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
LB_API cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec);
LB_API cudaError_t cudaGraphDestroy(cudaGraph_t graph);
LB_API cudaError_t cudaEventCreate(cudaEvent_t *event);
LB_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
LB_API cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
LB_API cudaError_t cudaEventQuery(cudaEvent_t event);
LB_API cudaError_t cudaEventSynchronize(cudaEvent_t event);
LB_API cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
LB_API cudaError_t cudaEventDestroy(cudaEvent_t event);
LB_API cudaError_t cudaMalloc(void **devPtr, size_t size);
LB_API cudaError_t cudaFree(void *devPtr);
LB_API cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
LB_API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                   enum cudaMemcpyKind kind, cudaStream_t stream);
LB_API cudaError_t cudaMemset(void *devPtr, int value, size_t count);
LB_API cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream);
LB_API cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes,
                                            const void *ptr);
LB_API cudaError_t cudaRuntimeGetVersion(int *runtimeVersion);
LB_API cudaError_t cudaDriverGetVersion(int *driverVersion);
LB_API const char *cudaGetErrorName(cudaError_t error);
LB_API const char *cudaGetErrorString(cudaError_t error);
LB_API cudaError_t cudaGetLastError(void);
LB_API cudaError_t cudaPeekAtLastError(void);
#undef LB_API

#endif /* LB_USE_REAL_HEADERS */

/* The layout pynccl's ctypes structure assumes (x86-64 / aarch64 LP64). */
_Static_assert(sizeof(struct cudaPointerAttributes) == 88, "cudaPointerAttributes size");
_Static_assert(offsetof(struct cudaPointerAttributes, device) == 4, "device offset");
_Static_assert(offsetof(struct cudaPointerAttributes, devicePointer) == 8, "devicePointer offset");
_Static_assert(offsetof(struct cudaPointerAttributes, hostPointer) == 16, "hostPointer offset");

/* Loopback extra (not in CUDA): a thread-local sentence explaining the calling
 * thread's most recent error from the loopback cudart ("" if none). */
LB_EXPORT const char *pynccl_lb_last_error_detail(void);

#endif /* PYNCCL_LB_CUDA_H */
