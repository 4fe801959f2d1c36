"""CUDA graphs: capture the work issued on a stream, replay it as one launch."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from ctypes import byref, c_void_p
from enum import IntEnum

from .._closable import Closable
from . import _runtime
from ._stream import _STREAM_LEGACY, Stream, stream_handle

TYPE_CHECKING = False  # not imported from typing: mypy reads it as true
if TYPE_CHECKING:
    from ..typing import StreamLike


class CaptureMode(IntEnum):
    """``cudaStreamCaptureMode``: which unsafe calls (synchronisation, allocation) other
    threads may make during a capture."""

    GLOBAL = 0
    THREAD_LOCAL = 1
    RELAXED = 2


# Captures begun through Graph.capture and not yet ended: stream handle -> (mode, thread).
# CUDA cannot be asked whether *some* stream is capturing, only about a given one; this
# registry lets the object API refuse work that would invalidate a capture on a side stream.
_ACTIVE: dict[int, tuple[CaptureMode, int]] = {}


def _unsafe_calls_prohibited() -> bool:
    """True while CUDA would refuse this thread a potentially unsafe call (synchronisation,
    allocation, a communicator's init) because of a capture begun with :meth:`Graph.capture`
    on any stream: one of this thread's in global or thread-local mode, or another thread's
    in global mode (CUDA's rule for a thread in the default global mode)."""
    me = threading.get_ident()
    return any(
        mode is not CaptureMode.RELAXED and (tid == me or mode is CaptureMode.GLOBAL)
        for mode, tid in list(_ACTIVE.values())
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
    """

    __slots__ = ("__weakref__", "_capturing", "_exec", "_stream")

    _exec: int
    _stream: Stream | None
    _capturing: bool

    def __init__(self) -> None:
        self._exec = 0
        self._stream = None
        self._capturing = False

    @contextlib.contextmanager
    def capture(
        self, stream: StreamLike, mode: CaptureMode | str = CaptureMode.GLOBAL
    ) -> Iterator[Graph]:
        """Capture the work the body issues on ``stream`` (not the legacy default stream).

        ``mode``: :class:`CaptureMode` or its name (``"global"``, the default as in
        PyTorch, ``"thread_local"``, ``"relaxed"``). If the body raises, the capture
        is ended and discarded and the body's exception propagates; a capture that
        CUDA invalidated (the body synchronised, allocated, ...) raises
        :class:`~pynccl.CudaError` on exit.
        """
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
        rt.cudaStreamBeginCapture(handle, int(mode))
        self._capturing = True
        _ACTIVE[handle] = (mode, threading.get_ident())
        graph = c_void_p()
        try:
            yield self
        except BaseException:
            # End the capture so the stream is usable again; what it holds is discarded.
            rt.raw("cudaStreamEndCapture")(handle, byref(graph))
            if graph.value:
                rt.raw("cudaGraphDestroy")(graph)
            raise
        finally:
            self._capturing = False
            _ACTIVE.pop(handle, None)
        rt.cudaStreamEndCapture(handle, byref(graph))
        try:
            exe = c_void_p()
            rt.cudaGraphInstantiate(byref(exe), graph, 0)
        finally:
            rt.cudaGraphDestroy(graph)
        self.close()
        self._exec = exe.value or 0
        self._stream = wrapped

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
        """Destroy the executable graph (idempotent)."""
        exe, self._exec = self._exec, 0
        self._stream = None
        if exe:
            _runtime._rt().cudaGraphExecDestroy(exe)



    def _held(self) -> bool:
        return bool(getattr(self, "_exec", 0))

    def __repr__(self) -> str:
        state = "capturing" if self._capturing else "captured" if self._exec else "empty"
        return f"<pynccl.cuda.Graph ({state})>"
