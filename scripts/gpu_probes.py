"""Single-GPU probes of the hazards of issue 20, for ``scripts/gpu_check.sh``.

Each probe runs in a fresh interpreter (a GPU fault or a hang cannot spoil the next
one) with a time limit, and prints exactly one JSON line::

    {"probe": NAME, "status": "ok" | "FAIL" | "skipped" | "error" | "timeout", ...}

``ok``: the hazard was provoked and pynccl behaved; ``FAIL``: it did not (a wrong
result, a hang past its bound, a watchdog gone, a pynccl/CUDA error under the
hazard); ``skipped``: with ``reason`` (no torch/CuPy, "1 rank only", NCCL too old);
``error``: the probe itself broke (a bug here, or an API that changed); ``timeout``:
the child ran past its limit. Results are checked against numpy or the array
library's own arithmetic, never against pynccl.

Race windows are widened by holding a stream busy: ``torch.cuda._sleep`` where torch
is imported anyway, else a CuPy spin kernel, else ``cudaLaunchHostFunc`` with a
sleeping host function (``PROBE_HOLD=torch|cupy|hostfunc|none`` forces one).

    python scripts/gpu_probes.py [--budget S] [--rehearsal] [NAME ...]
    python scripts/gpu_probes.py --list

Exit status: 0 when no probe failed; 1 when one reported FAIL, error or timeout
(with ``--rehearsal``, on the loopback libraries: only ``error`` counts, as the
rehearsal checks this script, not the GPU); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from _gpu_probe_kit import (  # this directory: sys.path[0] when run as a script
    PROBES,
    Fail,
    N,
    Result,
    Skip,
    check_consumed,
    check_equal,
    hold,
    host_copy,
    in_thread,
    is_pynccl_error,
    need,
    need_torch,
    needs_nccl,
    needs_ranks,
    one_rank,
    perf,
    probe,
    run_child,
    sanitizer,
    watchdog_alive,
)


def _np() -> Any:
    import numpy as np

    return np


# -- the probes ----------------------------------------------------------------------------


@probe("basic")
def basic() -> Result:
    """One rank: all_reduce and all_gather against numpy (also what compute-sanitizer runs)."""
    np = _np()
    from pynccl import DeviceBuffer, Stream

    comm = one_rank()
    s = Stream(non_blocking=True)
    x = np.arange(N, dtype=np.float32) % 13
    a, b, g = DeviceBuffer.from_numpy(x), DeviceBuffer(N, "float32"), DeviceBuffer(N, "float32")
    comm.all_reduce(a, b, stream=s)
    comm.all_gather(a, g, stream=s)
    comm.synchronize(s, timeout=60)
    check_equal("all_reduce", b.to_numpy(), x)
    check_equal("all_gather", g.to_numpy(), x)
    comm.destroy()
    return {}


def _watchdog_capture(torch: Any) -> Result:
    """The watchdog polls an event while this thread captures a graph in global mode."""
    np = _np()
    from pynccl import DeviceBuffer, Stream, cuda

    comm = one_rank()
    comm.start_watchdog(60, interval=0.002)
    busy = Stream(non_blocking=True)
    x = np.arange(N, dtype=np.float32) % 7
    a, b = DeviceBuffer.from_numpy(x), DeviceBuffer(N, "float32")
    how = hold(busy.handle, 2.0)
    comm.all_reduce(a, b, stream=busy)  # its event stays pending: the watchdog queries it
    if torch is not None:
        # capture_begin/end rather than `with torch.cuda.graph()`, which synchronizes the
        # device on entry and so would wait out the hold
        t_in = torch.arange(N, device="cuda", dtype=torch.float32) % 7
        t_out = torch.zeros_like(t_in)
        cap = torch.cuda.Stream()
        cap.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(cap):
            graph.capture_begin()  # global mode, PyTorch's default
            try:
                time.sleep(0.5)
                comm.all_reduce(t_in, t_out, stream=cap)
            finally:
                graph.capture_end()
        graph.replay()
        torch.cuda.synchronize()
        got = t_out.cpu().numpy()
    else:
        cap_s = Stream(non_blocking=True)
        y = DeviceBuffer(N, "float32")
        graph = cuda.Graph()
        with graph.capture(cap_s, "global"):
            time.sleep(0.5)
            comm.all_reduce(a, y, stream=cap_s)
        graph.replay()
        cap_s.synchronize()
        got = y.to_numpy()
    check_equal("replayed all_reduce", got, x)
    comm.synchronize(busy, timeout=60)
    if comm.error is not None or str(comm.state) != "ready":
        raise Fail(f"communicator {comm.state} after the capture: {comm.error}")
    if not watchdog_alive():
        raise Fail("the watchdog thread is gone")
    # NCCL's destroy waits while a graph that captured the communicator lives
    if torch is not None:
        graph.reset()
    else:
        graph.close()
    comm.destroy()
    return {"hold": how}


@probe("watchdog-graph-capture")
def watchdog_graph_capture() -> Result:
    """Bug 1: the watchdog runs while pynccl.cuda.Graph captures (global mode)."""
    return _watchdog_capture(None)


@probe("watchdog-torch-graph")
def watchdog_torch_graph() -> Result:
    """Bug 1: the watchdog runs while a torch.cuda.CUDAGraph captures (global mode)."""
    return _watchdog_capture(need_torch())


@probe("watchdog-blocked-finalize", limit=90.0)
def watchdog_blocked_finalize() -> Result:
    """Bug 2: finalize() blocked behind work for longer than the gate timeout (10 s)."""
    np = _np()
    from pynccl import DeviceBuffer, Stream

    seconds = float(os.environ.get("PROBE_LONG_HOLD", "12"))
    comm = one_rank()
    comm.start_watchdog(120, interval=0.05)
    s = Stream(non_blocking=True)
    a, b = DeviceBuffer.from_numpy(np.ones(N, np.float32)), DeviceBuffer(N, "float32")
    how = hold(s.handle, seconds)
    if how == "none":
        raise Skip("no way to hold a stream busy here")
    comm.all_reduce(a, b, stream=s)
    samples: list[bool] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            samples.append(watchdog_alive())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    took, error = in_thread(comm.finalize, seconds + 40)
    done.set()
    sampler.join()
    out = {"hold": how, "finalize_s": took, "samples": len(samples)}
    if took is None:
        raise Fail(f"finalize() still blocked {seconds + 40:g} s later")
    if error is not None:
        raise Fail(f"finalize() raised {type(error).__name__}: {error}")
    if not all(samples):
        raise Fail(f"the watchdog died while finalize() was blocked ({out})")
    comm.destroy()
    return out


@probe("destroy-bounded", limit=90.0)
def destroy_bounded() -> Result:
    """Bug 3: destroy() with hung work returns within about the watchdog timeout."""
    np = _np()
    from pynccl import DeviceBuffer, Stream

    comm = one_rank()
    comm.start_watchdog(2.0, interval=0.1)
    s = Stream(non_blocking=True)
    a, b = DeviceBuffer.from_numpy(np.ones(N, np.float32)), DeviceBuffer(N, "float32")
    how = hold(s.handle, 40.0)  # stands in for a collective whose peer never comes
    if how == "none":
        raise Skip("no way to hold a stream busy here")
    comm.all_reduce(a, b, stream=s)
    time.sleep(1.0)
    took, error = in_thread(comm.destroy, 30.0)
    out = {"hold": how, "destroy_s": took, "state": str(comm.state)}
    if took is None or took > 15.0:
        raise Fail(f"destroy() with a hung operation took {took or '> 30'} s (watchdog 2 s)")
    if error is not None and not is_pynccl_error(error):
        raise error
    out["raised"] = None if error is None else type(error).__name__
    return out


@probe("nonblocking-group")
def nonblocking_group() -> Result:
    """Bug 4: a group on a non-blocking communicator, issued while its stream is busy."""
    np = _np()
    from pynccl import Config, DeviceBuffer, Stream, group

    comm = one_rank(config=Config(blocking=False))
    comm.wait_ready(60)
    s = Stream(non_blocking=True)
    x = np.arange(N, dtype=np.float32) % 11
    a = DeviceBuffer.from_numpy(x)
    b, g, r, c = (DeviceBuffer(N, "float32") for _ in range(4))
    how = hold(s.handle, 1.0)
    with group():
        comm.all_reduce(a, b, stream=s)
        comm.all_gather(a, g, stream=s)
        comm.send(a, 0, stream=s)
        comm.recv(r, 0, stream=s)
    with group():  # at once: the previous group may still be launching
        comm.all_reduce(b, c, stream=s)
    comm.synchronize(s, timeout=60)
    for label, buf in (("all_reduce", b), ("all_gather", g), ("recv", r), ("second", c)):
        check_equal(label, buf.to_numpy(), x)
    comm.destroy()
    return {"hold": how}


@probe("dangling-stream")
def dangling_stream() -> Result:
    """Bug 5: a Stream() passed to a communicator and dropped at once must stay usable."""
    np = _np()
    from pynccl import DeviceBuffer, Stream, cuda

    x = np.arange(N, dtype=np.float32) % 5
    comm = one_rank(stream=Stream(non_blocking=True))
    spare = []
    gc.collect()
    spare += [Stream(non_blocking=True) for _ in range(4)]  # may take a freed handle
    a, b = DeviceBuffer.from_numpy(x), DeviceBuffer(N, "float32")
    comm.all_reduce(a, b)
    comm.synchronize(timeout=60)
    check_equal("Communicator(stream=Stream())", b.to_numpy(), x)
    comm.stream = Stream(non_blocking=True)
    gc.collect()
    spare += [Stream(non_blocking=True) for _ in range(4)]
    b.fill_zero()
    cuda.synchronize()
    comm.all_reduce(a, b)
    comm.synchronize(timeout=60)
    check_equal("comm.stream = Stream()", b.to_numpy(), x)
    op = comm.all_reduce_init(a, b, stream=Stream(non_blocking=True))
    gc.collect()
    spare += [Stream(non_blocking=True) for _ in range(4)]
    b.fill_zero()
    cuda.synchronize()
    op()
    cuda.synchronize()
    check_equal("all_reduce_init(stream=Stream())", b.to_numpy(), x)
    op.close()
    comm.destroy()
    return {}


@probe("cai-stream-v3")
def cai_stream_v3() -> Result:
    """Bug 6: a hand-made v3 __cuda_array_interface__ ``stream`` is waited for.

    pynccl's stream must wait for the producer's before it reads the bytes."""
    np = _np()
    from pynccl import DeviceBuffer, Stream, cudart

    comm = one_rank()
    consumer, producer = Stream(non_blocking=True), Stream(non_blocking=True)
    out = DeviceBuffer(N, "uint8")
    src = DeviceBuffer.from_numpy(np.zeros(N, np.uint8))
    how = hold(producer.handle, 1.0)
    cudart().cudaMemsetAsync(src.ptr, 7, N, producer.handle)  # written after the hold

    class Exported:
        __cuda_array_interface__ = {
            "shape": (N,),
            "typestr": "|u1",
            "data": (src.ptr, False),
            "version": 3,
            "strides": None,
            "stream": producer.handle,
        }

    comm.all_reduce(Exported(), out, stream=consumer)
    return check_consumed("all_reduce of the producer's bytes", comm, out, consumer, producer, how)


@probe("cai-cupy-side-stream")
def cai_cupy_side_stream() -> Result:
    """Bug 6: a CuPy array written on CuPy's stream, reduced on another stream."""
    cp = need("cupy")
    from pynccl import DeviceBuffer, Stream

    comm = one_rank()
    consumer = Stream(non_blocking=True)
    out = DeviceBuffer(N, "uint8")
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:  # CuPy exports the current stream: the producer's
        how = hold(producer.ptr, 1.0)
        x = cp.full(N, 7, dtype=cp.uint8)  # written on the producer, after the hold
        comm.all_reduce(x, out, stream=consumer)
    return check_consumed("all_reduce of CuPy's bytes", comm, out, consumer, producer, how)


