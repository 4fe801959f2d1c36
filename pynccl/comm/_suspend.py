"""Suspend and resume: ``suspend``, ``resume``, ``with comm.suspended():`` and
``mem_stats`` (``ncclCommSuspend`` / ``ncclCommResume`` / ``ncclCommMemStats``,
NCCL >= 2.29).

A suspended communicator (state ``"suspended"``) has given back the GPU memory NCCL can
release (``SuspendFlag.MEM``); every call but :meth:`Suspend.resume`,
:meth:`Suspend.mem_stats`, ``destroy()`` and ``abort()`` raises
:class:`~pynccl.NcclInvalidUsage` saying so. Every rank suspends and resumes (NCCL
releases the memory of the world once all of them are suspended).

Communicators that share NCCL's memory manager — a parent made with
``Config(split_share=True)`` and the children of its splits (or ``shrink_share`` and
non-aborting shrinks) — cannot be suspended or resumed while more than one of them is
alive (NCCL refuses: ``src/mem_manager.cc``); pynccl tracks them and refuses first.
"""

from __future__ import annotations

import os
from ctypes import byref, c_uint64

from .._limits import check_c_int
from ..enums import MemStat, Result, ShrinkFlag, SuspendFlag
from ..errors import NcclInvalidUsage
from ._state import HANDLE, TERMINAL, State

