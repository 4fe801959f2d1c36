"""``Communicator``: constructors, properties, lifecycle verbs, split, custom ops,
memory, registration, windows, one-sided signals, synchronize and the watchdog. The
collectives are generated from the spec table (:mod:`._codegen`) and attached at import;
their one slow path is :meth:`._collectives.Collectives._slow`, a base of the class."""

from __future__ import annotations

from collections.abc import Sequence
from ctypes import byref, c_int, c_void_p

from .._capi._enumargs import C_DATATYPE
from .._capi.structs import ncclUniqueId
from .._limits import (
    C_INT_MAX,
    check_c_int,
    check_device_ordinal,
    check_index,
    check_on_hang,
    check_timeout,
)
from ..enums import DataType, Result
from ..library import cudart, lib
from . import _recorder
from ._args import RANK_ARGS_LIMIT, op_table, rank_args
from ._codegen import install
from ._collectives import Collectives
from ._config import Config
from ._core import Core
from ._extras import Extras
from ._introspect import Introspection
from ._resilience import Resilience
from ._signals import Signals, rma_limits
from ._spec import COLLECTIVES
from ._suspend import Suspend
from ._uid import UniqueId, as_unique_ids
from ._vcoll import VCollectives

__all__ = ["Communicator"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from .._capi.nccl import NcclLibrary
    from ..cuda import DeviceBuffer
    from ..typing import DeviceLike, StreamLike

_P63 = 1 << 63
#: The inline raw-pointer path's largest count is a one-digit int (below 2**30), which
#: the interpreter compares with a specialised instruction.
_FAST_N_MAX = (1 << 30) - 1


def _fast_n(size: int) -> int:
    """The largest count the inline raw-pointer path takes: pointer + count * 16 bytes
    * nranks then stays below 2**64 without a multiplication per call."""
    return min(_FAST_N_MAX, _P63 // (16 * max(size, 1)))


class Communicator(
    Suspend, Resilience, Signals, Introspection, VCollectives, Collectives, Extras, Core
):
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
        "_array_ops",
        "_barrier_buf",
        "_fast_n",
        "_fast_w",
        "_ops",
        "_regs",
        "_rma",
        "_wargs",
        "_wins",
    )

    def __init__(
        self,
        nranks: int,
        unique_id: UniqueId | bytes | Sequence[UniqueId | bytes],
        rank: int,
        *,
        device: DeviceLike | None = None,
        config: Config | None = None,
        stream: StreamLike = None,
        watchdog_timeout: float | None = None,
        watchdog_on_hang: str = "abort",
    ) -> None:
        L = lib()
        self._init_handle(L, True)
        nranks = check_c_int(nranks, "nranks", 1, C_INT_MAX)
        rank = check_index(rank, "rank", nranks, f"for a communicator of size {nranks}")
        if device is not None:
            device = check_device_ordinal(device)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a pynccl.Config, got {type(config).__name__}")
        if watchdog_timeout is not None:
            check_timeout(watchdog_timeout, "watchdog_timeout")
        if check_on_hang(watchdog_on_hang, "watchdog_on_hang") == "revoke":
            L.require("watchdog_on_hang='revoke'", L.PROTOTYPES["ncclCommRevoke"].first)
        ids = as_unique_ids(unique_id)
        self._setup(L, rank, nranks, device, config, stream)
        if device is not None:
            cudart().cudaSetDevice(device)
        self._refuse_if_capturing("communicator initialisation")
        comm = c_void_p()
        cfg = None if config is None else config.to_struct(L.version)
        self._config = cfg  # NCCL keeps the commName pointer: keep the struct alive
        self._rma = rma_limits(L.version, cfg)
        if len(ids) > 1:
            L.require("ncclCommInitRankScalable (several unique ids)", (2, 23, 4))
            id_array = (ncclUniqueId * len(ids))(*(uid.struct for uid in ids))
            result = L.ncclCommInitRankScalable(
                byref(comm), nranks, rank, len(ids), id_array, None if cfg is None else byref(cfg)
            )
        elif cfg is not None:
            result = L.ncclCommInitRankConfig(byref(comm), nranks, ids[0].struct, rank, byref(cfg))
        else:
            result = L.ncclCommInitRank(byref(comm), nranks, ids[0].struct, rank)
        self._adopt(comm.value, result == Result.IN_PROGRESS)
        if self._device is None and self._h is not None:
            _ = self.device  # known from now on, so buffers can be checked against it
        if watchdog_timeout is not None:
            self.start_watchdog(watchdog_timeout, on_hang=watchdog_on_hang)

    def _setup(
        self,
        L: NcclLibrary,
        rank: int,
        size: int,
        device: int | None,
        config: Config | None,
        stream: StreamLike,
    ) -> None:
        self._rank = rank
        self._size = size
        self._device = device
        self._blocking = config is None or config.blocking is None or bool(config.blocking)
        self._keep_stream(stream)
        self.on_close(self._close_windows)
        self.on_close(self._close_registrations)
        self._custom_ops: dict[int, tuple[object, set[int]]] = {}
        self._config = None
        self._regs = {}
        self._wins = {}
        self._seq = 0
        self._barrier_buf: list[DeviceBuffer] = []  # barrier()'s, once allocated
        self._ring: list[object] = [None] * _recorder.RING_SIZE
        version = L.version
        self._rma = rma_limits(version, None)
        # The ncclDataType_t argument for each type this library accepts (its shared
        # c_int); None for a type it is too old for.
        self._codes: dict[DataType, c_int | None] = {
            dt: C_DATATYPE[dt] if version >= dt.first_release else None for dt in DataType
        }
        self._ops = op_table(version)
        # Ops the inline array path takes: not prod/max/min, which need the complex check.
        self._array_ops = op_table(version, arrays=True)
        self._sized(size)
        self._raw_fn = [L.raw(row.cfunc) if L.has(row.cfunc) else None for row in COLLECTIVES]
        self._fn = list(self._raw_fn)
        self._raw_bfn = [L.bare(row.cfunc) if L.has(row.cfunc) else None for row in COLLECTIVES]
        self._bfn = list(self._raw_bfn)

    def _sized(self, size: int) -> None:
        """What the inline paths derive from the size: the count bound, and the shared
        c_int of each root/peer they take (``_wargs[r]`` for ``0 <= r < _fast_w``)."""
        self._fast_n = _fast_n(size)
        self._fast_w = min(size, RANK_ARGS_LIMIT)
        self._wargs = rank_args(size)
        self._forget_memos()

    @classmethod
    def _wrap(
        cls,
        L: NcclLibrary,
        handle: int,
        rank: int,
        size: int,
        device: int | None,
        *,
        owner: bool = True,
        blocking: bool = True,
        stream: StreamLike = None,
        pending: bool = False,
    ) -> Communicator:
        self = cls.__new__(cls)
        self._init_handle(L, owner)
        self._setup(L, rank, size, device, None, stream)
        self._blocking = blocking
        if not owner:
            self._rma = None  # a borrowed handle's config is unknown
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
        child._config = cfg  # NCCL keeps the commName pointer
        child._rma = self._rma if cfg is None else rma_limits(L.version, cfg)
        if not blocking:
            child.wait_ready()
        value = c_int()
        L.ncclCommUserRank(handle, byref(value))
        child._rank = value.value
        L.ncclCommCount(handle, byref(value))
        child._size = value.value
        child._sized(child._size)
        return child

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
        from ._from_env import from_env

        return from_env(**kwargs)

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        # pickle and copy both come here: a copy would own (and destroy) the same handle
        raise TypeError(
            "a Communicator cannot be pickled or copied: it is this process's handle to "
            "NCCL state on its GPU, which no other process can use. Send what creates one "
            "instead (the UniqueId it was made from, which pickles, or bytes(uid); the "
            "rank; the world size) and call Communicator(world_size, uid, rank) in the "
            "receiving process"
        )

    @classmethod
    def from_handle(cls, handle: int, *, stream: StreamLike = None) -> Communicator:
        """Wrap an ``ncclComm_t`` created elsewhere; it is borrowed, never destroyed here."""
        if type(handle) is not int or not 0 < handle < 1 << 64:
            raise ValueError(f"handle must be a non-NULL ncclComm_t as an int, got {handle!r}")
        L = lib()
        value = c_int()
        L.ncclCommCount(handle, byref(value))
        size = value.value
        L.ncclCommUserRank(handle, byref(value))
        rank = value.value
        L.ncclCommCuDevice(handle, byref(value))
        return cls._wrap(L, handle, rank, size, value.value, owner=False, stream=stream)

    @classmethod
    def init_all(
        cls, devices: Sequence[int] | int, *, stream: StreamLike = None
    ) -> list[Communicator]:
        """``ncclCommInitAll``: one communicator per device, all in this process.

        ``devices`` is a list of device ordinals or a count (``range(n)``).
        """
        if isinstance(devices, Sequence):
            devs = [check_device_ordinal(d, "devices") for d in devices]
        else:
            devs = list(range(check_c_int(devices, "devices", 0)))
        if not devs:
            raise ValueError("init_all needs at least one device")
        if len(set(devs)) != len(devs):
            raise ValueError(f"devices has duplicates: {devs}")
        L = lib()
        n = len(devs)
        handles = (c_void_p * n)()
        dev_array = (c_int * n)(*devs)
        L.ncclCommInitAll(handles, n, dev_array)
        return [cls._wrap(L, int(handles[i] or 0), i, n, devs[i], stream=stream) for i in range(n)]

    def __repr__(self) -> str:
        return (
            f"<pynccl.Communicator rank {self._rank}/{self._size} device {self._device} "
            f"{self._state}{'' if self._owner else ' (borrowed)'}>"
        )


install(Communicator)