@probe("helpers-finished")
def helpers_finished() -> Result:
    """Bug 7: copy_from(DeviceBuffer) and from_numpy() say they return once finished."""
    np = _np()
    from pynccl import DeviceBuffer, Stream, cuda

    cuda.set_device(0)
    reader = Stream(non_blocking=True)  # does not wait for the legacy default stream
    x = np.arange(N, dtype=np.int32)
    src, dst = DeviceBuffer.from_numpy(x), DeviceBuffer(N, "int32")
    cuda.synchronize()
    how = hold(0, 1.0)  # the legacy default stream, where the helpers' copies go
    dst.copy_from(src)
    check_equal("copy_from(DeviceBuffer)", host_copy(dst, "int32", reader), x)
    cuda.synchronize()
    how = hold(0, 1.0)
    fresh = DeviceBuffer.from_numpy(x * 3)
    check_equal("from_numpy", host_copy(fresh, "int32", reader), x * 3)
    cuda.synchronize()
    return {"hold": how}


@probe("watchdog-events-device")
def watchdog_events_device() -> Result:
    """Bug 8: watchdogs of ranks on devices 0 and 1, issued in a group from device 0."""
    needs_ranks(2)
    np = _np()
    from pynccl import Communicator, DeviceBuffer, Stream, cuda, group

    comms = Communicator.init_all(2)
    for c in comms:
        c.start_watchdog(60, interval=0.01)
    x = np.arange(N, dtype=np.float32)
    bufs = [(DeviceBuffer.from_numpy(x, device=r), DeviceBuffer(N, "float32", device=r))
            for r in range(2)]  # fmt: skip
    streams = [Stream(non_blocking=True, device=r) for r in range(2)]
    for label, pick in (("own streams", lambda r: streams[r]), ("stream 0", lambda r: 0)):
        cuda.set_device(0)
        with group():
            for r in range(2):
                comms[r].all_reduce(bufs[r][0], bufs[r][1], stream=pick(r))
        for r in range(2):
            comms[r].synchronize(pick(r), timeout=60)
            check_equal(f"{label}, rank {r}", bufs[r][1].to_numpy(), x * 2)
    for c in comms:
        c.destroy()
    return {}


