"""``python -m pynccl launch``: environment, output prefixes, exit codes, signals, no leftovers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest
from support import ROOT as _ROOT

import pynccl.launch as launch
from pynccl.bootstrap import detect_launch_env

ROOT = str(_ROOT)  # the repository, as subprocess arguments take it
HANG = 120  # seconds after which a launcher run counts as hung


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PYNCCL_", "CUDA_VIS"))
    }
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _launch(args, *, env=None, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pynccl", "launch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=HANG,
        env=env or _env(),
        cwd=ROOT,
        **kw,
    )


def _script(tmp_path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(
        "import os, signal, subprocess, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        f"OUT = {str(tmp_path)!r}\n" + textwrap.dedent(body)
    )
    return str(path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie re-parented to init is dead


def _assert_all_gone(pids) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    assert [p for p in pids if _alive(p)] == []


def _pids(tmp_path) -> list[int]:
    return [int(p.read_text()) for p in tmp_path.glob("pid-*")]


# -- environment and output ---------------------------------------------------------------------

ENV_SCRIPT = """
    import json
    from pynccl.bootstrap import detect_launch_env
    e = detect_launch_env()
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "PYNCCL_RENDEZVOUS_KEY", "PYNCCL_LAUNCHER", "CUDA_VISIBLE_DEVICES"]
    print(json.dumps({k: os.environ.get(k) for k in keys} | {"launcher": e.launcher}))
    print(f"to stderr {rank}", file=sys.stderr)
    sys.stdout.write(f"no newline at the end {rank}")
