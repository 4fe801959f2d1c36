"""The communicator's one state machine and its gate (the base of :class:`~._core.Core`,
which holds the one teardown).

* :class:`State` (:mod:`._state`) lists the states; :meth:`CommHandle._set_state` is the
  only code that assigns one, and it keeps ``_h`` (the handle calls may use) equal to
  the handle in state READY and None in every other state, so the hot path tests one
  attribute.
  ``_h`` is the handle as a pointer argument (:func:`pynccl._capi._binding.pointer_arg`),
  made once when the handle is adopted: what the fast path passes to functions without
  argtypes (no argument object made per call), and what functions with ``c_void_p``
  argtypes take as readily as an int (``_handle`` is the int).
* The *gate* is held around every C call that passes the handle, and by the teardown
  while it retires the handle: a communicator destroyed or aborted by another thread
  mid-call never hands a destroyed handle to C, and two threads issuing on one
  communicator are serialized. Uncontended, it is a one-token list (``[True]``):
  ``pop()`` takes the token, ``append(True)`` gives it back — each one C call, atomic
  under the GIL (and under the per-object lock of a free-threaded build), about a third
  of what ``Lock.acquire(False)``/``release()`` cost. A call that finds the token gone
  queues in :meth:`CommHandle._wait_gate`, first come first served: while anyone
  queues, ``_gate`` is a :class:`_Queued` stand-in whose ``pop()`` finds nothing, so
  every new call queues too instead of snatching the token as it comes back (a thread
  calling in a loop would otherwise starve the others); the queue's head takes the token
  from the list, and the list is the gate again once the queue is empty. A wait is
  bounded: after :attr:`CommHandle.GATE_TIMEOUT` it raises
  :class:`~pynccl.NcclInvalidUsage` instead of waiting silently.
* A teardown first marks the communicator *closing* (``_h`` becomes None), then waits
  for the token: calls that start after the mark refuse without taking the token, so
  a thread calling in a tight loop cannot starve a destroy or abort from another one.
* ``ncclCommGetAsyncError`` may be called from any thread at any time (NCCL's own
  watchdog pattern): :meth:`CommHandle._async_result` reads it without the gate, under a
  small lock (``_life``) that the teardown also takes to retire the handle, just before
  the C call that frees it — so a watchdog never waits behind a call blocked inside NCCL
  (a finalize, a first collective, a full work queue) and never uses a freed handle.
* ``Core._teardown`` is the one teardown: ``destroy``, ``abort``, ``close`` and the
  watchdog all go through it.
"""

from __future__ import annotations

import time
from _thread import allocate_lock
from ctypes import byref, c_int, c_void_p

from .._capi._binding import pointer_arg
from ..enums import Result
from ..errors import NcclInvalidUsage, NcclTimeoutError
from ._state import GONE_TAILS, HANDLE, TERMINAL, State, live_handles, track

