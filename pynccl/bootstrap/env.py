"""Which launcher started this process, and where this process sits in the job.

Conventions understood, in order of precedence (the innermost launcher usually
sets the most specific variables, so it wins):

``torchrun`` / ``pynccl``
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (also accelerate, deepspeed and anything
    else following torch's ``env://`` convention). ``python -m pynccl launch``
    sets the same variables plus ``PYNCCL_LAUNCHER=pynccl``.
``openmpi``
    ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``.
``mpich`` (MPICH, Intel MPI and other Hydra/PMI launchers)
    ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.
``slurm``
    ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the local world
    size from ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` and
    ``SLURM_NODEID``; the master address is the first host of the step's (or
    job's) node list unless ``MASTER_ADDR`` is set, the port ``MASTER_PORT`` or
    :func:`slurm_default_port`.

The MPI conventions carry no address: set ``MASTER_ADDR``/``MASTER_PORT``
yourself or share the id over MPI (``from_env(mpi_comm=...)``).

When several conventions are present (torchrun started by srun, say) the one
with precedence is used; if two of them describe a world of the same size but
give this process different ranks, that is a contradiction and
:class:`LaunchEnvError` is raised. ``PYNCCL_LAUNCHER=<name>`` forces one
convention and skips that cross-check.
"""

from __future__ import annotations

import itertools
import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

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

#: Names :attr:`LaunchEnv.launcher` can take, in order of precedence.
LAUNCHERS = ("torchrun", "pynccl", "openmpi", "mpich", "slurm")

# Slurm jobs without MASTER_PORT get a port in [base, base + span): below the
# Linux ephemeral range (32768+) so that it rarely collides with OS-assigned ports.
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 15000


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as told by its launcher.

    ``local_rank``/``local_world_size`` are ``None`` when the launcher does not
    say; ``master_addr``/``master_port`` are ``None`` when no address is known
    (MPI launchers without ``MASTER_ADDR``). ``job_id`` identifies the job when
    the launcher gives it an id (Slurm job and step, torchrun run id, PMIx
    namespace), else ``None``.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None


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
                f"{launcher} launch detected but {name}={environ[name]!r} is not an integer",
                launcher,
            ) from None
        if value < minimum:
            raise LaunchEnvError(
                f"{launcher} launch detected but {name}={value} (expected >= {minimum})",
                launcher,
            )
        return value, name
    return None, names[0]


def _req_int(
    environ: Mapping[str, str], names: tuple[str, ...], launcher: str, minimum: int = 0
) -> tuple[int, str]:
    value, name = _opt_int(environ, names, launcher, minimum)
    if value is None:
        wanted = " or ".join(names)
        raise LaunchEnvError(f"{launcher} launch detected but {wanted} is not set", launcher)
    return value, name


def _port_var(environ: Mapping[str, str], launcher: str) -> int | None:
    port, _ = _opt_int(environ, ("MASTER_PORT",), launcher, minimum=1)
    if port is not None and port > 65535:
        raise LaunchEnvError(
            f"{launcher} launch detected but MASTER_PORT={port} (expected 1..65535)", launcher
        )
    return port


def _check(env: LaunchEnv, names: dict[str, str]) -> LaunchEnv:
    """Cross-field checks; ``names`` maps field -> variable it came from."""
    who = env.launcher
    if env.rank >= env.world_size:
        raise LaunchEnvError(
            f"{who} launch detected but {names['rank']}={env.rank} is not below "
            f"{names['world_size']}={env.world_size}",
            who,
        )
    if env.local_world_size is not None and env.local_world_size > env.world_size:
        raise LaunchEnvError(
            f"{who} launch detected but {names['local_world_size']}={env.local_world_size} "
            f"exceeds {names['world_size']}={env.world_size}",
            who,
        )
    if (
        env.local_rank is not None
        and env.local_world_size is not None
        and env.local_rank >= env.local_world_size
    ):
        raise LaunchEnvError(
            f"{who} launch detected but {names['local_rank']}={env.local_rank} is not below "
            f"{names['local_world_size']}={env.local_world_size}",
            who,
        )
    if env.local_rank is not None and env.local_rank >= env.world_size:
        raise LaunchEnvError(
            f"{who} launch detected but {names['local_rank']}={env.local_rank} is not below "
            f"{names['world_size']}={env.world_size}",
            who,
        )
    return env


