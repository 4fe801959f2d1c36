"""A stream-ordered caching allocator for tests, made hostile to keep-alive bugs.

PyTorch's, CuPy's and cuda.core's allocators do not give freed memory back to CUDA:
a freed block returns to a pool *at once*, without waiting for the work queued on it,
and the next allocation of that size gets it straight away (safe for work ordered on
the allocation's stream, which is their contract). Code that hands a buffer to queued
work and then drops the last reference to it — a ``PersistentOp`` closed too early, a
reduction op's device scalar, a group's buffers — is fine under ``cudaFree`` (which
waits for the device) and wrong under these allocators: the memory is reused while the
GPU still reads or writes it.

:class:`CachingAllocator` reproduces that, and makes it visible: a freed block is
returned to the pool at once *and* its bytes are overwritten with a poison pattern
(``cudaMemsetAsync`` on a private non-blocking stream, which nothing orders after the
work still using the block, waited for before ``free`` returns). Work that was still to
read the block then reads the poison; work still to write it overwrites the next owner's
data. Either way a keep-alive bug shows as wrong data, deterministically, where a test
holds the consuming stream busy (or simply lets the work run later, as the loopback's
and a GPU's asynchronous streams do).

::

    with CachingAllocator(device=0) as pool:
        x = pool.from_numpy(np.arange(8, dtype=np.float32))
        op = comm.all_reduce_init(x)           # keeps x alive until op.close() ...
        op(); op.close(); del x                # ... and until its stream passed the work
        y = pool.empty(8, "float32")           # may be x's block: reused at once
        assert pool.reused == 1

Buffers (:class:`CachedBuffer`) export ``__cuda_array_interface__`` v3 with the
allocator's ``stream`` (the stream their producer work is ordered on; None for the
legacy default stream) and are accepted wherever pynccl takes an array.
"""

from __future__ import annotations

import threading
import weakref

from .._closable import Closable
from .._limits import check_c_int, check_extent
from ..cuda import DeviceBuffer, Stream
from ..cuda._buffer import _COMPLEX_TYPESTR, _TYPESTR, _element_type, _shape_of
from ..cuda._runtime import _rt
from ..cuda._streamlike import as_stream
from ..dtypes import complex_name, to_numpy_dtype
from ..enums import DataType

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    import numpy as np

    from ..typing import DeviceLike, DTypeLike, IndexLike, StreamLike

__all__ = ["CachedBuffer", "CachingAllocator"]

#: Block sizes are rounded up to this (torch rounds small blocks to 512 bytes too), so
#: allocations of nearby sizes share blocks, as in the real allocators.
ROUND = 512
_H2D = 1
_D2H = 2


class _Block:
    """One cudaMalloc'ed block of the pool (a byte DeviceBuffer)."""

    __slots__ = ("memory", "nbytes", "ptr")

    def __init__(self, nbytes: int, device: int) -> None:
        self.memory = DeviceBuffer(nbytes, DataType.UINT8, device)
        self.nbytes = nbytes
        self.ptr = self.memory.ptr


class CachingAllocator(Closable):
    """A pool of device blocks on ``device``, handed out and taken back at once.

    ``stream`` is the stream allocations are ordered on (as torch's current stream at
    allocation time; default: the legacy default stream): buffers report it as their
    ``__cuda_array_interface__`` ``stream`` and :meth:`CachedBuffer.to_numpy` copies on
    it. ``poison`` (a byte, default ``0xA5``: as a float32 ``-2.87e-16``, as an int32
    ``-1515870811``) is written over every freed block before it can be handed out again.

    :attr:`reused` counts allocations served from a freed block, :attr:`poisoned` the
    blocks poisoned. :meth:`close` (or the end of a ``with`` block) frees every block with
    ``cudaFree`` (which waits for the device); buffers still alive are marked freed.
    """

    __slots__ = (
        "__weakref__",
        "_blocks",
        "_closed",
        "_device",
        "_free",
        "_live",
        "_lock",
        "_poison",
        "_poison_stream",
        "_stream",
        "_stream_ref",
        "poisoned",
        "reused",
    )

    def __init__(
        self, device: DeviceLike | None = None, *, stream: StreamLike = None, poison: int = 0xA5
    ) -> None:
        from ..cuda import get_device

        self._closed = True  # until the pool's own stream exists
        self._poison = check_c_int(poison, "poison", 0, 255)
        self._device = get_device() if device is None else check_c_int(device, "device", 0)
        self._stream = as_stream(stream)
        self._stream_ref = None if stream is None or type(stream) is int else stream
        # Nothing is ever queued on this stream but poison: a memset there runs at once,
        # overtaking whatever other streams still have queued on the block.
        self._poison_stream = Stream(non_blocking=True, device=self._device)
        self._blocks: list[_Block] = []
        self._free: list[_Block] = []  # freed blocks, ready to be handed out again
        self._live: weakref.WeakSet[CachedBuffer] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.reused = 0
        self.poisoned = 0
        self._closed = False

    @property
    def device(self) -> int:
        """The device the blocks live on."""
        return self._device

    @property
    def stream(self) -> int:
        """The stream allocations are ordered on (a handle; 0: legacy default)."""
        return self._stream

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def empty(
        self, shape: IndexLike | Sequence[IndexLike], dtype: DTypeLike = DataType.FLOAT32
    ) -> CachedBuffer:
        """A buffer of ``shape`` and ``dtype`` (contents undefined: a reused block holds
        the poison) from the pool: the smallest free block that fits, else a new one."""
        if self._closed:
            raise ValueError("this CachingAllocator is closed")
        dims = _shape_of(shape)
        dt, lanes = _element_type(dtype)
        size = 1
        for d in dims:
            size *= d
        nbytes = check_extent(size, dt.itemsize * lanes, "buffer")
        need = max(ROUND, -(-nbytes // ROUND) * ROUND)
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= need]
            block = min(fits, key=lambda b: b.nbytes) if fits else None
            if block is not None:
                self._free.remove(block)
                self.reused += 1
        if block is None:
            block = _Block(need, self._device)
            with self._lock:
                self._blocks.append(block)
        buf = CachedBuffer(self, block, dims, dt, lanes, nbytes)
        self._live.add(buf)
        return buf

    def from_numpy(self, array: Any) -> CachedBuffer:
        """A buffer holding a copy of ``array`` (copied on :attr:`stream`, finished on
        return)."""
        import numpy as np

        arr = np.ascontiguousarray(array)
        buf = self.empty(arr.shape, arr.dtype)
        buf.copy_from(arr)
        return buf

    def _release(self, block: _Block) -> None:
        """``block`` is free: poisoned at once, then back in the pool (no wait for the
        work that may still use it: that is the point)."""
        if self._closed:
            return
        rt = _rt()
        handle = self._poison_stream.handle
        rt.cudaMemsetAsync(block.ptr, self._poison, block.nbytes, handle)
        rt.cudaStreamSynchronize(handle)
        with self._lock:
            self.poisoned += 1
            self._free.append(block)

    def close(self) -> None:
        """Free every block with ``cudaFree`` (idempotent; which waits for the device:
        release what holds a stream first); live buffers are marked freed."""
        if self._closed:
            return
        self._closed = True
        for buf in list(self._live):
            buf._block = None
        with self._lock:
            blocks, self._blocks, self._free = self._blocks, [], []
        for block in blocks:
            block.memory.close()
        self._poison_stream.close()
        self._stream_ref = None

    def _held(self) -> bool:
        return not getattr(self, "_closed", True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._blocks)} blocks"
        return f"<pynccl.testing.CachingAllocator device={self._device} {state}>"


