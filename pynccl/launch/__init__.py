"""``python -m pynccl launch``: start N local ranks of a script with the rendezvous env set.

Usage::

    python -m pynccl launch -n N [--devices 0,1,...] [--loopback] [--timeout S]
                            [--grace S] [--master-port P] script.py [args...]
    python -m pynccl launch -n N [...] -m package.module [args...]
    python -m pynccl launch -n N --nnodes M --node-rank K --master-addr A
                            [--master-port P] [...] script.py [args...]

Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` (a free port), a fresh random
``PYNCCL_RENDEZVOUS_KEY`` (unless one is exported) and ``PYNCCL_LAUNCHER=pynccl``, so that
``pynccl.bootstrap.from_env()`` just works. ``--devices`` sets
``CUDA_VISIBLE_DEVICES`` to the chosen devices (rank k uses the k-th);
``--loopback`` adds the environment of the GPU-less loopback libraries, with as
many loopback devices as ranks (``PYNCCL_LOOPBACK_DEVICES``, at least 8, unless set).
With ``--nnodes``, every node's launcher runs on this machine (the loopback's ranks
share its memory): node K's ranks get loopback devices ``K*N .. K*N+N-1`` (through
``CUDA_VISIBLE_DEVICES``, unless ``--devices``), and the ranks of all nodes meet in
``PYNCCL_LOOPBACK_RENDEZVOUS_DIR`` (default ``/tmp/pynccl-lb-<uid>``, made 0700), so
that launchers in network namespaces of their own find each other too.

Several nodes, as torchrun does it: run one launcher per node with the same
``-n``, ``--nnodes M`` and ``--master-addr`` (node 0's address; ``--master-port``
defaults to 29500), each with its own ``--node-rank K``. Rank ``K*N + i`` runs
on node K with ``LOCAL_RANK=i``, ``WORLD_SIZE=M*N`` and ``GROUP_RANK=K``; rank 0
(on node 0) serves the id at the master address. An exported
``PYNCCL_RENDEZVOUS_KEY`` is passed to the ranks (export the same secret on every
node); without one a multi-node job's rendezvous is unauthenticated, with a warning.

Every line a rank prints is prefixed with ``[rank k] `` (stdout to stdout,
stderr to stderr, whole lines only). SIGINT/SIGTERM are forwarded to the ranks;
a second one kills them. When a rank fails the others get SIGTERM, then SIGKILL
after ``--grace`` seconds, and the launcher exits with the failed rank's code
(128 + signal number for a rank killed by a signal). Each rank runs in its own
process group, so the processes it starts are stopped with it.

What the ranks start goes with them, however the launcher ends (a scheduler's SIGKILL
included), even a process that left the rank's group with ``setsid()``. The ranks are
started by a small keeper process in a session of its own, which stays their parent:
on Linux it is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``), so every
orphaned descendant of a rank is re-parented to it rather than to init, and each rank
gets SIGKILL from the kernel if the keeper dies (``PR_SET_PDEATHSIG``). When the
launcher ends, or dies (the keeper reads its stdin, which only the launcher holds, to
end of file), the keeper SIGKILLs its whole process tree, round after round, until it
has no child left. Limits: a process that is not a descendant (started through a
daemon: ``systemd-run``, ``ssh``, ``docker exec``) or that runs as another user (a
set-user-ID program) is out of reach; if the keeper itself is SIGKILLed, the ranks
still die (parent-death signal) but a descendant that left its rank's process group
may survive; and off Linux (no subreaper, no parent-death signal) only the ranks'
process groups are stopped.
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from . import _flight
from ._job import Job

__all__ = ["main"]

_VALUE_OPTIONS = frozenset(
    {
        "-n",
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        "--devices",
        "--timeout",
        "--grace",
        "--nnodes",
        "--node-rank",
        "--node_rank",
        "--master-addr",
        "--master_addr",
        "--master-port",
        "--master_port",
        *_flight.OPTIONS,
    }
)
_DEFAULT_MULTINODE_PORT = 29500  # torchrun's


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pynccl launch",
        description="Start N local ranks of a Python script or module with RANK, WORLD_SIZE, "
        "LOCAL_RANK, MASTER_ADDR/MASTER_PORT and a fresh PYNCCL_RENDEZVOUS_KEY set. For a job "
        "on several nodes, run it on each with --nnodes, --node-rank and --master-addr.",
        usage="%(prog)s -n N [options] (script.py | -m module) [args ...]",
    )
    p.add_argument(
        "-n",
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        type=int,
        required=True,
        help="number of ranks to start (on this node)",
    )
    p.add_argument(
        "--devices",
        help="comma-separated CUDA devices, one per rank "
        "(sets CUDA_VISIBLE_DEVICES; rank k uses the k-th)",
    )
    p.add_argument(
        "--loopback",
        action="store_true",
        help="run on the GPU-less loopback libraries (pynccl.testing.loopback)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="stop all ranks after this many seconds (exit code 124)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)",
    )
    p.add_argument(
        "--nnodes", type=int, default=1, help="number of nodes, one launcher each (default 1)"
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        default=0,
        help="this node's index in 0..nnodes-1 (default 0)",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default=None,
        help="address of node 0, where rank 0 serves the rendezvous (required with "
        "--nnodes > 1; default 127.0.0.1)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=int,
        default=None,
        help="rendezvous port (default: a free port on one node, "
        f"{_DEFAULT_MULTINODE_PORT} with --nnodes > 1)",
    )
    p.add_argument("-m", dest="module", default=None, help="run a module, as python -m does")
    _flight.add_options(p)
    return p


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Launcher options | the target and its arguments (which may look like options)."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if tok == "-m":
            return list(argv[: i + 2]), list(argv[i + 2 :])
        if tok.startswith("-m") and not tok.startswith("--"):
            return list(argv[: i + 1]), list(argv[i + 1 :])
        if not tok.startswith("-") or tok == "-":
            break
        i += 2 if tok in _VALUE_OPTIONS else 1
    return list(argv[:i]), list(argv[i:])


def _parse_devices(spec: str, nproc: int) -> list[str]:
    devices = [d.strip() for d in spec.split(",")]
    for d in devices:
        if not (d.isdigit() or d.startswith(("GPU-", "MIG-"))):
            raise ValueError(f"--devices: {d!r} is not a device index or GPU-/MIG- UUID")
    if len(set(devices)) != len(devices):
        raise ValueError(f"--devices {spec!r} lists a device twice")
    if len(devices) != nproc:
        raise ValueError(f"--devices lists {len(devices)} device(s) but -n is {nproc}")
    return devices


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_envs(
    opts: argparse.Namespace, devices: list[str] | None, addr: str, port: int
) -> tuple[list[dict[str, str]], list[str]]:
    """Every local rank's environment, and warnings for the launcher to print."""
    nproc, nnodes, node = opts.nproc, opts.nnodes, opts.node_rank
    base = dict(os.environ)
    if opts.loopback:
        # imported late: it builds the loopback libraries on first use
        try:
            module = importlib.import_module("pynccl.testing.loopback")
            base.update(module.env())
        except Exception as e:  # a missing compiler, a failed build: say so, do not trace back
            raise ValueError(
                f"--loopback: could not prepare the loopback libraries: {type(e).__name__}: {e}"
            ) from e
        # devices follow the global rank: rank K*N+i (node K, local rank i) uses loopback
        # device K*N+i, as on one GPU per rank; the loopback, like NCCL, refuses two ranks
        # on one device, and every "node" here is this machine
        base.setdefault("PYNCCL_LOOPBACK_DEVICES", str(max(8, nnodes * nproc)))
        if nnodes > 1:
            # the nodes' launchers may run in network namespaces of their own (abstract
            # sockets are per namespace): their ranks meet through a directory instead
            base.setdefault("PYNCCL_LOOPBACK_RENDEZVOUS_DIR", _loopback_rendezvous_dir())
    warnings = []
    key = base.get("PYNCCL_RENDEZVOUS_KEY") or None
    if key is None and nnodes == 1:
        key = secrets.token_hex(32)
    elif key is None:
        warnings.append(
            "PYNCCL_RENDEZVOUS_KEY is not set, so the rendezvous between nodes is not "
            "authenticated: export the same secret on every node"
        )
    if nnodes > 1 and not opts.loopback and _loopback_only(addr):
        warnings.append(
            f"--master-addr {addr} is a loopback address here: ranks on other machines cannot "
            "reach rank 0 there (give node 0's network address)"
        )
    envs = []
    for local in range(nproc):
        env = dict(base)
        env.pop("PYNCCL_RENDEZVOUS_KEY", None)
        env.update(
            RANK=str(node * nproc + local),
            WORLD_SIZE=str(nnodes * nproc),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK=str(node),
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            PYNCCL_LAUNCHER="pynccl",
            PYTHONUNBUFFERED="1",
        )
        if key is not None:
            env["PYNCCL_RENDEZVOUS_KEY"] = key
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        elif opts.loopback and nnodes > 1:
            # this node's share of the loopback devices, numbered from 0 as CUDA does
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * nproc + i) for i in range(nproc))
        envs.append(env)
    return envs, warnings


