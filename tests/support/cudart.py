"""The loopback libcudart driven through ctypes directly: what its test modules share.

Error codes and enums as in ``cuda_runtime_api.h`` / ``driver_types.h``, one prototype table
(:func:`bind`), small checked wrappers (``ok(rt, rc)`` asserts success and shows the
loopback's own detail of the failure), a fixture that leaves each test's thread state as
it found it, and :class:`StreamGate`: a host task that holds its stream busy until opened,
so that "work is still pending" states are reached deterministically, never by a race
(:class:`Hold`: one on a stream of the libcudart pynccl loaded).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_size_t, c_uint, c_void_p
from typing import Any, Self, TypeVar

import numpy as np
import pytest

# cudaError_t
SUCCESS = 0
INVALID_VALUE = 1
INITIALIZATION_ERROR = 3
INVALID_DEVICE_POINTER = 17
INVALID_MEMCPY_DIRECTION = 21
NO_DEVICE = 100
INVALID_DEVICE = 101
INVALID_RESOURCE_HANDLE = 400
ILLEGAL_STATE = 401
NOT_READY = 600
NOT_PERMITTED = 800
NOT_SUPPORTED = 801
CAPTURE_UNSUPPORTED = 900
CAPTURE_INVALIDATED = 901
CAPTURE_MERGE = 902
CAPTURE_UNMATCHED = 903
CAPTURE_UNJOINED = 904
CAPTURE_ISOLATION = 905
CAPTURE_IMPLICIT = 906
CAPTURED_EVENT = 907
CAPTURE_WRONG_THREAD = 908
GLOBAL, THREAD_LOCAL, RELAXED = range(3)  # cudaStreamCaptureMode
NONE, ACTIVE, INVALIDATED = range(3)  # cudaStreamCaptureStatus
H2H, H2D, D2H, D2D, DEFAULT = range(5)  # cudaMemcpyKind
NON_BLOCKING = 1  # cudaStreamNonBlocking
LEGACY = c_void_p(1)  # cudaStreamLegacy
PER_THREAD = c_void_p(2)  # cudaStreamPerThread
HOST_FN = ctypes.CFUNCTYPE(None, c_void_p)  # cudaHostFn_t, also the loopback's task hook


class PointerAttributes(ctypes.Structure):
    _fields_ = [
        ("type", c_int),
        ("device", c_int),
        ("devicePointer", c_void_p),
        ("hostPointer", c_void_p),
        ("reserved", ctypes.c_long * 8),
    ]


SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "cudaGetDeviceCount": (c_int, [POINTER(c_int)]),
    "cudaGetDevice": (c_int, [POINTER(c_int)]),
    "cudaSetDevice": (c_int, [c_int]),
    "cudaDeviceSynchronize": (c_int, []),
    "cudaDeviceGetPCIBusId": (c_int, [c_char_p, c_int, c_int]),
    "cudaStreamCreate": (c_int, [POINTER(c_void_p)]),
    "cudaStreamCreateWithFlags": (c_int, [POINTER(c_void_p), c_uint]),
    "cudaStreamDestroy": (c_int, [c_void_p]),
    "cudaStreamSynchronize": (c_int, [c_void_p]),
    "cudaStreamQuery": (c_int, [c_void_p]),
    "cudaStreamWaitEvent": (c_int, [c_void_p, c_void_p, c_uint]),
    "cudaStreamIsCapturing": (c_int, [c_void_p, POINTER(c_int)]),
    "cudaStreamBeginCapture": (c_int, [c_void_p, c_int]),
    "cudaStreamEndCapture": (c_int, [c_void_p, POINTER(c_void_p)]),
    "cudaThreadExchangeStreamCaptureMode": (c_int, [POINTER(c_int)]),
    "cudaLaunchHostFunc": (c_int, [c_void_p, c_void_p, c_void_p]),
    "cudaGraphInstantiate": (c_int, [POINTER(c_void_p), c_void_p, ctypes.c_ulonglong]),
    "cudaGraphLaunch": (c_int, [c_void_p, c_void_p]),
    "cudaGraphExecDestroy": (c_int, [c_void_p]),
    "cudaGraphDestroy": (c_int, [c_void_p]),
    "cudaEventCreate": (c_int, [POINTER(c_void_p)]),
    "cudaEventCreateWithFlags": (c_int, [POINTER(c_void_p), c_uint]),
    "cudaEventRecord": (c_int, [c_void_p, c_void_p]),
    "cudaEventQuery": (c_int, [c_void_p]),
    "cudaEventSynchronize": (c_int, [c_void_p]),
    "cudaEventElapsedTime": (c_int, [POINTER(c_float), c_void_p, c_void_p]),
    "cudaEventDestroy": (c_int, [c_void_p]),
    "cudaMalloc": (c_int, [POINTER(c_void_p), c_size_t]),
    "cudaFree": (c_int, [c_void_p]),
    "cudaMemcpy": (c_int, [c_void_p, c_void_p, c_size_t, c_int]),
    "cudaMemcpyAsync": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_void_p]),
    "cudaMemset": (c_int, [c_void_p, c_int, c_size_t]),
    "cudaMemsetAsync": (c_int, [c_void_p, c_int, c_size_t, c_void_p]),
    "cudaPointerGetAttributes": (c_int, [POINTER(PointerAttributes), c_void_p]),
    "cudaRuntimeGetVersion": (c_int, [POINTER(c_int)]),
    "cudaDriverGetVersion": (c_int, [POINTER(c_int)]),
    "cudaGetErrorName": (c_char_p, [c_int]),
    "cudaGetErrorString": (c_char_p, [c_int]),
    "cudaGetLastError": (c_int, []),
    "cudaPeekAtLastError": (c_int, []),
    "pynccl_lb_last_error_detail": (c_char_p, []),
    "pynccl_lb_stream_enqueue": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p]),
    "pynccl_lb_stream_enqueue2": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int]),
    "pynccl_lb_stream_capturing": (c_int, [c_void_p]),
    "pynccl_lb_stream_device": (c_int, [c_void_p]),
    "pynccl_lb_find_alloc": (c_int, [c_void_p, c_size_t, POINTER(c_int)]),
    "pynccl_lb_current_device": (c_int, []),
    "pynccl_lb_device_count": (c_int, []),
    "pynccl_lb_device_physical": (c_int, [c_int]),
    "pynccl_lb_malloc": (c_int, [POINTER(c_void_p), c_size_t, c_int]),
    "pynccl_lb_free": (c_int, [c_void_p]),
    "pynccl_lb_register_foreign_range": (c_int, [c_void_p, c_size_t, c_int]),
    "pynccl_lb_unregister_foreign_range": (c_int, [c_void_p]),
}


def bind(path: str) -> ctypes.CDLL:
    """The loopback libcudart at ``path``, every function of :data:`SIGNATURES` typed."""
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@pytest.fixture(scope="module", name="cudart_path")
def built_cudart_path() -> str:
    """``cudart_path``: the loopback libcudart built on its own (skips without a compiler;
    a module takes it by importing it)."""
    from pynccl.testing import loopback

    try:
        return loopback.build_cudart()
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"cannot build the loopback cudart: {exc}")


@pytest.fixture(scope="module", name="rt")
def standalone_rt(cudart_path: str) -> ctypes.CDLL:
    """``rt``: the loopback libcudart of :func:`cudart_path`, bound (a module takes it by
    importing it)."""
    return bind(cudart_path)


@pytest.fixture(scope="module", name="rt")
def linked_rt(build: Any) -> ctypes.CDLL:
    """``rt``: the cudart that the loopback libnccl of ``build`` (support.clib_fixtures) links, one
    instance (a module takes it by importing it)."""
    return bind(build.cudart)


@pytest.fixture(autouse=True)
def clean_thread_state(rt: ctypes.CDLL) -> Iterator[None]:
    """No last error and device 0 before and after each test (a module takes it by
    importing it, with its own ``rt`` fixture)."""
    rt.cudaGetLastError()
    rt.cudaSetDevice(0)
    yield
    rt.cudaSetDevice(0)
    rt.cudaGetLastError()


def ok(rt: ctypes.CDLL, rc: int) -> None:
    assert rc == SUCCESS, f"error {rc}: {rt.pynccl_lb_last_error_detail().decode()}"


def detail(rt: ctypes.CDLL) -> str:
    """The loopback's own words on this thread's last failure."""
    return str(rt.pynccl_lb_last_error_detail().decode())


def ndev(rt: ctypes.CDLL) -> int:
    """How many devices the loopback shows."""
    n = c_int()
    ok(rt, rt.cudaGetDeviceCount(byref(n)))
    return n.value


def malloc(rt: ctypes.CDLL, size: int) -> int:
    p = c_void_p()
    ok(rt, rt.cudaMalloc(byref(p), size))
    assert p.value is not None
    return p.value


def stream(rt: ctypes.CDLL, flags: int = 0) -> int:
    s = c_void_p()
    ok(rt, rt.cudaStreamCreateWithFlags(byref(s), flags))
    assert s.value is not None
    return s.value


def event(rt: ctypes.CDLL, flags: int = 0) -> int:
    e = c_void_p()
    ok(rt, rt.cudaEventCreateWithFlags(byref(e), flags))
    assert e.value is not None
    return e.value


def read(rt: ctypes.CDLL, ptr: int, n: int) -> np.ndarray:
    """``n`` bytes at device address ``ptr``, copied to the host by cudaMemcpy."""
    out = np.empty(n, np.uint8)
    ok(rt, rt.cudaMemcpy(out.ctypes.data, ptr, n, D2H))
    return out


def filled(rt: ctypes.CDLL, value: int, n: int) -> int:
    """A new allocation of ``n`` bytes holding ``value`` in every byte, landed."""
    p = malloc(rt, n)
    ok(rt, rt.cudaMemset(p, value, n))
    ok(rt, rt.cudaStreamSynchronize(None))
    return p


def capture_status(rt: ctypes.CDLL, s: object) -> int:
    status = c_int(-1)
    ok(rt, rt.cudaStreamIsCapturing(s, byref(status)))
    return status.value


def end_capture(rt: ctypes.CDLL, s: object) -> tuple[int, int | None]:
    """(cudaStreamEndCapture's result, the graph); the graph starts as a dummy value, so a
    failure that leaves it unwritten shows (CUDA sets it to NULL)."""
    graph = c_void_p(1234)
    rc = rt.cudaStreamEndCapture(s, byref(graph))
    return rc, graph.value


_KEEP: list[object] = []  # host functions must outlive the tasks that call them

_F = TypeVar("_F")


def keep(fn: _F) -> _F:
    """``fn`` (a ctypes callback), kept alive for the rest of the process."""
    _KEEP.append(fn)
    return fn


class StreamGate:
    """A host task holding its stream busy from construction until :meth:`open` (or the
    end of a ``with`` block). ``launch`` enqueues the task's C function on the stream;
    the wait is bounded by ``bound`` seconds, so that a failing test cannot hang the
    suite; ``ran_out`` says the bound passed before the gate was opened."""

    def __init__(self, launch: Callable[[Any], None], bound: float = 60.0) -> None:
        self.started = threading.Event()
        self.opened = threading.Event()
        self.ran_out = False

        def run(_arg: int | None) -> None:
            self.started.set()
            self.ran_out = not self.opened.wait(bound)

        self.fn = keep(HOST_FN(run))
        launch(self.fn)

    def open(self) -> None:
        self.opened.set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()


class HostGate(StreamGate):
    """A gate launched by ``cudaLaunchHostFunc`` on ``s`` (None: the legacy stream)."""

    def __init__(self, rt: ctypes.CDLL, s: object) -> None:
        super().__init__(lambda fn: ok(rt, rt.cudaLaunchHostFunc(s, fn, None)))


class TaskGate(StreamGate):
    """A gate enqueued on ``s`` through the loopback's own task hook
    (``pynccl_lb_stream_enqueue``)."""

    def __init__(self, rt: ctypes.CDLL, s: object) -> None:
        super().__init__(
            lambda fn: ok(rt, rt.pynccl_lb_stream_enqueue(s, ctypes.cast(fn, c_void_p), None, None))
        )


class Hold(StreamGate):
    """Holds ``stream`` (a handle; 0: the legacy default stream of the current device) of
    the libcudart pynccl loaded busy from construction until :meth:`release` or the end of
    the ``with`` block: a host function that blocks its stream (``cudaLaunchHostFunc``,
    or the loopback's own task hook where the loopback predates it). Bounded by
    ``seconds``, so that a failing test cannot hang the suite: a hold that ran out
    (something waited for the held stream) fails the test on exit."""

    def __init__(self, stream: int = 0, seconds: float = 10.0) -> None:
        from pynccl.library import cudart

        lib: Any = cudart()._cdll

        def launch(fn: Any) -> None:
            try:
                rc = lib.cudaLaunchHostFunc(c_void_p(stream), fn, None)
            except AttributeError:
                rc = lib.pynccl_lb_stream_enqueue(c_void_p(stream), fn, None, None)
            assert rc == 0, f"could not hold stream {stream:#x}: error {rc}"

        super().__init__(launch, bound=seconds)
        assert self.started.wait(10), "the holding task never started"

    def release(self) -> None:
        self.open()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        assert not self.ran_out, "the held stream was waited for while held"


def read_f32(ptr: int, n: int) -> np.ndarray:
    """``n`` float32 at device address ``ptr`` as they are now, without any stream order
    (the loopback's device memory is host memory): what a race would see."""
    return np.frombuffer(ctypes.string_at(ptr, 4 * n), np.float32).copy()


def live_events() -> int:
    """The events alive in the libcudart pynccl loaded (the loopback's counter)."""
    from pynccl.library import cudart

    lib: Any = cudart()._cdll
    lib.pynccl_lb_live_events.restype = ctypes.c_long
    return int(lib.pynccl_lb_live_events())
