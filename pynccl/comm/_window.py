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

import gc
from _thread import allocate_lock
from ctypes import byref, c_int64, c_void_p, sizeof

from .. import groups as _groups
from .._closable import Closable
from .._limits import U64, check_count, check_index
from ..enums import WIN_REQUIRED_ALIGNMENT, DataType, Result, WinFlag
from ..errors import NcclInvalidUsage
from ._handle import HANDLE, TERMINAL
from ._memory import Memory, buffer_range

__all__ = ["Window", "Windows"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    import weakref
    from typing import Any

    from ..cuda import DeviceBuffer
    from ..typing import BufferLike

_WINDOWS = (2, 27, 3)  # ncclCommWindowRegister
_PEER_POINTER = (2, 29, 2)  # ncclGetPeerDevicePointer, ncclWinGetUserPtr
#: From this release a symmetric window's size may differ across ranks (user guide 2.30.7).
_SIZES_MAY_DIFFER = (2, 30, 7)
_H2D, _D2H = 1, 2  # cudaMemcpyKind
_RELAXED = 2  # cudaStreamCaptureModeRelaxed


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
        "_comm",
        "_dtype",
        "_flags",
        "_key",
        "_nbytes",
        "_out",
        "_ptr",
        "_refs",
        "_streams",
    )

    def __init__(
        self, comm: Windows, ptr: int, nbytes: int, flags: int, dtype: DataType, buf: object
    ) -> None:
        self._comm = comm
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
        comm = self._comm
        if not comm._lib.has("ncclWinGetUserPtr"):
            return self._ptr
        out = c_void_p()
        comm._call_locked("ncclWinGetUserPtr", HANDLE, h, byref(out))
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
        return self._closed or self._comm._state in TERMINAL

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
                f"{what} elements of {item} bytes do not fit in the window of "
                f"{limit} bytes"
            )
        return start

    def peer_pointer(self, peer: int, offset: int = 0) -> int | None:
        """``ncclGetPeerDevicePointer`` (NCCL >= 2.29): a device address of ``peer``'s
        window, ``offset`` elements of :attr:`dtype` in, that this device can load from and
        store to; ``None`` where ``peer`` is not reachable that way (another node)."""
        comm = self._comm
        p = check_index(peer, "peer", comm._size, f"for a communicator of size {comm._size}")
        off = self._byte_offset(offset)
        h = self.handle
        comm._lib.require("ncclGetPeerDevicePointer", _PEER_POINTER)
        out = c_void_p()
        comm._call_locked("ncclGetPeerDevicePointer", h, off, p, byref(out))
        return int(out.value) if out.value else None

    def lsa_pointer(self, lsa_rank: int, offset: int = 0) -> int:
        """``ncclGetLsaDevicePointer`` (NCCL >= 2.29): the address of rank ``lsa_rank`` *of
        this rank's load/store-accessible team* (``ncclTeamLsa``: the ranks whose memory
        this device can reach, numbered from 0), ``offset`` elements of :attr:`dtype` in."""
        comm = self._comm
        off = self._byte_offset(offset)
        h = self.handle
        comm._lib.require("ncclGetLsaDevicePointer", _PEER_POINTER)
        size = int(comm._call_value("ncclTeamLsa").nRanks)
        r = check_index(lsa_rank, "lsa_rank", size, f"for an LSA team of size {size}")
        out = c_void_p()
        comm._call_locked("ncclGetLsaDevicePointer", h, off, r, byref(out))
        return int(out.value or 0)

    def multimem_pointer(self, offset: int = 0) -> int | None:
        """``ncclGetLsaMultimemDevicePointer`` (NCCL >= 2.29): the multicast (NVLS) address
        of the window's LSA team, ``offset`` elements in; ``None`` without multicast."""
        comm = self._comm
        off = self._byte_offset(offset)
        h = self.handle
        comm._lib.require("ncclGetLsaMultimemDevicePointer", _PEER_POINTER)
        out = c_void_p()
        comm._call_locked("ncclGetLsaMultimemDevicePointer", h, off, byref(out))
        return int(out.value) if out.value else None

    def close(self) -> None:
        """Drop one reference; the last deregisters (``ncclCommWindowDeregister``, NCCL >=
        2.27; local to the rank), once the work this rank queued that may use the window
        has run: the communicator's stream and the streams of the one-sided calls on it
        (work on other streams with buffers in the window: synchronize those first).
        Idempotent once closed."""
        self._comm._close_window(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"refs={self._refs}"
        kind = "symmetric " if self.symmetric else ""
        return (
            f"<pynccl.Window {kind}ptr={self._ptr:#x} nbytes={self._nbytes} "
            f"rank {self._comm._rank} {state}>"
        )


class Windows(Memory):
    """register_window and the open windows (a base of Communicator)."""

    __slots__ = ()

    _wins: dict[tuple[int, int, int], Window]

    @property
    def windows(self) -> list[Window]:
        """The open windows of this communicator, oldest first."""
        return [w for w in self._wins.values() if not w.closed]

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
        self._live()
        ptr, size, dt = buffer_range(self, buf, nbytes, "register_window")
        if type(symmetric) is not bool:
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        bits = _flag_bits(flags) | (WinFlag.COLL_SYMMETRIC if symmetric else 0)
        if not size:
            raise ValueError("register_window needs a buffer of at least 1 byte, got 0 bytes")
        _refuse_cuda_malloc(buf)
        self._lib.require("ncclCommWindowRegister", _WINDOWS)
        key = (ptr, size, bits)
        known = self._wins.get(key)
        if known is not None and known.closed:
            known = None
        if self._size > 1 and self._can_agree():
            self._agree(ptr, size, bits, known is not None)
        elif ptr % WIN_REQUIRED_ALIGNMENT:
            raise ValueError(_misaligned(self._rank, ptr))
        if known is not None:
            known._refs += 1
            return known
        win = Window(self, ptr, size, bits, dt, buf)
        rc = self._call_locked("ncclCommWindowRegister", HANDLE, ptr, size, byref(win._out), bits)
        # Inside a group NCCL registers at the end: the communicator is one of the group's.
        _groups.keep_alive((win, buf), self)  # type: ignore[arg-type]
        self._settle(rc)
        self._wins[key] = win
        return win

    def _can_agree(self) -> bool:
        """Whether the agreement's all_gather can run and be waited for now: not inside a
        group (it would be queued), not while this communicator's stream — or the legacy
        stream of its device — is captured (it would be captured), not while another
        capture forbids the wait and the thread cannot switch to relaxed mode."""
        if _groups.group_depth() > 0:
            return False
        from ..cuda import _capture_blocks, _unsafe_calls_prohibited

        s = self._stream
        if (s not in (0, 1) and _capture_blocks(s)) or _capture_blocks(0):
            return False
        return not _unsafe_calls_prohibited() or _exchange_mode(-1) is not None

    def _agree(self, ptr: int, size: int, bits: int, known: bool) -> None:
        """Exchange (size, misaligned, flags, known) with every rank (one all_gather of
        4 int64 each, on the communicator's stream) and raise the same ValueError on every
        rank if they disagree."""
        from .. import library
        from ..cuda._device import _DeviceScope

        n = self._size
        mine = (c_int64 * 4)(size, ptr % WIN_REQUIRED_ALIGNMENT, bits, int(known))
        everyone = (c_int64 * (4 * n))()
        dev = self._agreement_buffer(n)
        rt = library.cudart()
        s = self._stream
        comm: Any = self
        # The copies are ordered with the all_gather on the communicator's stream (on a
        # GPU a legacy-stream copy would not be), with its device current (the default
        # streams are per device), in relaxed capture mode as NCCL's own registration.
        previous = _exchange_mode(_RELAXED)
        try:
            with _DeviceScope(self.device), _no_collection():
                rt.cudaMemcpyAsync(dev, byref(mine), sizeof(mine), _H2D, s)
                comm.all_gather(dev, dev + sizeof(mine), count=4, dtype="int64")
                # Non-blocking: the all_gather is on the stream only once NCCL is ready.
                self._live()
                rt.cudaMemcpyAsync(byref(everyone), dev + sizeof(mine), sizeof(everyone), _D2H, s)
                self.synchronize()
        finally:
            if previous is not None and previous != _RELAXED:
                _exchange_mode(previous)
        _check_agreement([tuple(everyone[4 * r : 4 * r + 4]) for r in range(n)], bits, self)

    def _agreement_buffer(self, n: int) -> int:
        """The device scratch of the agreement (4 * (n + 1) int64), made once per
        communicator and freed with it: no allocation or free (which synchronizes the
        device) in the agreement itself."""
        global _SCRATCH
        if _SCRATCH is None:
            import weakref  # not at import: `from pynccl import Communicator` stays light

            _SCRATCH = weakref.WeakKeyDictionary()
        buf = _SCRATCH.get(self)
        if buf is None or buf.closed:
            from ..cuda import DeviceBuffer

            buf = _SCRATCH[self] = DeviceBuffer((4 * (n + 1),), "int64", self.device)
        return buf.ptr

    def _teardown(self, kind: str, reason: BaseException | None = None) -> None:
        """The one teardown, then the agreement's scratch goes once the handle is retired
        (an abort first stops what may still use it)."""
        try:
            super()._teardown(kind, reason)
        finally:
            if self._state in TERMINAL and _SCRATCH is not None:
                buf = _SCRATCH.pop(self, None)
                if buf is not None:
                    try:
                        buf.close()
                    except Exception:  # a dead context at exit, or the watchdog thread
                        if kind != "watchdog":
                            raise

    def _close_window(self, win: Window) -> None:
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
        raw = self._lib.raw("ncclCommWindowDeregister")

        def deregister(comm_handle: object) -> int:
            if win._closed:  # another thread closed it meanwhile
                return 0
            rc = int(raw(comm_handle, h))
            if rc == 0 or rc == Result.IN_PROGRESS:
                # Closed under the gate: a one-sided call that takes the gate after this
                # sees it closed and refuses instead of passing a freed window to NCCL.
                self._forget(win)
            return rc

        self._live()
        rc = self._under_gate(deregister)
        if rc and rc != Result.IN_PROGRESS:
            raise self._lib.make_error(rc, "ncclCommWindowDeregister")
        self._settle(rc)

    def _wait_for_window(self, win: Window) -> None:
        """Wait for the work this rank queued that may use ``win``: the communicator's
        stream and the streams of the one-sided calls on it. A stream being captured has
        run nothing yet (its graph runs later): nothing to wait for there."""
        if self._h is None and self._state.value != "initializing":
            return  # revoked, suspended: the deregistration itself says what is allowed
        from ..cuda import _capture_blocks

        for s in dict.fromkeys((self._stream, *sorted(win._streams))):
            if not _capture_blocks(s):  # 0: also while a blocking stream captures
                self.synchronize(s)

    def _call_value(self, function: str) -> Any:
        """A value-returning host function of ``nccl_device/host.h`` taking only the
        communicator (``ncclTeamLsa``), under the gate."""
        self._live()
        return self._under_gate(self._lib.raw(function))

    def _settle(self, rc: int) -> None:
        """A non-blocking communicator's registration still in progress: wait for it
        (inside a group, the group's end does)."""
        if rc == Result.IN_PROGRESS:
            if _groups.group_depth() > 0:
                _groups.in_progress_later(self)  # type: ignore[arg-type]
            else:
                self._mark_pending()
                self.wait_ready()

    def _forget(self, win: Window) -> None:
        win._closed = True
        win._refs = 0
        win._buf = None
        if self._wins.get(win._key) is win:
            del self._wins[win._key]

    def _close_windows(self, abort: bool) -> None:
        """Before destroy or abort: only mark them closed. NCCL frees the windows left at
        destroy itself (after the communicator's work has finished), and the abort frees
        them too; nothing is called that could hang or free a window still in use."""
        del abort
        for win in list(self._wins.values()):
            self._forget(win)


#: The agreement's device scratch per communicator (see Windows._agreement_buffer): a
#: ``weakref.WeakKeyDictionary`` from the first registration on.
_SCRATCH: weakref.WeakKeyDictionary[Windows, DeviceBuffer] | None = None


def _check_agreement(rows: list[tuple[int, ...]], bits: int, comm: Windows) -> None:
    """Raise the same ValueError on every rank if the ranks' (size, misaligned, flags,
    known) rows disagree."""
    for r, (sz, mis, fl, kn) in enumerate(rows):
        if fl != rows[0][2]:
            raise ValueError(
                f"register_window: window flags differ between ranks (rank 0: "
                f"{rows[0][2]:#x}, rank {r}: {fl:#x}); every rank must pass the same"
            )
        if kn != rows[0][3]:
            has, lacks = (r, 0) if kn else (0, r)
            raise ValueError(
                f"register_window: rank {has} has this range registered already and "
                f"rank {lacks} does not; every rank must register the same windows"
            )
        if mis:
            raise ValueError(_misaligned(r, None))
        if bits & WinFlag.COLL_SYMMETRIC and sz != rows[0][0]:
            if comm._lib.version < _SIZES_MAY_DIFFER:
                raise ValueError(
                    f"register_window: a symmetric window needs the same size on every "
                    f"rank before NCCL 2.30.7 (this is {_release(comm._lib.version)}), but "
                    f"rank 0 registers {rows[0][0]} bytes and rank {r} {sz}"
                )


def _release(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def _exchange_mode(mode: int) -> int | None:
    """:func:`._held.exchange_mode` on the loaded libcudart."""
    from .. import library
    from ._held import exchange_mode

    return exchange_mode(library.cudart(), mode)


class _NoCollection:
    """No automatic garbage collection on any thread while an agreement is under way.

    A finalizer the collector runs — a cyclic ``DeviceBuffer``'s ``cudaFree``, which waits
    for its device — on this thread, before it issued its all_gather, would wait for a
    peer's pending all_gather on that device, which waits for this thread: a deadlock
    with one thread per GPU in one process. Held only for the agreement's few calls
    (counted: the collector comes back when the last agreement ends)."""

    __slots__ = ()
    _lock = allocate_lock()
    _holds = 0
    _was_enabled = False

    def __enter__(self) -> None:
        with _NoCollection._lock:
            if _NoCollection._holds == 0:
                _NoCollection._was_enabled = gc.isenabled()
                gc.disable()
            _NoCollection._holds += 1

    def __exit__(self, *exc: object) -> None:
        with _NoCollection._lock:
            _NoCollection._holds -= 1
            if _NoCollection._holds == 0 and _NoCollection._was_enabled:
                gc.enable()


_no_collection = _NoCollection


def _refuse_cuda_malloc(buf: object) -> None:
    """NCCL registers windows only from ncclMemAlloc or VMM memory: a DeviceBuffer tells
    which allocator made it."""
    from ..cuda import DeviceBuffer

    if isinstance(buf, DeviceBuffer) and buf.allocator != "nccl":
        raise ValueError(
            f"register_window: buf is a DeviceBuffer from cudaMalloc (allocator="
            f"{buf.allocator!r}); NCCL registers windows only in memory from ncclMemAlloc "
            "(comm.mem_alloc, or DeviceBuffer(..., allocator='nccl')) or the CUDA VMM API"
        )


def _flag_bits(flags: object) -> int:
    if isinstance(flags, bool) or not isinstance(flags, int):
        raise TypeError(f"flags must be WinFlag bits (an int), got {type(flags).__name__}")
    known = 0
    for f in WinFlag:
        known |= f
    if flags & ~known or flags < 0:
        raise ValueError(f"flags={flags:#x} has bits that are not WinFlag values")
    return int(flags)


def _misaligned(rank: int, ptr: int | None) -> str:
    where = f"rank {rank}'s buffer" + ("" if ptr is None else f" {ptr:#x}")
    return (
        f"register_window: a window must start on WIN_REQUIRED_ALIGNMENT "
        f"({WIN_REQUIRED_ALIGNMENT}) bytes, but {where} does not "
        "(allocate it with comm.mem_alloc)"
    )
