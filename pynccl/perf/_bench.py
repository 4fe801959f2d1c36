"""One rank of a sweep: buffers, stream, timing (with CUDA graphs for ``-G``), ``-c``
checks, and the sweep itself."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable
from ctypes import addressof, create_string_buffer
from typing import TYPE_CHECKING, Any

from ..enums import DataType, RedOp
from ._colls import runner
from ._options import _REDOP, _TYPES, Options
from ._reference import _CHUNK, _Data, _expected, _mulsum_scale
from ._report import _Console, _Result, _row_text
from ._sweep import Counts, _doubling
from ._traffic import Traffic

if TYPE_CHECKING:
    from ..cuda import Graph


# --------------------------------------------------------------------------------------
# One rank


def _gpu_name(cudart_path: str, device: int) -> bytes:
    """``cudaDeviceProp.name`` (its first member, 256 chars) of ``device``, or b"" where
    the runtime cannot say. pynccl's prototype table has no cudaGetDeviceProperties (its
    struct changes between CUDA releases); only the leading name is read here, into a
    buffer larger than any release's struct."""
    import ctypes

    try:
        lib = ctypes.CDLL(cudart_path)
        fn = getattr(lib, "cudaGetDeviceProperties_v2", None) or lib.cudaGetDeviceProperties
    except (OSError, AttributeError):
        return b""
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    prop = ctypes.create_string_buffer(16384)
    if fn(prop, device) != 0:
        return b""
    return prop.raw[:256].split(b"\0", 1)[0]


_NOT_READY = 600  # cudaErrorNotReady
_STARTUP_TIMEOUT = 60.0  # seconds -T allows the first exchange (ranks start at their pace)


class PerfTimeout(Exception):
    """-T: one wait for the GPU took longer than the timeout (the communicator is aborted)."""


