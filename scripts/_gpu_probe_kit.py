"""The toolkit of ``scripts/gpu_probes.py``: the probe registry, Skip/Fail, a one-rank
communicator, stream holds that widen race windows, and result checks against numpy."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

Result = dict[str, Any]
PROBES: dict[str, tuple[Callable[[], Result], float]] = {}
N = 1 << 16  # elements per buffer: small, the holds make the windows wide


def probe(name: str, limit: float = 60.0) -> Callable[[Callable[[], Result]], Callable[[], Result]]:
    def register(fn: Callable[[], Result]) -> Callable[[], Result]:
        PROBES[name] = (fn, limit)
        return fn

    return register


class Skip(Exception):
    """Raised by a probe that cannot run here (the message says why)."""


class Fail(Exception):
    """Raised by a probe that saw the hazard (the message says what)."""


# -- shared pieces -------------------------------------------------------------------------


def _np() -> Any:
    import numpy as np

    return np


def ngpus() -> int:
    from pynccl import cuda

    return int(cuda.device_count())


def needs_ranks(n: int) -> None:
    have = ngpus()
    if have < n:
        raise Skip(f"1 rank only: needs {n} GPUs, {have} visible")


def one_rank(**kw: Any) -> Any:
    from pynccl import Communicator, UniqueId, cuda

    cuda.set_device(0)
    return Communicator(1, UniqueId(), 0, device=0, **kw)


def needs_nccl(release: tuple[int, int, int], what: str) -> None:
    from pynccl import version

    if tuple(version()) < release:
        raise Skip(f"{what} needs NCCL >= {'.'.join(map(str, release))}, have {version()}")


def host_copy(buf: Any, dtype: str, stream: Any) -> Any:
    """``buf``'s contents read on ``stream`` (a non-blocking one: it does not wait for the
    legacy default stream, so it sees what is really there now)."""
    np = _np()
    from pynccl import cudart

    out = np.empty(buf.nbytes // np.dtype(dtype).itemsize, dtype)
    rt = cudart()
    rt.cudaMemcpyAsync(out.ctypes.data, buf.ptr, buf.nbytes, 2, stream.handle)
    rt.cudaStreamSynchronize(stream.handle)
    return out


_KEEP: list[object] = []  # host functions and kernels the holds use, kept alive


def hold(stream: int, seconds: float) -> str:
    """Keep ``stream`` (a handle) busy for about ``seconds``; returns how."""
    choice = os.environ.get("PROBE_HOLD", "")
    if not choice and os.environ.get("PYNCCL_GPU_REHEARSAL") == "1":
        choice = "hostfunc"  # on the loopback: no kernels
    if choice == "none":
        return "none"
    if choice in ("", "torch") and "torch" in sys.modules:
        torch = sys.modules["torch"]
        if not hasattr(hold, "cycles_per_s"):  # calibrate once
            torch.cuda.synchronize()
            t = time.perf_counter()
            torch.cuda._sleep(10**8)
            torch.cuda.synchronize()
            hold.cycles_per_s = 10**8 / (time.perf_counter() - t)  # type: ignore[attr-defined]
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.cuda._sleep(int(seconds * hold.cycles_per_s))  # type: ignore[attr-defined]
        return "torch.cuda._sleep"
    if choice in ("", "cupy"):
        try:
            import cupy as cp  # type: ignore[import-not-found]
        except ImportError:
            if choice == "cupy":
                raise
        else:
            kernel = cp.RawKernel(
                r"""extern "C" __global__ void spin(long long cycles) {
                    long long t0 = clock64(); while (clock64() - t0 < cycles) {} }""",
                "spin",
            )
            _KEEP.append(kernel)
            khz = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0)
            cycles = cp.int64(int(seconds * khz * 1000))
            kernel((1,), (1,), (cycles,), stream=cp.cuda.ExternalStream(stream))
            return "cupy spin kernel"
    if choice in ("", "hostfunc"):
        from pynccl import cudart

        try:
            launch = ctypes.CDLL(cudart().path)["cudaLaunchHostFunc"]
        except AttributeError:
            launch = None
        if launch is not None:
            callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _p: time.sleep(seconds))
            _KEEP.append(callback)
            launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            rc = launch(stream or None, callback, None)
            if rc == 0:
                return "cudaLaunchHostFunc"
    return "none"


def watchdog_alive() -> bool:
    """Whether a watchdog thread runs (by its thread name, "pynccl-watchdog-rank<r>")."""
    return any(t.name.startswith("pynccl-watchdog") and t.is_alive() for t in threading.enumerate())


def in_thread(fn: Callable[[], object], limit: float) -> tuple[float | None, BaseException | None]:
    """Run ``fn`` in a daemon thread: (seconds it took or None if still running, its error)."""
    box: list[BaseException | None] = [None]

    def body() -> None:
        try:
            fn()
        except BaseException as e:  # reported, not raised: the probe decides
            box[0] = e

    t0 = time.monotonic()
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(limit)
    return (None if t.is_alive() else round(time.monotonic() - t0, 2)), box[0]


def check_equal(label: str, got: Any, want: Any) -> None:
    np = _np()
    got = np.asarray(got)
    want = np.broadcast_to(np.asarray(want), got.shape)
    if not np.array_equal(got, want):
        wrong = int(np.count_nonzero(got != want))
        raise Fail(f"{label}: {wrong} of {got.size} wrong, got {got[:4]}..., want {want[:4]}...")


def check_consumed(
    label: str, comm: Any, out: Any, consumer: Any, producer: Any, how: str
) -> Result:
    """The end of a producer/consumer probe: the reduction into ``out``, issued on
    ``consumer``, must hold the 7s the producer wrote after its hold; then both streams
    are drained and ``comm`` destroyed. The probe's result: how the hold was made."""
    consumer.synchronize()
    check_equal(label, host_copy(out, "uint8", consumer), 7)
    producer.synchronize()
    comm.destroy()
    return {"hold": how}


