"""``from_env``: a communicator from whatever launcher started this process."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._limits import check_device_ordinal
from ..bootstrap._common import check_share_args
from ..bootstrap._roots import id_makers
from ..bootstrap._seal import KEY_ENV
from ..bootstrap._torchrun import attempt_prefix, torchrun_store
from ..bootstrap.backends import FileRendezvous, MpiRendezvous, Rendezvous, StoreRendezvous
from ..bootstrap.env import LaunchEnv, detect_launch_env, explicit_launch_env, select_device
from ..bootstrap.errors import LaunchEnvError, RendezvousProtocolError
from ..bootstrap.tcp import TcpRendezvous

if TYPE_CHECKING:
    from pynccl.comm import Communicator, Config
    from pynccl.comm._uid import UniqueId
    from pynccl.typing import DeviceLike

__all__ = ["auto_nids", "from_env", "make_rendezvous"]

_ID_BYTES = 128  # sizeof(ncclUniqueId)
_MAX_IDS = 8192
_DEFAULT_TIMEOUT = 300.0
# NCCL's guidance for ncclCommInitRankScalable is one unique id (one bootstrap root) per
# 128 to 1,024 ranks: one per 512 keeps every root's share inside that range from 513 ranks
# on, and a world of up to 512 ranks keeps the single-id ncclCommInitRank.
_RANKS_PER_ID = 512
_SCALABLE_SINCE = (2, 23, 4)


def auto_nids(world_size: int) -> int:
    """How many unique ids :func:`from_env` creates for ``world_size`` ranks when the
    library has ``ncclCommInitRankScalable``: one per 512 ranks, at least one."""
    return min(_MAX_IDS, max(1, -(-world_size // _RANKS_PER_ID)))


def _has_scalable_init() -> bool:
    """Whether the loaded libnccl offers ncclCommInitRankScalable (NCCL >= 2.23.4)."""
    from pynccl.library import lib  # layer 1: loads the library once

    L = lib()
    return (
        L.version is not None and L.version >= _SCALABLE_SINCE and L.has("ncclCommInitRankScalable")
    )


def _file_key(env: LaunchEnv, environ: Mapping[str, str]) -> str | None:
    """The job key mixed with the launcher's job id, so that a key reused across runs of a
    Slurm/MPI job still tells this run's file from a leftover one."""
    key = environ.get(KEY_ENV) or None
    if env.job_id is None:
        return key
    return f"{key or ''}\x00job:{env.launcher}:{env.job_id}"


