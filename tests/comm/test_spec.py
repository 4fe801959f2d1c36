"""The spec table of collectives: consistent with the C prototypes, with the loopback
libnccl's own table (collectives.h) and with the tests' list; the methods hand-written with
the rows' signatures; and the documented parts of the object layer's surface."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from support.suite import COLLECTIVES as TEST_COLLECTIVES

import pynccl.testing
from pynccl._capi.nccl import PROTOTYPES
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.comm._spec import COLLECTIVES, Extent, On, Side, Where, by_cfunc, by_method

LOOPBACK_TABLE = Path(pynccl.testing.__file__).parent / "loopback" / "nccl" / "collectives.h"


@pytest.mark.parametrize("row", COLLECTIVES, ids=[r.method for r in COLLECTIVES])
def test_rows_agree_with_the_c_prototypes(row: Any) -> None:
    proto = PROTOTYPES[row.cfunc]
    names = [name for name, _ in proto.args]
    assert proto.first == row.since, f"{row.cfunc}: first release"
    assert ("op" in names) == row.has_op
    assert ("root" in names) == (row.where is Where.ROOT)
    assert ("peer" in names) == (row.where is Where.PEER)
    assert names[-2:] == ["comm", "stream"]  # the recorder and the checked path rely on it
    if row.where is not Where.NONE:
        assert names[-3] == row.where.value  # root/peer just before (comm, stream)
    assert row.extent(row.count_from) is not Extent.NONE
    assert row.fallback == (row.since >= (2, 28, 0)), "native only from 2.28"
    assert by_method(row.method) is row and by_cfunc(row.cfunc) is row
    assert row.multiplier(Side.SEND, 4) == {Extent.COUNT: 1, Extent.PER_RANK: 4,
                                            Extent.NONE: 0}[row.send]  # fmt: skip


def _loopback_rows() -> dict[str, dict[str, object]]:
    """collectives.h's LB_COLLECTIVES and LB_P2P rows, parsed from the C source."""
    text = LOOPBACK_TABLE.read_text()
    rows: dict[str, dict[str, object]] = {}
    coll = re.search(r"#define LB_COLLECTIVES\(X\)(.*?)\n\n", text, re.S)
    p2p = re.search(r"#define LB_P2P\(X\)(.*?)\n\n", text, re.S)
    assert coll and p2p, "collectives.h no longer has its two tables"
    for m in re.finditer(r"X\((\w+), \w+, (\w+), \w+, (\w+), \w+, (\w+), (\w+)\)", coll[1]):
        name, since, args, send, recv = m.groups()
        rows["nccl" + name] = {"since": since, "op": "OP" in args, "root": "ROOT" in args,
                               "send": send, "recv": recv}  # fmt: skip
    for m in re.finditer(r"X\((\w+), \w+, (\w+), (\w+)\)", p2p[1]):
        name, send, recv = m.groups()
        rows["nccl" + name] = {"since": "ALWAYS", "op": False, "root": False, "send": send,
                               "recv": recv}  # fmt: skip
    return rows


def test_the_spec_is_the_loopbacks_table() -> None:
    # The loopback libnccl validates calls from its own table (collectives.h): the Python
    # spec and it describe the same calls, or one of them is wrong.
    lb = _loopback_rows()
    assert set(lb) == {row.cfunc for row in COLLECTIVES}
    extent = {"NB": (Extent.COUNT, On.ALL), "ALL": (Extent.PER_RANK, On.ALL),
              "ROOT_NB": (Extent.COUNT, On.ROOT), "ROOT_ALL": (Extent.PER_RANK, On.ROOT),
              "ZERO": (Extent.NONE, On.ALL)}  # fmt: skip
    for row in COLLECTIVES:
        c = lb[row.cfunc]
        assert c["op"] == row.has_op, row.cfunc
        assert c["root"] == (row.where is Where.ROOT), row.cfunc
        assert extent[str(c["send"])] == (row.send, row.send_on), row.cfunc
        assert extent[str(c["recv"])] == (row.recv, row.recv_on), row.cfunc
        assert (c["since"] != "ALWAYS") == row.fallback, row.cfunc
        if c["since"] != "ALWAYS":
            assert c["since"] == "_".join(map(str, row.since)), row.cfunc


def test_the_tests_list_the_same_collectives() -> None:
    # The suite keeps its own oracle, but not its own idea of what the collectives are.
    ours = {m for m in TEST_COLLECTIVES if m != "send_recv"} | {"send", "recv"}
    assert ours == {row.method for row in COLLECTIVES}


def test_methods_carry_the_rows_signature_and_doc() -> None:
    for row in COLLECTIVES:
        for name in (row.method, row.method + "_init"):
            fn = getattr(Communicator, name)
            assert fn.__doc__ and fn.__qualname__.endswith(f".{name}")
            params = list(inspect.signature(fn).parameters)
            tail = ["count", "dtype", "stream", "config"]
            if name == row.method:  # a persistent op takes no async_op
                tail.append("async_op")
            assert params[-len(tail) :] == tail
            assert ("op" in params) == row.has_op
            if row.where is not Where.NONE:
                assert row.where.value in params


def test_no_generated_source_in_the_object_api() -> None:
    # The object API is hand-written: every method's code comes from a real file.
    import pynccl.comm as comm_pkg

    for name in dir(Communicator):
        fn = getattr(Communicator, name)
        code = getattr(fn, "__code__", None)
        if code is not None:
            assert Path(code.co_filename).is_file(), (name, code.co_filename)
    for path in Path(comm_pkg.__file__).parent.glob("*.py"):
        src = path.read_text()
        assert "exec(" not in src and "compile(" not in src, path.name


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


def test_a_rooted_fast_call_records_the_root_as_an_int(lb: Any) -> None:
    from pynccl.cuda import DeviceBuffer

    comm = Communicator(1, UniqueId(), 0, device=0)
    x = DeviceBuffer(4, "float32", device=0)
    try:
        comm.broadcast(x.ptr, x.ptr, root=0, count=4, dtype="float32")
        comm.broadcast(x.ptr, x.ptr, root=0, count=4, dtype="float32")  # the fast path
        _seq, name, where, args = comm.flight_record()[-1]
        assert (name, where, type(args[4]), args[4]) == ("ncclBroadcast", 0, int, 0)
        assert comm.last_operation().endswith("root=0 stream=0x0")
    finally:
        x.close()
        comm.destroy()
