"""NCCL memory as CuPy's allocator: :func:`cupy_allocator`.

CuPy calls an allocator with a size in bytes and takes a ``cupy.cuda.MemoryPointer`` back
(``cupy.cuda.set_allocator(alloc)``, or ``cupy.cuda.MemoryPool(alloc)`` for CuPy's pool on
top). Each allocation here is ``ncclMemAlloc`` memory held by a
:class:`~pynccl.cuda.DeviceBuffer`, handed to CuPy as ``cupy.cuda.UnownedMemory`` whose
owner is that buffer: when CuPy drops the memory (the last array over it, or the pool's
``free_all_blocks``), the buffer goes with it and ``ncclMemFree`` runs, on pynccl's
reaper thread (a finalizer never waits for a device: see ``pynccl.cuda._buffer``).
Pure Python: CuPy is imported only when the allocator is first called.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .._limits import check_count

__all__ = ["cupy_allocator"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from ..comm import Communicator


def cupy_allocator(comm: Communicator) -> Callable[[int], Any]:
    """An allocator for ``cupy.cuda.set_allocator`` or ``cupy.cuda.MemoryPool`` whose
    memory comes from ``ncclMemAlloc`` (NCCL >= 2.19) on ``comm``'s device, freed with
    ``ncclMemFree`` once CuPy drops it.

    Such memory can be registered as a window (``comm.register_window(ptr, nbytes=...)``):
    NCCL windows need ``ncclMemAlloc`` or VMM memory. The allocator refuses a call made
    while another device is current (CuPy allocates for its current device: use
    ``with cupy.cuda.Device(comm.device):``), and a communicator that is not usable
    (destroyed, aborted). Zero bytes give an empty pointer and allocate nothing, as
    CuPy's own allocator does.
    """
    from ..comm import Communicator

    if not isinstance(comm, Communicator):
        raise TypeError(
            f"cupy_allocator(comm): comm must be a pynccl.Communicator, got {type(comm).__name__}"
        )
    device = comm.device

    def allocate(size: int) -> Any:
        cupy = import_module("cupy")
        n = check_count(size, "size")
        _check_current(device)
        if n == 0:
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
        buf = comm.mem_alloc(n, "uint8")
        try:
            mem = cupy.cuda.UnownedMemory(buf.ptr, n, buf, device)
            return cupy.cuda.MemoryPointer(mem, 0)
        except BaseException:
            buf.close()
            raise

    allocate.__qualname__ = allocate.__name__ = "cupy_allocator.<nccl>"
    return allocate


def _check_current(device: int) -> None:
    """CuPy asks for memory of its current device: it must be the communicator's."""
    from ..cuda import get_device

    current = get_device()
    if current != device:
        raise ValueError(
            f"cupy_allocator: the current device is {current}, but the communicator's "
            f"device is {device}; allocate under `with cupy.cuda.Device({device}):`"
        )
