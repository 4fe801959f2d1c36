"""Suspend and resume: ``suspend``, ``resume``, ``with comm.suspended():`` and
``mem_stats`` (``ncclCommSuspend`` / ``ncclCommResume`` / ``ncclCommMemStats``,
NCCL >= 2.29).

A suspended communicator (state ``"suspended"``) has given back the GPU memory NCCL can
release (``SuspendFlag.MEM``); every call but :meth:`Suspend.resume`,
:meth:`Suspend.mem_stats`, ``destroy()`` and ``abort()`` raises
:class:`~pynccl.NcclInvalidUsage` saying so. Every rank suspends and resumes (NCCL
releases the memory of the world once all of them are suspended).
"""

from __future__ import annotations

from ctypes import byref, c_uint64

from .._limits import check_c_int
from ..enums import MemStat, Result, SuspendFlag
from ..errors import NcclInvalidUsage
from ._handle import HANDLE, TERMINAL, State
from ._observe import Observed

__all__ = ["Suspend", "Suspension"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import TracebackType

_ALL_FLAGS = 0
for _flag in SuspendFlag:
    _ALL_FLAGS |= int(_flag)
#: ``mem_stats()``'s keys, with the ncclCommMemStat_t each reads.
_STATS = tuple((stat.name.lower(), int(stat)) for stat in MemStat)


class Suspension:
    """What :meth:`Suspend.suspended` returns: suspends on entry, resumes on exit."""

    __slots__ = ("_comm", "_flags")

    def __init__(self, comm: Suspend, flags: int) -> None:
        self._comm = comm
        self._flags = flags

    def __enter__(self) -> Suspend:
        self._comm.suspend(self._flags)
        return self._comm

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._comm._state is State.SUSPENDED:  # not torn down inside the block
            self._comm.resume()


class Suspend(Observed):
    """suspend, resume, suspended, mem_stats (a base of Communicator)."""

    __slots__ = ()

    def suspend(self, flags: SuspendFlag | int = SuspendFlag.MEM) -> None:
        """``ncclCommSuspend`` (NCCL >= 2.29): wait for this rank's operations, then
        release the communicator's dynamic GPU memory (``SuspendFlag.MEM``, the only
        flag so far). Every rank calls it; until :meth:`resume` the communicator is
        ``"suspended"`` and refuses collectives with :class:`~pynccl.NcclInvalidUsage`."""
        self._require("suspend", "ncclCommSuspend")
        value = check_c_int(flags, "flags", 0)
        if value & ~_ALL_FLAGS:
            known = ", ".join(f"{f.name}={int(f):#x}" for f in SuspendFlag)
            raise ValueError(f"flags={value:#x} has bits that are no SuspendFlag ({known})")
        if self._state is State.SUSPENDED:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "",
                f"communicator rank {self._rank} is already suspended; call resume() first",
            )
        self._live()
        self._refuse_if_capturing("ncclCommSuspend")
        rc = self._call_locked("ncclCommSuspend", HANDLE, value, then=State.SUSPENDED)
        if rc == Result.IN_PROGRESS:
            self.wait_ready()

    def resume(self) -> None:
        """``ncclCommResume`` (NCCL >= 2.29): take the released memory back; the
        communicator is ``"ready"`` again."""
        self._require("resume", "ncclCommResume")
        state = self._state
        if state is not State.SUSPENDED:
            if state is State.READY and self._closing is None:
                raise NcclInvalidUsage(
                    Result.INVALID_USAGE,
                    "",
                    f"communicator rank {self._rank} is not suspended; resume() follows "
                    "suspend()",
                )
            self._gone()
        self._refuse_if_capturing("ncclCommResume")
        self._call_locked("ncclCommResume", HANDLE, ready=False, then=State.READY)

    def suspended(self, flags: SuspendFlag | int = SuspendFlag.MEM) -> Suspension:
        """``with comm.suspended(): ...`` suspends (:meth:`suspend`) for the block and
        resumes (:meth:`resume`) after it, also when it raises (NCCL >= 2.29)."""
        return Suspension(self, flags)

    def mem_stats(self) -> dict[str, int]:
        """``ncclCommMemStats`` (NCCL >= 2.29): the GPU memory NCCL holds for this
        communicator, by :class:`~pynccl.enums.MemStat` name in lower case:
        ``gpu_mem_suspend`` (bytes a suspend can release, 0 once released),
        ``gpu_mem_suspended`` (1 while suspended), ``gpu_mem_persist`` (bytes that stay)
        and ``gpu_mem_total``. Works while suspended or revoked; it touches no stream,
        so also while a CUDA graph is being captured."""
        self._require("mem_stats", "ncclCommMemStats")
        if self._state is State.INITIALIZING or self._state in TERMINAL:
            self._live()
        value = c_uint64()
        out: dict[str, int] = {}
        for name, stat in _STATS:
            self._call_locked("ncclCommMemStats", HANDLE, stat, byref(value), ready=False)
            out[name] = value.value
        return out
