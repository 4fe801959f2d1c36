"""Flight records with per-operation state, their JSON dumps and what triggers them
(``PYNCCL_FLIGHT_DIR``: a watchdog trip, SIGUSR1, SIGTERM, an unhandled exception), call
sites (``PYNCCL_FLIGHT_STACKS=1``), and ``python -m pynccl analyze`` on dumps written by
hand (pynccl's and PyTorch's flight-recorder pickles)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from pynccl import analyze
from pynccl.comm import _flight


def _child(tmp_path: Path, lb_env: dict[str, str], body: str, **env: str) -> tuple[int, str]:
    """Run ``body`` after making a 1-rank loopback communicator ``comm`` with a watchdog and
    a 4096-float32 buffer ``buf``, with PYNCCL_FLIGHT_DIR=tmp_path/'d'."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""\
        import os, signal, sys, time
        from pynccl.comm import Communicator, UniqueId
        from pynccl.cuda import DeviceBuffer
        comm = Communicator(1, UniqueId(), 0, device=0)
        comm.start_watchdog(5)
        buf = DeviceBuffer(4096, "float32")
        """) + textwrap.dedent(body))
    full = {**lb_env, "PYNCCL_FLIGHT_DIR": str(tmp_path / "d"), **env}
    run = subprocess.run([sys.executable, str(script)], env=full, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    return run.returncode, run.stderr


def _dump(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "d" / "rank0.json").read_text())


def test_states_fields_and_sites_in_a_dump(tmp_path: Path, lb_env: dict[str, str]) -> None:
    code, err = _child(tmp_path, lb_env, """\
        import pynccl
        comm.all_reduce(buf, op="max")
        comm.broadcast(buf, root=0)
        with pynccl.group():
            comm.all_reduce(buf)
        comm.synchronize()
        os.kill(os.getpid(), signal.SIGUSR1)
        comm.destroy()
        """, PYNCCL_FLIGHT_STACKS="1")  # fmt: skip
    assert code == 0, err
    d = _dump(tmp_path)
    assert (d["format"], d["version"], d["rank"], d["size"]) == ("pynccl-flight", 1, 0, 1)
    assert d["reason"] == "signal SIGUSR1" and d["host"] == os.uname().nodename
    ops = d["comms"][0]["ops"]
    site = str(tmp_path / "child.py") + ":{} in <module>"
    assert ops == [
        {"seq": 1, "function": "ncclAllReduce", "count": 4096, "dtype": "ncclFloat32",
         "op": "max", "stream": 0, "group": 0, "state": "completed", "site": site.format(8)},
        {"seq": 2, "function": "ncclBroadcast", "count": 4096, "dtype": "ncclFloat32",
         "root": 0, "stream": 0, "group": 0, "state": "completed", "site": site.format(9)},
        {"seq": 3, "function": "ncclAllReduce", "count": 4096, "dtype": "ncclFloat32",
         "op": "sum", "stream": 0, "group": 1, "state": "completed", "site": site.format(11)},
    ]  # fmt: skip
    assert d["comms"][0]["watchdog"] == {"timeout": 5.0, "completed": 3, "verdict": None}


def test_persistent_and_config_calls_have_their_own_sites(
    tmp_path: Path, lb_env: dict[str, str]
) -> None:
    # A persistent operation's calls and nccl*Config calls bypassed the slots that note
    # sites: a dump showed the site of the call 64 operations before (its ring slot's).
    code, err = _child(tmp_path, lb_env, """\
        from pynccl import CollConfig
        op = comm.all_reduce_init(buf)
        for _ in range(64):
            comm.all_reduce(buf)
        op()
        op(stream=0)
        comm.all_reduce(buf, config=CollConfig(max_ctas=2))
        comm.synchronize()
        os.kill(os.getpid(), signal.SIGUSR1)
        op.close()
        comm.destroy()
        """, PYNCCL_FLIGHT_STACKS="1")  # fmt: skip
    assert code == 0, err
    ops = _dump(tmp_path)["comms"][0]["ops"]
    site = str(tmp_path / "child.py") + ":{} in <module>"
    assert [(o["seq"], o["site"]) for o in ops[-4:]] == [
        (64, site.format(10)),
        (65, site.format(11)),
        (66, site.format(12)),
        (67, site.format(13)),
    ]


def test_hung_operation_is_started_and_later_ones_issued(
    tmp_path: Path, lb_env: dict[str, str]
) -> None:
    code, err = _child(tmp_path, lb_env, """\
        for _ in range(3):
            comm.all_reduce(buf)
        time.sleep(0.5)
        from pynccl.comm import _flight
        _flight.dump("by hand")
        comm.abort()
        """, PYNCCL_LOOPBACK_HANG="2")  # fmt: skip
    assert code == 0, err
    ops = _dump(tmp_path)["comms"][0]["ops"]
    assert [o["state"] for o in ops] == ["completed", "started", "issued"]
    assert all("site" not in o for o in ops)  # only with PYNCCL_FLIGHT_STACKS=1


def test_watchdog_trip_and_unhandled_exception_dump(tmp_path: Path, lb_env: dict[str, str]) -> None:
    code, err = _child(tmp_path, lb_env, """\
        comm.stop_watchdog()
        comm.start_watchdog(0.5)
        comm.all_reduce(buf)
        time.sleep(2)
        dumped = open(os.environ["PYNCCL_FLIGHT_DIR"] + "/rank0.json").read()
        assert "watchdog: NcclTimeoutError" in dumped
        seen = []
        previous = sys.excepthook
        sys.excepthook = lambda *a: (seen.append(a[0]), previous(*a))
        comm.synchronize()
        """, PYNCCL_LOOPBACK_HANG="1")  # fmt: skip
    assert code == 1 and "NcclTimeoutError" in err, err
    d = _dump(tmp_path)
    assert d["reason"].startswith("unhandled NcclTimeoutError")
    c = d["comms"][0]
    assert c["state"] == "aborted" and "operation #1 did not complete" in c["watchdog"]["verdict"]
    assert c["ops"][0]["state"] == "started"


def test_sigterm_dumps_then_ends_by_the_signal(tmp_path: Path, lb_env: dict[str, str]) -> None:
    code, err = _child(tmp_path, lb_env, """\
        comm.all_reduce(buf)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        """)  # fmt: skip
    assert code == -signal.SIGTERM, err
    assert _dump(tmp_path)["reason"] == "signal SIGTERM"


def test_a_signal_during_a_dump_names_where_the_program_was(
    tmp_path: Path, lb_env: dict[str, str]
) -> None:
    # A second signal arrives while the first dump runs code outside _flight (here its
    # makedirs): the nested dump must still say where the program was, not that code.
    code, err = _child(tmp_path, lb_env, """\
        import json
        real, seen = os.makedirs, []
        def makedirs(*args, **kwargs):
            if not seen:
                seen.append(1)
                os.kill(os.getpid(), signal.SIGUSR1)  # handled here, inside the first dump
                time.sleep(0.01)
                with open(os.path.join(os.environ["PYNCCL_FLIGHT_DIR"], "rank0.json")) as f:
                    print("NESTED", json.dumps(json.load(f)["main_thread"]), file=sys.stderr)
            return real(*args, **kwargs)
        os.makedirs = makedirs
        comm.all_reduce(buf)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        """)  # fmt: skip
    assert code == 0, err
    nested = json.loads(err.split("NESTED ", 1)[1].splitlines()[0])
    where = "in <module>: os.kill(os.getpid(), signal.SIGUSR1)"
    assert nested and nested[-1].endswith(where), nested


def test_handlers_chain_and_are_restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYNCCL_FLIGHT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "5")
    seen: list[int] = []

    def mine(signum: int, frame: object) -> None:
        seen.append(signum)

    before_hook = sys.excepthook
    old = signal.signal(signal.SIGUSR1, mine)
    try:
        _flight.install()
        assert signal.getsignal(signal.SIGUSR1) is not mine
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert seen == [signal.SIGUSR1]
        assert json.loads((tmp_path / "rank5.json").read_text())["reason"] == "signal SIGUSR1"
        _flight.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is mine and sys.excepthook is before_hook
    finally:
        _flight.uninstall()
        signal.signal(signal.SIGUSR1, old)


# -- analyze ---------------------------------------------------------------------------------


def _op(seq: int, count: int = 4096, state: str = "completed") -> dict[str, Any]:
    return {"seq": seq, "function": "ncclAllReduce", "count": count, "dtype": "ncclFloat32",
            "op": "sum", "stream": 0, "group": 0, "state": state}  # fmt: skip


def _write(where: Path, rank: int, ops: list[dict[str, Any]], t: float = 1000.0) -> None:
    comm = {"index": 0, "rank": rank, "size": 4, "state": "ready", "issued": len(ops),
            "watchdog": None, "error": None, "async_error": None, "ops": ops}  # fmt: skip
    data = {"format": "pynccl-flight", "version": 1, "rank": rank, "size": 4, "pid": 1,
            "host": "h", "time": t, "reason": "x", "main_thread": [], "comms": [comm]}  # fmt: skip
    (where / f"rank{rank}.json").write_text(json.dumps(data))


def test_analyze_missing_stale_and_no_fault(tmp_path: Path) -> None:
    for r in (0, 1, 3):
        _write(tmp_path, r, [_op(1), _op(2)], t=1000.0 if r else 960.0)
    out = analyze.analyze(analyze.load(str(tmp_path)))
    assert out["verdict"].startswith("rank 2 wrote no dump")
    assert out["verdict"].endswith("rank 0's last dump is 40 s older than the others' "
                                   "(stuck on the host?)")  # fmt: skip
    _write(tmp_path, 2, [_op(1), _op(2)])
    _write(tmp_path, 0, [_op(1), _op(2)])
    assert analyze.analyze(analyze.load(str(tmp_path)))["verdict"].startswith("no rank is at fault")
    _write(tmp_path, 3, [_op(1), _op(2, state="started")])
    assert analyze.analyze(analyze.load(str(tmp_path)))["verdict"] == (
        "every rank issued operation #2 (ncclAllReduce 4096 x float32, op sum); it did not "
        "complete on rank 3"
    )


def test_analyze_cli_json_and_bad_dir(tmp_path: Path) -> None:
    for r in range(4):
        _write(tmp_path, r, [_op(1), _op(2, count=8 if r == 3 else 4096)])
    run = subprocess.run([sys.executable, "-m", "pynccl", "analyze", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    out = json.loads(run.stdout)
    assert out["culprits"] == [3] and out["operation"] == 2
    assert out["verdict"].startswith("ranks disagree at operation #2: ranks 0, 1, 2")
    bad = subprocess.run([sys.executable, "-m", "pynccl", "analyze", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 1 and "is not a directory" in bad.stderr


def _torch_entry(seq: int, size: int, state: str) -> dict[str, Any]:
    """One entry as torch.distributed.flight_recorder's dump writes it (fr_trace's types)."""
    return {"record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": "nccl:all_reduce", "time_created_ns": 1, "input_sizes": [[size]],
            "input_dtypes": ["Float"], "output_sizes": [[size]], "output_dtypes": ["Float"],
            "state": state, "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "retired": False, "timeout_ms": 600000,
            "is_p2p": False,
            "frames": [{"name": "step", "filename": "train.py", "line": 7}]}  # fmt: skip


def test_analyze_reads_pytorch_flight_recorder_pickles(tmp_path: Path) -> None:
    for r in range(2):
        entries = [_torch_entry(1, 64, "completed")]
        if r == 0:
            entries.append(_torch_entry(2, 64, "scheduled"))
        dump = {"version": "2.10", "pg_config": {"0": {"name": "0"}}, "pg_status": {},
                "entries": entries}  # fmt: skip
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(dump))
    out = analyze.analyze(analyze.load(str(tmp_path)))
    assert out["verdict"] == ("rank 1 never issued operation #2 (nccl:all_reduce 64 x Float); "
                              "rank 0 is waiting in it")  # fmt: skip
    (tmp_path / "nccl_trace_rank_1").write_bytes(pickle.dumps({"entries": [Path("x")]}))
    with pytest.raises(ValueError, match="refusing pathlib"):
        analyze.load(str(tmp_path))
