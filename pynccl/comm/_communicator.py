"""``Communicator``: constructors and the public surface. A :class:`~._core.Core` composed
with parts (plain objects over the core's public surface; one delegating line per method
they implement, below). The collectives and their one fast path are
:class:`._collectives.Collectives`."""

from __future__ import annotations

from collections.abc import Sequence
from ctypes import byref, c_int, c_void_p

from ..enums import DataType, Result
from ..library import cudart, lib
from . import _recorder
from ._args import dtype_table, op_table
from ._collectives import Collectives
from ._config import Config
from ._delegate import delegate, delegate_property
from ._extras import Extras
from ._introspect import Introspection
from ._memory import Memory
from ._resilience import Resilience, join_args, refuse_in_group
from ._signals import Signals, rma_limits
from ._spec import COLLECTIVES
from ._suspend import Suspend
from ._uid import UniqueId, as_unique_ids, init_all_devices, init_args, init_rank, rank_and_size
from ._vcoll import VCollectives
from ._window import Windows

__all__ = ["Communicator"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .._capi.nccl import NcclLibrary
    from .._capi.structs import ncclConfig_t
    from ..cuda import DeviceBuffer
    from ..typing import DeviceLike, StreamLike
    from ._memory import Registration
    from ._window import Window

_P63 = 1 << 63
#: The fast path's largest raw-pointer count is a one-digit int (below 2**30), which
#: the interpreter compares with a specialised instruction.
_FAST_N_MAX = (1 << 30) - 1


def _fast_n(size: int) -> int:
    """The largest count the fast path takes with raw pointers: pointer + count * 16 bytes
    * nranks then stays below 2**64 without a multiplication per call."""
    return min(_FAST_N_MAX, _P63 // (16 * max(size, 1)))


class Communicator(Collectives):
    """An NCCL communicator (``ncclComm_t``) with every collective and point-to-point call.

    ``Communicator(nranks, unique_id, rank, device=None, config=None, stream=None)``
    sets ``device`` as the calling thread's CUDA device (if given) and calls
    ``ncclCommInitRank`` (or ``ncclCommInitRankConfig`` with a :class:`Config`,
    or ``ncclCommInitRankScalable`` — NCCL >= 2.23 — when ``unique_id`` is a list).

    ``device`` is an ordinal (an ``int`` or ``__index__`` object) or an object with a
    ``device_id`` (a cuda.core ``Device``).

    Buffers are raw device pointers (``int`` or a cuda.bindings ``CUdeviceptr``, with
    ``count=`` and ``dtype=``), a cuda.core ``Buffer`` (bytes, typed by ``dtype=``), or
    objects exposing ``__cuda_array_interface__`` or DLPack on a CUDA device.
    ``count`` is NCCL's: elements per rank. ``stream=None`` uses :attr:`stream` (the
    ``stream`` given here, kept referenced; default: the legacy default stream). An
    array's producer stream (``__cuda_array_interface__`` v3's ``stream``, DLPack's
    ``__dlpack__(stream=...)``) is ordered before the call's stream.

    Use it as a context manager (destroy on normal exit, abort on an exception)
    or call :meth:`destroy` / :meth:`abort`; afterwards every call raises
    :class:`~pynccl.NcclInvalidUsage`. Calls on one communicator are serialized: from
    two threads they run one at a time (never concurrently inside NCCL), and a
    destroy or abort from another thread waits for the call in flight.

    ``watchdog_timeout=T`` starts :meth:`start_watchdog` once the communicator exists,
    with ``on_hang=watchdog_on_hang`` (``"abort"``, or ``"revoke"`` on NCCL >= 2.28).
    """

    __slots__ = (
        "_barrier_buf", "_custom_ops", "_dtypes", "_extras", "_fast_n",
        "_introspect", "_memory", "_optab", "_regs", "_resilience", "_signals", "_suspend",
        "_vcoll", "_windows", "_wins",
    )  # fmt: skip

    def __init__(
        self, nranks: int, unique_id: UniqueId | bytes | Sequence[UniqueId | bytes], rank: int,
        *, device: DeviceLike | None = None, config: Config | None = None,
        stream: StreamLike = None, watchdog_timeout: float | None = None,
        watchdog_on_hang: str = "abort",
    ) -> None:  # fmt: skip
        L = lib()
        self._init_handle(L, True)
        nranks, rank, device = init_args(
            L, nranks, rank, device, config, watchdog_timeout, watchdog_on_hang
        )
        ids = as_unique_ids(unique_id)
        self._setup(L, rank, nranks, device, config, stream)
        if device is not None:
            cudart().cudaSetDevice(device)
        self._refuse_if_capturing("communicator initialisation")
        self._adopt(*init_rank(L, ids, nranks, rank, self._made_with(L, config)))
        self._learn_device()
        if watchdog_timeout is not None:
            self.start_watchdog(watchdog_timeout, on_hang=watchdog_on_hang)

    def _setup(
        self, L: NcclLibrary, rank: int, size: int, device: int | None, config: Config | None,
        stream: StreamLike,
    ) -> None:  # fmt: skip
        self._rank = rank
        self._size = size
        self._device = device
        self._keep_stream(stream)
        self._seq = 0
        self._ring: list[object] = [None] * _recorder.RING_SIZE
        self._compose(L, config)
        version = L.version
        # The ncclDataType_t argument for each type this library accepts (the member
        # itself, an int); None for a type it is too old for.
        self._codes = {dt: dt if version >= dt.first_release else None for dt in DataType}
        # The fast path's value-keyed tables (shared per release; see _collectives).
        self._optab = op_table(version)
        self._dtypes = dtype_table(version)
        self._sized(size)
        self._raw_fn = [L.raw(row.cfunc) if L.has(row.cfunc) else None for row in COLLECTIVES]
        self._fn = list(self._raw_fn)
        self._raw_bfn = [L.bare(row.cfunc) if L.has(row.cfunc) else None for row in COLLECTIVES]
        self._bfn = list(self._raw_bfn)

    def _compose(self, L: NcclLibrary, config: Config | None) -> None:
        """The parts, over this core. The hot path reads ``_custom_ops``, ``_regs`` and
        ``_wins`` off the communicator: the parts hold the same objects. Hooks run in the
        order registered: the barrier's buffer and the windows' scratch go once the handle
        is retired; windows close before registrations."""
        self._custom_ops: dict[int, tuple[object, set[int]]] = {}
        self._regs: dict[int, Registration] = {}
        self._wins: dict[tuple[int, int, int], Window] = {}
        self._barrier_buf: list[DeviceBuffer] = []  # barrier()'s, once allocated
        self._vcoll = VCollectives(self, self._barrier_buf, self._custom_ops)
        self._windows = windows = Windows(self, self._wins)
        self._memory = Memory(self, self._regs)
        self._signals = Signals(self, windows, rma_limits(L.version, None))
        self._suspend = suspend = Suspend(self)
        self._extras = extras = Extras(self, self._custom_ops, self._child, suspend)
        extras.blocking = config is None or config.blocking is None or bool(config.blocking)
        self._resilience = Resilience(self, extras)
        self._introspect = Introspection(self)

    def _made_with(self, L: NcclLibrary, config: Config | None) -> ncclConfig_t | None:
        """The config struct a new handle is made with (kept: NCCL keeps its commName
        pointer), and the one-sided limits it sets."""
        cfg = None if config is None else config.to_struct(L.version)
        self._suspend.config = cfg
        self._signals.rma = rma_limits(L.version, cfg)
        return cfg

    def _learn_device(self) -> None:
        if self._device is None and self._h is not None:
            _ = self.device  # known from now on, so buffers can be checked against it

    def _sized(self, size: int) -> None:
        """What the fast path derives from the size: the count bound."""
        self._fast_n = _fast_n(size)

    @classmethod
    def _wrap(
        cls, L: NcclLibrary, handle: int, rank: int, size: int, device: int | None, *,
        owner: bool = True, blocking: bool = True, stream: StreamLike = None,
        pending: bool = False,
    ) -> Communicator:  # fmt: skip
        self = cls.__new__(cls)
        self._init_handle(L, owner)
        self._setup(L, rank, size, device, None, stream)
        self._extras.blocking = blocking
        if not owner:
            self._signals.rma = None  # a borrowed handle's config is unknown
        self._adopt(handle, pending)
        return self

    def _child(self, handle: int, blocking: bool, cfg: object) -> Communicator:
        """The communicator ``split`` made (``handle``), once it is ready."""
        L = self._lib
        child = Communicator._wrap(
            L, handle, self._rank, self._size, self._device, blocking=blocking,
            stream=self._stream if self._stream_ref is None else self._stream_ref,
            pending=not blocking,
        )  # fmt: skip
        child._suspend.config = cfg  # NCCL keeps the commName pointer
        child._signals.rma = self._signals.rma if cfg is None else rma_limits(L.version, cfg)
        if not blocking:
            child.wait_ready()
        child._rank, child._size = rank_and_size(L, handle)
        child._sized(child._size)
        return child

    @classmethod
    def join(
        cls, nranks: int, unique_id: UniqueId | bytes, rank: int, *, device: int | None = None,
        config: Config | None = None, stream: StreamLike = None,
    ) -> Communicator:  # fmt: skip
        """``ncclCommGrow`` (NCCL >= 2.29) on a new rank: join the grow of an existing
        communicator as ``rank`` of ``nranks``, with the ``unique_id`` its root took
        (:meth:`grow_id`). ``device`` is made the thread's current device first, as
        ``Communicator(...)`` does; a non-blocking ``config`` returns at once, ready
        after ``wait_ready()``."""
        L = lib()
        L.require("Communicator.join (ncclCommGrow)", L.PROTOTYPES["ncclCommGrow"].first)
        nranks, uid, rank, device = join_args(nranks, unique_id, rank, device, config)
        self = cls.__new__(cls)
        self._init_handle(L, True)
        self._setup(L, rank, nranks, device, config, stream)
        if device is not None:
            cudart().cudaSetDevice(device)
        self._refuse_if_capturing("ncclCommGrow")
        refuse_in_group("ncclCommGrow")
        cfg = self._made_with(L, config)
        out = c_void_p()
        ref = None if cfg is None else byref(cfg)
        result = L.ncclCommGrow(None, nranks, byref(uid.struct), rank, byref(out), ref)
        self._adopt(out.value, result == Result.IN_PROGRESS)
        self._learn_device()
        return self

    @classmethod
    def from_handle(cls, handle: int, *, stream: StreamLike = None) -> Communicator:
        """Wrap an ``ncclComm_t`` created elsewhere; it is borrowed, never destroyed here."""
        if type(handle) is not int or not 0 < handle < 1 << 64:
            raise ValueError(f"handle must be a non-NULL ncclComm_t as an int, got {handle!r}")
        L = lib()
        rank, size = rank_and_size(L, handle)
        device = c_int()
        L.ncclCommCuDevice(handle, byref(device))
        return cls._wrap(L, handle, rank, size, device.value, owner=False, stream=stream)

    @classmethod
    def init_all(
        cls, devices: Sequence[int] | int, *, stream: StreamLike = None
    ) -> list[Communicator]:
        """``ncclCommInitAll``: one communicator per device, all in this process.

        ``devices`` is a list of device ordinals or a count (``range(n)``).
        """
        devs = init_all_devices(devices)
        L = lib()
        n = len(devs)
        handles = (c_void_p * n)()
        dev_array = (c_int * n)(*devs)
        L.ncclCommInitAll(handles, n, dev_array)
        return [cls._wrap(L, int(handles[i] or 0), i, n, devs[i], stream=stream) for i in range(n)]

    # -- what the parts implement ----------------------------------------------------------

    mem_alloc = delegate("_memory", Memory.mem_alloc)
    register = delegate("_memory", Memory.register)
    deregister = delegate("_memory", Memory.deregister)
    windows = delegate_property("_windows", Windows.windows)
    register_window = delegate("_windows", Windows.register_window)
    put_signal = delegate("_signals", Signals.put_signal)
    signal = delegate("_signals", Signals.signal)
    wait_signal = delegate("_signals", Signals.wait_signal)
    suspend = delegate("_suspend", Suspend.suspend)
    resume = delegate("_suspend", Suspend.resume)
    suspended = delegate("_suspend", Suspend.suspended)
    mem_stats = delegate("_suspend", Suspend.mem_stats)
    split = delegate("_extras", Extras.split)
    create_premul_sum = delegate("_extras", Extras.create_premul_sum)
    destroy_op = delegate("_extras", Extras.destroy_op)
    _note_op_use = delegate("_extras", Extras.note_op_use)
    revoke = delegate("_resilience", Resilience.revoke)
    shrink = delegate("_resilience", Resilience.shrink)
    grow_id = delegate("_resilience", Resilience.grow_id)
    grow = delegate("_resilience", Resilience.grow)
    all_gather_v = delegate("_vcoll", VCollectives.all_gather_v)
    reduce_scatter_v = delegate("_vcoll", VCollectives.reduce_scatter_v)
    all_to_all_v = delegate("_vcoll", VCollectives.all_to_all_v)
    barrier = delegate("_vcoll", VCollectives.barrier)
    properties = delegate_property("_introspect", Introspection.properties)
    algorithms = delegate("_introspect", Introspection.algorithms)

