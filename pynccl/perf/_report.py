"""Rank 0's report: the table rows (nccl-tests' columns), the progress note, the header
and loopback banner, the JSON and the plot."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from .._env import redact
from ._options import Options
from ._sweep import PerfError

# --------------------------------------------------------------------------------------
# Output


def _fmt(value: float, width: int) -> str:
    """nccl-tests' ``getFloatStr``: the most decimals (2, 1, 0) that fit in ``width``."""
    for spec in (".2f", ".1f", ".0f"):
        text = f"{value:{width}{spec}}"
        if len(text) <= width:
            return text
    return f"{value:{width}.1e}" if width >= 7 else f"{value:{width}.0e}"


#: The nccl-tests release whose output format (text and -J JSON) perf follows.
NCCL_TESTS_FORMAT = "2.19.6"
_JSON_FILE_VERSION = 3
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _table_header(cputime: bool, timestamps: bool) -> list[str]:
    """nccl-tests' writeResultHeader (without per-iteration timing)."""
    t = "cputime" if cputime else "time"
    pad, label, fmt = (19, "timestamp", _TIME_FORMAT) if timestamps else (0, "", "")
    blank = f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}"
    return [
        "#",
        blank + "           out-of-place                       in-place          ",
        f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  "
        f"{t:>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}  "
        f"{t:>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6} {label:>{pad}}",
        f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  "
        f"{'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  "
        f"{'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6} {fmt:>{pad}}",
    ]


def _footer(errors: int, avg: float, program: str, bw_ok: bool | None = None) -> list[str]:
    """nccl-tests' writeResultFooter, finalizeFooter and writeErrors (no NCCL error);
    ``bw_ok``: NCCL_TESTS_MIN_BW's verdict (None: not asked for)."""
    verdict = "" if bw_ok is None else ("OK" if bw_ok else "FAILED")
    return [
        f"# {'Out of bounds values':<20} : {errors} {'FAILED' if errors else 'OK'}",
        f"# {'Avg bus bandwidth':<20} : {avg:g} {verdict}",
        "#",
        f"# Collective test concluded: {program}",
        "#",
        "",
    ]


#: What the loopback figures are (the banner's text, and the JSON's "banner").
LOOPBACK_NOTE = (
    "LOOPBACK: no GPU here, so this runs on pynccl's host-memory loopback libraries. "
    "These figures measure host memory copies and Python, NOT NCCL or a GPU interconnect."
)
LOOPBACK_BANNER = "\n".join(
    [
        "# " + "=" * 86,
        "# LOOPBACK: no GPU here, so this runs on pynccl's host-memory loopback libraries.",
        "# These figures measure host memory copies and Python, NOT NCCL or a GPU interconnect.",
        "# " + "=" * 86,
    ]
)


def _cell(result: dict[str, Any]) -> str:
    """nccl-tests' writeBenchmarkLineBody: time, algbw, busbw and #wrong (N/A: not checked)."""
    wrong = result["nwrong"]
    time_us = result["cpu_time"] if "cpu_time" in result else result["time"]
    wrong_text = "  N/A" if wrong is None else f"{float(wrong):6g}"  # "    N/A" in all
    return (
        f"  {_fmt(time_us, 7)}  {_fmt(result['alg_bw'], 6)}  "
        f"{_fmt(result['bus_bw'], 6)}  {wrong_text}"
    )


def _row_text(row: dict[str, Any]) -> str:
    """One row: nccl-tests' preamble, the two cells and (-S) the timestamp."""
    text = (
        f"{row['size']:12d}  {row['count']:12d}  {row['type']:>8}  {row['redop']:>6}  "
        f"{row['root']:6d}" + _cell(row["out_of_place"]) + _cell(row["in_place"])
    )
    if "timestamp" in row:
        text += f"{row['timestamp']:>21}"
    return text


