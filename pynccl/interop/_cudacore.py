"""NCCL memory as a cuda.core memory resource: :class:`NcclMemoryResource`.

cuda.core's ``MemoryResource`` is an abstract base that its ``Buffer`` calls back: a
``Buffer`` made by :meth:`allocate` owns its pointer and calls :meth:`deallocate` when it
is closed or collected. The class subclasses cuda.core's own ``MemoryResource``, so it is
built the first time it is asked for (``pynccl.interop.NcclMemoryResource``), when
cuda.core is imported; nothing imports cuda.core before that.

Each allocation is ``ncclMemAlloc`` memory held by a :class:`~pynccl.cuda.DeviceBuffer`
(``comm.mem_alloc``) that the resource keeps until :meth:`deallocate` frees it with
``ncclMemFree``. ``ncclMemFree`` is not stream-ordered, so :meth:`deallocate` first waits
for the stream it is given: the work cuda.core ordered before the deallocation has run.
cuda.core's ``Buffer`` needs a CUDA driver to be made for device memory (it records a
stream for its deallocation): without one, :meth:`allocate` frees what it allocated and
raises cuda.core's error.
"""

from __future__ import annotations

import threading
from importlib import import_module
from typing import Any

from .._limits import check_count

__all__ = ["memory_resource_class"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..comm import Communicator
    from ..cuda import DeviceBuffer

_CLASS: list[type] = []
_LOCK = threading.Lock()


def memory_resource_class() -> type:
    """``NcclMemoryResource``: made once, on first use, as a subclass of cuda.core's
    ``MemoryResource`` (``cuda.core``, or ``cuda.core.experimental`` before cuda-core 0.4)."""
    with _LOCK:
        if not _CLASS:
            _CLASS.append(_make_class(_cuda_core()))
        return _CLASS[0]


def _cuda_core() -> Any:
    try:
        core = import_module("cuda.core")
        if hasattr(core, "MemoryResource"):
            return core
    except ImportError:
        pass
    try:
        experimental = import_module("cuda.core.experimental")
    except ImportError as exc:
        raise ImportError(
            "NcclMemoryResource needs cuda.core (`pip install cuda-core`), which is not "
            f"installed: {exc}"
        ) from exc
    return experimental


def _make_class(core: Any) -> type:
    base: type = core.MemoryResource
    buffer_type: Any = core.Buffer

    class NcclMemoryResource(base):  # type: ignore[misc]
        """A cuda.core ``MemoryResource`` over ``ncclMemAlloc`` / ``ncclMemFree`` (NCCL
        >= 2.19) on ``comm``'s device: ``Device(comm.device).memory_resource`` aside,
        hand it to code that takes a resource, or call :meth:`allocate`. Its buffers
        can be registered as windows (``comm.register_window(int(buf.handle),
        nbytes=buf.size)``)."""

        def __init__(self, comm: Communicator) -> None:
            from ..comm import Communicator

            if not isinstance(comm, Communicator):
                raise TypeError(
                    "NcclMemoryResource(comm): comm must be a pynccl.Communicator, "
                    f"got {type(comm).__name__}"
                )
            self._comm = comm
            self._device = comm.device
            self._live: dict[int, DeviceBuffer] = {}
            self._lock = threading.Lock()

        def allocate(self, size: int, *, stream: Any = None) -> Any:
            """``size`` bytes of ``ncclMemAlloc`` memory (NCCL >= 2.19) as a cuda.core
            ``Buffer`` that owns it (its close, or its collection, calls :meth:`deallocate`).
            Zero bytes allocate nothing: an empty buffer at address 0, as cuda.core's own
            resources give."""
            n = check_count(size, "size")
            if n == 0:  # nothing allocated, as cuda.core's own resources: every one is at 0
                return buffer_type.from_handle(0, 0, mr=self, stream=stream)
            buf = self._comm.mem_alloc(n, "uint8")
            with self._lock:
                self._live[buf.ptr] = buf
            try:
                return buffer_type.from_handle(buf.ptr, n, mr=self, stream=stream)
            except BaseException:
                with self._lock:
                    self._live.pop(buf.ptr, None)
                buf.close()
                raise

        def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
            """Free what :meth:`allocate` returned at ``ptr`` (``ncclMemFree``, NCCL >= 2.19),
            once the work queued on ``stream`` before this call has run."""
            p = int(ptr)
            if p == 0 and size == 0:  # an empty buffer of allocate(0): nothing to free
                return
            with self._lock:
                buf = self._live.pop(p, None)
            if buf is None:
                raise ValueError(
                    f"NcclMemoryResource.deallocate: ptr={p:#x} was not allocated by this "
                    "resource, or was freed already"
                )
            if buf.nbytes != size:
                with self._lock:
                    self._live[p] = buf
                raise ValueError(
                    f"NcclMemoryResource.deallocate: size={size} but ptr={p:#x} holds "
                    f"{buf.nbytes} bytes"
                )
            if stream is not None:
                from .. import library
                from ..cuda import stream_handle

                try:
                    library.cudart().cudaStreamSynchronize(stream_handle(stream))
                except BaseException:  # not freed: still this resource's, to deallocate again
                    with self._lock:
                        self._live[p] = buf
                    raise
            buf.close()

        @property
        def is_device_accessible(self) -> bool:
            """True: ``ncclMemAlloc`` memory (NCCL >= 2.19) is device memory."""
            return True

        @property
        def is_host_accessible(self) -> bool:
            """False: ``ncclMemAlloc`` memory (NCCL >= 2.19) is not host memory."""
            return False

        @property
        def is_managed(self) -> bool:
            """False: not CUDA managed memory."""
            return False

        @property
        def device_id(self) -> int:
            """The communicator's device."""
            return self._device

        @property
        def live_allocations(self) -> int:
            """How many allocations are not deallocated yet."""
            return len(self._live)

        def __repr__(self) -> str:
            return (
                f"<pynccl.interop.NcclMemoryResource device={self._device} "
                f"live={len(self._live)}>"
            )

    NcclMemoryResource.__module__ = "pynccl.interop"
    return NcclMemoryResource
