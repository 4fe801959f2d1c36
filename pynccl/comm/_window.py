"""Memory windows: ``register_window`` (``ncclCommWindowRegister``, NCCL >= 2.27), the
:class:`Window` it returns and ``comm.windows``.

Registration and deregistration are collective. Before the C call every rank learns
every other rank's (size, alignment, flags, whether it already holds that range) through
one small ``all_gather``, so a mistake on one rank makes *every* rank raise the same
``ValueError`` instead of leaving its peers waiting inside NCCL (inside a group, where
nothing can be waited for, only this rank's own values are checked). The same
(pointer, size, flags) registered again returns the same :class:`Window` with one more
reference (NCCL's symmetric address space is finite: registering one allocation twice
would spend it twice); :meth:`Window.close` drops one, and the last deregisters.
"""

from __future__ import annotations

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
    from typing import Any

    from ..typing import BufferLike

_WINDOWS = (2, 27, 3)  # ncclCommWindowRegister
_PEER_POINTER = (2, 29, 2)  # ncclGetPeerDevicePointer, ncclWinGetUserPtr


class Window(Closable):
    """A registered memory window (``ncclWindow_t``), from :meth:`Communicator.register_window`.

    ``handle`` is the ``ncclWindow_t`` as an int, ``user_ptr`` / ``nbytes`` the range it
    covers, ``dtype`` the element type of the registered buffer (offsets count in it).
    :meth:`close` (collective, like the registration) drops one reference and
    deregisters at the last; a ``with`` block closes it too. It keeps the registered
    buffer referenced while registered.
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
        2.27, collective: every rank closes its window). Idempotent once closed."""
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

        ``symmetric=True`` adds ``NCCL_WIN_COLL_SYMMETRIC``: the buffers must have the
        same size on every rank and start on ``WIN_REQUIRED_ALIGNMENT`` (4096) bytes
        (:meth:`mem_alloc` memory does); ``flags`` adds other ``WinFlag`` bits. A range
        already registered with the same flags returns the same :class:`Window`, with
        one more reference. Not while a CUDA graph is being captured.
        """
        self._live()
        ptr, size, dt = buffer_range(self, buf, nbytes, "register_window")
        if type(symmetric) is not bool:
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        bits = _flag_bits(flags) | (WinFlag.COLL_SYMMETRIC if symmetric else 0)
        if not size:
            raise ValueError("register_window needs a buffer of at least 1 byte, got 0 bytes")
        self._lib.require("ncclCommWindowRegister", _WINDOWS)
        self._refuse_if_capturing("ncclCommWindowRegister")
        key = (ptr, size, bits)
        known = self._wins.get(key)
        if known is not None and known.closed:
            known = None
        if _groups.group_depth() == 0 and self._size > 1:
            self._agree(ptr, size, bits, known is not None)
        elif bits & WinFlag.COLL_SYMMETRIC and ptr % WIN_REQUIRED_ALIGNMENT:
            raise ValueError(_misaligned(self._rank, ptr))
        if known is not None:
            known._refs += 1
            return known
        win = Window(self, ptr, size, bits, dt, buf)
        rc = self._call_locked("ncclCommWindowRegister", HANDLE, ptr, size, byref(win._out), bits)
        self._settle(rc)
        _groups.keep_alive((win, buf))
        self._wins[key] = win
        return win

    def _agree(self, ptr: int, size: int, bits: int, known: bool) -> None:
        """Exchange (size, misaligned, flags, known) with every rank (one all_gather of
        4 int64 each) and raise the same ValueError on every rank if they disagree."""
        from .. import library
        from ..cuda import DeviceBuffer

        n = self._size
        mine = (c_int64 * 4)(size, ptr % WIN_REQUIRED_ALIGNMENT, bits, int(known))
        everyone = (c_int64 * (4 * n))()
        rt = library.cudart()
        with DeviceBuffer((4 * (n + 1),), "int64", self.device) as dev:
            rt.cudaMemcpy(dev.ptr, byref(mine), sizeof(mine), 1)
            comm: Any = self
            comm.all_gather(dev.ptr, dev.ptr + sizeof(mine), count=4, dtype="int64")
            self.synchronize()
            rt.cudaMemcpy(byref(everyone), dev.ptr + sizeof(mine), sizeof(everyone), 2)
        rows = [tuple(everyone[4 * r : 4 * r + 4]) for r in range(n)]
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
            if bits & WinFlag.COLL_SYMMETRIC and mis:
                raise ValueError(_misaligned(r, None))
            if bits & WinFlag.COLL_SYMMETRIC and sz != rows[0][0]:
                raise ValueError(
                    f"register_window: a symmetric window needs the same size on every rank, "
                    f"but rank 0 registers {rows[0][0]} bytes and rank {r} {sz}"
                )

    def _close_window(self, win: Window) -> None:
        if win._closed:
            return
        if win.closed:  # the communicator is gone: its teardown freed the window
            self._forget(win)
            return
        if win._refs > 1:
            win._refs -= 1
            return
        self._refuse_if_capturing("ncclCommWindowDeregister")
        h = win.handle
        self._settle(self._call_locked("ncclCommWindowDeregister", HANDLE, h))
        _groups.keep_alive((win, win._buf))
        self._forget(win)

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
        """Before destroy (deregister every open window, collectively) or abort (only
        mark them closed: the abort frees them)."""
        wins = list(self._wins.values())
        call = not abort and self._h is not None
        first: BaseException | None = None
        for win in wins:
            if call and first is None and win._out.value:
                try:
                    self._call_locked("ncclCommWindowDeregister", HANDLE, win._out.value)
                except BaseException as exc:  # destroy goes on; it frees the rest
                    first = exc
            self._forget(win)
        if first is not None:
            raise first


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
        f"register_window: a symmetric window must start on WIN_REQUIRED_ALIGNMENT "
        f"({WIN_REQUIRED_ALIGNMENT}) bytes, but {where} does not "
        "(allocate it with comm.mem_alloc)"
    )
