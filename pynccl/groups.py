"""NCCL group calls: ``with pynccl.group(): ...`` and ``group_start()``/``group_end()``.

Groups are thread-local in NCCL (depth and queued operations belong to the
calling thread), and so is the bookkeeping here. Only the outermost
``ncclGroupEnd`` launches the queued operations: the buffer objects of the operations
queued in a group (a temporary ``DeviceBuffer``, say) are kept alive until it has
returned. Communicators take part through a small interface (:class:`GroupMember`).
"""

from __future__ import annotations

import itertools
import threading
from types import TracebackType

from .enums import Result
from .library import lib

TYPE_CHECKING = False  # `typing` costs milliseconds to import
if TYPE_CHECKING:
    from typing import Protocol

    class GroupMember(Protocol):
        """What a group needs from a communicator used inside it."""

        def group_in_progress(self) -> None:
            """The outermost group end returned ncclInProgress: poll before the next call."""


__all__ = ["group", "group_depth", "group_end", "group_start", "in_progress_later", "keep_alive"]


class _GroupState(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        # Non-blocking communicators used inside the open group: after a group end
        # that returns ncclInProgress they must be polled before their next call.
        self.pending: list[GroupMember] = []
        # Buffer objects of the queued operations: alive until the outermost group end.
        self.keep: list[object] = []
        # The outermost open group's number (0: none), for the flight recorder.
        self.gid = 0


_state = _GroupState()
#: Threads with a group open: the hot paths look up the thread-local group number only
#: when this is not empty (set add/discard are atomic under the GIL).
OPEN: set[int] = set()
_SERIAL = itertools.count(1)


def group_depth() -> int:
    """How many groups the calling thread has open (through pynccl)."""
    return _state.depth


def keep_alive(objs: object) -> None:
    """Keep ``objs`` referenced until the calling thread's outermost group has ended
    (called for operations queued inside a group; nothing happens outside one)."""
    if _state.depth > 0:
        _state.keep.append(objs)


def in_progress_later(comm: GroupMember) -> None:
    """``comm`` returned ncclInProgress inside the open group: tell it at the group end
    if the group as a whole is still in progress."""
    _state.pending.append(comm)


def group_start() -> None:
    """``ncclGroupStart``: open a group on the calling thread (groups nest)."""
    lib().ncclGroupStart()
    if _state.depth == 0:
        _state.gid = next(_SERIAL)
        OPEN.add(threading.get_ident())
    _state.depth += 1


def group_end() -> Result:
    """``ncclGroupEnd``: close the innermost group; the outermost one launches the work.

    Returns ``Result.IN_PROGRESS`` when a non-blocking communicator's operations
    are still being set up (the communicators then wait before their next call).
    """
    if _state.depth > 0:
        _state.depth -= 1
        if _state.depth == 0:
            _state.gid = 0
            OPEN.discard(threading.get_ident())
    try:
        result: Result = lib().ncclGroupEnd()
    except BaseException:
        if _state.depth == 0:
            _state.pending.clear()
            _state.keep.clear()
        raise
    if _state.depth == 0:
        _state.keep.clear()
        if _state.pending:
            pending, _state.pending = _state.pending, []
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
