"""Which algorithm NCCL ran: its own ``NCCL_DEBUG_SUBSYS=TUNING`` lines, parsed back.

Opt in with ``PYNCCL_TRACE_ALGORITHMS=1`` before the library loads. pynccl then sets, where
the user has not, ``NCCL_DEBUG=INFO``, adds ``TUNING`` to ``NCCL_DEBUG_SUBSYS`` (keeping the
subsystems already named, or NCCL's default ``INIT,ENV``) and points ``NCCL_DEBUG_FILE`` at
a per-process file (NCCL expands ``%h`` and ``%p`` itself, so child processes get their
own). :func:`recent` reads that file back into :class:`AlgorithmRecord` s.

The formats, from NCCL's source (matched against 2.27.3 .. 2.29.2 and master):

- ``src/enqueue.cc`` (every release since 2.19): ``AllReduce: 4096 Bytes -> Algo RING
  proto SIMPLE channel{Lo..Hi}={0..1}``;
- symmetric kernels (2.27: ``src/enqueue.cc``, 2.28+: ``src/scheduler/symmetric_sched.cc``):
  ``AllReduce [Symmetric]: 4096 Bytes -> Kernel AllReduce_AGxLL_R nchannels 4 nthreads 512``
  (``nWorks N`` appended since 2.28);
- copy-engine ("zero-CTA") collectives (2.28+): ``AllGather [Copy Engine]: 4096 Bytes ->
  cudaMemcpy`` and ``... [Hierarchical CE]: 4096 Bytes -> RMA proxy + CE``.

NCCL prints these on rank 0 of a communicator only (2.27 printed the symmetric line on every
rank). Lines in other shapes are skipped, and trailing fields a release adds are ignored.
Only the standard library: :func:`prepare` runs before the first library load.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import tempfile
from dataclasses import dataclass

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, MutableMapping

__all__ = ["ENV", "AlgorithmRecord", "TracingOffError", "parse", "parse_line", "recent"]

#: The variable that turns tracing on ("1"), read when the library first loads.
ENV = "PYNCCL_TRACE_ALGORITHMS"
_FILE_STEM = "pynccl-tuning"

# "[time] host:pid:tid [dev] NCCL INFO <body>" (src/debug.cc); only the body's shape matters.
_PREFIX = re.compile(r"(?:^|\s)(?:\S+:(?P<pid>\d+):\d+ )?\[(?P<dev>\d+)\] NCCL INFO (?P<body>.*)$")
_ALGO = re.compile(
    r"^(?P<coll>\w+): (?P<bytes>\d+) Bytes -> Algo (?P<algo>\w+) proto (?P<proto>\w+) "
    r"channel\{Lo\.\.Hi\}=\{(?P<lo>\d+)\.\.(?P<hi>\d+)\}"
)
_SYM = re.compile(
    r"^(?P<coll>\w+) \[Symmetric\]: (?P<bytes>\d+) Bytes -> Kernel (?P<kernel>\w+) "
    r"nchannels (?P<nch>\d+)"
)
_CE = re.compile(r"^(?P<coll>\w+) \[(?P<kind>Copy Engine|Hierarchical CE)\]: (?P<bytes>\d+) Bytes")


class TracingOffError(RuntimeError):
    """Raised by :func:`recent` when algorithm tracing is not on in this process."""


@dataclass(frozen=True)
class AlgorithmRecord:
    """One collective as NCCL's tuner reported it.

    ``algorithm`` is NCCL's word: ``"RING"``, ``"TREE"``, ``"NVLS"``, ``"PAT"``... for the
    channel algorithms, the kernel's name (``"AllReduce_AGxLL_R"``) for a symmetric kernel,
    ``"Copy Engine"`` / ``"Hierarchical CE"`` for a copy-engine collective. ``protocol`` is
    None where NCCL names none; ``channels`` the number of channels (0 for copy engines).
    ``symmetric``: NCCL took a symmetric-window path (a symmetric kernel or the copy engine).
    """

    collective: str
    nbytes: int
    algorithm: str
    protocol: str | None
    channels: int
    symmetric: bool
    copy_engine: bool
    device: int | None
    line: str


def parse_line(line: str) -> AlgorithmRecord | None:
    """The record in one NCCL INFO line (with or without its prefix), or None when the line
    is not a TUNING line of a shape pynccl knows."""
    text = line.rstrip("\n")
    m = _PREFIX.search(text)
    body, dev = (m.group("body"), int(m.group("dev"))) if m else (text.strip(), None)
    a = _ALGO.match(body)
    if a:
        lo, hi = int(a.group("lo")), int(a.group("hi"))
        return AlgorithmRecord(
            a.group("coll"), int(a.group("bytes")), a.group("algo"), a.group("proto"),
            hi - lo + 1, False, False, dev, text,
        )  # fmt: skip
    s = _SYM.match(body)
    if s:
        return AlgorithmRecord(
            s.group("coll"), int(s.group("bytes")), s.group("kernel"), None,
            int(s.group("nch")), True, False, dev, text,
        )  # fmt: skip
    c = _CE.match(body)
    if c:
        return AlgorithmRecord(
            c.group("coll"), int(c.group("bytes")), c.group("kind"), None, 0, True, True, dev, text
        )
    return None


def parse(lines: Iterable[str]) -> list[AlgorithmRecord]:
    """Every TUNING record in ``lines``, in order; other lines are skipped."""
    return [r for r in map(parse_line, lines) if r is not None]


# --- opting in, before the library loads ----------------------------------------

_state: dict[str, str] = {}  # "file": the NCCL_DEBUG_FILE pattern set; "off": why not


def _with_tuning(subsys: str | None) -> str:
    if not subsys:
        return "INIT,ENV,TUNING"  # NCCL's default, plus TUNING
    names = [n for n in subsys.split(",") if n]
    if subsys.startswith("^"):  # an exclusion list: stop excluding TUNING
        kept = [n for n in subsys[1:].split(",") if n and n.upper() != "TUNING"]
        return "^" + ",".join(kept) if kept else "ALL"
    upper = {n.upper() for n in names}
    return subsys if upper & {"TUNING", "ALL"} else ",".join([*names, "TUNING"])


def prepare(environ: MutableMapping[str, str] | None = None) -> bool:
    """Turn tracing on in ``environ`` (default :data:`os.environ`) when ``ENV`` is "1";
    called once before libnccl is loaded. Returns whether tracing is on."""
    env = os.environ if environ is None else environ
    _state.clear()
    if env.get(ENV, "") in ("", "0"):
        _state["off"] = f"{ENV} is not set"
        return False
    if env[ENV] != "1":
        raise ValueError(f"{ENV}={env[ENV]!r}: expected '1' (on) or '0' (off)")
    level = env.setdefault("NCCL_DEBUG", "INFO").upper()
    if level not in ("INFO", "TRACE"):
        _state["off"] = f"NCCL_DEBUG={env['NCCL_DEBUG']} prints no TUNING lines (INFO does)"
        return False
    env["NCCL_DEBUG_SUBSYS"] = _with_tuning(env.get("NCCL_DEBUG_SUBSYS"))
    if "NCCL_DEBUG_FILE" not in env:
        folder = os.path.join(tempfile.gettempdir(), f"{_FILE_STEM}-{os.getuid()}")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        _sweep(folder)
        env["NCCL_DEBUG_FILE"] = os.path.join(folder, "%h.%p.log")
        _state["owned"] = "1"
    _state["file"] = env["NCCL_DEBUG_FILE"]
    return True


def _sweep(folder: str) -> None:
    """Remove this host's trace files whose process is gone (killed before its exit hook)."""
    host = socket.gethostname().split(".")[0]
    for name in os.listdir(folder):
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
        except OSError:
            pass  # alive, someone else's


