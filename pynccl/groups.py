"""NCCL group calls: ``with pynccl.group(): ...`` and ``group_start()``/``group_end()``.

Groups are thread-local in NCCL (depth and queued operations belong to the calling
thread), and so is the bookkeeping here. Only the outermost ``ncclGroupEnd`` launches the
queued operations. ``group(simulate=True)`` ends with ``ncclGroupSimulateEnd`` instead:
NCCL estimates the group's time and launches nothing.

What the outermost end must know, each call made inside the group tells the thread's
state (cheaply: one append, and only while a group is open):

* **its communicator** — a non-blocking ``ncclGroupEnd`` that returns ``ncclInProgress``
  puts *every* communicator of the group in progress (NCCL launches from its own thread;
  the calls inside the group returned success), so each of them waits for readiness
  before its next call and in ``synchronize()`` (:class:`GroupMember`);
* **the objects it uses and the stream it was issued on** — the buffers of a queued
  operation (a temporary ``DeviceBuffer``, an array of a stream-ordered caching
  allocator) must live until the operation has *run*, not only until it was launched: at
  the end an event is recorded on each stream the group used (once NCCL has launched, for
  a non-blocking group), and the objects are let go once every event has completed —
  checked without waiting at later group ends of the thread (or :func:`release_done`),
  never by a thread of its own. Work captured into a CUDA graph is kept for good (the
  graph may replay it at any time).

The group calls are the hot path of every send/recv exchange, so they call the bare
ctypes functions of the loaded libnccl (bound once per library) and check the result
themselves; errors are the same :class:`~pynccl.NcclError` the low-level layer raises.
"""

from __future__ import annotations

import itertools
from _thread import _local as _ThreadLocal
from _thread import get_ident

from . import library as _library
from ._limits import check_flag
from .enums import Result
from .errors import NcclInvalidUsage

TYPE_CHECKING = False  # `typing` costs milliseconds to import
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType
    from typing import Any, Protocol

    from ._capi.nccl import NcclLibrary
    from .comm import Work

    class GroupMember(Protocol):
        """What a group needs from a communicator used inside it."""

        @property
        def state(self) -> str: ...

        def watch_device(self) -> int | None: ...

        def group_in_progress(self) -> None:
            """The outermost group end returned ncclInProgress: poll before the next call."""


__all__ = [
    "OPEN",
    "STATE",
    "Group",
    "SimulatedGroup",
    "after_launch",
    "group",
    "group_depth",
    "group_end",
    "group_start",
    "in_progress_later",
    "inner_group",
    "keep_alive",
    "kept_objects",
    "release_done",
]

#: First release with ncclGroupSimulateEnd / ncclSimInfo_t.
SIMULATE_SINCE = (2, 22, 3)
_SUCCESS = Result.SUCCESS
_IN_PROGRESS = Result.IN_PROGRESS


class _GroupState:
    """One thread's group bookkeeping (a plain object: attribute access is cheap)."""

    __slots__ = ("comms", "depth", "gid", "held", "ident", "keep")

    def __init__(self) -> None:
        self.depth = 0
        self.ident = get_ident()  # the thread's, for OPEN
        # (communicator, stream handle or None) of each call issued inside the open
        # outermost group that keeps nothing alive (those that do are in `keep`).
        self.comms: list[tuple[GroupMember, Any]] = []
        # One entry per call that keeps objects alive: (communicator or None, stream or
        # None, *objects). The stream is a handle (int) or its shared c_void_p.
        self.keep: list[tuple[Any, ...]] = []
        # The outermost open group's number, for the flight recorder: not 0 exactly while
        # depth > 0 (which is what keep_alive tests).
        self.gid = 0
        # Ended groups whose kept objects wait for their streams (pynccl.comm._held).
        self.held: list[Any] = []

    def __del__(self) -> None:
        # The thread is gone: what it still holds waits in any other thread's release.
        if self.held:
            _ORPHANS.extend(self.held)
        at_end = _AT_END  # None at interpreter exit, when module globals are cleared
        if at_end:
            # A group left open: its end never comes, and nothing of it was launched. Those
            # who asked to hear of the end (the watchdog) hear so now, or a later thread
            # given the same ident would find their state for this one.
            for told in at_end.pop(self.ident, ()):
                told(False, False)


