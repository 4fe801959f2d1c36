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

from ._bench import _ENV_J_PATH, _ENV_NGPUS, PerfTimeout, _run_rank
from ._options import Options, _parse, _parser
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


def _use_loopback(nranks: int) -> None:
    """Make this process use the loopback libraries (no GPU and none configured)."""
    if nranks > _LOOPBACK_DEVICES:
        os.environ.setdefault("PYNCCL_LOOPBACK_DEVICES", str(nranks))
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
    asked = opts.nthreads * (opts.ngpus or 1)
    if (opts.ngpus is not None or opts.nthreads > 1) and asked != env.world_size:
        flags = f"-t {opts.nthreads} -g {opts.ngpus or 1}" if opts.nthreads > 1 else f"-g {asked}"
        started = f"{env.world_size} rank" + ("" if env.world_size == 1 else "s")
        raise PerfError(
            f"{flags}, but the {env.launcher} launcher started {started}: "
            "drop -g (and -t) inside a launcher, or start that many ranks"
        )
    gpus, loop = _gpu_count()
    if gpus == 0:
        _use_loopback(env.local_world_size or env.world_size)
        loop = True
    opts.resolve(loop)
    _ = opts.sizes  # validate before the rendezvous
    comm = from_env()
    return _finish(opts, comm)


def _finish(opts: Options, comm: Any) -> int:
    try:
        code = _run_rank(opts, comm, _backend())
    except BaseException:
        comm.abort()  # idempotent: _run_rank may have done it
        raise
    comm.destroy()
    return code


def _coordinate(opts: Options, argv: Sequence[str]) -> int:
    """Started by hand: pick the backend and run -g ranks."""
    gpus, loop_configured = _gpu_count()
    loop = gpus == 0 or loop_configured
    per_thread = opts.ngpus if opts.ngpus is not None else (2 if loop else gpus)
    nranks = opts.nthreads * per_thread
    if not loop and nranks > gpus:
        flags = f"-t {opts.nthreads} -g {per_thread}" if opts.nthreads > 1 else f"-g {nranks}"
        raise PerfError(f"{flags} needs {nranks} GPUs: only {gpus} visible")
    opts.resolve(loop)
    sizes = opts.sizes  # validate before starting anything
    if opts.collective.rooted and opts.root >= nranks:
        raise PerfError(f"-r {opts.root}: the root must be below the {nranks} ranks")
    os.environ[_ENV_NGPUS] = str(per_thread)  # the nGpus of the header (ranks inherit it)
    if nranks == 1:
        from ..comm import Communicator, UniqueId

        if gpus == 0:
            _use_loopback(1)
        comm = Communicator(1, UniqueId(), 0, device=0)
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
    if loopback_build and nranks > _LOOPBACK_DEVICES:
        env.setdefault("PYNCCL_LOOPBACK_DEVICES", str(nranks))
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
