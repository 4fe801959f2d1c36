"""``python -m pynccl analyze DIR [--json]``: who is at fault, from every rank's flight dump.

Reads ``DIR/rank*.json`` (pynccl's dumps: ``PYNCCL_FLIGHT_DIR``) or PyTorch's flight
recorder dumps (``TORCH_FR_DUMP_TEMP_FILE`` / ``fr_trace``: pickled dicts, read here by a
restricted unpickler that refuses every class, so torch is never imported) and prints one
line naming the culprit and the operation, then the detail per rank. The rules, in order:

1. a rank of the job wrote no dump (killed, or stuck in C code that never came back);
2. ranks disagree at an operation they all issued (function, count, dtype, op, root);
3. a rank never issued an operation the others issued (and are waiting in);
4. a rank's dump is much older than the others' (stuck on the host?);
5. every rank issued the same; the first operation not completed everywhere.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import sys
from typing import Any

__all__ = ["analyze", "load", "main"]

#: A dump this many seconds older than the newest is "old" (rule 4).
STALE_S = 10.0
_SIGNATURE = ("function", "count", "dtype", "op", "root", "peer")
_P2P = ("ncclSend", "ncclRecv")


class _NoClasses(pickle.Unpickler):
    """Plain containers only: PyTorch's dumps hold dicts, lists, tuples, str and numbers."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: not a plain flight-record dump")


def _from_torch(data: dict[str, Any], name: str) -> dict[str, Any]:
    """A PyTorch flight-recorder dump as pynccl's dump shape (collectives of each pg)."""
    rank = data.get("rank")
    if not isinstance(rank, int):  # fr_trace's rule: the file name's trailing digits
        digits = re.search(r"(\d+)$", name)
        rank = int(digits.group(1)) if digits else -1
    comms: dict[object, dict[str, Any]] = {}
    for e in data.get("entries", []):
        if e.get("is_p2p"):
            continue
        pg = e.get("pg_id", 0)
        comm = comms.setdefault(pg, {"index": pg, "rank": rank, "ops": [], "watchdog": None})
        sizes = e.get("input_sizes") or [[]]
        count = 1
        for d in sizes[0] if sizes else []:
            count *= int(d)
        dtypes = e.get("input_dtypes") or ["?"]
        comm["ops"].append({
            "seq": e.get("collective_seq_id", 0),
            "function": str(e.get("profiling_name", "?")),
            "count": count,
            "dtype": str(dtypes[0]) if dtypes else "?",
            "group": 0,
            "state": {"scheduled": "issued"}.get(e.get("state"), e.get("state", "issued")),
            "site": " <- ".join(f"{f.get('filename')}:{f.get('line')} in {f.get('name')}"
                                for f in (e.get("frames") or [])[:2]),
        })  # fmt: skip
    for comm in comms.values():
        comm["issued"] = max((op["seq"] for op in comm["ops"]), default=0)
        comm["state"] = "?"
    return {"format": "torch-flight-recorder", "rank": rank, "time": None, "reason": "",
            "comms": list(comms.values()), "main_thread": []}  # fmt: skip


def load(directory: str) -> list[dict[str, Any]]:
    """Every dump in ``directory`` (sorted by rank); ``ValueError`` for one unreadable."""
    if not os.path.isdir(directory):
        raise ValueError(f"analyze: {directory!r} is not a directory of flight-record dumps")
    dumps = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".tmp") or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:1] == b"{":
            data = json.loads(raw)
            if data.get("format") != "pynccl-flight":
                continue
        elif raw[:1] == b"\x80":  # a pickle: PyTorch's flight recorder
            try:
                data = _from_torch(_NoClasses(io.BytesIO(raw)).load(), name)
            except (pickle.UnpicklingError, EOFError, AttributeError) as exc:
                raise ValueError(f"analyze: {path}: not a PyTorch flight dump ({exc})") from exc
        else:
            continue
        data["file"] = path
        dumps.append(data)
    if not dumps:
        raise ValueError(
            f"analyze: no flight-record dump (rank*.json or a pickle) in {directory!r}"
        )
    return sorted(dumps, key=lambda d: d.get("rank", -1))


def _short(dtype: object) -> str:
    text = str(dtype)
    return text[4].lower() + text[5:] if text.startswith("nccl") and len(text) > 5 else text


def _describe(op: dict[str, Any]) -> str:
    """``ncclAllReduce 4096 x float32, group 1`` (and its root or peer)."""
    text = f"{op['function']} {op['count']} x {_short(op['dtype'])}"
    for key in ("op", "root", "peer"):
        if key in op:
            text += f", {key} {op[key]}"
    return text + (f", group {op['group']}" if op.get("group") else "")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(ranks))


def _signature(op: dict[str, Any]) -> tuple[object, ...]:
    return tuple(op.get(k) for k in _SIGNATURE)


def _ended(comm: dict[str, Any]) -> bool:
    """The communicator was aborted or failed: an event that completed since may mark
    work that the abort ended, not work that ran."""
    verdict = (comm.get("watchdog") or {}).get("verdict")
    failed = verdict or comm.get("error") or comm.get("async_error")
    return bool(failed) or comm.get("state") in ("aborted", "revoked")


