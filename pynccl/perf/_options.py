"""The command line: nccl-tests' type and op names, flags, :class:`Options`, and the
cases and checks they ask for once the ranks are known."""

from __future__ import annotations

import argparse
import importlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..enums import DataType, RedOp
from ._sweep import COLLECTIVES, Collective, PerfError, _collective, parse_size, sweep_sizes
from ._tests_env import NcclTestsEnv
from ._traffic import Traffic

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


def _root_arg(text: str) -> int:
    """``-r``: a rank, or ``all``/``-1`` for every rank in turn."""
    if text.strip().lower() == "all":
        return -1
    return _int_at_least(-1, "-r")(text)


#: nccl-tests flags pynccl does not implement: (short, long, default, why). The default
#: value is accepted (it asks for nothing); any other value is refused by name.
_UNSUPPORTED = (
    ("-x", "--cta_policy", -1, "pynccl's Config does not pass a CTA policy to perf's ranks"),
    ("-D", "--device_implementation", 0, "device-API kernels need CUDA code, not ctypes"),
    ("-V", "--device_cta_count", 16, "device-API kernels need CUDA code, not ctypes"),
    ("-M", "--memory", 0, "pynccl has no binding for cudaMemGetInfo"),
    ("-I", "--per_iter_timing", 0, "per-iteration CUDA event timing is not implemented"),
    ("-K", "--per_iter_skip", 0, "per-iteration CUDA event timing is not implemented"),
)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m pynccl perf",
        description="Bandwidth sweep of an NCCL collective, with nccl-tests' flags, columns and "
        "-J JSON. Without a GPU it runs on pynccl's host-memory loopback libraries (and says so).",
        epilog="Defaults on a GPU are nccl-tests' (-b 32M -e 32M -i 1M -n 20 -w 1 -c 1) with -g "
        "= every visible GPU; on the loopback -g 2 -b 8 -e 32M -f 2. Sizes take K/M/G suffixes "
        "(powers of 1024). Every rank is one process with one GPU: -t T -g G runs T*G ranks. "
        "nccl-tests' NCCL_TESTS_MIN_BW, NCCL_TESTS_DEVICE, NCCL_TESTS_SPLIT(_MASK) and "
        "NCCL_TESTS_ALLTOALLV_* variables work as there. "
        "nccl-tests flags pynccl lacks (" + ", ".join(u[0] for u in _UNSUPPORTED) + ") are "
        "refused by name unless given their default value.",
    )
    p.add_argument(
        "collective",
        nargs="?",
        default="all_reduce",
        type=_collective_arg,
        help=f"one of {', '.join(COLLECTIVES)} (default all_reduce)",
    )
    add = p.add_argument
    add("-t", "--nthreads", type=_int_at_least(1, "-t"), default=1,
        help="threads per process in nccl-tests; here ranks = t * g (default 1)")
    add("-g", "--ngpus", type=_int_at_least(1, "-g"),
        help="GPUs (ranks) per thread (default: every visible GPU, 2 on the loopback; "
        "1 when -t is given, as nccl-tests)")
    add("-b", "--minbytes", type=_size_arg, help="smallest size in bytes (K/M/G suffixes)")
    add("-e", "--maxbytes", type=_size_arg, help="largest size in bytes (K/M/G suffixes)")
    add("-i", "--stepbytes", type=_size_arg,
        help="add this to the size at each step when -f is 1 or not given (default 1M)")
    add("-f", "--stepfactor", type=_int_at_least(1, "-f"),
        help="multiply the size by this at each step (1: add -i instead; default 1, 2 on "
        "the loopback unless -i is given)")
    add("-n", "--iters", type=_int_at_least(1, "-n"), help="timed iterations (default 20)")
    add("-m", "--agg_iters", type=_int_at_least(1, "-m"), default=1,
        help="operations aggregated in one group per iteration (default 1)")
    add("-w", "--warmup_iters", type=_int_at_least(0, "-w"), help="warm-up iterations (default 1)")
    add("-N", "--run_cycles", type=_int_at_least(0, "-N"), default=1,
        help="run and print the sweep this many times (0: forever; default 1)")
    add("-p", "--parallel_init", type=_int_at_least(0, "-p"), default=0,
        help="0/1; every rank is its own process, so inits always run in parallel")
    add("-c", "--check", type=_int_at_least(0, "-c"),
        help="check results against numpy N times per size (default 1; 0 without numpy)")
    add("-o", "--op", type=_parse_ops, default=["sum"],
        help="sum/prod/max/min/avg/mulsum, a comma-separated list, or all (default sum)")
    add("-d", "--datatype", type=_parse_types, default=["float"],
        help=f"nccl-tests' type names ({', '.join(_TYPES)}), a comma-separated list, or all "
        "(default float)")
    add("-r", "--root", type=_root_arg, default=0,
        help="root rank of rooted collectives; all or -1: every rank in turn (default 0)")
    add("-z", "--blocking", type=_int_at_least(0, "-z"), default=0,
        help="0: none; 1: wait and barrier after each operation; 2: wait, no barrier; "
        "3: wait and barrier after each iteration, time excludes the barrier")
    add("-y", "--stream_null", type=_int_at_least(0, "-y"), default=0,
        help="1: run on the default (NULL) stream instead of a created one")
    add("-T", "--timeout", type=_timeout_arg, default=0.0, metavar="S",
        help="abort when one wait for the GPU takes over S seconds (0: never)")
    add("-G", "--cudagraph", type=_int_at_least(0, "-G"), default=0,
        help="capture -n iterations in a CUDA graph and launch it this many times")
    add("-C", "--report_cputime", type=_int_at_least(0, "-C"), default=0,
        help="1: report the host time to issue the operations (cputime column)")
    add("-S", "--report_timestamps", type=_int_at_least(0, "-S"), default=0,
        help="1: end each row with a timestamp")
    add("-J", "--output_file", metavar="FILE.json",
        help="write nccl-tests' JSON report there (FILE.json.0, .1 ... if it exists); like "
        "nccl-tests' it records the arguments and the whole environment")
    add("-a", "--average", type=_int_at_least(0, "-a"), default=1,
        help="time reported: 0 rank 0's, 1 mean (default), 2 min, 3 max over ranks")
    add("-u", "--unalign", type=_int_at_least(0, "-u"), default=0,
        help="shift both buffers by this many elements (misalignment; default 0)")
    add("-R", "--local_register", type=_int_at_least(0, "-R"), default=0,
        help="0: plain buffers; 1: ncclMemAlloc buffers registered with ncclCommRegister; "
        "2: ncclMemAlloc buffers in symmetric windows (ncclCommWindowRegister)")
    for short, long, default, _why in _UNSUPPORTED:
        add(short, long, dest=f"unsupported{short[1]}", type=int, default=default, metavar="N",
            help=f"nccl-tests' {long}: not supported (only {default} is accepted)")
    add("--json", metavar="FILE", help="write pynccl's JSON report (every row and the setup)")
    add("--plot", metavar="FILE.png", help="plot bus bandwidth against size (matplotlib)")
    return p


