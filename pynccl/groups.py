"""NCCL group calls: ``with pynccl.group(): ...`` and ``group_start()``/``group_end()``.

Groups are thread-local in NCCL (depth and queued operations belong to the
calling thread), and so is the bookkeeping here. Only the outermost
``ncclGroupEnd`` launches the queued operations: the buffer objects of the operations
queued in a group (a temporary ``DeviceBuffer``, say) are kept alive until it has
returned. Communicators take part through a small interface (:class:`GroupMember`).
``group(simulate=True)`` ends with ``ncclGroupSimulateEnd`` instead: NCCL estimates the
group's time and launches nothing.

The group calls are the hot path of every send/recv exchange, so they call the bare
ctypes functions of the loaded libnccl (bound once per library) and check the result
themselves; errors are the same :class:`~pynccl.NcclError` the low-level layer raises.
"""

from __future__ import annotations

import itertools
from _thread import _local as _ThreadLocal
from _thread import get_ident

from . import library as _library
from .enums import Result
from .errors import NcclInvalidUsage

TYPE_CHECKING = False  # `typing` costs milliseconds to import
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType
    from typing import Any, Protocol

    from ._capi.nccl import NcclLibrary

    class GroupMember(Protocol):
        """What a group needs from a communicator used inside it."""

        def group_in_progress(self) -> None:
            """The outermost group end returned ncclInProgress: poll before the next call."""


__all__ = [
    "KEEP_ALIVE",
    "Group",
    "SimulatedGroup",
    "group",
    "group_depth",
    "group_end",
    "group_start",
    "in_progress_later",
    "keep_alive",
]

#: First release with ncclGroupSimulateEnd / ncclSimInfo_t.
SIMULATE_SINCE = (2, 22, 3)
_SUCCESS = Result.SUCCESS
_IN_PROGRESS = Result.IN_PROGRESS


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
        # The outermost open group's number, for the flight recorder: not 0 exactly while
        # depth > 0 (which is what keep_alive tests).
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
_open_add, _open_discard = OPEN.add, OPEN.discard

# The bare ncclGroupStart / ncclGroupEnd of the library they were bound from (`_bound`,
# compared with library's `_nccl`, None until the first load): bound on first use and
# again whenever the process's libnccl is replaced (the loopback's test hook does that).
# Two threads binding at once is harmless: both bind the same functions.
_bound: object = object()
_gs: Any = None
_ge: Any = None


def _bind() -> NcclLibrary:
    global _bound, _gs, _ge
    lib = _library.lib()
    _gs, _ge = lib.raw("ncclGroupStart"), lib.raw("ncclGroupEnd")
    _bound = lib
    return lib


def group_depth() -> int:
    """How many groups the calling thread has open (through pynccl)."""
    return _local.s.depth


def keep_alive(objs: object) -> int:
    """Keep ``objs`` referenced until the calling thread's outermost group has ended
    (called for operations queued inside a group; nothing happens outside one). Returns
    that group's number (0: none), which the flight recorder stores with the operation.
    :data:`KEEP_ALIVE` is the same, inline."""
    st = _local.s
    gid = st.gid
    if gid:
        st.keep.append(objs)
    return gid


#: :func:`keep_alive` as source lines for generated hot paths, whose globals bind
#: ``_GROUPS`` to this module's thread-local state and ``_OPEN`` to :data:`OPEN` (no
#: thread has a group open: nothing to look up): ``{objs}`` kept, ``gid`` bound.
KEEP_ALIVE = (
    "gid = 0",
    "if _OPEN:",
    "    st = _GROUPS.s",
    "    gid = st.gid",
    "    if gid:",
    "        st.keep.append({objs})",
)


def in_progress_later(comm: GroupMember) -> None:
    """``comm`` returned ncclInProgress inside the open group: tell it at the group end
    if the group as a whole is still in progress."""
    _local.s.pending.append(comm)


def group_start() -> None:
    """``ncclGroupStart``: open a group on the calling thread (groups nest)."""
    _PLAIN.__enter__()


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
            _open_discard(st.ident)
    if _library._nccl is not _bound:  # an end without a start through pynccl
        _bind()
    rc = _ge()
    if rc or (depth == 0 and (st.keep or st.pending)):
        return _ended(st, depth, rc, "ncclGroupEnd")
    return _SUCCESS


def _ended(st: _GroupState, depth: int, rc: int, function: str) -> Result:
    """After the C end call has returned: release what the outermost group kept alive,
    then raise for an error, or tell the pending communicators about ncclInProgress."""
    pending: list[GroupMember] = []
    if depth == 0:
        st.keep.clear()
        pending, st.pending = st.pending, []
    if not rc:
        return _SUCCESS
    result: Result = _fail(rc, function)
    if result == _IN_PROGRESS:
        for comm in pending:
            comm.group_in_progress()
    return result


def _fail(rc: int, function: str) -> Any:
    """``Result.IN_PROGRESS`` for ncclInProgress; raises the NcclError for any other code."""
    return _library.lib()._fail(rc, function)


