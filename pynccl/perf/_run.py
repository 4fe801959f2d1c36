"""Where the sweep runs: choosing the backend (a GPU or the loopback), joining a launcher's
ranks or launching ``-g`` of them, and :func:`main`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from ._bench import PerfTimeout
from ._options import Options, _parse, _parser
from ._rank import _ENV_J_PATH, _ENV_NGPUS, _run_rank
from ._report import _Backend, _claim_output_file, _Console, _progress
from ._sweep import PerfError

_LOOPBACK_DEVICES = 8  # the loopback libcudart's default device count


# --------------------------------------------------------------------------------------
# Choosing the backend, joining or launching the ranks

_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
    "PYNCCL_LAUNCHER",
)


def _backend() -> _Backend:
    from .. import library

    L = library.lib()
    rt = library.cudart()
    return _Backend(
        loopback=_is_loopback_path(rt.path) or _is_loopback_path(L.path),
        nccl_path=L.path,
        nccl_rule=L.rule,
        nccl_version=".".join(str(v) for v in L.version),
        cudart_path=rt.path,
        cudart_rule=rt.rule,
    )


def _is_loopback_path(path: str) -> bool:
    base = os.path.basename(path)
    return base.startswith("libpynccl_loopback") or "/pynccl/loopback" in path.replace(os.sep, "/")


def _in_launcher() -> bool:
    return any(os.environ.get(v) for v in _LAUNCHER_VARS)


def _gpu_count() -> tuple[int, bool]:
    """(visible devices, whether they are the loopback's) without building anything."""
    from .. import cuda, library

    n = cuda.device_count()
    if n == 0:
        return 0, False
    return n, _is_loopback_path(library.cudart().path)


def _use_loopback(devices: int) -> None:
    """Make this process use the loopback libraries (no GPU and none configured), with
    at least ``devices`` devices."""
    if devices > _LOOPBACK_DEVICES:
        os.environ.setdefault("PYNCCL_LOOPBACK_DEVICES", str(devices))
    try:
        from ..testing import loopback

        with _progress("preparing pynccl's loopback libraries (compiled on first use)"):
            loopback.use()
    except Exception as e:
        raise PerfError(
            f"there is no GPU here and the loopback libraries could not be prepared: "
            f"{type(e).__name__}: {e}"
        ) from e


def _loopback_env() -> dict[str, str]:
    """The environment that makes child processes use the loopback (built here, once)."""
    try:
        from ..testing import loopback

        with _progress("preparing pynccl's loopback libraries (compiled on first use)"):
            return dict(loopback.env())
    except Exception as e:
        raise PerfError(
            f"there is no GPU here and the loopback libraries could not be prepared: "
            f"{type(e).__name__}: {e}"
        ) from e


def _worker(opts: Options) -> int:
    """Inside a launcher: this process is one rank."""
    from ..bootstrap import detect_launch_env, from_env

    env = detect_launch_env()
    # Started by perf itself, the ranks share the coordinator's -g (its default included).
    ours = os.environ.get(_ENV_NGPUS)
    per_thread = opts.ngpus or (int(ours) if ours else 1)
    asked = opts.nthreads * per_thread
    if (opts.ngpus is not None or opts.nthreads > 1) and asked != env.world_size:
        flags = f"-t {opts.nthreads} -g {per_thread}" if opts.nthreads > 1 else f"-g {asked}"
        started = f"{env.world_size} rank" + ("" if env.world_size == 1 else "s")
        raise PerfError(
            f"{flags}, but the {env.launcher} launcher started {started}: "
            "drop -g (and -t) inside a launcher, or start that many ranks"
        )
    first = opts.tests_env.device
    device = None
    if first is not None:
        # perf's own launch is one nccl-tests process of many GPUs (D + local rank); under
        # another launcher each rank is a process of one GPU, so D itself.
        device = first + ((env.local_rank or 0) if ours else 0)
    gpus, loop = _gpu_count()
    if gpus == 0:
        _use_loopback(max(env.local_world_size or env.world_size, (device or 0) + 1))
        loop = True
    opts.resolve(loop)
    _ = opts.sizes  # validate before the rendezvous
    _check_run(opts, env.world_size)
    comm = from_env() if device is None else from_env(device=device)
    return _finish(opts, comm)


def _check_run(opts: Options, nranks: int) -> None:
    """What the ranks would refuse one by one, refused once before they start."""
    opts.tests_env.check_groups(nranks)
    if opts.traffic is not None and opts.minbytes is not None and opts.maxbytes is not None:
        opts.traffic.check(nranks, opts.minbytes, opts.maxbytes)


#: Host memory of one loopback rank besides its buffers: the interpreter, numpy, the
#: libraries (measured at 40 MiB; rounded up).
_RANK_OVERHEAD = 64 << 20
_STAGING = 32 << 20  # the most -c's three host staging buffers each use (_Bench._host)
_MAX_LOOPBACK_DEVICES = 1024  # PYNCCL_LOOPBACK_DEVICES' limit
_FEW_RANKS = 4  # the loopback's usual worlds: a few seconds on any machine


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_loopback_load(opts: Options, flags: str, nranks: int) -> None:
    """On the loopback every rank is a process computing on the CPU in host memory:
    refuse a run whose buffers cannot fit in memory, and say when the ranks outnumber
    the CPU cores (they then take turns, so the run is slow and its figures mean little)."""
    assert opts.maxbytes is not None
    devices = (opts.tests_env.device or 0) + nranks
    if devices > _MAX_LOOPBACK_DEVICES:
        raise PerfError(
            f"{flags}: the loopback emulates at most {_MAX_LOOPBACK_DEVICES} devices, one per "
            f"rank ({devices} asked for)"
        )
    buffers = 2 * (max(opts.maxbytes, 64) + 8 * opts.unalign)
    staging = 3 * min(_STAGING, opts.maxbytes) if opts.check != 0 else 0
    need = nranks * (buffers + staging + _RANK_OVERHEAD)
    have = _available_memory()
    gib = 1 << 30
    if have is not None and need > 0.8 * have:  # the rest for the system and the launcher
        raise PerfError(
            f"{flags}: {nranks} loopback ranks need about {need / gib:.1f} GiB of host memory "
            f"(the loopback's device buffers are host memory: 2 x {opts.maxbytes} B per rank, "
            f"plus about {(_RANK_OVERHEAD + staging) >> 20} MiB per rank process) and "
            f"{have / gib:.1f} GiB is available: run fewer ranks (-g) or smaller sizes (-e)"
        )
    cores = _cpu_count()
    if nranks > max(cores, _FEW_RANKS):
        print(
            f"python -m pynccl perf: warning: {flags} starts {nranks} loopback ranks on "
            f"{cores} CPU core{'s' if cores > 1 else ''}: each rank is a process that moves "
            "its data on the CPU, so they take turns; the run is slow and its figures say "
            f"little (-g {cores} or fewer keeps one core per rank)",
            file=sys.stderr,
            flush=True,
        )


def _finish(opts: Options, comm: Any) -> int:
    """Run the sweep on ``comm`` (split into NCCL_TESTS_SPLIT's groups first), then
    destroy what it made; on an error, abort instead."""
    group = None
    try:
        color = opts.tests_env.color(int(comm.rank))
        if opts.tests_env.split is not None:
            group = comm.split(color, key=int(comm.rank))
        code = _run_rank(opts, group or comm, _backend(), world=comm, color=color)
    except BaseException:
        if group is not None:
            group.abort()
        comm.abort()  # idempotent: _run_rank may have done it
        raise
    if group is not None:
        group.destroy()
    comm.destroy()
    return code


def _coordinate(opts: Options, argv: Sequence[str]) -> int:
    """Started by hand: pick the backend and run -g ranks."""
    gpus, loop_configured = _gpu_count()
    loop = gpus == 0 or loop_configured
    if opts.ngpus is not None:
        per_thread = opts.ngpus
    elif opts.nthreads > 1:
        per_thread = 1  # nccl-tests' -g: -t T alone runs T ranks
    else:
        per_thread = 2 if loop else gpus
    nranks = opts.nthreads * per_thread
    first = opts.tests_env.device or 0
    flags = f"-t {opts.nthreads} -g {per_thread}" if opts.nthreads > 1 else f"-g {nranks}"
    if not loop and first + nranks > gpus:
        if first:
            raise PerfError(
                f"{flags} with NCCL_TESTS_DEVICE={first} needs devices {first} to "
                f"{first + nranks - 1}: only {gpus} visible"
            )
        raise PerfError(f"{flags} needs {nranks} GPUs: only {gpus} visible")
    opts.resolve(loop)
    sizes = opts.sizes  # validate before starting anything
    if opts.collective.rooted and opts.root >= nranks:
        raise PerfError(f"-r {opts.root}: the root must be below the {nranks} ranks")
    _check_run(opts, nranks)
    if loop:
        _check_loopback_load(opts, flags, nranks)
    os.environ[_ENV_NGPUS] = str(per_thread)  # the nGpus of the header (ranks inherit it)
    if nranks == 1:
        from ..comm import Communicator, UniqueId

        if gpus == 0:
            _use_loopback(first + 1)
        comm = Communicator(1, UniqueId(), 0, device=first)
        return _finish(opts, comm)
    claimed = None
    if opts.output_file:  # -J: one name for the whole run, taken before it starts
        claimed = os.environ[_ENV_J_PATH] = _claim_output_file(opts.output_file)
    try:
        return _launch(opts, argv, nranks, loopback_build=gpus == 0, rows=len(sizes))
    finally:
        if claimed is not None:
            del os.environ[_ENV_J_PATH]
            if os.path.exists(claimed) and os.path.getsize(claimed) == 0:
                os.unlink(claimed)  # the run failed before writing it: leave nothing behind


_PREFIX = re.compile(rb"^\[rank (\d+)\] ")


def _launch(
    opts: Options, argv: Sequence[str], nranks: int, loopback_build: bool, rows: int
) -> int:
    """Run ``python -m pynccl launch -n N -m pynccl perf ARGV`` and relay rank 0's report.

    The launcher starts, watches and stops the ranks; here only its stdout is read,
    with the ``[rank 0] `` prefix taken off rank 0's lines so the table reads as
    nccl-tests' does (other ranks' lines, and everything on stderr, keep theirs).
    """
    # No --timeout for the launcher: -T bounds each wait inside the ranks, as nccl-tests.
    cmd = [sys.executable, "-m", "pynccl", "launch", "-n", str(nranks)]
    cmd += ["-m", "pynccl", "perf", *argv]
    env = dict(os.environ)
    if loopback_build:
        env.update(_loopback_env())
    # The ranks import this very pynccl, wherever it was imported from.
    # (the directory holding pynccl/, three levels up from pynccl/perf/_run.py)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    devices = (opts.tests_env.device or 0) + nranks
    if loopback_build and devices > _LOOPBACK_DEVICES:
        env.setdefault("PYNCCL_LOOPBACK_DEVICES", str(devices))
    known = opts.datatype != ["all"] and opts.op != ["all"] and opts.root != -1
    total = rows * len(opts.datatype) * len(opts.op) * opts.run_cycles
    console = _Console(sys.stdout, total if known and opts.run_cycles else None)
    # Its own session: a terminal's Ctrl-C reaches it once, through the forwarding below.
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )

    def forward(signum: int, _frame: Any) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, forward)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            match = _PREFIX.match(raw)
            if match is not None and match.group(1) == b"0":
                raw = raw[match.end() :]
            console.line(raw.decode(errors="replace").rstrip("\n"))
        return proc.wait()
    finally:
        console.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if proc.poll() is None:  # only on an error here: the launcher stops its ranks
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m pynccl perf``; returns the exit status (see :mod:`pynccl.perf`'s docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if any(a in ("-h", "--help") for a in args):
            _parser().print_help()
            return 0
        opts = _parse(args)
        if _in_launcher():
            return _worker(opts)
        return _coordinate(opts, args)
    except PerfError as e:
        print(f"python -m pynccl perf: error: {e}", file=sys.stderr)
        return 2
    except PerfTimeout as e:
        print(f"python -m pynccl perf: timeout: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("python -m pynccl perf: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from ..errors import CudaError, NcclError, NotSupportedError

        if isinstance(e, (NcclError, CudaError, NotSupportedError, ValueError, TypeError, OSError)):
            print(f"python -m pynccl perf: {type(e).__name__}: {e}", file=sys.stderr)
            from ..info import LOOPBACK_HINT, no_gpu_error

            if no_gpu_error(e):
                print(LOOPBACK_HINT, file=sys.stderr)
        else:
            traceback.print_exc()
        return 1