__all__ = ["Suspend", "Suspension"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    import weakref
    from types import TracebackType

    from ._communicator import Communicator

_ALL_FLAGS = 0
for _flag in SuspendFlag:
    _ALL_FLAGS |= int(_flag)
#: ``mem_stats()``'s keys, with the ncclCommMemStat_t each reads.
_STATS = tuple((stat.name.lower(), int(stat)) for stat in MemStat)
_UNDEF = -(1 << 31)  # NCCL_CONFIG_UNDEF_INT
#: The communicators sharing one NCCL memory manager: each member -> the group's WeakSet
#: (a ``weakref.WeakKeyDictionary``, made by the first split that shares).
_SHARED: weakref.WeakKeyDictionary[Communicator, weakref.WeakSet[Communicator]] | None = None


class Suspension:
    """What :meth:`Suspend.suspended` returns: suspends on entry, resumes on exit."""

    __slots__ = ("_comm", "_flags")

    def __init__(self, comm: Communicator, flags: int) -> None:
        self._comm = comm
        self._flags = flags

    def __enter__(self) -> Communicator:
        self._comm.suspend(self._flags)
        return self._comm

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._comm.state is State.SUSPENDED:  # not torn down inside the block
            self._comm.resume()


class Suspend:
    """suspend, resume, suspended, mem_stats, and the communicators sharing NCCL's memory
    manager: a part of :class:`~pynccl.Communicator`, over its core's public surface."""

    __slots__ = ("config", "core")

    def __init__(self, core: Communicator) -> None:
        self.core = core
        #: The ``ncclConfig_t`` the communicator was made with (None: the defaults, or
        #: unknown): whether its splits share its memory manager.
        self.config: object = None

    def suspend(self, flags: SuspendFlag | int = SuspendFlag.MEM) -> None:
        """``ncclCommSuspend`` (NCCL >= 2.29): wait for this rank's operations, then
        release the communicator's dynamic GPU memory (``SuspendFlag.MEM``, the only
        flag so far). Every rank calls it; until :meth:`resume` the communicator is
        ``"suspended"`` and refuses collectives with :class:`~pynccl.NcclInvalidUsage`."""
        core = self.core
        core.require("suspend", "ncclCommSuspend")
        value = check_c_int(flags, "flags", 0)
        if value & ~_ALL_FLAGS:
            known = ", ".join(f"{f.name}={int(f):#x}" for f in SuspendFlag)
            raise ValueError(f"flags={value:#x} has bits that are no SuspendFlag ({known})")
        if core.state is State.SUSPENDED:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "",
                f"communicator rank {core.rank} is already suspended; call resume() first",
            )
        core.live()
        self._refuse_if_shared("ncclCommSuspend", "suspend")
        core.refuse_if_capturing("ncclCommSuspend")
        rc = core.call_locked("ncclCommSuspend", HANDLE, value, then=State.SUSPENDED)
        if rc == Result.IN_PROGRESS:
            core.wait_ready()

    def resume(self) -> None:
        """``ncclCommResume`` (NCCL >= 2.29): take the released memory back; the
        communicator is ``"ready"`` again."""
        core = self.core
        core.require("resume", "ncclCommResume")
        if core.state is not State.SUSPENDED:
            if core.usable:  # ready, and not being torn down
                raise NcclInvalidUsage(
                    Result.INVALID_USAGE,
                    "",
                    f"communicator rank {core.rank} is not suspended; resume() follows "
                    "suspend()",
                )
            core.gone()
        self._refuse_if_shared("ncclCommResume", "resume")
        core.refuse_if_capturing("ncclCommResume")
        core.call_locked("ncclCommResume", HANDLE, ready=False, then=State.READY)

    def suspended(self, flags: SuspendFlag | int = SuspendFlag.MEM) -> Suspension:
        """``with comm.suspended(): ...`` suspends (:meth:`suspend`) for the block and
        resumes (:meth:`resume`) after it, also when it raises (NCCL >= 2.29)."""
        return Suspension(self.core, flags)

    def mem_stats(self) -> dict[str, int]:
        """``ncclCommMemStats`` (NCCL >= 2.29): the GPU memory NCCL tracks for this
        communicator, by :class:`~pynccl.enums.MemStat` name in lower case:
        ``gpu_mem_suspend`` (bytes a suspend releases), ``gpu_mem_suspended`` (1 while
        they are released), ``gpu_mem_persist`` (bytes that stay) and ``gpu_mem_total``
        (the sum). As in NCCL (``src/mem_manager.cc``), a suspend changes only
        ``gpu_mem_suspended``: the tracked totals stay what they were (the memory is
        still accounted for, and comes back at resume). Works while suspended or revoked;
        it touches no stream, so also while a CUDA graph is being captured."""
        core = self.core
        core.require("mem_stats", "ncclCommMemStats")
        if core.state is State.INITIALIZING or core.state in TERMINAL:
            core.live()
        value = c_uint64()
        out: dict[str, int] = {}
        for name, stat in _STATS:
            core.call_locked("ncclCommMemStats", HANDLE, stat, byref(value), ready=False)
            out[name] = value.value
        return out

    # -- communicators sharing NCCL's memory manager --------------------------------------

    def adopt_child(self, child: Communicator | None, shares: bool) -> None:
        """After a split, shrink or grow: a ``child`` that shares this communicator's
        memory manager (``shares``, from :meth:`shares_memory` before the call) joins its
        group."""
        if child is None or not shares:
            return
        global _SHARED
        if _SHARED is None:
            import weakref  # not at import: `from pynccl import Communicator` stays light

            _SHARED = weakref.WeakKeyDictionary()
        group = _SHARED.get(self.core)
        if group is None:
            import weakref

            group = _SHARED[self.core] = weakref.WeakSet([self.core])
        group.add(child)
        _SHARED[child] = group

    def shares_memory(self, function: str, post: tuple[object, ...]) -> bool:
        """Whether the child ``function`` makes shares this communicator's memory manager
        (NCCL, ``src/init.cc``: a split with the parent's splitShare, a shrink without
        NCCL_SHRINK_ABORT with its shrinkShare — each overridden by its environment
        variable — and never from a revoked parent)."""
        if self.core.state is State.REVOKED:
            return False
        if function == "ncclCommSplit":
            field, env = "splitShare", "NCCL_COMM_SPLIT_SHARE_RESOURCES"
        elif function == "ncclCommShrink":
            if post and int(post[0]) & ShrinkFlag.ABORT:  # type: ignore[call-overload]
                return False
            field, env = "shrinkShare", "NCCL_COMM_SHRINK_SHARE_RESOURCES"
        else:
            return False
        value = getattr(self.config, field, _UNDEF)
        text = os.environ.get(env, "").strip()
        if text.lstrip("-").isdigit():
            value = int(text)
        return bool(value == 1)

    def _refuse_if_shared(self, function: str, verb: str) -> None:
        """NCCL refuses to suspend or resume a memory manager more than one live
        communicator shares; say so before the call."""
        group = None if _SHARED is None else _SHARED.get(self.core)
        if group is None:
            return
        live = [c for c in list(group) if c.state not in TERMINAL]
        if len(live) > 1:
            others = ", ".join(repr(c) for c in live if c is not self.core)
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                function,
                f"Memory {verb} not supported with split_share communicators "
                f"(refCount={len(live)}): this communicator shares NCCL's memory with "
                f"{others}; destroy those first",
            )
