"""NCCL's RAS service, from Python: ``python -m pynccl ras [HOST[:PORT]] [--json] [--timeout S]``.

NCCL >= 2.24 runs a RAS (reliability, availability, serviceability) thread in every process
of a job, listening on ``NCCL_RAS_ADDR`` (default ``localhost:28028``). Its client protocol
is lines of text, as NCCL's ``ncclras`` speaks it (``src/ras/client.cc``,
``client_support.cc``; matched against NCCL 2.30.7)::

    CLIENT PROTOCOL 2      ->  SERVER PROTOCOL 2
    TIMEOUT 5              ->  OK            (optional: seconds RAS waits for its peers)
    SET FORMAT json        ->  OK            (NCCL >= 2.28.7; "text" is the default)
    STATUS                 ->  the report; the server then closes the connection

The JSON report lists every communicator with its ``ranks`` (host, pid, GPU, status,
per-collective counts) and ``missing_ranks`` (those RAS got no data from; since NCCL 2.28.9
each says whether it is ``unresponsive`` and ``considered_dead``). :func:`status` parses it
into a :class:`RasStatus`; :func:`query` returns either report verbatim. Pure standard
library: nothing here loads libnccl, so it runs anywhere the job's port can be reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import socket
import sys
from typing import Any

__all__ = [
    "DEFAULT_PORT",
    "RasCommunicator",
    "RasError",
    "RasMissingRank",
    "RasRank",
    "RasStatus",
    "main",
    "missing_from_text",
    "parse_address",
    "parse_status",
    "query",
    "status",
]

DEFAULT_PORT = 28028
PROTOCOL = 2
_CONNECT_TIMEOUT = 5.0
_EXTRA_TIMEOUT = 5.0  # ncclras waits this long past the TIMEOUT it sent (RAS_COLLECTIVE_EXTRA)
_DEFAULT_TIMEOUT = 30.0


class RasError(RuntimeError):
    """RAS could not be reached, or answered something that is not NCCL's RAS protocol."""


@dataclasses.dataclass(frozen=True)
class RasRank:
    """A rank RAS got data from (one entry of a communicator's ``ranks``)."""

    rank: int
    host: str
    pid: int
    cuda_dev: int
    nvml_dev: int
    init_state: int
    async_error: int
    finalize_called: bool
    destroy_flag: bool
    abort_flag: bool
    collective_counts: dict[str, int]


@dataclasses.dataclass(frozen=True)
class RasMissingRank:
    """A rank RAS got no data from; ``None``: not reported (NCCL before 2.28.9)."""

    rank: int
    host: str
    pid: int
    cuda_dev: int
    nvml_dev: int
    unresponsive: bool | None
    considered_dead: bool | None


@dataclasses.dataclass(frozen=True)
class RasCommunicator:
    hash: str
    secondary_hash: str
    size: int
    ranks: tuple[RasRank, ...]
    missing_ranks: tuple[RasMissingRank, ...]


@dataclasses.dataclass(frozen=True)
class RasStatus:
    """RAS's JSON report, typed; ``raw`` is the document as parsed."""

    nccl_version: str
    timestamp: str
    communicators: tuple[RasCommunicator, ...]
    collection_time_sec: float
    timeouts_count: int
    raw: dict[str, Any]

    def missing(self) -> list[tuple[RasCommunicator, RasMissingRank]]:
        """Every missing rank, with its communicator, in report order."""
        return [(c, m) for c in self.communicators for m in c.missing_ranks]

    def summary(self, where: str) -> str:
        """One line: the ranks RAS sees as missing or dead, or that there are none."""
        n = len(self.communicators)
        head = f"RAS at {where} (NCCL {self.nccl_version}): {n} communicator{'s' * (n != 1)}"
        gone = self.missing()
        if not gone:
            return f"{head}, no missing or dead ranks"
        parts = [
            f"rank {m.rank} ({_who(m.pid, m.host, m.considered_dead)}) of "
            f"communicator {c.hash} ({c.size} ranks)"
            for c, m in gone
        ]
        return f"{head}; missing: " + "; ".join(parts)


def _who(pid: int, host: str, dead: bool | None) -> str:
    place = f"pid {pid} on {host}" if pid > 0 else "process unknown"
    return place + (", considered dead" if dead else "")


# ---- the protocol ---------------------------------------------------------------------


