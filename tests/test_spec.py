"""The spec table of collectives: consistent with the C prototypes, the same list as the
tests' own, the generated source as a golden file, tracebacks through generated code
readable, and the documented parts of the object layer's surface."""

from __future__ import annotations

import difflib
import inspect
import traceback
from pathlib import Path
from typing import Any

import pytest
from _worlds import COLLECTIVES as TEST_COLLECTIVES

from pynccl._capi.nccl import PROTOTYPES
from pynccl.comm import Communicator, Config, UniqueId, _codegen
from pynccl.comm._spec import COLLECTIVES, by_cfunc, by_method

GOLDEN = Path(__file__).resolve().parent / "golden" / "comm_generated.py.txt"


@pytest.mark.parametrize("row", COLLECTIVES, ids=[r.method for r in COLLECTIVES])
def test_rows_agree_with_the_c_prototypes(row: Any) -> None:
    proto = PROTOTYPES[row.cfunc]
    names = [name for name, _ in proto.args]
    assert proto.first == row.since, f"{row.cfunc}: first release"
    assert ("op" in names) == row.has_op
    assert ("root" in names) == (row.where == "root")
    assert ("peer" in names) == (row.where == "peer")
    assert names[-2:] == ["comm", "stream"]  # the recorder and the slow path rely on it
    if row.where:
        assert names[-3] == row.where  # root/peer just before (comm, stream)
    for which in ("send", "recv"):
        assert getattr(row, which) in ("1", "n", "-")
        assert getattr(row, which + "_on") in ("all", "root")
    assert row.count_from in ("send", "recv") and getattr(row, row.count_from) != "-"
    assert row.in_place in ("", "recvbuf=None", "offset")
    assert bool(row.fallback) == (row.since >= (2, 28, 0)), "native only from 2.28"
    assert by_method(row.method) is row and by_cfunc(row.cfunc) is row
    assert row.multiplier("send", 4) == {"1": 1, "n": 4, "-": 0}[row.send]


def test_the_tests_list_the_same_collectives() -> None:
    # The suite keeps its own oracle, but not its own idea of what the collectives are.
    ours = {m for m in TEST_COLLECTIVES if m != "send_recv"} | {"send", "recv"}
    assert ours == {row.method for row in COLLECTIVES}


def test_methods_carry_the_rows_signature_and_doc(lb: Any) -> None:
    for row in COLLECTIVES:
        fn = getattr(Communicator, row.method)
        assert fn.__doc__ == row.doc and fn.__qualname__ == f"Communicator.{row.method}"
        params = list(inspect.signature(fn).parameters)
        assert params[-4:] == ["count", "dtype", "stream", "config"]
        assert ("op" in params) == row.has_op and (row.where in params if row.where else True)


def test_generated_source_matches_the_golden_file() -> None:
    # A template change shows here as a readable diff; regenerate the file with
    # python -c "from pynccl.comm import _codegen; print(_codegen.source(), end='')"
    want = GOLDEN.read_text()
    got = _codegen.source()
    diff = "".join(
        difflib.unified_diff(want.splitlines(True), got.splitlines(True), "golden", "generated")
    )
    assert not diff, diff


def test_tracebacks_show_the_generated_lines(lb: Any) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    try:
        with pytest.raises(TypeError) as info:
            comm.all_gather(1.5, 2.5)
        text = "".join(traceback.format_exception(info.value))
        assert _codegen.FILENAME in text
        assert "self._slow(_ROWS[" in text  # the source line itself, from the loader
    finally:
        comm.destroy()


def test_config_help_shows_the_minimum_releases() -> None:
    doc = Config.__doc__ or ""
    assert "``blocking`` (bool, ``blocking``, NCCL >= 2.14)" in doc
    assert "``max_p2p_peers`` (int, ``maxP2pPeers``, NCCL >= 2.30.3)" in doc
    for name in Config.C_NAMES:
        assert f"``{name}``" in doc
    assert Config(blocking=False) == Config(blocking=False) != Config()
    assert repr(Config(comm_name="x")) == "Config(comm_name='x')"
    with pytest.raises(TypeError):
        Config(bogus=1)  # type: ignore[call-arg]


def test_first_use_imports_no_dataclasses_or_hashlib() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from pynccl import Communicator; "
        "print(sorted(m for m in ('dataclasses', 'hashlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_rank_args_are_shared_c_ints_of_each_rank() -> None:
    from ctypes import c_int

    from pynccl.comm._args import RANK_ARGS_LIMIT, rank_args

    small = rank_args(5)
    assert len(small) >= 5 and all(type(a) is c_int and a.value == r for r, a in enumerate(small))
    assert rank_args(3) is small  # one list for the process, grown on demand
    assert len(rank_args(RANK_ARGS_LIMIT + 10)) == RANK_ARGS_LIMIT
    assert [a.value for a in rank_args(0)[-2:]] == [RANK_ARGS_LIMIT - 2, RANK_ARGS_LIMIT - 1]


def test_a_rooted_inline_call_records_the_root_as_an_int(lb: Any) -> None:
    from pynccl.cuda import DeviceBuffer

    comm = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer(4, "float32", device=0)
    try:
        comm.broadcast(x.ptr, x.ptr, root=0, count=4, dtype="float32")  # the inline path
        _seq, name, where, args = comm.flight_record()[-1]
        assert (name, where, type(args[4]), args[4]) == ("ncclBroadcast", 0, int, 0)
        assert comm.last_operation().endswith("root=0 stream=0x0")
    finally:
        x.close()
        comm.destroy()
