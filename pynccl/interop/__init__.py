"""pynccl inside other people's programs: joining vLLM's NCCL groups, and NCCL memory as the
allocator of CuPy, cuda.core and torch.

Nothing here imports those libraries until a function that serves one of them is called;
each works on the loopback libraries as on a GPU.

- :func:`cupy_allocator` — ``cupy.cuda.set_allocator(cupy_allocator(comm))`` or
  ``cupy.cuda.MemoryPool(cupy_allocator(comm))``: pure Python.
- :class:`NcclMemoryResource` — a cuda.core ``MemoryResource`` (built on first access,
  as a subclass of cuda.core's own).
- :func:`torch_mem_pool` — a ``torch.cuda.MemPool`` over torch's own NCCL allocator
  (``group=`` a torch NCCL process group) or over :func:`torch_allocator_shim`, a C shim
  built with the system compiler.

Every allocation is ``ncclMemAlloc`` memory on the communicator's device, which
``comm.register_window`` accepts, freed with ``ncclMemFree`` when the library drops it.
"""

from __future__ import annotations

from typing import Any

from ._cupy import cupy_allocator
from ._torch import torch_allocator_shim, torch_mem_pool

__all__ = ["NcclMemoryResource", "cupy_allocator", "torch_allocator_shim", "torch_mem_pool"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    NcclMemoryResource: type


def __getattr__(name: str) -> Any:
    if name == "NcclMemoryResource":  # a subclass of cuda.core's class: made on first use
        from ._cudacore import memory_resource_class

        return memory_resource_class()
    raise AttributeError(f"module 'pynccl.interop' has no attribute {name!r}")
