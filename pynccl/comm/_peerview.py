"""Reaching a peer's window from this rank: the pointer queries of ``nccl_device/host.h``
(``ncclGetPeerDevicePointer``, ``ncclGetLsaDevicePointer``,
``ncclGetLsaMultimemDevicePointer``; NCCL >= 2.29) and :meth:`PeerPointers.peer_array`,
a view of a peer's window as an array. A part of :class:`~pynccl.Window` (its methods
delegate here), over the window's public surface and its registry's
(:class:`._window.Windows`).
"""

from __future__ import annotations

from _weakref import ref  # weakref.ref, without importing the weakref module
from ctypes import byref, c_void_p

from .._limits import check_index
from ..dtypes import canonical_name
from ._agreement import _SIZES_MAY_DIFFER

__all__ = ["PeerArray", "PeerViews"]


def __getattr__(name: str) -> type:
    if name == "PeerArray":  # loaded on first use: `from pynccl import Communicator` stays light
        from .._adapt._export import PeerArray

        return PeerArray
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._adapt._export import PeerArray
    from ..typing import DTypeLike, IndexLike
    from ._window import Window, Windows

_PEER_POINTER = (2, 29, 2)  # ncclGetPeerDevicePointer


class PeerViews:
    """The peer-pointer methods of one :class:`~pynccl.Window` (``Window.peer_pointer``
    and the others delegate here)."""

    __slots__ = ("_win", "windows")

    def __init__(self, windows: Windows, win: Window) -> None:
        #: The window's registry: its ``core`` and the checked offsets and sizes.
        self.windows = windows
        self._win = ref(win)  # the window holds this part: no cycle

    @property
    def win(self) -> Window:
        """The window (alive: it is the caller of every method here)."""
        win = self._win()
        assert win is not None
        return win

    def peer_pointer(self, peer: int, offset: int = 0) -> int | None:
        """``ncclGetPeerDevicePointer`` (NCCL >= 2.29): a device address of ``peer``'s
        window, ``offset`` elements of :attr:`dtype` in, that this device can load from and
        store to; ``None`` where ``peer`` is not reachable that way (another node)."""
        core = self.windows.core
        p = check_index(peer, "peer", core.size, f"for a communicator of size {core.size}")
        off = self.windows.byte_offset(self.win, offset, 0, 0)
        h = self.win.handle
        core.library.require("ncclGetPeerDevicePointer", _PEER_POINTER)
        out = c_void_p()
        core.call_locked("ncclGetPeerDevicePointer", h, off, p, byref(out))
        return int(out.value) if out.value else None

    def peer_array(
        self, peer: int, shape: IndexLike | Sequence[IndexLike], dtype: DTypeLike | None = None
    ) -> PeerArray:
        """``peer``'s window, from its start, as a C-contiguous array of ``shape`` and
        ``dtype`` (default: :attr:`dtype`, the registered buffer's): a
        :class:`~pynccl.comm.PeerArray` exposing ``__cuda_array_interface__`` v3 and DLPack
        (``cupy.asarray``, ``torch.from_dlpack`` and pynccl's array adapters view it without
        a copy; a collective refuses it as a buffer, as NCCL does a peer's address: copy it
        to this device first). It keeps this window referenced; the memory is valid while
        the window is registered on both ranks (NCCL >= 2.29: ``ncclGetPeerDevicePointer``);
        once this window is closed the view refuses to export its address (``NcclInvalidUsage``).

        The view must fit in the *peer's* window. Its size is known from the agreement
        :meth:`~pynccl.Communicator.register_window` makes (every rank's size is
        exchanged); for a window registered without it (inside a group, during a capture)
        a symmetric window before NCCL 2.30.7 has the same size on every rank (NCCL
        requires it), and otherwise the peer's size is unknown: refused. ``ValueError``
        for a peer out of range, a view larger than the peer's window, or a peer this
        device cannot reach (another node); ``TypeError`` for a bad shape or dtype."""
        from .._adapt._export import PeerArray

        core = self.windows.core
        p = check_index(peer, "peer", core.size, f"for a communicator of size {core.size}")
        win = self.win
        dt = win.dtype if dtype is None else dtype
        view = PeerArray(0, shape, dt, core.device, win)  # checks shape and dtype
        limit = self._peer_nbytes(p, core.rank, core.library.version)
        if view.nbytes > limit:
            raise ValueError(
                f"shape={view.shape} of {canonical_name(view.dtype)} is {view.nbytes} bytes, "
                f"more than rank {p}'s window of {limit} bytes"
            )
        ptr = self.peer_pointer(p)
        if ptr is None:
            raise ValueError(
                f"rank {p}'s window is not reachable by load/store from this device "
                "(another node): it has no peer view"
            )
        return PeerArray(ptr, view.shape, dt, core.device, win)

    def _peer_nbytes(self, peer: int, rank: int, version: tuple[int, ...]) -> int:
        """The size of ``peer``'s window, where it is known (see :meth:`peer_array`)."""
        win = self.win
        sizes = self.windows.sizes(win)
        if sizes:
            return sizes[peer]
        if peer == rank or (win.symmetric and version < _SIZES_MAY_DIFFER):
            return win.nbytes
        raise ValueError(
            f"the size of rank {peer}'s window is not known here: it was registered inside "
            "a group or a CUDA-graph capture, where the ranks do not exchange sizes, and "
            "from NCCL 2.30.7 (or without NCCL_WIN_COLL_SYMMETRIC) the sizes may differ; "
            "register the window outside a group to view a peer's window"
        )

    def lsa_pointer(self, lsa_rank: int, offset: int = 0) -> int:
        """``ncclGetLsaDevicePointer`` (NCCL >= 2.29): the address of rank ``lsa_rank`` *of
        this rank's load/store-accessible team* (``ncclTeamLsa``: the ranks whose memory
        this device can reach, numbered from 0), ``offset`` elements of :attr:`dtype` in."""
        core = self.windows.core
        off = self.windows.byte_offset(self.win, offset, 0, 0)
        h = self.win.handle
        core.library.require("ncclGetLsaDevicePointer", _PEER_POINTER)
        core.live()
        size = int(core.under_gate(core.library.raw("ncclTeamLsa")).nRanks)
        r = check_index(lsa_rank, "lsa_rank", size, f"for an LSA team of size {size}")
        out = c_void_p()
        core.call_locked("ncclGetLsaDevicePointer", h, off, r, byref(out))
        return int(out.value or 0)

    def multimem_pointer(self, offset: int = 0) -> int | None:
        """``ncclGetLsaMultimemDevicePointer`` (NCCL >= 2.29): the multicast (NVLS) address
        of the window's LSA team, ``offset`` elements in; ``None`` without multicast."""
        core = self.windows.core
        off = self.windows.byte_offset(self.win, offset, 0, 0)
        h = self.win.handle
        core.library.require("ncclGetLsaMultimemDevicePointer", _PEER_POINTER)
        out = c_void_p()
        core.call_locked("ncclGetLsaMultimemDevicePointer", h, off, byref(out))
        return int(out.value) if out.value else None
