"""CUDA graphs: capture the work issued on a stream, replay it as one launch; and the
calling thread's capture interaction mode (``cudaThreadExchangeStreamCaptureMode``)."""

from __future__ import annotations

from _thread import get_ident
from ctypes import byref, c_int, c_void_p
from enum import IntEnum

from .._closable import Closable
from ..errors import NotSupportedError
from . import _runtime
from ._stream import _STREAM_LEGACY, Stream, stream_handle

TYPE_CHECKING = False  # not imported from typing: mypy reads it as true
if TYPE_CHECKING:
    import weakref
    from collections.abc import Callable
    from types import TracebackType

    from ..typing import StreamLike

# The object API imports this module at its first call (to see captures): what only a Graph
# needs (weakref, ~1 ms to import) is imported when one is made, and the context managers
# are classes (contextlib, ~0.5 ms, is not imported).


class CaptureMode(IntEnum):
    """``cudaStreamCaptureMode``: which unsafe calls (synchronisation, allocation) other
    threads may make during a capture."""

    GLOBAL = 0
    THREAD_LOCAL = 1
    RELAXED = 2


# Captures begun through Graph.capture and not yet ended: stream handle -> (mode, thread,
# graph). CUDA cannot be asked whether *some* stream is capturing, only about a given one;
# this registry lets the object API refuse work that would invalidate a capture on a side
# stream, and tell which Graph captured a communicator's call.
_ACTIVE: dict[int, tuple[CaptureMode, int, Graph]] = {}
#: Called with True just before a capture begins and with False once it ended (or failed
#: to begin): the communicators (a layer above, which registers here) track what is
#: captured meanwhile. Exceptions from a hook propagate.
CAPTURE_HOOKS: list[Callable[[bool], None]] = []

#: cudaStreamCaptureStatusActive
_CAPTURE_ACTIVE = 1
#: cudaErrorStreamCaptureUnsupported (900) .. cudaErrorStreamCaptureWrongThread (908):
#: errors about a capture, not about the work queried.
_CAPTURE_ERRORS = range(900, 909)
_EXCHANGE = "cudaThreadExchangeStreamCaptureMode"


def is_capture_error(code: int) -> bool:
    """True for the cudaError_t codes of the stream-capture family (900-908)."""
    return code in _CAPTURE_ERRORS


def exchange_capture_mode(mode: CaptureMode) -> CaptureMode | None:
    """``cudaThreadExchangeStreamCaptureMode``: make ``mode`` the calling thread's capture
    interaction mode and return the previous one; None (and nothing changed) where the
    loaded libcudart lacks the call. In ``RELAXED`` mode the thread's queries,
    synchronisations and allocations never invalidate another thread's capture."""
    rt = _runtime._rt()
    try:
        fn = rt.raw(_EXCHANGE)
    except (KeyError, NotSupportedError):  # pynccl's table or the library lack it
        return None
    value = c_int(int(mode))
    rc = int(fn(byref(value)))
    if rc:
        rt.raw("cudaGetLastError")()
        raise rt.make_error(rc, _EXCHANGE)
    return CaptureMode(value.value)


class relaxed_capture_mode:  # a function in name: it replaces a contextlib one
    """The calling thread in relaxed capture mode inside the block, its own mode restored
    after (what PyTorch's watchdog does before querying). Yields False where libcudart
    lacks ``cudaThreadExchangeStreamCaptureMode`` (then nothing changed)."""

    __slots__ = ("_previous",)

    def __init__(self) -> None:
        self._previous: CaptureMode | None = None

    def __enter__(self) -> bool:
        self._previous = exchange_capture_mode(CaptureMode.RELAXED)
        return self._previous is not None

    def __exit__(self, *exc: object) -> None:
        previous, self._previous = self._previous, None
        if previous is not None:
            exchange_capture_mode(previous)


