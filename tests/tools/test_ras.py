"""NCCL's RAS: the pure-Python client (pynccl.ras, ``python -m pynccl ras``) against the
loopback libnccl's RAS listener, which answers NCCL's protocol with NCCL's fields.

The reference is NCCL 2.30.7's ``src/ras/client_support.cc``: the handshake lines, the JSON
keys (communicators[].ranks[] / missing_ranks[] / status.considered_dead), and the text
report's "Rank N -- GPU G managed by process P on node H" lines under INCOMPLETE.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from support import ROOT
from support.workers._harness import free_port

from pynccl import ras

# One rank (argv: rank, uid, N): join an N-rank communicator, run 3 all_reduce and 1
# broadcast, say "ready", then wait for a line on stdin before destroying the communicator.
_RANK = r"""
import sys
import numpy as np
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer
rank, uid = int(sys.argv[1]), UniqueId.from_bytes(bytes.fromhex(sys.argv[2]))
comm = Communicator(int(sys.argv[3]), uid, rank, device=rank)
buf = DeviceBuffer.from_numpy(np.ones(16, np.float32), device=rank)
for _ in range(3):
    comm.all_reduce(buf, buf, op="sum")
comm.broadcast(buf, buf, root=0)
comm.synchronize()
print("ready", flush=True)
sys.stdin.readline()
comm.destroy()
"""


def _pynccl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pynccl", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
        cwd=ROOT,
    )


@contextlib.contextmanager
def _ranks(env: dict[str, str], n: int) -> Iterator[list[subprocess.Popen[str]]]:
    """n rank processes of one communicator, each ready (its collectives done)."""
    code = "from pynccl.comm import UniqueId; print(UniqueId().hex())"
    uid = subprocess.run(
        [sys.executable, "-c", code], env=env, text=True, capture_output=True, check=True,
        timeout=120,
    ).stdout.strip()  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), uid, str(n)],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for r in range(n)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()


@pytest.fixture()
def job(lb_env: dict[str, str]) -> Iterator[tuple[list[subprocess.Popen[str]], dict[str, str]]]:
    """A 4-process loopback job whose ranks all listen for RAS on one free port."""
    port = free_port()
    env = {**lb_env, "NCCL_RAS_ADDR": f"127.0.0.1:{port}", "PYNCCL_RAS_TEST_PORT": str(port)}
    with _ranks(env, 4) as procs:
        yield procs, env


def _kill(p: subprocess.Popen[str]) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)


@pytest.mark.slow
def test_json_names_the_killed_rank(job: Any) -> None:
    procs, env = job
    where = f"127.0.0.1:{env['PYNCCL_RAS_TEST_PORT']}"
    healthy = ras.status(where, timeout=2)
    assert healthy.nccl_version == "2.32.3"
    (comm,) = healthy.communicators
    assert comm.size == 4 and not comm.missing_ranks
    assert sorted(r.rank for r in comm.ranks) == [0, 1, 2, 3]
    assert {r.rank: r.pid for r in comm.ranks} == {i: p.pid for i, p in enumerate(procs)}
    for r in comm.ranks:  # NCCL's five counted functions, in ncclFunc_t order
        assert list(r.collective_counts) == [
            "Broadcast",
            "Reduce",
            "AllGather",
            "ReduceScatter",
            "AllReduce",
        ]
        assert r.collective_counts["AllReduce"] == 3 and r.collective_counts["Broadcast"] == 1
    dead_pid = procs[2].pid
    _kill(procs[2])
    out = _pynccl("ras", where, "--json", "--timeout", "2", env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["summary"].splitlines()[0] == doc["summary"]
    assert f"rank 2 (pid {dead_pid} on 127.0.0.1, considered dead)" in doc["summary"]
    (raw,) = doc["status"]["communicators"]
    assert raw["size"] == 4 and raw["ranks_count"] == 3 and raw["missing_ranks_count"] == 1
    assert sorted(r["rank"] for r in raw["ranks"]) == [0, 1, 3]
    (gone,) = raw["missing_ranks"]
    assert gone["rank"] == 2 and gone["pid"] == dead_pid and gone["host"] == "127.0.0.1"
    assert gone["status"] == {"unresponsive": True, "considered_dead": True}
    assert doc["missing"] == [
        {
            "communicator": raw["hash"],
            "rank": 2,
            "host": "127.0.0.1",
            "pid": dead_pid,
            "cuda_dev": 2,
            "nvml_dev": 2,
            "unresponsive": True,
            "considered_dead": True,
        }
    ]
    for p in procs:
        if p.poll() is None:
            p.stdin.write("done\n")
            p.stdin.flush()


@pytest.mark.slow
def test_text_report_names_the_killed_rank_first(job: Any) -> None:
    procs, env = job
    where = f"127.0.0.1:{env['PYNCCL_RAS_TEST_PORT']}"
    dead_pid = procs[1].pid
    _kill(procs[1])
    out = _pynccl("ras", where, env=env)
    assert out.returncode == 0, out.stderr
    first, blank, *report = out.stdout.splitlines()
    assert (
        first == f"RAS at {where}; missing: rank 1 (pid {dead_pid} on 127.0.0.1, considered dead)"
    )
    assert blank == ""
    text = "\n".join(report)
    assert "Job summary\n===========" in text and "\nErrors\n======" in text
    assert f"  Rank 1 -- GPU 1 managed by process {dead_pid} on node 127.0.0.1" in text
    assert f"  Process {dead_pid} on node 127.0.0.1 managing GPU 1" in text


def test_refused_connection_says_nothing_listens() -> None:
    port = free_port()
    with pytest.raises(
        ras.RasError, match=rf"no RAS listening at 127\.0\.0\.1:{port}; NCCL >= 2\.24"
    ):
        ras.query(f"127.0.0.1:{port}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = _pynccl("ras", f"127.0.0.1:{port}", "--json", env=env)
    assert out.returncode == 1 and out.stdout == ""
    assert f"no RAS listening at 127.0.0.1:{port}" in out.stderr


def test_bad_address_and_timeout_are_named() -> None:
    with pytest.raises(ValueError, match="port 70000 is not in 1-65535"):
        ras.parse_address("h:70000")
    with pytest.raises(ValueError, match=r"'a:b:c'.*HOST\[:PORT\]"):
        ras.parse_address("a:b:c")
    assert ras.parse_address(None) == ("localhost", 28028)
    bad = _pynccl("ras", "a:b:c", env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode == 2 and "RAS address 'a:b:c'" in bad.stderr
    assert ras.parse_address("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError, match="timeout -1"):
        ras.query("127.0.0.1:1", timeout=-1)


def test_not_ras_is_named() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]

        def answer() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.recv(100)
                conn.sendall(b"HTTP/1.1 400 Bad Request\n")

        import threading

        t = threading.Thread(target=answer)
        t.start()
        try:
            with pytest.raises(
                ras.RasError, match=r"is not NCCL's RAS: it answered 'HTTP/1\.1 400"
            ):
                ras.query(f"127.0.0.1:{port}", timeout=1)
        finally:
            t.join(timeout=10)


def test_parse_status_reads_ncclras_json() -> None:
    # The shape NCCL 2.28.7 wrote (no status object on missing ranks yet).
    doc = {
        "nccl_version": "2.28.7",
        "cuda_runtime_version": 12080,
        "cuda_driver_version": 12080,
        "timestamp": "2026-01-01 00:00:00",
        "communicators_count": 1,
        "communicators": [
            {
                "hash": "0x1f",
                "secondary_hash": "0x2:0x3",
                "size": 2,
                "ranks_count": 1,
                "missing_ranks_count": 1,
                "ranks": [
                    {
                        "rank": 0,
                        "host": "10.0.0.1",
                        "pid": 11,
                        "cuda_dev": 0,
                        "nvml_dev": 0,
                        "status": {
                            "init_state": 0,
                            "async_error": 0,
                            "finalize_called": False,
                            "destroy_flag": False,
                            "abort_flag": False,
                        },
                        "collective_counts": {
                            "Broadcast": 0,
                            "Reduce": 0,
                            "AllGather": 0,
                            "ReduceScatter": 0,
                            "AllReduce": 7,
                        },
                    }
                ],
                "missing_ranks": [
                    {"rank": 1, "host": "10.0.0.2", "pid": 12, "cuda_dev": 1, "nvml_dev": 1}
                ],
            }
        ],
        "ras": {"collection_time_sec": 0.5, "timeouts_count": 1},
    }
    st = ras.parse_status(json.dumps(doc))
    ((comm, gone),) = st.missing()
    assert comm.hash == "0x1f" and gone.rank == 1 and gone.considered_dead is None
    assert st.communicators[0].ranks[0].collective_counts["AllReduce"] == 7
    assert st.summary("h:1") == (
        "RAS at h:1 (NCCL 2.28.7): 1 communicator; missing: rank 1 "
        "(pid 12 on 10.0.0.2) of communicator 0x1f (2 ranks)"
    )
    with pytest.raises(ras.RasError, match="not a RAS JSON report"):
        ras.parse_status("NCCL version 2.30.7\n")
    text = (
        "#0-0 (00000000000000ab) INCOMPLETE\n  Missing communicator data from 2 ranks\n"
        "  Rank 3 -- GPU 5 managed by process 77 on node 10.1.1.1\n"
        "  Rank 4 -- [process information not found]\n\n"
    )
    assert ras.missing_from_text(text) == [(3, 77, "10.1.1.1", False), (4, -1, "unknown", False)]


def test_ranks_of_one_communicator_in_one_process_are_one_communicator(
    lb_env: dict[str, str],
) -> None:
    port = free_port()
    code = (
        "from pynccl.comm import Communicator\nfrom pynccl import ras\n"
        "cs = Communicator.init_all(3)\n"
        f"st = ras.status('127.0.0.1:{port}'); text = ras.query('127.0.0.1:{port}')\n"
        "[c.destroy() for c in cs]\n"
        "print([(len(c.ranks), c.size) for c in st.communicators])\n"
        "print(text.split('Job summary')[1].splitlines()[5].split())\n"
    )
    env = {**lb_env, "NCCL_RAS_ADDR": f"127.0.0.1:{port}"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    comms, summary = out.stdout.splitlines()
    assert comms == "[(3, 3)]"
    # nodes, processes per node, GPUs per process, processes, GPUs
    assert summary == "['1', '1', '3', '1', '3']"


def test_listener_thread_lives_with_the_communicators(lb_env: dict[str, str]) -> None:
    """One thread and one listening socket from the first init; both gone at the last destroy,
    and back with the next init (NCCL_RAS_ENABLE=0: never)."""
    code = (
        "import os, socket\n"
        "from pynccl.comm import Communicator\n"
        "def seen():\n"
        "    s = socket.socket(); r = s.connect_ex(('127.0.0.1', PORT)); s.close()\n"
        "    return len(os.listdir('/proc/self/task')), r == 0\n"
        "out = [seen()]\n"
        "a, b = Communicator.init_all(2); out.append(seen())\n"
        "a.destroy(); out.append(seen()); b.destroy(); out.append(seen())\n"
        "(c,) = Communicator.init_all(1); out.append(seen()); c.destroy(); out.append(seen())\n"
        "print(out)\n"
    )
    for enable, extra in (("1", 1), ("0", 0)):
        port = free_port()
        env = {**lb_env, "NCCL_RAS_ADDR": f"127.0.0.1:{port}", "NCCL_RAS_ENABLE": enable}
        out = subprocess.run(
            [sys.executable, "-c", code.replace("PORT", str(port))],
            env=env,
            text=True,
            capture_output=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        seen = ast.literal_eval(out.stdout)
        base = seen[0][0]
        on = (base + extra, bool(extra))
        assert seen == [(base, False), on, on, (base, False), on, (base, False)], seen


def test_ras_disabled_or_old_release_listens_nowhere(lb_env: dict[str, str]) -> None:
    port = free_port()
    code = (
        "import sys, socket\nfrom pynccl.comm import Communicator\n"
        "c = Communicator.init_all(1)[0]\n"
        f"s = socket.socket(); r = s.connect_ex(('127.0.0.1', {port})); s.close()\n"
        "c.destroy(); print(r != 0)\n"
    )
    env = {**lb_env, "NCCL_RAS_ADDR": f"127.0.0.1:{port}", "NCCL_RAS_ENABLE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=120
    )
    assert out.stdout.strip() == "True", out.stderr
    env.pop("NCCL_RAS_ENABLE")
    env["NCCL_DEBUG"] = "INFO"  # NCCL's INIT line for the listener
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=120
    )
    lines = out.stdout.splitlines()
    assert lines[-1] == "False", out.stderr
    info = (out.stdout + out.stderr).splitlines()
    listening = [ln for ln in info if " NCCL INFO RAS client listening socket at " in ln]
    assert len(listening) == 1 and listening[0].endswith(f" at 127.0.0.1:{port}"), info


@pytest.mark.slow
@pytest.mark.parametrize(
    ("version", "listens", "has_json"),
    [("2.23.4", False, False), ("2.28.3", True, False), ("2.28.7", True, True)],
)
def test_what_each_release_answers(version: str, listens: bool, has_json: bool) -> None:
    """RAS from NCCL 2.24; JSON ("SET FORMAT json") from 2.28.7."""
    from pynccl.testing import loopback

    port = free_port()
    env = {**os.environ, **loopback.env(version), "NCCL_RAS_ADDR": f"127.0.0.1:{port}"}
    env["PYTHONPATH"] = str(ROOT)
    code = (
        "import json, sys\nfrom pynccl.comm import Communicator\nfrom pynccl import ras\n"
        "cs = Communicator.init_all(2)\nout = {}\n"
        "for fmt in (False, True):\n"
        "    try:\n"
        f"        out[fmt] = ras.query('127.0.0.1:{port}', json_format=fmt)\n"
        "    except ras.RasError as e:\n"
        "        out[fmt] = 'RasError: ' + str(e)\n"
        "[c.destroy() for c in cs]\nprint(json.dumps([out[False], out[True]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    text, doc = json.loads(proc.stdout)
    if not listens:
        assert text.startswith(f"RasError: no RAS listening at 127.0.0.1:{port}")
        return
    assert text.startswith(f"NCCL version {version} ")
    if not has_json:
        assert doc.startswith("RasError: RAS at 127.0.0.1:")
        assert "has no JSON output (NCCL >= 2.28.7 has): it answered 'ERROR: Unknown command" in doc
        return
    st = ras.parse_status(doc)
    assert st.nccl_version == version and not st.missing()


def test_a_forked_child_does_not_keep_the_port(lb_env: dict[str, str]) -> None:
    """After fork, only the parent listens: once its last communicator is destroyed the port
    refuses connections (a child holding the socket would queue them where nobody accepts)."""
    port = free_port()
    code = (
        "import os, socket, time\nfrom pynccl.comm import Communicator\n"
        "(c,) = Communicator.init_all(1)\nr, w = os.pipe()\npid = os.fork()\n"
        "if pid == 0:\n    os.close(w); os.read(r, 1); os._exit(0)\n"
        "c.destroy()\n"
        f"s = socket.socket(); refused = s.connect_ex(('127.0.0.1', {port})) != 0; s.close()\n"
        "os.write(w, b'x'); os.waitpid(pid, 0); print(refused)\n"
    )
    env = {**lb_env, "NCCL_RAS_ADDR": f"127.0.0.1:{port}"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


@pytest.mark.slow
@pytest.mark.parametrize(("version", "status"), [("2.28.7", False), ("2.28.9", True)])
def test_missing_ranks_status_object_since_2_28_9(version: str, status: bool) -> None:
    """NCCL 2.28.7's missing_ranks entries end at nvml_dev; 2.28.9 adds status{unresponsive,
    considered_dead}: the client reads both (None where not reported)."""
    from pynccl.testing import loopback

    port = free_port()
    env = {**os.environ, **loopback.env(version), "NCCL_RAS_ADDR": f"127.0.0.1:{port}"}
    env["PYTHONPATH"] = str(ROOT)
    with _ranks(env, 2) as procs:
        _kill(procs[1])
        doc = ras.query(f"127.0.0.1:{port}", json_format=True)
    (comm,) = json.loads(doc)["communicators"]
    (gone,) = comm["missing_ranks"]
    assert gone["rank"] == 1 and gone["pid"] == procs[1].pid
    assert ("status" in gone) == status
    ((_, missing),) = ras.parse_status(doc).missing()
    assert missing.considered_dead == (True if status else None)
