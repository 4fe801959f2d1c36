"""Under the launchers people have (issue 22): real torchrun, real Open MPI ``mpirun``,
MPICH's Hydra ``mpiexec``, ``python -m pynccl launch --nnodes`` twice on one machine (and
in two network namespaces), processes that no launcher started, and a communicator that
someone tries to send to another process.

Each job is a 4-rank (2 where a restart or an error is the point) all_reduce + all_gather
on the loopback libraries, checked against numpy in every rank, which writes what it saw
to a file of its own (stdout of several ranks interleaves under mpirun). A tool that is
not installed skips its test, saying how to get it: ``pip install torch==2.13.0`` (the
CPU wheel), ``apt-get install openmpi-bin libopenmpi-dev``, ``pip install mpich``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_multihost
from support.workers import _harness as h

#: Real tools / network namespaces: among the slow tests (.ci/run runs them after the quick run).
pytestmark = pytest.mark.slow

#: Two network namespaces joined by a veth pair: tests/launch/test_multihost.py's fixture.
namespaces = test_multihost.hosts

RUN_TIMEOUT = 180  # generous: a loaded 2-core machine starts 4 interpreters slowly

WORKER = textwrap.dedent(
    """
    import json, os, sys, traceback
    import numpy as np

    out, mode = sys.argv[1], sys.argv[2]
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "-")
    tag = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or str(os.getpid())
    try:
        from pynccl.comm import Communicator
        from pynccl.cuda import DeviceBuffer

        if mode == "mpi4py":
            from mpi4py import MPI

            comm = Communicator.from_env(mpi_comm=MPI.COMM_WORLD, timeout=60)
        elif mode == "store":  # no launcher: the caller says rank and size
            from datetime import timedelta
            from torch.distributed import TCPStore

            rank, size, port = map(int, sys.argv[3:6])
            store = TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=60))
            comm = Communicator.from_env(rank=rank, world_size=size, store=store, timeout=60)
        else:
            comm = Communicator.from_env(timeout=60)
        if os.environ.get("FAIL_RANK_1_IN_ATTEMPT_0") and attempt == "0" and comm.rank == 1:
            os._exit(3)  # after its rendezvous: torchrun restarts every rank
        n, size, rank = 1000, comm.size, comm.rank
        rows = np.stack([np.arange(n, dtype=np.float32) + 100 * r for r in range(size)])
        total = DeviceBuffer.from_numpy(rows[rank])
        comm.all_reduce(total)
        gathered = DeviceBuffer((size, n), "float32")
        comm.all_gather(DeviceBuffer.from_numpy(rows[rank]), gathered)
        comm.synchronize(timeout=60)
        ok = bool(
            np.array_equal(total.to_numpy(), rows.sum(axis=0))
            and np.array_equal(gathered.to_numpy(), rows)
        )
        from pynccl.bootstrap import detect_launch_env

        try:
            launcher = detect_launch_env().launcher
        except Exception:
            launcher = "none"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        phys = int(visible.split(",")[comm.device]) if visible else comm.device
        result = dict(
            rank=rank, size=size, ok=ok, launcher=launcher, device=phys, attempt=attempt
        )
        comm.destroy()
    except BaseException as e:
        result = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
        result["attempt"] = attempt
    name = f"{result.get('rank', tag)}.{attempt}.{os.getpid()}.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f)
    sys.exit(0 if result.get("ok") else 1)
    """
)


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, Path]:
    """(the worker script, the directory its ranks report to)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return script, out