def make_rendezvous(
    env: LaunchEnv,
    *,
    store: Any = None,
    mpi_comm: Any = None,
    file: str | os.PathLike[str] | None = None,
    rendezvous: Rendezvous | None = None,
    environ: Mapping[str, str] | None = None,
    timeout: float = _DEFAULT_TIMEOUT,
) -> Rendezvous:
    """The backend :func:`from_env` would use: the one given; else, under torchrun,
    torchrun's own store at ``MASTER_ADDR:MASTER_PORT``; else TCP at
    ``MASTER_ADDR:MASTER_PORT`` keyed by ``PYNCCL_RENDEZVOUS_KEY``.

    A ``store=`` gets the prefix ``pynccl`` plus torchrun's run id and restart count
    when there are any, so that a restarted job never reads an earlier attempt's id.
    ``timeout`` bounds connecting to torchrun's store.
    """
    given = [
        name
        for name, value in (
            ("store", store),
            ("mpi_comm", mpi_comm),
            ("file", file),
            ("rendezvous", rendezvous),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"pass at most one of store=, mpi_comm=, file=, rendezvous= (got {given})")
    if environ is None:
        environ = os.environ
    if rendezvous is not None:
        if not callable(getattr(rendezvous, "share", None)):
            raise TypeError(
                f"rendezvous must have a share() method, got {type(rendezvous).__name__}"
            )
        return rendezvous
    if store is not None:
        return StoreRendezvous(store, prefix=attempt_prefix(env, environ))
    if mpi_comm is not None:
        return MpiRendezvous(mpi_comm)
    if file is not None:
        return FileRendezvous(file, key=_file_key(env, environ))
    if env.world_size == 1:
        return _Alone()  # nobody to share with: no address needed
    agent = torchrun_store(env, environ, timeout)
    if agent is not None:
        return agent
    return TcpRendezvous.from_env(env, environ)


class _Alone:
    """The rendezvous of a world of one: rank 0 keeps its own ids."""

    def share(self, payload: bytes | None, *, rank: int, world_size: int, timeout: float) -> bytes:
        data = check_share_args(payload, rank, world_size, timeout)
        assert data is not None  # rank 0 of 1
        return data


def _launch_env(
    environ: Mapping[str, str], rank: Any, world_size: Any, local_rank: Any, mpi_comm: Any
) -> LaunchEnv:
    """Where this process sits: as the caller says, else as its launcher says, else (with
    an MPI communicator and no launcher that tells the size) as MPI says."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            missing = "rank" if rank is None else "world_size"
            raise ValueError(f"pass rank= and world_size= together ({missing}= is missing)")
        return explicit_launch_env(rank, world_size, local_rank, environ)
    if local_rank is not None:
        raise ValueError("local_rank= goes with rank= and world_size=")
    try:
        return detect_launch_env(environ)
    except LaunchEnvError as e:
        if mpi_comm is None or e.launcher not in (None, "pmix"):
            raise
        get_rank = getattr(mpi_comm, "Get_rank", None)
        get_size = getattr(mpi_comm, "Get_size", None)
        if not (callable(get_rank) and callable(get_size)):
            raise
        return explicit_launch_env(get_rank(), get_size(), None, environ)


def _device_count() -> int:
    from pynccl.cuda import device_count  # the CUDA layer sits below this one

    return device_count()


def from_env(
    *,
    timeout: float = _DEFAULT_TIMEOUT,
    store: Any = None,
    mpi_comm: Any = None,
    file: str | os.PathLike[str] | None = None,
    config: Config | None = None,
    nids: int | None = None,
    device: DeviceLike | None = None,
    rendezvous: Rendezvous | None = None,
    environ: Mapping[str, str] | None = None,
    watchdog_timeout: float | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
) -> Communicator:
    """Create this process's :class:`~pynccl.Communicator` from its launcher's environment.

    Detects the launcher (:func:`detect_launch_env`: torchrun, ``python -m pynccl
    launch``, torch's ``env://`` variables, Open MPI, MVAPICH2, Cray PALS, MPICH/Intel
    MPI, Slurm steps, LeaderWorkerSet, indexed Jobs/JobSet), picks the device from the
    local rank (:func:`select_device`, unless ``device`` is given), creates ``nids``
    unique ids (id ``i`` by the first rank of NCCL's group ``i``, where its bootstrap
    root belongs; all by rank 0 with a ``rendezvous=`` that has no ``share_parts``) and
    shares them with ``store=`` (a key-value store such as ``torch.distributed.Store``),
    ``mpi_comm=`` (mpi4py), ``file=`` (a path on a shared file system), ``rendezvous=``
    (any :class:`Rendezvous`); by default under torchrun through torchrun's own store,
    and otherwise over TCP at
    ``MASTER_ADDR:MASTER_PORT`` with ``PYNCCL_RENDEZVOUS_KEY``. Then calls
    ``Communicator(world_size, ids, rank, device=device, config=config)``; several ids
    use ``ncclCommInitRankScalable`` (requires NCCL >= 2.23.4), which spreads NCCL's
    bootstrap over one root per id. ``nids=None`` (the default) means one id per 512
    ranks (:func:`auto_nids`; NCCL advises one per 128 to 1,024) where the library has
    ``ncclCommInitRankScalable``, else one, decided by each rank alike. An explicit
    ``nids`` must be the same on every rank.

    ``rank=`` and ``world_size=`` (with ``local_rank=`` optionally) say where this
    process sits instead of a launcher: for processes that a framework started (Ray
    actors, a process pool), usually with ``store=`` or ``rendezvous=``. With
    ``mpi_comm=`` and no launcher that gives the world size (PMIx alone), rank and size
    are the communicator's.

    Every rank must call it with the same backend. ``timeout`` bounds the
    id exchange, not NCCL's own initialisation. ``environ`` replaces
    :data:`os.environ` (for tests and embedding). ``watchdog_timeout`` starts the
    communicator's watchdog (see :meth:`Communicator.start_watchdog`).
    """
    if nids is not None and (
        isinstance(nids, bool) or not isinstance(nids, int) or not 1 <= nids <= _MAX_IDS
    ):
        raise ValueError(f"nids={nids!r} is not None or an integer in 1..{_MAX_IDS}")
    if environ is None:
        environ = os.environ
    env = _launch_env(environ, rank, world_size, local_rank, mpi_comm)
    if device is None:
        count = None
        if env.local_rank is None and environ.get("CUDA_VISIBLE_DEVICES") is None:
            count = _device_count()  # one GPU and no local rank (a Kubernetes pod): use it
        device = select_device(env, environ, device_count=count)
    else:
        device = check_device_ordinal(device)
    backend = make_rendezvous(
        env,
        store=store,
        mpi_comm=mpi_comm,
        file=file,
        rendezvous=rendezvous,
        environ=environ,
        timeout=timeout,
    )

    from pynccl.comm import Communicator  # the object layer sits above this one

    ids = _share_ids(env, backend, nids, timeout)
    return Communicator(
        env.world_size,
        ids[0] if len(ids) == 1 else ids,
        env.rank,
        device=device,
        config=config,
        watchdog_timeout=watchdog_timeout,
    )


def _share_ids(
    env: LaunchEnv, backend: Rendezvous, nids: int | None, timeout: float
) -> list[UniqueId]:
    """Make ``nids`` unique ids (None: :func:`auto_nids`, or one where the library lacks
    ncclCommInitRankScalable) and share them; every rank returns them.

    With several ids and a backend that has ``share_parts`` (all of pynccl's), id ``i`` is
    made by the first rank of NCCL's group ``i`` (``firstRankFromRoot``), so that each
    bootstrap root runs in a process of its own group, as NCCL intends; otherwise rank 0
    makes them all."""
    from pynccl.comm import UniqueId  # the package's name (tests stand in for it)

    count = nids
    if count is None:
        count = auto_nids(env.world_size) if env.world_size > _RANKS_PER_ID else 1
        if count > 1 and not _has_scalable_init():
            count = 1  # an older NCCL: one id, one root
    share_parts = getattr(backend, "share_parts", None)
    if callable(share_parts) and 1 < count <= env.world_size:
        makers = id_makers(env.world_size, count)
        part = bytes(UniqueId()) if env.rank in makers else None
        data = share_parts(
            part, rank=env.rank, world_size=env.world_size, makers=makers, timeout=timeout
        )
        nids = count  # every rank made the same count: what came must be that many
    else:
        payload = None
        if env.rank == 0:
            payload = b"".join(bytes(UniqueId()) for _ in range(count))
        data = backend.share(payload, rank=env.rank, world_size=env.world_size, timeout=timeout)
    got = len(data) // _ID_BYTES
    if len(data) % _ID_BYTES or not 1 <= got <= _MAX_IDS or (nids is not None and got != nids):
        expects = f"nids={nids}" if nids is not None else f"1..{_MAX_IDS} whole ids"
        raise RendezvousProtocolError(
            f"rank {env.rank}: rank 0 shared {len(data)} bytes ({len(data) / _ID_BYTES:g} ids) "
            f"but this rank expects {expects}: call from_env with the same nids on every rank"
        )
    return [UniqueId.from_bytes(data[i : i + _ID_BYTES]) for i in range(0, len(data), _ID_BYTES)]
