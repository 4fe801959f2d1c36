"""Getting ranks together, end to end on the loopback libraries: separate processes,
``Communicator.from_env()``, real collectives checked against numpy on every rank.

* ``python -m pynccl launch -n N --loopback`` with 4 and 8 ranks;
* N processes started here with the environment of each launcher convention faked
  (torchrun, Open MPI, MPICH/Intel MPI, Slurm) and the TCP rendezvous;
* the file and key-value store rendezvous backends.

The worker is ``tests/support/workers/collectives.py``; every job must also leave no process
and no shared-memory segment behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.workers import _harness as h

CHECKS = {
    "all_reduce-sum-int64",
    "all_reduce-sum-float32",
    "all_reduce-max-int32-inplace",
    "all_gather",
    "send-recv-ring",
}


def _assert_job_ok(text: str, size: int, launcher: str) -> set[int]:
    """Every rank reported READY (the right launcher, world and device) and E2E-OK with
    every check; returns the ranks' pids."""
    ready = h.markers(text, "READY")
    ok = h.markers(text, "E2E-OK")
    assert h.markers(text, "FAIL") == {}, text
    assert sorted(ready) == list(range(size)), text
    assert sorted(ok) == list(range(size)), text
    for rank in range(size):
        assert ready[rank]["size"] == str(size)
        assert ready[rank]["launcher"] == launcher
        assert ready[rank]["device"] == str(rank)  # the local rank picks the device
        checks = set(ok[rank]["checks"].split(","))
        assert checks == CHECKS | {f"broadcast-root{size - 1}"}, ok[rank]
    return {int(ready[r]["pid"]) for r in ready}


def _shm(text: str) -> set[str]:
    return {
        name
        for fields in h.markers(text, "READY").values()
        for name in fields["shm"].split(",")
        if name != "-"
    }


# -- python -m pynccl launch (10 ranks: more than the loopback's default of 8 devices) --------


