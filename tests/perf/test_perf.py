"""``python -m pynccl perf``: argument parsing, nccl-tests' size and bandwidth rules, the host
reference, and real sweeps on the loopback libraries (no GPU needed).

The bandwidth expectations below are written out from nccl-tests' ``*GetBw`` and
``*GetCollByteCount`` functions (``src/*.cu``) and ``doc/PERFORMANCE.md``, not
computed with the code under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.perf import perf_env, run_perf, table_rows

from pynccl import perf
from pynccl.enums import DataType

COLLS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "sendrecv",
)


# -- sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("8", 8),
        ("1000", 1000),
        ("64K", 65536),
        ("64k", 65536),
        ("64KiB", 65536),
        ("2kb", 2048),
        ("1.5M", 1572864),
        ("32M", 33554432),
        ("1G", 1073741824),
        (" 4 M ", 4194304),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert perf.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1", "1X", "1.2.3", "M", "1MM", "0x10"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size") as info:
        perf.parse_size(text)
    assert repr(text) in str(info.value)


def test_sweep_sizes_follow_nccl_tests() -> None:
    assert perf.sweep_sizes(8, 128, 2, 0) == [8, 16, 32, 64, 128]
    assert perf.sweep_sizes(8, 100, 4, 0) == [8, 32]
    assert perf.sweep_sizes(1 << 20, 3 << 20, 1, 1 << 20) == [1 << 20, 2 << 20, 3 << 20]
    assert perf.sweep_sizes(32, 32, 1, 1 << 20) == [32]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((64, 8, 2, 0), "above the maximum"),
        ((0, 64, 2, 0), "never grows"),
        ((8, 64, 1, 0), "step must be at least"),
        ((1, 1 << 30, 1, 1), "more than"),
    ],
)
def test_sweep_sizes_errors(args: tuple[int, int, int, int], match: str) -> None:
    with pytest.raises(perf.PerfError, match=match):
        perf.sweep_sizes(*args)


def test_default_sweeps() -> None:
    # On a GPU nccl-tests' defaults (one 32 MiB step); on the loopback 8 B .. 32 MiB, doubling.
    gpu = perf._parse([])
    gpu.resolve(loopback=False)
    assert gpu.sizes == [32 << 20] and (gpu.iters, gpu.warmup_iters) == (20, 1)
    lb = perf._parse([])
    lb.resolve(loopback=True)
    assert lb.sizes == [8 << k for k in range(23)]
    only_max = perf._parse(["-e", "1M"])
    only_max.resolve(loopback=False)
    assert only_max.sizes == [1 << 20]
    only_min = perf._parse(["-b", "64M", "-f", "2"])
    only_min.resolve(loopback=True)
    assert only_min.sizes == [64 << 20]


# -- nccl-tests' counts and bandwidths --------------------------------------------------

# Bus-bandwidth factors (doc/PERFORMANCE.md, src/*.cu) for 2, 4 and 8 ranks.
BUS = {
    "all_reduce": (1.0, 1.5, 1.75),
    "all_gather": (0.5, 0.75, 0.875),
    "reduce_scatter": (0.5, 0.75, 0.875),
    "broadcast": (1.0, 1.0, 1.0),
    "reduce": (1.0, 1.0, 1.0),
    "gather": (0.5, 0.75, 0.875),
    "scatter": (0.5, 0.75, 0.875),
    "all_to_all": (0.5, 0.75, 0.875),
    "sendrecv": (1.0, 1.0, 1.0),
}


@pytest.mark.parametrize("coll", COLLS)
def test_bus_factors(coll: str) -> None:
    for n, expected in zip((2, 4, 8), BUS[coll]):
        assert perf.bus_factor(coll, n) == pytest.approx(expected)
    if coll == "all_reduce":
        assert perf.bus_factor(coll, 1) == 0.0


def test_bus_factor_accepts_nccl_tests_names() -> None:
    assert perf.bus_factor("all_reduce_perf", 4) == 1.5
    assert perf.bus_factor("alltoall", 4) == 0.75
    with pytest.raises(ValueError, match="unknown collective 'allreduce2'"):
        perf.bus_factor("allreduce2", 4)


def test_all_reduce_bandwidth() -> None:
    # 32 MiB of float32 on 8 ranks in 1 ms: algbw = 33554432 B / 1e9 / 1e-3 s.
    coll = perf.COLLECTIVES["all_reduce"]
    c = coll.counts(33554432, 4, 8)
    assert (c.send, c.recv, c.param) == (8388608, 8388608, 8388608)
    algbw, busbw = coll.bandwidths(c.param, 4, 1e-3, 8)
    assert algbw == pytest.approx(33.554432)
    assert busbw == pytest.approx(33.554432 * 14 / 8)


def test_gather_family_counts_are_per_rank_and_16_byte_aligned() -> None:
    # nccl-tests: base = (count / nranks) rounded down to 16 bytes.
    ag = perf.COLLECTIVES["all_gather"]
    c = ag.counts(1 << 20, 4, 3)  # 262144 floats / 3 = 87381 -> 87380 (multiple of 4)
    assert (c.send, c.recv, c.param, c.send_offset, c.recv_offset) == (
        87380,
        262140,
        87380,
        87380,
        0,
    )
    algbw, busbw = ag.bandwidths(c.param, 4, 1.0, 3)
    assert algbw == pytest.approx(87380 * 4 * 3 / 1e9)
    assert busbw == pytest.approx(algbw * 2 / 3)
    rs = perf.COLLECTIVES["reduce_scatter"].counts(1 << 20, 4, 3)
    assert (rs.send, rs.recv, rs.param, rs.send_offset, rs.recv_offset) == (
        262140,
        87380,
        87380,
        0,
        87380,
    )
    a2a = perf.COLLECTIVES["all_to_all"].counts(4096, 8, 4)  # 512 doubles / 4 = 128 (even)
    assert (a2a.send, a2a.recv, a2a.param) == (512, 512, 128)
    # Too small to give every rank 16 bytes: nothing moves, as in nccl-tests.
    assert perf.COLLECTIVES["scatter"].counts(8, 4, 2).param == 0
    assert perf.COLLECTIVES["gather"].counts(96, 1, 2).param == 48


def test_broadcast_and_sendrecv_bandwidth_is_algbw() -> None:
    for name in ("broadcast", "reduce", "sendrecv"):
        coll = perf.COLLECTIVES[name]
        algbw, busbw = coll.bandwidths(1000, 2, 1e-6, 4)
        assert algbw == pytest.approx(2.0) and busbw == pytest.approx(2.0)


def test_number_format_matches_nccl_tests() -> None:
    # getFloatStr: as many of 2, 1, 0 decimals as fit the width, then exponent form.
    assert perf._fmt(12.3456, 7) == "  12.35"
    assert perf._fmt(12345.678, 7) == "12345.7"
    assert perf._fmt(1234567.0, 7) == "1234567"
    assert perf._fmt(123456789.0, 7) == "1.2e+08"
    assert perf._fmt(0.0, 6) == "  0.00"


# -- host reference -----------------------------------------------------------------------


REFERENCE_CASES = [
    (op, dtype)
    for op in ("sum", "prod", "max", "min", "avg", "mulsum")
    for dtype in (DataType.FLOAT32, DataType.FLOAT16, DataType.INT32, DataType.UINT8)
]


@pytest.mark.parametrize(("op", "dtype"), REFERENCE_CASES)
@pytest.mark.parametrize("n", [3, 20])  # 20: several rank groups
def test_reference_against_numpy(op: str, dtype: DataType, n: int) -> None:
    np = pytest.importorskip("numpy")
    data = perf._Data(np, dtype, op, n, rep=5)
    xs = np.stack([data.values(r, 0, 1000) for r in range(n)])
    assert xs.dtype == data.np_dtype
    assert len(np.unique(xs)) > 1  # not a constant pattern
    ref, tol = data.reduce(0, 1000)
    if dtype.is_integer:
        assert tol is None
        if op == "mulsum":
            xs = xs * np.array([[1 + r % 2] for r in range(n)], dtype=xs.dtype)
        if op == "avg":  # NCCL: the sum divided by nranks, truncated toward zero (not floor)
            total = xs.astype(np.int64).sum(0)
            assert np.array_equal(ref, np.trunc(total / n).astype(xs.dtype))
            assert (total < 0).any() == (dtype is DataType.INT32)  # truncation was tested
            return
        fold = {
            "sum": np.add,
            "mulsum": np.add,
            "prod": np.multiply,
            "max": np.maximum,
            "min": np.minimum,
        }[op]
        want = fold.reduce(xs, axis=0, dtype=xs.dtype)
        assert np.array_equal(ref, want)
    else:
        x64 = xs.astype(np.float64)
        if op == "mulsum":
            x64 = x64 * np.array([[1.0 + r % 2] for r in range(n)])
        want = {
            "sum": x64.sum(0),
            "mulsum": x64.sum(0),
            "prod": x64.prod(0),
            "max": x64.max(0),
            "min": x64.min(0),
            "avg": x64.mean(0),
        }[op]
        assert np.allclose(ref.astype(np.float64), want, rtol=0, atol=1e-9)
        if op == "avg":  # not exact in binary: a tolerance
            assert tol is not None and tol > 0
        else:  # small integers, exact in any order: compared bit for bit, in the type
            assert tol is None and ref.dtype == data.np_dtype
            assert np.array_equal(ref, want.astype(data.np_dtype))


def test_slices_are_consistent_and_reps_differ() -> None:
    np = pytest.importorskip("numpy")
    data = perf._Data(np, DataType.FLOAT32, "sum", 2, rep=1)
    whole = data.values(1, 0, 100)
    assert np.array_equal(whole[40:60], data.values(1, 40, 60))
    assert not np.array_equal(whole, data.values(0, 0, 100))
    other = perf._Data(np, DataType.FLOAT32, "sum", 2, rep=2)
    assert not np.array_equal(whole, other.values(1, 0, 100))


def test_compare_counts_corrupted_elements() -> None:
    np = pytest.importorskip("numpy")
    data = perf._Data(np, DataType.FLOAT16, "sum", 4, rep=3)
    ref, tol = data.reduce(0, 512)
    got = ref.astype(np.float16)
    assert data.compare(got, ref, tol) == 0
    got[[3, 100, 511]] += np.float16(1.0)
    got[7] = np.nan
    assert data.compare(got, ref, tol) == 4
    moved = data.values(2, 0, 64)
    copy = moved.copy()
    copy[10] = -copy[10] if copy[10] != 0 else np.float16(1)
    assert data.compare(moved.copy(), moved, None) == 0
    assert data.compare(copy, moved, None) == 1


def test_expected_results_per_collective() -> None:
    np = pytest.importorskip("numpy")
    n, rank, root = 3, 1, 2
    data = perf._Data(np, DataType.INT32, "sum", n, rep=9)
    x = [data.values(r, 0, 3 * 4) for r in range(n)]

    def expect(name: str) -> Any:
        coll = perf.COLLECTIVES[name]
        c = coll.counts(48, 4, n)  # 12 ints: flat count 12, per-rank blocks of 4
        fn = perf._expected(coll, data, rank, root, c)
        if fn is None:
            return None
        def fn_new(lo: int, hi: int) -> Any:  # into a fresh buffer each time
            return fn(lo, hi, np.empty(hi - lo, dtype=data.np_dtype))

        whole, tol = fn_new(0, c.recv)
        assert tol is None
        # any split into pieces gives the same (results are checked a chunk at a time)
        for cut in range(1, c.recv):
            parts = np.concatenate([fn_new(0, cut)[0], fn_new(cut, c.recv)[0]])
            assert np.array_equal(parts, whole)
        return whole

    assert np.array_equal(expect("all_reduce"), x[0] + x[1] + x[2])
    assert np.array_equal(expect("broadcast"), x[root])
    assert expect("reduce") is None  # only the root's result is defined
    assert np.array_equal(expect("all_gather"), np.concatenate([x[0][:4], x[1][:4], x[2][:4]]))
    assert np.array_equal(expect("reduce_scatter"), (x[0] + x[1] + x[2])[4:8])
    assert expect("gather") is None
    assert np.array_equal(expect("scatter"), x[root][4:8])
    assert np.array_equal(expect("all_to_all"), np.concatenate([x[0][4:8], x[1][4:8], x[2][4:8]]))
    assert np.array_equal(expect("sendrecv"), x[0])
    gather_root = perf._expected(
        perf.COLLECTIVES["gather"], data, root, root, perf.COLLECTIVES["gather"].counts(48, 4, n)
    )
    assert gather_root is not None
    got = gather_root(0, 12, np.empty(12, np.int32))[0]
    assert np.array_equal(got, np.concatenate([x[0][:4], x[1][:4], x[2][:4]]))


# -- command line (parsing errors need no library) -------------------------------------


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["-b", "1Q"], "invalid size '1Q'"),
        (["-e", "lots"], "invalid size 'lots'"),
        (["-f", "0"], "-f must be >= 1, got 0"),
        (["-n", "0"], "-n must be >= 1"),
        (["-n", "many"], "-n must be an integer, got 'many'"),
        (["-g", "0"], "-g must be >= 1"),
        (["all_reducer"], "unknown collective 'all_reducer'"),
        (["-d", "complex64"], "unknown data type 'complex64'"),
        (["-o", "xor"], "unknown reduction op 'xor'"),
        (["all_gather", "-o", "max"], "all_gather takes no reduction op"),
        (["all_reduce", "-r", "1"], "all_reduce has no root"),
        (["-a", "7"], "-a 7"),
        (["-T", "-3"], "timeout must be >= 0"),
        (["--bogus"], "unknown flag --bogus: neither nccl-tests nor pynccl has it"),
        # nccl-tests' flags are flags, never a collective's name
        (["-t", "x"], "-t must be an integer, got 'x'"),
        (["-m", "0"], "-m must be >= 1"),
        (["-z", "4"], "-z 4: expected 0, 1, 2 or 3"),
        (["-p", "2"], "-p 2: expected 0 or 1"),
        (["-z", "1", "-G", "2"], "-z 1 with -G: a wait between operations cannot be captured"),
        (["-y", "1", "-G", "2"], "-y 1 with -G: the default (NULL) stream cannot be captured"),
        (["-R", "3"], "-R 3: expected 0 (plain buffers), 1 (registered) or 2"),
        (["-I", "1"], "flag -I (--per_iter_timing) is not supported"),
        (["-D", "1"], "flag -D (--device_implementation) is not supported"),
        (["-M", "1"], "flag -M (--memory) is not supported"),
        (["-r", "some"], "-r must be an integer, got 'some'"),
        (["--json", "/nonexistent-dir/x.json"], "directory /nonexistent-dir does not exist"),
        (["-J", "/nonexistent-dir/x.json"], "-J /nonexistent-dir/x.json: directory"),
        (["--plot", "/"], "--plot /: is a directory"),
        (["-J", "out.txt"], "-J out.txt: nccl-tests writes JSON only, to a file named *.json"),
    ],
)
def test_usage_errors(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert perf.main(argv) == 2
    err = capsys.readouterr().err
    assert "python -m pynccl perf: error:" in err
    assert match in err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert perf.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "-t",
        "-m",
        "-N",
        "-p",
        "-z",
        "-y",
        "-T",
        "-C",
        "-S",
        "-J",
        "-a",
        "-u",
        "-R",
        "-b",
        "-e",
        "-f",
        "-g",
        "-n",
        "-w",
        "-c",
        "-o",
        "-d",
        "-r",
        "-G",
        "--json",
        "--plot",
    ):
        assert flag in out


# -- real sweeps on the loopback ----------------------------------------------------------


@pytest.fixture(scope="module")
def loopback_ready(lb_env: dict[str, str]) -> None:
    """The loopback is built (cached) before the sweeps, or they skip saying why.

    The sweeps themselves run without its environment: perf finds no GPU and
    switches to the loopback on its own.
    """


@pytest.mark.usefixtures("loopback_ready")
def test_mulsum_across_processes_uses_each_ranks_scalar() -> None:
    # nccl-tests' mulsum gives every rank its own scalar; 3 processes go through the
    # loopback's shared-memory staging, so this checks that path against numpy.
    proc = run_perf("all_reduce", "-g", "3", "-b", "1K", "-e", "256K", "-f", "16", "-n", "1",
                    "-w", "0", "-c", "1", "-o", "mulsum", "-d", "float,half,int32")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Out of bounds values : 0 OK" in proc.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
@pytest.mark.parametrize("coll", COLLS)
def test_sweep_checks_every_collective(coll: str, tmp_path: Path) -> None:
    extra = ["-r", "1"] if coll in ("broadcast", "reduce", "gather", "scatter") else []
    out = tmp_path / "perf.json"
    proc = run_perf(
        coll,
        "-g",
        "2",
        "-b",
        "64",
        "-e",
        "16K",
        "-f",
        "16",
        "-n",
        "3",
        "-w",
        "1",
        "-c",
        "1",
        *extra,
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Out of bounds values : 0 OK" in proc.stdout
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [r["count"] for r in rows] == [
        perf.COLLECTIVES[coll].counts(size, 4, 2).param for size in (64, 1024, 16384)
    ]
    for row in rows:
        assert row["out_of_place"]["nwrong"] == 0
        assert row["out_of_place"]["time"] > 0
        if coll in ("all_to_all", "sendrecv"):  # timed in place too, as nccl-tests, unchecked
            assert row["in_place"]["nwrong"] is None and row["in_place"]["time"] > 0
        else:
            assert row["in_place"]["nwrong"] == 0
        if extra:
            assert row["root"] == 1
    table = table_rows(proc.stdout)
    assert len(table) == 3 and table[0][2:4] == [
        "float",
        "sum" if coll in ("all_reduce", "reduce_scatter", "reduce") else "none",
    ]


@pytest.mark.usefixtures("loopback_ready")
def test_json_report_and_loopback_banner(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = run_perf(
        "all_reduce",
        "-g",
        "2",
        "-b",
        "1K",
        "-e",
        "4K",
        "-f",
        "2",
        "-n",
        "2",
        "-d",
        "half,int8",
        "-o",
        "sum,max",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# " + "=" * 86 + "\n# LOOPBACK:")
    assert "NOT NCCL" in proc.stdout
    assert "[rank" not in proc.stdout  # rank 0's lines come through unprefixed
    doc = json.loads(out.read_text())
    assert doc["loopback"] is True and "host-memory loopback" in doc["banner"]
    assert doc["nranks"] == 2
    assert doc["parameters"]["minbytes"] == 1024 and doc["parameters"]["maxbytes"] == 4096
    assert doc["parameters"]["check"] == 1
    assert doc["library"]["nccl"]["version"].count(".") == 2
    assert len(doc["devices"]) == 2 and {d["rank"] for d in doc["devices"]} == {0, 1}
    seen = {(r["type"], r["redop"], r["size"]) for r in doc["results"]}
    assert seen == {
        (t, o, s) for t in ("half", "int8") for o in ("sum", "max") for s in (1024, 2048, 4096)
    }
    for r in doc["results"]:
        cell = r["out_of_place"]
        assert cell["nwrong"] == 0
        # busbw = algbw * 2(n-1)/n = algbw for 2 ranks; algbw = bytes / time
        assert cell["bus_bw"] == pytest.approx(cell["alg_bw"])
        assert cell["alg_bw"] == pytest.approx(r["size"] / 1e9 / (cell["time"] * 1e-6))
    assert doc["out_of_bounds"] == {"count": 0, "okay": True}
    rows = len(doc["results"]) * 2
    mean = sum(r[k]["bus_bw"] for r in doc["results"] for k in ("out_of_place", "in_place"))
    assert doc["average_bus_bandwidth"] == pytest.approx(mean / rows)


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
@pytest.mark.parametrize("args", [("-g", "2"), ("all_gather", "-g", "3"), ("sendrecv", "-g", "1")])
def test_graphs_on_the_loopback(args: tuple[str, ...]) -> None:
    """-G captures each rank's operations into a CUDA graph and replays it; -c 1 checks
    the replayed results against numpy."""
    proc = run_perf(*args, "-G", "3", "-c", "1", "-b", "64", "-e", "4K", "-f", "8", "-n", "2")
    assert proc.returncode == 0, proc.stderr
    assert "graph: 3" in proc.stdout
    assert "host memory, not NCCL" in proc.stdout
    rows = table_rows(proc.stdout)
    assert len(rows) == 3
    assert all(r[8] == "0" for r in rows), proc.stdout  # out-of-place #wrong
    assert "# Out of bounds values : 0 OK" in proc.stdout


@pytest.mark.usefixtures("loopback_ready")
def test_single_rank_runs_in_process() -> None:
    proc = run_perf("reduce_scatter", "-g", "1", "-b", "256", "-e", "1K", "-n", "2", "-f", "2")
    assert proc.returncode == 0, proc.stderr
    assert "# nThread 1 nGpus 1 " in proc.stdout and "LOOPBACK" in proc.stdout
    rows = table_rows(proc.stdout)
    assert [r[0] for r in rows] == ["256", "512", "1024"]
    # one rank: the bus factor (n-1)/n is 0
    assert all(float(r[7]) == 0.0 for r in rows)


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_inside_an_existing_launcher() -> None:
    env = perf_env()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pynccl",
            "launch",
            "-n",
            "2",
            "-m",
            "pynccl",
            "perf",
            "broadcast",
            "-r",
            "1",
            "-b",
            "512",
            "-e",
            "2K",
            "-f",
            "2",
            "-n",
            "2",
        ],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "LOOPBACK" in line or "Out of" in line]
    assert lines and all(line.startswith("[rank 0] ") for line in lines)
    rows = [
        line.split()[2:]
        for line in proc.stdout.splitlines()
        if line.startswith("[rank 0] ") and not line.startswith("[rank 0] #") and line[9:]
    ]
    assert [r[0] for r in rows] == ["512", "1024", "2048"]
    assert all(r[4] == "1" and r[8] == "0" and r[12] == "0" for r in rows)


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_ngpus_must_match_the_launcher() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pynccl", "launch", "-n", "2", "-m", "pynccl", "perf", "-g", "3"],
        env=perf_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "-g 3, but the pynccl launcher started 2 ranks" in proc.stderr


@pytest.mark.usefixtures("loopback_ready")
def test_root_out_of_range() -> None:
    proc = run_perf("reduce", "-g", "2", "-r", "2")
    assert proc.returncode == 2
    assert "-r 2: the root must be below the 2 ranks" in proc.stderr


def _shadow(tmp_path: Path, module: str) -> dict[str, str]:
    """An environment in which ``import module`` fails, as if it were not installed."""
    d = tmp_path / "shadow"
    (d / module).mkdir(parents=True)
    (d / module / "__init__.py").write_text(f"raise ImportError('no {module} here (test)')\n")
    return {"PYTHONPATH": os.pathsep.join((str(d), str(ROOT)))}


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_runs_without_numpy(tmp_path: Path) -> None:
    env = _shadow(tmp_path, "numpy")
    proc = run_perf("-g", "2", "-b", "1K", "-e", "2K", "-n", "2", extra_env=env)
    assert proc.returncode == 0, proc.stderr
    assert "validation off: numpy is not installed" in proc.stdout
    rows = table_rows(proc.stdout)
    assert len(rows) == 2 and all(r[8] == "N/A" and r[12] == "N/A" for r in rows)
    proc = run_perf("-g", "2", "-c", "1", "-b", "1K", "-e", "1K", extra_env=env)
    assert proc.returncode != 0
    assert "-c 1 checks results against numpy, which is not installed" in proc.stderr


def test_plot_without_matplotlib(tmp_path: Path) -> None:
    proc = run_perf("--plot", str(tmp_path / "p.png"), extra_env=_shadow(tmp_path, "matplotlib"))
    assert proc.returncode == 2
    assert "--plot needs matplotlib" in proc.stderr and "pynccl-ctypes[plot]" in proc.stderr
    assert not (tmp_path / "p.png").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("loopback_ready")
def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib (the 'plot' extra) is not installed")
    png = tmp_path / "bw.png"
    proc = run_perf(
        "all_gather", "-g", "2", "-b", "1K", "-e", "8K", "-f", "2", "-n", "2", "--plot", str(png)
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.usefixtures("loopback_ready")
def test_wrong_results_fail_the_run(tmp_path: Path) -> None:
    # A rank whose all-reduce silently adds 1 to the first element: the check must see it.
    hook = tmp_path / "hook" / "sitecustomize.py"
    hook.parent.mkdir()
    hook.write_text(
        textwrap.dedent("""
        import os
        if os.environ.get("RANK") == "1":
            import numpy as np
            from pynccl import comm as _comm, library
            _orig = _comm.Communicator.all_reduce
            def all_reduce(self, sendbuf, recvbuf=None, op=0, **kw):
                _orig(self, sendbuf, recvbuf, op, **kw)
                if kw.get("count") and kw["count"] > 16:  # spare the 1-element scalars
                    self.library  # noqa
                    s = kw["stream"]
                    one = np.ones(1, dtype=np.float32)
                    rt = library.cudart()
                    rt.cudaStreamSynchronize(s)
                    dst = recvbuf if recvbuf is not None else sendbuf
                    cur = np.empty(1, dtype=np.float32)
                    rt.cudaMemcpy(cur.ctypes.data, dst, 4, 2)
                    cur += one
                    rt.cudaMemcpy(dst, cur.ctypes.data, 4, 1)
                    rt.cudaStreamSynchronize(0)  # a host-to-device copy lands later
            _comm.Communicator.all_reduce = all_reduce
    """)
    )
    env = {"PYTHONPATH": os.pathsep.join((str(hook.parent), str(ROOT)))}
    proc = run_perf("-g", "2", "-b", "1K", "-e", "1K", "-n", "1", extra_env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    # one bad element, each placement
    assert rows and rows[0][8] == "1" and rows[0][12] == "1", proc.stdout + proc.stderr
    assert "Out of bounds values : 2 FAILED" in proc.stdout
