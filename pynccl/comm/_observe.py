"""The communicator's observation side: the flight recorder, ``synchronize``, the
watchdog's interface (:class:`~._watchdog.Watched`) and the CUDA-graph capture guard."""

from __future__ import annotations

import time
from ctypes import byref, c_int, c_void_p

from .._adapt import as_stream
from .._limits import check_timeout
from ..enums import Result
from ..errors import NcclError, NcclInvalidUsage, NcclTimeoutError, NotSupportedError
from ..library import cudart
from . import _recorder
from ._handle import HANDLE, TERMINAL, CommHandle, State
from ._memos import empty_memos as _empty_memos

__all__ = ["Observed"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..typing import StreamLike
    from ._watchdog import Watchdog

_IN_PROGRESS = 7


class Observed(CommHandle):
    """Recorder, synchronize, watchdog and capture guard (a base of Communicator)."""

    __slots__ = (
        "_bfn",
        "_cstream",
        "_device",
        "_fn",
        "_memo",
        "_raw_bfn",
        "_raw_fn",
        "_ring",
        "_seq",
        "_stream",
    )

    _device: int | None
    _fn: list[Any]
    _raw_fn: list[Any]
    _bfn: list[Any]
    _raw_bfn: list[Any]
    _memo: list[tuple[object, ...]]  # every row's memos: see _memos.ARRAYS
    _ring: list[object]
    _seq: int
    _stream: int
    _cstream: c_void_p  # _stream as the generated calls pass it

    def abort(self) -> None:
        raise NotImplementedError  # pragma: no cover - Communicator defines it

    @property
    def rank(self) -> int:
        """This rank's index in the communicator."""
        return self._rank

    @property
    def device(self) -> int:
        """The CUDA device of this communicator (``ncclCommCuDevice``)."""
        if self._device is None:
            value = c_int()
            self._call_locked("ncclCommCuDevice", HANDLE, byref(value))
            self._device = value.value
        return self._device

    # -- the flight recorder --------------------------------------------------------------

    def flight_record(self) -> list[_recorder.FlightRecord]:
        """The last operations issued (oldest first): ``(seq, function, root/peer, args)``,
        numbered from #1."""
        return _recorder.record(self._ring, self._seq)

    def format_flight_record(self, last: int = 0) -> str:
        """The flight record as text (``last`` > 0: only the newest ``last`` entries)."""
        items = self.flight_record()
        marks = _recorder.groups(self._ring, items)
        return _recorder.format_lines(items, self._rank, self._size, last, marks)

    def describe(self, seq: int) -> str:
        """The C function of operation ``seq``, or ``"operation"`` if no longer recorded."""
        item = _recorder.entry(self._ring, self._seq, seq)
        return "operation" if item is None else item[1]

    _describe = describe

    def last_operation(self) -> str:
        """The last operation issued, as text (``"none"`` before the first)."""
        item = _recorder.entry(self._ring, self._seq, self._seq) if self._seq else None
        return "none" if item is None else _recorder.format_record(item)

    def _with_record(self, error: NcclError, lead: str = "") -> NcclError:
        """``error`` with a short record in its text (the last few operations, readable in
        a terminal) and the whole record as its ``flight_record`` attribute."""
        record = self.flight_record()
        error.message += lead + self.format_flight_record(_recorder.SHORT)
        error.flight_record = record  # type: ignore[attr-defined]
        return error

    # -- waiting, and the watchdog ---------------------------------------------------------

    def synchronize(self, stream: StreamLike = None, timeout: float | None = None) -> None:
        """Wait for ``stream`` (default: :attr:`stream`) while watching for NCCL errors.

        The communicator's device is made current while waiting (the default streams
        0, legacy and per-thread are per device), then the caller's device is restored.
        Raises the communicator's asynchronous error as soon as it appears
        (e.g. :class:`~pynccl.NcclRemoteError` when a peer died). After
        ``timeout`` seconds — also while a non-blocking init is still in progress — it
        aborts the communicator and raises :class:`~pynccl.NcclTimeoutError` naming
        the last operations issued.
        """
        s = self._stream if stream is None else as_stream(stream)
        seconds = check_timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        if self._state is State.INITIALIZING:
            self.wait_ready(None if deadline is None else max(deadline - time.monotonic(), 1e-6))
        self._live()
        from ..cuda import _capture_blocks, _unsafe_calls_prohibited

        if _capture_blocks(s):
            # cudaStreamQuery would fail and invalidate the capture: nothing captured has
            # run yet, so there is nothing to wait for either.
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "synchronize",
                f"stream {s:#x} is being captured into a CUDA graph: its work runs when "
                "the graph is launched; end the capture, launch the graph, then synchronize",
            )
        if _unsafe_calls_prohibited():  # waiting on s would invalidate that other capture
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "synchronize",
                "a CUDA graph capture is in progress on another stream (pynccl.cuda.Graph): "
                "synchronizing now would invalidate it; synchronize after the capture ends",
            )
        rt = cudart()
        current = c_int(-1)
        rt.raw("cudaGetDevice")(byref(current))
        device = self.device
        if current.value != device:
            rt.cudaSetDevice(device)
        try:
            self._wait_stream(rt, s, deadline, seconds)
        finally:
            if current.value != device and current.value >= 0:
                rt.raw("cudaSetDevice")(current.value)
        if self._state is State.REVOKED:  # revoked meanwhile: its work was stopped, not done
            self._gone()
        # An error found after the stream drained gets the same flight record as one
        # found while waiting: which of the two happens is a matter of timing.
        self._raise_async_error()

    def _wait_stream(self, rt: Any, s: int, deadline: float | None, seconds: float | None) -> None:
        query = rt.raw("cudaStreamQuery")
        delay = 0.0
        while True:
            rc = query(s)
            if rc == 0:
                return
            if rc != 600:
                raise rt.make_error(rc, "cudaStreamQuery")
            self._raise_async_error()
            if deadline is not None and time.monotonic() >= deadline:
                last = self.last_operation()
                error = NcclTimeoutError(
                    Result.TIMEOUT,
                    "synchronize",
                    f"stream {s:#x} did not finish within {seconds:g} s; the communicator "
                    f"was aborted. Last operation issued: {last}. ",
                )
                self._with_record(error)
                self.abort()
                raise error
            time.sleep(delay)
            delay = min(delay * 2 or 0.0001, 0.005)

    def _raise_async_error(self) -> None:
        result = self.get_async_error()
        if result not in (Result.SUCCESS, Result.IN_PROGRESS):
            raise self._with_record(self._lib.make_error(result, "ncclCommGetAsyncError"), ". ")

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
        raises the recorded error. A non-blocking initialisation that never completes is
        aborted either way.
        """
        if self._state in TERMINAL:
            self._gone()
        if self._watch is not None and self._watch.running:
            raise NcclInvalidUsage(Result.INVALID_USAGE, "", "the watchdog is already running")
        from ._watchdog import Watchdog  # its threading/weakref/atexit: only when used

        if on_hang == "revoke":
            self._require("start_watchdog(on_hang='revoke')", "ncclCommRevoke")
        watch = Watchdog(self, timeout, interval, on_hang)
        self._watch = watch
        # Every row's slot gets a wrapper that records a completion event (the hot path
        # never tests for a watchdog).
        self._fn = [None if fn is None else _watched(self, fn, watch) for fn in self._raw_fn]
        self._bfn = [None if fn is None else _watched(self, fn, watch) for fn in self._raw_bfn]
        self._forget_memos()  # they hold the bare functions

    def stop_watchdog(self) -> None:
        """Stop the watchdog thread, if one runs."""
        watch = self._watch
        self._watch = None
        self._unwatch()
        if watch is not None:
            watch.stop()

    def _unwatch(self) -> None:
        """Every row's call slots back to the bare functions (the watchdog's are dropped)."""
        self._fn = list(self._raw_fn)
        self._bfn = list(self._raw_bfn)
        self._forget_memos()  # they hold the watchdog's wrappers

    def _use_stream(self, stream: int) -> None:
        """Make ``stream`` (a handle) the default stream of every call: the generated
        calls' shared c_void_p of it too, and their memos are forgotten (their C
        arguments hold the previous one)."""
        self._stream = stream
        self._cstream = c_void_p(stream)
        self._forget_memos()

    def _forget_memos(self) -> None:
        """Forget each row's memos of its last raw-pointer, DeviceBuffer and interface
        calls (``_memos.memo_hit``): what they were built from (the size, the stream, the
        row's function) changed — changed before this is called, so that a call that read
        the old values stores into the list replaced here (``_memos.ARRAYS``)."""
        self._memo = _empty_memos()

    def watch_status(self) -> tuple[bool, bool, BaseException | None]:
        """For the watchdog: ``(alive, ready, asynchronous error or None)``."""
        if self._state in TERMINAL:
            return False, False, None
        try:
            result = self.get_async_error()
        except NcclInvalidUsage:  # torn down meanwhile
            return False, False, None
        if result in (Result.SUCCESS, Result.IN_PROGRESS):
            ready = result == Result.SUCCESS and self._state is not State.INITIALIZING
            if result == Result.SUCCESS and self._state is State.INITIALIZING:
                self.wait_ready()
                ready = True
            return True, ready, None
        error = self._lib.make_error(result, "ncclCommGetAsyncError")
        watch = self._watch
        verdict = "the watchdog aborted the communicator" if watch is None else watch.verdict
        return True, True, self._with_record(error, f"; {verdict}. ")

    def watch_trip(self, reason: BaseException, revoke: bool = False) -> None:
        """For the watchdog: abort through the one teardown (or, with ``revoke``, revoke),
        recording ``reason`` (with the flight record: its last operations in the text,
        all of it as an attribute)."""
        if isinstance(reason, NcclError) and not hasattr(reason, "flight_record"):
            self._with_record(reason)
        if revoke and self._watch_revoke(reason):
            return
        self._teardown("watchdog", reason)

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

    # -- capture guard ---------------------------------------------------------------------

    def _refuse_if_capturing(self, what: str) -> None:
        """Init, split and register cannot be captured in a CUDA graph: say so clearly,
        before they call anything that would invalidate the capture."""
        try:
            from ..cuda import _capture_blocks, _unsafe_calls_prohibited

            # The legacy default stream (0) answers for the blocking streams of the device;
            # pynccl.cuda's registry for captures on other (non-blocking) streams.
            own = self._stream not in (0, 1) and _capture_blocks(self._stream)
            if not own and not _capture_blocks(0) and not _unsafe_calls_prohibited():
                return
        except (OSError, NcclError, NotSupportedError):  # no usable libcudart: nothing to check
            return
        where = (
            f"stream {self._stream:#x} is being captured"
            if own
            else "a stream of this device is being captured"
        )
        raise NcclInvalidUsage(
            Result.INVALID_USAGE,
            "",
            f"{what} cannot run while {where} into a CUDA graph; do it before the capture begins",
        )


def _watched(comm: Observed, fn: Any, watch: Watchdog) -> Any:
    """``fn`` (a row's bare ctypes function) recording a completion event per operation."""

    def call(*args: object) -> int:
        rc = int(fn(*args))
        if rc == 0 or rc == _IN_PROGRESS:
            stream = args[-1]  # an int (the slow path), or the generated calls' c_void_p
            if type(stream) is c_void_p:
                stream = stream.value or 0
            watch.enqueued(comm._seq, stream)  # type: ignore[arg-type]
        return rc

    return call
