"""NCCL group calls: ``with pynccl.group(): ...`` and ``group_start()``/``group_end()``.

Groups are thread-local in NCCL (depth and queued operations belong to the
calling thread), and so is the bookkeeping here. Only the outermost
``ncclGroupEnd`` launches the queued operations: the buffer objects of the operations
queued in a group (a temporary ``DeviceBuffer``, say) are kept alive until it has
returned. Communicators take part through a small interface (:class:`GroupMember`).
"""

from __future__ import annotations

import itertools
from _thread import _local as _ThreadLocal
from _thread import get_ident

from .enums import Result
from .library import lib

TYPE_CHECKING = False  # `typing` costs milliseconds to import
if TYPE_CHECKING:
    from types import TracebackType
    from typing import Protocol

    class GroupMember(Protocol):
        """What a group needs from a communicator used inside it."""

        def group_in_progress(self) -> None:
            """The outermost group end returned ncclInProgress: poll before the next call."""


__all__ = ["group", "group_depth", "group_end", "group_start", "in_progress_later", "keep_alive"]


class _GroupState:
    """One thread's group bookkeeping (a plain object: attribute access is cheap)."""

    __slots__ = ("depth", "gid", "ident", "keep", "pending")

    def __init__(self) -> None:
        self.depth = 0
        self.ident = get_ident()  # the thread's, for OPEN
        # Non-blocking communicators used inside the open group: after a group end
        # that returns ncclInProgress they must be polled before their next call.
        self.pending: list[GroupMember] = []
        # Buffer objects of the queued operations: alive until the outermost group end.
        self.keep: list[object] = []
        # The outermost open group's number (0: none), for the flight recorder.
        self.gid = 0


class _Local(_ThreadLocal):
    def __init__(self) -> None:
        self.s = _GroupState()


#: ``_local.s``: the calling thread's state (one per-thread lookup, then plain slots).
_local = _Local()
#: Threads with a group open: the hot paths look up the thread-local group number only
#: when this is not empty (set add/discard are atomic under the GIL).
OPEN: set[int] = set()
_SERIAL = itertools.count(1)


def group_depth() -> int:
    """How many groups the calling thread has open (through pynccl)."""
    return _local.s.depth


def keep_alive(objs: object) -> None:
    """Keep ``objs`` referenced until the calling thread's outermost group has ended
    (called for operations queued inside a group; nothing happens outside one)."""
    st = _local.s
    if st.depth > 0:
        st.keep.append(objs)


def in_progress_later(comm: GroupMember) -> None:
    """``comm`` returned ncclInProgress inside the open group: tell it at the group end
    if the group as a whole is still in progress."""
    _local.s.pending.append(comm)


def group_start() -> None:
    """``ncclGroupStart``: open a group on the calling thread (groups nest)."""
    lib().ncclGroupStart()
    st = _local.s
    depth = st.depth
    if depth == 0:
        st.gid = next(_SERIAL)
        OPEN.add(st.ident)
    st.depth = depth + 1


def group_end() -> Result:
    """``ncclGroupEnd``: close the innermost group; the outermost one launches the work.

    Returns ``Result.IN_PROGRESS`` when a non-blocking communicator's operations
    are still being set up (the communicators then wait before their next call).
    """
    st = _local.s
    depth = st.depth
    if depth > 0:
        depth -= 1
        st.depth = depth
        if depth == 0:
            st.gid = 0
            OPEN.discard(st.ident)
    try:
        result: Result = lib().ncclGroupEnd()
    except BaseException:
        if depth == 0:
            st.pending.clear()
            st.keep.clear()
        raise
    if depth == 0:
        keep = st.keep
        if keep:
            keep.clear()
        if st.pending:
            pending, st.pending = st.pending, []
            if result == Result.IN_PROGRESS:
                for comm in pending:
                    comm.group_in_progress()
    return result


class group:
    """Context manager for a group: ``with pynccl.group(): comm.send(...); comm.recv(...)``.

    The group is ended even if the body raises (NCCL requires it); the body's
    exception is the one that propagates, with a group-end failure attached as
    its ``__context__`` (and a note).
    """

    __slots__ = ()

    def __enter__(self) -> group:
        group_start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            group_end()
            return
        try:
            group_end()
        except Exception as end_error:
            if exc.__context__ is None:
                exc.__context__ = end_error
            if hasattr(exc, "add_note"):
                exc.add_note(f"ncclGroupEnd also failed while ending the group: {end_error}")