@probe("caching-allocator-keepalive")
def caching_allocator_keepalive() -> Result:
    """Bug 9: buffers only pynccl holds stay alive until their stream is done (torch).

    A group's temporaries and a closed persistent op's buffers, under torch's caching
    allocator, which reuses a freed block at once."""
    torch = need_torch()
    comm = one_rank()
    side = torch.cuda.Stream()
    out = torch.zeros(N, device="cuda")
    results = {}
    for variant in ("group", "persistent-close"):
        out.zero_()
        torch.cuda.synchronize()
        how = hold(side.cuda_stream, 1.0)
        tmp = torch.full((N,), 3.0, device="cuda")
        if variant == "group":
            from pynccl import group

            with group():
                comm.all_reduce(tmp, out, stream=side.cuda_stream)
        else:
            op = comm.all_reduce_init(tmp, out, stream=side.cuda_stream)
            op()
            op.close()
        del tmp  # only pynccl may hold it now
        junk = torch.full((N,), -1.0, device="cuda")  # takes a freed block of that size
        torch.cuda.synchronize()
        results[variant] = float(out[0].item())
        del junk
    comm.destroy()
    bad = {k: v for k, v in results.items() if v != 3.0}
    if bad:
        raise Fail(f"collectives read memory reused by the allocator: {bad} (expected 3.0)")
    return {"hold": how}


