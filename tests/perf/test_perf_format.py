"""Golden test: ``python -m pynccl perf``'s text and ``-J`` JSON against nccl-tests 2.19.6's.

The formats come from nccl-tests' source, captured verbatim in
``tests/perf/fixtures/nccl_tests_2.19.6_format.txt`` (printf formats and JSON key orders).
Each line of a real run on the loopback is parsed into its values, those values are
rendered again with nccl-tests' printf format for that line (Python's ``%`` follows C
printf), and the two are compared character for character; the lines must also come
in nccl-tests' order. Only the loopback banner is pynccl's own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from support.perf import run_perf

from pynccl.perf import LOOPBACK_BANNER

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "nccl_tests_2.19.6_format.txt"


def _formats() -> dict[str, str]:
    out = {}
    for line in FIXTURE.read_text().splitlines():
        if line.startswith("# ") and "\t" not in line:
            continue
        name, _, fmt = line.partition("\t")
        out[name] = fmt
    return out


FMT = _formats()
LOOPBACK_LINES = {
    *LOOPBACK_BANNER.splitlines(),
    "# (loopback: these figures are host memory, not NCCL)",
}


@pytest.fixture(scope="module")
def loopback_ready(lb_env: dict[str, str]) -> None:
    """The loopback is built (cached) before the runs, or they skip saying why."""


def _render_row(line: str) -> str:
    tok = line.split()
    size, count, dtype, redop, root = tok[:5]
    text = FMT["preamble"] % (int(size), int(count), dtype, redop, FMT["root"] % int(root))
    cells = tok[5:]
    for i in (0, 4):
        t, alg, bus, wrong = cells[i : i + 4]
        if wrong == "N/A":
            text += FMT["body_na"] % (t, alg, bus)
        else:
            text += FMT["body"] % (t, alg, bus, float(wrong))
    if len(cells) > 8:  # -S: the date and the time
        text += FMT["timestamp"] % " ".join(cells[8:10])
    return text


_DEVICE = re.compile(
    r"#  Rank +(\d+) Group +(\d+) Pid +(\d+) on +(\S+) device +(\d+) "
    r"\[([0-9a-f]{4}):([0-9a-f]{2}):([0-9a-f]{2})\] (.*)$"
)
_PARAMS = re.compile(
    r"# nThread (\d+) nGpus (\d+) minBytes (\d+) maxBytes (\d+) step: (\d+)\((\w+)\) warmup "
    r"iters: (\d+) iters: (\d+) agg iters: (\d+) validation: (\d+) graph: (\d+) unalign: (\d+)$"
)


def _check_text(stdout: str, nranks: int, cputime: bool, timestamps: bool) -> list[str]:
    """Walk the run's lines in nccl-tests' order, re-rendering each with its format."""
    lines = [line for line in stdout.split("\n") if line not in LOOPBACK_LINES]
    assert lines[-1] == "", "the output ends with a newline"
    lines.pop()
    it = iter(lines)
    seen: list[str] = []

    def expect(name: str, values: tuple[Any, ...] = ()) -> str:
        line = next(it)
        want = FMT[name] % values if values else FMT[name]
        assert line == want, f"{name}:\n  got  {line!r}\n  want {want!r}"
        seen.append(name)
        return line

    line = next(it)
    if line.startswith("# Writing JSON output to "):
        assert line == FMT["json_writing"] % line[len("# Writing JSON output to ") :]
        line = next(it)
    m = re.fullmatch(r"# nccl-tests version (\S+) nccl-headers=(\d+) nccl-library=(\d+)", line)
    assert m and line == FMT["version"] % (m[1], int(m[2]), int(m[3])), line
    assert m[1] == "2.19.6"
    program = next(it)
    assert program == FMT["starting"] % program[len("# Collective test starting: ") :]
    params = next(it)
    p = _PARAMS.match(params)
    assert p, params
    ints = [int(v) for v in p.groups() if v.isdigit()]
    values = (*ints[:5], p[6], *ints[5:])
    assert params == FMT["params"] % tuple(values)
    line = next(it)
    while line.startswith(("# Blocking", "# Parallel")):
        assert line in (FMT["blocking1"], FMT["blocking2"], FMT["blocking3"], FMT["parallel"])
        line = next(it)
    assert line == FMT["hash"]
    expect("using")
    for rank in range(nranks):
        line = next(it)
        d = _DEVICE.match(line)
        assert d, line
        assert int(d[1]) == rank
        nums = [int(d[i]) for i in (1, 2, 3)]
        rendered = FMT["device"] % (
            *nums, d[4], int(d[5]), int(d[6], 16), int(d[7], 16), int(d[8], 16), d[9]
        )
        assert line == rendered
    expect("hash")
    expect("header0", ("", "", "", "", ""))
    t = "cputime" if cputime else "time"
    pad, label, fmt = (19, "timestamp", "%Y-%m-%d %H:%M:%S") if timestamps else (0, "", "")
    expect("header1", ("size", "count", "type", "redop", "root", t, "algbw", "busbw",
                       "#wrong", t, "algbw", "busbw", "#wrong", pad, label))  # fmt: skip
    expect("header2", ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "",
                       "(us)", "(GB/s)", "(GB/s)", "", pad, fmt))  # fmt: skip
    rows = []
    line = next(it)
    while not line.startswith("#"):
        assert line == _render_row(line), f"row:\n  got  {line!r}\n  want {_render_row(line)!r}"
        rows.append(line)
        line = next(it)
    errors = int(line.split(":")[1].split()[0])
    assert line == FMT["oob"] % ("Out of bounds values", errors, "FAILED" if errors else "OK")
    line = next(it)
    avg = float(line.split(":")[1])
    assert line == FMT["avg"] % ("Avg bus bandwidth", avg, "")
    expect("hash")
    assert next(it) == FMT["concluded"] % program[len("# Collective test starting: ") :]
    expect("hash")
    expect("errors")
    assert next(it, None) is None
    return rows


@pytest.mark.usefixtures("loopback_ready")
@pytest.mark.parametrize(
    ("args", "nranks"),
    [
        (("all_reduce", "-g", "2", "-b", "8", "-e", "4K", "-f", "8"), 2),
        (("sendrecv", "-g", "2", "-b", "1K", "-e", "3K", "-f", "1", "-i", "1K", "-C", "1",
          "-S", "1"), 2),
        (("broadcast", "-t", "3", "-g", "1", "-r", "all", "-d", "int8", "-z", "3", "-u", "1",
          "-c", "0", "-b", "1M", "-e", "1M"), 3),
    ],
)
def test_text_matches_nccl_tests(args: tuple[str, ...], nranks: int, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = run_perf(*args, "-n", "2", "-J", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _check_text(proc.stdout, nranks, "-C" in args, "-S" in args)
    assert rows
    if "-i" in args:  # -f 1: a linear step of -i bytes, as nccl-tests
        assert [r.split()[0] for r in rows] == ["1024", "2048", "3072"]
    if args[0] == "sendrecv":  # in place is timed too; only out of place is checked
        assert all(r.split()[12] == "N/A" and r.split()[8] == "0" for r in rows)
    if "-r" in args:  # every root in turn
        assert [r.split()[4] for r in rows] == ["0", "1", "2"]
    if "-c" in args:
        assert all(r.split()[8] == "N/A" for r in rows)
    doc = json.loads(out.read_text())
    _check_json(doc, rows, nranks)


def _keys(name: str) -> list[str]:
    return FMT[f"json.{name}"].split(",")


def _check_json(doc: dict[str, Any], rows: list[str], nranks: int) -> None:
    assert list(doc) == _keys("top")
    assert doc["version"] == 3
    config = doc["config"]
    want = _keys("config")
    if "step_bytes" in config:
        want[want.index("step_factor")] = "step_bytes"
    assert list(config) == want
    assert config["blocking_collectives"] in ("true", "false")  # nccl-tests' jsonBool
    assert len(config["devices"]) == nranks
    for d in config["devices"]:
        assert list(d) == _keys("device")
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}", d["device_hex"])
    assert len(doc["results"]) == len(rows)
    for r, line in zip(doc["results"], rows):
        assert list(r) == _keys("result")
        tok = line.split()
        assert (r["size"], r["count"], r["type"], r["redop"]) == (
            int(tok[0]), int(tok[1]), tok[2], tok[3])  # fmt: skip
        assert r["root"] == FMT["root"] % int(tok[4])  # the printed column, a string
        for key, at in (("out_of_place", 5), ("in_place", 9)):
            cell = r[key]
            timing = "cpu_time" if "cpu_time" in cell else "time"
            assert list(cell) == [timing, *_keys("cell")[1:]]
            assert cell["nwrong"] == (None if tok[at + 3] == "N/A" else float(tok[at + 3]))
    assert list(doc["out_of_bounds"]) == _keys("out_of_bounds")
    assert doc["out_of_bounds"] == {"count": 0, "okay": "true"}
    assert list(doc["average_bus_bandwidth"]) == _keys("average_bus_bandwidth")
    assert doc["average_bus_bandwidth"]["okay"] == "unchecked"


@pytest.mark.usefixtures("loopback_ready")
def test_json_file_that_exists_is_kept(tmp_path: Path) -> None:
    """nccl-tests' -J never overwrites: it takes FILE.0, FILE.1 ... instead."""
    out = tmp_path / "r.json"
    out.write_text("keep me")
    proc = run_perf("-g", "2", "-b", "1K", "-e", "1K", "-n", "1", "-J", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "keep me"
    assert f"# Writing JSON output to {out}.0" in proc.stdout
    assert json.loads((tmp_path / "r.json.0").read_text())["version"] == 3


def test_device_line_pieces() -> None:
    from pynccl.perf import _report

    # cudaDeviceGetPCIBusId's "dddd:BB:DD.F" as nccl-tests prints cudaDeviceProp's ids
    assert _report._bus_hex("0000:1B:00.0") == "0000:1b:00"
    assert _report._bus_hex("0001:C3:1F.0") == "0001:c3:1f"
    assert _report._bus_hex("") == "????:??:??"
    assert _report._version_code("2.32.3") == 23203
    assert _report._version_code("2.19.4") == 21904
    line = _report._device_line(
        {"rank": 3, "pid": 4242, "hostname": "node7", "device": 1, "bus_id": "0000:1B:00.0",
         "name": "NVIDIA H100 80GB HBM3"}
    )  # fmt: skip
    want = FMT["device"] % (3, 0, 4242, "node7", 1, 0, 0x1B, 0, "NVIDIA H100 80GB HBM3")
    assert line == want


def test_json_text_is_nccl_tests_own() -> None:
    from pynccl.perf._report import _JsonText

    text = _JsonText.dump({"a": 1.5, "b": True, "c": None, "d": [1, "x"], "e": float("nan")})
    assert text == '{"a":1.500000,"b":"true","c":null,"d":[1,"x"],"e":"nan"}'
    assert json.loads(text)["a"] == 1.5


def test_gpu_name_read_from_device_properties(tmp_path: Path) -> None:
    """The GPU name comes from cudaGetDeviceProperties(_v2)'s leading name field (a stub
    runtime here: the loopback has no such function)."""
    import shutil
    import subprocess

    from pynccl.perf._bench import _gpu_name

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "stub.c"
    src.write_text(
        '#include <stdio.h>\n'
        "int cudaGetDeviceProperties_v2(char *prop, int dev) {\n"
        "    if (dev > 1) return 101; /* cudaErrorInvalidDevice */\n"
        '    snprintf(prop, 256, "Stub GPU %d", dev);\n'
        "    return 0;\n"
        "}\n"
    )
    lib = tmp_path / "libstubcudart.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    assert _gpu_name(str(lib), 1) == b"Stub GPU 1"
    assert _gpu_name(str(lib), 5) == b""  # an error: no name, no exception
    assert _gpu_name(str(tmp_path / "missing.so"), 0) == b""