class _Local(_ThreadLocal):
    def __init__(self) -> None:
        self.s = _GroupState()


#: ``_local.s``: the calling thread's state (one per-thread lookup, then plain slots).
_local = _Local()
#: The same object under its public name, for hot paths in other modules
#: (``STATE.s.gid``, ``STATE.s.keep``, ``STATE.s.comms``: see :class:`_GroupState`).
STATE = _local
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


def keep_alive(objs: object, comm: GroupMember | None = None, stream: object = None) -> int:
    """Keep ``objs`` referenced until the work of the calling thread's outermost group
    has run on ``stream`` (a handle; ``None``: every stream the group used), and count
    ``comm`` among the group's communicators (called for operations queued inside a
    group; nothing happens outside one). Returns that group's number (0: none), which
    the flight recorder stores with the operation. The collectives' fast path does the same inline.
    """
    st = _local.s
    gid = st.gid
    if gid:
        st.keep.append((comm, stream, *objs) if type(objs) is tuple else (comm, stream, objs))
    return gid


def kept_objects() -> list[object]:
    """The objects the calling thread's open group keeps alive so far (what
    :func:`keep_alive` and the fast path kept), in order."""
    return [obj for entry in _local.s.keep for obj in entry[2:]]


def in_progress_later(comm: GroupMember, stream: int | None = None) -> None:
    """``comm`` issued inside the open group (its call may even have returned
    ncclInProgress) on ``stream`` (a handle; None: none to wait for): if the outermost end
    returns ncclInProgress, ``comm`` waits for readiness before its next call; otherwise
    the group's :attr:`Group.work` covers ``stream``. Nothing happens outside a group."""
    st = _local.s
    if st.gid:
        st.comms.append((comm, stream))


def after_launch(comm: GroupMember, stream: int, told: Callable[[bool, bool], None]) -> bool:
    """Inside a group of the calling thread: call ``told(now, later)`` once the outermost
    end has returned (before it raises for an error) — ``now``: that end launched the
    group's work; ``later``: a non-blocking end returned ncclInProgress (NCCL launches once
    the group's communicators are ready); both False: nothing was launched (the end failed,
    or the group was simulated). ``comm``, issued on ``stream`` (a handle), counts among the
    group's communicators. Returns False outside a group (nothing is remembered).

    For what must follow the launch, not the call: an event recorded at the call completes
    at once, since NCCL enqueues nothing on the stream before the outermost end (the
    watchdog's events, :mod:`pynccl.comm._watchdog`). Costs nothing to groups that use it not.
    """
    st = _local.s
    if not st.gid:
        return False
    waiting = _AT_END.get(st.ident)
    if waiting is None:
        _AT_END[st.ident] = [told]
    else:
        waiting.append(told)
    # An entry that names a stream and keeps nothing: the end comes back to _ended, where
    # `told` is called, even for a group of raw pointers (whose calls keep nothing).
    st.keep.append((comm, stream))
    return True


def _launched(st: _GroupState, rc: int, launched: bool) -> None:
    """The outermost end returned ``rc``: tell what :func:`after_launch` registered."""
    told = _AT_END.pop(st.ident, None)
    if told is not None:
        now = launched and not rc
        later = launched and rc == _IN_PROGRESS
        for fn in told:
            fn(now, later)


def group_start() -> None:
    """``ncclGroupStart``: open a group on the calling thread (groups nest)."""
    _PLAIN.__enter__()