@dataclass
class Options:
    """The parsed command line; ``None`` fields take the defaults of the chosen backend."""

    collective: Collective
    nthreads: int
    minbytes: int | None
    maxbytes: int | None
    stepfactor: int | None
    stepbytes: int | None
    ngpus: int | None
    iters: int | None
    agg_iters: int
    warmup_iters: int | None
    run_cycles: int
    parallel_init: int
    check: int | None
    op: list[str]
    datatype: list[str]
    root: int
    blocking: int
    stream_null: int
    timeout: float
    cudagraph: int
    report_cputime: int
    report_timestamps: int
    output_file: str | None
    average: int
    unalign: int
    local_register: int
    json: str | None
    plot: str | None
    #: The arguments as given (for -J's "args").
    argv: list[str] = field(default_factory=list)
    #: nccl-tests' NCCL_TESTS_* variables (read with the arguments).
    tests_env: NcclTestsEnv = field(default_factory=NcclTestsEnv)
    #: alltoallv's traffic pattern (NCCL_TESTS_ALLTOALLV_*), None for the others.
    traffic: Traffic | None = None

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
            # nccl-tests' default factor is 1: a given -i means a linear step, also on
            # the loopback (whose own default sweep doubles)
            self.stepfactor = 1 if self.stepbytes is not None else defaults["stepfactor"]
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
            "nthreads": self.nthreads,
            "agg_iters": self.agg_iters,
            "run_cycles": self.run_cycles,
            "blocking": self.blocking,
            "stream_null": self.stream_null,
            "unalign": self.unalign,
            "local_register": self.local_register,
        }