class _Ticker:
    """A status line on a terminal (stderr), redrawn every second by a thread, while a
    long step runs; nothing at all when stderr is not a terminal (piped, a file)."""

    def __init__(self, status: Callable[[], str], delay: float = 0.0) -> None:
        self.status = status
        self.lock = threading.Lock()
        self.shown = False
        self.stop = threading.Event()
        err = sys.stderr
        self.tty: IO[str] | None = err if err is not None and err.isatty() else None
        self.thread: threading.Thread | None = None
        if self.tty is not None:
            self.thread = threading.Thread(
                target=self._run, args=(delay,), name="pynccl-perf-progress", daemon=True
            )
            self.thread.start()

    def _run(self, delay: float) -> None:
        if self.stop.wait(delay):
            return
        while True:
            self.draw()
            if self.stop.wait(1.0):
                return

    def draw(self) -> None:
        if self.tty is None or self.stop.is_set():
            return
        with self.lock:
            self.tty.write("\r" + self.status() + "\x1b[K")
            self.tty.flush()
            self.shown = True

    def clear(self) -> None:
        """Take the status line off (the caller holds ``lock``)."""
        if self.shown and self.tty is not None:
            self.tty.write("\r\x1b[K")
            self.tty.flush()
            self.shown = False

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        with self.lock:
            self.clear()


@contextlib.contextmanager
def _progress(label: str, delay: float = 0.5) -> Iterator[None]:
    """``label ... N s`` on a terminal while the block runs, if it takes over ``delay``."""
    started = time.monotonic()
    ticker = _Ticker(lambda: f"# {label} ... {time.monotonic() - started:.0f} s", delay)
    try:
        yield
    finally:
        ticker.close()


class _Console:
    """Where rank 0's report goes: whole lines, flushed; on a terminal also a status
    line (rows done, seconds so far) kept up to date while a long row runs."""

    def __init__(self, out: IO[str] | None, total: int | None = None) -> None:
        self.out = out
        self.total = total
        self.rows = 0
        self.started = time.monotonic()
        self.ticker = _Ticker(self._status) if out is not None else None

    def _status(self) -> str:
        of = f"/{self.total}" if self.total else ""
        return f"# {self.rows}{of} rows done, {time.monotonic() - self.started:.0f} s ..."

    def line(self, text: str) -> None:
        if self.out is None:
            return
        if self.ticker is None or self.ticker.tty is None:
            self.out.write(text + "\n")
            self.out.flush()
            return
        with self.ticker.lock:
            self.ticker.clear()
            self.out.write(text + "\n")
            self.out.flush()
        if text and not text.startswith("#"):
            self.rows += 1
        if self.total is None or self.rows < self.total:
            self.ticker.draw()

    def close(self) -> None:
        if self.ticker is not None:
            self.ticker.close()


@dataclass
class _Backend:
    loopback: bool
    nccl_path: str
    nccl_rule: str
    nccl_version: str
    cudart_path: str
    cudart_rule: str

    def as_json(self) -> dict[str, Any]:
        return {
            "nccl": {"path": self.nccl_path, "rule": self.nccl_rule, "version": self.nccl_version},
            "cudart": {"path": self.cudart_path, "rule": self.cudart_rule},
        }


@dataclass
class _Result:
    rows: list[dict[str, Any]] = field(default_factory=list)
    wrong: int = 0  # wrong elements, all rows
    errors: int = 0  # (size, placement) cells with wrong elements: nccl-tests' "out of bounds"
    busbw_sum: float = 0.0
    busbw_count: int = 0


def _version_code(version: str) -> int:
    """NCCL_VERSION_CODE of ``"2.32.3"`` (major*10000 + minor*100 + patch since 2.9)."""
    major, minor, patch = (int(v) for v in [*version.split("."), "0", "0"][:3])
    return major * 10000 + minor * 100 + patch


def _bus_hex(bus_id: str) -> str:
    """``0000:1B:00.0`` (cudaDeviceGetPCIBusId) as nccl-tests prints it: ``0000:1b:00``
    (domain, bus and device in hex, from cudaDeviceProp)."""
    try:
        domain, bus, rest = bus_id.split(":")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(rest.split('.')[0], 16):02x}"
    except ValueError:
        return "????:??:??"


