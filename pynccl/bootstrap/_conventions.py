"""Each launcher's convention: the variables it sets, read into a :class:`LaunchEnv`.

:mod:`.env` lists the conventions and decides between them; this module reads one.
Every parser takes the environment and the launcher's name and either returns a
:class:`LaunchEnv` or raises :class:`LaunchEnvError` naming the variable at fault.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ._nodelist import first_host
from .errors import LaunchEnvError

__all__ = ["CONVENTIONS", "LaunchEnv", "detected", "missing_address", "slurm_default_port", "who"]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as told by its launcher.

    ``launcher`` is one of :data:`LAUNCHERS`, or ``"explicit"`` when
    ``from_env(rank=..., world_size=...)`` said it. ``local_rank``/``local_world_size``
    are ``None`` when the launcher does not say; ``master_addr``/``master_port`` are
    ``None`` when no address is known. ``job_id`` identifies the job when the launcher
    gives it an id (Slurm job and step, torchrun run id, MPI job or PMIx namespace, Cray
    PALS application id, LeaderWorkerSet group, JobSet name), else ``None``.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None


# Jobs without MASTER_PORT get a port in [base, base + span): below the Linux ephemeral
# range (32768+), so that it rarely collides with ports the OS hands out.
_PORT_BASE = 15000
_PORT_SPAN = 15000


def slurm_default_port(job_id: str, step_id: str | None = None) -> int:
    """The rendezvous port used when ``MASTER_PORT`` is not set, from the job's id.

    Every rank of a job computes the same port, and concurrent jobs on one node rarely
    collide; always in 15000..29999, below Linux's ephemeral port range. Slurm's job and
    step ids (distinct steps of one job get distinct ports), and likewise the MPI
    launchers' job ids, Cray PALS's application id, a LeaderWorkerSet group's leader
    address and a JobSet's name.
    """
    text = job_id.strip()
    base = int(text) if text.isdigit() else zlib.crc32(text.encode())
    if step_id is not None and step_id.strip().isdigit():
        base = base * 31 + int(step_id.strip())
    return _PORT_BASE + base % _PORT_SPAN


# What each convention is called in messages ("<who> detected but ...").
_WHO = {
    "torchrun": "torchrun launch",
    "pynccl": "pynccl launch",
    "env": "env launch (torch's env:// variables RANK/WORLD_SIZE)",
    "openmpi": "openmpi launch",
    "mvapich2": "mvapich2 launch",
    "pals": "pals launch (Cray PALS)",
    "mpich": "mpich launch",
    "slurm": "slurm launch",
    "lws": "lws launch (a LeaderWorkerSet pod)",
    "jobset": "jobset launch (a Kubernetes indexed Job / JobSet pod)",
    "pmix": "pmix launch",
    "explicit": "from_env(rank=..., world_size=...)",
}

# The variables that name the job, per convention, in order: the first one set is the
# job id, from which a missing MASTER_PORT is derived.
_JOB_VARS: dict[str, tuple[str, ...]] = {
    "openmpi": ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_hnp_uri"),
    "mvapich2": ("PMIX_NAMESPACE", "PMI_JOBID", "PMI_PORT"),
    "pals": ("PALS_APID", "PMI_JOBID"),
    "mpich": ("PMIX_NAMESPACE", "PMI_JOBID", "PMI_PORT"),
    "pmix": ("PMIX_NAMESPACE",),
    "lws": ("LWS_LEADER_ADDRESS",),
    "jobset": ("JOBSET_NAME",),
    "slurm": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "torchrun": ("TORCHELASTIC_RUN_ID",),
}


def who(launcher: str) -> str:
    """The convention as messages name it: ``"openmpi launch"``."""
    return _WHO.get(launcher, f"{launcher} launch")


def detected(launcher: str) -> str:
    return f"{who(launcher)} {'given' if launcher == 'explicit' else 'detected'}"


def missing_address(env: LaunchEnv) -> str:
    """What keeps ``env`` from having a rendezvous address, precisely (for messages)."""
    parts = []
    if env.master_addr is None:
        why = "rank 0's host name or address"
        if env.local_world_size is not None and env.local_world_size < env.world_size:
            why += f"; this host runs {env.local_world_size} of the {env.world_size} ranks"
        parts.append(f"MASTER_ADDR is not set ({why})")
    if env.master_port is None:
        names = _JOB_VARS.get(env.launcher, ())
        source = f" and none of {', '.join(names)} is set to derive one from" if names else ""
        parts.append(f"MASTER_PORT is not set{source}")
    return "; ".join(parts)


# -- reading variables --------------------------------------------------------------------------


def _get(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value if value else None


def _opt_int(
    environ: Mapping[str, str], names: tuple[str, ...], launcher: str, minimum: int = 0
) -> tuple[int | None, str]:
    """First of ``names`` that is set, parsed as an int: (value or None, variable name)."""
    for name in names:
        raw = _get(environ, name)
        if raw is None:
            continue
        try:
            value = int(raw, 10)
        except ValueError:
            raise LaunchEnvError(
                f"{detected(launcher)} but {name}={environ[name]!r} is not an integer", launcher
            ) from None
        if value < minimum:
            raise LaunchEnvError(
                f"{detected(launcher)} but {name}={value} (expected >= {minimum})", launcher
            )
        return value, name
    return None, names[0]


def _req_int(
    environ: Mapping[str, str],
    names: tuple[str, ...],
    launcher: str,
    minimum: int = 0,
    why: str = "",
) -> tuple[int, str]:
    value, name = _opt_int(environ, names, launcher, minimum)
    if value is None:
        wanted = " or ".join(names)
        raise LaunchEnvError(f"{detected(launcher)} but {wanted} is not set{why}", launcher)
    return value, name


def _port_var(environ: Mapping[str, str], launcher: str) -> int | None:
    port, _ = _opt_int(environ, ("MASTER_PORT",), launcher, minimum=1)
    if port is not None and port > 65535:
        raise LaunchEnvError(
            f"{detected(launcher)} but MASTER_PORT={port} (expected 1..65535)", launcher
        )
    return port


def _job_id(environ: Mapping[str, str], launcher: str) -> str | None:
    for name in _JOB_VARS.get(launcher, ()):
        value = _get(environ, name)
        if value is not None:
            if name == "OMPI_MCA_orte_hnp_uri":
                value = value.split(";", 1)[0]  # "<jobfamily>.0;tcp://...": the family
            return value
    return None


def _check(env: LaunchEnv, names: dict[str, str]) -> LaunchEnv:
    """Cross-field checks; ``names`` maps field -> variable it came from."""
    said = detected(env.launcher)
    who_ = env.launcher
    if env.rank >= env.world_size:
        raise LaunchEnvError(
            f"{said} but {names['rank']}={env.rank} is not below "
            f"{names['world_size']}={env.world_size}",
            who_,
        )
    if env.local_world_size is not None and env.local_world_size > env.world_size:
        raise LaunchEnvError(
            f"{said} but {names['local_world_size']}={env.local_world_size} "
            f"exceeds {names['world_size']}={env.world_size}",
            who_,
        )
    if (
        env.local_rank is not None
        and env.local_world_size is not None
        and env.local_rank >= env.local_world_size
    ):
        raise LaunchEnvError(
            f"{said} but {names['local_rank']}={env.local_rank} is not below "
            f"{names['local_world_size']}={env.local_world_size}",
            who_,
        )
    if env.local_rank is not None and env.local_rank >= env.world_size:
        raise LaunchEnvError(
            f"{said} but {names['local_rank']}={env.local_rank} is not below "
            f"{names['world_size']}={env.world_size}",
            who_,
        )
    return env


def _generic(
    environ: Mapping[str, str],
    launcher: str,
    names: dict[str, tuple[str, ...]],
    *,
    job_id: str | None = None,
    master_addr: str | None = None,
    size_why: str = "",
) -> LaunchEnv:
    rank, rank_var = _req_int(environ, names["rank"], launcher)
    size, size_var = _req_int(environ, names["world_size"], launcher, minimum=1, why=size_why)
    local, local_var = _opt_int(environ, names["local_rank"], launcher)
    lsize, lsize_var = _opt_int(environ, names["local_world_size"], launcher, minimum=1)
    port = _port_var(environ, launcher)
    if port is None and job_id is not None:
        port = slurm_default_port(job_id)
    env = LaunchEnv(
        launcher=launcher,
        rank=rank,
        world_size=size,
        local_rank=local,
        local_world_size=lsize,
        master_addr=_get(environ, "MASTER_ADDR") or master_addr,
        master_port=port,
        job_id=job_id,
    )
    return _check(
        env,
        {
            "rank": rank_var,
            "world_size": size_var,
            "local_rank": local_var,
            "local_world_size": lsize_var,
        },
    )


# -- torch: torchrun, python -m pynccl launch, env:// --------------------------------------------


def _torch(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    run_id = _get(environ, "TORCHELASTIC_RUN_ID") if launcher == "torchrun" else None
    if run_id == "none":  # torchrun's placeholder when no --rdzv-id is given
        run_id = None
    env = _generic(
        environ,
        launcher,
        {
            "rank": ("RANK",),
            "world_size": ("WORLD_SIZE",),
            "local_rank": ("LOCAL_RANK",),
            "local_world_size": ("LOCAL_WORLD_SIZE",),
        },
    )
    # the port is torch's, never derived: its job id only names the job
    env = replace(env, job_id=run_id)
    if launcher == "pynccl" and (env.master_addr is None or env.master_port is None):
        raise LaunchEnvError(
            "pynccl launch detected but MASTER_ADDR or MASTER_PORT is not set", launcher
        )
    return env


# -- MPI: Open MPI, MVAPICH2, Cray PALS, MPICH / Intel MPI (Hydra), PMIx ------------------------


def _mpi(environ: Mapping[str, str], launcher: str, names: dict[str, tuple[str, ...]]) -> LaunchEnv:
    env = _generic(environ, launcher, names, job_id=_job_id(environ, launcher))
    if env.master_addr is None and env.local_world_size == env.world_size:
        # every rank runs on this host, rank 0 included
        env = replace(env, master_addr="127.0.0.1")
    return env


def _openmpi(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    return _mpi(
        environ,
        launcher,
        {
            "rank": ("OMPI_COMM_WORLD_RANK",),
            "world_size": ("OMPI_COMM_WORLD_SIZE",),
            "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",),
            "local_world_size": ("OMPI_COMM_WORLD_LOCAL_SIZE",),
        },
    )


def _mvapich2(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    return _mpi(
        environ,
        launcher,
        {
            "rank": ("MV2_COMM_WORLD_RANK",),
            "world_size": ("MV2_COMM_WORLD_SIZE",),
            "local_rank": ("MV2_COMM_WORLD_LOCAL_RANK",),
            "local_world_size": ("MV2_COMM_WORLD_LOCAL_SIZE",),
        },
    )


def _pals(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    # PALS numbers the ranks; Cray PMI, which PALS starts them under, exports the sizes
    return _mpi(
        environ,
        launcher,
        {
            "rank": ("PALS_RANKID",),
            "world_size": ("PMI_SIZE",),
            "local_rank": ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
            "local_world_size": ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"),
        },
    )


def _mpich(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    return _mpi(
        environ,
        launcher,
        {
            "rank": ("PMI_RANK",),
            "world_size": ("PMI_SIZE",),
            "local_rank": ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
            "local_world_size": ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
        },
    )


def _pmix(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    rank, _ = _req_int(environ, ("PMIX_RANK",), launcher)
    namespace = _get(environ, "PMIX_NAMESPACE")
    where = f"PMIX_RANK={rank}" + (f", PMIX_NAMESPACE={namespace!r}" if namespace else "")
    raise LaunchEnvError(
        f"{detected(launcher)} ({where}) but PMIx gives the world size only through its "
        "library, not the environment: pass from_env(mpi_comm=MPI.COMM_WORLD) (mpi4py "
        "asks PMIx; rank and size then come from the communicator) or rank= and "
        "world_size=, or export WORLD_SIZE and RANK",
        launcher,
    )


# -- Slurm --------------------------------------------------------------------------------------


def _slurm_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's ``2(x3),1`` into ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"malformed tasks-per-node list {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def slurm_step(environ: Mapping[str, str]) -> str | None:
    return _get(environ, "SLURM_STEP_ID") or _get(environ, "SLURM_STEPID")


def _slurm(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    rank, _ = _req_int(environ, ("SLURM_PROCID",), launcher)
    size, size_var = _req_int(
        environ, ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS"), launcher, minimum=1
    )
    local, _ = _opt_int(environ, ("SLURM_LOCALID",), launcher)
    node_id, _ = _opt_int(environ, ("SLURM_NODEID",), launcher)
    lsize: int | None = None
    lsize_var = "SLURM_TASKS_PER_NODE"
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        spec = _get(environ, var)
        if spec is None or node_id is None:
            continue
        try:
            counts = _slurm_tasks_per_node(spec)
        except ValueError as e:
            raise LaunchEnvError(f"{detected(launcher)} but {var}: {e}", launcher) from None
        if node_id >= len(counts):
            raise LaunchEnvError(
                f"{detected(launcher)} but SLURM_NODEID={node_id} is not below the "
                f"{len(counts)} nodes listed in {var}={spec!r}",
                launcher,
            )
        lsize, lsize_var = counts[node_id], var
        break

    job = _job_id(environ, launcher)
    step = slurm_step(environ)
    addr = _get(environ, "MASTER_ADDR")
    if addr is None:
        for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            nodelist = _get(environ, var)
            if nodelist is None:
                continue
            try:
                addr = first_host(nodelist)
            except ValueError as e:
                raise LaunchEnvError(f"{detected(launcher)} but {var}: {e}", launcher) from None
            break
    port = _port_var(environ, launcher)
    if port is None and job is not None:
        port = slurm_default_port(job, step)
    env = LaunchEnv(
        launcher=launcher,
        rank=rank,
        world_size=size,
        local_rank=local,
        local_world_size=lsize,
        master_addr=addr,
        master_port=port,
        job_id=None if job is None else (job if step is None else f"{job}.{step}"),
    )
    return _check(
        env,
        {
            "rank": "SLURM_PROCID",
            "world_size": size_var,
            "local_rank": "SLURM_LOCALID",
            "local_world_size": lsize_var,
        },
    )


# -- Kubernetes: LeaderWorkerSet, indexed Jobs and JobSet (one rank per pod) ---------------------

_ONE_PER_POD = {"local_rank": ("LOCAL_RANK",), "local_world_size": ("LOCAL_WORLD_SIZE",)}


def _one_per_pod(env: LaunchEnv) -> LaunchEnv:
    """A pod is one rank: local rank 0 of 1, unless LOCAL_RANK/LOCAL_WORLD_SIZE say more."""
    if env.local_rank is not None or env.local_world_size is not None:
        return env
    return replace(env, local_rank=0, local_world_size=1)


def _lws(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    if _get(environ, "LWS_WORKER_INDEX") is None:
        raise LaunchEnvError(
            f"{detected(launcher)} but LWS_WORKER_INDEX is not set (LeaderWorkerSet sets it "
            "from v0.6; before, expose the pod label leaderworkerset.sigs.k8s.io/worker-index "
            "as LWS_WORKER_INDEX with the downward API)",
            launcher,
        )
    env = _generic(
        environ,
        launcher,
        {"rank": ("LWS_WORKER_INDEX",), "world_size": ("LWS_GROUP_SIZE",), **_ONE_PER_POD},
        job_id=_job_id(environ, launcher),
        master_addr=_get(environ, "LWS_LEADER_ADDRESS"),
    )
    return _one_per_pod(env)


def _jobset(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    job_index, job_var = _opt_int(environ, ("JOB_GLOBAL_INDEX", "JOB_INDEX"), launcher)
    if job_index:
        raise LaunchEnvError(
            f"{detected(launcher)} but {job_var}={job_index}: the pods of a JobSet's "
            "several Jobs share completion indexes, so JOB_COMPLETION_INDEX is no rank; set "
            "RANK (JOB_GLOBAL_INDEX * pods per Job + JOB_COMPLETION_INDEX) and WORLD_SIZE in "
            "the pod template",
            launcher,
        )
    name, rjob = _get(environ, "JOBSET_NAME"), _get(environ, "REPLICATED_JOB_NAME")
    # JobSet's pod host names: <jobset>-<replicated job>-<job index>-<pod index>.<jobset>
    leader = f"{name}-{rjob}-0-0.{name}" if name and rjob else None
    env = _generic(
        environ,
        launcher,
        {"rank": ("JOB_COMPLETION_INDEX",), "world_size": ("WORLD_SIZE",), **_ONE_PER_POD},
        job_id=_job_id(environ, launcher),
        master_addr=leader,
        size_why=" (an indexed Job does not export its completions: set WORLD_SIZE in the "
        "pod template)",
    )
    return _one_per_pod(env)


Parser = Callable[[Mapping[str, str], str], LaunchEnv]

_TORCHELASTIC = (
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def _set(*names: str) -> Callable[[Mapping[str, str]], bool]:
    return lambda environ: any(_get(environ, n) is not None for n in names)


def _is_torchrun(environ: Mapping[str, str]) -> bool:
    return _set("RANK", "WORLD_SIZE")(environ) and _set(*_TORCHELASTIC)(environ)


def _is_env(environ: Mapping[str, str]) -> bool:
    # WORLD_SIZE alone is no launch (a JobSet pod template sets it beside its index)
    return _get(environ, "RANK") is not None and not _set(*_TORCHELASTIC)(environ)


def _is_slurm_step(environ: Mapping[str, str]) -> bool:
    # a batch script also has SLURM_PROCID=0 and SLURM_NTASKS: only a step started the ranks
    return _get(environ, "SLURM_PROCID") is not None and slurm_step(environ) is not None


#: name -> (whether this launcher started us, parser), in order of precedence: the innermost
#: launcher sets the most specific variables, and PMIx-only (no size) is the last resort.
CONVENTIONS: dict[str, tuple[Callable[[Mapping[str, str]], bool], Parser]] = {
    "torchrun": (_is_torchrun, _torch),
    "pynccl": (lambda environ: False, _torch),  # launch sets PYNCCL_LAUNCHER=pynccl
    "env": (_is_env, _torch),
    "openmpi": (_set("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), _openmpi),
    "mvapich2": (_set("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"), _mvapich2),
    "pals": (_set("PALS_RANKID"), _pals),
    "mpich": (_set("PMI_RANK", "PMI_SIZE"), _mpich),
    "slurm": (_is_slurm_step, _slurm),
    "lws": (_set("LWS_WORKER_INDEX", "LWS_GROUP_SIZE", "LWS_LEADER_ADDRESS"), _lws),
    "jobset": (_set("JOB_COMPLETION_INDEX"), _jobset),
    "pmix": (_set("PMIX_RANK"), _pmix),
}