"""


def test_environment_and_prefixes(tmp_path):
    import json

    out = _launch(["-n", 3, _script(tmp_path, ENV_SCRIPT), "--not-a-launcher-option"])
    assert out.returncode == 0, out.stderr
    envs, tails = {}, {}
    for line in out.stdout.splitlines():
        m = re.fullmatch(r"\[rank (\d+)\] (.*)", line)
        assert m, line
        rank, text = int(m.group(1)), m.group(2)
        if text.startswith("{"):
            envs[rank] = json.loads(text)
        else:
            tails[rank] = text
    assert tails == {r: f"no newline at the end {r}" for r in range(3)}
    assert sorted(out.stderr.splitlines()) == [f"[rank {r}] to stderr {r}" for r in range(3)]
    for r, e in envs.items():
        assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == (
            str(r),
            "3",
            str(r),
            "3",
        )
        assert (e["MASTER_ADDR"], e["PYNCCL_LAUNCHER"], e["launcher"]) == (
            "127.0.0.1",
            "pynccl",
            "pynccl",
        )
        assert e["CUDA_VISIBLE_DEVICES"] is None
    assert sorted(envs) == [0, 1, 2]
    assert len({e["MASTER_PORT"] for e in envs.values()}) == 1
    keys = {e["PYNCCL_RENDEZVOUS_KEY"] for e in envs.values()}
    assert len(keys) == 1 and re.fullmatch(r"[0-9a-f]{64}", keys.pop())


@pytest.mark.slow
def test_fresh_key_and_port_per_launch(tmp_path):
    script = _script(
        tmp_path,
        "print(os.environ['PYNCCL_RENDEZVOUS_KEY'], os.environ['MASTER_PORT'])\n",
    )
    a = _launch(["-n", 1, script]).stdout
    b = _launch(["-n", 1, script]).stdout
    assert a.split()[2] != b.split()[2]  # the keys


@pytest.mark.slow
def test_lines_never_interleave(tmp_path):
    script = _script(
        tmp_path,
        """
        for i in range(300):
            print(f"{rank} " + str(rank) * (i * 37 % 5000))
        """,
    )
    out = _launch(["-n", 4, script])
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert len(lines) == 1200
    for line in lines:
        m = re.fullmatch(r"\[rank (\d)\] (\d) (\d*)", line)
        assert m and m.group(1) == m.group(2) and set(m.group(3)) <= {m.group(1)}, line[:80]


def test_module_mode_and_devices(tmp_path):
    (tmp_path / "mymod.py").write_text(
        "import os, sys\nprint(os.environ['CUDA_VISIBLE_DEVICES'], sys.argv[1:])\n"
    )
    env = _env(PYTHONPATH=str(tmp_path) + os.pathsep + ROOT)
    out = _launch(["-n", 2, "--devices", "3,1", "-m", "mymod", "-x", "y"], env=env)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [
        "[rank 0] 3,1 ['-x', 'y']",
        "[rank 1] 3,1 ['-x', 'y']",
    ]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["-n", 2], "nothing to run"),
        (["-n", 0, "x.py"], "at least one rank"),
        (["-n", 2, "--devices", "0", "x.py"], "lists 1 device(s) but -n is 2"),
        (["-n", 2, "--devices", "0,0", "x.py"], "twice"),
        (["-n", 2, "--devices", "0,gpu", "x.py"], "'gpu'"),
        (["-n", 2, "--grace", "-1", "x.py"], "--grace"),
        (["x.py"], "required"),
    ],
)
def test_usage_errors(args, words):
    out = _launch(args)
    assert out.returncode == 2
    assert words in out.stderr


def test_main_help_returns_zero(capsys):
    assert launch.main(["--help"]) == 0
    assert "-n N" in capsys.readouterr().out


# -- failures -----------------------------------------------------------------------------------

FAIL_SCRIPT = """
    open(os.path.join(OUT, f"pid-{rank}"), "w").write(str(os.getpid()))
    if rank == 0:
        # a grandchild in the rank's process group
        child = subprocess.Popen(["sleep", "600"])
        open(os.path.join(OUT, "pid-grandchild"), "w").write(str(child.pid))
    if rank == 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # needs SIGKILL
    print("ready", flush=True)
    if rank == 1:
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(600)
"""


@pytest.mark.slow
def test_failing_rank_stops_the_others(tmp_path):
    out = _launch(["-n", 3, "--grace", 1, _script(tmp_path, FAIL_SCRIPT)])
    assert out.returncode == 3
    assert "rank 1 failed (exit code 3); stopping the other ranks" in out.stderr
    assert "0: killed by SIGTERM" in out.stderr
    assert "2: killed by SIGKILL" in out.stderr
    pids = _pids(tmp_path)
    assert len(pids) == 4
    _assert_all_gone(pids)


@pytest.mark.slow
def test_rank_killed_by_a_signal(tmp_path):
    script = _script(
        tmp_path,
        """
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
        """,
    )
    out = _launch(["-n", 2, "--grace", 1, script])
    assert out.returncode == 128 + signal.SIGKILL
    assert "rank 1 failed (killed by SIGKILL)" in out.stderr


@pytest.mark.slow
def test_timeout(tmp_path):
    out = _launch(["-n", 2, "--timeout", 1, "--grace", 1, _script(tmp_path, "time.sleep(600)")])
    assert out.returncode == 124
    assert "timed out after 1 s" in out.stderr


def test_grandchildren_of_successful_ranks_are_stopped(tmp_path):
    script = _script(
        tmp_path,
        """
        child = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL)
        open(os.path.join(OUT, f"pid-{rank}"), "w").write(str(child.pid))
        """,
    )
    out = _launch(["-n", 2, "--grace", 1, script])
    assert out.returncode == 0
    pids = _pids(tmp_path)
    assert len(pids) == 2
    _assert_all_gone(pids)


# -- signals to the launcher --------------------------------------------------------------------

SIGNAL_SCRIPT = """
    open(os.path.join(OUT, f"pid-{rank}"), "w").write(str(os.getpid()))
    def on_signal(sig, frame):
        print(f"rank {rank} got {signal.Signals(sig).name}", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded(tmp_path, sig):
    n = 3
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pynccl",
            "launch",
            "-n",
            str(n),
            "--grace",
            "5",
            _script(tmp_path, SIGNAL_SCRIPT),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        ready = 0
        assert proc.stdout is not None
        while ready < n:
            line = proc.stdout.readline()
            assert line, "launcher ended early"
            ready += line.endswith("ready\n")
        proc.send_signal(sig)
        rest, err = proc.communicate(timeout=HANG)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig
    name = signal.Signals(sig).name
    assert sorted(rest.splitlines()) == [f"[rank {r}] rank {r} got {name}" for r in range(n)]
    assert f"received {name}" in err
    _assert_all_gone(_pids(tmp_path))


# -- --loopback, in process, with a stand-in for the loopback package ---------------------------


def test_loopback_environment(tmp_path, monkeypatch, capfd):
    module = types.ModuleType("pynccl.testing.loopback")
    module.env = lambda version=None, null=False, sanitize=False: {"PYNCCL_FAKE_LB": "on"}
    monkeypatch.setitem(sys.modules, "pynccl.testing.loopback", module)
    monkeypatch.setenv("PYTHONPATH", ROOT)
    script = _script(tmp_path, "print(os.environ.get('PYNCCL_FAKE_LB'))\n")
    fds = len(os.listdir("/proc/self/fd"))
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert launch.main(["-n", "2", "--loopback", script]) == 0
    assert len(os.listdir("/proc/self/fd")) == fds  # pipes and wake-up sockets closed
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    assert sorted(capfd.readouterr().out.splitlines()) == ["[rank 0] on", "[rank 1] on"]


def test_loopback_failure_is_a_usage_error(monkeypatch, capfd):
    module = types.ModuleType("pynccl.testing.loopback")

    def broken(**_):
        raise OSError("no C compiler")

    module.env = broken
    monkeypatch.setitem(sys.modules, "pynccl.testing.loopback", module)
    assert launch.main(["-n", "1", "--loopback", "x.py"]) == 2
    assert "--loopback: could not prepare the loopback libraries: OSError: no C compiler" in (
        capfd.readouterr().err
    )


def test_split_keeps_script_options():
    assert launch._split(["-n", "2", "s.py", "-n", "5"]) == (["-n", "2"], ["s.py", "-n", "5"])
    assert launch._split(["-n2", "-m", "mod", "--x"]) == (["-n2", "-m", "mod"], ["--x"])
    assert launch._split(["-n", "1", "--", "-weird.py"]) == (["-n", "1"], ["-weird.py"])


def test_children_detect_the_pynccl_convention(monkeypatch):
    monkeypatch.delenv("PYNCCL_RENDEZVOUS_KEY", raising=False)
    opts = launch._parser().parse_args(["-n", "2"])
    env, warnings = launch._child_envs(opts, ["0", "1"], "127.0.0.1", 12345)
    detected = [detect_launch_env(e) for e in env]
    assert [(d.launcher, d.rank, d.world_size, d.master_port) for d in detected] == [
        ("pynccl", 0, 2, 12345),
        ("pynccl", 1, 2, 12345),
    ]
    assert warnings == [] and len({e["PYNCCL_RENDEZVOUS_KEY"] for e in env}) == 1


@pytest.mark.parametrize("key", [None, "node-shared-secret"])
def test_multinode_ranks_and_key(monkeypatch, key):
    # torchrun's numbering: node K of M with N ranks each runs ranks K*N .. K*N+N-1
    if key is None:
        monkeypatch.delenv("PYNCCL_RENDEZVOUS_KEY", raising=False)
    else:
        monkeypatch.setenv("PYNCCL_RENDEZVOUS_KEY", key)
    opts = launch._parser().parse_args(["--nnodes", "3", "--node_rank", "2", "-n", "2"])
    env, warnings = launch._child_envs(opts, None, "169.254.1.3", 29500)
    got = [
        (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"])
        for e in env
    ]
    assert got == [("4", "6", "0", "2", "2"), ("5", "6", "1", "2", "2")]
    detected = [detect_launch_env(e) for e in env]
    assert [
        (d.rank, d.world_size, d.local_rank, d.master_addr, d.master_port) for d in detected
    ] == [
        (4, 6, 0, "169.254.1.3", 29500),
        (5, 6, 1, "169.254.1.3", 29500),
    ]
    if key is None:  # no secret the nodes could share: unauthenticated, and said so
        assert all("PYNCCL_RENDEZVOUS_KEY" not in e for e in env)
        assert len(warnings) == 1 and "PYNCCL_RENDEZVOUS_KEY is not set" in warnings[0]
    else:
        assert [e["PYNCCL_RENDEZVOUS_KEY"] for e in env] == [key, key] and warnings == []


def test_multinode_without_a_key_warns(tmp_path):
    script = _script(tmp_path, "print(os.environ['RANK'], os.environ['WORLD_SIZE'])\n")
    args = ["--nnodes", 2, "--node-rank", 1, "--master-addr", "127.0.0.1", "-n", 2, script]
    out = _launch(args)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank 2] 2 4", "[rank 3] 3 4"]
    assert "warning: PYNCCL_RENDEZVOUS_KEY is not set" in out.stderr
    # 127.0.0.1 is fine for nodes that are all this machine, but not what a cluster wants
    assert "warning: --master-addr 127.0.0.1 is a loopback address here" in out.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--nnodes", "2", "-n", "1"], "--nnodes 2 needs --master-addr"),
        (["--nnodes", "0", "-n", "1"], "--nnodes 0: need at least one node"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "-n", "1"],
            "--node-rank 2: must be in 0..1",
        ),
        (["--node-rank", "-1", "-n", "1"], "--node-rank -1: must be in 0..0"),
        (["--master-addr", " ", "-n", "1"], "--master-addr is empty"),
    ],
)
def test_multinode_usage_errors(tmp_path, args, words):
    out = _launch([*args, _script(tmp_path, "pass\n")])
    assert out.returncode == 2
    assert words in out.stderr, out.stderr


