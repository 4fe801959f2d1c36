"""Launcher detection, Slurm node lists and device selection, from faked environments."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys

import pytest

from pynccl.bootstrap import (
    LaunchEnv,
    LaunchEnvError,
    detect_launch_env,
    expand_nodelist,
    first_host,
    select_device,
    slurm_default_port,
    visible_devices,
)

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "169.254.1.3",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "6",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "3",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_JOB_NODELIST": "node[01-04,07],gpu3",
    "SLURM_JOB_ID": "123456",
}


# -- each convention ----------------------------------------------------------------------------


def test_torchrun():
    env = detect_launch_env(TORCHRUN)
    assert env == LaunchEnv("torchrun", 3, 8, 1, 2, "169.254.1.3", 29500, "abc")


def test_pynccl_launch_convention():
    env = detect_launch_env({**TORCHRUN, "PYNCCL_LAUNCHER": "pynccl"})
    assert env.launcher == "pynccl"
    assert (env.rank, env.world_size, env.master_port) == (3, 8, 29500)


def test_torchrun_placeholder_run_id_is_no_job_id():
    assert detect_launch_env({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}).job_id is None


def test_torchrun_minimal_without_local_rank_or_address():
    env = detect_launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert env == LaunchEnv("torchrun", 0, 1)


def test_openmpi():
    env = detect_launch_env({**OPENMPI, "PMIX_NAMESPACE": "prterun-x-1@1"})
    assert env == LaunchEnv("openmpi", 5, 6, 2, 3, None, None, "prterun-x-1@1")


def test_mpich():
    env = detect_launch_env({**MPICH, "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert env == LaunchEnv("mpich", 1, 4, 1, 2, "h0", 1234)


def test_slurm():
    env = detect_launch_env(SLURM)
    assert env.launcher == "slurm"
    assert (env.rank, env.world_size, env.local_rank) == (6, 7, 0)
    assert env.local_world_size == 1  # node 3 of "2(x3),1"
    assert env.master_addr == "node01"
    assert env.master_port == slurm_default_port("123456")
    assert env.job_id == "123456"


def test_slurm_step_variables_win_and_master_port_overrides():
    env = detect_launch_env(
        {
            **SLURM,
            "SLURM_STEP_NODELIST": "gpu[7-8]",
            "SLURM_STEP_TASKS_PER_NODE": "4,3",
            "SLURM_NODEID": "1",
            "SLURM_STEP_ID": "2",
            "MASTER_PORT": "4000",
        }
    )
    assert (env.master_addr, env.master_port, env.local_world_size) == ("gpu7", 4000, 3)
    assert env.job_id == "123456.2"


def test_slurm_master_addr_overrides_nodelist():
    assert detect_launch_env({**SLURM, "MASTER_ADDR": "login"}).master_addr == "login"


def test_slurm_default_port_range_and_determinism():
    ports = {slurm_default_port(str(j)) for j in range(100000, 100500)}
    assert all(15000 <= p < 30000 for p in ports)
    assert len(ports) == 500  # consecutive jobs do not collide
    assert slurm_default_port("77", "0") != slurm_default_port("77", "1")
    assert 15000 <= slurm_default_port("array_77x") < 30000


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "launcher", "words"),
    [
        ({"RANK": "0"}, "torchrun", ["WORLD_SIZE", "not set"]),
        ({"WORLD_SIZE": "2"}, "torchrun", ["RANK", "not set"]),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "torchrun", ["RANK='x'", "not an integer"]),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "torchrun", ["RANK=2", "WORLD_SIZE=2"]),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "torchrun", ["RANK=-1"]),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "torchrun", ["WORLD_SIZE=0"]),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "torchrun",
            ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"],
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"},
            "torchrun",
            ["LOCAL_WORLD_SIZE=3"],
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"},
            "torchrun",
            ["MASTER_PORT=70000"],
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"},
            "torchrun",
            ["MASTER_PORT='http'"],
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "PYNCCL_LAUNCHER": "pynccl"}, "pynccl", ["MASTER_ADDR"]),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "openmpi", ["OMPI_COMM_WORLD_SIZE"]),
        (
            {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"},
            "openmpi",
            ["OMPI_COMM_WORLD_RANK=4"],
        ),
        ({"PMI_SIZE": "4"}, "mpich", ["PMI_RANK"]),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1.5"},
            "mpich",
            ["MPI_LOCALRANKID"],
        ),
        ({"SLURM_PROCID": "0"}, "slurm", ["SLURM_NTASKS"]),
        (
            {**SLURM, "SLURM_JOB_NODELIST": "node[01-"},
            "slurm",
            ["SLURM_JOB_NODELIST", "unbalanced"],
        ),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "2(x"}, "slurm", ["SLURM_TASKS_PER_NODE"]),
        ({**SLURM, "SLURM_NODEID": "9"}, "slurm", ["SLURM_NODEID=9"]),
    ],
)
def test_errors_name_launcher_and_variable(environ, launcher, words):
    with pytest.raises(LaunchEnvError) as info:
        detect_launch_env(environ)
    assert isinstance(info.value, ValueError)
    assert info.value.launcher == launcher
    message = str(info.value)
    assert launcher in message
    for word in words:
        assert word in message


def test_nothing_detected():
    with pytest.raises(LaunchEnvError, match="no launcher detected") as info:
        detect_launch_env({"HOME": "/root", "CUDA_VISIBLE_DEVICES": "0"})
    assert info.value.launcher is None


def test_unknown_forced_launcher():
    with pytest.raises(LaunchEnvError, match="PYNCCL_LAUNCHER='lsf'"):
        detect_launch_env({**TORCHRUN, "PYNCCL_LAUNCHER": "lsf"})


def test_default_environ_is_os_environ(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("RANK", "WORLD_SIZE", "OMPI_", "PMI_", "SLURM_", "PYNCCL_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert (detect_launch_env().rank, detect_launch_env().world_size) == (1, 3)


# -- several launchers at once ------------------------------------------------------------------


def test_two_launchers_disagreeing():
    environ = {**MPICH, "SLURM_PROCID": "2", "SLURM_NTASKS": "4"}
    with pytest.raises(LaunchEnvError, match="disagree") as info:
        detect_launch_env(environ)
    assert "mpich says rank 1 of 4" in str(info.value)
    assert "slurm says rank 2 of 4" in str(info.value)


def test_two_launchers_agreeing():
    environ = {**MPICH, "SLURM_PROCID": "1", "SLURM_NTASKS": "4"}
    assert detect_launch_env(environ).launcher == "mpich"


def test_inner_launcher_wins_over_an_outer_world():
    # srun -n 2 (one task per node) running torchrun with 4 processes per node
    environ = {**TORCHRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert detect_launch_env(environ).launcher == "torchrun"


def test_outer_launcher_partial_variables_are_ignored():
    environ = {**TORCHRUN, "SLURM_PROCID": "0"}  # no SLURM_NTASKS: e.g. a batch step
    assert detect_launch_env(environ).launcher == "torchrun"


def test_forcing_a_launcher_skips_the_cross_check():
    environ = {**MPICH, "SLURM_PROCID": "2", "SLURM_NTASKS": "4", "PYNCCL_LAUNCHER": "slurm"}
    env = detect_launch_env(environ)
    assert (env.launcher, env.rank) == ("slurm", 2)


# -- Slurm node lists ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-04,07],gpu3", ["node01", "node02", "node03", "node04", "node07", "gpu3"]),
        ("single", ["single"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("gpu[3]x,cpu[1,5]", ["gpu3x", "cpu1", "cpu5"]),
        (
            "host-1.example.com,host[2-3].example.com",
            ["host-1.example.com", "host2.example.com", "host3.example.com"],
        ),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


def test_expand_nodelist_against_an_independent_expansion():
    # the reference expansion is built from the parts, not parsed
    groups = ["01-03", "10", "12-13"]
    expected = [f"c{n:02d}" for n in (1, 2, 3, 10, 12, 13)]
    assert expand_nodelist("c[" + ",".join(groups) + "]") == expected
    prods = [f"x{a}y{b}" for a, b in itertools.product(range(1, 4), range(7, 9))]
    assert expand_nodelist("x[1-3]y[7-8]") == prods


@pytest.mark.parametrize(
    "bad", ["", " ", "n[1-", "n]1[", "n[[1]]", "n[3-1]", "n[a-b]", "n[1-2-3]", "a,,b", "n[]"]
)
def test_bad_nodelists(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


def test_first_host_does_not_expand_the_list(monkeypatch):
    from pynccl.bootstrap import env as envmod

    def no_expansion(piece):
        raise AssertionError("first_host expanded a range")

    monkeypatch.setattr(envmod, "_choices", no_expansion)
    assert first_host("n[0000000-9999999],m[5-6]") == "n0000000"
    assert first_host("r[07-99]-c[3,1]") == "r07-c3"
    with pytest.raises(ValueError):  # the rest of the list is still validated
        first_host("n[1-2],m[3-")


# -- devices ------------------------------------------------------------------------------------


def _env(local_rank, launcher="torchrun"):
    return LaunchEnv(launcher, local_rank, 8, local_rank, 8)


@pytest.mark.parametrize(
    ("value", "entries"),
    [
        ("0,1,2", ["0", "1", "2"]),
        (" 3 , 1 ", ["3", "1"]),
        ("", []),
        ("0,1,-1,2", ["0", "1"]),
        ("0,0,1", ["0"]),
        ("GPU-aaa,MIG-bbb", ["GPU-aaa", "MIG-bbb"]),
        ("1,bogus,2", ["1"]),
        ("01,2", ["1", "2"]),
    ],
)
def test_visible_devices(value, entries):
    assert visible_devices({"CUDA_VISIBLE_DEVICES": value}) == entries


def test_visible_devices_unset():
    assert visible_devices({}) is None


def test_device_is_local_rank_without_visibility_limit():
    assert select_device(_env(5), {}) == 5


def test_device_indexes_visible_list():
    assert select_device(_env(2), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == 2


def test_device_out_of_visible_range():
    with pytest.raises(LaunchEnvError, match=r"local rank 3.*exposes only 2"):
        select_device(_env(3), {"CUDA_VISIBLE_DEVICES": "4,5"})


def test_one_visible_device_means_per_process_binding():
    assert select_device(_env(3), {"CUDA_VISIBLE_DEVICES": "GPU-1234"}) == 0


def test_no_visible_device():
    with pytest.raises(LaunchEnvError, match="no usable device"):
        select_device(_env(0), {"CUDA_VISIBLE_DEVICES": "-1"})


def test_device_needs_a_local_rank():
    with pytest.raises(LaunchEnvError, match="no local rank"):
        select_device(LaunchEnv("mpich", 0, 2), {})


# -- the real MPICH launcher (installed from PyPI with the test extras) --------------------------


def test_real_mpiexec_environment(tmp_path):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec (pip install mpich) is not installed")
    script = tmp_path / "show.py"
    # Each rank writes its own file: mpiexec's forwarding of several ranks' stdout can split
    # and interleave lines, which made a stdout-based check flaky.
    script.write_text(
        "import os, sys\n"
        "from pynccl.bootstrap import detect_launch_env\n"
        "e = detect_launch_env()\n"
        "path = os.path.join(sys.argv[1], f'rank{e.rank}')\n"
        "with open(path, 'w') as f:\n"
        "    f.write(f'{e.launcher} {e.rank} {e.world_size} {e.local_rank} {e.local_world_size}')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.getcwd()
    subprocess.run(
        [mpiexec, "-n", "3", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    got = [(tmp_path / f"rank{r}").read_text() for r in range(3)]
    assert got == [f"mpich {r} 3 {r} 3" for r in range(3)]