__all__ = ["HANDLE", "TERMINAL", "CommHandle", "State", "live_handles"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

    from .._capi.nccl import NcclLibrary
    from ._watchdog import Watchdog


_POLL_FIRST = 0.0005
_POLL_MAX = 0.01
_GATE_POLL_MAX = 0.001

class _Queued:
    """The gate while threads queue for it (see the module doc): ``pop()`` finds no token
    (the fast path's ``except IndexError`` then queues them), ``append()`` gives the
    token back to the list and wakes the queue's head, which takes it."""

    __slots__ = ("_lock", "_queue", "_tokens")

    def __init__(self, tokens: list[bool], queue: list[Any], lock: Any) -> None:
        self._tokens = tokens
        self._queue = queue
        self._lock = lock

    def pop(self) -> bool:
        raise IndexError("the gate is queued for")

    def append(self, token: bool) -> None:
        self._tokens.append(token)
        with self._lock:
            _wake(self._queue)


def _wake(queue: list[Any]) -> None:
    """Wake the queue's head (its ticket is a lock it waits on); under the queue's lock,
    the only place tickets are released."""
    if queue and queue[0].locked():
        queue[0].release()


class CommHandle:
    """The handle, its state and its gate (the base of :class:`~pynccl.Communicator`)."""

    __slots__ = (
        "__weakref__",
        "_closing",
        "_error",
        "_gate",
        "_h",
        "_handle",
        "_harg",
        "_lib",
        "_life",
        "_owner",
        "_qlock",
        "_queue",
        "_queued",
        "_rank",
        "_shrunk",
        "_size",
        "_state",
        "_tokens",
        "_watch",
    )

    #: Seconds a call waits for another thread's call on the same communicator to return
    #: before raising NcclInvalidUsage (calls only enqueue work: they return quickly).
    GATE_TIMEOUT = 10.0

    _h: c_void_p | None
    _handle: int | None
    _harg: c_void_p | None  # a pointer argument, which passes wherever a c_void_p does
    _lib: NcclLibrary
    _rank: int
    _size: int
    _watch: Watchdog | None

    def _init_handle(self, lib: NcclLibrary, owner: bool) -> None:
        self._lib = lib
        self._owner = owner
        self._h = None
        self._handle = None
        self._harg = None
        self._state = State.INITIALIZING
        self._tokens: list[bool] = [True]
        #: What calls take the token from: ``_tokens``, or ``_queued`` while threads queue.
        self._gate: list[bool] | _Queued = self._tokens
        self._queue: list[Any] = []  # the waiting calls' tickets (locks), first come first
        self._qlock = allocate_lock()
        self._queued = _Queued(self._tokens, self._queue, self._qlock)
        self._life = allocate_lock()  # retiring the handle vs. a gate-free async-error read
        self._closing: str | None = None
        self._error: BaseException | None = None
        self._watch = None
        #: Shrunk with NCCL_SHRINK_ABORT: its destroy() aborts (see Watched._destroy_kind).
        self._shrunk = False

    # -- the one place that changes state --------------------------------------------------

    def _set_state(self, state: State) -> None:
        self._state = state
        ready = state is State.READY and self._closing is None
        self._h = self._harg if ready else None

    def _adopt(self, handle: int | None, pending: bool) -> None:
        """Take ``handle`` from an init/split: READY, or INITIALIZING if non-blocking."""
        if not handle:
            from ..errors import NcclError

            raise NcclError(
                Result.INTERNAL_ERROR, "ncclCommInit", "NCCL returned a NULL communicator"
            )
        self._handle = handle
        self._harg = pointer_arg(handle)
        self._set_state(State.INITIALIZING if pending else State.READY)
        track(self)
        self._adopted()

    def _adopted(self) -> None:
        """Called once a handle is adopted (:class:`~._observe.Observed` installs its
        call slots for a CUDA-graph capture under way)."""

    def mark_pending(self) -> None:
        """A non-blocking call returned ncclInProgress: poll before the next call."""
        if self._state is State.READY:
            self._set_state(State.INITIALIZING)


    _mark_pending = mark_pending
    # -- the gate ------------------------------------------------------------------------

    def _wait_gate(self) -> None:
        """The token is taken (another thread's call, or a teardown): queue for it, bounded."""
        if self._take_gate(self.GATE_TIMEOUT):
            return
        raise NcclInvalidUsage(
            Result.INVALID_USAGE,
            "",
            f"communicator rank {self._rank} is in use by another thread whose call has "
            f"not returned after {self.GATE_TIMEOUT:g} s; a communicator's calls are "
            "serialized: issue from one thread, or use one communicator per thread",
        )

    def _take_gate(self, timeout: float) -> bool:
        """Take the gate's token within ``timeout`` seconds, after every call that queued
        before this one (first come, first served); False if not."""
        tokens, queue = self._tokens, self._queue
        ticket = allocate_lock()
        ticket.acquire()  # released (under _qlock) to wake this call when it is the head
        with self._qlock:
            if not queue:
                try:
                    tokens.pop()
                    return True
                except IndexError:
                    pass
            queue.append(ticket)
            if self._gate is tokens:  # calls from now on find no token: they queue too
                self._gate = self._queued
        deadline = time.monotonic() + timeout
        try:
            while True:
                if queue[0] is ticket:
                    try:
                        tokens.pop()
                        return True
                    except IndexError:
                        pass
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # Woken when the token comes back through the stand-in; a call that bound
                # the list before the queue formed gives it back unseen: look again soon.
                ticket.acquire(True, min(remaining, _GATE_POLL_MAX))
        finally:
            with self._qlock:
                queue.remove(ticket)
                _wake(queue)  # the next head (the token may be waiting already)
                if not queue and self._gate is not tokens:
                    self._gate = tokens

    def gone(self) -> NoReturn:
        """Raise why there is no handle to call with."""
        if self._error is not None:
            raise self._error
        state = self._state
        if self._closing is not None and state not in TERMINAL:
            what = "being " + ("destroyed" if self._closing == "destroy" else "aborted")
            tail = "it cannot be used any more"
        else:
            what = state.value
            tail = GONE_TAILS.get(state, "it cannot be used any more")
        raise NcclInvalidUsage(
            Result.INVALID_USAGE, "", f"communicator rank {self._rank} is {what}; {tail}"
        )


    _gone = gone
    def live(self, timeout: float | None = None) -> c_void_p:
        """The handle for a call, waiting (up to ``timeout`` seconds, None: as long as it
        takes) for a non-blocking communicator if needed."""
        h = self._h
        if h is not None:
            return h
        if self._state is State.INITIALIZING and self._error is None:
            self.wait_ready(timeout)
            if self._h is not None:
                return self._h
        return self._gone()


    _live = live
    def under_gate(self, fn: Callable[[Any], Any], *, ready: bool = True) -> Any:
        """``fn(handle)`` under the gate, returning what it returns: the one way a call
        outside the fast path gets the handle (read under the gate, so a teardown
        on another thread never hands a freed one to C). With ``ready=False`` the raw
        handle is used in any non-terminal state (async-error queries during init)."""
        gate = self._gate
        try:
            gate.pop()
        except IndexError:
            self._wait_gate()
        try:
            h = self._h if ready else (None if self._closing else self._handle)
            if h is None:
                h = self._gone()
            return fn(h)
        finally:
            gate.append(True)


    _under_gate = under_gate
    def call_locked(
        self,
        function: str,
        *args: object,
        ready: bool = True,
        then: State | None = None,
        timeout: float | None = None,
    ) -> int:
        """A C call outside the hot path, checked, under the gate; the handle replaces
        :data:`HANDLE` in ``args``. With ``ready=False`` the
        raw handle is used in any non-terminal state (async-error queries during init);
        with ``ready=True`` a non-blocking communicator still in progress is waited for,
        up to ``timeout`` seconds (None: as long as it takes).
        ``then``: the state the communicator enters through this call. A state without a
        handle (suspended, revoked) is entered just before the C call, so that calls
        starting meanwhile refuse and a wait that sees the work stopped sees the new state
        too; it is undone if the call fails. READY is entered once the call succeeded,
        before the gate is given back, so that no other thread's call slips in between."""
        if ready:
            self._live(timeout)
        raw = self._lib.raw(function)

        def call(h: object) -> int:
            call_args = tuple(h if a is HANDLE else a for a in args)
            before, early, ok = self._state, False, False
            if then is not None and then is not State.READY:
                self._set_state(then)
                early = True
            try:
                rc = int(raw(*call_args))
                ok = rc == 0 or rc == Result.IN_PROGRESS
            finally:
                if early and not ok:
                    self._set_state(before)
                elif then is not None and ok and not early:
                    self._set_state(then)
            return rc

        rc: int = self._under_gate(call, ready=ready)
        if rc and rc != Result.IN_PROGRESS:
            raise self._lib.make_error(rc, function)
        return rc


    _call_locked = call_locked
    def require(self, method: str, function: str) -> None:
        """NotSupportedError naming ``method``, ``function`` and the release that added
        it, when the loaded library predates that release."""
        lib = self._lib
        lib.require(f"Communicator.{method} ({function})", lib.PROTOTYPES[function].first)


    _require = require
    # -- readiness -------------------------------------------------------------------------

    def get_async_error(self) -> Result:
        """``ncclCommGetAsyncError``: ``SUCCESS``, ``IN_PROGRESS`` or the error of the comm."""
        value = c_int()
        self._call_locked("ncclCommGetAsyncError", HANDLE, byref(value), ready=False)
        try:
            return Result(value.value)
        except ValueError:
            return value.value  # type: ignore[return-value]

    def _async_result(self) -> int | None:
        """``ncclCommGetAsyncError`` without the gate (NCCL allows it from any thread at
        any time): the raw result code, or None once the handle is retired. ``_life``
        keeps the teardown from freeing the handle while the query runs."""
        value = c_int()
        with self._life:
            handle = self._handle
            if handle is None or self._state in TERMINAL:
                return None
            rc = int(self._lib.raw("ncclCommGetAsyncError")(handle, byref(value)))
        if rc:
            raise self._lib.make_error(rc, "ncclCommGetAsyncError")
        return value.value

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll ``ncclCommGetAsyncError`` until a non-blocking call completes.

        Raises the asynchronous error if one occurred, and
        :class:`~pynccl.NcclTimeoutError` after ``timeout`` seconds.
        """
        from .._limits import check_timeout

        seconds = check_timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        delay = _POLL_FIRST
        while True:
            if self._state is State.READY:
                return
            result = self.get_async_error()
            if result == Result.SUCCESS:
                if self._state is State.INITIALIZING:
                    self._set_state(State.READY)
                return
            if result != Result.IN_PROGRESS:
                raise self._lib.make_error(result, "ncclCommGetAsyncError")
            if deadline is not None and time.monotonic() >= deadline:
                raise NcclTimeoutError(
                    Result.TIMEOUT,
                    "ncclCommGetAsyncError",
                    f"communicator rank {self._rank} not ready after {seconds:g} s",
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)
