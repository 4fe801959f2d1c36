"""The agreement of :meth:`~pynccl.Communicator.register_window`: before the C call every
rank learns every other rank's (alignment, flags, whether it already holds that range,
size) through one small ``all_gather`` on the communicator's stream, so a mistake on one
rank makes *every* rank raise the same ``ValueError`` instead of leaving its peers waiting
inside NCCL. Also the checks of one rank's own arguments."""

from __future__ import annotations

import gc
from _thread import allocate_lock
from ctypes import byref, c_int64, sizeof

from .. import groups as _groups
from ..enums import WIN_REQUIRED_ALIGNMENT, WinFlag

__all__ = ["agree", "can_agree", "flag_bits", "misaligned", "refuse_cuda_malloc"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..cuda import DeviceBuffer
    from ..enums import Release
    from ._communicator import Communicator

#: From this release a symmetric window's size may differ across ranks (user guide 2.30.7).
_SIZES_MAY_DIFFER = (2, 30, 7)
_H2D, _D2H = 1, 2  # cudaMemcpyKind
_RELAXED = 2  # cudaStreamCaptureModeRelaxed


def can_agree(core: Communicator) -> bool:
    """Whether the agreement's all_gather can run and be waited for now: not inside a
    group (it would be queued), not while this communicator's stream — or the legacy
    stream of its device — is captured (it would be captured), not while another
    capture forbids the wait and the thread cannot switch to relaxed mode."""
    if _groups.group_depth() > 0:
        return False
    from ..cuda import _capture_blocks, _unsafe_calls_prohibited

    s = core.stream
    if (s not in (0, 1) and _capture_blocks(s)) or _capture_blocks(0):
        return False
    return not _unsafe_calls_prohibited() or _exchange_mode(-1) is not None


def agree(
    core: Communicator, scratch: list[DeviceBuffer], ptr: int, size: int, bits: int, known: bool
) -> tuple[int, ...]:
    """Exchange (size, misaligned, flags, known) with every rank (one all_gather of
    4 int64 each, on the communicator's stream, through ``scratch``: see
    :func:`scratch_buffer`) and raise the same ValueError on every rank if they disagree;
    else return every rank's size in bytes (what bounds a view of a peer's window)."""
    from .. import library
    from ..cuda._device import _DeviceScope

    n = core.size
    mine = (c_int64 * 4)(size, ptr % WIN_REQUIRED_ALIGNMENT, bits, int(known))
    everyone = (c_int64 * (4 * n))()
    dev = scratch_buffer(core, scratch, n)
    rt = library.cudart()
    s = core.stream
    # The copies are ordered with the all_gather on the communicator's stream (on a
    # GPU a legacy-stream copy would not be), with its device current (the default
    # streams are per device), in relaxed capture mode as NCCL's own registration.
    previous = _exchange_mode(_RELAXED)
    try:
        with _DeviceScope(core.device), _no_collection():
            rt.cudaMemcpyAsync(dev, byref(mine), sizeof(mine), _H2D, s)
            core.all_gather(dev, dev + sizeof(mine), count=4, dtype="int64")
            # Non-blocking: the all_gather is on the stream only once NCCL is ready.
            core.live()
            rt.cudaMemcpyAsync(byref(everyone), dev + sizeof(mine), sizeof(everyone), _D2H, s)
            core.synchronize()
    finally:
        if previous is not None and previous != _RELAXED:
            _exchange_mode(previous)
    rows = [tuple(everyone[4 * r : 4 * r + 4]) for r in range(n)]
    _check_agreement(rows, bits, core.library.version)
    return tuple(int(row[0]) for row in rows)


def scratch_buffer(core: Communicator, scratch: list[DeviceBuffer], n: int) -> int:
    """The device scratch of the agreement (4 * (n + 1) int64), made once per
    communicator (kept in ``scratch``, which the windows part frees with the communicator):
    no allocation or free (which synchronizes the device) in the agreement itself."""
    if not scratch or scratch[0].closed:
        from ..cuda import DeviceBuffer

        scratch[:] = [DeviceBuffer((4 * (n + 1),), "int64", core.device)]
    return scratch[0].ptr


def _check_agreement(rows: list[tuple[int, ...]], bits: int, version: Release) -> None:
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
            raise ValueError(misaligned(r, None))
        if bits & WinFlag.COLL_SYMMETRIC and sz != rows[0][0]:
            if version < _SIZES_MAY_DIFFER:
                raise ValueError(
                    f"register_window: a symmetric window needs the same size on every "
                    f"rank before NCCL 2.30.7 (this is {_release(version)}), but "
                    f"rank 0 registers {rows[0][0]} bytes and rank {r} {sz}"
                )


def _release(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def _exchange_mode(mode: int) -> int | None:
    """:func:`._sync.exchange_mode` on the loaded libcudart."""
    from .. import library
    from ._sync import exchange_mode

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


def refuse_cuda_malloc(buf: object) -> None:
    """NCCL registers windows only from ncclMemAlloc or VMM memory: a DeviceBuffer tells
    which allocator made it."""
    from ..cuda import DeviceBuffer

    if isinstance(buf, DeviceBuffer) and buf.allocator != "nccl":
        raise ValueError(
            f"register_window: buf is a DeviceBuffer from cudaMalloc (allocator="
            f"{buf.allocator!r}); NCCL registers windows only in memory from ncclMemAlloc "
            "(comm.mem_alloc, or DeviceBuffer(..., allocator='nccl')) or the CUDA VMM API"
        )


def flag_bits(flags: object) -> int:
    if isinstance(flags, bool) or not isinstance(flags, int):
        raise TypeError(f"flags must be WinFlag bits (an int), got {type(flags).__name__}")
    known = 0
    for f in WinFlag:
        known |= f
    if flags & ~known or flags < 0:
        raise ValueError(f"flags={flags:#x} has bits that are not WinFlag values")
    return int(flags)


def misaligned(rank: int, ptr: int | None) -> str:
    where = f"rank {rank}'s buffer" + ("" if ptr is None else f" {ptr:#x}")
    return (
        f"register_window: a window must start on WIN_REQUIRED_ALIGNMENT "
        f"({WIN_REQUIRED_ALIGNMENT}) bytes, but {where} does not "
        "(allocate it with comm.mem_alloc)"
    )
