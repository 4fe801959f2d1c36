"""Rank 0's report: the table rows (nccl-tests' columns), the progress note, the header
and loopback banner, the JSON and the plot."""

from __future__ import annotations

import importlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

from ._options import Options

# --------------------------------------------------------------------------------------
# Output


def _fmt(value: float, width: int) -> str:
    """nccl-tests' ``getFloatStr``: the most decimals (2, 1, 0) that fit in ``width``."""
    for spec in (".2f", ".1f", ".0f"):
        text = f"{value:{width}{spec}}"
        if len(text) <= width:
            return text
    return f"{value:{width}.1e}" if width >= 7 else f"{value:{width}.0e}"


_HEADER = (
    "#\n"
    f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}           out-of-place"
    "                       in-place\n"
    f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  "
    f"{'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}  "
    f"{'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}\n"
    f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  "
    f"{'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  "
    f"{'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}"
)

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


def _cell(result: dict[str, Any] | None) -> str:
    if result is None:  # no in-place form
        return f"  {'-':>7}  {'-':>6}  {'-':>6}  {'-':>6}"
    wrong = result["nwrong"]
    wrong_text = "N/A" if wrong is None else f"{float(wrong):g}"
    return (
        f"  {_fmt(result['time'], 7)}  {_fmt(result['alg_bw'], 6)}  "
        f"{_fmt(result['bus_bw'], 6)}  {wrong_text:>6}"
    )


def _row_text(row: dict[str, Any]) -> str:
    return (
        f"{row['size']:12d}  {row['count']:12d}  {row['type']:>8}  {row['redop']:>6}  "
        f"{row['root']:6d}" + _cell(row["out_of_place"]) + _cell(row["in_place"])
    )


class _Console:
    """Where rank 0's report goes: whole lines, flushed, and a progress note on a terminal."""

    def __init__(self, out: IO[str] | None, total: int | None = None) -> None:
        self.out = out
        self.total = total
        self.rows = 0
        self.started = time.monotonic()
        err = sys.stderr
        self.tty: IO[str] | None = err if out is not None and err.isatty() else None
        self.shown = False

    def line(self, text: str) -> None:
        if self.out is None:
            return
        self._clear()
        self.out.write(text + "\n")
        self.out.flush()
        if text and not text.startswith("#"):
            self.rows += 1
        self._show()

    def _show(self) -> None:
        if self.tty is None or (self.total is not None and self.rows >= self.total):
            return
        of = f"/{self.total}" if self.total else ""
        self.tty.write(
            f"\r# {self.rows}{of} sizes done, {time.monotonic() - self.started:.0f} s ..."
        )
        self.tty.flush()
        self.shown = True

    def _clear(self) -> None:
        if self.shown and self.tty is not None:
            self.tty.write("\r\x1b[K")
            self.tty.flush()
            self.shown = False

    def close(self) -> None:
        self._clear()


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


def _header(
    opts: Options, nranks: int, backend: _Backend, devices: list[dict[str, Any]], notes: list[str]
) -> list[str]:
    from .. import __version__

    lines = []
    if backend.loopback:
        lines.extend(LOOPBACK_BANNER.splitlines())
    step = (
        f"{opts.stepfactor}(factor)" if (opts.stepfactor or 1) > 1 else f"{opts.stepbytes}(bytes)"
    )
    lines.append(
        f"# pynccl perf {__version__}: {opts.collective.name} on {nranks} rank(s); "
        f"compare with nccl-tests' {opts.collective.tests_binary}"
    )
    lines.append(f"# libnccl {backend.nccl_version}: {backend.nccl_path} ({backend.nccl_rule})")
    lines.append(f"# libcudart: {backend.cudart_path} ({backend.cudart_rule})")
    lines.append(
        f"# nThread 1 nGpus 1 minBytes {opts.minbytes} maxBytes {opts.maxbytes} step: {step} "
        f"warmup iters: {opts.warmup_iters} iters: {opts.iters} agg iters: 1 "
        f"validation: {opts.check} graph: {opts.cudagraph}"
    )
    lines.extend(notes)
    lines.append("#")
    lines.append("# Using devices")
    for d in devices:
        bus = f" [{d['bus_id']}]" if d["bus_id"] else ""
        lines.append(
            f"#  Rank {d['rank']:2d} Group  0 Pid {d['pid']:6d} on {d['hostname']:>10} "
            f"device {d['device']:2d}{bus}"
        )
    lines.extend(_HEADER.splitlines())
    return lines


def _write_json(
    path: str,
    opts: Options,
    nranks: int,
    backend: _Backend,
    devices: list[dict[str, Any]],
    result: _Result,
    avg: float,
    elapsed: float,
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
