"""Memory windows: ``register_window`` (``ncclCommWindowRegister``, NCCL >= 2.27), the
:class:`Window` it returns and ``comm.windows``.

Registration is collective. Before the C call every rank learns every other rank's
(alignment, flags, whether it already holds that range, size) through one small
``all_gather`` on the communicator's stream, so a mistake on one rank makes *every* rank
raise the same ``ValueError`` instead of leaving its peers waiting inside NCCL (inside a
group, or while this thread's stream is captured into a CUDA graph, where nothing can be
waited for, only this rank's own values are checked). The same (pointer, size, flags)
registered again returns the same :class:`Window` with one more reference (NCCL's
symmetric address space is finite: registering one allocation twice would spend it
twice); :meth:`Window.close` drops one, and the last deregisters.

Deregistration is local to the rank (NCCL: no peer takes part, so one rank may close
while another still calls collectives). NCCL frees the window at once, so the close
first waits for the work this rank queued that may use it: the communicator's stream
and each stream a one-sided call on the window was issued on. Both are allowed during a
CUDA-graph capture (NCCL switches the thread to relaxed capture mode for them).
"""

from __future__ import annotations

from ctypes import byref, c_void_p

from .. import groups as _groups
from .._closable import Closable
from .._limits import U64, check_count
from ..enums import WIN_REQUIRED_ALIGNMENT, DataType, Result, WinFlag
from ..errors import NcclInvalidUsage
from ._delegate import delegate
from ._memory import buffer_range
from ._peerview import PeerViews
from ._state import HANDLE, TERMINAL

