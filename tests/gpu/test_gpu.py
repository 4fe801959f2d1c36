"""Checks that need a real NVIDIA GPU (``pytest -m gpu``; ``scripts/gpu_check.sh`` runs them).

Everything here is skipped, with the reason, on machines without a GPU. Each test
runs its body in a fresh Python process against the real libnccl and libcudart:
a GPU failure cannot poison the test process, and loopback libraries that other
test modules load into this process cannot be picked up by mistake. Results are
checked against numpy (or the array library's own arithmetic), never against
pynccl.

* every collective, p2p and pre-multiplied sums on a 1-rank communicator;
* several ranks in one process (``Communicator.init_all``) where several GPUs exist;
* CuPy, torch (bfloat16 through DLPack) and cuda.core buffers and streams;
* CUDA-graph capture and replay of all-reduce and all-gather, and the clear
  refusal of calls that cannot be captured;
* ``python -m pynccl perf`` on the GPU, with ``-c 1`` and ``-G``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from test_examples import EXAMPLES, gpu_command

HAS_DRIVER = os.path.exists("/proc/driver/nvidia/version")
#: PYNCCL_GPU_REHEARSAL=1: run these checks on the loopback libraries instead (no GPU
#: needed), so that their scripts are exercised where no GPU is lent; see
#: tests/gpu/test_gpu_rehearsal.py. What needs CuPy, torch or cuda.core still skips.
REHEARSAL = os.environ.get("PYNCCL_GPU_REHEARSAL") == "1"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not HAS_DRIVER and not REHEARSAL,
        reason="needs an NVIDIA GPU (no driver: /proc/driver/nvidia/version)",
    ),
]


def _env() -> dict[str, str]:
    # The real libraries: nothing pointing at a loopback build, nothing from a launcher.
    drop = ("PYNCCL_NCCL_LIBRARY", "PYNCCL_CUDART_LIBRARY", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if REHEARSAL:
        from pynccl.testing import loopback

        env.update(loopback.env())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("NCCL_DEBUG", "WARN")
    return env


def run_child(code: str, timeout: float = 180) -> Any:
    """Run ``code`` in a fresh interpreter; it prints one JSON value on its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


@pytest.fixture(scope="module")
def ngpus() -> int:
    """Number of visible GPUs (asked in a child process); skip when there are none."""
    n = int(run_child("from pynccl import cuda; print(cuda.device_count())"))
    if n == 0:
        pytest.skip("the NVIDIA driver is present but no GPU is visible")
    return n


def test_every_collective_on_one_rank(ngpus: int) -> None:
    out = run_child(
        """
        import json
        import numpy as np
        from pynccl import cuda, RedOp
        from pynccl.comm import Communicator, UniqueId
        from pynccl.cuda import DeviceBuffer, Stream
        from pynccl.groups import group

        try:
            import ml_dtypes
            extra = ["bfloat16"]
        except ImportError:
            extra = []
        cuda.set_device(0)
        comm = Communicator(1, UniqueId(), 0, device=0)
        s = Stream(non_blocking=True)
        rng = np.random.default_rng(7)
        failures, checked = [], 0

        def expect(label, buf, want):
            global checked
            s.synchronize()
            got = buf.to_numpy()
            checked += 1
            if not np.array_equal(got.astype(np.float64), np.asarray(want).astype(np.float64)):
                failures.append(label)

        n = 1000
        for t in ["float32", "float16", "float64", "int32", "uint8", "int64", "int8"] + extra:
            dt = np.dtype(ml_dtypes.bfloat16) if t == "bfloat16" else np.dtype(t)
            x = rng.integers(0, 16, n).astype(dt)
            a = DeviceBuffer.from_numpy(x)
            out = DeviceBuffer(n, t)
            ops = [RedOp.SUM, RedOp.PROD, RedOp.MAX, RedOp.MIN]
            if dt.kind not in "iu":
                ops.append(RedOp.AVG)
            for op in ops:  # one rank: every reduction is the identity
                out.fill_zero(s)
                comm.all_reduce(a, out, op, stream=s)
                expect(f"all_reduce {t} {op.name}", out, x)
                out.fill_zero(s)
                comm.reduce(a, out, op, root=0, stream=s)
                expect(f"reduce {t} {op.name}", out, x)
                out.fill_zero(s)
                comm.reduce_scatter(a, out, op, stream=s)
                expect(f"reduce_scatter {t} {op.name}", out, x)
            premul = comm.create_premul_sum(3, t)  # a real computation, even on one rank
            comm.all_reduce(a, out, premul, stream=s)
            expect(f"premulsum x3 {t}", out, (x.astype(np.float64) * 3).astype(dt))
            comm.destroy_op(premul)
            b = DeviceBuffer.from_numpy(x)
            comm.all_reduce(b, stream=s)  # in place
            expect(f"all_reduce in place {t}", b, x)
            for name, call in [
                ("broadcast", lambda: comm.broadcast(a, out, root=0, stream=s)),
                ("all_gather", lambda: comm.all_gather(a, out, stream=s)),
                ("gather", lambda: comm.gather(a, out, root=0, stream=s)),
                ("scatter", lambda: comm.scatter(a, out, root=0, stream=s)),
                ("all_to_all", lambda: comm.all_to_all(a, out, stream=s)),
            ]:
                out.fill_zero(s)
                call()
                expect(f"{name} {t}", out, x)
            out.fill_zero(s)
            with group():
                comm.send(a, 0, stream=s)
                comm.recv(out, 0, stream=s)
            expect(f"send/recv to self {t}", out, x)
        comm.destroy()
        print(json.dumps({"failures": failures, "checked": checked}))
        """
    )
    assert out["failures"] == []
    assert out["checked"] >= 7 * 19