def need(module: str) -> Any:
    """Import an array library, or skip: absent, or a rehearsal (it would want a real GPU)."""
    if os.environ.get("PYNCCL_GPU_REHEARSAL") == "1":
        raise Skip(f"rehearsal on the loopback: {module} needs a real GPU")
    try:
        return __import__(module)
    except ImportError as e:
        raise Skip(f"{module} is not installed ({e})") from None


def need_torch() -> Any:
    torch = need("torch")
    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device (a CPU-only build?)")
    return torch


def is_pynccl_error(error: BaseException) -> bool:
    from pynccl import CudaError, NcclError

    return isinstance(error, (NcclError, CudaError))


# -- running --------------------------------------------------------------------------------


def run_child(script: str, name: str, limit: float) -> Result:
    """Run probe ``name`` in a fresh interpreter (``script --child name``) within ``limit`` s."""
    cmd = [sys.executable, script, "--child", name]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return {
            "probe": name,
            "status": "timeout",
            "seconds": round(time.monotonic() - t0, 2),
            "detail": f"still running after {limit:g} s",
            "stderr": (err or "")[-400:],
        }
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"probe"')]
    if not lines:
        return {"probe": name, "status": "error", "detail": f"exit {proc.returncode}, no result",
                "stderr": proc.stderr[-600:]}  # fmt: skip
    result: Result = json.loads(lines[-1])
    return result


def perf(register: int) -> Result:
    """``python -m pynccl perf all_reduce -R register`` with its results checked (-c 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "perf.json")
        cmd = [sys.executable, "-m", "pynccl", "perf", "all_reduce", "-g", str(ngpus()), "-b",
               "4K", "-e", "16M", "-f", "4", "-n", "5", "-w", "1", "-c", "1", "-R", str(register),
               "-T", "40", "--json", report]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=80)
        if proc.returncode != 0:
            raise Fail(f"perf -R {register} exit {proc.returncode}: {proc.stderr[-400:]}")
        with open(report) as f:
            doc = json.load(f)
    wrong = sum(row[k]["nwrong"] for row in doc["results"] for k in ("out_of_place", "in_place"))
    if wrong:
        raise Fail(f"perf -R {register}: {wrong} wrong values")
    return {"rows": len(doc["results"]), "ranks": doc.get("parameters", {}).get("ngpus")}


def sanitizer() -> str | None:
    """compute-sanitizer's path, or None."""
    found = shutil.which("compute-sanitizer")
    if found is None and os.path.exists("/usr/local/cuda/bin/compute-sanitizer"):
        found = "/usr/local/cuda/bin/compute-sanitizer"
    return found