__all__ = ["Window", "Windows"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..cuda import DeviceBuffer
    from ..typing import BufferLike
    from ._communicator import Communicator

_WINDOWS = (2, 27, 3)  # ncclCommWindowRegister
_PEER_POINTER = (2, 29, 2)  # ncclGetPeerDevicePointer, ncclWinGetUserPtr


class Window(Closable):
    """A registered memory window (``ncclWindow_t``), from :meth:`Communicator.register_window`.

    ``handle`` is the ``ncclWindow_t`` as an int, ``user_ptr`` / ``nbytes`` the range it
    covers, ``dtype`` the element type of the registered buffer (offsets count in it).
    :meth:`close` (local to the rank) drops one reference and deregisters at the last; a
    ``with`` block closes it too. It keeps the registered buffer referenced while
    registered.
    """

    __slots__ = (
        "__weakref__",
        "_buf",
        "_closed",
        "_dtype",
        "_flags",
        "_key",
        "_nbytes",
        "_out",
        "_peers",
        "_ptr",
        "_refs",
        "_sizes",
        "_streams",
        "_windows",
    )

    def __init__(
        self, windows: Windows, ptr: int, nbytes: int, flags: int, dtype: DataType, buf: object
    ) -> None:
        self._windows = windows
        self._ptr = ptr
        self._nbytes = nbytes
        self._flags = flags
        self._dtype = dtype
        self._buf = buf
        self._out = c_void_p()  # written by NCCL (at the group's end, inside a group)
        self._refs = 1
        self._closed = False
        self._key = (ptr, nbytes, flags)
        # Streams one-sided calls on this window were issued on: close() waits for them.
        self._streams: set[int] = set()
        self._sizes: tuple[int, ...] = ()  # every rank's size, where the agreement ran
        self._peers = PeerViews(windows, self)

    @property
    def handle(self) -> int:
        """The ``ncclWindow_t`` as an int; refused once the window is closed."""
        self._check_open()
        if not self._out.value:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "ncclCommWindowRegister",
                f"{self!r} is not registered yet: the group it was registered in has not ended",
            )
        return int(self._out.value)

    @property
    def user_ptr(self) -> int:
        """This rank's registered address (``ncclWinGetUserPtr`` from NCCL 2.29 on; the
        address given to :meth:`Communicator.register_window` before)."""
        h = self.handle
        core = self._windows.core
        if not core.library.has("ncclWinGetUserPtr"):
            return self._ptr
        out = c_void_p()
        core.call_locked("ncclWinGetUserPtr", HANDLE, h, byref(out))
        return int(out.value or 0)

    @property
    def nbytes(self) -> int:
        """The registered size in bytes (this rank's)."""
        return self._nbytes

    @property
    def dtype(self) -> DataType:
        """The registered buffer's element type (``uint8`` for a raw pointer)."""
        return self._dtype

    @property
    def flags(self) -> WinFlag | int:
        """The ``NCCL_WIN_*`` flags it was registered with."""
        try:
            return WinFlag(self._flags)
        except ValueError:
            return self._flags

    @property
    def symmetric(self) -> bool:
        """True for an ``NCCL_WIN_COLL_SYMMETRIC`` window (the same size on every rank)."""
        return bool(self._flags & WinFlag.COLL_SYMMETRIC)

    @property
    def closed(self) -> bool:
        """True once deregistered, or once its communicator is gone."""
        return self._closed or self._windows.core.state in TERMINAL

    def _check_open(self) -> None:
        if self.closed:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE, "", f"{self!r} is closed; it cannot be used any more"
            )

    def _byte_offset(self, offset: object, count: int = 0, itemsize: int = 0) -> int:
        """``offset`` elements (of ``itemsize`` bytes; default :attr:`dtype`'s) as bytes,
        checked so that ``count`` more elements (at least one byte) fit in the window. A
        window that is not symmetric may be larger on the peer: only the address space
        bounds it here (NCCL checks the peer's size)."""
        off = check_count(offset, "offset")
        item = itemsize or self._dtype.itemsize
        start = off * item
        limit = self._nbytes if self._flags & WinFlag.COLL_SYMMETRIC else U64
        if start + max(count * item, 1) > limit:
            what = f"offset={off}" + (f" + count={count}" if count else "")
            raise ValueError(
                f"{what} elements of {item} bytes do not fit in the window of {limit} bytes"
            )
        return start

    peer_pointer = delegate("_peers", PeerViews.peer_pointer)
    peer_array = delegate("_peers", PeerViews.peer_array)
    lsa_pointer = delegate("_peers", PeerViews.lsa_pointer)
    multimem_pointer = delegate("_peers", PeerViews.multimem_pointer)

    def close(self) -> None:
        """Drop one reference; the last deregisters (``ncclCommWindowDeregister``, NCCL >=
        2.27; local to the rank), once the work this rank queued that may use the window
        has run: the communicator's stream and the streams of the one-sided calls on it
        (work on other streams with buffers in the window: synchronize those first).
        Idempotent once closed."""
        self._windows.close_window(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"refs={self._refs}"
        kind = "symmetric " if self.symmetric else ""
        return (
            f"<pynccl.Window {kind}ptr={self._ptr:#x} nbytes={self._nbytes} "
            f"rank {self._windows.core.rank} {state}>"
        )


class Windows:
    """register_window and the open windows: a part of :class:`~pynccl.Communicator`,
    over its core's public surface."""

    __slots__ = ("core", "scratch", "wins")

    def __init__(self, core: Communicator, wins: dict[tuple[int, int, int], Window]) -> None:
        self.core = core
        #: The open windows by (pointer, size, flags) (the communicator's ``_wins``).
        self.wins = wins
        #: The agreement's device scratch (:func:`._agreement.scratch_buffer`).
        self.scratch: list[DeviceBuffer] = []
        core.on_close(self.close_windows)
        core.on_retire(self._free_scratch)

    @property
    def windows(self) -> list[Window]:
        """The open windows of this communicator, oldest first."""
        return [w for w in self.wins.values() if not w.closed]

    def register_window(
        self, buf: BufferLike, *, nbytes: int | None = None, symmetric: bool = True,
        flags: WinFlag | int = WinFlag.DEFAULT,
    ) -> Window:  # fmt: skip
        """``ncclCommWindowRegister`` (NCCL >= 2.27), collective: every rank registers its
        buffer (``nbytes=`` for a raw pointer, or to register the first bytes only).

        The memory must come from ``ncclMemAlloc`` (NCCL >= 2.19; :meth:`mem_alloc`, a
        ``DeviceBuffer`` with ``allocator="nccl"``) or the CUDA VMM API, and every window
        must start on ``WIN_REQUIRED_ALIGNMENT`` (4096) bytes (:meth:`mem_alloc` memory
        does). A
        ``DeviceBuffer`` from ``cudaMalloc`` is refused here; for other buffers pynccl
        cannot tell ``cudaMalloc`` memory from VMM memory (that needs the driver API), and
        NCCL refuses it. ``symmetric=True`` adds ``NCCL_WIN_COLL_SYMMETRIC``; before NCCL
        2.30.7 such a window needs the same size on every rank. ``flags`` adds other
        ``WinFlag`` bits. A range already registered with the same flags returns the same
        :class:`Window`, with one more reference. Allowed during a CUDA-graph capture
        (NCCL registers in relaxed capture mode; only this rank's values are checked).
        """
        from ._agreement import agree, can_agree, flag_bits, misaligned, refuse_cuda_malloc

        core = self.core
        core.live()
        ptr, size, dt = buffer_range(core.device, buf, nbytes, "register_window")
        if type(symmetric) is not bool:
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        bits = flag_bits(flags) | (WinFlag.COLL_SYMMETRIC if symmetric else 0)
        if not size:
            raise ValueError("register_window needs a buffer of at least 1 byte, got 0 bytes")
        refuse_cuda_malloc(buf)
        core.library.require("ncclCommWindowRegister", _WINDOWS)
        key = (ptr, size, bits)
        known = self.wins.get(key)
        if known is not None and known.closed:
            known = None
        sizes: tuple[int, ...] = ()
        if core.size > 1 and can_agree(core):
            sizes = agree(core, self.scratch, ptr, size, bits, known is not None)
        elif ptr % WIN_REQUIRED_ALIGNMENT:
            raise ValueError(misaligned(core.rank, ptr))
        if known is not None:
            known._refs += 1
            return known
        win = Window(self, ptr, size, bits, dt, buf)
        win._sizes = sizes
        rc = core.call_locked("ncclCommWindowRegister", HANDLE, ptr, size, byref(win._out), bits)
        # Inside a group NCCL registers at the end: the communicator is one of the group's.
        _groups.keep_alive((win, buf), core)
        self._settle(rc)
        self.wins[key] = win
        return win

    def _free_scratch(self, kind: str) -> None:
        """The core's retire hook: the agreement's scratch goes once the handle is retired
        (an abort first stops what may still use it)."""
        if self.scratch:
            buf = self.scratch.pop()
            try:
                buf.close()
            except Exception:  # a dead context at exit, or the watchdog thread
                if kind != "watchdog":
                    raise

    def close_window(self, win: Window) -> None:
        """Drop one reference to ``win``; the last deregisters (:meth:`Window.close`)."""
        if win._closed:
            return
        if win.closed:  # the communicator is gone: its teardown freed the window
            self._forget(win)
            return
        if win._refs > 1:
            win._refs -= 1
            return
        h = win.handle
        self._wait_for_window(win)
        core = self.core
        raw = core.library.raw("ncclCommWindowDeregister")

        def deregister(comm_handle: object) -> int:
            if win._closed:  # another thread closed it meanwhile
                return 0
            rc = int(raw(comm_handle, h))
            if rc == 0 or rc == Result.IN_PROGRESS:
                # Closed under the gate: a one-sided call that takes the gate after this
                # sees it closed and refuses instead of passing a freed window to NCCL.
                self._forget(win)
            return rc

        core.live()
        rc = core.under_gate(deregister)
        if rc and rc != Result.IN_PROGRESS:
            raise core.library.make_error(rc, "ncclCommWindowDeregister")
        self._settle(rc)

    def _wait_for_window(self, win: Window) -> None:
        """Wait for the work this rank queued that may use ``win``: the communicator's
        stream and the streams of the one-sided calls on it. A stream being captured has
        run nothing yet (its graph runs later): nothing to wait for there."""
        core = self.core
        if not core.usable and core.state.value != "initializing":
            return  # revoked, suspended: the deregistration itself says what is allowed
        from ..cuda import _capture_blocks

        for s in dict.fromkeys((core.stream, *sorted(win._streams))):
            if not _capture_blocks(s):  # 0: also while a blocking stream captures
                core.synchronize(s)

    def _settle(self, rc: int) -> None:
        """A non-blocking communicator's registration still in progress: wait for it
        (inside a group, the group's end does)."""
        if rc == Result.IN_PROGRESS:
            if _groups.group_depth() > 0:
                _groups.in_progress_later(self.core)
            else:
                self.core.mark_pending()
                self.core.wait_ready()

    def _forget(self, win: Window) -> None:
        win._closed = True
        win._refs = 0
        win._buf = None
        if self.wins.get(win._key) is win:
            del self.wins[win._key]

    def close_windows(self, abort: bool) -> None:
        """The core's close hook, before destroy or abort: only mark them closed. NCCL
        frees the windows left at destroy itself (after the communicator's work has
        finished), and the abort frees them too; nothing is called that could hang or
        free a window still in use."""
        del abort
        for win in list(self.wins.values()):
            self._forget(win)

    # -- for the one-sided calls (:mod:`._signals`) -----------------------------------------

    def owns(self, win: Window) -> bool:
        """Whether ``win`` was registered on this communicator."""
        return win._windows is self

    def in_symmetric(self, ptr: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``ptr`` lie inside an open symmetric window."""
        for (base, size, bits), win in self.wins.items():
            inside = base <= ptr and ptr + nbytes <= base + size
            if inside and bits & WinFlag.COLL_SYMMETRIC and not win._closed:
                return True
        return False

    @staticmethod
    def byte_offset(win: Window, offset: object, count: int, itemsize: int) -> int:
        """:meth:`Window._byte_offset`: ``offset`` elements as bytes, checked to fit."""
        return win._byte_offset(offset, count, itemsize)

    @staticmethod
    def sizes(win: Window) -> tuple[int, ...]:
        """Every rank's size of ``win``, where its registration exchanged them, else ()."""
        return win._sizes

    @staticmethod
    def use(win: Window, handle: int, function: str, s: int) -> None:
        """Under the gate, before a one-sided call on ``win`` (whose handle was read as
        ``handle``) on stream ``s``: refuse a window another thread's close deregistered
        meanwhile (the deregistration holds the gate), else note ``s`` (its close waits
        for that stream)."""
        if win._closed or win._out.value != handle:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                function,
                f"{win!r} was closed by another thread before this call could "
                "use it; close a window only once no call may use it any more",
            )
        win._streams.add(s)
