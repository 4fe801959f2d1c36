"""The watchdog's side of the communicator core: ``start_watchdog`` / ``stop_watchdog``
and the interface :class:`~._watchdog.Watchdog` calls (``watch_status``,
``watch_device``, ``watch_trip``), read without the gate."""

from __future__ import annotations

from _warnings import warn as _warn
from ctypes import byref, c_int

from ..enums import Result
from ..errors import NcclError, NcclInvalidUsage, NcclTimeoutError
from ._handle import HANDLE, TERMINAL, State
from ._observe import Observed

__all__ = ["Watched"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._watchdog import Watchdog as Watchdog

_IN_PROGRESS = 7


class Watched(Observed):
    """The watchdog's interface (a base of :class:`~._core.Core`)."""

    __slots__ = ()

    if TYPE_CHECKING:

        def _teardown(self, kind: str, reason: BaseException | None = None) -> None: ...

        def group_in_progress(self) -> None: ...  # Core's

    def start_watchdog(
        self, timeout: float, interval: float | None = None, *, on_hang: str = "abort"
    ) -> None:
        """Start a daemon thread that aborts this communicator when an operation hangs.

        An operation still incomplete ``timeout`` seconds after it was issued, an
        asynchronous NCCL error, or a non-blocking initialisation not done within
        ``timeout``, makes the watchdog abort the communicator and record why; the next
        call then raises that error. Costs a CUDA event record per operation.

        ``on_hang="revoke"`` (``ncclCommRevoke``, NCCL >= 2.28) revokes it instead, for a
        hung operation or an asynchronous error: the hung work stops, the communicator
        becomes ``"revoked"`` and the survivors can :meth:`shrink` it; the next other call
        raises the recorded error. A non-blocking initialisation (or call) still in
        progress after ``timeout`` is aborted either way.

        ``interval`` (seconds between looks; default a 20th of ``timeout``, between 5 ms
        and 1 s) and ``timeout`` must be positive, finite numbers. The thread reads the
        asynchronous error without the communicator's gate and queries in relaxed
        CUDA-graph capture mode, so neither a call blocked inside NCCL on another thread
        nor another thread's capture keeps it from watching; it also bounds
        :meth:`destroy` (see there).
        """
        if self._state in TERMINAL:
            self._gone()
        if self._watch is not None and self._watch.running:
            raise NcclInvalidUsage(Result.INVALID_USAGE, "", "the watchdog is already running")
        from ._watchdog import Watchdog  # its threading/weakref/atexit: only when used

        if on_hang == "revoke":
            self._require("start_watchdog(on_hang='revoke')", "ncclCommRevoke")
        watch = Watchdog(self, timeout, interval, on_hang)  # checks every argument first
        self._watch = watch
        self._install_slots()

    def stop_watchdog(self) -> None:
        """Stop the watchdog thread, if one runs."""
        watch = self._watch
        self._watch = None
        self._unwatch()
        if watch is not None:
            watch.stop()

    def _unwatch(self) -> None:
        """Every row's call slots back to the bare functions (the watchdog's are dropped)."""
        self._install_slots()

    def watch_status(self) -> tuple[bool, bool, BaseException | None]:
        """For the watchdog: ``(alive, ready, asynchronous error or None)``, read without
        the gate (a call blocked inside NCCL on another thread holds it). ``ready``: no
        non-blocking call in progress; the state itself is left to the issuing thread."""
        result = self._async_result()
        if result is None:  # torn down
            return False, False, None
        if result == Result.SUCCESS:
            return True, True, None
        if result == Result.IN_PROGRESS:
            return True, False, None
        error = self._lib.make_error(result, "ncclCommGetAsyncError")
        watch = self._watch
        verdict = "the watchdog aborted the communicator" if watch is None else watch.verdict
        return True, True, self._with_record(error, f"; {verdict}. ")

    def watch_device(self) -> int | None:
        """For the watchdog: the communicator's CUDA device (``ncclCommCuDevice`` once,
        without the gate, which the calling thread may hold); None once it is gone."""
        device = self._device
        if device is None:
            value = c_int(-1)
            with self._life:
                handle = self._handle
                if handle is None:
                    return None
                if self._lib.raw("ncclCommCuDevice")(handle, byref(value)):
                    return None
            device = self._device = value.value
        return device

    def watch_trip(self, reason: BaseException, revoke: bool = False) -> None:
        """For the watchdog: abort through the one teardown (or, with ``revoke``, revoke),
        recording ``reason`` (with the flight record: its last operations in the text,
        all of it as an attribute)."""
        if isinstance(reason, NcclError) and not hasattr(reason, "flight_record"):
            self._with_record(reason)
        if revoke and self._watch_revoke(reason):
            return
        self._teardown("watchdog", reason)

    def hang_verdict(self) -> str:
        """What :meth:`trip_hang` does to this communicator, as its errors word it."""
        watch = self._watch
        return "the communicator was aborted" if watch is None else watch.verdict

    def trip_hang(self, reason: BaseException) -> None:
        """An operation found hung by a caller (:meth:`pynccl.Work.wait`): what the
        watchdog does on a hang — through the running watchdog if there is one (its
        ``on_hang`` applies, and it stops), else an abort through the one teardown;
        ``reason`` is recorded for the next call and the flight record is dumped where
        ``PYNCCL_FLIGHT_DIR`` says."""
        from ._watchdog import trip

        if self._state not in TERMINAL:
            trip(self, reason, self._watch)

    def watch_tripped(self, reason: BaseException) -> None:
        """For the watchdog, once it has stopped after a trip: every rank's flight record is
        dumped where ``PYNCCL_FLIGHT_DIR`` says (:mod:`._flight`), if it says."""
        from . import _flight

        _flight.on_trip(reason)

    def _watch_revoke(self, reason: BaseException) -> bool:
        """``ncclCommRevoke`` from the watchdog thread; False (abort instead) if it failed.
        Never raises: nothing on that thread would see it. A communicator the user revoked
        meanwhile is left as it is, for shrink."""
        watch = self._watch
        try:
            state = self._state
            if self._closing is not None or state not in (State.READY, State.REVOKED):
                return False
            rc = 0
            if state is State.READY:
                self._error = reason  # what the next call raises (a teardown would set it too)
                rc = self._call_locked("ncclCommRevoke", HANDLE, 0, then=State.REVOKED)
            self._watch = None
            self._unwatch()
            if rc == _IN_PROGRESS:  # non-blocking: wait until quiescent, bounded
                self.wait_ready(None if watch is None else watch.timeout)
        except Exception:  # reported through the abort that follows
            return self._state is State.REVOKED
        return True

    def _destroy_kind(self) -> tuple[str, BaseException | None]:
        """What ``destroy()`` does: ``("destroy", None)``, or ``("abort", why)``.

        * NCCL's destroy waits until every CUDA graph that captured the communicator is
          destroyed: with a live :class:`pynccl.cuda.Graph` that did, it would block
          for ever, so :class:`~pynccl.NcclInvalidUsage` names the graphs instead.
        * After ``shrink(..., abort=True)`` the parent is aborted: from NCCL 2.31.2 on,
          its destroy waits in a barrier for ranks that aborted (pytorch#194775).
        * With a watchdog, the work it watches is waited for, each operation until the
          watchdog's timeout after its issue; one still incomplete then makes it abort
          (a RuntimeWarning names it; :attr:`error` holds the NcclTimeoutError), since
          ``ncclCommDestroy`` would wait for it for ever.
        """
        if not self._owner:  # a borrowed handle is only forgotten: nothing waits
            return "destroy", None
        graphs = self._live_graphs()
        if graphs:
            names = ", ".join(repr(g) for g in graphs)
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "ncclCommDestroy",
                f"cannot destroy communicator rank {self._rank}: {len(graphs)} live CUDA "
                f"graph(s) captured its calls ({names}); NCCL's destroy waits until they "
                "are destroyed: close them first (Graph.close()), or abort() (which closes them)",
            )
        if self._shrunk:
            return "abort", None
        watch = self._watch
        if watch is None or self._state is not State.READY:
            return "destroy", None
        self._watch = None
        self._unwatch()
        hung = watch.drain()
        if hung is None:
            return "destroy", None
        seq, waited = hung
        error = NcclTimeoutError(
            Result.TIMEOUT,
            self.describe(seq),
            f"destroy(): operation #{seq} ({self.describe(seq)}) did not complete within "
            f"the watchdog's {watch.timeout:g} s (waited {waited:.3g} s since it was "
            "issued), so the communicator was aborted instead of destroyed",
        )
        self._with_record(error)
        _warn(str(error), RuntimeWarning, stacklevel=3)
        return "abort", error
