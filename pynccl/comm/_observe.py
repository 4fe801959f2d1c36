"""The communicator's observation side: the flight recorder, ``synchronize``, the
watchdog's interface (:class:`~._watchdog.Watched`), the CUDA-graph capture guard, and
what a capture must know (which :class:`pynccl.cuda.Graph` captured this communicator,
and the buffers its calls use, which the graph keeps alive)."""

from __future__ import annotations

import os
import sys
import time
from ctypes import byref, c_int

from .._adapt import as_stream
from .._capi._binding import arg_value, ptr_arg
from .._limits import check_count, check_timeout
from ..enums import Result
from ..errors import NcclError, NcclInvalidUsage, NcclTimeoutError, NotSupportedError
from . import _recorder
from ._handle import HANDLE, TERMINAL, CommHandle, State, live_handles

__all__ = ["Observed"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    import weakref
    from typing import Any

    from ..cuda import Graph
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
        "_graphs",
        "_raw_bfn",
        "_raw_fn",
        "_ring",
        "_seq",
        "_sites",
        "_stream",
    )

    _device: int | None
    _fn: list[Any]
    _raw_fn: list[Any]
    _bfn: list[Any]
    _raw_bfn: list[Any]
    _ring: list[object]
    _seq: int
    #: With PYNCCL_FLIGHT_STACKS=1: the call site ``(code, line)`` of each entry of the
    #: ring, else None.
    _sites: list[Any] | None
    _stream: int
    _cstream: object  # _stream as the fast path passes it (None: NULL; ptr_arg)
    #: The Graphs that captured calls of this communicator (a WeakSet, from the first one).
    _graphs: weakref.WeakSet[Graph] | None
    #: The CUDA-graph captures under way (pynccl.cuda.Graph's registry, bound by the
    #: first communicator made): the checked path tells the graph what it captured.
    _captures: dict[int, object] = {}

    if TYPE_CHECKING:

        def abort(self) -> None: ...  # Core's

    @property
    def rank(self) -> int:
        """This rank's index in the communicator."""
        return self._rank

    @property
    def state(self) -> State:
        """``"ready"``, ``"initializing"`` (non-blocking), ``"suspended"``, ``"revoked"``,
        ``"finalized"``, ``"destroyed"``, ``"aborted"`` or ``"closed"`` (a :class:`State`,
        equal to those strings)."""
        return self._state

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

    def flight_entries(self) -> list[tuple[_recorder.FlightRecord, int]]:
        """:meth:`flight_record` with the group number (0: none) each operation was issued
        in."""
        items = self.flight_record()
        return list(zip(items, _recorder.groups(self._ring, items)))

    def format_flight_record(self, last: int = 0) -> str:
        """The flight record as text (``last`` > 0: only the newest ``last`` entries; a
        non-negative int)."""
        last = check_count(last, "last")
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
        if not lead and error.message and not error.message.endswith((" ", "\n")):
            lead = ". "  # a sentence of its own, whatever the message ended with
        error.message += lead + self.format_flight_record(_recorder.SHORT)
        error.flight_record = record  # type: ignore[attr-defined]
        return error

    # -- waiting --------------------------------------------------------------------

    def synchronize(self, stream: StreamLike = None, timeout: float | None = None) -> None:
        """Wait for ``stream`` (default: :attr:`stream`) while watching for NCCL errors.

        The communicator's device is made current while waiting (the default streams
        0, legacy and per-thread are per device), then the caller's device is restored.
        The calling thread waits in relaxed CUDA-graph capture mode (its own mode is
        restored after), so waiting never breaks another thread's capture. Raises the
        communicator's asynchronous error as soon as it appears (e.g.
        :class:`~pynccl.NcclRemoteError` when a peer died). After ``timeout`` seconds —
        also while a non-blocking init is still in progress — it aborts the communicator
        and raises :class:`~pynccl.NcclTimeoutError` naming the last operations issued.
        A failure of the CUDA query itself raises without touching the communicator.
        """
        s = self._stream if stream is None else as_stream(stream)
        seconds = check_timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        if self._state is State.INITIALIZING:
            self.wait_ready(None if deadline is None else max(deadline - time.monotonic(), 1e-6))
        self._live()

        def timed_out(s: int) -> BaseException:
            error = NcclTimeoutError(
                Result.TIMEOUT,
                "synchronize",
                f"stream {s:#x} did not finish within {seconds:g} s; the communicator "
                f"was aborted. Last operation issued: {self.last_operation()}. ",
            )
            self._with_record(error)
            self.abort()
            return error

        from ._sync import sync_stream  # its CUDA waits: only when used

        sync_stream(s, lambda: self.device, deadline, self._raise_async_error, timed_out)
        if self._state is State.REVOKED:  # revoked meanwhile: its work was stopped, not done
            self._gone()
        # An error found after the stream drained gets the same flight record as one
        # found while waiting: which of the two happens is a matter of timing.
        self._raise_async_error()

    def _raise_async_error(self) -> None:
        """Raise the asynchronous error, if any: read without the gate (NCCL allows it from
        any thread at any time), so a call blocked in another thread never delays it."""
        result = self._async_result()
        if result is None:  # torn down meanwhile
            self._gone()
        if result not in (Result.SUCCESS, Result.IN_PROGRESS):
            raise self._with_record(self._lib.make_error(result, "ncclCommGetAsyncError"), ". ")

    #: The public name of the check (Work's waits use it): raise the asynchronous error.
    raise_async_error = _raise_async_error

    @property
    def flight_seq(self) -> int:
        """The number of the last operation issued (0: none yet), as the flight record
        numbers them."""
        return self._seq

    def sited(self, fn: Any) -> Any:
        """``fn`` (a bare C function of this communicator's library) noting the call site of
        each operation where ``PYNCCL_FLIGHT_STACKS=1``, as the call slots do; else ``fn``.
        For the calls that do not go through the slots (persistent ops, ``config=``)."""
        sites = self._sites
        return fn if sites is None else _sited(self, fn, sites)

    def _install_slots(self) -> None:
        """Each row's call slots for what is watched now: the watchdog's wrappers, which
        record a completion event (the hot path never tests for a watchdog), or the bare
        functions. While a CUDA-graph capture begun by :class:`pynccl.cuda.Graph` is under
        way, the fast path's slots (``_bfn``) are empty, so every call takes the checked
        path, which tells the graph what it captured (:meth:`note_capture`)."""
        watch = self._watch
        fn, bfn = list(self._raw_fn), list(self._raw_bfn)
        if watch is not None:
            fn = [None if f is None else _watched(self, f, watch) for f in fn]
            bfn = [None if f is None else _watched(self, f, watch) for f in bfn]
        sites = self._sites
        if sites is not None:
            fn = [None if f is None else _sited(self, f, sites) for f in fn]
            bfn = [None if f is None else _sited(self, f, sites) for f in bfn]
        self._fn = fn
        self._bfn = [None] * len(bfn) if self._captures else bfn

    def _init_handle(self, lib: Any, owner: bool) -> None:
        super()._init_handle(lib, owner)
        self._graphs = None
        self._sites = [None] * _recorder.RING_SIZE if STACKS else None

    def _adopted(self) -> None:
        if STACKS or DUMPS:
            from . import _flight

            _flight.adopted(self)
            if STACKS:
                self._install_slots()
        if not _HOOKED:
            _hook_captures()
        if self._captures:  # a capture began before this communicator existed
            self._install_slots()

    def note_capture(self, stream: int, keep: tuple[object, ...] = ()) -> None:
        """A call of this communicator issued on ``stream`` while a capture begun by
        :class:`pynccl.cuda.Graph` is under way: if ``stream`` is being captured, the
        capturing graph(s) keep ``keep`` (the call's buffers) alive until closed, and
        remember this communicator (which :meth:`destroy` must not destroy under them)."""
        if not self._captures:
            return
        from ..cuda._graph import capturing_graphs

        for graph in capturing_graphs(stream):
            graph._captured(self, keep)
            if self._graphs is None:
                import weakref

                self._graphs = weakref.WeakSet()
            self._graphs.add(graph)

    _note_capture = note_capture

    def _live_graphs(self) -> list[Graph]:
        """The live :class:`pynccl.cuda.Graph` objects that captured calls of this one."""
        graphs = self._graphs
        return [] if graphs is None else [g for g in list(graphs) if g.holds(self)]

    def _use_stream(self, stream: int) -> None:
        """Make ``stream`` (a handle) the default stream of every call (and its pointer
        argument, :func:`~pynccl._capi._binding.ptr_arg`, the fast path's)."""
        self._stream = stream
        self._cstream = ptr_arg(stream)

    # -- capture guard ---------------------------------------------------------------------

    def refuse_if_capturing(self, what: str) -> None:
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

    _refuse_if_capturing = refuse_if_capturing