def trace_file() -> str | None:
    """This process's trace file (NCCL's ``%h``/``%p`` expanded), or None when tracing is off."""
    pattern = _state.get("file")
    if pattern is None:
        return None
    host = socket.gethostname().split(".")[0]
    out, i = [], 0
    while i < len(pattern):
        ch, nxt = pattern[i], pattern[i + 1 : i + 2]
        if ch == "%" and nxt in ("h", "p", "%"):
            out.append({"h": host, "p": str(os.getpid()), "%": "%"}[nxt])
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def remove_trace_file() -> None:
    """Delete this process's trace file if pynccl chose its name (at exit)."""
    path = trace_file()
    if path is not None and _state.get("owned"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def recent(last: int | None = None, *, device: int | None = None) -> list[AlgorithmRecord]:
    """The TUNING records NCCL has written in this process, oldest first (the ``last`` ones
    when given; only device ``device``'s when given).

    Raises:
        TracingOffError: tracing is off ("set PYNCCL_TRACE_ALGORITHMS=1 before the library
            loads", or why NCCL prints no such lines).
    """
    if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
        raise ValueError(f"last={last!r}: expected a non-negative int or None")
    path = trace_file()
    if path is None:
        why = _state.get("off", f"{ENV} was not 1 when the library loaded")
        raise TracingOffError(
            f"algorithm tracing is off ({why}): set {ENV}=1 before the library loads"
        )
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            records = parse(f)
    except FileNotFoundError:
        records = []  # NCCL opens the file on its first line
    if device is not None:
        records = [r for r in records if r.device == device]
    return records if last is None else records[len(records) - last :] if last else []