def capturing_graphs(stream: int) -> list[Graph]:
    """The :class:`Graph` objects whose capture records work issued on ``stream`` now:
    the one capturing from ``stream`` itself, else — ``stream`` joined a capture through
    an event, or is not capturing — every capture begun through :meth:`Graph.capture` and
    under way (which of them CUDA cannot tell without a capture id: all of them, to be
    safe). Empty when ``stream`` is not being captured."""
    if not _ACTIVE:
        return []
    status = c_int(0)
    rt = _runtime._rt()
    if rt.raw("cudaStreamIsCapturing")(stream, byref(status)):
        rt.raw("cudaGetLastError")()  # e.g. 906 for the legacy stream: not left behind
        return []
    if status.value != _CAPTURE_ACTIVE:
        return []
    own = _ACTIVE.get(stream)
    if own is not None:
        return [own[2]]
    return [graph for _, _, graph in list(_ACTIVE.values())]


def _unsafe_calls_prohibited() -> bool:
    """True while CUDA would refuse this thread a potentially unsafe call (synchronisation,
    allocation, a communicator's init) because of a capture begun with :meth:`Graph.capture`
    on any stream: one of this thread's in global or thread-local mode, or another thread's
    in global mode (CUDA's rule for a thread in the default global mode)."""
    me = get_ident()
    return any(
        mode is not CaptureMode.RELAXED and (tid == me or mode is CaptureMode.GLOBAL)
        for mode, tid, _ in list(_ACTIVE.values())
    )


