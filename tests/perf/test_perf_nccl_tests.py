"""``perf`` as nccl-tests users expect (issue 22): ``-t`` without ``-g``, ``-i`` as a linear
step, unknown flags, nccl-tests 2.19's ``hypercube`` and ``alltoallv``, ``NCCL_TESTS_MIN_BW``,
``NCCL_TESTS_DEVICE`` and ``NCCL_TESTS_SPLIT``, many loopback ranks, and ``-J`` without
secrets.

Expected counts and bandwidths are written out from nccl-tests 2.19.6's ``src/hypercube.cu``,
``src/alltoallv.cu`` and ``src/common.cu``; expected data from numpy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.perf import run_perf, table_rows

from pynccl import perf
from pynccl.enums import DataType
from pynccl.perf import _run
from pynccl.perf._tests_env import NcclTestsEnv
from pynccl.perf._traffic import Traffic, read_matrix


@pytest.fixture(scope="module")
def loopback_ready(lb_env: dict[str, str]) -> None:
    """The loopback is built (cached) before the runs, or they skip saying why."""


def _sizes(argv: list[str], loopback: bool) -> list[int]:
    opts = perf._parse(argv)
    opts.resolve(loopback)
    return opts.sizes


# -- the command line -------------------------------------------------------------------


def test_a_given_step_without_a_factor_is_linear() -> None:
    # nccl-tests' stepFactor defaults to 1: -i alone steps linearly, on the loopback too.
    mib = 1 << 20
    for loopback in (True, False):
        linear = _sizes(["-i", "1M", "-b", "1M", "-e", "4M"], loopback)
        assert linear == [mib, 2 * mib, 3 * mib, 4 * mib]
        doubling = _sizes(["-i", "1M", "-f", "2", "-b", "1M", "-e", "4M"], loopback)
        assert doubling == [mib, 2 * mib, 4 * mib]
    assert _sizes(["-b", "1M", "-e", "4M"], True) == [mib, 2 * mib, 4 * mib]  # loopback default
    assert _sizes(["-b", "1M", "-e", "3M"], False) == [mib, 2 * mib, 3 * mib]  # nccl-tests'


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["-q", "1"], "-q"),
        (["all_gather", "-q", "1"], "-q"),
        (["--foo", "1"], "--foo"),
        (["-Z"], "-Z"),
    ],
)
def test_unknown_flags_are_named(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert perf.main(argv) == 2
    err = capsys.readouterr().err
    assert f"unknown flag {flag}:" in err
    assert "unknown collective" not in err


@pytest.mark.parametrize(
    "argv",
    [["-g2", "-b", "8"], ["--ngpus=2"], ["--ngpu", "2"], ["reduce", "-r", "-1"], ["-d", "all"]],
)
def test_flag_forms_argparse_accepts_still_parse(argv: list[str]) -> None:
    perf._parse(argv)


# -- hypercube --------------------------------------------------------------------------


def test_hypercube_counts_and_bandwidth() -> None:
    hc = perf.COLLECTIVES["hypercube"]
    assert hc.tests_binary == "hypercube_perf"
    # HyperCubeGetCollByteCount: base = (count/nranks) & ~(16/eltSize - 1), the gather layout
    c = hc.counts(4096, 4, 4)  # 1024 floats / 4 ranks = 256
    assert (c.send, c.recv, c.param, c.send_offset, c.recv_offset) == (256, 1024, 256, 256, 0)
    # HyperCubeGetBw: algbw = count * typesize * (nranks - 1) / sec, busbw = algbw
    algbw, busbw = hc.bandwidths(c.param, 4, 1e-3, 4, c)
    assert algbw == pytest.approx(256 * 4 * 3 / 1e9 / 1e-3)
    assert busbw == pytest.approx(algbw)
    assert hc.bandwidths(c.param, 4, 1e-3, 4) == (algbw, busbw)


# -- alltoallv ---------------------------------------------------------------------------


def _peer_bytes(i: int, j: int, n: int, total: int, spread: float) -> int:
    # AlltoAllvGetPeerBytesDistanceWeighted, written out from src/alltoallv.cu
    if n == 1:
        return total & ~15
    distance = (j - i + n) % n
    uniform = total / n
    dist = distance * total / (n * (n - 1) // 2)
    return int((1.0 - spread) * uniform + spread * dist) & ~15


@pytest.mark.parametrize("spread", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_alltoallv_generated_pattern(spread: float, n: int) -> None:
    t = Traffic(spread)
    count, size = 100_000, 4
    param = (count // n) & ~3  # (count / nranks) & ~(16/4 - 1)
    total = param * n * size
    c = t.counts(count, size, n)
    assert c.param == param and c.send_offset == c.recv_offset == 0
    for r in range(n):
        sends = [_peer_bytes(r, j, n, total, spread) // size for j in range(n)]
        recvs = [_peer_bytes(j, r, n, total, spread) // size for j in range(n)]
        assert t.sends(r, n, param, size) == sends
        assert t.recvs(r, n, param, size) == recvs
        assert sum(sends) == sum(recvs) == c.send == c.recv  # balanced: every rank alike
    if spread == 1.0 and n > 1:
        assert t.sends(0, n, param, size)[0] == 0  # nothing to itself
    # AlltoAllvGetBw: the busiest rank's bytes; busbw * n / (n-1)
    coll = perf.COLLECTIVES["alltoallv"]
    algbw, busbw = coll.bandwidths(c.param, size, 1.0, n, c)
    assert algbw == pytest.approx(c.send * size / 1e9)
    assert busbw == pytest.approx(algbw * (n - 1) / n)
    if spread == 1.0:  # without counts: those of the default (generated, spread 1) pattern
        assert coll.bandwidths(c.param, size, 1.0, n) == (algbw, busbw)


def test_alltoallv_expected_against_numpy() -> None:
    # Each rank's result: for each source, the slice of its input that follows what it
    # sends the lower ranks; zeros after, up to the buffer's size.
    matrix = [[0, 32, 64], [16, 0, 48], [96, 16, 0]]  # bytes, multiples of 16
    t = Traffic(matrix=matrix, path="m")
    n, size = 3, 4
    c = t.counts(0, size, n)
    assert (c.param, c.send, c.recv) == (0, 28, 28)  # rank 2 sends 112 B; rank 0 gets 112 B
    data = perf._Data(np, DataType.FLOAT32, None, n, 7)
    inputs = [data.values(r, 0, c.send) for r in range(n)]
    for rank in range(n):
        pieces = []
        for src in range(n):
            start = sum(matrix[src][:rank]) // size
            pieces.append(inputs[src][start : start + matrix[src][rank] // size])
        want = np.zeros(c.recv, np.float32)
        got_values = np.concatenate(pieces)
        want[: len(got_values)] = got_values
        expect = perf._expected(perf.COLLECTIVES["alltoallv"], data, rank, -1, c, t)
        assert expect is not None
        got = []
        for lo in range(0, c.recv, 5):  # a few elements at a time, as the checks chunk
            hi = min(lo + 5, c.recv)
            got.append(expect(lo, hi, np.empty(hi - lo, np.float32))[0].copy())
        assert np.array_equal(np.concatenate(got), want), rank


def test_hypercube_expected_is_the_all_gather() -> None:
    n, size = 4, 4
    c = perf.COLLECTIVES["hypercube"].counts(256, size, n)
    data = perf._Data(np, DataType.FLOAT32, None, n, 3)
    expect = perf._expected(perf.COLLECTIVES["hypercube"], data, 2, -1, c)
    assert expect is not None
    want = np.concatenate([data.values(r, 0, c.param) for r in range(n)])
    assert np.array_equal(expect(0, c.recv, np.empty(c.recv, np.float32))[0], want)


def test_alltoallv_matrix_file(tmp_path: Path) -> None:
    path = tmp_path / "m.txt"
    path.write_text("100  200  150\n\n50 100 75\n300 150 200\n")
    # * scale, then rounded down to 16 bytes
    assert read_matrix(str(path)) == [[96, 192, 144], [48, 96, 64], [288, 144, 192]]
    assert read_matrix(str(path), 2.0) == [[192, 400, 288], [96, 192, 144], [592, 288, 400]]
    t = Traffic.from_env({"NCCL_TESTS_ALLTOALLV_MATRIX_FILE": str(path)})
    t.check(3, 1024, 1024)
    with pytest.raises(perf.PerfError, match="-b and -e must be equal"):
        t.check(3, 512, 1024)
    with pytest.raises(perf.PerfError, match="-e must be at least 624"):  # rank 2: 288+144+192
        t.check(3, 256, 256)
    with pytest.raises(perf.PerfError, match="cannot describe 4 ranks"):
        t.check(4, 1024, 1024)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1 2\n3\n", "line 2 has 1 values, the first row 2"),
        ("1 2 3\n4 5 6\n", "2 rows of 3 values"),
        ("1 -2\n3 4\n", "line 1, column 2: '-2'"),
        ("1 x\n3 4\n", "'x' is not a number of bytes"),
        ("\n\n", "the file is empty"),
    ],
)
def test_alltoallv_matrix_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "m.txt"
    path.write_text(text)
    with pytest.raises(perf.PerfError, match=match):
        read_matrix(str(path))


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"NCCL_TESTS_ALLTOALLV_SPREAD": "1.5"}, "expected 0.0 .uniform. to 1.0"),
        ({"NCCL_TESTS_ALLTOALLV_SPREAD": "lots"}, "expected a number"),
        ({"NCCL_TESTS_ALLTOALLV_MATRIX_SCALE": "-1"}, "expected a scale >= 0"),
        ({"NCCL_TESTS_ALLTOALLV_PRINT_SUMMARY": "yes"}, "expected 0 or 1"),
        ({"NCCL_TESTS_ALLTOALLV_MATRIX_FILE": "/nonexistent/m.txt"}, "cannot read it"),
    ],
)
def test_alltoallv_env_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(perf.PerfError, match=match):
        Traffic.from_env(env)


# -- NCCL_TESTS_* -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "colors"),
    [
        # the README's examples, on 16 ranks (2 nodes of 8)
        ("AND 0x7", [r & 7 for r in range(16)]),
        ("MOD 8", [r % 8 for r in range(16)]),
        ("OR 0x7", [r | 7 for r in range(16)]),
        ("DIV 8", [r // 8 for r in range(16)]),
        ("&0b1", [r & 1 for r in range(16)]),
        ("%2", [r % 2 for r in range(16)]),
        ("/ 4", [r // 4 for r in range(16)]),
        ("| 1", [r | 1 for r in range(16)]),
    ],
)
def test_split_colors(split: str, colors: list[int]) -> None:
    env = NcclTestsEnv.from_env({"NCCL_TESTS_SPLIT": split})
    assert [env.color(r) for r in range(16)] == colors
    env.check_groups(16)


def test_split_mask_and_errors() -> None:
    env = NcclTestsEnv.from_env({"NCCL_TESTS_SPLIT_MASK": "3", "NCCL_TESTS_SPLIT": "DIV 2"})
    assert [env.color(r) for r in range(6)] == [r & 3 for r in range(6)]  # the mask first
    assert NcclTestsEnv.from_env({"NCCL_TESTS_SPLIT_MASK": "0b1"}).color(0xB1) == 0xB1  # hex
    for bad, match in (("XOR 1", "expected an operator"), ("MOD 0", "cannot divide by 0"),
                       ("AND x", "'x' is not a number")):  # fmt: skip
        with pytest.raises(perf.PerfError, match=match):
            NcclTestsEnv.from_env({"NCCL_TESTS_SPLIT": bad})
    with pytest.raises(perf.PerfError, match=r"groups of 3 \(color 0\), 1 \(color 1\)"):
        NcclTestsEnv.from_env({"NCCL_TESTS_SPLIT": "DIV 3"}).check_groups(4)


def test_device_and_min_bw_parsing() -> None:
    assert NcclTestsEnv.from_env({}).device is None
    assert NcclTestsEnv.from_env({"NCCL_TESTS_DEVICE": "3"}).device == 3
    assert NcclTestsEnv.from_env({"NCCL_TESTS_DEVICE": "-1"}).device is None  # nccl-tests' default
    with pytest.raises(perf.PerfError, match="NCCL_TESTS_DEVICE='one'"):
        NcclTestsEnv.from_env({"NCCL_TESTS_DEVICE": "one"})
    env = NcclTestsEnv.from_env({"NCCL_TESTS_MIN_BW": "100"})
    # nccl-tests: FAILED when the average is below 90% of the minimum
    assert env.bandwidth_ok(90.0) is True and env.bandwidth_ok(89.9) is False
    assert NcclTestsEnv.from_env({}).bandwidth_ok(0.0) is None
    with pytest.raises(perf.PerfError, match="expected a bandwidth in GB/s"):
        NcclTestsEnv.from_env({"NCCL_TESTS_MIN_BW": "fast"})


# -- many loopback ranks -----------------------------------------------------------------


def test_many_loopback_ranks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_run, "_cpu_count", lambda: 2)
    monkeypatch.setattr(_run, "_available_memory", lambda: 8 << 30)
    opts = perf._parse(["-g", "99"])
    opts.resolve(True)
    with pytest.raises(perf.PerfError, match=r"-g 99: 99 loopback ranks need about .* GiB of host"):
        _run._check_loopback_load(opts, "-g 99", 99)
    small = perf._parse(["-g", "99", "-e", "1K"])
    small.resolve(True)
    _run._check_loopback_load(small, "-g 99", 99)  # fits: runs, with a word
    err = capsys.readouterr().err
    assert "warning: -g 99 starts 99 loopback ranks on 2 CPU cores" in err
    _run._check_loopback_load(small, "-g 4", 4)  # the usual few: nothing to say
    assert capsys.readouterr().err == ""
    with pytest.raises(perf.PerfError, match="at most 1024 devices"):
        _run._check_loopback_load(small, "-g 2000", 2000)


# -- runs on the loopback ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_threads_without_gpus() -> None:
    proc = run_perf("-t", "2", "-b", "1K", "-e", "2K", "-n", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# nThread 2 nGpus 1 " in proc.stdout
    assert proc.stdout.count("#  Rank ") == 2
    assert [r[0] for r in table_rows(proc.stdout)] == ["1024", "2048"]


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_linear_step_on_the_loopback() -> None:
    proc = run_perf("-g", "2", "-i", "1K", "-b", "1K", "-e", "4K", "-n", "1")
    assert proc.returncode == 0, proc.stderr
    assert [r[0] for r in table_rows(proc.stdout)] == ["1024", "2048", "3072", "4096"]
    assert "step: 1024(bytes)" in proc.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
@pytest.mark.parametrize("g", ["2", "4"])
def test_hypercube_runs_and_checks(g: str) -> None:
    n = int(g)
    proc = run_perf("hypercube", "-g", g, "-b", "64", "-e", "16K", "-f", "16", "-n", "2",
                    "-c", "1", "-d", "float,int8")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Collective test starting: hypercube_perf" in proc.stdout
    rows = table_rows(proc.stdout)
    assert len(rows) == 6
    steps = [64, 1024, 16384] * 2
    for step, row in zip(steps, rows):
        size, count, dtype = int(row[0]), int(row[1]), row[2]
        item = 4 if dtype == "float" else 1
        assert count == (step // item // n) & ~(16 // item - 1)  # the gather layout's block
        assert size == count * n * item
        assert row[3] == "-1" and row[7] == "0" and row[11] == "0"  # the redop column is empty
        t_us, algbw, busbw = float(row[4]), float(row[5]), float(row[6])
        assert busbw == algbw  # factor 1
        assert algbw == pytest.approx(count * item * (n - 1) / 1e3 / t_us, abs=0.011)
    assert "# Out of bounds values : 0 OK" in proc.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_hypercube_skips_other_rank_counts() -> None:
    proc = run_perf("hypercube", "-g", "3", "-b", "64", "-e", "64", "-n", "1")
    assert proc.returncode == 0, proc.stderr
    assert "nRanks 3 is not a power of 2, skipping" in proc.stdout
    assert table_rows(proc.stdout) == ["nRanks 3 is not a power of 2, skipping".split()]


@pytest.mark.usefixtures("loopback_ready")
def test_alltoallv_runs_and_checks(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = run_perf("alltoallv", "-g", "3", "-b", "96", "-e", "96K", "-f", "32", "-n", "2",
                    "-c", "1", "-d", "float,half", "--json", str(out),
                    extra_env={"NCCL_TESTS_ALLTOALLV_SPREAD": "0.5",
                               "NCCL_TESTS_ALLTOALLV_PRINT_SUMMARY": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Out of bounds values : 0 OK" in proc.stdout
    t = Traffic(0.5)
    rows = json.loads(out.read_text())["results"]
    cases = [(dtype, step) for dtype in ("float", "half") for step in (96, 3072, 98304)]
    assert len(rows) == len(cases)
    for (dtype, step), row in zip(cases, rows):
        item = 4 if dtype == "float" else 2
        c = t.counts(step // item, item, 3)
        assert (row["type"], row["size"], row["count"]) == (dtype, c.send * item, c.param)
        assert row["redop"] == "none" and row["out_of_place"]["nwrong"] == 0
        assert row["in_place"]["nwrong"] is None  # timed in place, unchecked, as nccl-tests
    assert proc.stdout.count("# NCCL_TESTS_ALLTOALLV_PRINT_SUMMARY: mode=generated nranks=3") == 12
    assert "#   rank=2 send_bytes=" in proc.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_alltoallv_matrix_run(tmp_path: Path) -> None:
    path = tmp_path / "traffic.txt"
    path.write_text("0 256 512\n64 0 1024\n128 32 0\n")
    env = {"NCCL_TESTS_ALLTOALLV_MATRIX_FILE": str(path)}
    proc = run_perf("alltoallv", "-g", "3", "-b", "4K", "-e", "4K", "-n", "2", "-c", "1",
                    extra_env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = table_rows(proc.stdout)
    # the busiest rank moves 1536 B (rank 2 receives 512 + 1024); count is 0 with a matrix
    assert row[:2] == ["1536", "0"] and row[8] == "0"
    bad = run_perf("alltoallv", "-g", "3", "-b", "1K", "-e", "4K", extra_env=env)
    assert bad.returncode == 2 and "-b and -e must be equal" in bad.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_min_bw(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    fail = run_perf("-g", "2", "-b", "1K", "-e", "2K", "-n", "1", "-J", str(out),
                    extra_env={"NCCL_TESTS_MIN_BW": "100000"})  # fmt: skip
    assert fail.returncode == 1, fail.stdout + fail.stderr
    line = next(x for x in fail.stdout.splitlines() if "Avg bus bandwidth" in x)
    assert line.endswith(" FAILED")
    assert json.loads(out.read_text())["average_bus_bandwidth"]["okay"] == "false"
    ok = run_perf("-g", "2", "-b", "1K", "-e", "2K", "-n", "1",
                  extra_env={"NCCL_TESTS_MIN_BW": "0.000001"})  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert next(x for x in ok.stdout.splitlines() if "Avg bus bandwidth" in x).endswith(" OK")


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_device_offset() -> None:
    proc = run_perf("-g", "2", "-b", "1K", "-e", "1K", "-n", "1",
                    extra_env={"NCCL_TESTS_DEVICE": "3"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    devices = [line.split()[10] for line in proc.stdout.splitlines() if "#  Rank" in line]
    assert devices == ["3", "4"]
    one = run_perf("-g", "1", "-b", "1K", "-e", "1K", "-n", "1",
                   extra_env={"NCCL_TESTS_DEVICE": "9"})  # fmt: skip
    assert one.returncode == 0, one.stdout + one.stderr
    assert [line.split()[10] for line in one.stdout.splitlines() if "#  Rank" in line] == ["9"]


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_split_runs_groups_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    proc = run_perf("-g", "4", "-b", "1K", "-e", "4K", "-n", "2", "-c", "1", "-J", str(out),
                    extra_env={"NCCL_TESTS_SPLIT": "MOD 2"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    groups = [int(line.split()[4]) for line in proc.stdout.splitlines() if "#  Rank" in line]
    assert groups == [0, 1, 0, 1]
    doc = json.loads(out.read_text())
    assert [d["group"] for d in doc["config"]["devices"]] == [0, 1, 0, 1]
    for row in doc["results"]:
        # all_reduce in a group of 2: busbw = algbw * 2(2-1)/2 = algbw
        for key in ("out_of_place", "in_place"):
            assert row[key]["nwrong"] == 0
            assert row[key]["bus_bw"] == pytest.approx(row[key]["alg_bw"])
    bad = run_perf("-g", "4", "-b", "1K", "-e", "1K", extra_env={"NCCL_TESTS_SPLIT": "DIV 3"})
    assert bad.returncode == 2 and "every group must have the same size" in bad.stderr


@pytest.mark.usefixtures("loopback_ready")
def test_json_never_writes_secrets(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    secrets = {"PYNCCL_RENDEZVOUS_KEY": "rendezvous-secret-1", "MY_API_TOKEN": "token-2",
               "DB_PASSWORD": "password-3", "SOME_SECRET": "secret-4"}  # fmt: skip
    proc = run_perf("-g", "2", "-b", "1K", "-e", "1K", "-n", "1", "-J", str(out),
                    extra_env=secrets)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    for value in secrets.values():
        assert value not in text
    env: list[Any] = json.loads(text)["env"]
    for name in secrets:
        assert f"{name}=<set>" in env
    assert any(e.startswith("PATH=") and e != "PATH=<set>" for e in env)  # the rest as it is
    assert os.environ.get("PATH", "") in [e[5:] for e in env if e.startswith("PATH=")]