def group_end() -> Result:
    """``ncclGroupEnd``: close the innermost group; the outermost one launches the work.

    Returns ``Result.IN_PROGRESS`` when a non-blocking communicator's operations
    are still being set up (every communicator of the group then waits before its next
    call).
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
    if rc or (depth == 0 and (st.keep or st.comms or st.held)):
        return _ended(st, depth, rc, "ncclGroupEnd")
    return _SUCCESS


def _ended(st: _GroupState, depth: int, rc: int, function: str, launched: bool = True) -> Result:
    """After the C end call has returned: at the outermost end, tell every communicator
    of the group that it is in progress (ncclInProgress), hand what the group kept to
    the streams it used (nothing ran if not ``launched``: let it go) and release what
    earlier groups kept whose streams have passed; then raise for an error."""
    if depth == 0:
        if _AT_END:  # only where after_launch was called (a watched communicator)
            _launched(st, rc, launched)
        # Earlier groups first: this group's own events, recorded below, have hardly
        # begun (asking for them now would be one more query per end, nearly always
        # answered "not yet"); a later end or release_done() asks.
        if st.held or _ORPHANS:
            _release(st.held)
        keep, comms = st.keep, st.comms
        if rc == _IN_PROGRESS:  # a non-blocking simulated end launches too (NCCL's thread)
            waiting = _members(comms, keep)
            st.keep, st.comms = [], []
            for comm in waiting:
                comm.group_in_progress()
            if keep:
                (_HELD or _held()).hold(st.held, keep, waiting)
        else:
            if keep:
                if launched and (_HELD or _held()).hold(st.held, keep, ()):
                    st.keep = []  # taken by the held list
                else:
                    keep.clear()
            if comms:
                comms.clear()
    if not rc:
        return _SUCCESS
    return _fail(rc, function)  # type: ignore[no-any-return]


def _members(
    comms: list[tuple[GroupMember, Any]], keep: list[tuple[Any, ...]]
) -> list[GroupMember]:
    """Every communicator that issued in the group, once each, in order."""
    found: dict[int, GroupMember] = {}
    for comm, _ in comms:
        found.setdefault(id(comm), comm)
    for entry in keep:
        if entry[0] is not None:
            found.setdefault(id(entry[0]), entry[0])
    return list(found.values())


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
    thread on entry and ends it on exit (the bookkeeping is per thread); once the
    outermost group has ended, :attr:`work` is its completion handle. See
    :class:`SimulatedGroup`."""

    __slots__ = ("_work",)

    #: A plain group makes no estimate (see :class:`SimulatedGroup`).
    estimated_time: float | None = None
    #: Whether the end records :attr:`work` (``group(async_op=True)`` only).
    records = False

    @property
    def work(self) -> Work | None:
        """The :class:`pynccl.Work` of a ``group(async_op=True)`` once it has ended: one
        event per distinct stream its operations were issued on, recorded after the launch
        (done at once for a group that issued nothing). None before the end, for a nested
        group (the outermost one launches its operations), or a non-blocking one whose end
        returned ncclInProgress (its operations reach their streams only once the
        communicators are ready: ``comm.wait_ready()``, then ``comm.synchronize()``).

        Raises ValueError on a group that records none (``pynccl.group()`` without
        ``async_op=True``, a simulated one): reading it there is a mistake, not a wait."""
        if not self.records:
            raise ValueError(
                f"{self!r} records no completion handle; open the group with "
                "pynccl.group(async_op=True) to get g.work"
            )
        try:
            return self._work  # type: ignore[no-any-return]
        except AttributeError:
            return None

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
            keep = st.keep
            if not rc and self.records:
                try:
                    self._work = _work_of(st.comms, keep)
                except BaseException:  # launched all the same: hand over what it kept
                    _ended(st, 0, rc, "ncclGroupEnd")
                    raise
            if rc or st.held:
                _ended(st, 0, rc, "ncclGroupEnd")
            elif keep:
                for entry in keep:
                    if entry[1] is not None:  # a stream to wait for, maybe
                        _ended(st, 0, rc, "ncclGroupEnd")
                        break
                else:  # launched, and nothing needs its stream: let go at once
                    keep.clear()
                    st.comms.clear()
            elif st.comms:
                st.comms.clear()  # launched, and nothing kept: the members need nothing
        else:  # nested (or unbalanced: no group open through pynccl)
            if depth > 0:
                depth -= 1
                st.depth = depth
            rc = _ge()
            if rc or (depth == 0 and (st.keep or st.comms or st.held)):
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
        # Nothing was launched: what the group kept may go (unless NCCL went on
        # without it: a non-blocking end in progress).
        result = _ended(st, depth, rc, "ncclGroupSimulateEnd", launched=False)
        estimate = float(info.estimatedTime)  # microseconds; NCCL_UNDEF_FLOAT (-1): none
        self.estimated_time = estimate * 1e-6 if estimate >= 0 else None
        return result

    def __repr__(self) -> str:
        return f"pynccl.group(simulate=True) (estimated_time={self.estimated_time!r})"