@probe("destroy-with-live-graph")
def destroy_with_live_graph() -> Result:
    """Bug 10b: destroy() while a CUDA graph that captured the communicator is alive."""
    np = _np()
    from pynccl import DeviceBuffer, Stream, cuda

    comm = one_rank()
    s = Stream(non_blocking=True)
    a, b = DeviceBuffer.from_numpy(np.ones(N, np.float32)), DeviceBuffer(N, "float32")
    graph = cuda.Graph()
    with graph.capture(s):
        comm.all_reduce(a, b, stream=s)
    graph.replay()
    s.synchronize()
    took, error = in_thread(comm.destroy, 20.0)
    if took is None:
        raise Fail("destroy() with a live graph still blocked 20 s later")
    graph.close()
    raised = None if error is None else f"{type(error).__name__}: {error}"
    if error is not None and not is_pynccl_error(error):
        raise error
    return {"destroy_s": took, "raised": raised}


@probe("abortive-shrink-destroy")
def abortive_shrink_destroy() -> Result:
    """Bug 10a: after shrink(abort=True), tearing the parent down must not hang."""
    needs_ranks(2)
    needs_nccl((2, 27, 0), "shrink")
    from pynccl import Communicator

    comms = Communicator.init_all(2)
    child = comms[0].shrink([1], abort=True)  # rank 1 plays the dead peer
    took, error = in_thread(comms[0].destroy, 20.0)
    comms[1].abort()
    child.destroy()
    if took is None:
        raise Fail("the parent's destroy() after an abortive shrink blocked 20 s")
    return {"destroy_s": took, "raised": None if error is None else type(error).__name__}


@probe("last-error-clean")
def last_error_clean() -> Result:
    """Item 11: no CUDA error is left as the thread's last error by pynccl's own probes."""
    np = _np()
    from pynccl import DeviceBuffer, cuda, cudart

    rt = cudart()
    comm = one_rank()
    a, b = DeviceBuffer.from_numpy(np.ones(N, np.float32)), DeviceBuffer(N, "float32")
    rt.raw("cudaGetLastError")()
    comm.all_reduce(a, b, stream=0)
    cuda.is_capturing(0)
    comm.synchronize(0, timeout=60)
    left = int(rt.raw("cudaGetLastError")())
    comm.destroy()
    if left:
        raise Fail(f"cudaGetLastError() = {left} ({rt.error_name(left)}) after plain calls")
    return {}


@probe("perf-windows-R1", limit=100.0)
def perf_r1() -> Result:
    """perf with ncclMemAlloc buffers registered (-R 1)."""
    return perf(1)