# -- end to end: launch -> from_env -> a collective on the loopback libraries --------------------

E2E_SCRIPT = """
    import numpy as np
    from pynccl.bootstrap import from_env
    from pynccl.cuda import DeviceBuffer

    nids = int(sys.argv[1])
    comm = from_env(timeout=60, nids=nids)
    x = np.arange(16, dtype=np.float32) * (comm.rank + 1)
    buf = DeviceBuffer.from_numpy(x)
    comm.all_reduce(buf)
    comm.synchronize()
    print("result", comm.rank, comm.size, comm.device, *buf.to_numpy().tolist(), flush=True)
    buf.close()
    comm.destroy()
"""


@pytest.mark.slow
@pytest.mark.parametrize("nids", [1, 2])
def test_launch_from_env_all_reduce_on_loopback(tmp_path, nids):
    from pynccl.testing import loopback

    try:
        loopback.build()
    except loopback.LoopbackBuildError as e:
        pytest.skip(f"the loopback libraries cannot be built here: {e}")
    n = 3
    out = _launch(["-n", n, "--loopback", _script(tmp_path, E2E_SCRIPT), nids])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = sorted(line.split() for line in out.stdout.splitlines() if " result " in line)
    expected = (np.arange(16, dtype=np.float32) * sum(range(1, n + 1))).tolist()
    assert len(rows) == n
    for r, row in enumerate(rows):
        assert row[:2] == ["[rank", f"{r}]"]
        assert [int(v) for v in row[3:6]] == [r, n, r]  # rank, size, device = local rank
        assert [float(v) for v in row[6:]] == expected