class _Inner(Group):
    """pynccl's own groups (a grouped fallback, a v-collective): no :attr:`work` of their
    own; their caller makes the handle if one was asked for."""

    __slots__ = ()


class _Recording(Group):
    """``group(async_op=True)``: its end records :attr:`Group.work`."""

    __slots__ = ()
    records = True

    def __enter__(self) -> Group:
        try:  # entered again: the last end's work is not this group's
            del self._work
        except AttributeError:
            pass
        return super().__enter__()


_PLAIN = Group()
#: What :func:`inner_group` returns (stateless: the bookkeeping is per thread).
_INNER = _Inner()


def inner_group() -> Group:
    """A group for pynccl's own grouped calls, which records no :attr:`Group.work`."""
    return _INNER


def group(*, simulate: bool = False, async_op: bool = False) -> Group:
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

    ``group(async_op=True)``: once the group has ended, ``g.work`` is its
    :class:`pynccl.Work` (one event per distinct stream its operations used, recorded
    after the launch)::

        with pynccl.group(async_op=True) as g:
            comm.send(x, 1)
            comm.recv(y, 1)
        g.work.wait(timeout=30)

    A plain group records nothing (an event record per group end would cost a send/recv
    exchange several times its host time).

    A simulated group must be the outermost one (NCCL ignores the simulation of a
    nested group, whose operations the outer group would launch): opening one inside
    another raises :class:`~pynccl.NcclInvalidUsage`, and on an older library
    :class:`~pynccl.NotSupportedError`, both before ``ncclGroupStart``. Buffers are
    kept alive until the end (nothing runs) and errors raised as in a normal group.
    """
    if simulate is False:
        if async_op is False:
            return _PLAIN
        return _Recording() if check_flag(async_op, "async_op") else _PLAIN
    if simulate is not True:
        raise TypeError(f"group(simulate=...) takes True or False, not {simulate!r}")
    return SimulatedGroup()


# -- objects kept until the streams of ended groups have passed ------------------------------

#: What threads that ended left held (any thread's release lets it go once done).
_ORPHANS: list[Any] = []
#: What the outermost end of each thread's open group tells (thread ident -> the
#: ``told`` of :func:`after_launch`): empty unless a watched communicator issued in a group.
_AT_END: dict[int, list[Callable[[bool, bool], None]]] = {}
_HELD: Any = None


def _held() -> Any:
    """:mod:`pynccl.comm._held`, imported on first use (``from pynccl import group`` stays
    light; a group that kept something has communicators, so the object API is loaded)."""
    global _HELD
    if _HELD is None:
        from .comm import _held

        _HELD = _held
    return _HELD


def _work_of(comms: list[tuple[GroupMember, Any]], keep: list[tuple[Any, ...]]) -> Any:
    """The ended group's :class:`pynccl.Work` (:mod:`pynccl.comm._work`)."""
    return (_WORK or _work()).group_work(comms, keep)


_WORK: Any = None


def _work() -> Any:
    global _WORK
    from .comm import _work

    _WORK = _work
    return _WORK


def release_done() -> int:
    """Let go of what ended groups of the calling thread (and of threads that ended)
    kept, once their streams have passed them; returns how many groups are still held.
    Never waits, and never disturbs another thread's CUDA-graph capture (see
    :mod:`pynccl.comm._held`). Group ends call it; call it to release sooner."""
    return _release(_local.s.held)


def _release(held: list[Any]) -> int:
    """:func:`release_done` for the thread whose ``held`` list this is (a group end has
    its state at hand: no second thread-local lookup)."""
    while _ORPHANS:
        held.append(_ORPHANS.pop())
    if held:
        (_HELD or _held()).release(held)
    return len(held)