def test_several_ranks_in_one_process(ngpus: int) -> None:
    if ngpus < 2:
        pytest.skip(f"needs at least 2 GPUs, {ngpus} visible")
    out = run_child(
        f"""
        import json
        import numpy as np
        from pynccl.comm import Communicator
        from pynccl.cuda import DeviceBuffer, Stream
        from pynccl.groups import group

        n = {min(ngpus, 8)}
        comms = Communicator.init_all(n)
        streams = [Stream(non_blocking=True, device=d) for d in range(n)]
        xs = [np.arange(4096, dtype=np.float32) * (r + 1) for r in range(n)]
        send = [DeviceBuffer.from_numpy(xs[r], device=r) for r in range(n)]
        summed = [DeviceBuffer(4096, "float32", device=r) for r in range(n)]
        gathered = [DeviceBuffer(4096 * n, "float32", device=r) for r in range(n)]
        with group():
            for r in range(n):
                comms[r].all_reduce(send[r], summed[r], stream=streams[r])
        with group():
            for r in range(n):
                comms[r].all_gather(send[r], gathered[r], stream=streams[r])
        bad = []
        want_sum = np.sum(xs, axis=0)
        want_cat = np.concatenate(xs)
        for r in range(n):
            streams[r].synchronize()
            if not np.array_equal(summed[r].to_numpy(), want_sum):
                bad.append(f"all_reduce rank {{r}}")
            if not np.array_equal(gathered[r].to_numpy(), want_cat):
                bad.append(f"all_gather rank {{r}}")
        for c in comms:
            c.destroy()
        print(json.dumps({{"bad": bad, "n": n}}))
        """
    )
    assert out["bad"] == [] and out["n"] >= 2


def test_cupy_arrays_and_streams(ngpus: int) -> None:
    pytest.importorskip("cupy")
    if REHEARSAL:  # CuPy calls the real libcudart, which needs the driver
        pytest.skip("cupy needs the NVIDIA driver, which the loopback does not stand in for")
    out = run_child(
        """
        import json
        import cupy as cp
        from pynccl.comm import Communicator, UniqueId

        cp.cuda.Device(0).use()
        comm = Communicator(1, UniqueId(), 0, device=0)
        st = cp.cuda.Stream(non_blocking=True)
        res = {}
        for dt in (cp.float32, cp.float16, cp.int32):
            x = (cp.arange(2048) % 17).astype(dt)
            y = cp.zeros_like(x)
            comm.all_reduce(x, y, stream=st)
            op = comm.create_premul_sum(2, cp.dtype(dt).name)
            z = cp.zeros_like(x)
            comm.all_reduce(x, z, op, stream=st)
            g = cp.zeros(x.size, dtype=dt)
            comm.all_gather(x, g, stream=st)
            st.synchronize()
            comm.destroy_op(op)
            res[cp.dtype(dt).name] = [
                bool(cp.array_equal(y, x)),
                bool(cp.array_equal(z, x * 2)),
                bool(cp.array_equal(g, x)),
            ]
        comm.destroy()
        print(json.dumps(res))
        """
    )
    assert all(all(v) for v in out.values()), out