class _Bench:
    """One rank of a sweep: buffers, stream, timing, checks; rank 0 reports."""

    _H2D = 1
    _D2H = 2

    def __init__(
        self,
        opts: Options,
        comm: Any,
        console: _Console,
        world: Any = None,
        color: int = 0,
        traffic: Traffic | None = None,
    ) -> None:
        from .. import library
        from ..cuda import DeviceBuffer, Stream

        self.opts = opts
        # comm runs the operations: every rank, or this rank's group of NCCL_TESTS_SPLIT;
        # world (every rank) lines the ranks up, averages the times and sums the errors,
        # over all groups at once, as nccl-tests does over MPI_COMM_WORLD.
        self.comm = comm
        self.world = comm if world is None else world
        self.color = color
        self.rank = int(comm.rank)
        self.nranks = int(comm.size)
        self.console = console
        self.traffic = traffic
        self.rt = library.cudart()
        self.coll = opts.collective
        # -y 1: the legacy default stream, as nccl-tests' stream_null
        self.stream = None if opts.stream_null else Stream(non_blocking=True)
        self.s = 0 if self.stream is None else self.stream.handle
        self.bufs: list[Any] = []
        assert opts.maxbytes is not None
        # Every layout keeps both sides within maxbytes (per-rank blocks are count/n);
        # -u shifts both buffers by up to 8 bytes per element of misalignment.
        nbytes = max(opts.maxbytes, 64) + 8 * opts.unalign
        self.regs: list[Any] = []  # -R: registrations or windows, closed before the buffers
        try:
            # -R 1/2 as nccl-tests' local_register: send and recv from ncclMemAlloc,
            # registered (1) or in symmetric windows (2) for the whole run.
            allocator = "nccl" if opts.local_register else "cuda"
            self.send = self._alloc(DeviceBuffer, nbytes, allocator)
            self.recv = self._alloc(DeviceBuffer, nbytes, allocator)
            self.scratch = self._alloc(DeviceBuffer, 64)
            for buf in (self.send, self.recv):
                if opts.local_register == 1:
                    self.regs.append(comm.register(buf))
                elif opts.local_register == 2:
                    self.regs.append(comm.register_window(buf))
            for buf in (self.send, self.recv):
                buf.fill_zero(self.s)  # timed runs without -c still see defined data
            self.sync()
        except BaseException:
            self.close()
            raise
        self.rep = 0
        self.staging: list[Any] = []
        self.np: Any = None
        if opts.check:
            import numpy

            self.np = numpy

    def _alloc(self, cls: Any, nbytes: int, allocator: str = "cuda") -> Any:
        buf = cls(nbytes, DataType.UINT8, allocator=allocator)
        self.bufs.append(buf)
        return buf

    def close(self) -> None:
        regs, self.regs = self.regs, []
        try:
            for reg in reversed(regs):
                reg.close()  # a window's close is collective: every rank closes the same
        finally:
            self._free()

    def _free(self) -> None:
        for buf in self.bufs:
            buf.close()
        self.bufs.clear()
        if self.stream is not None:
            self.stream.close()

    def sync(self, at_least: float = 0.0) -> None:
        """Wait for the stream; with -T, abort and raise :class:`PerfTimeout` when one wait
        takes longer (nccl-tests' testStreamSynchronize), also on an asynchronous error.
        ``at_least``: a longer bound for this wait (the ranks' first exchange, which
        waits for the slowest rank to start)."""
        timeout = max(self.opts.timeout, at_least) if self.opts.timeout else 0.0
        if not timeout:
            self.rt.cudaStreamSynchronize(self.s)
            return
        deadline = time.monotonic() + timeout
        pause = 1e-5
        while int(self.rt.cudaStreamQuery(self.s)) == _NOT_READY:
            try:
                for comm in self._comms():  # an asynchronous NCCL error ends the wait
                    comm.check()
            except BaseException:
                self.abort()
                raise
            if time.monotonic() > deadline:
                self.abort()
                host = socket.gethostname().split(".")[0]
                print(f"{host}: Test timeout ({timeout:g}s) on rank {self.rank}", flush=True)
                what = (
                    f"a wait took longer than -T {timeout:g} s"
                    if timeout == self.opts.timeout
                    else f"the ranks' first exchange took longer than {timeout:g} s"
                )
                raise PerfTimeout(f"rank {self.rank}: {what}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _comms(self) -> list[Any]:
        return [self.comm] if self.world is self.comm else [self.comm, self.world]

    def abort(self) -> None:
        """Abort every communicator of this rank (idempotent)."""
        for comm in self._comms():
            comm.abort()

    # -- small collectives between the ranks --------------------------------------------

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        if nbytes:
            self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.s)

    def _scalar(self, value: float, dtype: DataType, op: RedOp | None) -> float:
        """All-reduce one number across the ranks (``op=None``: rank 0's value)."""
        fmt = "<d" if dtype is DataType.FLOAT64 else "<q"
        host = create_string_buffer(struct.pack(fmt, value), 8)
        ptr = self.scratch.ptr
        self._copy(ptr, addressof(host), 8, self._H2D)
        if op is None:
            self.world.broadcast(ptr, ptr, root=0, count=1, dtype=dtype, stream=self.s)
        else:
            self.world.all_reduce(ptr, ptr, op, count=1, dtype=dtype, stream=self.s)
        self._copy(addressof(host), ptr, 8, self._D2H)
        self.sync()
        return float(struct.unpack(fmt, host.raw)[0])

    def barrier(self) -> None:
        """Every rank has reached this point (a one-element all-reduce, waited for)."""
        self._scalar(0, DataType.INT64, RedOp.SUM)

    def devices(self, loopback: bool) -> list[dict[str, Any]]:
        """Every rank's pid, host, device, PCI bus id, GPU name and NCCL_TESTS_SPLIT group
        (an all-gather of fixed records over every rank)."""
        from ..cuda import DeviceBuffer

        device = int(self.comm.device)
        bus = create_string_buffer(32)
        try:
            self.rt.cudaDeviceGetPCIBusId(bus, 32, device)
        except Exception:  # an old runtime: the bus id is decoration
            bus.value = b""
        name = b"pynccl loopback (host memory)" if loopback else _gpu_name(self.rt.path, device)
        host = socket.gethostname().split(".")[0].encode()[:48]  # as nccl-tests' getHostName
        fmt = "<qqq48s32s96s"
        record = struct.pack(
            fmt, os.getpid(), device, self.color, host, bus.value[:32], name[:96]
        )
        size, nworld = len(record), int(self.world.size)
        mine = create_string_buffer(record, size)
        everyone = create_string_buffer(size * nworld)
        tmp = self._alloc(DeviceBuffer, size * (nworld + 1))
        self._copy(tmp.ptr, addressof(mine), size, self._H2D)
        self.world.all_gather(
            tmp.ptr, tmp.ptr + size, count=size, dtype=DataType.UINT8, stream=self.s
        )
        self._copy(addressof(everyone), tmp.ptr + size, size * nworld, self._D2H)
        self.sync(at_least=_STARTUP_TIMEOUT)
        out = []
        for r in range(nworld):
            pid, dev, color, hostname, busid, gpu = struct.unpack_from(fmt, everyone, r * size)
            out.append(
                {
                    "rank": r,
                    "group": color,
                    "pid": pid,
                    "hostname": hostname.rstrip(b"\0").decode(errors="replace"),
                    "device": dev,
                    "bus_id": busid.rstrip(b"\0").decode(errors="replace"),
                    "name": gpu.rstrip(b"\0").decode(errors="replace"),
                }
            )
        return out

    # -- one operation ------------------------------------------------------------------

    def _op_handle(self, op: str, dtype: DataType) -> Any:
        if op == "mulsum":
            scale = _mulsum_scale(self.rank)
            return self.comm.create_premul_sum(
                float(scale) if dtype.is_float else scale, dtype, "host"
            )
        return _REDOP[op]

    def _base(self, buf: Any, itemsize: int) -> int:
        """A buffer's address shifted by -u elements (nccl-tests' unalign)."""
        return int(buf.ptr) + self.opts.unalign * itemsize

    def _pointers(self, c: Counts, itemsize: int, in_place: bool) -> tuple[int, int]:
        if not in_place:
            return self._base(self.send, itemsize), self._base(self.recv, itemsize)
        base = self._base(self.recv, itemsize)
        return (
            base + c.send_offset * self.rank * itemsize,
            base + c.recv_offset * self.rank * itemsize,
        )

    def _runner(
        self, c: Counts, dtype: DataType, op: Any, root: int, in_place: bool
    ) -> Callable[[], None]:
        """A no-argument function issuing the operation once (all arguments bound)."""
        pointers = self._pointers(c, dtype.itemsize, in_place)
        return runner(self.coll, self.comm, self.rt, pointers, c, dtype, op, root, self.s,
                      self.traffic)  # fmt: skip

    # -- CUDA graphs ----------------------------------------------------------------------

    def _capture(self, run: Callable[[], None], times: int) -> Graph:
        """Capture ``times`` calls of ``run`` on the stream into a graph (thread-local
        capture mode, as nccl-tests)."""
        from ..cuda import CaptureMode, Graph

        graph = Graph()
        with graph.capture(self.stream, CaptureMode.THREAD_LOCAL):
            for _ in range(times):
                run()
        return graph

    # -- timing and checking ---------------------------------------------------------------

    def _issue(self, run: Callable[[], None]) -> None:
        """One iteration: -m operations (in one group when more than one), then what -z 1
        and -z 2 ask for after it."""
        agg = self.opts.agg_iters
        if agg > 1:
            from ..groups import group

            with group():
                for _ in range(agg):
                    run()
        else:
            run()
        if self.opts.blocking in (1, 2):
            self.sync()
            if self.opts.blocking == 1:
                self.barrier()

    def _time(self, run: Callable[[], None]) -> tuple[float, float]:
        """(seconds per operation, host seconds per operation to issue it), this rank's
        view (nccl-tests' BenchTime)."""
        opts = self.opts
        iters = opts.iters
        assert iters is not None
        ops = iters * opts.agg_iters
        run()  # one untimed call, then line the ranks up
        self.sync()
        self.barrier()
        launches = opts.cudagraph
        if launches:
            with self._capture(lambda: self._issue(run), iters) as graph:
                self.barrier()
                start = time.perf_counter()
                for _ in range(launches):
                    graph.replay()
                issued = time.perf_counter() - start
                self.sync()
                elapsed = time.perf_counter() - start
            return elapsed / (ops * launches), issued / (ops * launches)
        busy = 0.0  # -z 3: the time of the operations alone, barriers left out
        start = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            self._issue(run)
            if opts.blocking == 3:
                self.sync()
                busy += time.perf_counter() - t0
                self.barrier()
        issued = time.perf_counter() - start
        self.sync()
        elapsed = busy if opts.blocking == 3 else time.perf_counter() - start
        return elapsed / ops, (busy if opts.blocking == 3 else issued) / ops

    def _across_ranks(self, seconds: float) -> float:
        mode = self.opts.average
        if mode == 0:
            return self._scalar(seconds, DataType.FLOAT64, None)
        op = {1: RedOp.SUM, 2: RedOp.MIN, 3: RedOp.MAX}[mode]
        value = self._scalar(seconds, DataType.FLOAT64, op)
        return value / int(self.world.size) if mode == 1 else value

    def _host(self, which: int, count: int, np_dtype: Any) -> Any:
        """Host staging buffer ``which`` (0: inputs, 1: results, 2: references) as ``count``
        elements: allocated once, so checks do not pay for fresh pages every time."""
        if not self.staging:
            self.staging = [self.np.empty(_CHUNK * 8, dtype=self.np.uint8) for _ in range(3)]
        return self.staging[which][: count * self.np.dtype(np_dtype).itemsize].view(np_dtype)

    def _check_once(
        self,
        run: Callable[[], None],
        c: Counts,
        dtype: DataType,
        op: str | None,
        root: int,
        in_place: bool,
    ) -> int:
        """Fill fresh inputs, run the operation once, count this rank's wrong elements.

        Inputs are written and results compared a chunk at a time, so the host
        memory needed stays small whatever the size.
        """
        np = self.np
        self.rep += 1
        data = _Data(np, dtype, op, self.nranks, self.rep)
        size = dtype.itemsize
        sp, rp = self._pointers(c, size, in_place)
        # Zero the receive side (in place: the whole region), then write the inputs.
        region = c.recv * size
        if in_place:
            region = max(
                region + c.recv_offset * self.rank * size,
                c.send * size + c.send_offset * self.rank * size,
            )
        if region:
            self.rt.cudaMemsetAsync(self._base(self.recv, size), 0, region, self.s)
        for lo in range(0, c.send, _CHUNK):
            hi = min(c.send, lo + _CHUNK)
            chunk = data.values(self.rank, lo, hi, self._host(0, hi - lo, data.np_dtype))
            self._copy(sp + lo * size, chunk.ctypes.data, chunk.nbytes, self._H2D)
            self.sync()  # before the host buffer is written again
        expect = _expected(self.coll, data, self.rank, root, c, self.traffic)
        if self.opts.cudagraph:
            with self._capture(run, 1) as graph:
                graph.replay()
                self.sync()
        else:
            run()
        # The first chunk's reference is computed while the operation runs.
        first = None
        if expect is not None and c.recv:
            hi = min(c.recv, _CHUNK)
            first = expect(0, hi, self._host(2, hi, data.np_dtype))
        self.sync()
        if expect is None:
            return 0
        wrong = 0
        for lo in range(0, c.recv, _CHUNK):
            hi = min(c.recv, lo + _CHUNK)
            if lo == 0 and first is not None:
                want, tol = first
            else:
                want, tol = expect(lo, hi, self._host(2, hi - lo, data.np_dtype))
            got = self._host(1, hi - lo, data.np_dtype)
            self._copy(got.ctypes.data, rp + lo * size, got.nbytes, self._D2H)
            self.sync()
            wrong += data.compare(got, want, tol)
        return wrong

    def _bench(
        self, c: Counts, dtype: DataType, op_name: str | None, op: Any, root: int, in_place: bool
    ) -> dict[str, Any]:
        run = self._runner(c, dtype, op, root, in_place)
        seconds, issued = self._time(run)
        seconds = self._across_ranks(seconds)
        algbw, busbw = self.coll.bandwidths(c.param, dtype.itemsize, seconds, self.nranks, c)
        wrong: int | None = None
        # nccl-tests runs all-to-all and send/recv in place too, but checks only out of place
        if self.opts.check and (self.coll.in_place or not in_place):
            self.barrier()
            total = 0
            for _ in range(self.opts.check):
                mine = self._check_once(run, c, dtype, op_name, root, in_place)
                total = int(self._scalar(mine, DataType.INT64, RedOp.SUM))
                if total:
                    break
            wrong = total
        cell = {"time": seconds * 1e6, "alg_bw": algbw, "bus_bw": busbw, "nwrong": wrong}
        if self.opts.report_cputime:  # -C: the host time to issue them, as nccl-tests
            cell["cpu_time"] = self._across_ranks(issued) * 1e6
        return cell

    # -- the sweep ------------------------------------------------------------------------

    def run_case(self, dtype_name: str, op_name: str | None, root: int, out: _Result) -> None:
        """nccl-tests' TimeTest: warm up, then one row per size (-N times)."""
        dtype = _TYPES[dtype_name]
        opts = self.opts
        assert opts.minbytes is not None and opts.maxbytes is not None
        op = self._op_handle(op_name, dtype) if op_name is not None else RedOp.SUM
        self.barrier()
        for size in _doubling(opts.minbytes, opts.maxbytes):
            c = self.coll.counts(size, dtype.itemsize, self.nranks, self.traffic)
            run = self._runner(c, dtype, op, root, False)
            for _ in range(opts.warmup_iters or 0):
                run()
            self.sync()
        cycle = 0
        while True:
            for size in opts.sizes:
                self._row(size, dtype, dtype_name, op_name, op, root, out)
            cycle += 1
            if opts.run_cycles and cycle >= opts.run_cycles:  # -N 0: forever
                break
        if op_name == "mulsum":  # (after an error the communicator is aborted anyway)
            self.comm.destroy_op(op)

    def _row(
        self,
        size: int,
        dtype: DataType,
        dtype_name: str,
        op_name: str | None,
        op: Any,
        root: int,
        out: _Result,
    ) -> None:
        c = self.coll.counts(size, dtype.itemsize, self.nranks, self.traffic)
        row: dict[str, Any] = {
            "size": max(c.send, c.recv) * dtype.itemsize,
            "count": c.param,
            "type": dtype_name,
            "redop": op_name if op_name is not None else self.coll.no_op,
            "root": root if self.coll.rooted else -1,
        }
        row["out_of_place"] = self._bench(c, dtype, op_name, op, root, False)
        row["in_place"] = self._bench(c, dtype, op_name, op, root, True)
        if self.opts.report_timestamps:
            row["timestamp"] = time.strftime("%Y-%m-%d %H:%M:%S")
        for key in ("out_of_place", "in_place"):
            cell = row[key]
            out.busbw_sum += cell["bus_bw"]
            out.busbw_count += 1
            out.wrong += cell["nwrong"] or 0
            out.errors += 1 if cell["nwrong"] else 0
        out.rows.append(row)
        self.console.line(_row_text(row))
        if self.traffic is not None and self.traffic.summary:
            for key in ("out_of_place", "in_place"):
                seconds = row[key]["time"] * 1e-6
                for text in self.traffic.summary_lines(
                    self.nranks, c.param, dtype.itemsize, seconds
                ):
                    self.console.line(text)