class CachedBuffer(Closable):
    """A C-contiguous array in a :class:`CachingAllocator` block.

    Freed by :meth:`free` / :meth:`close`, at the end of a ``with`` block, or when the
    last reference goes: the block returns to the pool at once, poisoned."""

    __slots__ = ("__weakref__", "_block", "_dtype", "_lanes", "_nbytes", "_pool", "_shape")

    def __init__(
        self,
        pool: CachingAllocator,
        block: _Block,
        shape: tuple[int, ...],
        dtype: DataType,
        lanes: int,
        nbytes: int,
    ) -> None:
        self._pool = pool
        self._block: _Block | None = block
        self._shape = shape
        self._dtype = dtype
        self._lanes = lanes
        self._nbytes = nbytes

    @property
    def ptr(self) -> int:
        """The device address."""
        return self._live().ptr

    @property
    def nbytes(self) -> int:
        """Size in bytes (the block may be larger)."""
        return self._nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> DataType:
        """The element type (for a complex buffer, the float type of each half)."""
        return self._dtype

    @property
    def size(self) -> int:
        """Number of elements."""
        return self._nbytes // (self._dtype.itemsize * self._lanes) if self._nbytes else 0

    @property
    def closed(self) -> bool:
        return self._block is None

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        stream = self._pool.stream
        return {
            "shape": self._shape,
            "typestr": _COMPLEX_TYPESTR[self._dtype] if self._lanes == 2 else _TYPESTR[self._dtype],
            "data": (self._live().ptr, False),
            "strides": None,
            "version": 3,
            "stream": stream or 1,  # CUDA's 0 (legacy default) is the protocol's 1
        }

    def _live(self) -> _Block:
        block = self._block
        if block is None:
            raise ValueError("this CachedBuffer has been freed")
        return block

    def _copy(self, dst: int, src: int, kind: int) -> None:
        if not self._nbytes:
            return
        rt = _rt()
        stream = self._pool.stream
        rt.cudaMemcpyAsync(dst, src, self._nbytes, kind, stream)
        rt.cudaStreamSynchronize(stream)

    def copy_from(self, array: Any) -> None:
        """Overwrite the contents from a host array of the same type and size (copied on
        the pool's stream; finished on return)."""
        import numpy as np

        arr = np.ascontiguousarray(array)
        if _element_type(arr.dtype) != (self._dtype, self._lanes) or arr.nbytes != self._nbytes:
            raise ValueError(
                f"source {arr.dtype} x {arr.size} does not match this buffer's "
                f"{self._name()} x {self.size}"
            )
        self._copy(self._live().ptr, arr.ctypes.data, _H2D)

    def to_numpy(self) -> np.ndarray:
        """A host copy (copied on the pool's stream, after the work queued there)."""
        import numpy as np

        host_type = np.dtype(complex_name(self._dtype)) if self._lanes == 2 else to_numpy_dtype(
            self._dtype
        )
        out = np.empty(self._shape, dtype=host_type)
        self._copy(out.ctypes.data, self._live().ptr, _D2H)
        return out

    def _name(self) -> str:
        return complex_name(self._dtype) if self._lanes == 2 else self._dtype.name.lower()

    def close(self) -> None:
        """Give the block back to the pool, at once (idempotent)."""
        block, self._block = self._block, None
        if block is not None:
            self._pool._release(block)

    free = close

    def _held(self) -> bool:
        return getattr(self, "_block", None) is not None

    def __repr__(self) -> str:
        state = "freed" if self._block is None else f"ptr={self._block.ptr:#x}"
        return f"<pynccl.testing.CachedBuffer shape={self._shape} {self._name()} {state}>"