def parse_address(spec: str | None) -> tuple[str, int]:
    """``HOST[:PORT]`` (or ``[V6]:PORT``) -> (host, port); None: localhost, 28028."""
    if not spec:
        return "localhost", DEFAULT_PORT
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\s]+)(?::(\d+))?", spec)
    if m is None:
        raise ValueError(f"RAS address {spec!r}: expected HOST[:PORT], e.g. 127.0.0.1:28028")
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    number = DEFAULT_PORT if port is None else int(port)
    if not 0 < number < 65536:
        raise ValueError(f"RAS address {spec!r}: port {number} is not in 1-65535")
    return host, number


class _Conn:
    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.where = f"{host}:{port}"
        try:
            self.sock = socket.create_connection(
                (host, port), timeout=min(timeout, _CONNECT_TIMEOUT)
            )
        except ConnectionRefusedError:
            raise RasError(
                f"no RAS listening at {self.where}; NCCL >= 2.24 starts it in every process of a "
                f"job (unless NCCL_RAS_ENABLE=0) on NCCL_RAS_ADDR (default localhost:"
                f"{DEFAULT_PORT}): is the job running on that host, with that address?"
            ) from None
        except OSError as e:
            raise RasError(f"cannot connect to RAS at {self.where}: {e}") from None
        self.sock.settimeout(timeout)
        self.buf = b""

    def line(self, command: str) -> str:
        """Send one command; its one-line answer, without the newline."""
        self.sock.sendall(command.encode() + b"\n")
        while b"\n" not in self.buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise RasError(f"RAS at {self.where} closed the connection after {command!r}")
            self.buf += chunk
        answer, _, self.buf = self.buf.partition(b"\n")
        return answer.decode(errors="replace")

    def rest(self, command: str) -> str:
        """Send one command; everything until the server closes the connection."""
        self.sock.sendall(command.encode() + b"\n")
        out = [self.buf]
        while chunk := self.sock.recv(65536):
            out.append(chunk)
        return b"".join(out).decode(errors="replace")


def query(
    address: str | None = None,
    *,
    json_format: bool = False,
    timeout: float | None = None,
    verbose: bool = False,
) -> str:
    """RAS's status report at ``address``, as NCCL sends it (text, or JSON with json_format).

    ``timeout``: seconds RAS may wait for its peers (sent as ``TIMEOUT``), plus 5 for the
    answer; without it NCCL's own default applies and the answer may take up to 30 s.
    """
    host, port = parse_address(address)
    if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
        raise ValueError(f"RAS timeout {timeout!r}: expected a finite number of seconds >= 0")
    wait = _DEFAULT_TIMEOUT if timeout is None else timeout + _EXTRA_TIMEOUT
    conn = _Conn(host, port, wait)
    try:
        return _exchange(conn, json_format, timeout, verbose)
    except TimeoutError:
        raise RasError(f"RAS at {conn.where} did not answer within {wait:g} s") from None
    except OSError as e:
        raise RasError(f"RAS at {conn.where}: {e}") from None
    finally:
        conn.sock.close()


def _exchange(conn: _Conn, json_format: bool, timeout: float | None, verbose: bool) -> str:
    hello = conn.line(f"CLIENT PROTOCOL {PROTOCOL}")
    if not hello.upper().startswith("SERVER PROTOCOL "):
        raise RasError(
            f"{conn.where} is not NCCL's RAS: it answered {hello!r} to 'CLIENT PROTOCOL {PROTOCOL}'"
        )
    if timeout is not None:
        _expect_ok(conn, f"TIMEOUT {math.ceil(timeout)}")
    if json_format:
        answer = conn.line("SET FORMAT json")
        if answer.upper() != "OK":
            raise RasError(
                f"RAS at {conn.where} has no JSON output (NCCL >= 2.28.7 has): it "
                f"answered {answer!r} to 'SET FORMAT json'; the text report works"
            )
    return conn.rest("VERBOSE STATUS" if verbose else "STATUS")


def _expect_ok(conn: _Conn, command: str) -> None:
    answer = conn.line(command)
    if answer.upper() != "OK":
        raise RasError(f"RAS at {conn.where} answered {answer!r} to {command!r}")


# ---- the reports ----------------------------------------------------------------------


def _rank(d: dict[str, Any]) -> RasRank:
    st = d.get("status", {})
    return RasRank(
        int(d["rank"]),
        str(d["host"]),
        int(d["pid"]),
        int(d["cuda_dev"]),
        int(d["nvml_dev"]),
        int(st.get("init_state", 0)),
        int(st.get("async_error", 0)),
        bool(st.get("finalize_called")),
        bool(st.get("destroy_flag")),
        bool(st.get("abort_flag")),
        {str(k): int(v) for k, v in d.get("collective_counts", {}).items()},
    )


