"""The object API: :class:`UniqueId`, :class:`Config` and :class:`Communicator`.

A collective call goes: argument adaptation (:mod:`pynccl._adapt`) and
validation here, then the bare ctypes function, then the result check. The
raw-pointer route (``int`` buffers with ``count=`` and ``dtype=``) probes
nothing per call: dtypes and ops resolve through prebuilt tables and the
ctypes functions are bound once per communicator.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
import warnings
from collections.abc import Sequence
from ctypes import byref, c_int, c_size_t, c_void_p
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any, ClassVar

from . import groups as _group
from ._adapt import _BUFFER_HANDLERS, as_buffer, as_stream, buffer_handler, check_device
from ._adapt import _PTR_LIMIT as _U64  # pointers and size_t counts lie in [0, 2**64)
from ._adapt import check_pointer as _check_pointer
from ._capi.nccl import C_DATATYPE, C_REDOP, NcclLibrary
from ._capi.structs import (
    NCCL_SPLIT_NOCOLOR,
    NCCL_UNIQUE_ID_BYTES,
    make_config,
    ncclConfig_t,
    ncclUniqueId,
)
from .dtypes import as_datatype, canonical_name
from .enums import DataType, RedOp, Result, ScalarResidence
from .errors import NcclError, NcclInvalidUsage, NcclTimeoutError, NotSupportedError
from .library import cudart, lib
from .watchdog import RING_MASK, RING_SIZE, FlightRecord, Watchdog, format_record

__all__ = ["Communicator", "Config", "UniqueId"]

_Buf = Any  # an int pointer, a __cuda_array_interface__ or DLPack object


# --------------------------------------------------------------------------------------
# UniqueId


class UniqueId:
    """An ``ncclUniqueId``: 128 bytes that name one communicator being created.

    ``UniqueId()`` asks NCCL for a new one (``ncclGetUniqueId``; rank 0 does this
    and shares the bytes with the other ranks). ``bytes(uid)`` /
    ``UniqueId.from_bytes(b)``, ``uid.hex()`` / ``UniqueId.fromhex(s)``; it pickles
    and compares by value. Its ``repr`` shows only a short fingerprint: the id
    carries the root's listening address and is the key to join the job.
    """

    __slots__ = ("_struct",)

    def __init__(self, data: bytes | bytearray | memoryview | None = None) -> None:
        self._struct = ncclUniqueId()
        if data is None:
            lib().ncclGetUniqueId(byref(self._struct))
            return
        raw = bytes(data)
        if len(raw) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"a unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)} bytes")
        ctypes.memmove(byref(self._struct), raw, NCCL_UNIQUE_ID_BYTES)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> UniqueId:
        """The id whose 128 bytes are ``data``."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"UniqueId.from_bytes needs bytes, got {type(data).__name__}")
        return cls(data)

    @classmethod
    def fromhex(cls, text: str) -> UniqueId:
        """The id from its 256-character hex form (``uid.hex()``)."""
        try:
            raw = bytes.fromhex(text)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"not a hex string of {NCCL_UNIQUE_ID_BYTES} bytes") from exc
        return cls(raw)

    def __bytes__(self) -> bytes:
        return ctypes.string_at(byref(self._struct), NCCL_UNIQUE_ID_BYTES)

    def hex(self) -> str:
        """The 128 bytes as 256 hex characters."""
        return bytes(self).hex()

    @property
    def struct(self) -> ncclUniqueId:
        """The ``ncclUniqueId`` structure (pass it by value to the C functions)."""
        return self._struct

    def fingerprint(self) -> str:
        """A short digest identifying this id in logs without revealing it."""
        return hashlib.sha256(bytes(self)).hexdigest()[:12]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UniqueId):
            return NotImplemented
        return bytes(self) == bytes(other)

    def __hash__(self) -> int:
        return hash(bytes(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (UniqueId.from_bytes, (bytes(self),))

    def __repr__(self) -> str:
        return f"UniqueId(<{self.fingerprint()}>)"


def _as_unique_ids(unique_id: Any) -> list[UniqueId]:
    if isinstance(unique_id, UniqueId):
        return [unique_id]
    if isinstance(unique_id, (bytes, bytearray, memoryview)):
        return [UniqueId.from_bytes(unique_id)]
    if isinstance(unique_id, Sequence) and not isinstance(unique_id, str):
        ids = [_as_unique_ids(item)[0] for item in unique_id]
        if not ids:
            raise ValueError("unique_id: an empty sequence of unique ids")
        return ids
    raise TypeError(
        f"unique_id must be a UniqueId, 128 bytes or a sequence of them, got "
        f"{type(unique_id).__name__}"
    )


# --------------------------------------------------------------------------------------
# Config


@dataclass
class Config:
    """Communicator options, turned into an ``ncclConfig_t``; ``None`` leaves NCCL's default.

    Each field needs a minimum NCCL release (shown in brackets); a field the
    loaded library does not know raises :class:`~pynccl.NotSupportedError`
    rather than being silently ignored.
    """

    blocking: bool | None = None  #: [2.14] False: calls may return ncclInProgress
    cga_cluster_size: int | None = None  #: [2.17]
    min_ctas: int | None = None  #: [2.17]
    max_ctas: int | None = None  #: [2.17]
    net_name: str | None = None  #: [2.17]
    split_share: bool | None = None  #: [2.18]
    traffic_class: int | None = None  #: [2.26]
    comm_name: str | None = None  #: [2.27]
    collnet_enable: bool | None = None  #: [2.27]
    cta_policy: int | None = None  #: [2.27]
    shrink_share: bool | None = None  #: [2.27]
    nvls_ctas: int | None = None  #: [2.27]
    n_channels_per_net_peer: int | None = None  #: [2.28]
    nvlink_centric_sched: bool | None = None  #: [2.28]
    graph_usage_mode: int | None = None  #: [2.29]
    num_rma_ctx: int | None = None  #: [2.29]
    max_p2p_peers: int | None = None  #: [2.30.3]
    graph_stream_ordering: int | None = None  #: [2.30.5]
    launch_order_implicit: bool | None = None  #: [2.31]
    num_rma_sig: int | None = None  #: [2.31]
    rma_eager_init: bool | None = None  #: [2.31]
    host_cft_mode: int | None = None  #: [2.31]
    nvls_host_mode: int | None = None  #: [2.32]

    C_NAMES: ClassVar[dict[str, str]] = {
        "blocking": "blocking",
        "cga_cluster_size": "cgaClusterSize",
        "min_ctas": "minCTAs",
        "max_ctas": "maxCTAs",
        "net_name": "netName",
        "split_share": "splitShare",
        "traffic_class": "trafficClass",
        "comm_name": "commName",
        "collnet_enable": "collnetEnable",
        "cta_policy": "CTAPolicy",
        "shrink_share": "shrinkShare",
        "nvls_ctas": "nvlsCTAs",
        "n_channels_per_net_peer": "nChannelsPerNetPeer",
        "nvlink_centric_sched": "nvlinkCentricSched",
        "graph_usage_mode": "graphUsageMode",
        "num_rma_ctx": "numRmaCtx",
        "max_p2p_peers": "maxP2pPeers",
        "graph_stream_ordering": "graphStreamOrdering",
        "launch_order_implicit": "launchOrderImplicit",
        "num_rma_sig": "numRmaSig",
        "rma_eager_init": "rmaEagerInit",
        "host_cft_mode": "hostCftMode",
        "nvls_host_mode": "nvlsHostMode",
    }

    def c_fields(self) -> dict[str, Any]:
        """The fields that are set, by their ``ncclConfig_t`` names."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and f.name in self.C_NAMES:
                out[self.C_NAMES[f.name]] = int(value) if isinstance(value, bool) else value
        return out

    def to_struct(self, loaded: tuple[int, int, int] | None = None) -> ncclConfig_t:
        """The ``ncclConfig_t``; with ``loaded``, refuses fields that release lacks."""
        return make_config(self.c_fields(), loaded)


# --------------------------------------------------------------------------------------
# Communicator

_OP_NAMES: dict[Any, int] = {}
for _op in RedOp:
    _OP_NAMES[_op] = int(_op)
    _OP_NAMES[_op.name.lower()] = int(_op)
    _OP_NAMES[_op.c_name] = int(_op)
del _op
# The ops that need no per-call check (avg is refused on integers and before 2.10).
# The hot paths pass the shared c_int of each type and op (C_DATATYPE, C_REDOP).
_FAST_OPS = {k: C_REDOP[RedOp(v)] for k, v in _OP_NAMES.items() if v != RedOp.AVG}
_SUM = RedOp.SUM
_C_SUM = _FAST_OPS[_SUM]
# The same for size_t counts, which repeat (the same buffers, call after call): a bounded
# cache of c_size_t objects, shared and never mutated, keyed by the count.
_SIZE_ARGS: dict[int, c_size_t] = {}
_SIZE_ARGS_LIMIT = 4096


def _size_arg(count: int) -> c_size_t:
    """``count`` (already checked to lie in [0, 2**64)) as a shared c_size_t."""
    arg = c_size_t(count)
    if len(_SIZE_ARGS) < _SIZE_ARGS_LIMIT:
        _SIZE_ARGS[count] = arg
    return arg


def _check_rank(value: Any, size: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < size:
        raise ValueError(f"{name}={value} is out of range for a communicator of size {size}")
    return int(value)


def _raw_count(count: Any) -> int:
    if count is None:
        raise TypeError("sendbuf is a raw pointer, so count= and dtype= are required")
    return _check_count(count)


def _check_count(count: Any, name: str = "count") -> int:
    if type(count) is not int or not 0 <= count < _U64:
        if isinstance(count, int) and not isinstance(count, bool) and 0 <= count < _U64:
            return int(count)
        # ctypes would silently wrap a size_t of 2**64 or more: refuse it here.
        raise ValueError(f"{name} must be a non-negative int below 2**64, got {count!r}")
    return count


class Communicator:
    """An NCCL communicator (``ncclComm_t``) with every collective and point-to-point call.

    ``Communicator(nranks, unique_id, rank, device=None, config=None, stream=None)``
    sets ``device`` as the calling thread's CUDA device (if given) and calls
    ``ncclCommInitRank`` (or ``ncclCommInitRankConfig`` with a :class:`Config`,
    or ``ncclCommInitRankScalable`` — NCCL >= 2.23 — when ``unique_id`` is a list).

    Buffers are raw device pointers (``int``, with ``count=`` and ``dtype=``), or
    objects exposing ``__cuda_array_interface__`` or DLPack on a CUDA device.
    ``count`` is NCCL's: elements per rank. ``stream=None`` uses :attr:`stream`.

    Use it as a context manager (destroy on normal exit, abort on an exception)
    or call :meth:`destroy` / :meth:`abort`; afterwards every call raises
    :class:`~pynccl.NcclInvalidUsage`.
    """

    __slots__ = (
        "__weakref__",
        "_blocking",
        "_c",
        "_c_allreduce",
        "_codes",
        "_config",
        "_custom_ops",
        "_device",
        "_error",
        "_h",
        "_handle",
        "_lib",
        "_native",
        "_owner",
        "_rank",
        "_ring",
        "_seq",
        "_size",
        "_state",
        "_stream",
        "_watch",
    )

    _DEFAULT_POLL: ClassVar[float] = 0.0005

    def __init__(
        self,
        nranks: int,
        unique_id: UniqueId | bytes | Sequence[UniqueId | bytes],
        rank: int,
        *,
        device: int | None = None,
        config: Config | None = None,
        stream: Any = None,
        watchdog_timeout: float | None = None,
    ) -> None:
        self._h: int | None = None
        self._handle: int | None = None
        self._owner = True
        self._state = "uninitialized"
        if type(nranks) is not int or nranks < 1:
            raise ValueError(f"nranks must be a positive int, got {nranks!r}")
        rank = _check_rank(rank, nranks, "rank")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a pynccl.Config, got {type(config).__name__}")
        ids = _as_unique_ids(unique_id)
        L = lib()
        self._setup(L, rank, nranks, device, config, stream)
        if device is not None:
            _set_device(device)
        self._refuse_if_capturing("communicator initialisation")
        comm = c_void_p()
        cfg = None if config is None else config.to_struct(L.version)
        self._config = cfg  # NCCL keeps the commName pointer: keep the struct alive
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
        self._adopt(comm.value, result)
        if self._device is None and self._h is not None:
            _ = self.device  # known from now on, so buffers can be checked against it
        if watchdog_timeout is not None:
            self.start_watchdog(watchdog_timeout)

    # -- construction helpers ----------------------------------------------------------

    def _setup(
        self,
        L: NcclLibrary,
        rank: int,
        size: int,
        device: int | None,
        config: Config | None,
        stream: Any,
    ) -> None:
        self._lib = L
        self._rank = rank
        self._size = size
        self._device = device
        self._blocking = config is None or config.blocking is None or bool(config.blocking)
        self._stream = as_stream(stream) if stream is not None else 0
        self._custom_ops: set[int] = set()
        self._config = None
        self._seq = 0
        self._ring: list[tuple[Any, ...] | None] = [None] * RING_SIZE
        self._watch: Watchdog | None = None
        self._error: BaseException | None = None
        version = L.version
        # The ncclDataType_t argument for each type this library accepts (its shared
        # c_int from C_DATATYPE); None for a type it is too old for.
        self._codes: dict[DataType, c_int | None] = {
            dt: C_DATATYPE[dt] if version >= dt.first_release else None for dt in DataType
        }
        self._native = L.has("ncclAlltoAll") and L.has("ncclGather") and L.has("ncclScatter")
        # Bare ctypes functions, bound once: the hot path calls them directly.
        raw = L.raw
        self._c = {name: raw(name) for name in _HOT if L.has(name)}
        self._c_allreduce = self._c["ncclAllReduce"]

    def _adopt(self, handle: int | None, result: Result) -> None:
        if not handle:
            raise NcclError(
                Result.INTERNAL_ERROR, "ncclCommInit", "NCCL returned a NULL communicator"
            )
        self._handle = handle
        if result == Result.IN_PROGRESS:
            self._state = "initializing"
        else:
            self._state = "ready"
            self._h = handle

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
        stream: Any = None,
        pending: bool = False,
    ) -> Communicator:
        self = cls.__new__(cls)
        self._h = None
        self._handle = None
        self._owner = owner
        self._state = "uninitialized"
        self._setup(L, rank, size, device, None, stream)
        self._blocking = blocking
        self._adopt(handle, Result.IN_PROGRESS if pending else Result.SUCCESS)
        return self

    @classmethod
    def from_env(cls, **kwargs: Any) -> Communicator:
        """This process's communicator from its launcher's environment.

        torchrun / ``python -m pynccl launch``, Open MPI, MPICH / Intel MPI or
        Slurm variables give rank, world size and device; the unique id travels
        over TCP (``MASTER_ADDR:MASTER_PORT``, authenticated with
        ``PYNCCL_RENDEZVOUS_KEY``), a ``store=``, an ``mpi_comm=`` or a ``file=``.
        Keyword arguments as :func:`pynccl.bootstrap.from_env` (``timeout``,
        ``store``, ``mpi_comm``, ``file``, ``config``, ``nids``, ``device``, ...).
        """
        from .bootstrap import from_env

        return from_env(**kwargs)

    @classmethod
    def from_handle(cls, handle: int, *, stream: Any = None) -> Communicator:
        """Wrap an ``ncclComm_t`` created elsewhere; it is borrowed, never destroyed here."""
        if type(handle) is not int or handle <= 0:
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
    def init_all(cls, devices: Sequence[int] | int, *, stream: Any = None) -> list[Communicator]:
        """``ncclCommInitAll``: one communicator per device, all in this process.

        ``devices`` is a list of device ordinals or a count (``range(n)``).
        """
        devs = list(range(devices)) if isinstance(devices, int) else list(devices)
        if not devs:
            raise ValueError("init_all needs at least one device")
        for d in devs:
            if type(d) is not int or d < 0:
                raise ValueError(f"devices must be non-negative ints, got {d!r}")
        if len(set(devs)) != len(devs):
            raise ValueError(f"devices has duplicates: {devs}")
        L = lib()
        n = len(devs)
        handles = (c_void_p * n)()
        dev_array = (c_int * n)(*devs)
        L.ncclCommInitAll(handles, n, dev_array)
        return [cls._wrap(L, int(handles[i] or 0), i, n, devs[i], stream=stream) for i in range(n)]

    # -- properties ---------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This rank's index in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._size

    @property
    def device(self) -> int:
        """The CUDA device of this communicator (``ncclCommCuDevice``)."""
        if self._device is None:
            value = c_int()
            self._lib.ncclCommCuDevice(self._live(), byref(value))
            self._device = value.value
        return self._device

    @property
    def handle(self) -> int:
        """The ``ncclComm_t`` as an int (for the low-level layer or other bindings)."""
        if self._handle is None:
            raise NcclInvalidUsage(Result.INVALID_USAGE, "", f"communicator is {self._state}")
        return self._handle

    @property
    def stream(self) -> int:
        """The default stream handle for this communicator's calls (0 = legacy default)."""
        return self._stream

    @stream.setter
    def stream(self, value: Any) -> None:
        self._stream = 0 if value is None else as_stream(value)

    @property
    def state(self) -> str:
        """``"ready"``, ``"initializing"`` (non-blocking), ``"finalized"``, ``"destroyed"``,
        ``"aborted"`` or ``"closed"``."""
        return self._state

    @property
    def library(self) -> NcclLibrary:
        """The low-level library this communicator calls."""
        return self._lib

    def __repr__(self) -> str:
        return (
            f"<pynccl.Communicator rank {self._rank}/{self._size} device {self._device} "
            f"{self._state}{'' if self._owner else ' (borrowed)'}>"
        )

    # -- state ---------------------------------------------------------------------------

    def _live(self) -> int:
        """The handle for a call, waiting for a non-blocking communicator if needed."""
        h = self._h
        if h is not None:
            return h
        if self._error is not None:
            raise self._error
        if self._state == "initializing":
            self.wait_ready()
            if self._h is not None:
                return self._h
        raise NcclInvalidUsage(
            Result.INVALID_USAGE,
            "",
            f"communicator rank {self._rank} is {self._state}; it cannot be used any more",
        )

    def _mark_pending(self) -> None:
        if self._state == "ready":
            self._state = "initializing"
            self._h = None

    def _pending_after(self, result: int) -> None:
        # A non-blocking call returned ncclInProgress: poll before the next call.
        if result == Result.IN_PROGRESS:
            if _group._state.depth > 0:
                _group._state.pending.append(self)
            else:
                self._mark_pending()

    def get_async_error(self) -> Result:
        """``ncclCommGetAsyncError``: ``SUCCESS``, ``IN_PROGRESS`` or the error of the comm."""
        if self._handle is None or self._state in ("destroyed", "aborted", "closed"):
            raise NcclInvalidUsage(Result.INVALID_USAGE, "", f"communicator is {self._state}")
        value = c_int()
        self._lib.ncclCommGetAsyncError(self._handle, byref(value))
        try:
            return Result(value.value)
        except ValueError:
            return value.value  # type: ignore[return-value]

    def check(self) -> None:
        """Raise the communicator's asynchronous error, if any."""
        result = self.get_async_error()
        if result not in (Result.SUCCESS, Result.IN_PROGRESS):
            raise self._lib.make_error(result, "ncclCommGetAsyncError")

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll ``ncclCommGetAsyncError`` until a non-blocking call completes.

        Raises the asynchronous error if one occurred, and
        :class:`~pynccl.NcclTimeoutError` after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = self._DEFAULT_POLL
        while True:
            result = self.get_async_error()
            if result == Result.SUCCESS:
                if self._state == "initializing":
                    self._state = "ready"
                    self._h = self._handle
                return
            if result != Result.IN_PROGRESS:
                raise self._lib.make_error(result, "ncclCommGetAsyncError")
            if deadline is not None and time.monotonic() >= deadline:
                raise NcclTimeoutError(
                    Result.TIMEOUT,
                    "ncclCommGetAsyncError",
                    f"communicator rank {self._rank} not ready after {timeout} s",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _refuse_if_capturing(self, what: str) -> None:
        """Init, split and register cannot be captured in a CUDA graph: say so clearly,
        before they call anything that would invalidate the capture."""
        try:
            from .cuda import _capture_blocks

            # The legacy default stream (0) answers for the blocking streams of the device.
            own = self._stream not in (0, 1) and _capture_blocks(self._stream)
            if not own and not _capture_blocks(0):
                return
        except (OSError, NcclError, NotSupportedError):  # no usable libcudart: nothing to check
            return
        where = (
            f"stream {self._stream:#x} is being captured"
            if own
            else "a stream of this device is being captured"
        )
        raise NcclInvalidUsage(
            Result.INVALID_USAGE,
            "",
            f"{what} cannot run while {where} into a CUDA graph; do it before the capture begins",
        )

    # -- lifecycle -----------------------------------------------------------------------

    def finalize(self, timeout: float | None = None) -> None:
        """``ncclCommFinalize`` (NCCL >= 2.14): flush pending work; :meth:`destroy` after."""
        if self._state == "finalized":
            return
        h = self._live()
        result = self._lib.ncclCommFinalize(h)
        if result == Result.IN_PROGRESS:
            self._state = "initializing"
            self._h = None
            self.wait_ready(timeout)
        self._state = "finalized"
        self._h = None

    def destroy(self) -> None:
        """``ncclCommDestroy``; a second call does nothing. Borrowed handles are only dropped."""
        if self._handle is None or self._state in ("destroyed", "aborted", "closed"):
            return
        if _group.group_depth() > 0:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "ncclCommDestroy",
                "cannot destroy a communicator inside a group; end the group first",
            )
        self.stop_watchdog()
        handle = self._handle
        self._h = None
        if not self._owner:
            self._state = "closed"
            self._handle = None
            return
        self._state = "destroyed"
        self._lib.ncclCommDestroy(handle)
        self._handle = None

    def abort(self) -> None:
        """``ncclCommAbort``: stop pending work and free the communicator (also when hung)."""
        if self._handle is None or self._state in ("destroyed", "aborted", "closed"):
            return
        self.stop_watchdog()
        handle = self._handle
        self._h = None
        if not self._owner:
            self._state = "closed"
            self._handle = None
            return
        self._state = "aborted"
        self._lib.ncclCommAbort(handle)
        self._handle = None

    def close(self) -> None:
        """Destroy the communicator if this object owns it; forget a borrowed one."""
        self.destroy()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.destroy()
        else:
            self.abort()

    def __del__(self) -> None:
        # Never tear down from __del__ (it may run on any thread, at exit, or inside a
        # group): only tell the user.
        if getattr(self, "_owner", False) and getattr(self, "_handle", None) is not None:
            warnings.warn(
                f"pynccl.Communicator rank {self._rank}/{self._size} was never destroyed; "
                "call destroy()/abort() or use it as a context manager",
                ResourceWarning,
                stacklevel=2,
            )

    # -- hangs: flight recorder, synchronize, watchdog --------------------------------------

    # The ring holds, per slot, ``(function, root/peer, args)``; all_reduce's hot path
    # stores its bare argument tuple instead, sparing a tuple per call. A slot's
    # sequence number is not stored: it is the newest one issued that maps to the slot.

    def _entry(self, seq: int) -> FlightRecord | None:
        slot = self._ring[seq & RING_MASK]
        if slot is None or not 0 <= self._seq - 1 - seq < RING_SIZE:
            return None  # not issued yet, or overwritten (checked after reading the slot)
        name, where, args = slot if len(slot) == 3 else ("ncclAllReduce", -1, slot)
        # The hot paths pass c_int objects for types and ops: report their values.
        plain = tuple(a.value if type(a) in (c_int, c_size_t) else a for a in args)
        return (seq, name, where, plain)

    def flight_record(self) -> list[FlightRecord]:
        """The last operations issued (oldest first): ``(seq, function, root/peer, args)``."""
        seq = self._seq
        entries = (self._entry(i) for i in range(max(0, seq - RING_SIZE), seq))
        return [e for e in entries if e is not None]

    def format_flight_record(self) -> str:
        """The flight record as text, for error messages and hang reports."""
        entries = self.flight_record()
        if not entries:
            return f"No operation issued yet on rank {self._rank}."
        lines = [f"Last {len(entries)} operations issued on rank {self._rank}/{self._size}:"]
        lines += ["  " + format_record(e) for e in entries]
        return "\n".join(lines)

    def _describe(self, seq: int) -> str:
        entry = self._entry(seq)
        return "operation" if entry is None else entry[1]

    def last_operation(self) -> str:
        """The last operation issued, as text (``"none"`` before the first)."""
        entry = self._entry(self._seq - 1) if self._seq else None
        return "none" if entry is None else format_record(entry)

    def synchronize(self, stream: Any = None, timeout: float | None = None) -> None:
        """Wait for ``stream`` (default: :attr:`stream`) while watching for NCCL errors.

        Raises the communicator's asynchronous error as soon as it appears
        (e.g. :class:`~pynccl.NcclRemoteError` when a peer died). After
        ``timeout`` seconds it aborts the communicator and raises
        :class:`~pynccl.NcclTimeoutError` naming the last operation issued.
        """
        s = self._s(stream)
        self._live()
        from .cuda import _capture_blocks

        if _capture_blocks(s):
            # cudaStreamQuery would fail and invalidate the capture: nothing captured has
            # run yet, so there is nothing to wait for either.
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "synchronize",
                f"stream {s:#x} is being captured into a CUDA graph: its work runs when "
                "the graph is launched; end the capture, launch the graph, then synchronize",
            )
        rt = cudart()
        query = rt.raw("cudaStreamQuery")
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0
        while True:
            rc = query(s)
            if rc == 0:
                break
            if rc != 600:
                raise rt.make_error(rc, "cudaStreamQuery")
            self._raise_async_error()
            if deadline is not None and time.monotonic() >= deadline:
                last = self.last_operation()
                record = self.format_flight_record()
                self.abort()
                raise NcclTimeoutError(
                    Result.TIMEOUT,
                    "synchronize",
                    f"stream {s:#x} did not finish within {timeout:g} s; the communicator was "
                    f"aborted. Last operation issued: {last}. {record}",
                )
            time.sleep(delay)
            delay = min(delay * 2 or 0.0001, 0.005)
        # An error found after the stream drained gets the same flight record as one
        # found while waiting: which of the two happens is a matter of timing.
        self._raise_async_error()

    def _raise_async_error(self) -> None:
        result = self.get_async_error()
        if result not in (Result.SUCCESS, Result.IN_PROGRESS):
            error = self._lib.make_error(result, "ncclCommGetAsyncError")
            error.message += ". " + self.format_flight_record()
            raise error

    def start_watchdog(self, timeout: float, interval: float | None = None) -> None:
        """Start a daemon thread that aborts this communicator when an operation hangs.

        An operation still incomplete ``timeout`` seconds after it was issued, or
        an asynchronous NCCL error, makes the watchdog abort the communicator and
        record why; the next call then raises that error. Costs a CUDA event
        record per operation while running.
        """
        self._live()
        if self._watch is not None and self._watch.running:
            raise NcclInvalidUsage(Result.INVALID_USAGE, "", "the watchdog is already running")
        self._set_watch(Watchdog(self, timeout, interval))

    def stop_watchdog(self) -> None:
        """Stop the watchdog thread, if one runs."""
        watch = self._watch
        self._set_watch(None)
        if watch is not None:
            watch.stop()

    def _set_watch(self, watch: Watchdog | None) -> None:
        # all_reduce's hot path never tests for a watchdog: its C function is swapped.
        self._watch = watch
        raw = self._c["ncclAllReduce"]
        self._c_allreduce = raw if watch is None else self._watched_allreduce

    def _watched_allreduce(self, *args: Any) -> int:
        """ncclAllReduce under the watchdog's lock, with a completion event recorded."""
        watch = self._watch
        raw = self._c["ncclAllReduce"]
        if watch is None:
            if self._error is not None:  # aborted by the watchdog
                raise self._error
            return int(raw(*args))
        with watch.lock:
            if self._h is None and self._error is not None:
                raise self._error
            rc = int(raw(*args))
            if rc in (0, 7):
                watch.enqueued(self._seq - 1, args[-1])
        return rc

    @property
    def error(self) -> BaseException | None:
        """The error the watchdog recorded when it aborted this communicator, if any."""
        return self._error

    def _abort_with(self, reason: BaseException) -> None:
        # Called by the watchdog thread, holding the watchdog's lock; the watchdog
        # frees its own events once it has released that lock.
        self._error = reason
        # _c_allreduce stays _watched_allreduce: a call racing this abort then meets
        # the recorded error instead of passing the freed handle to NCCL.
        self._watch = None
        handle = self._handle
        self._h = None
        if handle is None or self._state in ("destroyed", "aborted", "closed"):
            return
        self._state = "aborted"
        self._handle = None
        if self._owner:
            self._lib.raw("ncclCommAbort")(handle)

    # -- splitting -----------------------------------------------------------------------

    def split(
        self, color: int | None, key: int | None = None, config: Config | None = None
    ) -> Communicator | None:
        """``ncclCommSplit`` (NCCL >= 2.18): every rank calls it; ranks with the same
        ``color`` form a new communicator, ordered by ``key`` (default: this rank).
        ``color=None`` (``NCCL_SPLIT_NOCOLOR``) takes no part and returns ``None``."""
        h = self._live()
        if color is None:
            color = NCCL_SPLIT_NOCOLOR
        if type(color) is not int or (color < 0 and color != NCCL_SPLIT_NOCOLOR):
            raise ValueError(f"color must be a non-negative int or None, got {color!r}")
        key = self._rank if key is None else key
        if type(key) is not int:
            raise TypeError(f"key must be an int, got {type(key).__name__}")
        self._refuse_if_capturing("ncclCommSplit")
        cfg = None if config is None else config.to_struct(self._lib.version)
        out = c_void_p()
        result = self._lib.ncclCommSplit(
            h, color, key, byref(out), None if cfg is None else byref(cfg)
        )
        blocking = (
            self._blocking if config is None or config.blocking is None else bool(config.blocking)
        )
        if result == Result.IN_PROGRESS or (not blocking and not out.value):
            # Non-blocking: the new handle is written later by NCCL; poll the parent.
            self._state, self._h = "initializing", None
            self.wait_ready()
        if not out.value:
            return None
        child = Communicator._wrap(
            self._lib,
            out.value,
            -1,
            -1,
            self._device,
            blocking=blocking,
            stream=self._stream or None,
            pending=not blocking,
        )
        child._config = cfg
        if not blocking:
            child.wait_ready()
        value = c_int()
        self._lib.ncclCommUserRank(out.value, byref(value))
        child._rank = value.value
        self._lib.ncclCommCount(out.value, byref(value))
        child._size = value.value
        return child

    # -- custom reduction ops ------------------------------------------------------------

    def create_premul_sum(
        self, scalar: Any, dtype: Any, residence: ScalarResidence | str = "host"
    ) -> int:
        """``ncclRedOpCreatePreMulSum`` (NCCL >= 2.11): an op computing sum(scalar * x).

        ``residence="host"`` reads ``scalar`` (a Python number) now;
        ``residence="device"`` takes a device pointer (int) read while the collective
        runs. Release the op with :meth:`destroy_op`.
        """
        h = self._live()
        dt = self._datatype(dtype)
        if residence in ("host", ScalarResidence.HOST_IMMEDIATE):
            import numpy as np

            from .dtypes import to_numpy_dtype

            value = np.array([scalar], dtype=to_numpy_dtype(dt))
            ptr, res, keep = value.ctypes.data, ScalarResidence.HOST_IMMEDIATE, value
        elif residence in ("device", ScalarResidence.DEVICE):
            ptr, _, _, _ = as_buffer(scalar, 1, dt, name="scalar")
            res, keep = ScalarResidence.DEVICE, None
        else:
            raise ValueError(f"residence must be 'host' or 'device', got {residence!r}")
        op = c_int()
        self._lib.ncclRedOpCreatePreMulSum(byref(op), ptr, int(dt), int(res), h)
        del keep
        self._custom_ops.add(op.value)
        return op.value

    def destroy_op(self, op: int) -> None:
        """``ncclRedOpDestroy`` for an op made by :meth:`create_premul_sum`."""
        if op not in self._custom_ops:
            raise ValueError(f"op {op!r} was not created on this communicator")
        self._lib.ncclRedOpDestroy(op, self._live())
        self._custom_ops.discard(op)

    # -- registration --------------------------------------------------------------------

    def register(self, buf: _Buf, *, nbytes: int | None = None) -> int:
        """``ncclCommRegister`` (NCCL >= 2.19): register a buffer; returns the handle."""
        h = self._live()
        self._refuse_if_capturing("ncclCommRegister")
        if type(buf) is int:
            if nbytes is None:
                raise TypeError("register(ptr) with a raw pointer needs nbytes=")
            ptr, size = buf, _check_count(nbytes, "nbytes")
            _check_pointer("buf", ptr, size)
        else:
            ptr, n, dt, _ = as_buffer(buf, name="buf")
            size = n * dt.itemsize if nbytes is None else _check_count(nbytes, "nbytes")
        out = c_void_p()
        self._lib.ncclCommRegister(h, ptr, size, byref(out))
        return int(out.value or 0)

    def deregister(self, handle: int) -> None:
        """``ncclCommDeregister`` (NCCL >= 2.19)."""
        self._lib.ncclCommDeregister(self._live(), handle)

    # -- argument resolution (hot path) ---------------------------------------------------

    def _raw_type(self, dtype: Any) -> DataType:
        if dtype is None:
            raise TypeError("sendbuf is a raw pointer, so count= and dtype= are required")
        return self._datatype(dtype)

    def _datatype(self, dtype: Any) -> DataType:
        dt = as_datatype(dtype)
        if self._codes[dt] is None:
            raise NotSupportedError(f"data type {dt.c_name}", dt.first_release, self._lib.version)
        return dt

    def _op(self, op: Any, dt: int) -> c_int | int:
        """The ncclRedOp_t argument for ``op`` on type ``dt``: a shared c_int for the
        built-in ops (see _FAST_OPS), the plain value of avg or of a custom op."""
        try:
            fast = _FAST_OPS.get(op)
            value = _OP_NAMES.get(op) if fast is None else None
        except TypeError:  # unhashable: not an op either
            fast = value = None
        if fast is not None:
            return fast
        if value is None:
            if type(op) is int and op in self._custom_ops:
                return op
            raise ValueError(
                f"op {op!r} is not a reduction op; expected a pynccl.RedOp, one of "
                "'sum', 'prod', 'max', 'min', 'avg', or an op from create_premul_sum()"
            )
        # avg (the only op not in _FAST_OPS)
        if dt <= DataType.UINT64:
            raise TypeError(f"op 'avg' is not defined for integer type {DataType(dt).c_name}")
        if self._lib.version < (2, 10, 3):
            raise NotSupportedError("ncclAvg", (2, 10, 3), self._lib.version)
        return value

    def _raw_pair(self, sendbuf: Any, recvbuf: Any, count: Any, dtype: Any) -> c_int | None:
        """The ncclDataType_t argument for the common raw-pointer call that needs no more
        checks: two int pointers in (0, 2**64), an int count in [0, 2**64) and a DataType
        this library has. None for anything else (arrays, in place, odd values): those
        take the full checks, which word the errors."""
        if (
            type(sendbuf) is int
            and type(recvbuf) is int
            and type(count) is int
            and type(dtype) is DataType
            and 0 < sendbuf < _U64
            and 0 < recvbuf < _U64
            and 0 <= count < _U64
        ):
            return self._codes[dtype]
        return None

    def _rank_arg(self, value: Any, name: str) -> int:
        """``root=`` / ``peer=``, checked (the common in-range int without a second frame)."""
        if type(value) is int and 0 <= value < self._size:
            return value
        return _check_rank(value, self._size, name)

    def _buf(
        self,
        obj: _Buf,
        count: Any,
        dtype: Any,
        name: str,
        writable: bool = False,
        *,
        stream: int = 0,
        like: DataType | None = None,
    ) -> tuple[int, int, DataType]:
        """``(ptr, elements available or -1 if unknown, datatype)`` for a buffer argument."""
        if obj is None:
            raise TypeError(f"{name} is required")
        raw = type(obj) is int
        if dtype is None and raw:
            dtype = like  # a raw pointer takes the type of the call's other buffer
        # Arrays are read whole (count=None) so that a short one is reported with both sizes.
        # The handler as_buffer would pick, called directly: one frame less.
        handler = _BUFFER_HANDLERS.get(type(obj)) or buffer_handler(obj, name)
        ptr, n, dt, dev = handler(obj, count if raw else None, dtype, name, writable, stream)
        if dev is not None:
            check_device(dev, self._device, name)
        if self._codes[dt] is None:
            self._datatype(dt)  # raises NotSupportedError naming the type and releases
        return ptr, -1 if raw else n, dt

    @staticmethod
    def _need(name: str, have: int, need: int) -> None:
        if have >= 0 and have < need:
            raise ValueError(f"{name} holds {have} elements but this call needs {need}")

    @staticmethod
    def _same_type(a: DataType, b: DataType) -> None:
        if a is not b:
            raise TypeError(
                f"sendbuf and recvbuf have different data types: sendbuf is "
                f"{canonical_name(a)} but recvbuf is {canonical_name(b)}"
            )

    def _count(self, count: Any, default: int, name: str) -> int:
        if count is None:
            if default < 0:
                raise TypeError(f"count= is required: {name} does not know its size")
            return default
        return _check_count(count)

    def _s(self, stream: Any) -> int:
        return self._stream if stream is None else as_stream(stream)

    def _call(self, name: str, where: int, args: tuple[Any, ...]) -> None:
        """Record ``name(*args)`` in the flight recorder, call it, check the result."""
        seq = self._seq
        self._seq = seq + 1
        self._ring[seq & RING_MASK] = (name, where, args)
        watch = self._watch
        if watch is None:
            rc = self._c[name](*args)
        else:
            with watch.lock:
                if self._h is None and self._error is not None:
                    raise self._error
                rc = self._c[name](*args)
                if rc in (0, 7):
                    watch.enqueued(seq, args[-1])
        if rc:
            if rc == 7:
                self._pending_after(rc)
                return
            raise self._lib.make_error(rc, name)

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(
        self,
        sendbuf: _Buf,
        recvbuf: _Buf = None,
        op: Any = RedOp.SUM,
        *,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """``ncclAllReduce``: every rank gets op(sendbuf of all ranks) in ``recvbuf``.

        ``recvbuf=None`` reduces in place into ``sendbuf``.
        """
        h = self._h or self._live()
        s = self._stream if stream is None else as_stream(stream)
        recv = sendbuf if recvbuf is None else recvbuf
        if type(sendbuf) is int and type(recv) is int:
            # Raw pointers: no probing; anything unusual goes to the slow checks. A count
            # found in _SIZE_ARGS was range-checked when it entered it.
            if type(count) is not int or (cn := _SIZE_ARGS.get(count)) is None:
                cn = _size_arg(_raw_count(count))
            if type(dtype) is DataType and (code := self._codes[dtype]) is not None:
                dt = dtype
            else:
                dt = self._raw_type(dtype)  # raises for a type this library lacks
                code = self._codes[dt]
            if not (0 < sendbuf < _U64 and 0 < recv < _U64):
                _check_pointer("sendbuf", sendbuf, cn.value)
                _check_pointer("recvbuf", recv, cn.value)
        else:
            # Array route, with as_buffer/_buf/_need/_same_type inlined: their checks,
            # fewer frames.
            if type(sendbuf) is int or sendbuf is None:
                sendbuf, sn, dt = self._buf(sendbuf, count, dtype, "sendbuf", stream=s)
            else:
                handler = _BUFFER_HANDLERS.get(type(sendbuf)) or buffer_handler(sendbuf, "sendbuf")
                sendbuf, sn, dt, dev = handler(sendbuf, None, dtype, "sendbuf", recvbuf is None, s)
                if dev is not None and dev != self._device and self._device is not None:
                    check_device(dev, self._device, "sendbuf")
            n = sn if count is None and sn >= 0 else self._count(count, sn, "sendbuf")
            if n > sn >= 0:
                self._need("sendbuf", sn, n)
            if recvbuf is None:
                recv = sendbuf
            elif type(recvbuf) is int:
                recv, rn, rdt = self._buf(recvbuf, n, dtype, "recvbuf", True, stream=s, like=dt)
                if rdt is not dt:
                    self._same_type(dt, rdt)
            else:
                handler = _BUFFER_HANDLERS.get(type(recvbuf)) or buffer_handler(recvbuf, "recvbuf")
                recv, rn, rdt, dev = handler(recvbuf, None, dtype, "recvbuf", True, s)
                if dev is not None and dev != self._device and self._device is not None:
                    check_device(dev, self._device, "recvbuf")
                if rdt is not dt:
                    self._same_type(dt, rdt)
                if n > rn:
                    self._need("recvbuf", rn, n)
            code = self._codes[dt]
            if code is None:
                self._datatype(dt)  # raises NotSupportedError naming the type and releases
            if (cn := _SIZE_ARGS.get(n)) is None:
                cn = _size_arg(n)
        if op is _SUM:
            args: tuple[Any, ...] = (sendbuf, recv, cn, code, _C_SUM, h, s)
        else:
            args = (sendbuf, recv, cn, code, self._op(op, dt), h, s)
        # The hot path: _call inlined (record, call, check); _c_allreduce is the bare
        # ctypes function, or _watched_allreduce while a watchdog runs. The flight
        # recorder's entry is the argument tuple itself (see _entry).
        seq = self._seq
        self._seq = seq + 1
        self._ring[seq & RING_MASK] = args
        rc = self._c_allreduce(*args)
        if rc:
            if rc == 7:
                self._pending_after(rc)
                return
            raise self._lib.make_error(rc, "ncclAllReduce")

    def broadcast(
        self,
        sendbuf: _Buf,
        recvbuf: _Buf = None,
        *,
        root: int = 0,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """``ncclBroadcast``: copy ``root``'s ``sendbuf`` into every rank's ``recvbuf``.

        ``recvbuf=None`` broadcasts in place in ``sendbuf``.
        """
        h = self._live()
        s = self._s(stream)
        root = self._rank_arg(root, "root")
        code = self._raw_pair(sendbuf, recvbuf, count, dtype)
        if code is not None:
            self._call("ncclBroadcast", root, (sendbuf, recvbuf, count, code, root, h, s))
            return
        sp, sn, dt = self._buf(sendbuf, count, dtype, "sendbuf", writable=recvbuf is None, stream=s)
        n = self._count(count, sn, "sendbuf")
        if recvbuf is None or self._rank == root:
            self._need("sendbuf", sn, n)
        if recvbuf is None:
            rp = sp
        else:
            rp, rn, rdt = self._buf(recvbuf, n, dtype, "recvbuf", True, stream=s, like=dt)
            self._same_type(dt, rdt)
            self._need("recvbuf", rn, n)
        self._call("ncclBroadcast", root, (sp, rp, n, dt, root, h, s))

    def reduce(
        self,
        sendbuf: _Buf,
        recvbuf: _Buf = None,
        op: Any = RedOp.SUM,
        *,
        root: int = 0,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """``ncclReduce``: op(sendbuf of all ranks) into ``root``'s ``recvbuf``.

        ``recvbuf=None`` reduces in place (on the root the result lands in ``sendbuf``).
        """
        h = self._live()
        s = self._s(stream)
        root = self._rank_arg(root, "root")
        code = self._raw_pair(sendbuf, recvbuf, count, dtype)
        if code is not None:
            args = (sendbuf, recvbuf, count, code, self._op(op, dtype), root, h, s)
            self._call("ncclReduce", root, args)
            return
        sp, sn, dt = self._buf(sendbuf, count, dtype, "sendbuf", writable=recvbuf is None, stream=s)
        n = self._count(count, sn, "sendbuf")
        self._need("sendbuf", sn, n)
        if recvbuf is None:
            rp = sp
        else:
            rp, rn, rdt = self._buf(recvbuf, n, dtype, "recvbuf", True, stream=s, like=dt)
            self._same_type(dt, rdt)
            if self._rank == root:
                self._need("recvbuf", rn, n)
        self._call("ncclReduce", root, (sp, rp, n, dt, self._op(op, dt), root, h, s))

    def all_gather(
        self,
        sendbuf: _Buf,
        recvbuf: _Buf,
        *,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """``ncclAllGather``: ``recvbuf`` = every rank's ``sendbuf`` (``count`` each), by rank."""
        h = self._live()
        s = self._s(stream)
        code = self._raw_pair(sendbuf, recvbuf, count, dtype)
        if code is not None:
            self._call("ncclAllGather", -1, (sendbuf, recvbuf, count, code, h, s))
            return
        sp, sn, dt = self._buf(sendbuf, count, dtype, "sendbuf", stream=s)
        n = self._count(count, sn, "sendbuf")
        self._need("sendbuf", sn, n)
        rp, rn, rdt = self._buf(recvbuf, n * self._size, dtype, "recvbuf", True, stream=s, like=dt)
        self._same_type(dt, rdt)
        self._need("recvbuf", rn, n * self._size)
        self._call("ncclAllGather", -1, (sp, rp, n, dt, h, s))

    def reduce_scatter(
        self,
        sendbuf: _Buf,
        recvbuf: _Buf,
        op: Any = RedOp.SUM,
        *,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """``ncclReduceScatter``: rank r gets block r (``count`` elements) of op(sendbuf)."""
        h = self._live()
        s = self._s(stream)
        code = self._raw_pair(sendbuf, recvbuf, count, dtype)
        if code is not None:
            args = (sendbuf, recvbuf, count, code, self._op(op, dtype), h, s)
            self._call("ncclReduceScatter", -1, args)
            return
        rp, rn, dt = self._buf(recvbuf, count, dtype, "recvbuf", True, stream=s)
        n = self._count(count, rn, "recvbuf")
        self._need("recvbuf", rn, n)
        sp, sn, sdt = self._buf(sendbuf, n * self._size, dtype, "sendbuf", stream=s, like=dt)
        self._same_type(sdt, dt)
        self._need("sendbuf", sn, n * self._size)
        self._call("ncclReduceScatter", -1, (sp, rp, n, dt, self._op(op, dt), h, s))

    def gather(
        self,
        sendbuf: _Buf,
        recvbuf: _Buf = None,
        *,
        root: int = 0,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """Gather ``count`` elements from each rank into ``root``'s ``recvbuf``, in rank order.

        ``ncclGather`` where the library has it (NCCL >= 2.28), otherwise grouped
        ``ncclSend``/``ncclRecv`` with the same result. ``recvbuf`` matters on the root only.
        """
        h = self._live()
        s = self._s(stream)
        root = self._rank_arg(root, "root")
        sp, sn, dt = self._buf(sendbuf, count, dtype, "sendbuf", stream=s)
        n = self._count(count, sn, "sendbuf")
        self._need("sendbuf", sn, n)
        rp = 0
        if self._rank == root:
            if recvbuf is None:
                raise TypeError("recvbuf is required on the root of a gather")
            rp, rn, rdt = self._buf(
                recvbuf, n * self._size, dtype, "recvbuf", True, stream=s, like=dt
            )
            self._same_type(dt, rdt)
            self._need("recvbuf", rn, n * self._size)
        if self._native:
            self._call("ncclGather", root, (sp, rp, n, dt, root, h, s))
            return
        nbytes = n * dt.itemsize
        with _group.group():
            self._call("ncclSend", root, (sp, n, dt, root, h, s))
            if self._rank == root:
                for r in range(self._size):
                    self._call("ncclRecv", r, (rp + r * nbytes, n, dt, r, h, s))

    def scatter(
        self,
        sendbuf: _Buf,
        recvbuf: _Buf,
        *,
        root: int = 0,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """Scatter block r (``count`` elements) of ``root``'s ``sendbuf`` to rank r's ``recvbuf``.

        ``ncclScatter`` where available (NCCL >= 2.28), otherwise grouped
        send/recv. ``sendbuf`` matters on the root only (may be ``None`` elsewhere).
        """
        h = self._live()
        s = self._s(stream)
        root = self._rank_arg(root, "root")
        rp, rn, dt = self._buf(recvbuf, count, dtype, "recvbuf", True, stream=s)
        n = self._count(count, rn, "recvbuf")
        self._need("recvbuf", rn, n)
        sp = 0
        if self._rank == root:
            if sendbuf is None:
                raise TypeError("sendbuf is required on the root of a scatter")
            sp, sn, sdt = self._buf(sendbuf, n * self._size, dtype, "sendbuf", stream=s, like=dt)
            self._same_type(sdt, dt)
            self._need("sendbuf", sn, n * self._size)
        if self._native:
            self._call("ncclScatter", root, (sp, rp, n, dt, root, h, s))
            return
        nbytes = n * dt.itemsize
        with _group.group():
            if self._rank == root:
                for r in range(self._size):
                    self._call("ncclSend", r, (sp + r * nbytes, n, dt, r, h, s))
            self._call("ncclRecv", root, (rp, n, dt, root, h, s))

    def all_to_all(
        self,
        sendbuf: _Buf,
        recvbuf: _Buf,
        *,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """Send block r (``count`` elements) of ``sendbuf`` to rank r; receive rank r's block
        for this rank into block r of ``recvbuf``.

        ``ncclAlltoAll`` where available (NCCL >= 2.28), otherwise grouped send/recv.
        ``count`` defaults to ``len(sendbuf) // size``.
        """
        h = self._live()
        s = self._s(stream)
        code = self._raw_pair(sendbuf, recvbuf, count, dtype) if self._native else None
        if code is not None:
            self._call("ncclAlltoAll", -1, (sendbuf, recvbuf, count, code, h, s))
            return
        sp, sn, dt = self._buf(sendbuf, count, dtype, "sendbuf", stream=s)
        if count is None:
            if sn < 0:
                raise TypeError("count= is required: sendbuf does not know its size")
            if sn % self._size:
                raise ValueError(
                    f"sendbuf holds {sn} elements, not a multiple of the {self._size} ranks"
                )
            n = sn // self._size
        else:
            n = _check_count(count)
        self._need("sendbuf", sn, n * self._size)
        rp, rn, rdt = self._buf(recvbuf, n * self._size, dtype, "recvbuf", True, stream=s, like=dt)
        self._same_type(dt, rdt)
        self._need("recvbuf", rn, n * self._size)
        if self._native:
            self._call("ncclAlltoAll", -1, (sp, rp, n, dt, h, s))
            return
        nbytes = n * dt.itemsize
        with _group.group():
            for r in range(self._size):
                self._call("ncclSend", r, (sp + r * nbytes, n, dt, r, h, s))
                self._call("ncclRecv", r, (rp + r * nbytes, n, dt, r, h, s))

    def send(
        self,
        sendbuf: _Buf,
        peer: int,
        *,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """``ncclSend`` (NCCL >= 2.7): send ``count`` elements to ``peer`` (pair with its recv)."""
        self._p2p("ncclSend", "sendbuf", sendbuf, peer, count, dtype, stream)

    def recv(
        self,
        recvbuf: _Buf,
        peer: int,
        *,
        count: int | None = None,
        dtype: Any = None,
        stream: Any = None,
    ) -> None:
        """``ncclRecv`` (NCCL >= 2.7): receive ``count`` elements from ``peer``."""
        self._p2p("ncclRecv", "recvbuf", recvbuf, peer, count, dtype, stream)

    def _p2p(
        self, name: str, arg: str, buf: _Buf, peer: int, count: Any, dtype: Any, stream: Any
    ) -> None:
        h = self._live()
        s = self._s(stream)
        peer = self._rank_arg(peer, "peer")
        code = self._raw_pair(buf, buf, count, dtype)
        if code is not None:
            self._call(name, peer, (buf, count, code, peer, h, s))
            return
        ptr, have, dt = self._buf(buf, count, dtype, arg, arg == "recvbuf", stream=s)
        n = self._count(count, have, arg)
        self._need(arg, have, n)
        self._call(name, peer, (ptr, n, dt, peer, h, s))


def _set_device(device: int) -> None:
    if type(device) is not int or device < 0:
        raise ValueError(f"device must be a non-negative int, got {device!r}")
    cudart().cudaSetDevice(device)


_HOT = (
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclAlltoAll",
    "ncclGather",
    "ncclScatter",
    "ncclSend",
    "ncclRecv",
)
