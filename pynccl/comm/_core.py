"""The communicator's core, :class:`Core`: the handle, the gate and the state machine
(:class:`~._handle.CommHandle`), the flight record, ``synchronize``, the watchdog slots and
the capture guard (:class:`~._observe.Observed`), and here the properties, the lifecycle
verbs and the one teardown. :class:`~pynccl.Communicator` subclasses it.

The rest of the communicator is *parts* (memory, windows, signals, suspend, resilience,
v-collectives, split and custom ops, introspection): plain objects that hold the core and
use only this surface, never its private state:

* ``library``, ``handle``, ``rank``, ``size``, ``device``, ``stream``, ``state``,
  ``usable`` (a call may use the handle now), ``wait_ready()``, ``synchronize()``;
* ``live()``: the handle for a call, waiting for a non-blocking init; ``gone()`` raises
  why there is none;
* ``call_locked(function, *args)``: one checked C call under the gate (:data:`HANDLE`
  stands for the handle); ``under_gate(fn)``: ``fn(handle)`` under the gate;
* ``require(method, function)``, ``refuse_if_capturing(what)``, ``datatype(dtype)``;
* ``mark_pending()`` (a non-blocking call is in progress), ``note_capture(stream, keep)``
  (a call a capturing graph must keep alive), ``abort_at_destroy()`` (after a shrink
  with abort);
* ``on_close(hook)``: ``hook(abort)`` runs before ``destroy``/``abort`` retire the
  handle (windows, registrations); ``on_retire(hook)``: ``hook(kind)`` runs once the
  handle is retired, by any teardown (the buffers parts own). The one way the core
  calls parts back.

The hot path reads the core's private attributes straight off the instance (``_h``,
``_gate``, ``_seq``, ``_ring`` ...): their names and meaning stay.
"""

from __future__ import annotations

import time
from _warnings import warn as _warn

from .. import groups as _groups
from .._adapt import as_stream
from .._limits import check_timeout
from ..dtypes import as_datatype
from ..enums import DataType, Result
from ..errors import NcclInvalidUsage, NotSupportedError
from ._handle import HANDLE, TERMINAL, State
from ._watched import Watched

