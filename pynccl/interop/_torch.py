"""NCCL memory for torch: :func:`torch_mem_pool` and the allocator shim it may build.

The rule: a program that has a torch NCCL process group on the device passes it as
``group=`` and gets torch's own NCCL allocator (``ProcessGroupNCCL.mem_allocator``,
``ncclMemAlloc`` of torch's libnccl) in a ``torch.cuda.MemPool``. pynccl's communicators
are not torch process groups, so without one the pool's allocator is a
``torch.cuda.memory.CUDAPluggableAllocator`` over a small C shim
(``pynccl/interop/nccl_alloc.c``) that calls ``ncclMemAlloc`` / ``ncclMemFree`` of the
libnccl pynccl loaded. The shim is built with the system C compiler the way the loopback
libraries are (on first use, cached by source hash under the loopback's cache
directory): C only, no CUDA toolkit, no C++ toolchain, no torch headers. Either way the
memory is VMM memory that ``comm.register_window`` accepts.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

__all__ = ["torch_allocator_shim", "torch_mem_pool"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..comm import Communicator

SOURCE = Path(__file__).resolve().parent / "nccl_alloc.c"
#: The shim's allocation and free functions, as CUDAPluggableAllocator takes them.
ALLOC_FN = "pynccl_nccl_alloc"
FREE_FN = "pynccl_nccl_free"
#: As the loopback's: the shim is built on users' machines by whatever compiler they have,
#: where a warning a newer compiler (or CC's own flags) adds must not stop the build.
_WERROR = "-Werror=implicit-function-declaration"
_READY: dict[tuple[str, str, str], ctypes.CDLL] = {}
_LOCK = threading.Lock()


def torch_allocator_shim() -> str:
    """Build (or find cached) the allocator shim and point it at the libnccl and
    libcudart pynccl loaded; returns the shared library's path. Its functions are
    ``pynccl_nccl_alloc(ssize_t size, int device, cudaStream_t stream)`` and
    ``pynccl_nccl_free(void *ptr, ssize_t size, int device, cudaStream_t stream)``.
    Raises ``LoopbackBuildError`` without a C compiler, ``RuntimeError`` if the loaded
    libnccl has no ``ncclMemAlloc`` (NCCL < 2.19)."""
    from .. import library
    from ..testing.loopback._build import _compile

    nccl = library.lib()
    cudart = library.cudart()
    path = _compile(
        "torchshim",
        "pynccl torch allocator shim",
        "libpynccl_torch_shim.so",
        [SOURCE],
        [],
        ["-O2", "-shared", "-fPIC", "-std=gnu11", "-Wall", "-Wextra", _WERROR],
        ["-ldl"],
        {"shim": 1},
        SOURCE.parent,
    )
    key = (path, nccl.path, cudart.path)
    with _LOCK:
        if key not in _READY:
            shim = ctypes.CDLL(path)
            shim.pynccl_shim_init.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
            shim.pynccl_shim_init_error.restype = ctypes.c_char_p
            rc = shim.pynccl_shim_init(nccl.path.encode(), cudart.path.encode())
            if rc:
                why = (shim.pynccl_shim_init_error() or b"").decode(errors="replace")
                raise RuntimeError(f"the torch allocator shim ({path}) cannot start: {why}")
            _READY[key] = shim
    return path


def torch_mem_pool(comm: Communicator, *, group: Any = None) -> Any:
    """A ``torch.cuda.MemPool`` whose memory comes from ``ncclMemAlloc`` (NCCL >= 2.19)
    for ``comm``'s device: allocate under ``with torch.cuda.use_mem_pool(pool):`` with
    that device current (``torch.cuda.device(comm.device)``). Each allocation is made on
    the device torch asks for, the tensor's: the pool does not move it to ``comm``'s.

    ``group``: a torch process group with an NCCL backend on that device; then the pool
    uses torch's own NCCL allocator (its ``mem_allocator``). Without it, a
    ``CUDAPluggableAllocator`` over :func:`torch_allocator_shim`. Needs a torch built with
    CUDA (``RuntimeError`` otherwise, naming the torch found)."""
    from ..comm import Communicator

    if not isinstance(comm, Communicator):
        raise TypeError(
            f"torch_mem_pool(comm): comm must be a pynccl.Communicator, got {type(comm).__name__}"
        )
    import torch

    if not torch.cuda.is_available() or not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(
            f"torch_mem_pool needs a torch built with CUDA and a GPU; torch "
            f"{torch.__version__} has none (torch.cuda.is_available() is False)"
        )
    if group is not None:
        backend = group._get_backend(torch.device("cuda", comm.device))
        allocator = getattr(backend, "mem_allocator", None)
        if allocator is None:
            raise ValueError(
                f"torch_mem_pool: group's backend {type(backend).__name__} has no "
                "mem_allocator (torch's NCCL allocator); pass an NCCL process group, or "
                "no group for pynccl's shim"
            )
        return torch.cuda.MemPool(allocator)
    from torch.cuda.memory import CUDAPluggableAllocator

    path = torch_allocator_shim()
    allocator = CUDAPluggableAllocator(path, ALLOC_FN, FREE_FN).allocator()  # type: ignore[no-untyped-call]
    return torch.cuda.MemPool(allocator)
