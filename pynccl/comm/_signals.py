"""One-sided operations (NCCL >= 2.29): ``put_signal``, ``signal`` and ``wait_signal``,
with :class:`SignalWait` describing what a wait waits for.

They are stream-ordered like collectives (they capture into CUDA graphs and replay).
Signal indices and contexts are checked against the communicator's configuration
(``Config(num_rma_sig=..., num_rma_ctx=...)``; one of each by default, and before 2.31
only signal 0 and context 0) and peers against its size, before anything reaches C.
"""

from __future__ import annotations

from .. import groups as _groups
from .._adapt import as_buffer, as_stream, check_device
from .._capi.structs import ncclWaitSignalDesc_t
from .._limits import C_INT_MAX, check_c_int, check_index
from ..enums import Result
from ..errors import NotSupportedError
from ._window import Window

__all__ = ["SignalWait", "Signals", "rma_limits"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from ..enums import Release
    from ..typing import BufferLike, DTypeLike, StreamLike
    from ._core import Core
    from ._window import Windows

_SIGNALS = (2, 29, 2)  # ncclPutSignal, ncclSignal, ncclWaitSignal
_SIGNAL_INDICES = (2, 31, 0)  # numRmaSig; contexts above 0
_UNDEF = -(1 << 31)  # NCCL_CONFIG_UNDEF_INT


def rma_limits(version: Release, cfg: object) -> tuple[int, int]:
    """``(contexts, signals)`` a communicator made with ``cfg`` (an ``ncclConfig_t`` or
    None) offers: the config's numRmaCtx / numRmaSig, 1 each by default; before 2.31
    only context 0 and signal 0."""
    nctx = getattr(cfg, "numRmaCtx", _UNDEF) if version >= (2, 29, 0) else _UNDEF
    nsig = getattr(cfg, "numRmaSig", _UNDEF) if version >= _SIGNAL_INDICES else _UNDEF
    nctx = 1 if nctx == _UNDEF else nctx
    nsig = 1 if nsig == _UNDEF else nsig
    if version < _SIGNAL_INDICES:
        nctx, nsig = min(nctx, 1), 1
    return nctx, nsig


class SignalWait:
    """What :meth:`Communicator.wait_signal` waits for: ``count`` signals from ``peer``
    on signal index ``signal`` of context ``context`` (an ``ncclWaitSignalDesc_t``).
    Frozen: compare and hash by value."""

    __slots__ = ("context", "count", "peer", "signal")

    peer: int
    count: int
    signal: int
    context: int

    def __init__(self, peer: int, count: int = 1, signal: int = 0, context: int = 0) -> None:
        set_ = object.__setattr__
        set_(self, "peer", check_c_int(peer, "peer", 0))
        set_(self, "count", check_c_int(count, "count", 1))
        set_(self, "signal", check_c_int(signal, "signal", 0))
        set_(self, "context", check_c_int(context, "context", 0))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"SignalWait is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"SignalWait is frozen: cannot delete {name!r}")

    def _key(self) -> tuple[int, int, int, int]:
        return (self.peer, self.count, self.signal, self.context)

    def __eq__(self, other: object) -> bool:
        if type(other) is not SignalWait:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[object, ...]:
        return (SignalWait, self._key())

    def __repr__(self) -> str:
        return (
            f"SignalWait(peer={self.peer}, count={self.count}, signal={self.signal}, "
            f"context={self.context})"
        )


class Signals:
    """put_signal, signal, wait_signal: a part of :class:`~pynccl.Communicator`, over its
    core's public surface and its windows part."""

    __slots__ = ("core", "rma", "windows")

    def __init__(self, core: Core, windows: Windows, rma: tuple[int, int] | None) -> None:
        self.core = core
        self.windows = windows
        #: ``(contexts, signals)`` the communicator offers (:func:`rma_limits`); None for
        #: a borrowed handle, whose config is unknown (NCCL checks).
        self.rma = rma

    def _rma_fn(self, function: str) -> Any:
        """The bare ctypes function of a one-sided call, once the communicator is usable."""
        self.core.live()
        library = self.core.library
        try:
            return library.raw(function)
        except NotSupportedError:
            raise NotSupportedError(function, _SIGNALS, library.version) from None

    def _indices(self, signal: object, context: object, where: str = "") -> tuple[int, int]:
        """``(signal, context)`` checked against the communicator's numRmaSig/numRmaCtx."""
        rma = self.rma
        if rma is None:  # a borrowed handle: its config is unknown, NCCL checks
            sig = check_c_int(signal, where + "signal", 0)
            return sig, check_c_int(context, where + "context", 0)
        nctx, nsig = rma
        has = f"(the communicator has numRmaSig={nsig}, numRmaCtx={nctx})"
        sig = check_index(signal, where + "signal", nsig, has)
        ctx = check_index(context, where + "context", nctx, has)
        return sig, ctx

    def _peer(self, peer: object, name: str = "peer") -> int:
        size = self.core.size
        return check_index(peer, name, size, f"for a communicator of size {size}")

    def _rma_issue(
        self,
        fn: Any,
        function: str,
        s: int,
        *args: object,
        window: tuple[Window, int] | None = None,
    ) -> None:
        """``fn(*args, comm, s)`` under the gate (as the collectives' issue path: the
        handle is read under it, so a teardown on another thread never passes a freed one;
        nor a ``window`` (with the handle read before) that another thread's close
        deregistered meanwhile: checked again under the gate, which the deregistration
        holds)."""

        core = self.core

        def issue(h: object) -> int:
            if window is not None:
                self.windows.use(window[0], window[1], function, s)
            return int(fn(*args, h, s))

        # One of the open group's communicators (NCCL returns success inside a group).
        _groups.in_progress_later(core)
        rc = core.under_gate(issue)
        if rc == Result.IN_PROGRESS:
            if _groups.group_depth() == 0:
                core.mark_pending()
        elif rc:
            raise core.library.make_error(rc, function)

    def put_signal(
        self, sendbuf: BufferLike, peer: int, window: Window, *, offset: int = 0,
        count: int | None = None, dtype: DTypeLike = None, signal: int = 0, context: int = 0,
        stream: StreamLike = None,
    ) -> None:  # fmt: skip
        """``ncclPutSignal`` (NCCL >= 2.29): write ``sendbuf`` (``count`` elements; a raw
        pointer needs ``count=`` and ``dtype=``) into ``peer``'s part of ``window``,
        ``offset`` elements of the buffer's type in, then add one to ``peer``'s signal
        ``signal`` of context ``context``. ``sendbuf`` must lie in a symmetric window of
        this communicator. Stream-ordered (captures into CUDA graphs)."""
        core = self.core
        fn = self._rma_fn("ncclPutSignal")
        s = core.stream if stream is None else as_stream(stream)
        p = self._peer(peer)
        if not isinstance(window, Window):
            raise TypeError(f"window must be a pynccl.Window, got {type(window).__name__}")
        if not self.windows.owns(window):
            raise ValueError(f"{window!r} was registered on another communicator")
        h = window.handle
        ptr, n, dt, dev = as_buffer(sendbuf, count, dtype, name="sendbuf", stream=s)
        check_device(dev, core.device, "sendbuf")
        core.datatype(dt)
        off = self.windows.byte_offset(window, offset, n, dt.itemsize)
        sig, ctx = self._indices(signal, context)
        if not self.windows.in_symmetric(ptr, n * dt.itemsize):
            raise ValueError(
                f"sendbuf {ptr:#x} ({n * dt.itemsize} bytes) is not inside a symmetric window "
                "of this communicator: register it (or the buffer it is in) with "
                "register_window first"
            )
        _groups.keep_alive((sendbuf, window), core, s)
        self._rma_issue(
            fn, "ncclPutSignal", s, ptr, n, int(dt), p, h, off, sig, ctx, 0, window=(window, h)
        )
        core.note_capture(s, (sendbuf, window))  # a Graph capturing it keeps the source

    def signal(
        self, peer: int, *, signal: int = 0, context: int = 0, stream: StreamLike = None
    ) -> None:
        """``ncclSignal`` (NCCL >= 2.29): add one to ``peer``'s signal ``signal`` of
        context ``context``, without data. Stream-ordered."""
        fn = self._rma_fn("ncclSignal")
        s = self.core.stream if stream is None else as_stream(stream)
        p = self._peer(peer)
        sig, ctx = self._indices(signal, context)
        self._rma_issue(fn, "ncclSignal", s, p, sig, ctx, 0)

    def wait_signal(
        self, waits: SignalWait | Iterable[SignalWait], *, stream: StreamLike = None
    ) -> None:
        """``ncclWaitSignal`` (NCCL >= 2.29): make ``stream`` wait until every
        :class:`SignalWait` in ``waits`` (one, or a list) has its signals; they are then
        consumed. Stream-ordered (captures into CUDA graphs)."""
        fn = self._rma_fn("ncclWaitSignal")
        s = self.core.stream if stream is None else as_stream(stream)
        items = [waits] if isinstance(waits, SignalWait) else _wait_list(waits)
        if not items:
            raise ValueError("waits must hold at least one SignalWait, got none")
        if len(items) > C_INT_MAX:
            raise ValueError(f"waits holds {len(items)} SignalWaits; at most {C_INT_MAX}")
        descs = (ncclWaitSignalDesc_t * len(items))()
        for i, (w, d) in enumerate(zip(items, descs)):
            where = f"waits[{i}]."
            d.opCnt = w.count
            d.peer = self._peer(w.peer, where + "peer")
            d.sigIdx, d.ctx = self._indices(w.signal, w.context, where)
        self._rma_issue(fn, "ncclWaitSignal", s, len(items), descs)


def _wait_list(waits: object) -> list[SignalWait]:
    try:
        items: list[SignalWait] = list(waits)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"waits must be a SignalWait or a list of them, got {type(waits).__name__}"
        ) from None
    for i, w in enumerate(items):
        if type(w) is not SignalWait:
            raise TypeError(f"waits[{i}] must be a pynccl.SignalWait, got {type(w).__name__}")
    return items
