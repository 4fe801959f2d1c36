"""Which launcher started this process, and where this process sits in the job.

Conventions understood, in order of precedence (the innermost launcher usually sets
the most specific variables, so it wins); the name in front is
:attr:`LaunchEnv.launcher`:

``torchrun``
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT`` with torchelastic's ``TORCHELASTIC_*`` variables. torchrun's own
    store already listens on ``MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``):
    :func:`~pynccl.bootstrap.from_env` shares the id through that store.
``pynccl``
    The same variables from ``python -m pynccl launch`` (which also sets
    ``PYNCCL_LAUNCHER=pynccl``).
``env``
    ``RANK``, ``WORLD_SIZE`` (and maybe ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``)
    without torchelastic: torch's ``env://`` convention as a Kubeflow PyTorchJob pod,
    accelerate, deepspeed or a hand-made script sets it.
``openmpi``
    ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``.
``mvapich2``
    ``MV2_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``.
``pals`` (HPE Cray PALS ``mpiexec``)
    ``PALS_RANKID``, ``PALS_LOCAL_RANKID`` (or ``PMI_LOCAL_RANK``), the sizes from Cray
    PMI's ``PMI_SIZE`` and ``PALS_LOCAL_SIZE``/``PMI_LOCAL_SIZE``, job ``PALS_APID``.
``mpich`` (MPICH, Intel MPI and other Hydra/PMI launchers)
    ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``/``PMI_LOCAL_RANK``,
    ``MPI_LOCALNRANKS``/``PMI_LOCAL_SIZE``.
``slurm`` (a task of a job step: ``srun``)
    ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the local world size from
    ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` and ``SLURM_NODEID``; the
    master address is the first host of the step's (or job's) node list. Only inside a
    step (``SLURM_STEP_ID`` set): a batch script also has ``SLURM_PROCID=0`` and
    ``SLURM_NTASKS`` but is one process, and mpirun or torchrun inside it are the
    launchers.
``lws`` (a LeaderWorkerSet pod, one rank per pod)
    ``LWS_WORKER_INDEX``, ``LWS_GROUP_SIZE``, ``LWS_LEADER_ADDRESS``.
``jobset`` (a Kubernetes indexed Job or a JobSet pod, one rank per pod)
    ``JOB_COMPLETION_INDEX`` and ``WORLD_SIZE`` (which the pod template sets: a Job does
    not export its completion count); the leader's host name from ``JOBSET_NAME`` and
    ``REPLICATED_JOB_NAME`` (``<jobset>-<job>-0-0.<jobset>``) unless ``MASTER_ADDR``.
``pmix``
    ``PMIX_RANK`` alone: PMIx keeps the size in its library, so
    :class:`LaunchEnvError` says how to get it (``from_env(mpi_comm=...)``).

Where ``MASTER_ADDR`` is not set, an MPI job whose ranks all run on this host uses
``127.0.0.1``; where ``MASTER_PORT`` is not set, MPI, Slurm, PALS, LeaderWorkerSet and
JobSet jobs derive one from the job's id (:func:`slurm_default_port`). Otherwise the
message says which variable is missing.

When several conventions are present (torchrun started by srun, say) the one with
precedence is used; if two of them describe a world of the same size but give this
process different ranks, that is a contradiction and :class:`LaunchEnvError` is
raised. ``PYNCCL_LAUNCHER=<name>`` forces one convention and skips that cross-check.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ._conventions import (
    CONVENTIONS,
    LaunchEnv,
    detected,
    slurm_default_port,
    slurm_step,
    who,
)
from ._nodelist import expand_nodelist, first_host
from .errors import LaunchEnvError

__all__ = [
    "LAUNCHERS",
    "LaunchEnv",
    "detect_launch_env",
    "expand_nodelist",
    "first_host",
    "select_device",
    "slurm_default_port",
    "visible_devices",
]

#: The conventions :func:`detect_launch_env` recognises (and ``PYNCCL_LAUNCHER``
#: accepts), in order of precedence.
LAUNCHERS = tuple(CONVENTIONS)


def _set(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    if value is None:
        return None
    return value.strip() or None


def _nothing_detected(environ: Mapping[str, str]) -> LaunchEnvError:
    message = (
        "no launcher detected: none of RANK (torchrun, pynccl launch, env://), "
        "OMPI_COMM_WORLD_RANK (Open MPI), MV2_COMM_WORLD_RANK (MVAPICH2), PALS_RANKID "
        "(Cray PALS), PMI_RANK (MPICH, Intel MPI), SLURM_PROCID with SLURM_STEP_ID (srun), "
        "LWS_WORKER_INDEX (LeaderWorkerSet), JOB_COMPLETION_INDEX (indexed Job, JobSet) or "
        "PMIX_RANK (PMIx) is set"
    )
    job = _set(environ, "SLURM_JOB_ID") or _set(environ, "SLURM_JOBID")
    if job is not None and slurm_step(environ) is None:
        message += (
            f". SLURM_JOB_ID={job} without SLURM_STEP_ID: this is a Slurm batch script (or "
            "salloc shell), one process rather than a task of a job step; start the ranks "
            "with `srun python ...` (or mpirun, torchrun, python -m pynccl launch)"
        )
    elif _set(environ, "WORLD_SIZE") is not None:
        message += ". WORLD_SIZE is set but RANK is not"
    return LaunchEnvError(message)


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size, local rank and the master address from the launcher's variables.

    ``environ`` defaults to :data:`os.environ`. Raises :class:`LaunchEnvError`
    (a :class:`ValueError`) naming the detected launcher and the offending
    variable when variables are missing, not integers, out of range, or when two
    launchers contradict each other; and when no launcher is detected at all (with
    a hint about ``srun`` inside a Slurm batch script).
    """
    if environ is None:
        environ = os.environ
    forced = _set(environ, "PYNCCL_LAUNCHER")
    if forced is not None:
        if forced not in CONVENTIONS:
            raise LaunchEnvError(f"PYNCCL_LAUNCHER={forced!r} is not one of {', '.join(LAUNCHERS)}")
        return CONVENTIONS[forced][1](environ, forced)

    found: list[LaunchEnv] = []
    for name, (present, parse) in CONVENTIONS.items():
        if not present(environ):
            continue
        if not found:
            found.append(parse(environ, name))  # errors of the chosen launcher are fatal
            continue
        try:
            found.append(parse(environ, name))
        except LaunchEnvError:
            continue  # an outer launcher's partial variables do not matter
    if not found:
        raise _nothing_detected(environ)
    chosen = found[0]
    for other in found[1:]:
        # same-sized worlds describe the same processes: ranks must then agree
        if other.world_size == chosen.world_size and other.rank != chosen.rank:
            raise LaunchEnvError(
                f"launchers disagree: {chosen.launcher} says rank {chosen.rank} of "
                f"{chosen.world_size} but {other.launcher} says rank {other.rank} of "
                f"{other.world_size}; set PYNCCL_LAUNCHER to the one to trust",
                chosen.launcher,
            )
    return chosen


