"""The collective suite (``tests/support/worlds.py``) run in every world, mpi4py style.

The same :func:`_worlds.check` assertions — every collective against a numpy
reference, with send buffers left untouched and guard elements intact — run in:

* threads of this process (each rank a thread with its own ``Communicator``):
  fixed matrices over collectives, array kinds, data types and ops, then a
  hypothesis property over (collective, dtype, op, count, nranks 1-8, root,
  in place, array kind);
* ``Communicator.init_all`` driven by this one thread inside ``pynccl.group()``;
* separate processes: 4 workers given a shared unique id in hex, and 4 workers
  started by ``python -m pynccl launch -n 4 --loopback``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import ROOT, SUPPORT
from support.suite import (
    COLLECTIVES,
    INPLACE_NONE,
    INPLACE_OFFSET,
    OPS,
    REDUCING,
    Spec,
    check,
    fixed_matrix,
)
from support.worlds import KINDS, GroupWorld, ThreadWorld

from pynccl.comm import UniqueId
from pynccl.dtypes import canonical_name
from pynccl.enums import DataType

WORKER = SUPPORT / "rank_worker.py"
DTYPES = [canonical_name(dt) for dt in DataType]
FLOAT_DTYPES = [canonical_name(dt) for dt in DataType if dt.is_float]


def _ops(dtype: str) -> tuple[str, ...]:
    return OPS  # avg on integers too: NCCL's sum / nranks, truncated toward zero


# --- threads: fixed matrices ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("coll", COLLECTIVES)
def test_every_collective_with_every_array_kind(
    thread_worlds: Callable[[int], ThreadWorld], coll: str, kind: str
) -> None:
    world = thread_worlds(3)
    check(world, Spec(coll, "float32", "sum", count=17, root=2, kind=kind, seed=1))
    if coll in INPLACE_NONE or (coll in INPLACE_OFFSET and kind != "buffer"):
        check(world, Spec(coll, "int32", "sum", count=6, root=1, inplace=True, kind=kind))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_reduction_op_on_every_type(
    thread_worlds: Callable[[int], ThreadWorld], dtype: str
) -> None:
    world = thread_worlds(4)
    for i, op in enumerate(_ops(dtype)):
        check(world, Spec("all_reduce", dtype, op, count=67, kind=KINDS[i % 4], seed=i))
        check(world, Spec("reduce", dtype, op, count=5, root=3, kind="raw", seed=i))
        check(world, Spec("reduce_scatter", dtype, op, count=9, inplace=True, kind="cai", seed=i))


@pytest.mark.parametrize("dtype", DTYPES)
def test_data_movement_keeps_every_bit_of_every_type(
    thread_worlds: Callable[[int], ThreadWorld], dtype: str
) -> None:
    # "bytes" inputs: any bit pattern, NaN payloads included, must arrive unchanged.
    world = thread_worlds(4)
    for coll in ("broadcast", "all_gather", "gather", "scatter", "all_to_all", "send_recv"):
        check(world, Spec(coll, dtype, count=13, root=1, kind="dlpack", seed=5))


def test_integer_reductions_wrap_around(thread_worlds: Callable[[int], ThreadWorld]) -> None:
    import numpy as np
    from support.reference import ref_reduce

    # The reference itself must wrap: 3 * 100 in int8 is 44, 127 + 1 is -128.
    a = np.array([100, 127], np.int8)
    b = np.array([100, 1], np.int8)
    assert ref_reduce([a, b, a], DataType.INT8, "sum").tolist() == [44, -1]
    assert ref_reduce([a, a], DataType.INT8, "prod").tolist() == [16, 1]
    # avg: the wrapped sum divided as C divides, truncating toward zero (not flooring).
    assert ref_reduce([a, b], DataType.INT8, "avg").tolist() == [-28, -64]
    odd = [np.array([-3, 3], np.int32), np.array([0, 0], np.int32)]
    assert ref_reduce(odd, DataType.INT32, "avg").tolist() == [-1, 1]
    world = thread_worlds(5)
    for dtype in ("int8", "uint8", "int32", "uint64"):
        for op in ("sum", "prod"):
            check(world, Spec("all_reduce", dtype, op, count=257, seed=11))


def test_one_rank_world(thread_worlds: Callable[[int], ThreadWorld]) -> None:
    world = thread_worlds(1)
    for coll in COLLECTIVES:
        check(world, Spec(coll, "float64", count=3, kind="raw"))


# --- threads: property ----------------------------------------------------------------------------


@st.composite
def sized_specs(draw: st.DrawFn, colls: tuple[str, ...]) -> tuple[int, Spec]:
    size = draw(st.integers(1, 8))
    coll = draw(st.sampled_from(colls))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(_ops(dtype))) if coll in REDUCING else "sum"
    count = draw(st.one_of(st.integers(0, 9), st.sampled_from([31, 127, 1001, 4099])))
    root = draw(st.integers(0, size - 1))
    inplace = coll in INPLACE_NONE | INPLACE_OFFSET and draw(st.booleans())
    kind = draw(st.sampled_from(KINDS))
    seed = draw(st.integers(0, 2**16))
    return size, Spec(coll, dtype, op, count, root, inplace, kind, seed)


PROPERTY = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MOVING = tuple(c for c in COLLECTIVES if c not in REDUCING)


@PROPERTY
@given(case=sized_specs(tuple(sorted(REDUCING))))
def test_reductions_match_numpy(
    thread_worlds: Callable[[int], ThreadWorld], case: tuple[int, Spec]
) -> None:
    size, spec = case
    check(thread_worlds(size), spec)


@PROPERTY
@given(case=sized_specs(MOVING))
def test_data_movement_matches_numpy(
    thread_worlds: Callable[[int], ThreadWorld], case: tuple[int, Spec]
) -> None:
    size, spec = case
    check(thread_worlds(size), spec)


# --- init_all, driven by one thread with groups ---------------------------------------------------

GROUP_MATRIX = fixed_matrix(4, ("float32", "bfloat16", "int8", "float8_e5m2"))


@pytest.fixture(scope="module")
def group_world(lb: Any) -> Iterator[GroupWorld]:
    with GroupWorld(4) as world:
        yield world


@pytest.mark.parametrize("spec", GROUP_MATRIX, ids=str)
def test_init_all_world_in_one_thread(group_world: GroupWorld, spec: Spec) -> None:
    check(group_world, spec)


def test_init_all_world_of_one_and_eight(lb: Any) -> None:
    for size in (1, 8):
        with GroupWorld(size) as world:
            for coll in COLLECTIVES:
                check(world, Spec(coll, "float16", count=7, root=size - 1, kind="cai"))


# --- separate processes ---------------------------------------------------------------------------

PROCESS_MATRIX = fixed_matrix(4, ("float32", "int64", "bfloat16"))


def _parse_results(stdout: str) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for line in stdout.splitlines():
        _, sep, payload = line.partition("RESULT ")
        if sep:
            record = json.loads(payload)
            out[record["rank"]] = record["results"]
    return out


def _assert_all_passed(results: dict[int, list[dict[str, Any]]], size: int, n: int) -> None:
    assert sorted(results) == list(range(size)), f"ranks that reported: {sorted(results)}"
    failures = [
        f"rank {rank}: {item['spec']}: {item['error']}"
        for rank, items in sorted(results.items())
        for item in items
        if not item["ok"]
    ]
    assert not failures, "\n".join(failures)
    assert all(len(items) == n for items in results.values())


def test_four_processes_with_a_shared_unique_id(lb: Any, lb_env: dict[str, str]) -> None:
    size = 4
    uid = UniqueId()
    specs = json.dumps([json.loads(s.to_json()) for s in PROCESS_MATRIX])
    procs = []
    for rank in range(size):
        env = {
            **lb_env,
            "PYNCCL_TEST_RANK": str(rank),
            "PYNCCL_TEST_SIZE": str(size),
            "PYNCCL_TEST_UID": uid.hex(),
            "PYNCCL_TEST_SPECS": specs,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (code, _, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} exited with {code}:\n{err[-4000:]}"
    results: dict[int, list[dict[str, Any]]] = {}
    for _, out, _ in outputs:
        results.update(_parse_results(out))
    _assert_all_passed(results, size, len(PROCESS_MATRIX))


@pytest.mark.slow
def test_four_processes_started_by_pynccl_launch(lb_env: dict[str, str]) -> None:
    specs = [s for s in PROCESS_MATRIX if s.dtype == "float32"]
    env = {**lb_env, "PYNCCL_TEST_SPECS": json.dumps([json.loads(s.to_json()) for s in specs])}
    for key in ("PYNCCL_NCCL_LIBRARY", "PYNCCL_CUDART_LIBRARY"):
        env.pop(key, None)  # --loopback must provide them
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pynccl",
            "launch",
            "-n",
            "4",
            "--loopback",
            "--timeout",
            "150",
            str(WORKER),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, f"launch exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    _assert_all_passed(_parse_results(proc.stdout), 4, len(specs))


def test_process_matrix_covers_every_collective_kind_and_in_place_form() -> None:
    # The fixed matrices stand in for the property test where it is too costly:
    # make sure they keep covering what they claim to.
    for matrix in (PROCESS_MATRIX, GROUP_MATRIX):
        assert {s.coll for s in matrix} == set(COLLECTIVES)
        assert {s.kind for s in matrix} == set(KINDS)
        assert {s.coll for s in matrix if s.inplace} == INPLACE_NONE | INPLACE_OFFSET
        assert any(s.count == 0 for s in matrix) and any(s.root != 0 for s in matrix)
    assert os.path.exists(WORKER)
