"""Launcher detection, Slurm node lists and device selection, from faked environments."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import zlib

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
    "SLURM_STEP_ID": "0",
}


# Every variable through which some convention could describe a job.
_TRIGGER_PREFIXES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMPI_",
    "PMI",
    "MV2_",
    "PALS_",
    "SLURM_",
    "LWS_",
    "JOB_",
    "JOBSET_",
    "PYNCCL_",
    "TORCHELASTIC_",
)


def _documented_port(job_id: str, step: str | None = None) -> int:
    """The port a job without MASTER_PORT gets, as slurm_default_port's docstring defines
    it: 15000 + (the id as a number, or its CRC-32) [* 31 + step] mod 15000."""
    base = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    if step is not None:
        base = base * 31 + int(step)
    return 15000 + base % 15000


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


def test_env_convention_minimal_without_local_rank_or_address():
    # RANK/WORLD_SIZE without torchelastic's variables: torch's env://, not torchrun
    env = detect_launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert env == LaunchEnv("env", 0, 1)


def test_openmpi():
    env = detect_launch_env({**OPENMPI, "PMIX_NAMESPACE": "prterun-x-1@1"})
    port = _documented_port("prterun-x-1@1")
    assert env == LaunchEnv("openmpi", 5, 6, 2, 3, None, port, "prterun-x-1@1")


def test_mpich():
    env = detect_launch_env({**MPICH, "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert env == LaunchEnv("mpich", 1, 4, 1, 2, "h0", 1234)


def test_slurm():
    env = detect_launch_env(SLURM)
    assert env.launcher == "slurm"
    assert (env.rank, env.world_size, env.local_rank) == (6, 7, 0)
    assert env.local_world_size == 1  # node 3 of "2(x3),1"
    assert env.master_addr == "node01"
    assert env.master_port == slurm_default_port("123456", "0")
    assert env.job_id == "123456.0"


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


# The variables Open MPI 4.1's mpirun gave two ranks here (`mpirun -np 2`, rank 1), less
# the ones that do not describe the job.
OPENMPI_41 = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_MCA_ess_base_jobid": "748617729",
    "OMPI_MCA_orte_hnp_uri": "748617728.0;tcp://192.0.2.2:54235;tcp6://[fd00::2]:41749",
    "OMPI_MCA_orte_num_nodes": "1",
    "PMIX_ID": "748617729.1",
    "PMIX_NAMESPACE": "748617729",
    "PMIX_RANK": "1",
    "PMIX_SERVER_URI41": "748617728.0;tcp4://127.0.0.1:55271",
}


def test_kubeflow_pod_is_the_env_convention_and_one_gpu_is_its_device():
    # a PyTorchJob pod: torch's env:// variables, no LOCAL_RANK, one GPU
    pod = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    env = detect_launch_env(pod)
    assert env == LaunchEnv("env", 3, 4, None, None, "job-master-0", 23456)
    assert select_device(env, {**pod, "CUDA_VISIBLE_DEVICES": "GPU-5d2e"}) == 0
    assert select_device(env, pod, device_count=1) == 0  # the device plugin set no variable
    with pytest.raises(LaunchEnvError) as info:
        select_device(env, pod, device_count=4)
    message = str(info.value)
    assert "torchrun" not in message  # nothing here ran torchrun
    assert "env://" in message and "LOCAL_RANK" in message and "4 devices" in message


def test_torchrun_needs_its_own_variables():
    env = detect_launch_env({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert env.launcher == "torchrun"


def test_jobset_pod():
    pod = {
        "JOB_COMPLETION_INDEX": "2",
        "JOB_INDEX": "0",
        "JOB_GLOBAL_INDEX": "0",
        "JOBSET_NAME": "train",
        "REPLICATED_JOB_NAME": "workers",
        "WORLD_SIZE": "4",
    }
    env = detect_launch_env(pod)
    # JobSet's host names: <jobset>-<replicated job>-<job index>-<pod index>.<jobset>
    leader, port = "train-workers-0-0.train", _documented_port("train")
    assert env == LaunchEnv("jobset", 2, 4, 0, 1, leader, port, "train")
    assert detect_launch_env({**pod, "MASTER_ADDR": "h", "MASTER_PORT": "99"}).master_port == 99


def test_jobset_errors_say_what_to_set():
    with pytest.raises(LaunchEnvError, match=r"WORLD_SIZE is not set \(an indexed Job"):
        detect_launch_env({"JOB_COMPLETION_INDEX": "1"})
    with pytest.raises(LaunchEnvError, match=r"JOB_GLOBAL_INDEX=1: .*set RANK"):
        detect_launch_env({"JOB_COMPLETION_INDEX": "1", "JOB_GLOBAL_INDEX": "1", "WORLD_SIZE": "8"})


def test_leaderworkerset_pod():
    pod = {
        "LWS_LEADER_ADDRESS": "vllm-0.vllm.default",
        "LWS_GROUP_SIZE": "4",
        "LWS_WORKER_INDEX": "3",
    }
    env = detect_launch_env(pod)
    address = "vllm-0.vllm.default"
    assert env == LaunchEnv("lws", 3, 4, 0, 1, address, _documented_port(address), address)
    with pytest.raises(LaunchEnvError, match=r"LWS_WORKER_INDEX is not set.*downward API"):
        detect_launch_env({k: v for k, v in pod.items() if k != "LWS_WORKER_INDEX"})


def test_pmix_alone_says_how_to_get_the_size():
    with pytest.raises(LaunchEnvError) as info:
        detect_launch_env({"PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-h-7@1"})
    assert info.value.launcher == "pmix"
    assert "PMIX_RANK=1" in str(info.value) and "mpi_comm=" in str(info.value)


def test_mvapich2():
    environ = {
        "MV2_COMM_WORLD_RANK": "5",
        "MV2_COMM_WORLD_SIZE": "8",
        "MV2_COMM_WORLD_LOCAL_RANK": "1",
        "MV2_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "4000",
    }
    assert detect_launch_env(environ) == LaunchEnv("mvapich2", 5, 8, 1, 4, "n0", 4000)


def test_cray_pals():
    environ = {
        "PALS_RANKID": "5",
        "PALS_LOCAL_RANKID": "1",
        "PALS_NODEID": "1",
        "PALS_APID": "8b1a6e0c-9d2f",
        "PALS_LOCAL_SIZE": "4",
        "PMI_RANK": "5",  # Cray PMI's, which agree
        "PMI_SIZE": "8",
        "MASTER_ADDR": "x1000c0s0b0n0",
    }
    env = detect_launch_env(environ)
    port = _documented_port("8b1a6e0c-9d2f")
    assert env == LaunchEnv("pals", 5, 8, 1, 4, "x1000c0s0b0n0", port, "8b1a6e0c-9d2f")


def test_pmi_local_rank():
    environ = {"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2"}
    assert detect_launch_env(environ) == LaunchEnv("mpich", 3, 4, 1, 2)


def test_real_open_mpi_variables_with_only_master_addr():
    env = detect_launch_env({**OPENMPI_41, "MASTER_ADDR": "n0"})
    # the port from the job's id, as for Slurm: every rank of the job computes the same
    assert env == LaunchEnv("openmpi", 1, 2, 1, 2, "n0", _documented_port("748617729"), "748617729")


def test_mpi_job_on_one_host_needs_no_address():
    # every rank on this host: rank 0 is here too
    env = detect_launch_env(OPENMPI_41)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", _documented_port("748617729"))


def test_open_mpi_job_id_from_the_hnp_uri():
    environ = {k: v for k, v in OPENMPI_41.items() if not k.startswith(("PMIX", "OMPI_MCA_ess"))}
    env = detect_launch_env(environ)
    assert (env.job_id, env.master_port) == ("748617728.0", _documented_port("748617728.0"))


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        (
            # MPICH's Hydra (PMI_FD) gives no job id, and the ranks span two hosts
            {**MPICH, "PMI_FD": "9", "MASTER_ADDR": "n0"},
            ["MASTER_PORT is not set", "PMIX_NAMESPACE, PMI_JOBID, PMI_PORT"],
        ),
        ({**MPICH, "PMI_JOBID": "77"}, ["MASTER_ADDR is not set", "2 of the 4 ranks"]),
    ],
)
def test_mpi_without_an_address_says_precisely_what_is_missing(environ, words):
    from pynccl.bootstrap import TcpRendezvous

    with pytest.raises(LaunchEnvError) as info:
        TcpRendezvous.from_env(environ=environ)
    message = str(info.value)
    assert "mpich launch detected" in message
    for word in words:
        assert word in message
    assert "MASTER_ADDR/MASTER_PORT are not set" not in message  # the old, vaguer words


# -- Slurm: a step, not a batch script ----------------------------------------------------------

SLURM_BATCH = {  # what sbatch's batch script sees: no step
    "SLURM_JOB_ID": "777",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "n[1-2]",
}


def test_slurm_batch_script_is_no_launcher_and_says_srun():
    with pytest.raises(LaunchEnvError) as info:
        detect_launch_env(SLURM_BATCH)
    message = str(info.value)
    assert "no launcher detected" in message
    assert "SLURM_JOB_ID=777 without SLURM_STEP_ID" in message and "srun" in message


@pytest.mark.parametrize(
    "inner",
    [
        {**OPENMPI_41, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
        {**TORCHRUN, "RANK": "2", "WORLD_SIZE": "4"},
    ],
)
def test_launchers_inside_a_batch_script_are_not_contradicted(inner):
    # mpirun/torchrun in the batch script: SLURM_PROCID=0 of SLURM_NTASKS=4 is the script's
    env = detect_launch_env({**SLURM_BATCH, **inner})
    assert env.rank == int(inner.get("RANK", inner.get("OMPI_COMM_WORLD_RANK", "-1")))


def test_slurm_step_of_a_batch_job_is_a_launcher():
    env = detect_launch_env({**SLURM_BATCH, "SLURM_STEP_ID": "0"})
    assert (env.launcher, env.master_addr, env.job_id) == ("slurm", "n1", "777.0")


def test_world_size_alone_is_no_launch():
    with pytest.raises(LaunchEnvError, match="WORLD_SIZE is set but RANK is not") as info:
        detect_launch_env({"WORLD_SIZE": "2"})
    assert info.value.launcher is None


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "launcher", "words"),
    [
        ({"RANK": "0"}, "env", ["WORLD_SIZE", "not set"]),
        ({"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "j"}, "torchrun", ["RANK", "not set"]),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "env", ["RANK='x'", "not an integer"]),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "env", ["RANK=2", "WORLD_SIZE=2"]),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "env", ["RANK=-1"]),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "env", ["WORLD_SIZE=0"]),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "env",
            ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"],
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"},
            "env",
            ["LOCAL_WORLD_SIZE=3"],
        ),
        (
            {**TORCHRUN, "MASTER_PORT": "70000"},
            "torchrun",
            ["MASTER_PORT=70000"],
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"},
            "env",
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
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "1"}, "slurm", ["SLURM_NTASKS"]),
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
        if name.startswith(_TRIGGER_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert (detect_launch_env().rank, detect_launch_env().world_size) == (1, 3)


# -- several launchers at once ------------------------------------------------------------------


def test_two_launchers_disagreeing():
    environ = {**MPICH, "SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
    with pytest.raises(LaunchEnvError, match="disagree") as info:
        detect_launch_env(environ)
    assert "mpich says rank 1 of 4" in str(info.value)
    assert "slurm says rank 2 of 4" in str(info.value)


def test_two_launchers_agreeing():
    environ = {**MPICH, "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
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
    environ["SLURM_STEP_ID"] = "0"
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
    from pynccl.bootstrap import _nodelist

    def no_expansion(piece):
        raise AssertionError("first_host expanded a range")

    monkeypatch.setattr(_nodelist, "_choices", no_expansion)
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
    with pytest.raises(LaunchEnvError, match=r"no local rank and CUDA sees 4 devices"):
        select_device(LaunchEnv("mpich", 0, 2), {}, device_count=4)


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