def _torch_cuda_build() -> None:
    """Skip unless torch is installed as a CUDA build (the CPU wheel has no CUDA API to
    drive, on a GPU or on the loopback)."""
    if not _has("torch"):
        pytest.skip("torch is not installed")
    cuda = run_child("import json, torch; print(json.dumps(torch.version.cuda))")
    if cuda is None:
        pytest.skip("torch is a CPU build (torch.version.cuda is None)")


def test_torch_tensors_including_bfloat16_via_dlpack(ngpus: int) -> None:
    _torch_cuda_build()
    out = run_child(
        """
        import json
        import torch
        from pynccl.comm import Communicator, UniqueId

        torch.cuda.set_device(0)
        comm = Communicator(1, UniqueId(), 0, device=0)
        stream = torch.cuda.current_stream()

        class OnlyDLPack:
            # exposes the tensor through DLPack alone (no __cuda_array_interface__)
            def __init__(self, t):
                self.t = t
            def __dlpack__(self, **kw):
                return self.t.__dlpack__(**kw)
            def __dlpack_device__(self):
                return self.t.__dlpack_device__()

        res = {}
        for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
            x = (torch.arange(4096, device="cuda") % 13).to(dt)
            y = torch.zeros_like(x)
            comm.all_reduce(x, y, stream=stream)  # bf16 has no __cuda_array_interface__
            op = comm.create_premul_sum(3, str(dt))
            z = torch.zeros_like(x)
            comm.all_reduce(OnlyDLPack(x), OnlyDLPack(z), op, stream=stream)
            comm.destroy_op(op)
            w = x.clone()
            comm.all_reduce(w, stream=stream)  # in place
            torch.cuda.synchronize()
            res[str(dt)] = [
                bool(torch.equal(y, x)),
                bool(torch.equal(z.float(), x.float() * 3)),
                bool(torch.equal(w, x)),
            ]
        comm.destroy()
        print(json.dumps(res))
        """
    )
    assert all(all(v) for v in out.values()), out
    assert "torch.bfloat16" in out


def test_cuda_core_streams_and_buffers(ngpus: int) -> None:
    if not (_has("cuda.core") or _has("cuda.core.experimental")):
        pytest.skip("cuda.core (cuda-python) is not installed")
    if REHEARSAL:  # cuda.core imports without a driver, but its Device calls cuInit
        pytest.skip("cuda.core needs the NVIDIA driver, which the loopback does not stand in for")
    out = run_child(
        """
        import json
        import numpy as np
        try:
            from cuda.core import Device
        except ImportError:
            from cuda.core.experimental import Device
        from pynccl import library
        from pynccl.comm import Communicator, UniqueId

        dev = Device(0)
        dev.set_current()
        st = dev.create_stream()
        comm = Communicator(1, UniqueId(), 0, device=0)
        n = 1024
        x = (np.arange(n) % 11).astype(np.float32)
        src = dev.allocate(x.nbytes, stream=st)
        dst = dev.allocate(x.nbytes, stream=st)
        st.sync()
        rt = library.cudart()
        rt.cudaMemcpy(int(src.handle), x.ctypes.data, x.nbytes, 1)
        op = comm.create_premul_sum(2.0, "float32")
        # a cuda.core Stream goes in as is (__cuda_stream__); buffers as raw pointers
        comm.all_reduce(int(src.handle), int(dst.handle), op, count=n, dtype="float32", stream=st)
        st.sync()
        comm.destroy_op(op)
        y = np.empty_like(x)
        rt.cudaMemcpy(y.ctypes.data, int(dst.handle), x.nbytes, 2)
        comm.destroy()
        print(json.dumps({"ok": bool(np.array_equal(y, x * 2))}))
        """
    )
    assert out == {"ok": True}