def _reports(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def _assert_job(out: Path, size: int, launcher: str, attempt: str = "-") -> None:
    reports = [r for r in _reports(out) if r.get("attempt", attempt) == attempt]
    assert all("error" not in r for r in reports), reports
    assert sorted(r["rank"] for r in reports) == list(range(size)), reports
    assert all(r["ok"] and r["size"] == size and r["launcher"] == launcher for r in reports)
    # one GPU per rank: the loopback, like NCCL, refuses two ranks on one device
    assert len({r["device"] for r in reports}) == size, reports


def _run(argv: list[str], env: dict[str, str], timeout: float = RUN_TIMEOUT) -> str:
    proc = subprocess.run(
        argv, env=env, cwd=h.ROOT, capture_output=True, text=True, timeout=timeout
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{out[-4000:]}"
    return out


# -- torchrun -----------------------------------------------------------------------------------


def _torchrun() -> list[str]:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0: the CPU wheel)")
    return [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.parametrize("mode", [[], ["--standalone"]], ids=["static", "standalone"])
def test_torchrun_from_env(job: tuple[Path, Path], mode: list[str]) -> None:
    # torchrun's agent store already listens on MASTER_PORT: the id goes through it
    script, out = job
    port = [] if mode else ["--master-port", str(h.free_port())]
    argv = [*_torchrun(), *mode, *port, "--nproc-per-node", "4", str(script), str(out), "env"]
    _run(argv, h.loopback_env())
    _assert_job(out, 4, "torchrun", attempt="0")


def test_torchrun_restart_reads_the_new_attempts_id(job: tuple[Path, Path]) -> None:
    # attempt 0: every rank shares an id through torchrun's store, then rank 1 dies; the
    # store lives on, and attempt 1 must meet on its own id, not read attempt 0's
    script, out = job
    argv = [*_torchrun(), "--master-port", str(h.free_port()), "--max-restarts", "1"]
    argv += ["--nproc-per-node", "2", str(script), str(out), "env"]
    _run(argv, h.loopback_env(FAIL_RANK_1_IN_ATTEMPT_0="1"))
    _assert_job(out, 2, "torchrun", attempt="1")


# -- MPI ----------------------------------------------------------------------------------------


def _open_mpi() -> tuple[list[str], dict[str, str]]:
    """Open MPI's mpirun (not MPICH's, which a venv may put first on PATH) and its env."""
    info = shutil.which("ompi_info")
    mpirun = None if info is None else Path(info).with_name("mpirun")
    if mpirun is None or not mpirun.exists():
        pytest.skip("Open MPI is not installed (apt-get install openmpi-bin libopenmpi-dev)")
    argv = [str(mpirun), "--oversubscribe", "-np", "4"]
    env = {}
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        argv.insert(1, "--allow-run-as-root")
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return argv, env


def test_open_mpi_with_only_master_addr(job: tuple[Path, Path]) -> None:
    # the port comes from the job's id, as under Slurm (issue 22, item 6)
    script, out = job
    mpirun, extra = _open_mpi()
    env = h.loopback_env(**extra, MASTER_ADDR="127.0.0.1", PYNCCL_RENDEZVOUS_KEY=h.new_key())
    _run([*mpirun, sys.executable, str(script), str(out), "env"], env)
    _assert_job(out, 4, "openmpi")


def test_open_mpi_with_mpi4py_on_the_system_library(job: tuple[Path, Path]) -> None:
    # mpi4py's wheel loads the MPICH wheel's libmpi, whose MPI_Init aborts under Open MPI;
    # MPI4PY_LIBMPI points it at the system's (what the README says)
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed")
    mpirun, extra = _open_mpi()
    try:
        ctypes.CDLL(_OPEN_MPI_LIBMPI)
    except OSError as e:
        pytest.skip(f"Open MPI's {_OPEN_MPI_LIBMPI} cannot be loaded: {e}")
    script, out = job
    env = h.loopback_env(**extra, MPI4PY_LIBMPI=_OPEN_MPI_LIBMPI)
    _run([*mpirun, "-x", "MPI4PY_LIBMPI", sys.executable, str(script), str(out), "mpi4py"], env)
    _assert_job(out, 4, "openmpi")


_OPEN_MPI_LIBMPI = "libmpi.so.40"  # Open MPI's soname (MPICH's is libmpi.so.12)


def _hydra() -> str:
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("MPICH's mpiexec is not installed (pip install mpich)")
    return mpiexec


def test_mpich_hydra_says_precisely_what_is_missing(job: tuple[Path, Path]) -> None:
    # Hydra gives no job id to derive a port from: every rank says so at once
    script, out = job
    argv = [_hydra(), "-n", "2", sys.executable, str(script), str(out), "env"]
    proc = subprocess.run(
        argv, env=h.loopback_env(), cwd=h.ROOT, capture_output=True, timeout=RUN_TIMEOUT
    )
    assert proc.returncode != 0
    errors = [r["error"] for r in _reports(out)]
    assert len(errors) == 2, errors
    for error in errors:
        assert error.startswith("LaunchEnvError: mpich launch detected"), error
        assert "MASTER_PORT is not set and none of PMIX_NAMESPACE, PMI_JOBID, PMI_PORT" in error
        assert "MASTER_ADDR is not set" not in error  # both ranks are here: 127.0.0.1


def test_mpich_hydra_with_master_port(job: tuple[Path, Path]) -> None:
    script, out = job
    env = h.loopback_env(MASTER_PORT=str(h.free_port()), PYNCCL_RENDEZVOUS_KEY=h.new_key())
    _run([_hydra(), "-n", "4", sys.executable, str(script), str(out), "env"], env)
    _assert_job(out, 4, "mpich")


# -- python -m pynccl launch --nnodes on the loopback ---------------------------------------------


def _two_nodes(script: Path, out: Path, addr: str, port: int) -> list[list[str]]:
    argvs = []
    for node in range(2):
        argv = h.launch(2, str(script), str(out), "env")
        at = argv.index("launch") + 1
        argv[at:at] = ["--nnodes", "2", "--node-rank", str(node), "--master-addr", addr]
        argv[at:at] = ["--master-port", str(port)]
        argvs.append(argv)
    return argvs


def _run_all(starts: list[tuple[list[str], dict[str, str]]], logs: Path) -> None:
    procs = []
    try:
        for i, (argv, env) in enumerate(starts):
            procs.append(h.start(argv, env, logs / f"launcher{i}.txt"))
        codes = h.wait_all(procs, timeout=RUN_TIMEOUT)
        text = "\n".join(p.read_text() for p in sorted(logs.glob("launcher*.txt")))
        assert codes == [0] * len(procs), text[-4000:]
    finally:
        h.stop(procs)


def test_launch_nnodes_on_the_loopback(job: tuple[Path, Path], tmp_path: Path) -> None:
    # the README's multi-node recipe, both "nodes" on this machine: rank K*N+i gets its own
    # loopback device (issue 22, item 5), and no rendezvous directory needs exporting
    script, out = job
    env = h.loopback_env(PYNCCL_RENDEZVOUS_KEY=h.new_key())
    argvs = _two_nodes(script, out, "127.0.0.1", h.free_port())
    _run_all([(argv, env) for argv in argvs], tmp_path)
    _assert_job(out, 4, "pynccl")
    reports = {r["rank"]: r["device"] for r in _reports(out)}
    assert reports == {0: 0, 1: 1, 2: 2, 3: 3}  # global rank k on loopback device k


def test_launch_nnodes_on_the_loopback_across_namespaces(
    job: tuple[Path, Path], tmp_path: Path, namespaces: tuple[str, str]
) -> None:
    # each launcher in a network namespace of its own (abstract sockets do not cross):
    # without PYNCCL_LOOPBACK_RENDEZVOUS_DIR exported, the ranks still meet
    script, out = job
    env = h.loopback_env(PYNCCL_RENDEZVOUS_KEY=h.new_key())
    assert "PYNCCL_LOOPBACK_RENDEZVOUS_DIR" not in env
    argvs = _two_nodes(script, out, test_multihost.ADDRS[0], h.free_port())
    starts = [(["ip", "netns", "exec", ns, *argv], env) for ns, argv in zip(namespaces, argvs)]
    _run_all(starts, tmp_path)
    _assert_job(out, 4, "pynccl")


# -- no launcher: the caller says rank and size ----------------------------------------------------


def test_from_env_rank_world_size_store_in_separate_processes(job: tuple[Path, Path]) -> None:
    # as Ray actors or a process pool would: one GPU each, a store, no launcher variables
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0: the CPU wheel)")
    script, out = job
    port, n = h.free_port(), 3
    procs = []
    try:
        for r in range(n):
            env = h.loopback_env(CUDA_VISIBLE_DEVICES=str(r))
            argv = h.python(str(script), str(out), "store", str(r), str(n), str(port))
            procs.append(h.start(argv, env, out.parent / f"log{r}.txt"))
        codes = h.wait_all(procs, timeout=RUN_TIMEOUT)
    finally:
        h.stop(procs)
    assert codes == [0] * n, _reports(out)
    _assert_job(out, n, "none")


# -- a communicator cannot cross processes --------------------------------------------------------


def test_communicator_refuses_pickle_and_copy(solo_comm: Any) -> None:
    import copy

    from pynccl.comm import UniqueId

    for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError) as info:
            attempt(solo_comm)
        message = str(info.value)
        assert "cannot be pickled or copied" in message
        assert "UniqueId" in message and "Communicator(world_size, uid, rank)" in message
    uid = UniqueId()  # what to send instead does pickle
    assert pickle.loads(pickle.dumps(uid)) == uid
    x = np.ones(4, dtype=np.float32)
    from pynccl.cuda import DeviceBuffer

    buf = DeviceBuffer.from_numpy(x)
    solo_comm.all_reduce(buf)  # the communicator still works
    solo_comm.synchronize()
    np.testing.assert_array_equal(buf.to_numpy(), x)
    buf.close()