@probe("perf-windows-R2", limit=100.0)
def perf_r2() -> Result:
    """perf with symmetric windows (-R 2)."""
    needs_nccl((2, 27, 0), "symmetric windows")
    return perf(2)


@probe("suspend-revoke-memstats")
def suspend_revoke_memstats() -> Result:
    """suspend/resume, mem_stats while suspended, revoke: on one rank."""
    needs_nccl((2, 29, 0), "suspend and mem_stats")
    np = _np()
    from pynccl import DeviceBuffer, Stream

    comm = one_rank()
    s = Stream(non_blocking=True)
    x = np.arange(N, dtype=np.float32) % 9
    a, b = DeviceBuffer.from_numpy(x), DeviceBuffer(N, "float32")
    comm.all_reduce(a, b, stream=s)
    comm.synchronize(s, timeout=60)
    before = comm.mem_stats()
    comm.suspend()
    during = comm.mem_stats()
    comm.resume()
    b.fill_zero(s)
    comm.all_reduce(a, b, stream=s)
    comm.synchronize(s, timeout=60)
    check_equal("all_reduce after resume", b.to_numpy(), x)
    if during.get("gpu_mem_total", 0) < before.get("gpu_mem_total", 0):
        # NCCL keeps the tracked totals while suspended (src/mem_manager.cc)
        raise Fail(f"gpu_mem_total fell while suspended: {before} -> {during}")
    if during.get("gpu_mem_suspended") != 1:
        raise Fail(f"gpu_mem_suspended is not 1 while suspended: {during}")
    comm.revoke()
    state = str(comm.state)
    comm.destroy()
    if state != "revoked":
        raise Fail(f"state after revoke() is {state!r}")
    return {"before": before, "during": during}


@probe("compute-sanitizer", limit=240.0)
def compute_sanitizer() -> Result:
    """The basic probe under compute-sanitizer's memcheck, when it is installed."""
    tool = sanitizer()
    if tool is None:
        raise Skip("compute-sanitizer is not installed")
    if os.environ.get("PYNCCL_GPU_REHEARSAL") == "1":
        raise Skip("rehearsal: the loopback is host memory, nothing for memcheck to see")
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "86", "--target-processes", "all",
           sys.executable, os.path.abspath(__file__), "--child", "basic"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220)
    summary = [ln for ln in proc.stdout.splitlines() if "ERROR SUMMARY" in ln]
    if proc.returncode != 0:
        raise Fail(f"memcheck exit {proc.returncode}: {summary or proc.stdout[-400:]}")
    return {"summary": summary[-1] if summary else None}


# -- the child and the runner --------------------------------------------------------------


def child(name: str) -> None:
    """Run one probe here; print its JSON line; leave at once (nothing waits at exit)."""
    fn, _ = PROBES[name]
    t0 = time.monotonic()
    line: Result = {"probe": name}
    try:
        line.update(status="ok", **fn())
    except Skip as e:
        line.update(status="skipped", reason=str(e))
    except Fail as e:
        line.update(status="FAIL", detail=str(e))
    except Exception as e:
        status = "FAIL" if is_pynccl_error(e) else "error"
        line.update(status=status, detail=f"{type(e).__name__}: {e}"[:600],
                    where=traceback.format_exc().splitlines()[-3:])  # fmt: skip
    line["seconds"] = round(time.monotonic() - t0, 2)
    sys.stdout.write(json.dumps(line, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no teardown: a held stream or a hung handle must not delay the next probe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="probes to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the probes and exit")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for all (default 400)")
    p.add_argument("--rehearsal", action="store_true", help="on the loopback: only errors fail")
    p.add_argument("--child", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child:
        child(opts.child)
    if opts.list:
        for name, (fn, limit) in PROBES.items():
            print(f"{name:<28} {limit:>4.0f}s  {(fn.__doc__ or '').splitlines()[0]}")
        return 0
    unknown = [n for n in opts.names if n not in PROBES]
    if unknown:
        p.error(f"unknown probe(s) {unknown}; --list shows them")
    deadline = time.monotonic() + opts.budget
    bad = {"error"} if opts.rehearsal else {"FAIL", "error", "timeout"}
    counts: dict[str, int] = {}
    for name in opts.names or list(PROBES):
        limit = PROBES[name][1]
        left = deadline - time.monotonic()
        if left < min(limit, 20.0):
            result = {"probe": name, "status": "skipped", "reason": "out of time (--budget)"}
        else:
            result = run_child(os.path.abspath(__file__), name, min(limit, left))
        print(json.dumps(result, default=str), flush=True)
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    print(f"# probes: {summary}", flush=True)
    return 1 if any(counts.get(k) for k in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