def _generic(
    environ: Mapping[str, str], launcher: str, names: dict[str, tuple[str, ...]], job_id: str | None
) -> LaunchEnv:
    rank, rank_var = _req_int(environ, names["rank"], launcher)
    size, size_var = _req_int(environ, names["world_size"], launcher, minimum=1)
    local, local_var = _opt_int(environ, names["local_rank"], launcher)
    lsize, lsize_var = _opt_int(environ, names["local_world_size"], launcher, minimum=1)
    env = LaunchEnv(
        launcher=launcher,
        rank=rank,
        world_size=size,
        local_rank=local,
        local_world_size=lsize,
        master_addr=_get(environ, "MASTER_ADDR"),
        master_port=_port_var(environ, launcher),
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


def _torchrun(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    run_id = _get(environ, "TORCHELASTIC_RUN_ID")
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
        run_id,
    )
    if launcher == "pynccl" and (env.master_addr is None or env.master_port is None):
        raise LaunchEnvError(
            "pynccl launch detected but MASTER_ADDR or MASTER_PORT is not set", launcher
        )
    return env


def _openmpi(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    job = _get(environ, "PMIX_NAMESPACE") or _get(environ, "OMPI_MCA_ess_base_jobid")
    return _generic(
        environ,
        launcher,
        {
            "rank": ("OMPI_COMM_WORLD_RANK",),
            "world_size": ("OMPI_COMM_WORLD_SIZE",),
            "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",),
            "local_world_size": ("OMPI_COMM_WORLD_LOCAL_SIZE",),
        },
        job,
    )


def _mpich(environ: Mapping[str, str], launcher: str) -> LaunchEnv:
    job = _get(environ, "PMIX_NAMESPACE") or _get(environ, "PMI_JOBID")
    return _generic(
        environ,
        launcher,
        {
            "rank": ("PMI_RANK",),
            "world_size": ("PMI_SIZE",),
            "local_rank": ("MPI_LOCALRANKID",),
            "local_world_size": ("MPI_LOCALNRANKS",),
        },
        job,
    )


def _slurm_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's ``2(x3),1`` into ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"malformed tasks-per-node list {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def slurm_default_port(job_id: str, step_id: str | None = None) -> int:
    """The rendezvous port used for a Slurm job when ``MASTER_PORT`` is not set.

    Derived from the job (and step) id so that every task of a step computes the
    same port and concurrent jobs on one node rarely collide; always in
    15000..29999, below Linux's ephemeral port range.
    """
    text = job_id.strip()
    base = int(text) if text.isdigit() else zlib.crc32(text.encode())
    if step_id is not None and step_id.strip().isdigit():
        # distinct steps of one job (srun ... & srun ...) get distinct ports
        base = base * 31 + int(step_id.strip())
    return _SLURM_PORT_BASE + base % _SLURM_PORT_SPAN


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
            raise LaunchEnvError(f"slurm launch detected but {var}: {e}", launcher) from None
        if node_id >= len(counts):
            raise LaunchEnvError(
                f"slurm launch detected but SLURM_NODEID={node_id} is not below the "
                f"{len(counts)} nodes listed in {var}={spec!r}",
                launcher,
            )
        lsize, lsize_var = counts[node_id], var
        break

    job = _get(environ, "SLURM_JOB_ID") or _get(environ, "SLURM_JOBID")
    step = _get(environ, "SLURM_STEP_ID") or _get(environ, "SLURM_STEPID")
    addr = _get(environ, "MASTER_ADDR")
    if addr is None:
        for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            nodelist = _get(environ, var)
            if nodelist is None:
                continue
            try:
                addr = first_host(nodelist)
            except ValueError as e:
                raise LaunchEnvError(f"slurm launch detected but {var}: {e}", launcher) from None
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


# launcher name -> (variables whose presence means "this launcher started us", parser)
_CONVENTIONS = {
    "torchrun": (("RANK", "WORLD_SIZE"), _torchrun),
    "pynccl": (("RANK", "WORLD_SIZE"), _torchrun),
    "openmpi": (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), _openmpi),
    "mpich": (("PMI_RANK", "PMI_SIZE"), _mpich),
    "slurm": (("SLURM_PROCID",), _slurm),
}


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size, local rank and master address from the launcher's variables.

    ``environ`` defaults to :data:`os.environ`. Raises :class:`LaunchEnvError`
    (a :class:`ValueError`) naming the detected launcher and the offending
    variable when variables are missing, not integers, out of range, or when two
    launchers contradict each other; and when no launcher is detected at all.
    """
    if environ is None:
        environ = os.environ
    forced = _get(environ, "PYNCCL_LAUNCHER")
    if forced is not None:
        if forced not in _CONVENTIONS:
            raise LaunchEnvError(f"PYNCCL_LAUNCHER={forced!r} is not one of {', '.join(LAUNCHERS)}")
        return _CONVENTIONS[forced][1](environ, forced)

    found: list[LaunchEnv] = []
    for name in ("torchrun", "openmpi", "mpich", "slurm"):
        triggers, parse = _CONVENTIONS[name]
        if not any(_get(environ, t) is not None for t in triggers):
            continue
        if not found:
            found.append(parse(environ, name))  # errors of the chosen launcher are fatal
            continue
        try:
            found.append(parse(environ, name))
        except LaunchEnvError:
            continue  # an outer launcher's partial variables do not matter
    if not found:
        raise LaunchEnvError(
            "no launcher detected: none of RANK/WORLD_SIZE (torchrun, pynccl launch), "
            "OMPI_COMM_WORLD_RANK (Open MPI), PMI_RANK (MPICH, Intel MPI) or SLURM_PROCID "
            "(srun) is set"
        )
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


# -- Slurm node lists -----------------------------------------------------------------------

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in node list {nodelist!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {nodelist!r}")
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in node list {nodelist!r}")
    items.append(nodelist[start:])
    return items


def _parse_ranges(spec: str, nodelist: str) -> list[tuple[int, int, int]]:
    """``"01-03,7"`` -> ``[(1, 3, 2), (7, 7, 1)]``: (low, high, zero-padded width)."""
    ranges: list[tuple[int, int, int]] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"malformed range {part!r} in node list {nodelist!r}")
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise ValueError(f"descending range {part!r} in node list {nodelist!r}")
        ranges.append((lo, hi, len(lo_text)))  # Slurm keeps the lower bound's zero padding
    return ranges


def _parse_nodelist(nodelist: str) -> list[list[str | list[tuple[int, int, int]]]]:
    """Each host expression as [literal, ranges, literal, ranges, ..., literal]."""
    if not nodelist.strip():
        raise ValueError("empty node list")
    items = []
    for item in _split_top_level(nodelist.strip()):
        item = item.strip()
        if not item:
            raise ValueError(f"empty host name in node list {nodelist!r}")
        pieces = _BRACKET.split(item)  # literal, range spec, literal, ..., literal
        items.append(
            [
                piece if i % 2 == 0 else _parse_ranges(piece, nodelist)
                for i, piece in enumerate(pieces)
            ]
        )
    return items


def _choices(piece: str | list[tuple[int, int, int]]) -> list[str]:
    if isinstance(piece, str):
        return [piece]
    return [str(n).zfill(width) for lo, hi, width in piece for n in range(lo, hi + 1)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm compressed host list: ``"node[01-03,07],gpu3"`` ->
    ``["node01", "node02", "node03", "node07", "gpu3"]``.

    Zero padding and several bracket groups per name (``"r[1-2]n[1-2]"``) are
    handled; malformed lists raise :class:`ValueError`.
    """
    hosts: list[str] = []
    for item in _parse_nodelist(nodelist):
        hosts.extend("".join(combo) for combo in itertools.product(*map(_choices, item)))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm compressed host list, without expanding the list.

    The whole list is validated (:class:`ValueError` if malformed).
    """
    first = _parse_nodelist(nodelist)[0]
    return "".join(
        piece if isinstance(piece, str) else str(piece[0][0]).zfill(piece[0][2]) for piece in first
    )


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


def select_device(env: LaunchEnv, environ: Mapping[str, str] | None = None) -> int:
    """The CUDA device ordinal this process should use: its local rank.

    The ordinal indexes the devices left visible by ``CUDA_VISIBLE_DEVICES``.
    When exactly one device is visible, the launcher has bound one device per
    process (``srun --gpus-per-task=1``, a per-rank ``CUDA_VISIBLE_DEVICES``) and
    the answer is 0 whatever the local rank. Raises :class:`LaunchEnvError` when
    the local rank is unknown, or when it is not below the number of visible
    devices.
    """
    if env.local_rank is None:
        raise LaunchEnvError(
            f"{env.launcher} launch detected but it gives no local rank, so the device "
            "cannot be chosen; set LOCAL_RANK or pass a device explicitly",
            env.launcher,
        )
    visible = visible_devices(environ)
    if visible is None:
        return env.local_rank
    if not visible:
        raw = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
        raise LaunchEnvError(
            f"CUDA_VISIBLE_DEVICES={raw!r} leaves no usable device for local rank {env.local_rank}",
            env.launcher,
        )
    if len(visible) == 1:
        return 0
    if env.local_rank >= len(visible):
        raise LaunchEnvError(
            f"{env.launcher} launch detected: local rank {env.local_rank} needs device "
            f"{env.local_rank} but CUDA_VISIBLE_DEVICES exposes only {len(visible)} "
            f"({','.join(visible)})",
            env.launcher,
        )
    return env.local_rank
