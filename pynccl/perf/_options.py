"""The command line: nccl-tests' type and op names, flags, :class:`Options`, and the
cases and checks they ask for once the ranks are known."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ..enums import DataType, RedOp
from ._sweep import COLLECTIVES, Collective, PerfError, _collective, parse_size, sweep_sizes

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
        from ..dtypes import as_datatype

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


def _collective_arg(text: str) -> Collective:
    try:
        return _collective(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
# What the options ask for, once the ranks and the library are known


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