_HOOKED = False
#: ``PYNCCL_FLIGHT_STACKS=1``: record the Python line that issued each operation (read
#: once, at import; costs a wrapper per call only then).
STACKS = os.environ.get("PYNCCL_FLIGHT_STACKS", "") == "1"
#: ``PYNCCL_FLIGHT_DIR`` set: install the dump triggers with the first communicator.
DUMPS = bool(os.environ.get("PYNCCL_FLIGHT_DIR"))


def _hook_captures() -> None:
    """Once, at the first communicator: be told when a :class:`pynccl.cuda.Graph` capture
    begins and ends (layer 4 cannot import this layer, so it calls back)."""
    global _HOOKED
    from ..cuda import _graph

    Observed._captures = _graph._ACTIVE  # type: ignore[assignment]
    if _on_capture not in _graph.CAPTURE_HOOKS:
        _graph.CAPTURE_HOOKS.append(_on_capture)
    _HOOKED = True


def _on_capture(begins: bool) -> None:
    """A capture began or ended: every live communicator's call slots follow."""
    for comm in live_handles():
        if isinstance(comm, Observed) and comm.state not in TERMINAL:
            comm._install_slots()


def _watched(comm: Observed, fn: Any, watch: Watchdog) -> Any:
    """``fn`` (a row's bare ctypes function) recording a completion event per operation
    (inside a group: once the group's outermost end launched it, see ``enqueued``)."""

    def call(*args: object) -> int:
        if watch.events.later:  # a non-blocking group launched (this call waited until ready):
            watch.events.launch_later()  # its events go before this operation's
        rc = int(fn(*args))
        if rc == 0 or rc == _IN_PROGRESS:
            stream = arg_value(args[-1])  # an int, or the fast path's pointer argument
            watch.enqueued(comm._seq, stream)  # type: ignore[arg-type]
        return rc

    return call


def _sited(comm: Observed, fn: Any, sites: list[Any]) -> Any:
    """``fn`` remembering the first frame outside pynccl that issued each operation, as
    ``(code, line)``: made text only when a record is read."""
    mask = _recorder.RING_MASK
    getframe = sys._getframe

    def call(*args: object) -> int:
        frame = getframe(1)
        while frame.f_code.co_filename.startswith(_PACKAGE) and frame.f_back is not None:
            frame = frame.f_back
        sites[comm._seq & mask] = (frame.f_code, frame.f_lineno)
        return int(fn(*args))

    return call


#: pynccl's directory (with its separator): frames under it are not call sites.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
