"""NCCL memory and buffer registration: ``mem_alloc``, ``register`` / ``deregister`` and
the :class:`Registration` they hand out (tracked per communicator, closed before it goes).

``mem_alloc`` is a :class:`~pynccl.cuda.DeviceBuffer` with ``allocator="nccl"``
(``ncclMemAlloc`` / ``ncclMemFree``). A :class:`Registration` keeps the registered
object referenced while it is registered; the communicator deregisters every open one on
:meth:`~pynccl.Communicator.destroy` and only marks them closed on ``abort`` (the abort
frees them, and nothing that could hang is called then).
"""

from __future__ import annotations

from ctypes import byref, c_void_p

from .._adapt import as_buffer, check_device
from .._closable import Closable
from .._limits import check_count, check_pointer, is_pointer_object
from ..enums import DataType, Result
from ..errors import NcclInvalidUsage
from ._state import HANDLE, TERMINAL

__all__ = ["Memory", "Registration", "buffer_range"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..cuda import DeviceBuffer
    from ..typing import BufferLike, DTypeLike
    from ._core import Core

_MEM_ALLOC = (2, 19, 1)  # ncclMemAlloc, ncclCommRegister


def buffer_range(
    device: int | None, buf: object, nbytes: object, verb: str
) -> tuple[int, int, DataType]:
    """``(ptr, bytes, element type)`` of the range ``verb`` (register, register_window)
    covers: a buffer (its first ``nbytes`` if given) or a raw pointer with ``nbytes``;
    a buffer must be on ``device`` (the communicator's, if known)."""
    if type(buf) is int or is_pointer_object(buf):  # a raw pointer (or a CUdeviceptr)
        if nbytes is None:
            raise TypeError(f"{verb}(ptr) with a raw pointer needs nbytes=")
        size = check_count(nbytes, "nbytes")
        return check_pointer(buf, "buf", size), size, DataType.UINT8
    ptr, n, dt, dev = as_buffer(buf, name="buf")  # type: ignore[arg-type]
    check_device(dev, device, "buf")
    held = n * dt.itemsize
    size = held if nbytes is None else check_count(nbytes, "nbytes")
    if size > held:
        raise ValueError(f"nbytes={size} is more than the {held} bytes buf holds")
    return ptr, size, dt


class Registration(Closable):
    """A buffer registered with ``ncclCommRegister`` (:meth:`Communicator.register`; NCCL >= 2.19).

    ``handle`` is NCCL's registration handle (an ``int``); :meth:`close` (or the end of a
    ``with`` block, or :meth:`Communicator.deregister`) deregisters it. The registered
    object stays referenced until then. A closed registration refuses ``handle``.
    """

    __slots__ = ("__weakref__", "_buf", "_closed", "_handle", "_memory", "_nbytes", "_ptr")

    def __init__(self, memory: Memory, handle: int, ptr: int, nbytes: int, buf: object) -> None:
        self._memory = memory
        self._handle = handle
        self._ptr = ptr
        self._nbytes = nbytes
        self._buf = buf
        self._closed = False

    @property
    def handle(self) -> int:
        """NCCL's registration handle; refused once the registration is closed."""
        if self.closed:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE, "", f"{self!r} is closed: its handle is no longer valid"
            )
        return self._handle

    @property
    def ptr(self) -> int:
        """The registered device address."""
        return self._ptr

    @property
    def nbytes(self) -> int:
        """The registered size in bytes."""
        return self._nbytes

    @property
    def closed(self) -> bool:
        """True once deregistered, or once its communicator is gone."""
        return self._closed or self._memory.core.state in TERMINAL

    def close(self) -> None:
        """``ncclCommDeregister`` (NCCL >= 2.19; idempotent; only marks it closed once the
        communicator is gone, whose teardown freed it)."""
        self._memory.deregister_one(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"handle={self._handle:#x}"
        return (
            f"<pynccl.Registration ptr={self._ptr:#x} nbytes={self._nbytes} "
            f"rank {self._memory.core.rank} {state}>"
        )


class Memory:
    """mem_alloc, register, deregister and the open registrations: a part of
    :class:`~pynccl.Communicator`, over its core's public surface."""

    __slots__ = ("core", "regs")

    def __init__(self, core: Core, regs: dict[int, Registration]) -> None:
        self.core = core
        #: The open registrations by handle (the communicator's ``_regs``).
        self.regs = regs
        core.on_close(self.close_registrations)

    def mem_alloc(self, count: int, dtype: DTypeLike = "uint8") -> DeviceBuffer:
        """``ncclMemAlloc`` (NCCL >= 2.19): ``count`` elements of ``dtype`` on this
        communicator's device, as a :class:`~pynccl.cuda.DeviceBuffer` (``allocator="nccl"``)
        that ``close()`` (or garbage collection) frees with ``ncclMemFree``. Memory for
        symmetric windows and one-sided puts. Not while a CUDA graph is being captured."""
        core = self.core
        core.live()
        n = check_count(count)
        core.library.require("ncclMemAlloc", _MEM_ALLOC)
        core.refuse_if_capturing("ncclMemAlloc")
        from ..cuda import DeviceBuffer

        return DeviceBuffer((n,), dtype, core.device, allocator="nccl")

    def register(self, buf: BufferLike, *, nbytes: int | None = None) -> Registration:
        """``ncclCommRegister`` (NCCL >= 2.19): register ``buf`` (a buffer, or a raw
        pointer with ``nbytes=``; ``nbytes`` also registers just the first bytes of a
        buffer) for faster collectives. Returns a :class:`Registration` that keeps ``buf``
        referenced until it is closed. Not while a CUDA graph is being captured."""
        core = self.core
        core.live()
        ptr, size, _ = buffer_range(core.device, buf, nbytes, "register")
        core.library.require("ncclCommRegister", _MEM_ALLOC)
        core.refuse_if_capturing("ncclCommRegister")
        out = c_void_p()
        core.call_locked("ncclCommRegister", HANDLE, ptr, size, byref(out))
        reg = Registration(self, int(out.value or 0), ptr, size, buf)
        self.regs[reg._handle] = reg
        return reg

    def deregister(self, handle: Registration | int) -> None:
        """``ncclCommDeregister`` (NCCL >= 2.19): a :class:`Registration` (like its
        ``close()``) or a bare handle (an ``int``, as ``register`` returned before it
        returned Registrations)."""
        if isinstance(handle, Registration):
            if handle._memory is not self:
                raise ValueError(f"{handle!r} belongs to another communicator")
            self.deregister_one(handle)
            return
        if isinstance(handle, (bool, float)) or not hasattr(type(handle), "__index__"):
            raise TypeError(
                f"handle must be a Registration or an int handle, got {type(handle).__name__}"
            )
        # A void* for NCCL: ctypes would wrap 2**64 + h to h (the real registration).
        handle = check_pointer(handle, "handle", 0)
        reg = self.regs.get(handle)
        if reg is not None:
            self.deregister_one(reg)
            return
        self.core.refuse_if_capturing("ncclCommDeregister")
        self.core.call_locked("ncclCommDeregister", HANDLE, handle)

    def deregister_one(self, reg: Registration) -> None:
        """Deregister ``reg`` (only forget it once the communicator is gone)."""
        if reg.closed:
            reg._closed = True
            self.regs.pop(reg._handle, None)
            return
        self.core.refuse_if_capturing("ncclCommDeregister")
        self.core.call_locked("ncclCommDeregister", HANDLE, reg._handle)
        reg._closed = True
        reg._buf = None
        self.regs.pop(reg._handle, None)

    def close_registrations(self, abort: bool) -> None:
        """Before destroy (deregister each) or abort (only mark them closed): the core's
        close hook."""
        regs = list(self.regs.values())
        self.regs.clear()
        call = not abort and self.core.usable  # finalized: the destroy frees them
        first: BaseException | None = None
        for reg in regs:
            if call and first is None and not reg._closed:
                try:
                    self.core.call_locked("ncclCommDeregister", HANDLE, reg._handle)
                except BaseException as exc:  # destroy goes on; it frees the rest
                    first = exc
            reg._closed = True
            reg._buf = None
        if first is not None:
            raise first