@pytest.mark.parametrize(
    "nproc, extra",
    [
        (4, {}),
        # small pipelining chunks and p2p rings: every collective crosses many chunks
        pytest.param(
            10,
            {"PYNCCL_LOOPBACK_CHUNK_BYTES": "65536", "PYNCCL_LOOPBACK_RING_BYTES": "32768"},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_launch_loopback_collectives(tmp_path: Path, nproc: int, extra: dict[str, str]) -> None:
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    env = h.loopback_env(**extra)
    args = ["--count", "100000"] if extra else []
    proc = h.start(h.launch(nproc, h.worker("collectives.py"), *args), env, out, err)
    pids: set[int] = set()
    try:
        (code,) = h.wait_all([proc])
        text = out.read_text()
        pids = {int(f["pid"]) for f in h.markers(text, "READY").values()}
        assert code == 0, f"{text}\n{err.read_text()}"
        # the launcher prefixes each line with its rank; markers() checks prefix == rank=
        assert all(line.startswith("[rank ") for line in text.splitlines()), text
        pids = _assert_job_ok(text, nproc, "pynccl")
        h.assert_nothing_running(pids | {proc.pid})
        h.assert_no_shm(_shm(text))
    finally:
        h.stop([proc], pids)


# -- from_env under each launcher's conventions ---------------------------------------------------

EnvMaker = Callable[[int, int, int], dict[str, str]]


def _torchrun(rank: int, size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "none",  # what torchrun sets without --rdzv-id
    }


def _openmpi(rank: int, size: int, port: int) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
        "MASTER_ADDR": "127.0.0.1",  # MPI launchers give no address: the user exports one
        "MASTER_PORT": str(port),
    }


def _mpich(rank: int, size: int, port: int) -> dict[str, str]:
    return {
        "PMI_RANK": str(rank),
        "PMI_SIZE": str(size),
        "MPI_LOCALRANKID": str(rank),
        "MPI_LOCALNRANKS": str(size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _slurm(rank: int, size: int, port: int) -> dict[str, str]:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(size),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": str(size),
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "localhost",  # the address is the list's first host
        "MASTER_PORT": str(port),
    }


def _without_address(make: EnvMaker) -> EnvMaker:
    def env(rank: int, size: int, port: int) -> dict[str, str]:
        return {k: v for k, v in make(rank, size, port).items() if not k.startswith("MASTER_")}

    return env


def _run_job(tmp_path: Path, make: EnvMaker, size: int, *args: str) -> tuple[list[int], list[str]]:
    """Run ``size`` collectives workers with the fake launcher environment ``make`` and
    one fresh job key; their exit codes and outputs."""
    port, key = h.free_port(), h.new_key()
    outs = [tmp_path / f"rank{r}.txt" for r in range(size)]
    procs = []
    try:
        for r in range(size):
            env = h.loopback_env(PYNCCL_RENDEZVOUS_KEY=key, **make(r, size, port))
            procs.append(h.start(h.python(h.worker("collectives.py"), *args), env, outs[r]))
        codes = h.wait_all(procs)
        texts = [o.read_text() for o in outs]
        h.assert_nothing_running(p.pid for p in procs)
        h.assert_no_shm(set().union(*map(_shm, texts)))
        return codes, texts
    finally:
        h.stop(procs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, make",
    [("torchrun", _torchrun), ("openmpi", _openmpi), ("mpich", _mpich), ("slurm", _slurm)],
)
def test_from_env_under_launcher_conventions(tmp_path: Path, launcher: str, make: EnvMaker) -> None:
    size = 3
    codes, texts = _run_job(tmp_path, make, size)
    assert codes == [0] * size, "\n".join(texts)
    _assert_job_ok("".join(texts), size, launcher)


def test_from_env_file_backend(tmp_path: Path) -> None:
    # Open MPI's variables carry no address: the id travels through a file instead.
    size = 3
    path = tmp_path / "shared" / "uid"
    path.parent.mkdir()
    codes, texts = _run_job(tmp_path, _without_address(_openmpi), size, "--file", str(path))
    assert codes == [0] * size, "\n".join(texts)
    _assert_job_ok("".join(texts), size, "openmpi")
    assert list(path.parent.iterdir()) == []  # rank 0 removed the file and the acks


@pytest.fixture
def kv_store() -> Iterator[tuple[str, dict[str, str]]]:
    """A running ``support/workers/kv_store.py`` server: (its AF_UNIX address, client env)."""
    directory = tempfile.mkdtemp(prefix="pn-kv-")  # short: socket paths have ~100 bytes
    address = os.path.join(directory, "sock")
    env = {"PYNCCL_TEST_STORE_AUTHKEY": h.new_key()}
    log = Path(directory) / "log.txt"
    proc = h.start(h.python(h.worker("kv_store.py"), address), {**os.environ, **env}, log)
    try:
        h.wait_for_output(log, lambda text: "READY" in text, timeout=30, procs=[proc])
        yield address, env
    finally:
        h.stop([proc])
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_from_env_store_backend(tmp_path: Path, kv_store: tuple[str, dict[str, str]]) -> None:
    # MPICH's variables and a key-value store reached over a Unix socket: no TCP at all.
    address, store_env = kv_store
    size = 3

    def make(rank: int, n: int, port: int) -> dict[str, str]:
        return {**_without_address(_mpich)(rank, n, port), **store_env}

    codes, texts = _run_job(tmp_path, make, size, "--store", address)
    assert codes == [0] * size, "\n".join(texts)
    _assert_job_ok("".join(texts), size, "mpich")


# -- the launcher SIGKILLed: no rank outlives it ---------------------------------------------------


def _kill_launcher_while_blocked(tmp_path: Path, phase: str) -> tuple[list[int], list[str]]:
    """Start 4 ranks of ``orphans.py --phase``, SIGKILL the launcher once they block (what a
    scheduler does: the launcher cannot pass it on), wait 2 s; the ranks and the children
    they started still alive, and the loopback segments they had mapped still in /dev/shm."""
    size = 4
    out = tmp_path / "out.txt"
    proc = h.start(h.launch(size, h.worker("orphans.py"), "--phase", phase), h.loopback_env(), out)
    pids: set[int] = set()
    try:
        text = h.wait_for_output(out, lambda t: len(h.markers(t, "READY")) == size, procs=[proc])
        ready = h.markers(text, "READY").values()
        pids = {int(f["pid"]) for f in ready}
        children = {int(f["child"]) for f in ready}
        time.sleep(0.5)  # from READY into the blocking call
        segments = set().union(*(h.mapped_shm(p) for p in pids))
        if phase != "rendezvous":
            assert segments, f"the ranks map no loopback segment: no {phase} happened\n{text}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(h.alive(p) for p in pids | children):
            time.sleep(0.02)
        alive = sorted(p for p in pids | children if h.alive(p))
        return alive, sorted(s for s in segments if os.path.exists(f"/dev/shm/{s}"))
    finally:
        h.stop([proc], pids)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["rendezvous", "init", "collective"])
def test_ranks_die_with_a_killed_launcher(tmp_path: Path, phase: str) -> None:
    alive, segments = _kill_launcher_while_blocked(tmp_path, phase)
    assert alive == [], "ranks or their children outlived the launcher by 2 s"
    assert segments == [], "shared memory left in /dev/shm"