def explicit_launch_env(
    rank: object,
    world_size: object,
    local_rank: object = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchEnv:
    """The :class:`LaunchEnv` of ``from_env(rank=..., world_size=...)``: no launcher is
    read; ``MASTER_ADDR``/``MASTER_PORT`` still give the TCP rendezvous its address."""
    from .._limits import C_INT_MAX, check_c_int, check_index

    size = check_c_int(world_size, "world_size", 1, C_INT_MAX)
    rank_ = check_index(rank, "rank", size, f"for world_size={size}")
    local = None if local_rank is None else check_index(local_rank, "local_rank", size)
    environ = os.environ if environ is None else environ
    addr, port = _set(environ, "MASTER_ADDR"), None
    raw = _set(environ, "MASTER_PORT")
    if raw is not None:
        if not raw.isdigit() or not 1 <= int(raw) <= 65535:
            raise LaunchEnvError(f"MASTER_PORT={raw!r} is not a port (1..65535)", "explicit")
        port = int(raw)
    return LaunchEnv("explicit", rank_, size, local, None, addr, port)


# -- devices ----------------------------------------------------------------------------------


def visible_devices(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA will honour, or ``None`` if unset.

    CUDA stops at the first invalid entry (a negative index, an empty entry, a
    repeat), so ``"0,1,-1,2"`` exposes two devices; an empty value exposes none.
    """
    if environ is None:
        environ = os.environ
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    entries: list[str] = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            if int(entry) < 0:
                break
            entry = str(int(entry))
        elif not entry.startswith(("GPU-", "MIG-")):
            break
        if entry in entries:
            break
        entries.append(entry)
    return entries


def select_device(
    env: LaunchEnv, environ: Mapping[str, str] | None = None, *, device_count: int | None = None
) -> int:
    """The CUDA device ordinal this process should use: its local rank.

    The ordinal indexes the devices left visible by ``CUDA_VISIBLE_DEVICES``.
    When exactly one device is visible, the launcher has bound one device per
    process (``srun --gpus-per-task=1``, a per-rank ``CUDA_VISIBLE_DEVICES``, a
    Kubernetes pod with one GPU) and the answer is 0 whatever the local rank, or
    without one. ``device_count`` is how many devices CUDA sees (``from_env`` asks
    CUDA when it needs to know): one device and no ``CUDA_VISIBLE_DEVICES`` count as
    one visible device too. Raises :class:`LaunchEnvError` when the local rank is
    unknown and more than one device is visible, or when it is not below the number
    of visible devices.
    """
    visible = visible_devices(environ)
    raw = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        if not visible:
            rank = "" if env.local_rank is None else f" for local rank {env.local_rank}"
            raise LaunchEnvError(
                f"CUDA_VISIBLE_DEVICES={raw!r} leaves no usable device{rank}", env.launcher
            )
        if len(visible) == 1:
            return 0
    if env.local_rank is None:
        if visible is None and device_count == 1:
            return 0
        seen = (
            f"CUDA_VISIBLE_DEVICES={raw!r} shows {len(visible)} devices"
            if visible is not None
            else f"CUDA sees {device_count} devices"
            if device_count is not None
            else "the number of devices is unknown"
        )
        raise LaunchEnvError(
            f"{who(env.launcher)} gives no local rank and {seen}, so the device cannot be "
            "chosen; set LOCAL_RANK, or pass device=",
            env.launcher,
        )
    if visible is not None and env.local_rank >= len(visible):
        raise LaunchEnvError(
            f"{detected(env.launcher)}: local rank {env.local_rank} needs device "
            f"{env.local_rank} but CUDA_VISIBLE_DEVICES exposes only {len(visible)} "
            f"({','.join(visible)})",
            env.launcher,
        )
    return env.local_rank
