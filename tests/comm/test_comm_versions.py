"""The collective suite on loopback builds emulating NCCL 2.18.1, 2.24.3 and 2.32.3.

Each release is swapped in as this process's libnccl for its share of the tests
(``pynccl.testing.loopback.use(version)``, undone afterwards). 2.18 and 2.24
have no ``ncclGather`` / ``ncclScatter`` / ``ncclAlltoAll``: pynccl then issues
grouped ``ncclSend`` / ``ncclRecv``, and the same numpy-checked assertions must
hold. 2.18 also lacks float8, ``ncclCommRegister``, ``ncclCommInitRankScalable``
and newer ``ncclConfig_t`` fields, which must be refused with
``NotSupportedError`` before any C call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support import ROOT, SUPPORT
from support.child import result_line, run_ranks
from support.suite import COLLECTIVES, Spec, check, fixed_matrix
from support.worlds import GroupWorld, RankThreads, ThreadWorld, sanitized, use_loopback

from pynccl import library
from pynccl.comm import Communicator, Config, UniqueId
from pynccl.cuda import DeviceBuffer
from pynccl.errors import NotSupportedError

VERSIONS = ("2.18.1", "2.24.3", "2.32.3")
FALLBACK = {"gather": "ncclGather", "scatter": "ncclScatter", "all_to_all": "ncclAlltoAll"}


def _triple(version: str) -> tuple[int, int, int]:
    major, minor, patch = (int(p) for p in version.split("."))
    return major, minor, patch


def _dtypes(version: str) -> tuple[str, ...]:
    base = ("float32", "bfloat16", "int32")
    return (*base, "float8_e4m3fn") if _triple(version) >= (2, 24, 3) else base


@pytest.fixture(scope="module", params=VERSIONS)
def version(request: pytest.FixtureRequest) -> Iterator[str]:
    """This process runs on the loopback build of the release for the tests that use it."""
    with use_loopback(request.param):
        yield request.param


@pytest.fixture(scope="module")
def world(version: str) -> Iterator[ThreadWorld]:
    with ThreadWorld(4) as w:
        yield w


def test_the_loaded_library_is_that_release(version: str) -> None:
    assert library.version() == _triple(version)
    native = _triple(version) >= (2, 28, 0)
    for name in FALLBACK.values():
        assert library.lib().has(name) is native


def test_collective_suite(version: str, world: ThreadWorld) -> None:
    for spec in fixed_matrix(4, _dtypes(version)):
        check(world, spec)


@pytest.mark.parametrize("coll", sorted(FALLBACK))
def test_gather_scatter_all_to_all_native_or_grouped_p2p(
    version: str, world: ThreadWorld, coll: str
) -> None:
    for size_root in (0, 3):
        for kind in ("buffer", "raw"):
            check(world, Spec(coll, "int64", count=19, root=size_root, kind=kind, seed=size_root))
    check(world, Spec(coll, "float64", count=0, kind="raw"))
    if coll != "all_to_all":
        check(world, Spec(coll, "uint8", count=7, root=2, inplace=True, kind="cai"))
    # Which C functions carried it: the native one, or one send + recvs (or the reverse).
    record = world.comms[0].flight_record()
    names = {entry[1] for entry in record[-4:]}
    if library.lib().has(FALLBACK[coll]):
        assert names == {FALLBACK[coll]}
    else:
        assert names <= {"ncclSend", "ncclRecv"} and len(names) >= 1


def test_init_all_group_world(version: str) -> None:
    with GroupWorld(3) as gw:
        for coll in COLLECTIVES:
            check(gw, Spec(coll, "bfloat16", "max", count=9, root=1, kind="dlpack"))


@pytest.mark.slow
def test_processes(version: str) -> None:
    from pynccl.testing import loopback

    specs = [s for s in fixed_matrix(4, ("float32",)) if s.coll in FALLBACK or s.count == 0]
    env = {**os.environ, **loopback.env(version, sanitize=sanitized())}
    env["PYTHONPATH"] = str(ROOT)
    env["PYNCCL_TEST_SPECS"] = json.dumps([json.loads(s.to_json()) for s in specs])
    env["PYNCCL_TEST_SIZE"] = "4"
    env["PYNCCL_TEST_UID"] = UniqueId().hex()
    ranks = run_ranks(
        [str(SUPPORT / "rank_worker.py")], [{**env, "PYNCCL_TEST_RANK": str(r)} for r in range(4)]
    )
    for r, (returncode, out, err) in enumerate(ranks):
        assert returncode == 0, f"rank {r}: {err[-3000:]}"
        line = result_line(out)
        results = json.loads(line[len("RESULT ") :])["results"]
        bad = [f"{x['spec']}: {x['error']}" for x in results if not x["ok"]]
        assert not bad and len(results) == len(specs), "\n".join(bad)


# --- what an older release lacks ------------------------------------------------------------------


def test_float8_needs_2_24(version: str, world: ThreadWorld) -> None:
    def one(r: int, comm: Communicator) -> str:
        with DeviceBuffer(4, "float8_e4m3fn", device=r) as b:
            try:
                comm.all_reduce(b)
                comm.synchronize()
            except NotSupportedError as exc:
                with pytest.raises(NotSupportedError):
                    comm.broadcast(b.ptr, count=4, dtype="float8_e5m2")
                return str(exc)
        return "ok"

    out = world.run(one)
    if _triple(version) >= (2, 24, 3):
        assert set(out.values()) == {"ok"}
    else:
        for text in out.values():
            assert "ncclFloat8e4m3" in text and "2.24.3" in text and version in text
        check(world, Spec("all_reduce", "bfloat16", "sum", count=5))  # bf16 is there


def test_newer_config_field_is_refused(version: str) -> None:
    cfg = Config(traffic_class=1)
    if _triple(version) < (2, 26, 0):
        with pytest.raises(NotSupportedError, match=r"trafficClass.*2\.26"):
            Communicator(1, UniqueId(), 0, device=0, config=cfg)
    else:
        with Communicator(1, UniqueId(), 0, device=0, config=cfg) as comm:
            assert comm.state == "ready"


def test_register_needs_2_19(version: str) -> None:
    with Communicator(1, UniqueId(), 0, device=0) as comm, DeviceBuffer(8, device=0) as b:
        if _triple(version) < (2, 19, 0):
            with pytest.raises(NotSupportedError, match="ncclCommRegister"):
                comm.register(b)
        else:
            comm.deregister(comm.register(b))


def test_several_unique_ids_need_2_23(version: str) -> None:
    ids = [UniqueId(), UniqueId()]
    if _triple(version) < (2, 23, 4):
        with pytest.raises(NotSupportedError, match="ncclCommInitRankScalable"):
            Communicator(2, ids, 0, device=0)
        return
    threads = RankThreads(2)
    try:
        comms = threads.run(lambda r: Communicator(2, ids, r, device=r))

        def one(r: int) -> Any:
            with DeviceBuffer.from_numpy(np.array([r + 1.0]), device=r) as b:
                comms[r].all_reduce(b)
                comms[r].synchronize()
                out = b.to_numpy().tolist()
            comms[r].destroy()
            return out

        assert threads.run(one) == [[3.0], [3.0]]
    finally:
        threads.close()