class Graph(Closable):
    """Work captured from a stream into a CUDA graph, replayed as one launch.

    ::

        graph = Graph()
        with graph.capture(stream):   # cudaStreamBeginCapture ... cudaStreamEndCapture
            comm.all_reduce(x)        # recorded, not run
        graph.replay()                # cudaGraphLaunch: runs it, reading x as it is now
        graph.close()

    Only the executable graph is kept (the captured graph is freed once
    instantiated). Capturing again replaces it. Usable as a context manager, which
    closes it on exit. Collectives of several ranks must be captured, and replayed,
    by every rank.

    The graph keeps the buffers of the pynccl calls captured into it alive until it is
    closed (a replay reads them as they are then), and the communicators know it
    captured them: NCCL does not destroy a communicator while a graph that captured it
    exists, so ``destroy()`` of such a communicator refuses, naming the graph —
    close the graph first (``abort()`` proceeds).
    """

    __slots__ = ("__weakref__", "_capturing", "_comms", "_exec", "_keep", "_next", "_stream")

    _exec: int
    _stream: Stream | None
    _capturing: bool
    #: What the calls captured into the executable graph use: kept until close().
    _keep: list[object]
    #: The communicators whose calls the executable graph holds.
    _comms: weakref.WeakSet[object]
    #: The same two for the capture under way (they replace the others once it succeeds).
    _next: tuple[list[object], weakref.WeakSet[object]] | None

    def __init__(self) -> None:
        self._exec = 0
        self._stream = None
        self._capturing = False
        self._keep = []
        self._comms = _weak_set()
        self._next = None

    def _captured(self, comm: object, keep: tuple[object, ...] = ()) -> None:
        """A call of ``comm`` (using ``keep``) was captured by the capture under way."""
        pending = self._next
        if pending is not None:
            pending[0].extend(keep)
            pending[1].add(comm)

    def holds(self, comm: object) -> bool:
        """True while this graph is live (captured, not closed) and holds calls of
        ``comm`` (a communicator)."""
        return bool(self._exec) and comm in self._comms

    def capture(self, stream: StreamLike, mode: CaptureMode | str = CaptureMode.GLOBAL) -> _Capture:
        """Capture the work the body issues on ``stream`` (not the legacy default stream).

        ``mode``: :class:`CaptureMode` or its name (``"global"``, the default as in
        PyTorch, ``"thread_local"``, ``"relaxed"``). If the body raises, the capture
        is ended and discarded and the body's exception propagates; a capture that
        CUDA invalidated (the body synchronised, allocated, ...) raises
        :class:`~pynccl.CudaError` on exit. Everything is checked when the block is
        entered, as a generator-based context manager would.
        """
        return _Capture(self, stream, mode)

    def _begin(self, stream: StreamLike, mode: CaptureMode | str) -> tuple[int, Stream]:
        """The capture's checks and its start: (the stream's handle, the stream)."""
        if isinstance(mode, str):
            try:
                mode = CaptureMode[mode.upper()]
            except KeyError:
                raise ValueError(
                    f"mode={mode!r}: expected 'global', 'thread_local' or 'relaxed'"
                ) from None
        elif not isinstance(mode, CaptureMode):
            raise TypeError(f"mode must be a CaptureMode or its name, got {mode!r}")
        if self._capturing:
            raise RuntimeError("this Graph is already capturing")
        wrapped = Stream.wrap(stream)
        handle = wrapped.handle
        if handle in (0, _STREAM_LEGACY):
            raise ValueError(
                "the legacy default stream cannot be captured; capture on a Stream() "
                "(or another stream you created)"
            )
        rt = _runtime._rt()
        # Registered (and the hooks told) before the capture begins, so that no call
        # captured is missed; undone below if it fails to begin.
        _ACTIVE[handle] = (mode, get_ident(), self)
        self._next = ([], _weak_set())
        try:
            _hooks(True)
            rt.cudaStreamBeginCapture(handle, int(mode))
        except BaseException:
            self._ended(handle)
            raise
        self._capturing = True
        return handle, wrapped

    def _finish(self, handle: int, wrapped: Stream, failed: bool) -> None:
        """End the capture from ``handle``: discarded when the body ``failed`` (the stream
        usable again), else instantiated as this graph's executable graph."""
        rt = _runtime._rt()
        graph = c_void_p()
        try:
            if failed:
                # End the capture so the stream is usable again; what it holds is discarded.
                rt.raw("cudaStreamEndCapture")(handle, byref(graph))
                if graph.value:
                    rt.raw("cudaGraphDestroy")(graph)
                return
        finally:
            self._capturing = False
            captured = self._next
            self._ended(handle)
        rt.cudaStreamEndCapture(handle, byref(graph))
        try:
            exe = c_void_p()
            rt.cudaGraphInstantiate(byref(exe), graph, 0)
        finally:
            rt.cudaGraphDestroy(graph)
        self.close()
        self._exec = exe.value or 0
        self._stream = wrapped
        if captured is not None:
            self._keep, self._comms = captured

    def _ended(self, handle: int) -> None:
        """The capture from ``handle`` ended (or never began): unregistered, hooks told."""
        self._next = None
        _ACTIVE.pop(handle, None)
        _hooks(False)

    def replay(self, stream: StreamLike = None) -> None:
        """Launch the graph on ``stream`` (default: the stream it was captured from)."""
        if not self._exec:
            raise ValueError("this Graph holds nothing to replay: capture first (or closed)")
        target = self._stream if stream is None else stream
        _runtime._rt().cudaGraphLaunch(self._exec, stream_handle(target))

    @property
    def captured(self) -> bool:
        """True once a capture completed and until :meth:`close`."""
        return bool(self._exec)

    def close(self) -> None:
        """Destroy the executable graph (idempotent); the buffers it kept are let go."""
        exe, self._exec = self._exec, 0
        self._stream = None
        if exe:
            _runtime._rt().cudaGraphExecDestroy(exe)
        self._keep = []
        self._comms = _weak_set()

    def _held(self) -> bool:
        return bool(getattr(self, "_exec", 0))

    def __repr__(self) -> str:
        state = "capturing" if self._capturing else "captured" if self._exec else "empty"
        where = f" from stream {self._stream.handle:#x}" if self._stream is not None else ""
        return f"<pynccl.cuda.Graph at {id(self):#x} ({state}{where})>"


class _Capture:
    """What :meth:`Graph.capture` returns: begins the capture on entering the block (the
    graph is what ``as`` binds), ends it on leaving."""

    __slots__ = ("_args", "_graph", "_started")

    def __init__(self, graph: Graph, stream: StreamLike, mode: CaptureMode | str) -> None:
        self._graph = graph
        self._args = (stream, mode)
        self._started: tuple[int, Stream] | None = None

    def __enter__(self) -> Graph:
        if self._started is not None:
            raise RuntimeError("this capture block was already entered; call capture() again")
        self._started = self._graph._begin(*self._args)
        return self._graph

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        started = self._started
        if started is not None:
            self._graph._finish(*started, failed=exc_type is not None)


def _weak_set() -> weakref.WeakSet[object]:
    import weakref  # loaded on the first Graph only

    return weakref.WeakSet()


def _hooks(begins: bool) -> None:
    for hook in list(CAPTURE_HOOKS):
        hook(begins)
