"""``python -m pynccl perf``: bandwidth sweeps of NCCL collectives, after NVIDIA's nccl-tests.

Usage::

    python -m pynccl perf [COLLECTIVE] [-b MIN] [-e MAX] [-f FACTOR | -i STEP] [-g NRANKS]
                          [-n ITERS] [-w WARMUP] [-c CHECK] [-o OP] [-d TYPE] [-r ROOT]
                          [-G GRAPH_LAUNCHES] [-a AVERAGE] [-T TIMEOUT]
                          [--json FILE] [--plot FILE.png]

COLLECTIVE is one of all_reduce (default), all_gather, reduce_scatter, broadcast,
reduce, gather, scatter, all_to_all, sendrecv. The flags mean what they mean for
nccl-tests' ``*_perf`` binaries (``-g`` is the number of ranks, one GPU and one
process each), and so do the columns: per size, the time of one operation (µs),
the algorithm bandwidth (bytes / time, GB/s = 1e9 B/s) and the bus bandwidth
(algorithm bandwidth times nccl-tests' factor: 2(n-1)/n for all-reduce; (n-1)/n
for all-gather, reduce-scatter, gather, scatter and all-to-all; 1 for broadcast,
reduce and send/recv), out of place and in place, and with ``-c`` the number of
wrong elements against a numpy reference computed on the host. Sizes and counts
follow nccl-tests too (per-rank counts of the gather/scatter family are rounded
down to 16 bytes), so the rows compare line by line with theirs.

Where it runs:

* Started by hand it launches ``-g`` ranks itself (through ``python -m pynccl
  launch``, which also enforces ``-T``), one per GPU; ``-g 1`` without ``-T``
  runs in this process. Rank 0's lines are shown without the launcher's prefix.
* Started by a launcher (torchrun, ``python -m pynccl launch``, mpirun, srun:
  whatever :func:`pynccl.bootstrap.detect_launch_env` recognises) each process is
  one rank and joins through :func:`pynccl.bootstrap.from_env`.
* Without a GPU it runs on pynccl's host-memory loopback libraries, says so in a
  banner and in the JSON, and keeps its default sweep short: those figures
  measure host memory and Python, not NCCL.

Defaults: on a GPU nccl-tests' own (``-b 32M -e 32M -i 1M -n 20 -w 1 -c 1``) with
``-g`` = every visible GPU; on the loopback ``-g 2 -b 8 -e 32M -f 2`` (a few
seconds). ``-c`` defaults to 0, with a note, where numpy is not installed: the
sweep itself needs nothing but the standard library. ``-d``/``-o`` take
nccl-tests' names (``float``, ``half``, ``bfloat16``, ``f8e4m3``...; ``sum``...
``mulsum``), comma-separated lists or ``all``; ``-r -1`` runs every root.
``mulsum`` is NCCL's PreMulSum with each rank scaling its own input by its own
scalar (1 on even ranks, 2 on odd ones).

Timing follows nccl-tests: a host clock around ``-n`` back-to-back operations and
a stream synchronize (or around ``-G`` replays of a CUDA graph holding them),
averaged over the ranks (``-a``); the same method on the loopback and on a GPU.

Exit status: 0 when every check passed, 1 when results were wrong or a rank
failed, 2 for a usage error (including ``-G`` without a GPU).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from ctypes import addressof, create_string_buffer
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, NoReturn

from .enums import DataType, RedOp

if TYPE_CHECKING:
    from .cuda import Graph

__all__ = [
    "COLLECTIVES",
    "Collective",
    "Counts",
    "PerfError",
    "bus_factor",
    "main",
    "parse_size",
    "sweep_sizes",
]

_GB = 1.0e9  # nccl-tests' GB/s are 1e9 bytes per second
_MAX_SIZES = 10_000
_LOOPBACK_DEVICES = 8  # the loopback libcudart's default device count


class PerfError(Exception):
    """A problem with the request (bad flag combination, no GPU for ``-G``...): exit status 2."""


# --------------------------------------------------------------------------------------
# Collectives: counts and bandwidth, as nccl-tests computes them


@dataclass(frozen=True)
class Counts:
    """Element counts of one operation (nccl-tests' ``getCollByteCount``).

    ``param`` is the count passed to NCCL; ``send``/``recv`` the elements each
    buffer holds; ``send_offset``/``recv_offset`` the in-place offsets, in elements
    per rank (the in-place send buffer is ``recvbuf + send_offset * rank``).
    """

    send: int
    recv: int
    param: int
    send_offset: int
    recv_offset: int


@dataclass(frozen=True)
class Collective:
    """One benchmarked operation and nccl-tests' rules for its sizes and bandwidths."""

    name: str
    #: "flat" (count each side), "gather" (count in, count*n out), "scatter" (the
    #: reverse) or "alltoall" (count per peer, count*n each side).
    layout: str
    #: Bus-bandwidth factor: "2(n-1)/n", "(n-1)/n" or "1".
    bus: str
    reduces: bool = False
    rooted: bool = False
    #: False where NCCL defines no in-place form (all-to-all, send/recv).
    in_place: bool = True

    @property
    def tests_binary(self) -> str:
        """The nccl-tests program measuring the same thing, e.g. ``all_reduce_perf``."""
        return self.name.replace("all_to_all", "alltoall") + "_perf"

    def counts(self, nbytes: int, itemsize: int, nranks: int) -> Counts:
        """The counts nccl-tests uses for a ``nbytes`` step of its sweep."""
        count = nbytes // itemsize
        if self.layout == "flat":
            return Counts(count, count, count, 0, 0)
        # Per-rank blocks rounded down to 16 bytes, as nccl-tests >= 2.17 does.
        base = (count // nranks) & ~(max(16 // itemsize, 1) - 1)
        if self.layout == "gather":
            return Counts(base, base * nranks, base, base, 0)
        if self.layout == "scatter":
            return Counts(base * nranks, base, base, 0, base)
        return Counts(base * nranks, base * nranks, base, 0, 0)

    def bus_factor(self, nranks: int) -> float:
        """Bus bandwidth / algorithm bandwidth for ``nranks`` ranks."""
        if self.bus == "2(n-1)/n":
            return 2.0 * (nranks - 1) / nranks
        if self.bus == "(n-1)/n":
            return (nranks - 1) / nranks
        return 1.0

    def bandwidths(
        self, param: int, itemsize: int, seconds: float, nranks: int
    ) -> tuple[float, float]:
        """``(algbw, busbw)`` in GB/s for one operation of ``param`` elements taking ``seconds``."""
        moved = param * itemsize * (1 if self.layout == "flat" else nranks)
        algbw = moved / _GB / seconds if seconds > 0 else 0.0
        return algbw, algbw * self.bus_factor(nranks)


COLLECTIVES: dict[str, Collective] = {
    c.name: c
    for c in (
        Collective("all_reduce", "flat", "2(n-1)/n", reduces=True),
        Collective("all_gather", "gather", "(n-1)/n"),
        Collective("reduce_scatter", "scatter", "(n-1)/n", reduces=True),
        Collective("broadcast", "flat", "1", rooted=True),
        Collective("reduce", "flat", "1", reduces=True, rooted=True),
        Collective("gather", "gather", "(n-1)/n", rooted=True),
        Collective("scatter", "scatter", "(n-1)/n", rooted=True),
        Collective("all_to_all", "alltoall", "(n-1)/n", in_place=False),
        Collective("sendrecv", "flat", "1", in_place=False),
    )
}

# Spellings of the collectives people type: nccl-tests' binaries, NCCL's names.
_COLL_ALIASES = {re.sub(r"[_\-]", "", name): name for name in COLLECTIVES} | {
    "alltoall": "all_to_all",
    "bcast": "broadcast",
    "p2p": "sendrecv",
}


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``collective`` for ``nranks`` ranks."""
    return _collective(collective).bus_factor(nranks)


def _collective(name: str) -> Collective:
    key = re.sub(r"[_\-]", "", name.lower())
    key = key[: -len("perf")] if key.endswith("perf") else key
    try:
        return COLLECTIVES[_COLL_ALIASES[key]]
    except KeyError:
        raise ValueError(
            f"unknown collective {name!r}; expected one of {', '.join(COLLECTIVES)}"
        ) from None


def _collective_arg(text: str) -> Collective:
    try:
        return _collective(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --------------------------------------------------------------------------------------
# Sizes

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from nccl-tests' notation: ``8``, ``64K``, ``1.5M``, ``32M``, ``1G`` (powers of 1024).

    A trailing ``B``/``iB`` is accepted (``64KiB``). Raises ``ValueError`` for
    anything else, naming the text.
    """
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: expected a byte count with an optional K, M or G "
            "suffix (powers of 1024), e.g. 8, 64K, 32M, 1G"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def sweep_sizes(minbytes: int, maxbytes: int, factor: int, step: int) -> list[int]:
    """The sizes nccl-tests visits: from ``minbytes`` times ``factor`` (or plus ``step``
    when ``factor`` is 1) while not above ``maxbytes``."""
    if minbytes > maxbytes:
        raise PerfError(f"minimum size {minbytes} B is above the maximum {maxbytes} B (-b > -e)")
    if factor > 1 and minbytes == 0:
        raise PerfError("-b 0 with a step factor (-f) never grows: start at 1 byte or more")
    if factor <= 1 and step <= 0:
        raise PerfError(f"-i {step}: the step must be at least 1 byte when -f is 1")
    out: list[int] = []
    size = minbytes
    while size <= maxbytes:
        out.append(size)
        if len(out) > _MAX_SIZES:
            raise PerfError(
                f"-b {minbytes} -e {maxbytes} with step {'x' + str(factor) if factor > 1 else step}"
                f" gives more than {_MAX_SIZES} sizes; use a larger -f or -i"
            )
        size = size * factor if factor > 1 else size + step
    return out


def _doubling(minbytes: int, maxbytes: int) -> list[int]:
    """nccl-tests' warm-up sizes: ``minbytes`` doubling up to ``maxbytes``."""
    out, size = [], max(minbytes, 1)
    while size <= maxbytes:
        out.append(size)
        size *= 2
    return out or [minbytes]


# --------------------------------------------------------------------------------------
# Types and ops, by nccl-tests' names

_TYPES: dict[str, DataType] = {
    "int8": DataType.INT8,
    "uint8": DataType.UINT8,
    "int32": DataType.INT32,
    "uint32": DataType.UINT32,
    "int64": DataType.INT64,
    "uint64": DataType.UINT64,
    "half": DataType.FLOAT16,
    "float": DataType.FLOAT32,
    "double": DataType.FLOAT64,
    "bfloat16": DataType.BFLOAT16,
    "f8e4m3": DataType.FLOAT8_E4M3,
    "f8e5m2": DataType.FLOAT8_E5M2,
}
_TYPE_NAMES = {dt: name for name, dt in _TYPES.items()}
_OPS = ("sum", "prod", "max", "min", "avg", "mulsum")
_REDOP = {
    "sum": RedOp.SUM,
    "prod": RedOp.PROD,
    "max": RedOp.MAX,
    "min": RedOp.MIN,
    "avg": RedOp.AVG,
}


def _parse_types(text: str) -> list[str]:
    """``-d``: nccl-tests' names (``float``, ``half``...), pynccl's (``float32``...), ``all``,
    or a comma-separated list."""
    if text.strip().lower() == "all":
        return ["all"]
    out: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        if name in _TYPES:
            out.append(name)
            continue
        from .dtypes import as_datatype

        try:
            out.append(_TYPE_NAMES[as_datatype(part.strip())])
        except TypeError:
            raise argparse.ArgumentTypeError(
                f"unknown data type {part.strip()!r}; expected one of {', '.join(_TYPES)} "
                "(or numpy's names such as float32), a comma-separated list, or 'all'"
            ) from None
    return list(dict.fromkeys(out))  # each once, in the order given


def _parse_ops(text: str) -> list[str]:
    """``-o``: sum, prod, max, min, avg, mulsum, ``all``, or a comma-separated list."""
    if text.strip().lower() == "all":
        return ["all"]
    out = []
    for part in text.split(","):
        name = part.strip().lower()
        if name not in _OPS:
            raise argparse.ArgumentTypeError(
                f"unknown reduction op {part.strip()!r}; expected one of {', '.join(_OPS)}, "
                "a comma-separated list, or 'all'"
            )
        out.append(name)
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------------------
# Options


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{what} must be >= {low}, got {value}")
        return value

    return parse


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _timeout_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"timeout must be a number of seconds, got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"timeout must be >= 0 seconds, got {value:g}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's default exits; main() wants a code
        raise PerfError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m pynccl perf",
        description="Bandwidth sweep of an NCCL collective, with nccl-tests' flags and columns. "
        "Without a GPU it runs on pynccl's host-memory loopback libraries (and says so).",
        epilog="Defaults on a GPU are nccl-tests' (-b 32M -e 32M -i 1M -n 20 -w 1 -c 1) with -g "
        "= every visible GPU; on the loopback -g 2 -b 8 -e 32M -f 2. Sizes take K/M/G suffixes "
        "(powers of 1024).",
    )
    p.add_argument(
        "collective",
        nargs="?",
        default="all_reduce",
        type=_collective_arg,
        help=f"one of {', '.join(COLLECTIVES)} (default all_reduce)",
    )
    p.add_argument("-b", "--minbytes", type=_size_arg, help="smallest size in bytes")
    p.add_argument("-e", "--maxbytes", type=_size_arg, help="largest size in bytes")
    p.add_argument("-f", "--stepfactor", type=_int_at_least(1, "-f"), help="multiply the size by")
    p.add_argument("-i", "--stepbytes", type=_size_arg, help="add to the size (when -f is 1)")
    p.add_argument("-g", "--ngpus", type=_int_at_least(1, "-g"), help="number of ranks (GPUs)")
    p.add_argument("-n", "--iters", type=_int_at_least(1, "-n"), help="timed iterations")
    p.add_argument("-w", "--warmup_iters", type=_int_at_least(0, "-w"), help="warm-up iterations")
    p.add_argument("-c", "--check", type=_int_at_least(0, "-c"), help="check results N times")
    p.add_argument("-o", "--op", type=_parse_ops, default=["sum"], help="reduction op(s)")
    p.add_argument("-d", "--datatype", type=_parse_types, default=["float"], help="data type(s)")
    p.add_argument(
        "-r", "--root", type=_int_at_least(-1, "-r"), default=0, help="root rank (-1: every rank)"
    )
    p.add_argument(
        "-G", "--cudagraph", type=_int_at_least(0, "-G"), default=0, help="CUDA graph launches"
    )
    p.add_argument(
        "-a",
        "--average",
        type=_int_at_least(0, "-a"),
        default=1,
        help="time reported: 0 rank 0's, 1 mean (default), 2 min, 3 max over ranks",
    )
    p.add_argument(
        "-T", "--timeout", type=_timeout_arg, default=0.0, help="stop after S seconds (0: never)"
    )
    p.add_argument("--json", metavar="FILE", help="write every row and the run's setup as JSON")
    p.add_argument(
        "--plot", metavar="FILE.png", help="plot bus bandwidth against size (matplotlib)"
    )
    return p


@dataclass
class Options:
    """The parsed command line; ``None`` fields take the defaults of the chosen backend."""

    collective: Collective
    minbytes: int | None
    maxbytes: int | None
    stepfactor: int | None
    stepbytes: int | None
    ngpus: int | None
    iters: int | None
    warmup_iters: int | None
    check: int | None
    op: list[str]
    datatype: list[str]
    root: int
    cudagraph: int
    average: int
    timeout: float
    json: str | None
    plot: str | None

    def resolve(self, loopback: bool) -> None:
        """Fill the defaults: nccl-tests' on a GPU, a short sweep on the loopback."""
        if loopback:
            defaults = {"minbytes": 8, "maxbytes": 32 << 20, "stepfactor": 2, "stepbytes": 1 << 20}
        else:
            defaults = {"minbytes": 32 << 20, "maxbytes": 32 << 20, "stepfactor": 1}
            defaults["stepbytes"] = 1 << 20
        given_b, given_e = self.minbytes is not None, self.maxbytes is not None
        if self.minbytes is None:
            self.minbytes = defaults["minbytes"]
            if given_e and self.maxbytes is not None and self.minbytes > self.maxbytes:
                self.minbytes = self.maxbytes  # "-e 1M" alone: a sweep ending there
        if self.maxbytes is None:
            self.maxbytes = max(defaults["maxbytes"], self.minbytes if given_b else 0)
        if self.stepfactor is None:
            self.stepfactor = defaults["stepfactor"]
        if self.stepbytes is None:
            self.stepbytes = defaults["stepbytes"]
        if self.iters is None:
            self.iters = 20
        if self.warmup_iters is None:
            self.warmup_iters = 1

    @property
    def sizes(self) -> list[int]:
        """The sweep (after :meth:`resolve`)."""
        assert self.minbytes is not None and self.maxbytes is not None
        assert self.stepfactor is not None and self.stepbytes is not None
        return sweep_sizes(self.minbytes, self.maxbytes, self.stepfactor, self.stepbytes)

    def parameters(self) -> dict[str, Any]:
        """The run's parameters for the JSON report."""
        return {
            "collective": self.collective.name,
            "minbytes": self.minbytes,
            "maxbytes": self.maxbytes,
            "stepfactor": self.stepfactor,
            "stepbytes": self.stepbytes,
            "iters": self.iters,
            "warmup_iters": self.warmup_iters,
            "check": self.check,
            "ops": self.op,
            "datatypes": self.datatype,
            "root": self.root,
            "cudagraph": self.cudagraph,
            "average": self.average,
        }


def _parse(argv: Sequence[str]) -> Options:
    ns = _parser().parse_args(list(argv))
    opts = Options(**vars(ns))
    if opts.average > 3:
        raise PerfError(f"-a {opts.average}: expected 0 (rank 0), 1 (mean), 2 (min) or 3 (max)")
    if not opts.collective.reduces and opts.op != ["sum"]:
        raise PerfError(f"-o: {opts.collective.name} takes no reduction op")
    if opts.root != 0 and not opts.collective.rooted:
        raise PerfError(f"-r: {opts.collective.name} has no root")
    if opts.plot is not None:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            raise PerfError(
                "--plot needs matplotlib, which is not installed: "
                "pip install 'pynccl[plot]' (or pip install matplotlib)"
            ) from None
    return opts


def _check_combination(coll: Collective, dtypes: list[str], ops: list[str]) -> None:
    """Refuse op/type pairs that cannot run, before any rank starts."""
    if not coll.reduces or "all" in dtypes:
        return
    if "avg" in ops:
        ints = [d for d in dtypes if _TYPES[d].is_integer]
        if ints:
            raise PerfError(
                f"-o avg is defined for floating-point types only, not {', '.join(ints)}"
            )


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


# --------------------------------------------------------------------------------------
# Host reference data (numpy)

_EPS = {
    DataType.FLOAT16: 2.0**-10,
    DataType.BFLOAT16: 2.0**-7,
    DataType.FLOAT32: 2.0**-23,
    DataType.FLOAT64: 2.0**-52,
    DataType.FLOAT8_E4M3: 2.0**-3,
    DataType.FLOAT8_E5M2: 2.0**-2,
}
# Largest n such that every integer in [-n, n] is exact in the type.
_EXACT_INT = {
    DataType.FLOAT16: 2048,
    DataType.BFLOAT16: 256,
    DataType.FLOAT32: 1 << 24,
    DataType.FLOAT64: 1 << 53,
    DataType.FLOAT8_E4M3: 16,
    DataType.FLOAT8_E5M2: 8,
}
_M64 = (1 << 64) - 1
_CHUNK = 1 << 22  # elements per host-side piece of a check (bounded host memory)


class _Data:
    """Deterministic per-rank inputs and their numpy references.

    Element ``i`` of rank ``r``'s send buffer is a hash of ``(r, i, rep)``, so any
    slice of any rank's data can be produced on its own (a rank computes only what
    it checks), and stale data from an earlier check never passes. Values are
    small integers (powers of two for ``prod``), exact in every type, so float
    results are exact wherever the sums stay within the type's integer range and
    within a stated tolerance elsewhere (averages, fp8 across many ranks).
    """

    def __init__(self, np: Any, dtype: DataType, op: str | None, nranks: int, rep: int) -> None:
        from .dtypes import to_numpy_dtype

        self.np = np
        self.dtype = dtype
        self.op = op
        self.nranks = nranks
        self.seed = (rep * 0x94D049BB133111EB + 0x2545F4914F6CDD1D) & _M64
        self.np_dtype = to_numpy_dtype(dtype)
        self.bits = np.dtype(f"u{dtype.itemsize}")
        scale_max = 2 if op == "mulsum" else 1
        if op == "prod":
            self.table = [-1.0, 1.0, 2.0, 0.5] if nranks <= 8 else [-1.0, 1.0]
            if dtype.is_integer:
                self.table = [1.0, 2.0, 3.0] if dtype in _UNSIGNED else [-2.0, -1.0, 1.0, 2.0]
        else:
            k = 8
            if dtype.is_float and op in ("sum", "avg", "mulsum"):
                k = max(1, min(8, _EXACT_INT[dtype] // (nranks * scale_max)))
            low = 0 if dtype in _UNSIGNED else -k
            self.table = [float(v) for v in range(low, k + 1)]
        self.vmax = max(abs(v) for v in self.table) * scale_max
        self.values_table = np.array(self.table, dtype=np.float64).astype(self.np_dtype)

    def values(self, rank: int, lo: int, hi: int) -> Any:
        """Elements ``lo..hi`` of ``rank``'s send buffer, in the element type."""
        np = self.np
        z = np.arange(lo, hi, dtype=np.uint64)
        z *= np.uint64(0x9E3779B97F4A7C15)
        z += np.uint64((self.seed + (rank + 1) * 0xD1B54A32D192ED03) & _M64)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        return self.values_table[z % np.uint64(len(self.table))]

    def reduce(self, lo: int, hi: int) -> tuple[Any, float | None]:
        """op over every rank of elements ``lo..hi``: (reference, tolerance or None if exact)."""
        np = self.np
        n = self.nranks
        if self.dtype.is_integer:
            acc = None
            for r in range(n):
                x = self.values(r, lo, hi)
                if self.op == "mulsum":
                    x = np.multiply(x, np.array(_mulsum_scale(r), dtype=self.np_dtype))
                if acc is None:
                    acc = x.copy()
                elif self.op in ("sum", "mulsum"):
                    np.add(acc, x, out=acc)
                elif self.op == "prod":
                    np.multiply(acc, x, out=acc)
                elif self.op == "max":
                    np.maximum(acc, x, out=acc)
                else:
                    np.minimum(acc, x, out=acc)
            return acc, None
        acc64 = None
        for r in range(n):
            x = self.values(r, lo, hi).astype(np.float64)
            if self.op == "mulsum":
                x *= _mulsum_scale(r)
            if acc64 is None:
                acc64 = x
            elif self.op in ("sum", "avg", "mulsum"):
                acc64 += x
            elif self.op == "prod":
                acc64 *= x
            elif self.op == "max":
                np.maximum(acc64, x, out=acc64)
            else:
                np.minimum(acc64, x, out=acc64)
        assert acc64 is not None
        if self.op == "avg":
            acc64 /= n
        # Rounding of each partial result, in any reduction order.
        tol = _EPS[self.dtype] * (n + 2) * n * self.vmax
        return acc64, tol

    def compare(self, got: Any, expected: Any, tol: float | None) -> int:
        """Number of elements of ``got`` that differ from ``expected`` (beyond ``tol``)."""
        np = self.np
        if tol is None:  # exact: compare the bits (also right for -0.0 and NaN payloads)
            return int(np.count_nonzero(got.view(self.bits) != expected.view(self.bits)))
        diff = np.abs(got.astype(np.float64) - expected)
        return int(np.count_nonzero(~(diff <= tol)))  # NaN counts as wrong


_UNSIGNED = frozenset({DataType.UINT8, DataType.UINT32, DataType.UINT64})


def _mulsum_scale(rank: int) -> int:
    """The ``mulsum`` (PreMulSum) scalar of ``rank``: each rank scales its own input by
    its own scalar, as in NCCL; powers of two keep the sums exact."""
    return 2 if rank % 2 else 1


_Expect = Callable[[int, int], "tuple[Any, float | None]"]


def _expected(coll: Collective, data: _Data, rank: int, root: int, c: Counts) -> _Expect | None:
    """What ``rank`` should receive: a function giving elements ``lo..hi`` of its result
    (and the tolerance, None for exact), so big results are checked a chunk at a time;
    ``None`` where the result is undefined (reduce and gather off the root)."""
    n, p, name = data.nranks, c.param, coll.name

    def blocks(piece: Callable[[int, int, int], Any]) -> _Expect:
        # A result made of n blocks of p elements; block j, elements a..b is piece(j, a, b).
        def expect(lo: int, hi: int) -> tuple[Any, float | None]:
            parts = []
            while lo < hi:
                j, a = divmod(lo, p)
                b = min(p, a + hi - lo)
                parts.append(piece(j, a, b))
                lo += b - a
            return data.np.concatenate(parts), None

        return expect

    if name in ("all_reduce", "reduce"):
        if name == "reduce" and rank != root:
            return None
        return data.reduce
    if name == "reduce_scatter":
        return lambda lo, hi: data.reduce(rank * p + lo, rank * p + hi)
    if name == "broadcast":
        return lambda lo, hi: (data.values(root, lo, hi), None)
    if name == "scatter":
        return lambda lo, hi: (data.values(root, rank * p + lo, rank * p + hi), None)
    if name == "sendrecv":  # from the previous rank of the ring
        return lambda lo, hi: (data.values((rank - 1) % n, lo, hi), None)
    if name == "all_to_all":  # block j: rank j's block for this rank
        return blocks(lambda j, a, b: data.values(j, rank * p + a, rank * p + b))
    if name == "gather" and rank != root:
        return None
    return blocks(lambda j, a, b: data.values(j, a, b))  # all_gather, gather on the root


# --------------------------------------------------------------------------------------
# One rank


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


def _backend() -> _Backend:
    from . import library

    L = library.lib()
    rt = library.cudart()
    return _Backend(
        loopback=_is_loopback_path(rt.path) or _is_loopback_path(L.path),
        nccl_path=L.path,
        nccl_rule=L.rule,
        nccl_version=".".join(str(v) for v in L.version),
        cudart_path=rt.path,
        cudart_rule=rt.rule,
    )


def _is_loopback_path(path: str) -> bool:
    base = os.path.basename(path)
    return base.startswith("libpynccl_loopback") or "/pynccl/loopback" in path.replace(os.sep, "/")


@dataclass
class _Result:
    rows: list[dict[str, Any]] = field(default_factory=list)
    wrong: int = 0  # wrong elements, all rows
    errors: int = 0  # (size, placement) cells with wrong elements: nccl-tests' "out of bounds"
    busbw_sum: float = 0.0
    busbw_count: int = 0


class _Bench:
    """One rank of a sweep: buffers, stream, timing, checks; rank 0 reports."""

    _H2D = 1
    _D2H = 2

    def __init__(self, opts: Options, comm: Any, console: _Console) -> None:
        from . import library
        from .cuda import DeviceBuffer, Stream

        self.opts = opts
        self.comm = comm
        self.rank = int(comm.rank)
        self.nranks = int(comm.size)
        self.console = console
        self.rt = library.cudart()
        self.coll = opts.collective
        self.stream = Stream(non_blocking=True)
        self.s = self.stream.handle
        self.bufs: list[Any] = []
        assert opts.maxbytes is not None
        # Every layout keeps both sides within maxbytes (per-rank blocks are count/n).
        nbytes = max(opts.maxbytes, 64)
        try:
            self.send = self._alloc(DeviceBuffer, nbytes)
            self.recv = self._alloc(DeviceBuffer, nbytes)
            self.scratch = self._alloc(DeviceBuffer, 64)
            for buf in (self.send, self.recv):
                buf.fill_zero(self.s)  # timed runs without -c still see defined data
            self.stream.synchronize()
        except BaseException:
            self.close()
            raise
        self.rep = 0
        self.np: Any = None
        if opts.check:
            import numpy

            self.np = numpy

    def _alloc(self, cls: Any, nbytes: int) -> Any:
        buf = cls(nbytes, DataType.UINT8)
        self.bufs.append(buf)
        return buf

    def close(self) -> None:
        for buf in self.bufs:
            buf.close()
        self.bufs.clear()
        self.stream.close()

    # -- small collectives between the ranks --------------------------------------------

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        if nbytes:
            self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.s)

    def _scalar(self, value: float, dtype: DataType, op: RedOp | None) -> float:
        """All-reduce one number across the ranks (``op=None``: rank 0's value)."""
        fmt = "<d" if dtype is DataType.FLOAT64 else "<q"
        host = create_string_buffer(struct.pack(fmt, value), 8)
        ptr = self.scratch.ptr
        self._copy(ptr, addressof(host), 8, self._H2D)
        if op is None:
            self.comm.broadcast(ptr, ptr, root=0, count=1, dtype=dtype, stream=self.s)
        else:
            self.comm.all_reduce(ptr, ptr, op, count=1, dtype=dtype, stream=self.s)
        self._copy(addressof(host), ptr, 8, self._D2H)
        self.stream.synchronize()
        return float(struct.unpack(fmt, host.raw)[0])

    def barrier(self) -> None:
        """Every rank has reached this point (a one-element all-reduce, waited for)."""
        self._scalar(0, DataType.INT64, RedOp.SUM)

    def devices(self) -> list[dict[str, Any]]:
        """Every rank's pid, host, device and PCI bus id (an all-gather of fixed records)."""
        from .cuda import DeviceBuffer

        device = int(self.comm.device)
        bus = create_string_buffer(32)
        try:
            self.rt.cudaDeviceGetPCIBusId(bus, 32, device)
        except Exception:  # the loopback or an old runtime: the bus id is decoration
            bus.value = b""
        host = socket.gethostname().encode()[:48]
        record = struct.pack("<qq48s32s", os.getpid(), device, host, bus.value[:32])
        size = len(record)
        mine = create_string_buffer(record, size)
        everyone = create_string_buffer(size * self.nranks)
        tmp = self._alloc(DeviceBuffer, size * (self.nranks + 1))
        self._copy(tmp.ptr, addressof(mine), size, self._H2D)
        self.comm.all_gather(
            tmp.ptr, tmp.ptr + size, count=size, dtype=DataType.UINT8, stream=self.s
        )
        self._copy(addressof(everyone), tmp.ptr + size, size * self.nranks, self._D2H)
        self.stream.synchronize()
        out = []
        for r in range(self.nranks):
            pid, dev, hostname, busid = struct.unpack_from("<qq48s32s", everyone, r * size)
            out.append(
                {
                    "rank": r,
                    "pid": pid,
                    "hostname": hostname.rstrip(b"\0").decode(errors="replace"),
                    "device": dev,
                    "bus_id": busid.rstrip(b"\0").decode(errors="replace"),
                }
            )
        return out

    # -- one operation ------------------------------------------------------------------

    def _op_handle(self, op: str, dtype: DataType) -> Any:
        if op == "mulsum":
            scale = _mulsum_scale(self.rank)
            return self.comm.create_premul_sum(
                float(scale) if dtype.is_float else scale, dtype, "host"
            )
        return _REDOP[op]

    def _pointers(self, c: Counts, itemsize: int, in_place: bool) -> tuple[int, int]:
        if not in_place:
            return self.send.ptr, self.recv.ptr
        base = self.recv.ptr
        return (
            base + c.send_offset * self.rank * itemsize,
            base + c.recv_offset * self.rank * itemsize,
        )

    def _runner(
        self, c: Counts, dtype: DataType, op: Any, root: int, in_place: bool
    ) -> Callable[[], None]:
        """A no-argument function issuing the operation once (all arguments bound)."""
        sp, rp = self._pointers(c, dtype.itemsize, in_place)
        comm, n, s = self.comm, c.param, self.s
        name = self.coll.name
        if name == "all_reduce":
            return lambda: comm.all_reduce(sp, rp, op, count=n, dtype=dtype, stream=s)
        if name == "all_gather":
            return lambda: comm.all_gather(sp, rp, count=n, dtype=dtype, stream=s)
        if name == "reduce_scatter":
            return lambda: comm.reduce_scatter(sp, rp, op, count=n, dtype=dtype, stream=s)
        if name == "broadcast":
            return lambda: comm.broadcast(sp, rp, root=root, count=n, dtype=dtype, stream=s)
        if name == "reduce":
            return lambda: comm.reduce(sp, rp, op, root=root, count=n, dtype=dtype, stream=s)
        if name == "gather":
            return lambda: comm.gather(sp, rp, root=root, count=n, dtype=dtype, stream=s)
        if name == "scatter":
            return lambda: comm.scatter(sp, rp, root=root, count=n, dtype=dtype, stream=s)
        if name == "all_to_all":
            return lambda: comm.all_to_all(sp, rp, count=n, dtype=dtype, stream=s)
        from .groups import group

        nxt, prv = (self.rank + 1) % self.nranks, (self.rank - 1) % self.nranks

        def sendrecv() -> None:
            with group():
                comm.send(sp, nxt, count=n, dtype=dtype, stream=s)
                comm.recv(rp, prv, count=n, dtype=dtype, stream=s)

        return sendrecv

    # -- CUDA graphs ----------------------------------------------------------------------

    def _capture(self, run: Callable[[], None], times: int) -> Graph:
        """Capture ``times`` calls of ``run`` on the stream into a graph (thread-local
        capture mode, as nccl-tests)."""
        from .cuda import CaptureMode, Graph

        graph = Graph()
        with graph.capture(self.stream, CaptureMode.THREAD_LOCAL):
            for _ in range(times):
                run()
        return graph

    # -- timing and checking ---------------------------------------------------------------

    def _time(self, run: Callable[[], None]) -> float:
        """Seconds per operation, this rank's view (nccl-tests' BenchTime)."""
        iters = self.opts.iters
        assert iters is not None
        run()  # one untimed call, then line the ranks up
        self.stream.synchronize()
        self.barrier()
        launches = self.opts.cudagraph
        if launches:
            with self._capture(run, iters) as graph:
                self.barrier()
                start = time.perf_counter()
                for _ in range(launches):
                    graph.replay()
                self.stream.synchronize()
                elapsed = time.perf_counter() - start
            return elapsed / (iters * launches)
        start = time.perf_counter()
        for _ in range(iters):
            run()
        self.stream.synchronize()
        return (time.perf_counter() - start) / iters

    def _across_ranks(self, seconds: float) -> float:
        mode = self.opts.average
        if mode == 0:
            return self._scalar(seconds, DataType.FLOAT64, None)
        op = {1: RedOp.SUM, 2: RedOp.MIN, 3: RedOp.MAX}[mode]
        value = self._scalar(seconds, DataType.FLOAT64, op)
        return value / self.nranks if mode == 1 else value

    def _check_once(
        self,
        run: Callable[[], None],
        c: Counts,
        dtype: DataType,
        op: str | None,
        root: int,
        in_place: bool,
    ) -> int:
        """Fill fresh inputs, run the operation once, count this rank's wrong elements.

        Inputs are written and results compared a chunk at a time, so the host
        memory needed stays small whatever the size.
        """
        np = self.np
        self.rep += 1
        data = _Data(np, dtype, op, self.nranks, self.rep)
        size = dtype.itemsize
        sp, rp = self._pointers(c, size, in_place)
        # Zero the receive side (in place: the whole region), then write the inputs.
        region = c.recv * size
        if in_place:
            region = max(
                region + c.recv_offset * self.rank * size,
                c.send * size + c.send_offset * self.rank * size,
            )
        if region:
            self.rt.cudaMemsetAsync(self.recv.ptr, 0, region, self.s)
        for lo in range(0, c.send, _CHUNK):
            chunk = np.ascontiguousarray(data.values(self.rank, lo, min(c.send, lo + _CHUNK)))
            self._copy(sp + lo * size, chunk.ctypes.data, chunk.nbytes, self._H2D)
            self.stream.synchronize()  # before the host array goes
        if self.opts.cudagraph:
            with self._capture(run, 1) as graph:
                graph.replay()
                self.stream.synchronize()
        else:
            run()
        self.stream.synchronize()
        expect = _expected(self.coll, data, self.rank, root, c)
        if expect is None:
            return 0
        wrong = 0
        for lo in range(0, c.recv, _CHUNK):
            hi = min(c.recv, lo + _CHUNK)
            want, tol = expect(lo, hi)
            got = np.empty(hi - lo, dtype=data.np_dtype)
            self._copy(got.ctypes.data, rp + lo * size, got.nbytes, self._D2H)
            self.stream.synchronize()
            wrong += data.compare(got, want, tol)
        return wrong

    def _bench(
        self, c: Counts, dtype: DataType, op_name: str | None, op: Any, root: int, in_place: bool
    ) -> dict[str, Any]:
        run = self._runner(c, dtype, op, root, in_place)
        seconds = self._across_ranks(self._time(run))
        algbw, busbw = self.coll.bandwidths(c.param, dtype.itemsize, seconds, self.nranks)
        wrong: int | None = None
        if self.opts.check:
            self.barrier()
            total = 0
            for _ in range(self.opts.check):
                mine = self._check_once(run, c, dtype, op_name, root, in_place)
                total = int(self._scalar(mine, DataType.INT64, RedOp.SUM))
                if total:
                    break
            wrong = total
        return {"time": seconds * 1e6, "alg_bw": algbw, "bus_bw": busbw, "nwrong": wrong}

    # -- the sweep ------------------------------------------------------------------------

    def run_case(self, dtype_name: str, op_name: str | None, root: int, out: _Result) -> None:
        """nccl-tests' TimeTest: warm up, then one row per size."""
        dtype = _TYPES[dtype_name]
        opts = self.opts
        assert opts.minbytes is not None and opts.maxbytes is not None
        op = self._op_handle(op_name, dtype) if op_name is not None else RedOp.SUM
        self.barrier()
        for size in _doubling(opts.minbytes, opts.maxbytes):
            c = self.coll.counts(size, dtype.itemsize, self.nranks)
            run = self._runner(c, dtype, op, root, False)
            for _ in range(opts.warmup_iters or 0):
                run()
            self.stream.synchronize()
        for size in opts.sizes:
            c = self.coll.counts(size, dtype.itemsize, self.nranks)
            row: dict[str, Any] = {
                "size": max(c.send, c.recv) * dtype.itemsize,
                "count": c.param,
                "type": dtype_name,
                "redop": op_name if op_name is not None else "none",
                "root": root if self.coll.rooted else -1,
            }
            row["out_of_place"] = self._bench(c, dtype, op_name, op, root, False)
            row["in_place"] = (
                self._bench(c, dtype, op_name, op, root, True) if self.coll.in_place else None
            )
            for key in ("out_of_place", "in_place"):
                cell = row[key]
                if cell is not None:
                    out.busbw_sum += cell["bus_bw"]
                    out.busbw_count += 1
                    out.wrong += cell["nwrong"] or 0
                    out.errors += 1 if cell["nwrong"] else 0
            out.rows.append(row)
            self.console.line(_row_text(row))
        if op_name == "mulsum":  # (after an error the communicator is aborted anyway)
            self.comm.destroy_op(op)


def _cases(
    opts: Options, nranks: int, nccl_version: tuple[int, ...]
) -> list[tuple[str, str | None, int]]:
    """Every (type, op, root) the options ask for, in nccl-tests' order."""
    coll = opts.collective
    if opts.datatype == ["all"]:
        types = [n for n, dt in _TYPES.items() if nccl_version >= dt.first_release]
    else:
        types = opts.datatype
    ops: list[str | None]
    if not coll.reduces:
        ops = [None]
    elif opts.op == ["all"]:
        ops = list(_OPS)
    else:
        ops = list(opts.op)
    if coll.rooted:
        if opts.root >= nranks:
            raise PerfError(f"-r {opts.root}: the root must be below the {nranks} ranks")
        roots = list(range(nranks)) if opts.root == -1 else [opts.root]
    else:
        roots = [-1]
    out = []
    for t in types:
        for o in ops:
            if o == "avg" and _TYPES[t].is_integer:
                continue  # avg is for floating-point types (an explicit request was refused)
            for r in roots:
                out.append((t, o, r))
    return out


def _needs_ml_dtypes(types: list[str]) -> list[str]:
    return [
        t
        for t in types
        if _TYPES.get(t) in (DataType.BFLOAT16, DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2)
    ]


def _resolve_check(opts: Options, types: list[str]) -> list[str]:
    """Default ``-c`` to 1 where numpy is there (0, with a note, where it is not); refuse an
    explicit ``-c`` that cannot be honoured. Returns notes for the header."""
    explicit = opts.check is not None
    try:
        import numpy  # noqa: F401
    except ImportError:
        if explicit and opts.check:
            raise PerfError(
                f"-c {opts.check} checks results against numpy, which is not installed "
                "(pip install numpy), or pass -c 0"
            ) from None
        opts.check = 0
        return ["# validation off: numpy is not installed (pip install numpy to check results)"]
    if opts.check is None:
        opts.check = 1
    special = _needs_ml_dtypes(types)
    if opts.check and special:
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            names = ", ".join(special)
            if explicit:
                raise PerfError(
                    f"-c checks {names} with the ml_dtypes package, which is not installed "
                    "(pip install ml_dtypes), or pass -c 0"
                ) from None
            opts.check = 0
            return [f"# validation off: checking {names} needs ml_dtypes (pip install ml_dtypes)"]
    return []


def _header(
    opts: Options, nranks: int, backend: _Backend, devices: list[dict[str, Any]], notes: list[str]
) -> list[str]:
    from . import __version__

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
    from . import __version__

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


def _run_rank(opts: Options, comm: Any, backend: _Backend) -> int:
    """The sweep on this rank; rank 0 prints. Returns 0, or 1 when results were wrong.

    On an exception the communicator is aborted first (work may still be queued
    on it), then the buffers are freed.
    """
    lead = comm.rank == 0
    nranks = int(comm.size)
    lib_version = tuple(int(v) for v in backend.nccl_version.split("."))
    cases = _cases(opts, nranks, lib_version)
    notes = _resolve_check(opts, sorted({t for t, _, _ in cases}))
    if any(o == "mulsum" for _, o, _ in cases):
        try:
            import numpy  # noqa: F401  (create_premul_sum packs the scalar with it)
        except ImportError:
            raise PerfError("-o mulsum needs numpy (pip install numpy)") from None
    console = _Console(sys.stdout if lead else None, len(cases) * len(opts.sizes))
    started = time.monotonic()
    ok = False
    bench = None
    try:
        bench = _Bench(opts, comm, console)
        devices = bench.devices()
        for text in _header(opts, nranks, backend, devices, notes):
            console.line(text)
        result = _Result()
        for dtype_name, op_name, root in cases:
            bench.run_case(dtype_name, op_name, root, result)
        avg = result.busbw_sum / result.busbw_count if result.busbw_count else 0.0
        verdict = "FAILED" if result.errors else "OK"
        console.line(f"# {'Out of bounds values':<20} : {result.errors} {verdict}")
        console.line(f"# {'Avg bus bandwidth':<20} : {avg:g}")
        console.line("#")
        if backend.loopback:
            console.line("# (loopback: these figures are host memory, not NCCL)")
        if lead and opts.json:
            elapsed = time.monotonic() - started
            _write_json(opts.json, opts, nranks, backend, devices, result, avg, elapsed)
            console.line(f"# wrote {opts.json}")
        if lead and opts.plot:
            _write_plot(opts.plot, opts, nranks, backend, result)
            console.line(f"# wrote {opts.plot}")
        ok = True
        return 1 if result.errors else 0
    finally:
        console.close()
        if not ok:
            comm.abort()
        if bench is not None:
            bench.close()


# --------------------------------------------------------------------------------------
# Choosing the backend, joining or launching the ranks

_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
    "PYNCCL_LAUNCHER",
)


def _in_launcher() -> bool:
    return any(os.environ.get(v) for v in _LAUNCHER_VARS)


def _gpu_count() -> tuple[int, bool]:
    """(visible devices, whether they are the loopback's) without building anything."""
    from . import cuda, library

    n = cuda.device_count()
    if n == 0:
        return 0, False
    return n, _is_loopback_path(library.cudart().path)


def _use_loopback(nranks: int) -> None:
    """Make this process use the loopback libraries (no GPU and none configured)."""
    if nranks > _LOOPBACK_DEVICES:
        os.environ.setdefault("PYNCCL_LOOPBACK_DEVICES", str(nranks))
    try:
        from .testing import loopback

        loopback.use()
    except Exception as e:
        raise PerfError(
            f"there is no GPU here and the loopback libraries could not be prepared: "
            f"{type(e).__name__}: {e}"
        ) from e


def _loopback_env() -> dict[str, str]:
    """The environment that makes child processes use the loopback (built here, once)."""
    try:
        from .testing import loopback

        return dict(loopback.env())
    except Exception as e:
        raise PerfError(
            f"there is no GPU here and the loopback libraries could not be prepared: "
            f"{type(e).__name__}: {e}"
        ) from e


def _worker(opts: Options) -> int:
    """Inside a launcher: this process is one rank."""
    from .bootstrap import detect_launch_env, from_env

    env = detect_launch_env()
    if opts.ngpus is not None and opts.ngpus != env.world_size:
        raise PerfError(
            f"-g {opts.ngpus}, but the {env.launcher} launcher started {env.world_size} rank(s): "
            "drop -g inside a launcher, or start that many ranks"
        )
    gpus, loop = _gpu_count()
    if gpus == 0:
        _use_loopback(env.local_world_size or env.world_size)
        loop = True
    opts.resolve(loop)
    _ = opts.sizes  # validate before the rendezvous
    comm = from_env()
    return _finish(opts, comm)


def _finish(opts: Options, comm: Any) -> int:
    try:
        code = _run_rank(opts, comm, _backend())
    except BaseException:
        comm.abort()  # idempotent: _run_rank may have done it
        raise
    comm.destroy()
    return code


def _coordinate(opts: Options, argv: Sequence[str]) -> int:
    """Started by hand: pick the backend and run -g ranks."""
    gpus, loop_configured = _gpu_count()
    loop = gpus == 0 or loop_configured
    nranks = opts.ngpus if opts.ngpus is not None else (2 if loop else gpus)
    if not loop and nranks > gpus:
        raise PerfError(f"-g {nranks}: only {gpus} GPU(s) visible")
    opts.resolve(loop)
    sizes = opts.sizes  # validate before starting anything
    if opts.collective.rooted and opts.root >= nranks:
        raise PerfError(f"-r {opts.root}: the root must be below the {nranks} ranks")
    if nranks == 1 and not opts.timeout:  # -T needs the launcher's watch: see below
        from .comm import Communicator, UniqueId

        if gpus == 0:
            _use_loopback(1)
        comm = Communicator(1, UniqueId(), 0, device=0)
        return _finish(opts, comm)
    return _launch(opts, argv, nranks, loopback_build=gpus == 0, rows=len(sizes))


_PREFIX = re.compile(rb"^\[rank (\d+)\] ")


def _launch(
    opts: Options, argv: Sequence[str], nranks: int, loopback_build: bool, rows: int
) -> int:
    """Run ``python -m pynccl launch -n N -m pynccl perf ARGV`` and relay rank 0's report.

    The launcher starts, watches and stops the ranks; here only its stdout is read,
    with the ``[rank 0] `` prefix taken off rank 0's lines so the table reads as
    nccl-tests' does (other ranks' lines, and everything on stderr, keep theirs).
    """
    cmd = [sys.executable, "-m", "pynccl", "launch", "-n", str(nranks)]
    if opts.timeout:
        cmd += ["--timeout", f"{opts.timeout:g}"]
    cmd += ["-m", "pynccl", "perf", *argv]
    env = dict(os.environ)
    if loopback_build:
        env.update(_loopback_env())
    # The ranks import this very pynccl, wherever it was imported from.
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    if loopback_build and nranks > _LOOPBACK_DEVICES:
        env.setdefault("PYNCCL_LOOPBACK_DEVICES", str(nranks))
    known = opts.datatype != ["all"] and opts.op != ["all"] and opts.root != -1
    console = _Console(sys.stdout, rows * len(opts.datatype) * len(opts.op) if known else None)
    # Its own session: a terminal's Ctrl-C reaches it once, through the forwarding below.
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )

    def forward(signum: int, _frame: Any) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, forward)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            match = _PREFIX.match(raw)
            if match is not None and match.group(1) == b"0":
                raw = raw[match.end() :]
            console.line(raw.decode(errors="replace").rstrip("\n"))
        return proc.wait()
    finally:
        console.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if proc.poll() is None:  # only on an error here: the launcher stops its ranks
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m pynccl perf``; returns the exit status (see the module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if any(a in ("-h", "--help") for a in args):
            _parser().print_help()
            return 0
        opts = _parse(args)
        _check_combination(opts.collective, opts.datatype, opts.op)
        if _in_launcher():
            return _worker(opts)
        return _coordinate(opts, args)
    except PerfError as e:
        print(f"python -m pynccl perf: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("python -m pynccl perf: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from .errors import CudaError, NcclError, NotSupportedError

        if isinstance(e, (NcclError, CudaError, NotSupportedError, ValueError, TypeError, OSError)):
            print(f"python -m pynccl perf: {type(e).__name__}: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        return 1