def test_graph_capture_and_replay(ngpus: int) -> None:
    out = run_child(
        """
        import json
        from ctypes import byref, c_void_p
        import numpy as np
        from pynccl import cuda, library
        from pynccl.comm import Communicator, UniqueId
        from pynccl.cuda import DeviceBuffer, Stream
        from pynccl.errors import NcclInvalidUsage

        cuda.set_device(0)
        rt = library.cudart()
        comm = Communicator(1, UniqueId(), 0, device=0)
        s = Stream(non_blocking=True)
        n = 4096
        x = DeviceBuffer.from_numpy(np.zeros(n, np.float32))
        y = DeviceBuffer(n, "float32")
        z = DeviceBuffer(n, "float32")
        op = comm.create_premul_sum(3.0, "float32")
        graph, exe = c_void_p(), c_void_p()
        rt.cudaStreamBeginCapture(s.handle, 1)  # cudaStreamCaptureModeThreadLocal
        capturing = s.is_capturing()
        comm.all_reduce(x, y, op, stream=s)
        comm.all_gather(y, z, stream=s)
        rt.cudaStreamEndCapture(s.handle, byref(graph))
        rt.cudaGraphInstantiate(byref(exe), graph, 0)
        replays = []
        for k in (1.0, 2.0, 5.0):  # new inputs each time: the graph reads them at replay
            x.copy_from(np.arange(n, dtype=np.float32) % 7 + k)
            y.fill_zero()
            z.fill_zero()
            cuda.synchronize()
            rt.cudaGraphLaunch(exe, s.handle)
            s.synchronize()
            want = (np.arange(n, dtype=np.float32) % 7 + k) * 3
            replays.append(bool(np.array_equal(y.to_numpy(), want))
                           and bool(np.array_equal(z.to_numpy(), want)))
        rt.cudaGraphExecDestroy(exe)
        rt.cudaGraphDestroy(graph)
        comm.destroy_op(op)

        # What cannot be captured is refused with a clear error, not a broken graph.
        uid = UniqueId()
        s2 = Stream(non_blocking=True)
        rt.cudaStreamBeginCapture(s2.handle, 1)
        refused = ""
        try:
            Communicator(1, uid, 0, device=0, stream=s2)
        except NcclInvalidUsage as e:
            refused = str(e)
        finally:
            g2 = c_void_p()
            rt.cudaStreamEndCapture(s2.handle, byref(g2))
            if g2.value:
                rt.cudaGraphDestroy(g2)

        # The same through pynccl.cuda.Graph; synchronize refuses instead of invalidating.
        g = cuda.Graph()
        sync_refused = ""
        with g.capture(s, "global"):
            comm.all_reduce(x, y, stream=s)
            try:
                comm.synchronize(s, timeout=5)
            except NcclInvalidUsage as e:
                sync_refused = str(e)
        x.copy_from(np.ones(n, np.float32))
        cuda.synchronize()
        g.replay()
        s.synchronize()
        graph_ok = bool(np.array_equal(y.to_numpy(), np.ones(n, np.float32)))
        g.close()
        # A blocking stream capturing (global mode): the legacy stream answers
        # cudaErrorStreamCaptureImplicit, and init on it is refused.
        uid3, blocking, g3 = UniqueId(), Stream(), cuda.Graph()
        implicit = ""
        with g3.capture(blocking, "global"):
            try:
                Communicator(1, uid3, 0, device=0)
            except NcclInvalidUsage as e:
                implicit = str(e)
        g3.close()
        comm.destroy()
        print(json.dumps({"capturing": capturing, "replays": replays, "refused": refused,
                          "sync_refused": sync_refused, "graph_ok": graph_ok,
                          "implicit": implicit}))
        """
    )
    assert out["capturing"] is True
    assert out["replays"] == [True, True, True]
    assert "captured" in out["refused"]
    assert "being captured" in out["sync_refused"]
    assert out["graph_ok"] is True
    assert "a stream of this device is being captured" in out["implicit"]


def test_perf_on_the_gpu(ngpus: int, tmp_path: Path) -> None:
    report = tmp_path / "perf.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pynccl",
            "perf",
            "all_reduce",
            "-g",
            "1",
            "-b",
            "1K",
            "-e",
            "4M",
            "-f",
            "16",
            "-n",
            "5",
            "-w",
            "1",
            "-c",
            "1",
            "-G",
            "3",
            "--json",
            str(report),
        ],
        env=_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("LOOPBACK" in proc.stdout) is REHEARSAL  # the banner says what was measured
    doc = json.loads(report.read_text())
    assert doc["loopback"] is REHEARSAL and doc["parameters"]["cudagraph"] == 3
    assert [r["size"] for r in doc["results"]] == [1024, 16384, 262144, 4194304]
    for row in doc["results"]:
        for key in ("out_of_place", "in_place"):
            assert row[key]["nwrong"] == 0 and row[key]["time"] > 0


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_on_the_gpu(ngpus: int, name: str) -> None:
    """Every program in examples/ as a user runs it on GPUs (the CuPy and torch ones too)."""
    example = EXAMPLES[name]
    if example.needs and (REHEARSAL or not _has(example.needs)):
        pytest.skip(f"{name} needs {example.needs} and a GPU")
    command = gpu_command(name, ngpus)
    if command is None:
        pytest.skip(f"{name} needs more GPUs than the {ngpus} here")
    proc = subprocess.run(
        [sys.executable, *command],
        env=_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert example.says in proc.stdout, proc.stdout