__all__ = ["Core"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType
    from typing import Any, NoReturn, Self, TypeVar

    T = TypeVar("T")

    from .._capi.nccl import NcclLibrary
    from ..typing import DTypeLike, StreamLike
    from ._communicator import Communicator


class Core(Watched):
    """Handle, gate, state, flight record, watchdog slots and library (the base of
    :class:`~pynccl.Communicator`); the surface its parts use is in the module doc."""

    __slots__ = ("_closers", "_codes", "_retirers", "_stream_ref")

    #: The ncclDataType_t argument of each type the library accepts; None: too old.
    _codes: dict[DataType, DataType | None]

    def _init_handle(self, lib: NcclLibrary, owner: bool) -> None:
        super()._init_handle(lib, owner)
        self._closers: list[Callable[[bool], None]] = []
        self._retirers: list[Callable[[str], None]] = []

    # -- the parts' hooks -----------------------------------------------------------------

    def on_close(self, hook: Callable[[bool], None]) -> None:
        """Call ``hook(abort)`` before ``destroy()`` (``abort=False``) or ``abort()``
        retires the handle, in the order registered; each runs even if one before raised."""
        self._closers.append(hook)

    def on_retire(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(kind)`` once a teardown (``kind``: ``"destroy"``, ``"abort"`` or
        ``"watchdog"``) has retired the handle; on the watchdog thread a hook must not
        raise."""
        self._retirers.append(hook)

    def abort_at_destroy(self) -> None:
        """Make :meth:`destroy` abort (after ``shrink(..., abort=True)``: from NCCL 2.31.2
        on, a destroy would wait in a barrier for the ranks that aborted)."""
        self._shrunk = True

    def datatype(self, dtype: DTypeLike) -> DataType:
        """``dtype`` as a :class:`~pynccl.DataType`, refused with
        :class:`~pynccl.NotSupportedError` if the loaded library predates it."""
        dt = as_datatype(dtype)
        if self._codes[dt] is None:
            raise NotSupportedError(f"data type {dt.c_name}", dt.first_release, self._lib.version)
        return dt

    # -- construction, pickling, repr -----------------------------------------------------

    @classmethod
    def from_env(cls, **kwargs: Any) -> Communicator:
        """This process's communicator from its launcher's environment.

        The launcher's variables (torchrun, ``python -m pynccl launch``, torch's
        ``env://``, Open MPI, MVAPICH2, Cray PALS, MPICH / Intel MPI, Slurm steps,
        LeaderWorkerSet, indexed Jobs / JobSet), or ``rank=`` and ``world_size=``, give
        rank, world size and device; the unique id travels over TCP
        (``MASTER_ADDR:MASTER_PORT``, authenticated with ``PYNCCL_RENDEZVOUS_KEY``),
        torchrun's own store, a ``store=``, an ``mpi_comm=`` or a ``file=``. Keyword
        arguments as :func:`pynccl.bootstrap.from_env` (``timeout``, ``store``,
        ``mpi_comm``, ``file``, ``config``, ``nids``, ``device``, ``rank``, ...).
        """
        # Through the public facade, which loads ._from_env lazily: ._from_env builds a
        # Communicator, so a direct import would close an import cycle.
        from ..bootstrap import from_env

        return from_env(**kwargs)  # type: ignore[no-any-return]

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        # pickle and copy both come here: a copy would own (and destroy) the same handle
        raise TypeError(
            "a Communicator cannot be pickled or copied: it is this process's handle to "
            "NCCL state on its GPU, which no other process can use. Send what creates one "
            "instead (the UniqueId it was made from, which pickles, or bytes(uid); the "
            "rank; the world size) and call Communicator(world_size, uid, rank) in the "
            "receiving process"
        )

    def __repr__(self) -> str:
        return (
            f"<pynccl.Communicator rank {self._rank}/{self._size} device {self._device} "
            f"{self._state}{'' if self._owner else ' (borrowed)'}>"
        )


    # -- properties -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._size

    @property
    def handle(self) -> int:
        """The ``ncclComm_t`` as an int (for the low-level layer or other bindings)."""
        if self._handle is None:
            raise NcclInvalidUsage(Result.INVALID_USAGE, "", f"communicator is {self._state}")
        return self._handle

    @property
    def stream(self) -> int:
        """The default stream handle for this communicator's calls (0 = legacy default).

        Set it to any stream-like (``None``: the legacy default stream). A stream object
        (a :class:`~pynccl.cuda.Stream`, or any object owning its stream: a
        ``__cuda_stream__`` provider, a torch or CuPy stream) is kept referenced while it
        is the default, so the stream is not destroyed underneath the communicator; a
        child made by :meth:`split` keeps it too."""
        return self._stream

    @stream.setter
    def stream(self, value: StreamLike) -> None:
        self._keep_stream(value)

    def _keep_stream(self, value: StreamLike) -> None:
        """Make ``value`` the default stream, keeping the object that owns it (an int
        handle owns nothing: its stream is the caller's to keep)."""
        self._use_stream(0 if value is None else as_stream(value))
        self._stream_ref = None if value is None or type(value) is int else value

    @property
    def usable(self) -> bool:
        """True while a call may use the handle now: ready, and not being torn down."""
        return self._h is not None

    @property
    def library(self) -> NcclLibrary:
        """The low-level library this communicator calls."""
        return self._lib

    @property
    def error(self) -> BaseException | None:
        """The error the watchdog recorded when it aborted this communicator, if any."""
        return self._error

    # -- lifecycle -----------------------------------------------------------------------

    def check(self) -> None:
        """Raise the communicator's asynchronous error, if any."""
        result = self.get_async_error()
        if result not in (Result.SUCCESS, Result.IN_PROGRESS):
            raise self._lib.make_error(result, "ncclCommGetAsyncError")

    def group_in_progress(self) -> None:
        """Called by :func:`pynccl.group_end` when the group is still in progress
        (non-blocking communicators): the next call waits for this one to be ready."""
        self._mark_pending()

    def finalize(self, timeout: float | None = None) -> None:
        """``ncclCommFinalize`` (NCCL >= 2.14): flush pending work; :meth:`destroy` after.

        ``timeout`` bounds the waits of a non-blocking communicator (a call still in
        progress before, and the finalize itself): :class:`~pynccl.NcclTimeoutError`
        after that many seconds in all. A blocking communicator's ncclCommFinalize waits
        inside NCCL for the outstanding work (a watchdog aborts it if that hangs)."""
        if self._state is State.FINALIZED:
            return
        seconds = check_timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        rc = self._call_locked("ncclCommFinalize", HANDLE, timeout=seconds)
        if rc == Result.IN_PROGRESS:
            self._mark_pending()
            self.wait_ready(None if deadline is None else max(deadline - time.monotonic(), 1e-6))
        if self._state not in TERMINAL:
            self._set_state(State.FINALIZED)

    def destroy(self) -> None:
        """``ncclCommDestroy``; a second call does nothing. Borrowed handles are only dropped.

        ``ncclCommDestroy`` first waits for the work issued on the communicator. With a
        watchdog running, that wait is bounded: each operation it watches is waited for
        until the watchdog's timeout after its issue, and one still incomplete then makes
        destroy abort instead (a :class:`RuntimeWarning` names the operation; the state
        becomes ``"aborted"`` and :attr:`error` holds the
        :class:`~pynccl.NcclTimeoutError`). Without a watchdog it waits as long as NCCL
        does — for ever if a peer never comes: use :meth:`abort` then, or a watchdog.
        After ``shrink(..., abort=True)`` it aborts (state ``"aborted"``): NCCL >= 2.31.2
        would wait in a barrier for the ranks that aborted. A live
        :class:`pynccl.cuda.Graph` that captured calls of this communicator makes it
        raise :class:`~pynccl.NcclInvalidUsage` naming the graph (NCCL's destroy would
        wait for the graph to be destroyed): close the graph first, or :meth:`abort`."""
        if self._state in TERMINAL:
            return
        if _groups.group_depth() > 0:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "ncclCommDestroy",
                "cannot destroy a communicator inside a group; end the group first",
            )
        kind, reason = self._destroy_kind()
        try:
            self._close_resources(abort=kind != "destroy")
        finally:
            self._teardown(kind, reason)

    def abort(self) -> None:
        """``ncclCommAbort``: stop pending work and free the communicator (also when hung).

        The :class:`pynccl.cuda.Graph` objects that captured its calls are closed first:
        NCCL's abort, like its destroy, waits until every CUDA graph that captured the
        communicator is destroyed, and a replay after the abort would hand the freed
        communicator to the GPU."""
        for graph in self._live_graphs():
            graph.close()
        self._close_resources(abort=True)
        self._teardown("abort")

    def _close_resources(self, abort: bool) -> None:
        """The parts' close hooks (:meth:`on_close`): windows, then registrations. Each
        runs even if one before raised; the first error raises after the last."""
        _run_all(self._closers, abort)

    def close(self) -> None:
        """Destroy the communicator if this object owns it; forget a borrowed one."""
        self.destroy()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.destroy()
        else:
            self.abort()

    def __del__(self, _warn: Callable[..., None] = _warn) -> None:
        # Never tear down from __del__ (it may run on any thread, at exit, or inside a
        # group): only tell the user. ``_warn`` is bound here, not looked up: at exit this
        # may run after the module's globals were cleared (free-threaded 3.13 keeps
        # objects alive that late), where the global is None.
        if getattr(self, "_owner", False) and getattr(self, "_handle", None) is not None:
            _warn(
                f"pynccl.Communicator rank {self._rank}/{self._size} was never destroyed; "
                "call destroy()/abort() or use it as a context manager",
                ResourceWarning,
                stacklevel=2,
            )

    # -- the one teardown ----------------------------------------------------------------

    def _reopen(self) -> None:
        """Undo a teardown's closing mark (it refused or was interrupted)."""
        self._closing = None
        self._set_state(self._state)

    def _teardown(self, kind: str, reason: BaseException | None = None) -> None:
        """Retire the handle: ``kind`` is ``"destroy"``, ``"abort"`` or ``"watchdog"``.

        First the communicator is marked closing (calls starting from then on refuse),
        then the teardown takes the gate's token, so the handle leaves the communicator
        with no call in flight; the C call that frees it runs after. ``abort``/``watchdog``
        proceed without the token if a call on another thread hangs (abort is what
        releases hung work; the watchdog, which has seen a hang already, waits no longer
        than its own timeout); ``destroy`` refuses then and the communicator stays usable.
        """
        watch = self._watch
        wait = self.GATE_TIMEOUT
        if watch is not None and kind != "watchdog":
            self._watch = None
            watch.stop()  # joins the watchdog thread, unless called from it
        elif watch is not None:
            wait = min(wait, watch.timeout)
        closing = self._closing
        if closing is None:
            self._closing = kind
            self._h = None
        try:
            got = self._take_gate(wait)
        except BaseException:  # interrupted while waiting: usable again
            if closing is None:
                self._reopen()
            raise
        if not got and kind == "destroy":
            if closing is None:
                self._reopen()
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "ncclCommDestroy",
                f"cannot destroy communicator rank {self._rank}: another thread's call on it "
                f"has not returned after {self.GATE_TIMEOUT:g} s; abort() releases hung work",
            )
        handle = None
        try:
            if self._state in TERMINAL:
                return
            handle = self._handle
            if reason is not None:
                self._error = reason
            if kind == "watchdog":
                self._watch = None
            if not self._owner:
                final = State.CLOSED
            else:
                final = State.DESTROYED if kind == "destroy" else State.ABORTED
            with self._life:  # no gate-free async-error read is using it now
                self._handle = self._harg = None
                self._set_state(final)
        finally:
            if closing is None:
                self._closing = None
            if got:
                self._gate.append(True)
        self._free(kind, handle)

    def _free(self, kind: str, handle: int | None) -> None:
        """The C call that frees a retired ``handle`` (an owned one), then the parts'
        retire hooks (:meth:`on_retire`)."""
        try:
            if self._owner and handle:
                self._destroy_handle(kind, handle)
        finally:
            if self._state in TERMINAL:
                _run_all(self._retirers, kind)

    def _destroy_handle(self, kind: str, handle: int) -> None:
        if kind == "destroy":
            self._lib.ncclCommDestroy(handle)
        elif kind == "abort":
            self._lib.ncclCommAbort(handle)
        else:  # the watchdog thread: never raise there
            self._lib.raw("ncclCommAbort")(handle)


def _run_all(hooks: list[Callable[[T], None]], arg: T) -> None:
    """``hook(arg)`` for every hook; the first error raises once all have run."""
    first: BaseException | None = None
    for hook in list(hooks):
        try:
            hook(arg)
        except BaseException as exc:
            if first is None:
                first = exc
    if first is not None:
        raise first