def _missing(d: dict[str, Any]) -> RasMissingRank:
    st = d.get("status")
    return RasMissingRank(
        int(d["rank"]),
        str(d["host"]),
        int(d["pid"]),
        int(d["cuda_dev"]),
        int(d["nvml_dev"]),
        None if st is None else bool(st.get("unresponsive")),
        None if st is None else bool(st.get("considered_dead")),
    )


def parse_status(text: str) -> RasStatus:
    """RAS's JSON report (``SET FORMAT json`` + ``STATUS``) as a :class:`RasStatus`."""
    try:
        doc = json.loads(text)
        comms = tuple(
            RasCommunicator(
                str(c["hash"]),
                str(c.get("secondary_hash", "")),
                int(c["size"]),
                tuple(_rank(r) for r in c.get("ranks", [])),
                tuple(_missing(m) for m in c.get("missing_ranks", [])),
            )
            for c in doc["communicators"]
        )
        ras = doc.get("ras", {})
        return RasStatus(
            str(doc["nccl_version"]),
            str(doc.get("timestamp", "")),
            comms,
            float(ras.get("collection_time_sec", 0.0)),
            int(ras.get("timeouts_count", 0)),
            doc,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        head = text[:80].replace("\n", "\\n")
        raise RasError(
            f"not a RAS JSON report ({type(e).__name__}: {e}); it starts {head!r}"
        ) from None


def status(address: str | None = None, *, timeout: float | None = None) -> RasStatus:
    """Ask RAS at ``address`` for its JSON report and parse it (NCCL >= 2.28.7)."""
    return parse_status(query(address, json_format=True, timeout=timeout))


_RANK_LINE = re.compile(
    r"  Rank (\d+) -- (?:GPU \S+(?: \(NVML \d+\))? managed by process (\d+) "
    r"on node (\S+)|\[process information not found\])"
)
_DEAD_LINE = re.compile(r"  Process (\d+) on node (\S+) managing GPU")


def missing_from_text(text: str) -> list[tuple[int, int, str, bool]]:
    """(rank, pid, host, considered dead) for each rank the text report lists as missing
    (its INCOMPLETE sections; pid -1 and host "unknown" when RAS has no process for it)."""
    dead = {(int(m.group(1)), m.group(2)) for m in _DEAD_LINE.finditer(text)}
    out: list[tuple[int, int, str, bool]] = []
    for section in re.split(r"\n(?=\S)", text):
        if not re.match(r"#\S+ \([0-9a-f]+\) INCOMPLETE", section):
            continue
        for m in _RANK_LINE.finditer(section):
            pid, host = (int(m.group(2)), m.group(3)) if m.group(2) else (-1, "unknown")
            out.append((int(m.group(1)), pid, host, (pid, host) in dead))
    return out


def _text_summary(where: str, text: str) -> str:
    gone = missing_from_text(text)
    if not gone:
        return f"RAS at {where}: no missing or dead ranks"
    return f"RAS at {where}; missing: " + "; ".join(
        f"rank {rank} ({_who(pid, host, dead)})" for rank, pid, host, dead in gone
    )


# ---- python -m pynccl ras -------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Print RAS's status, its missing/dead ranks first. 0: printed; 1: RAS failed; 2: usage
    (a bad address or timeout too)."""
    parser = argparse.ArgumentParser(
        prog="python -m pynccl ras",
        description="Ask NCCL's RAS service (NCCL >= 2.24, every process of a job) for the "
        "job's status; the first line names the ranks it sees as missing or dead.",
    )
    parser.add_argument(
        "address",
        nargs="?",
        metavar="HOST[:PORT]",
        help=f"where RAS listens (NCCL_RAS_ADDR; default localhost:{DEFAULT_PORT})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON: the summary, the missing ranks and RAS's own report (NCCL >= 2.28.7)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds RAS may wait for its peers (the answer may take S + 5)",
    )
    parser.add_argument("--verbose", action="store_true", help="RAS's VERBOSE STATUS")
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        host, port = parse_address(args.address)
        where = f"{host}:{port}"
        if args.json:
            st = parse_status(
                query(where, json_format=True, timeout=args.timeout, verbose=args.verbose)
            )
            out = {
                "address": where,
                "summary": st.summary(where),
                "missing": [
                    {"communicator": c.hash, **dataclasses.asdict(m)} for c, m in st.missing()
                ],
                "status": st.raw,
            }
            print(json.dumps(out, indent=2))
        else:
            text = query(where, timeout=args.timeout, verbose=args.verbose)
            print(_text_summary(where, text))
            print()
            print(text, end="")
    except (RasError, ValueError) as e:
        print(f"python -m pynccl ras: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    return 0