def _device_line(d: dict[str, Any]) -> str:
    """nccl-tests' ``#  Rank ... device N [bus] NAME`` line."""
    return (
        f"#  Rank {d['rank']:2d} Group {d.get('group', 0):2d} Pid {d['pid']:6d} on "
        f"{d['hostname']:>10} "
        f"device {d['device']:2d} [{_bus_hex(d['bus_id'])}] {d['name']}"
    )


def _header(
    opts: Options,
    shape: tuple[int, int],
    backend: _Backend,
    devices: list[dict[str, Any]],
    notes: list[str],
) -> list[str]:
    """nccl-tests' writeDeviceReport and writeResultHeader: ``shape`` is (nThread, nGpus)
    as nccl-tests would show them for this run."""
    from .._capi.structs import STRUCT_VERSION

    lines = []
    if backend.loopback:
        lines.extend(LOOPBACK_BANNER.splitlines())
    factor = (opts.stepfactor or 1) > 1
    step = f"{opts.stepfactor}(factor)" if factor else f"{opts.stepbytes}(bytes)"
    lines += [
        f"# nccl-tests version {NCCL_TESTS_FORMAT} nccl-headers={STRUCT_VERSION} "
        f"nccl-library={_version_code(backend.nccl_version)}",
        f"# Collective test starting: {opts.collective.tests_binary}",
        f"# nThread {shape[0]} nGpus {shape[1]} minBytes {opts.minbytes} maxBytes "
        f"{opts.maxbytes} step: {step} warmup iters: {opts.warmup_iters} iters: {opts.iters} "
        f"agg iters: {opts.agg_iters} validation: {opts.check} graph: {opts.cudagraph} "
        f"unalign: {opts.unalign}",
    ]
    blocking = {
        1: "# Blocking Enabled: wait and barrier after each inner iteration (-m) ",
        2: "# Blocking Enabled: wait after each inner iteration (-m), no barrier ",
        3: "# Blocking Enabled: wait and barrier after each outer iteration (-n); "
        "time excludes barrier ",
    }
    if opts.blocking in blocking:
        lines.append(blocking[opts.blocking])
    if opts.parallel_init:
        lines.append("# Parallel Init Enabled: threads call into NcclInitRank concurrently ")
    lines.extend(notes)
    lines += ["#", "# Using devices"]
    lines += [_device_line(d) for d in devices]
    lines += _table_header(bool(opts.report_cputime), bool(opts.report_timestamps))
    return lines