def _end_after(exc: BaseException, end: Callable[[], object]) -> None:
    """End the group after its body raised ``exc``: ``exc`` propagates, with a failure of
    the end attached as its ``__context__`` (and a note)."""
    try:
        end()
    except Exception as end_error:
        if exc.__context__ is None:
            exc.__context__ = end_error
        if hasattr(exc, "add_note"):
            exc.add_note(f"ncclGroupEnd also failed while ending the group: {end_error}")


class Group:
    """What :func:`group` returns: a context manager that opens a group on the calling
    thread on entry and ends it on exit. Plain groups share one instance (they keep no
    state: the bookkeeping is per thread); see :class:`SimulatedGroup`."""

    __slots__ = ()

    #: A plain group makes no estimate (see :class:`SimulatedGroup`).
    estimated_time: float | None = None

    def __enter__(self) -> Group:
        # group_start()'s body (it calls this): the hot path of every send/recv exchange.
        if _library._nccl is not _bound:
            _bind()
        rc = _gs()
        if rc:
            _fail(rc, "ncclGroupStart")
        st = _local.s
        depth = st.depth
        if not depth:
            st.gid = next(_SERIAL)
            _open_add(st.ident)
        st.depth = depth + 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            _end_after(exc, group_end)
            return
        # group_end()'s body, inline (the hot path again), the outermost group's end
        # first. The bare ncclGroupEnd bound when this group started is the right one even
        # if the library was replaced since.
        st = _local.s
        depth = st.depth
        if depth == 1:
            st.depth = 0
            st.gid = 0
            _open_discard(st.ident)
            rc = _ge()
            if rc or st.pending:
                _ended(st, 0, rc, "ncclGroupEnd")
            elif st.keep:
                st.keep.clear()  # the launched operations' buffers
        else:  # nested (or unbalanced: no group open through pynccl)
            if depth > 0:
                depth -= 1
                st.depth = depth
            rc = _ge()
            if rc or (depth == 0 and (st.keep or st.pending)):
                _ended(st, depth, rc, "ncclGroupEnd")

    def __repr__(self) -> str:
        return "pynccl.group()"


class SimulatedGroup(Group):
    """A group ended with ``ncclGroupSimulateEnd`` (:func:`group` with ``simulate=True``;
    NCCL >= 2.22)."""

    __slots__ = ("estimated_time",)

    def __init__(self) -> None:
        #: NCCL's estimate of the group's time in seconds, set when it ends (``None``
        #: before, or where NCCL gave no estimate).
        self.estimated_time: float | None = None

    def __enter__(self) -> SimulatedGroup:
        lib = _bind()
        lib.require("group(simulate=True) (ncclGroupSimulateEnd)", SIMULATE_SINCE)
        if _local.s.depth > 0:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "ncclGroupSimulateEnd",
                "group(simulate=True) must be the outermost group: end the open group "
                "first (a nested group's operations are launched by the outer group's end)",
            )
        self.estimated_time = None  # entered again: the last estimate is not this one's
        super().__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self._end()
        else:
            _end_after(exc, self._end)

    def _end(self) -> Result:
        from ctypes import byref

        from ._capi.structs import make_sim_info

        simulate_end = _library.lib().raw("ncclGroupSimulateEnd")
        info = make_sim_info()
        st = _local.s
        depth = st.depth
        if depth > 0:  # the outermost group (checked on entry), unless left unbalanced
            depth -= 1
            st.depth = depth
            if depth == 0:
                st.gid = 0
                _open_discard(st.ident)
        rc = simulate_end(byref(info))
        result = _ended(st, depth, rc, "ncclGroupSimulateEnd")
        estimate = float(info.estimatedTime)  # microseconds; NCCL_UNDEF_FLOAT (-1): none
        self.estimated_time = estimate * 1e-6 if estimate >= 0 else None
        return result

    def __repr__(self) -> str:
        return f"pynccl.group(simulate=True) (estimated_time={self.estimated_time!r})"


_PLAIN = Group()


def group(*, simulate: bool = False) -> Group:
    """A group as a context manager: ``with pynccl.group(): comm.send(...); comm.recv(...)``.

    The group is ended even if the body raises (NCCL requires it); the body's
    exception is the one that propagates, with a group-end failure attached as
    its ``__context__`` (and a note).

    ``group(simulate=True)`` (NCCL >= 2.22.3) ends the group with
    ``ncclGroupSimulateEnd``: the operations queued in it are checked and planned but
    not launched, and afterwards the group's ``estimated_time`` holds NCCL's estimate
    of their time in seconds (``None`` where NCCL gave none)::

        with pynccl.group(simulate=True) as g:
            comm.all_reduce(x)
        print(g.estimated_time)

    A simulated group must be the outermost one (NCCL ignores the simulation of a
    nested group, whose operations the outer group would launch): opening one inside
    another raises :class:`~pynccl.NcclInvalidUsage`, and on an older library
    :class:`~pynccl.NotSupportedError`, both before ``ncclGroupStart``. Buffers are
    kept alive and errors raised as in a normal group.
    """
    if simulate is False:
        return _PLAIN
    if simulate is not True:
        raise TypeError(f"group(simulate=...) takes True or False, not {simulate!r}")
    return SimulatedGroup()