def _comm_verdict(comms: dict[int, dict[str, Any]]) -> tuple[str, list[int], int] | None:
    """One communicator's records across ranks (rank -> record): rules 2, 3 and 5."""
    ops = {r: {op["seq"]: op for op in c["ops"]} for r, c in comms.items()}
    issued = {r: int(c.get("issued") or max(ops[r], default=0)) for r, c in comms.items()}
    top = max(issued.values(), default=0)
    for seq in range(1, top + 1):
        have = {r: o[seq] for r, o in ops.items() if seq in o}
        kinds: dict[tuple[object, ...], list[int]] = {}
        for r, op in have.items():
            kinds.setdefault(_signature(op), []).append(r)
        # Send/recv differ by design (a send to 1 on rank 0 is matched by a recv from 0 on
        # rank 1): only collectives must agree, as PyTorch's dumps are read (p2p skipped).
        if len(kinds) > 1 and not any(op["function"] in _P2P for op in have.values()):
            parts = sorted(kinds.values(), key=len, reverse=True)
            text = " vs ".join(f"{_ranks(rs)} {_describe(have[rs[0]])}" for rs in parts)
            odd = [r for rs in parts[1:] for r in rs]
            return f"ranks disagree at operation #{seq}: {text}", odd, seq
        behind = sorted(r for r, n in issued.items() if n < seq)
        if behind and have:
            op = next(iter(have.values()))
            waiting = sorted(r for r, o in have.items()
                             if o.get("state") != "completed" or _ended(comms[r]))  # fmt: skip
            tail = f"{_ranks(waiting)} {'is' if len(waiting) == 1 else 'are'} waiting in it"
            if not waiting:
                tail = f"{_ranks(sorted(have))} issued it"
            return (f"{_ranks(behind)} never issued operation #{seq} ({_describe(op)}); {tail}",
                    behind, seq)  # fmt: skip
    for seq in range(1, top + 1):
        stuck = sorted(r for r, o in ops.items() if seq in o and o[seq].get("state") != "completed")
        if stuck and any(o.get(seq, {}).get("state") in ("started", "completed")
                         for o in ops.values()):  # fmt: skip
            op = ops[stuck[0]][seq]
            return (f"every rank issued operation #{seq} ({_describe(op)}); it did not complete "
                    f"on {_ranks(stuck)}", stuck, seq)  # fmt: skip
    return None


def analyze(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict: ``{"verdict": first line, "culprits": [ranks], "operation": seq or 0,
    "ranks": {rank: detail lines}}``."""
    size = max((int(d.get("size") or 0) for d in dumps), default=0)
    present = {int(d["rank"]) for d in dumps}
    missing = sorted(set(range(size)) - present)
    times = {int(d["rank"]): d["time"] for d in dumps if d.get("time") is not None}
    newest = max(times.values(), default=0.0)
    stale = {r: newest - t for r, t in times.items() if newest - t > STALE_S}
    verdict: tuple[str, list[int], int] | None = None
    if missing:
        verdict = (f"{_ranks(missing)} wrote no dump (killed, or stuck where Python never ran "
                   "again); the others' records follow", missing, 0)  # fmt: skip
    by_index: dict[int, dict[int, dict[str, Any]]] = {}
    for d in dumps:
        for c in d.get("comms", []):
            by_index.setdefault(int(c.get("index", 0)), {})[int(d["rank"])] = c
    for index in sorted(by_index):
        if verdict is None:
            verdict = _comm_verdict(by_index[index])
    if stale:
        r = max(stale, key=lambda k: stale[k])
        note = (f"rank {r}'s last dump is {stale[r]:.0f} s older than the others' "
                "(stuck on the host?)")  # fmt: skip
        verdict = (note, [r], 0) if verdict is None else (verdict[0] + "; " + note, *verdict[1:])
    if verdict is None:
        verdict = ("no rank is at fault in these dumps: every operation issued on every rank "
                   "matches, and none is seen hung", [], 0)  # fmt: skip
    details = {int(d["rank"]): _detail(d) for d in dumps}
    return {"verdict": verdict[0], "culprits": verdict[1], "operation": verdict[2],
            "ranks": details}  # fmt: skip


def _first(text: object) -> str:
    lines = str(text or "?").splitlines()
    return lines[0] if lines else "?"


def _detail(d: dict[str, Any]) -> list[str]:
    reason = _first(d.get("reason"))
    lines = [f"pid {d.get('pid', '?')} on {d.get('host', '?')}, dumped on {reason}"]
    for c in d.get("comms", []):
        wd = c.get("watchdog") or {}
        head = (f"comm {c.get('index')}: rank {c.get('rank')}/{c.get('size', '?')}, "
                f"{c.get('state')}, {c.get('issued')} operation(s) issued")  # fmt: skip
        if wd.get("verdict"):
            head += f"; watchdog: {_first(wd['verdict'])}"
        lines.append(head)
        for op in c.get("ops", [])[-4:]:
            site = f" at {op['site']}" if op.get("site") else ""
            lines.append(f"  #{op['seq']} {_describe(op)} [{op.get('state')}]{site}")
    if d.get("main_thread"):
        lines.append(f"main thread at {d['main_thread'][-1]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pynccl analyze", description=__doc__.split("\n")[0])
    p.add_argument("dir", help="the directory of the dumps (PYNCCL_FLIGHT_DIR, --flight-dir)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    args = p.parse_args(argv)
    try:
        result = analyze(load(args.dir))
    except (ValueError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(result["verdict"])
    for rank, lines in sorted(result["ranks"].items()):
        print(f"rank {rank}: " + "\n  ".join(lines))
    return 0