class _JsonText:
    """nccl-tests' hand-written JSON: compact, doubles as ``%lf``, booleans as the strings
    ``"true"``/``"false"`` (its jsonBool), NaN as ``"nan"``."""

    @classmethod
    def dump(cls, value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ",".join(f"{json.dumps(k)}:{cls.dump(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + ",".join(cls.dump(v) for v in value) + "]"
        if isinstance(value, bool):
            return '"true"' if value else '"false"'
        if isinstance(value, float):
            return f"{value:f}" if value == value and abs(value) != float("inf") else '"nan"'
        if value is None:
            return "null"
        if isinstance(value, int):
            return str(value)
        return json.dumps(str(value))


def _claim_output_file(path: str) -> str:
    """nccl-tests' -J: create ``path``, or ``path.0``, ``path.1`` ... where it exists;
    returns the name taken (an empty file, filled at the end of the run)."""
    candidate, n = path, 0
    while True:
        try:
            with open(candidate, "x", encoding="utf-8"):
                return candidate
        except FileExistsError:
            candidate, n = f"{path}.{n}", n + 1
        except OSError as e:
            raise PerfError(f"-J {path}: cannot create {candidate}: {e.strerror or e}") from None


def _write_tests_json(
    path: str,
    opts: Options,
    shape: tuple[int, int],
    backend: _Backend,
    devices: list[dict[str, Any]],
    result: _Result,
    avg: float,
    started: str,
    bw_ok: bool | None = None,
) -> None:
    """The -J report, in nccl-tests' JSON (file version 3) layout; secrets in the
    environment are written as ``<set>`` (see :func:`pynccl._env.redact`)."""
    config: dict[str, Any] = {
        "nthreads": shape[0],
        "ngpus": shape[1],
        "minimum_bytes": opts.minbytes,
        "maximum_bytes": opts.maxbytes,
    }
    if (opts.stepfactor or 1) > 1:
        config["step_factor"] = opts.stepfactor
    else:
        config["step_bytes"] = opts.stepbytes
    config.update(
        warmup_iters=opts.warmup_iters,
        iterations=opts.iters,
        aggregated_iterations=opts.agg_iters,
        validation=opts.check,
        graph=opts.cudagraph,
        blocking_collectives=bool(opts.blocking),
        per_iter_timing=False,
        per_iter_skip=0,
        parallel_init=bool(opts.parallel_init),
        devices=[
            {
                "rank": d["rank"],
                "group": d.get("group", 0),
                "pid": d["pid"],
                "hostname": d["hostname"],
                "device": d["device"],
                "device_hex": _bus_hex(d["bus_id"]),
                "device_info": d["name"],
            }
            for d in devices
        ],
    )
    rows = []
    for row in result.rows:
        out = {k: row[k] for k in ("size", "count", "type", "redop")}
        out["root"] = f"{row['root']:6d}"  # nccl-tests writes the printed column
        for key in ("out_of_place", "in_place"):
            cell = row[key]
            out[key] = {
                ("cpu_time" if "cpu_time" in cell else "time"): cell.get("cpu_time", cell["time"]),
                "alg_bw": cell["alg_bw"],
                "bus_bw": cell["bus_bw"],
                "nwrong": None if cell["nwrong"] is None else float(cell["nwrong"]),
            }
        out["actual_iterations"] = opts.iters
        out["experiment_name"] = ""
        rows.append(out)
    doc = {
        "version": _JSON_FILE_VERSION,
        "start_time": started,
        "args": ["python -m pynccl perf", *opts.argv],
        "env": [f"{k}={redact(k, v)}" for k, v in os.environ.items()],
        "nccl_version": _version_code(backend.nccl_version),
        "config": config,
        "results": rows,
        "out_of_bounds": {"count": result.errors, "okay": result.errors == 0},
        "average_bus_bandwidth": {
            "bandwidth": float(avg),
            "okay": "unchecked" if bw_ok is None else bw_ok,
        },
        "errors": [""],
        "end_time": time.strftime(_TIME_FORMAT),
    }
    with open(path, "w", encoding="utf-8") as f:
        f.write(_JsonText.dump(doc))


def _write_json(
    path: str,
    opts: Options,
    nranks: int,
    backend: _Backend,
    devices: list[dict[str, Any]],
    result: _Result,
    avg: float,
    elapsed: float,
    bw_ok: bool | None = None,
) -> None:
    from .. import __version__

    doc = {
        "tool": "pynccl perf",
        "pynccl_version": __version__,
        "loopback": backend.loopback,
        "banner": LOOPBACK_NOTE if backend.loopback else None,
        "nranks": nranks,
        "parameters": opts.parameters(),
        "library": backend.as_json(),
        "devices": devices,
        "results": result.rows,
        "out_of_bounds": {"count": result.errors, "okay": result.errors == 0},
        "wrong_elements": result.wrong,
        "average_bus_bandwidth": avg,
        "min_bus_bandwidth": {"required": opts.tests_env.min_bw, "okay": bw_ok},
        "elapsed_s": elapsed,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def _write_plot(path: str, opts: Options, nranks: int, backend: _Backend, result: _Result) -> None:
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")  # no display needed
    plt = importlib.import_module("matplotlib.pyplot")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        series: dict[str, tuple[list[int], list[float]]] = {}
        for row in result.rows:
            tag = " ".join(str(row[k]) for k in ("type", "redop") if row[k] != "none")
            if row["root"] >= 0 and opts.root == -1:
                tag += f" root {row['root']}"
            for key, label in (("out_of_place", "out-of-place"), ("in_place", "in-place")):
                cell = row[key]
                if cell is None:
                    continue
                xs, ys = series.setdefault(f"{tag} {label}".strip(), ([], []))
                xs.append(row["size"])
                ys.append(cell["bus_bw"])
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        title = f"{opts.collective.name}, {nranks} ranks, NCCL {backend.nccl_version}"
        if backend.loopback:
            title += "\nLOOPBACK: host memory, not NCCL"
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
