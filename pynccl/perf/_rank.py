"""One rank's whole run: the cases the options ask for, the header, the sweep of each
case, the footer and the reports (rank 0 of every rank prints and writes them)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from ._bench import _Bench
from ._options import Options, _cases, _resolve_check
from ._report import (
    _Backend,
    _claim_output_file,
    _Console,
    _footer,
    _header,
    _Result,
    _write_json,
    _write_plot,
    _write_tests_json,
)
from ._sweep import PerfError

#: Set by the coordinator for the ranks it launches: the -J file it created, and the
#: nGpus nccl-tests would show (-g, or its default).
_ENV_J_PATH = "PYNCCL_PERF_J_PATH"
_ENV_NGPUS = "PYNCCL_PERF_NGPUS"


#: -R: what each level uses and the first NCCL release that has it.
_REGISTER = {
    1: ("registered buffers (ncclMemAlloc, ncclCommRegister)", (2, 19, 1)),
    2: ("symmetric windows (ncclMemAlloc, ncclCommWindowRegister)", (2, 27, 3)),
}


def _check_register(opts: Options, version: tuple[int, ...], text: str) -> None:
    if not opts.local_register:
        return
    what, first = _REGISTER[opts.local_register]
    if version < first:
        raise PerfError(
            f"-R {opts.local_register}: {what} need NCCL >= {'.'.join(map(str, first))}; "
            f"the loaded libnccl is {text}"
        )


def _run_rank(
    opts: Options, comm: Any, backend: _Backend, world: Any = None, color: int = 0
) -> int:
    """The sweep on this rank; rank 0 prints. Returns 0, or 1 when results were wrong
    or the average bus bandwidth is below NCCL_TESTS_MIN_BW's.

    ``comm`` runs the operations; ``world`` (default ``comm``) holds every rank when
    NCCL_TESTS_SPLIT made ``comm`` one group (``color``) of them. On an exception the
    communicators are aborted first (work may still be queued on them), then the
    buffers are freed.
    """
    world = comm if world is None else world
    lead = world.rank == 0
    nranks = int(comm.size)
    lib_version = tuple(int(v) for v in backend.nccl_version.split("."))
    _check_register(opts, lib_version, backend.nccl_version)
    cases = _cases(opts, nranks, lib_version)
    notes = _resolve_check(opts, sorted({t for t, _, _ in cases}))
    if any(o == "mulsum" for _, o, _ in cases):
        try:
            import numpy  # noqa: F401  (create_premul_sum packs the scalar with it)
        except ImportError:
            raise PerfError("-o mulsum needs numpy (pip install numpy)") from None
    # hypercube: nccl-tests skips a number of ranks that is not a power of two
    skip = opts.collective.power_of_two and nranks & (nranks - 1) != 0
    shape = (opts.nthreads, opts.ngpus or int(os.environ.get(_ENV_NGPUS, "1")))
    tests_json = None
    if lead and opts.output_file:
        tests_json = os.environ.get(_ENV_J_PATH) or _claim_output_file(opts.output_file)
    rows = 0 if skip else len(cases) * len(opts.sizes) * opts.run_cycles
    console = _Console(sys.stdout if lead else None, None if opts.run_cycles == 0 else rows)
    started = time.monotonic()
    start_time = time.strftime("%Y-%m-%d %H:%M:%S")
    ok = False
    bench = None
    try:
        if tests_json is not None:
            console.line(f"# Writing JSON output to {tests_json}")
        bench = _Bench(opts, comm, console, world=world, color=color, traffic=opts.traffic)
        devices = bench.devices(backend.loopback)
        for text in _header(opts, shape, backend, devices, notes):
            console.line(text)
        result = _Result()
        if skip:
            console.line(f"nRanks {nranks} is not a power of 2, skipping")
        else:
            for dtype_name, op_name, root in cases:
                bench.run_case(dtype_name, op_name, root, result)
        avg = result.busbw_sum / result.busbw_count if result.busbw_count else 0.0
        bw_ok = opts.tests_env.bandwidth_ok(avg)
        for text in _footer(result.errors, avg, opts.collective.tests_binary, bw_ok):
            console.line(text)
        if backend.loopback:
            console.line("# (loopback: these figures are host memory, not NCCL)")
        if tests_json is not None:
            _write_tests_json(
                tests_json, opts, shape, backend, devices, result, avg, start_time, bw_ok
            )
        if lead and opts.json:
            elapsed = time.monotonic() - started
            _write_json(opts.json, opts, nranks, backend, devices, result, avg, elapsed, bw_ok)
            console.line(f"# wrote {opts.json}")
        if lead and opts.plot:
            _write_plot(opts.plot, opts, nranks, backend, result)
            console.line(f"# wrote {opts.plot}")
        ok = True
        return 1 if result.errors or bw_ok is False else 0
    finally:
        console.close()
        if not ok:
            if bench is not None:
                bench.abort()
            else:
                comm.abort()
                world.abort()
        if bench is not None:
            bench.close()