def _unknown_flag(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """The first token that looks like a flag and is none of perf's. argparse would take
    the value after it for the collective ("-q 1": unknown collective '1')."""
    known = parser._option_string_actions  # every "-x" and "--long" the parser has
    takes_value = {opt for opt, action in known.items() if action.nargs != 0}
    longs = [opt for opt in known if opt.startswith("--")]
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--":
            return None
        if not token.startswith("-") or token == "-" or _NUMBER.match(token):
            continue
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            matches = [opt for opt in longs if opt.startswith(name)]  # argparse's prefixes
            if not matches:
                return name
            skip = "=" not in token and all(m in takes_value for m in matches)
            continue
        name = token[:2]
        if name not in known:
            return name
        skip = name in takes_value and len(token) == 2  # "-g 2", not "-g2"
    return None


_NUMBER = re.compile(r"^-\d")


def _parse(argv: Sequence[str]) -> Options:
    parser = _parser()
    unknown = _unknown_flag(parser, argv)
    if unknown is not None:
        raise PerfError(
            f"unknown flag {unknown}: neither nccl-tests nor pynccl has it "
            "(python -m pynccl perf --help lists the flags)"
        )
    ns = vars(parser.parse_args(list(argv)))
    for short, long, default, why in _UNSUPPORTED:
        value = ns.pop(f"unsupported{short[1]}")
        if value != default:
            raise PerfError(f"flag {short} ({long}) is not supported: {why}")
    opts = Options(**ns, argv=list(argv), tests_env=NcclTestsEnv.from_env())
    if opts.collective.layout == "alltoallv":
        opts.traffic = Traffic.from_env()
    if opts.average > 3:
        raise PerfError(f"-a {opts.average}: expected 0 (rank 0), 1 (mean), 2 (min) or 3 (max)")
    if opts.blocking > 3:
        raise PerfError(f"-z {opts.blocking}: expected 0, 1, 2 or 3")
    if opts.local_register > 2:
        raise PerfError(
            f"-R {opts.local_register}: expected 0 (plain buffers), 1 (registered) "
            "or 2 (symmetric windows)"
        )
    for flag, value in (("-p", opts.parallel_init), ("-y", opts.stream_null),
                        ("-C", opts.report_cputime), ("-S", opts.report_timestamps)):  # fmt: skip
        if value > 1:
            raise PerfError(f"{flag} {value}: expected 0 or 1")
    if opts.stream_null and opts.cudagraph:
        raise PerfError("-y 1 with -G: the default (NULL) stream cannot be captured in a graph")
    if opts.blocking and opts.cudagraph:  # (nccl-tests drops -z 3 here, and -z 1/2 fail)
        raise PerfError(
            f"-z {opts.blocking} with -G: a wait between operations cannot be captured in a graph"
        )
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
                "pip install 'pynccl-ctypes[plot]' (or pip install matplotlib)"
            ) from None
    if opts.output_file is not None and not opts.output_file.lower().endswith(".json"):
        raise PerfError(
            f"-J {opts.output_file}: nccl-tests writes JSON only, to a file named *.json "
            "(it ignores other names)"
        )
    for flag, path in (("--json", opts.json), ("--plot", opts.plot), ("-J", opts.output_file)):
        if path is not None:
            _check_writable(flag, path)
    return opts


def _check_writable(flag: str, path: str) -> None:
    """Refuse an output path that cannot be written, before any rank starts (nothing is
    created: a failed run leaves no empty file behind)."""
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise PerfError(f"{flag} {path}: is a directory, expected a file name")
    if not os.path.isdir(where):
        raise PerfError(f"{flag} {path}: directory {where} does not exist")
    if os.path.exists(path) and flag != "-J":  # -J picks FILE.json.0, .1 ... instead
        if not os.access(path, os.W_OK):
            raise PerfError(f"{flag} {path}: the file exists and is not writable")
    elif not os.access(where, os.W_OK | os.X_OK):
        raise PerfError(f"{flag} {path}: directory {where} is not writable")


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
