"""A job whose ranks live on two hosts: two network namespaces joined by a veth pair.

Host A is ``169.254.123.1``, host B ``169.254.123.2``: a link-local /30 that exists only
between the two namespaces (never a private 10.x, 172.16-31.x or 192.168.x range). Two
ranks run in each; the rendezvous crosses the veth link, with ``MASTER_ADDR`` the other
namespace's address for host B's ranks. Three ways to start the job: ``python -m pynccl
launch --nnodes 2`` (one launcher per host), and processes started with Slurm's and
torchrun's variables. Every collective is checked against numpy on every rank
(``support/workers/multihost.py``).

The loopback libnccl's ranks still meet on this machine (through a socket file in
``PYNCCL_LOOPBACK_RENDEZVOUS_DIR``; the namespaces share the file system): what this tests
is pynccl's launcher and rendezvous over a real network. Needs root and ``ip``; skipped,
saying why, where namespaces cannot be made.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.workers import _harness as h

#: Real tools / network namespaces: among the slow tests (.ci/run runs them after the quick run).
pytestmark = pytest.mark.slow

ADDRS = ("169.254.123.1", "169.254.123.2")
NPROC, NNODES = 2, 2
SIZE = NPROC * NNODES
CHECKS = {
    "all_reduce-sum",
    "all_reduce-max",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "send-recv-ring",
}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[tuple[str, str]]:
    """Two fresh network namespaces joined by a veth pair; removed afterwards, whatever
    happened (deleting a namespace deletes its end of the pair, and the pair with it)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make network namespaces with")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    tag = secrets.token_hex(3)
    names = (f"pynccl-{tag}-a", f"pynccl-{tag}-b")
    links = (f"pn{tag}a", f"pn{tag}b")  # interface names: at most 15 characters
    made: list[str] = []
    try:
        for ns in names:
            try:
                _ip("netns", "add", ns)
            except subprocess.CalledProcessError as e:
                pytest.skip(f"cannot make a network namespace here: {e.stderr.strip()}")
            made.append(ns)
        try:
            _ip("link", "add", links[0], "netns", names[0], "type", "veth",
                "peer", "name", links[1], "netns", names[1])  # fmt: skip
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot make a veth pair here: {e.stderr.strip()}")
        for ns, link, addr in zip(names, links, ADDRS):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(ns in left for ns in names), f"namespaces left behind: {left}"


def _netns_inode(ns: str) -> int:
    return os.stat(f"/run/netns/{ns}").st_ino


def _check(texts: list[str], launcher: str, hosts: tuple[str, str]) -> None:
    text = "\n".join(texts)
    assert h.markers(text, "FAIL") == {}, text
    ready, ok = h.markers(text, "READY"), h.markers(text, "E2E-OK")
    assert sorted(ready) == sorted(ok) == list(range(SIZE)), text
    inodes = [_netns_inode(ns) for ns in hosts]
    for rank in range(SIZE):
        node, local = divmod(rank, NPROC)
        assert ready[rank]["launcher"] == launcher, ready[rank]
        assert ready[rank]["local"] == str(local), ready[rank]
        assert ready[rank]["netns"] == str(inodes[node]), "a rank ran on the wrong host"
        assert set(ok[rank]["checks"].split(",")) == CHECKS, ok[rank]
    pids = {int(f["pid"]) for f in ready.values()}
    h.assert_nothing_running(pids)
    h.assert_no_shm({s for f in ready.values() for s in f["shm"].split(",") if s != "-"})


def _run(
    tmp_path: Path, hosts: tuple[str, str], argvs: list[tuple[int, list[str], dict[str, str]]]
) -> list[str]:
    """Start each ``(host index, argv, extra env)`` in its namespace; their outputs."""
    outs = [tmp_path / f"out{i}.txt" for i in range(len(argvs))]
    procs = []
    # The loopback libnccl's ranks meet through a unix socket; an abstract one is private to
    # its network namespace, so the two "hosts" meet in a directory they share.
    rendezvous = tempfile.mkdtemp(prefix="pynccl-rv-", dir="/tmp")
    try:
        for out, (node, argv, extra) in zip(outs, argvs):
            env = h.loopback_env(**extra, PYNCCL_LOOPBACK_RENDEZVOUS_DIR=rendezvous)
            procs.append(h.start(["ip", "netns", "exec", hosts[node], *argv], env, out))
        codes = h.wait_all(procs)
        texts = [out.read_text() for out in outs]
        assert codes == [0] * len(procs), "\n".join(texts)
        assert os.listdir(rendezvous) == [], "a rendezvous socket was left behind"
        return texts
    finally:
        h.stop(procs)
        shutil.rmtree(rendezvous, ignore_errors=True)


def test_launch_nnodes(tmp_path: Path, hosts: tuple[str, str]) -> None:
    # one launcher per host, as a user runs it: the same command but --node-rank
    key = {"PYNCCL_RENDEZVOUS_KEY": h.new_key()}
    worker = h.worker("multihost.py")
    jobs = []
    for node in range(NNODES):
        argv = h.launch(NPROC, worker)
        argv[argv.index("launch") + 1 : argv.index("launch") + 1] = [
            "--nnodes", str(NNODES), "--node-rank", str(node), "--master-addr", ADDRS[0],
        ]  # fmt: skip
        jobs.append((node, argv, key))  # --master-port: torchrun's default, 29500
    _check(_run(tmp_path, hosts, jobs), "pynccl", hosts)


EnvMaker = Callable[[int, int, int], dict[str, str]]


def _slurm(rank: int, node: int, local: int) -> dict[str, str]:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(SIZE),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURM_NNODES": str(NNODES),
        "SLURM_TASKS_PER_NODE": f"{NPROC}(x{NNODES})",
        "SLURM_JOB_ID": "4243",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "hosta,hostb",
        "MASTER_ADDR": ADDRS[0],  # the node list's names resolve nowhere: the address given
        "MASTER_PORT": "29512",
    }


def _torchrun(rank: int, node: int, local: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(SIZE),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(NPROC),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": ADDRS[0],
        "MASTER_PORT": "29513",
        "TORCHELASTIC_RUN_ID": "none",
    }


@pytest.mark.parametrize("launcher, make", [("slurm", _slurm), ("torchrun", _torchrun)])
def test_launcher_conventions(
    tmp_path: Path, hosts: tuple[str, str], launcher: str, make: EnvMaker
) -> None:
    key = h.new_key()
    jobs = []
    for rank in range(SIZE):
        node, local = divmod(rank, NPROC)
        extra = {**make(rank, node, local), "PYNCCL_RENDEZVOUS_KEY": key}
        jobs.append((node, h.python(h.worker("multihost.py")), extra))
    _check(_run(tmp_path, hosts, jobs), launcher, hosts)
