"""The libcudart prototype table: the few CUDA runtime calls pynccl needs.

Signatures are those of cuda_runtime_api.h in CUDA 12 and 13 (the "first"
field is the CUDA runtime release: every entry here exists since 12.0).
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_float, c_int, c_size_t, c_uint, c_ulonglong, c_void_p

from ..errors import CudaError
from ._binding import BoundLibrary, Prototype
from .structs import cudaPointerAttributes

TYPE_CHECKING = False  # `typing` costs milliseconds to import
if TYPE_CHECKING:
    from typing import Any

__all__ = ["CUDART_PROTOTYPES", "CudartLibrary", "cudaError_t"]

cudaError_t = c_int
cudaStream_t = c_void_p
cudaEvent_t = c_void_p
cudaGraph_t = c_void_p
cudaGraphExec_t = c_void_p
#: ``void (*cudaHostFn_t)(void *userData)``: pass a ``ctypes.CFUNCTYPE(None, c_void_p)``
#: object (kept alive until the function has run) or its address.
cudaHostFn_t = c_void_p

#: cudaErrorNotReady: not an error for the Query functions.
cudaErrorNotReady = 600
_QUERIES = frozenset({"cudaStreamQuery", "cudaEventQuery"})

_P = Prototype
_R = (12, 0, 0)
_I = POINTER(c_int)

CUDART_PROTOTYPES: dict[str, Prototype] = {
    # cudaError_t cudaGetDeviceCount(int *count);
    "cudaGetDeviceCount": _P(_R, cudaError_t, (("count", _I),)),
    # cudaError_t cudaGetDevice(int *device);
    "cudaGetDevice": _P(_R, cudaError_t, (("device", _I),)),
    # cudaError_t cudaSetDevice(int device);
    "cudaSetDevice": _P(_R, cudaError_t, (("device", c_int),)),
    # cudaError_t cudaDeviceSynchronize(void);
    "cudaDeviceSynchronize": _P(_R, cudaError_t, ()),
    # cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device);
    "cudaDeviceGetPCIBusId": _P(
        _R, cudaError_t, (("pciBusId", c_char_p), ("len", c_int), ("device", c_int))
    ),
    # cudaError_t cudaStreamCreate(cudaStream_t *pStream);
    "cudaStreamCreate": _P(_R, cudaError_t, (("pStream", POINTER(cudaStream_t)),)),
    # cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags);
    "cudaStreamCreateWithFlags": _P(
        _R, cudaError_t, (("pStream", POINTER(cudaStream_t)), ("flags", c_uint))
    ),
    # cudaError_t cudaStreamDestroy(cudaStream_t stream);
    "cudaStreamDestroy": _P(_R, cudaError_t, (("stream", cudaStream_t),)),
    # cudaError_t cudaStreamSynchronize(cudaStream_t stream);
    "cudaStreamSynchronize": _P(_R, cudaError_t, (("stream", cudaStream_t),)),
    # cudaError_t cudaStreamQuery(cudaStream_t stream);
    "cudaStreamQuery": _P(_R, cudaError_t, (("stream", cudaStream_t),)),
    # cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
    "cudaStreamWaitEvent": _P(
        _R, cudaError_t, (("stream", cudaStream_t), ("event", cudaEvent_t), ("flags", c_uint))
    ),
    # cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *pCaptureStatus);
    "cudaStreamIsCapturing": _P(
        _R, cudaError_t, (("stream", cudaStream_t), ("pCaptureStatus", _I))
    ),
    # cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
    "cudaStreamBeginCapture": _P(_R, cudaError_t, (("stream", cudaStream_t), ("mode", c_int))),
    # cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph);
    "cudaStreamEndCapture": _P(
        _R, cudaError_t, (("stream", cudaStream_t), ("pGraph", POINTER(cudaGraph_t)))
    ),
    # cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode);
    "cudaThreadExchangeStreamCaptureMode": _P(_R, cudaError_t, (("mode", _I),)),
    # cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData);
    "cudaLaunchHostFunc": _P(
        _R,
        cudaError_t,
        (("stream", cudaStream_t), ("fn", cudaHostFn_t), ("userData", c_void_p)),
    ),
    # cudaError_t cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph, unsigned long long flags);
    "cudaGraphInstantiate": _P(
        _R,
        cudaError_t,
        (("pGraphExec", POINTER(cudaGraphExec_t)), ("graph", cudaGraph_t), ("flags", c_ulonglong)),
    ),
    # cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
    "cudaGraphLaunch": _P(
        _R, cudaError_t, (("graphExec", cudaGraphExec_t), ("stream", cudaStream_t))
    ),
    # cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec);
    "cudaGraphExecDestroy": _P(_R, cudaError_t, (("graphExec", cudaGraphExec_t),)),
    # cudaError_t cudaGraphDestroy(cudaGraph_t graph);
    "cudaGraphDestroy": _P(_R, cudaError_t, (("graph", cudaGraph_t),)),
    # cudaError_t cudaEventCreate(cudaEvent_t *event);
    "cudaEventCreate": _P(_R, cudaError_t, (("event", POINTER(cudaEvent_t)),)),
    # cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
    "cudaEventCreateWithFlags": _P(
        _R, cudaError_t, (("event", POINTER(cudaEvent_t)), ("flags", c_uint))
    ),
    # cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
    "cudaEventRecord": _P(_R, cudaError_t, (("event", cudaEvent_t), ("stream", cudaStream_t))),
    # cudaError_t cudaEventQuery(cudaEvent_t event);
    "cudaEventQuery": _P(_R, cudaError_t, (("event", cudaEvent_t),)),
    # cudaError_t cudaEventSynchronize(cudaEvent_t event);
    "cudaEventSynchronize": _P(_R, cudaError_t, (("event", cudaEvent_t),)),
    # cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
    "cudaEventElapsedTime": _P(
        _R, cudaError_t, (("ms", POINTER(c_float)), ("start", cudaEvent_t), ("end", cudaEvent_t))
    ),
    # cudaError_t cudaEventDestroy(cudaEvent_t event);
    "cudaEventDestroy": _P(_R, cudaError_t, (("event", cudaEvent_t),)),
    # cudaError_t cudaMalloc(void **devPtr, size_t size);
    "cudaMalloc": _P(_R, cudaError_t, (("devPtr", POINTER(c_void_p)), ("size", c_size_t))),
    # cudaError_t cudaFree(void *devPtr);
    "cudaFree": _P(_R, cudaError_t, (("devPtr", c_void_p),)),
    # cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
    "cudaMemcpy": _P(
        _R,
        cudaError_t,
        (("dst", c_void_p), ("src", c_void_p), ("count", c_size_t), ("kind", c_int)),
    ),
    # cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream);
    "cudaMemcpyAsync": _P(
        _R,
        cudaError_t,
        (
            ("dst", c_void_p),
            ("src", c_void_p),
            ("count", c_size_t),
            ("kind", c_int),
            ("stream", cudaStream_t),
        ),
    ),
    # cudaError_t cudaMemset(void *devPtr, int value, size_t count);
    "cudaMemset": _P(
        _R, cudaError_t, (("devPtr", c_void_p), ("value", c_int), ("count", c_size_t))
    ),
    # cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream);
    "cudaMemsetAsync": _P(
        _R,
        cudaError_t,
        (("devPtr", c_void_p), ("value", c_int), ("count", c_size_t), ("stream", cudaStream_t)),
    ),
    # cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr);
    "cudaPointerGetAttributes": _P(
        _R, cudaError_t, (("attributes", POINTER(cudaPointerAttributes)), ("ptr", c_void_p))
    ),
    # cudaError_t cudaRuntimeGetVersion(int *runtimeVersion);
    "cudaRuntimeGetVersion": _P(_R, cudaError_t, (("runtimeVersion", _I),)),
    # cudaError_t cudaDriverGetVersion(int *driverVersion);
    "cudaDriverGetVersion": _P(_R, cudaError_t, (("driverVersion", _I),)),
    # const char* cudaGetErrorName(cudaError_t error);
    "cudaGetErrorName": _P(_R, c_char_p, (("error", cudaError_t),)),
    # const char* cudaGetErrorString(cudaError_t error);
    "cudaGetErrorString": _P(_R, c_char_p, (("error", cudaError_t),)),
    # cudaError_t cudaGetLastError(void);
    "cudaGetLastError": _P(_R, cudaError_t, ()),
    # cudaError_t cudaPeekAtLastError(void);
    "cudaPeekAtLastError": _P(_R, cudaError_t, ()),
}


class CudartLibrary(BoundLibrary):
    """A loaded libcudart: functions by their C names, raising :class:`~pynccl.CudaError`.

    Checked calls return 0; ``cudaStreamQuery`` / ``cudaEventQuery`` return 600
    (``cudaErrorNotReady``) instead of raising while work is pending.
    """

    PROTOTYPES = CUDART_PROTOTYPES
    OK = 0
    KIND = "CUDA runtime"

    def __repr__(self) -> str:
        return f"<CudartLibrary from {self.path!r} ({self.rule})>"

    def error_name(self, code: int) -> str:
        """``cudaGetErrorName(code)``."""
        text = self.raw("cudaGetErrorName")(code)
        return "" if text is None else str(text.decode("utf-8", "replace"))

    def error_string(self, code: int) -> str:
        """``cudaGetErrorString(code)``."""
        text = self.raw("cudaGetErrorString")(code)
        return "" if text is None else str(text.decode("utf-8", "replace"))

    def make_error(self, code: int, function: str) -> CudaError:
        """The :class:`CudaError` for ``code`` from ``function``, with CUDA's name and text.

        The loopback libcudart also explains its last error in a sentence; it is appended.
        """
        text = self.error_string(code)
        detail = self._detail()
        if detail:
            text = f"{text} ({detail})"
        return CudaError(code, function, self.error_name(code), text)

    def _detail(self) -> str:
        try:
            fn = self.__dict__["_detail_fn"]
        except KeyError:
            fn = getattr(self._cdll, "pynccl_lb_last_error_detail", None)
            if fn is not None:
                fn.restype, fn.argtypes = c_char_p, []
            self.__dict__["_detail_fn"] = fn
        if fn is None:
            return ""
        text = fn()
        return "" if not text else str(text.decode("utf-8", "replace"))

    def _fail(self, code: int, function: str) -> Any:
        if code == cudaErrorNotReady and function in _QUERIES:
            return code
        # Clear the sticky-free "last error" so a later cudaGetLastError is not stale.
        self.raw("cudaGetLastError")()
        raise self.make_error(code, function)

    def runtime_version(self) -> int:
        """``cudaRuntimeGetVersion`` (e.g. 13000)."""
        value = c_int(0)
        self.cudaRuntimeGetVersion(ctypes.byref(value))
        return value.value