def _loopback_rendezvous_dir() -> str:
    """``/tmp/pynccl-lb-<uid>``: where the loopback ranks of every node's launcher meet
    (one directory for all the user's jobs; each world's socket has a name of its own).

    Made 0700 if missing; refused unless it is a real directory of this user that nobody
    else may write to, since whoever can connect there can join the job's worlds.
    """
    import stat

    path = f"/tmp/pynccl-lb-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ValueError(
            f"--loopback --nnodes: cannot create {path} for the loopback ranks to meet in "
            f"({e}); set PYNCCL_LOOPBACK_RENDEZVOUS_DIR to a directory every node's launcher "
            "sees"
        ) from e
    info = os.lstat(path)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        raise ValueError(
            f"--loopback --nnodes: {path} is not a directory of this user closed to others; "
            "remove it, or set PYNCCL_LOOPBACK_RENDEZVOUS_DIR to one"
        )
    return path


def _loopback_only(addr: str) -> bool:
    """Whether ``addr`` names this machine's loopback only (unresolvable: rank 0 says so)."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def _check_options(opts: argparse.Namespace) -> None:
    if opts.nproc < 1:
        raise ValueError(f"-n {opts.nproc}: need at least one rank")
    if opts.nnodes < 1:
        raise ValueError(f"--nnodes {opts.nnodes}: need at least one node")
    if not 0 <= opts.node_rank < opts.nnodes:
        raise ValueError(f"--node-rank {opts.node_rank}: must be in 0..{opts.nnodes - 1}")
    if opts.nnodes > 1 and opts.master_addr is None:
        raise ValueError(
            f"--nnodes {opts.nnodes} needs --master-addr: the address of node 0, where rank 0 "
            "serves the rendezvous"
        )
    if opts.master_addr is not None and not opts.master_addr.strip():
        raise ValueError("--master-addr is empty")
    if opts.grace < 0:
        raise ValueError(f"--grace {opts.grace}: must be >= 0")
    if opts.timeout is not None and opts.timeout <= 0:
        raise ValueError(f"--timeout {opts.timeout}: must be > 0")
    if opts.master_port is not None and not 1 <= opts.master_port <= 65535:
        raise ValueError(f"--master-port {opts.master_port}: must be in 1..65535")


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m pynccl launch``; returns the exit code (see the module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    own, rest = _split(args)
    parser = _parser()
    try:
        opts = parser.parse_args(own)
    except SystemExit as e:  # --help or a usage error: argparse already printed why
        return e.code if isinstance(e.code, int) else 2
    try:
        _check_options(opts)
        devices = None if opts.devices is None else _parse_devices(opts.devices, opts.nproc)
        if opts.module is not None:
            cmd = [sys.executable, "-u", "-m", opts.module, *rest]
        elif rest:
            cmd = [sys.executable, "-u", rest[0], *rest[1:]]
        else:
            raise ValueError("nothing to run: give a script or -m module")
        addr = (opts.master_addr or "127.0.0.1").strip()
        port = opts.master_port or (_DEFAULT_MULTINODE_PORT if opts.nnodes > 1 else _free_port())
        envs, warnings = _child_envs(opts, devices, addr, port)
        flight = _flight.prepare(opts, envs)
    except (ValueError, ImportError) as e:
        parser.print_usage(sys.stderr)
        print(f"python -m pynccl launch: error: {e}", file=sys.stderr)
        return 2

    # Without a GPU every rank that uses CUDA fails with its own traceback: find out once,
    # here, and say after a failure what to do (a job that needs no GPU hears nothing).
    no_gpu = None if opts.loopback else _no_gpu_reason()
    job = Job(cmd, envs, opts.grace, opts.timeout)
    if flight is not None:
        job.dump_grace = opts.dump_grace
        job.dumped = _flight.all_dumped(flight, job.ranks)
    pending: list[int] = []
    handled = (signal.SIGINT, signal.SIGTERM)
    previous: dict[int, object] = {}
    old_wakeup = -1
    in_main = threading.current_thread() is threading.main_thread()
    try:
        if in_main:
            job.wake_w.setblocking(False)
            job.wake_r.setblocking(False)
            old_wakeup = signal.set_wakeup_fd(job.wake_w.fileno(), warn_on_full_buffer=False)
            for sig in handled:
                previous[sig] = signal.signal(sig, lambda s, _f: pending.append(s))
        for warning in warnings:
            job.say(f"warning: {warning}")
        try:
            job.start()
        except OSError as e:
            job.say(f"could not start a rank: {e}")
            job.stop_all(signal.SIGKILL)
            return 1
        code = job.run(pending)
        if flight is not None and code != 0:
            _flight.report(flight, job.say)
        if code != 0 and no_gpu is not None:
            job.say(
                f"hint: {no_gpu}; ranks that use CUDA fail here. Add --loopback to run them "
                "on pynccl's host-memory loopback libraries (python -m pynccl info says more)"
            )
        return code
    finally:
        if in_main:
            for signum, handler in previous.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]
            signal.set_wakeup_fd(old_wakeup)
        job.cleanup()


def _no_gpu_reason() -> str | None:
    """Why CUDA cannot be used here, or None (see :func:`pynccl.info.no_gpu_reason`)."""
    from ..info import no_gpu_reason

    return no_gpu_reason()


if __name__ == "__main__":
    sys.exit(main())
