"""What the benchmarks share: array stand-ins for the buffer protocols as their producers
make them (over loopback device memory), a user-space instruction counter, and the cost of
``with pynccl.group(): pass`` over a bare ``ncclGroupStart/End`` pair.

Each producer here is the cheapest of its kind, so that a benchmark's ratio to a floor that
calls the producer too is the consumer's own cost. pynccl is imported only by the group()
functions, when called.
"""

from __future__ import annotations

import ctypes
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The script whose ``--group-loop`` runs one loop of group_loops (callgrind's child).
SCRIPT = Path(__file__).with_name("bench_overhead.py")


class CaiArray:
    """A minimal device-array object whose interface is one dict kept for its life."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<f4",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


class FreshCaiArray:
    """An array whose interface is a new dict of new tuples at every read, as CuPy, Numba
    and PyTorch build theirs."""

    def __init__(self, ptr: int, n: int) -> None:
        self.ptr, self.n = ptr, n

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.n,), "typestr": "<f4", "data": (self.ptr, False),
                "strides": None, "version": 3}  # fmt: skip


# --- a CUDA-device DLPack producer ---------------------------------------------------------
# dlpack.h (v1.1): DLManagedTensorVersioned = {DLPackVersion {u32 major, minor}; void*
# manager_ctx; void (*deleter)(self); u64 flags; DLTensor {void* data; DLDevice {i32 type,
# i32 id}; i32 ndim; DLDataType {u8 code, u8 bits, u16 lanes}; i64* shape; i64* strides;
# u64 byte_offset}}. One tensor is built per producer; each export wraps it in a new
# capsule without destructor (the producer owns it), as cheap a producer as there can be.
_VERSIONED = struct.Struct("IIPPQPiiiBBHPPQ")
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))  # fmt: skip
kDLCUDA, kDLFloat = 2, 2


class DLPackArray:
    """``n`` float32 elements at device address ``ptr`` of device 0, exported by DLPack."""

    def __init__(self, ptr: int, n: int) -> None:
        self._shape = (ctypes.c_int64 * 1)(n)
        shape_ptr = ctypes.addressof(self._shape)
        fields = (1, 1, 0, 0, 0, ptr, kDLCUDA, 0, 1, kDLFloat, 32, 1, shape_ptr, 0, 0)
        self._tensor = ctypes.create_string_buffer(_VERSIONED.pack(*fields))
        self._address = ctypes.addressof(self._tensor)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (kDLCUDA, 0)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None,
                   dl_device: Any = None, copy: Any = None) -> Any:  # fmt: skip
        if max_version is None or max_version[0] < 1:
            raise BufferError("this producer exports DLPack >= 1.0 tensors only")
        return _capsule_new(self._address, b"dltensor_versioned", None)


# --- user-space instruction counter --------------------------------------------------------
class InstructionCounter:
    """Counts this thread's user-space instructions with ``perf_event_open(2)``;
    ``reason`` says why not when the kernel gives no hardware counter."""

    _SYSCALL = {"x86_64": 298, "aarch64": 241}
    _ENABLE, _DISABLE, _RESET = 0x2400, 0x2401, 0x2403

    def __init__(self) -> None:
        self.fd = -1
        self.reason = ""
        number = self._SYSCALL.get(os.uname().machine)
        if number is None:
            self.reason = f"no perf_event_open syscall number for {os.uname().machine}"
            return
        libc = ctypes.CDLL(None, use_errno=True)
        self._ioctl = libc.ioctl
        # perf_event_attr: type PERF_TYPE_HARDWARE, size, config PERF_COUNT_HW_INSTRUCTIONS;
        # flags (offset 40): disabled | exclude_kernel | exclude_hv.
        attr = bytearray(128)
        struct.pack_into("IIQ", attr, 0, 0, len(attr), 1)
        struct.pack_into("Q", attr, 40, (1 << 0) | (1 << 5) | (1 << 6))
        buf = (ctypes.c_char * len(attr)).from_buffer(attr)
        fd = libc.syscall(number, buf, 0, -1, -1, 0)
        if fd < 0:
            err = ctypes.get_errno()
            self.reason = f"perf_event_open: {os.strerror(err)} (errno {err})"
        self.fd = fd

    def count(self, fn: Callable[[], Any]) -> int:
        self._ioctl(self.fd, self._RESET, 0)
        self._ioctl(self.fd, self._ENABLE, 0)
        fn()
        self._ioctl(self.fd, self._DISABLE, 0)
        value: int = struct.unpack("q", os.read(self.fd, 8))[0]
        return value

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def group_loops(cdll: ctypes.CDLL, reps: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """``reps`` bare ncclGroupStart/End pairs, and ``reps`` ``with group(): pass``."""
    from pynccl import group

    gs, ge = cdll.ncclGroupStart, cdll.ncclGroupEnd
    for fn in (gs, ge):  # as a bare binding would set them
        fn.argtypes, fn.restype = [], ctypes.c_int
    loop = range(reps)

    def bare() -> None:
        for _ in loop:
            gs()
            ge()

    def with_group() -> None:
        for _ in loop:
            with group():
                pass

    bare()  # warm up
    with_group()
    return bare, with_group


def group_instructions(cdll: ctypes.CDLL, counter: InstructionCounter, reps: int) -> float:
    """Instructions of ``with group(): pass`` over the bare pair, per use (perf_event_open):
    the fewest over a few runs, as an interrupt's or a page fault's user-space work only
    ever adds some."""
    bare, with_group = group_loops(cdll, reps)
    b = min(counter.count(bare) for _ in range(5))
    g = min(counter.count(with_group) for _ in range(5))
    return (g - b) / reps


def group_ns(cdll: ctypes.CDLL, reps: int) -> float:
    bare, with_group = group_loops(cdll, reps)
    perf = time.perf_counter_ns
    diffs = []
    for _ in range(15):
        t0 = perf()
        bare()
        t1 = perf()
        with_group()
        diffs.append(((perf() - t1) - (t1 - t0)) / reps)
    return statistics.median(diffs)


def callgrind_per_call(argv: list[str], k: int) -> float:
    """Instructions per loop step of ``python *argv K``, a run that loops K times: the runs
    of ``k`` and ``3 * k`` steps under valgrind's callgrind, differenced (the interpreter's
    start and the set-up cancel out). The main thread's count alone (the loopback's threads
    poll at their own pace), with a fixed hash seed: the same build counts the same."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"}
    counts = []
    with tempfile.TemporaryDirectory(prefix="pynccl-bench-cg-") as tmp:
        for steps in (k, 3 * k):
            cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes",
                   f"--callgrind-out-file={tmp}/cg.out", sys.executable, *argv,
                   str(steps)]  # fmt: skip
            subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            text = Path(f"{tmp}/cg.out-01").read_text()
            found = re.search(r"^(?:summary|totals):\s*(\d+)", text, re.M)
            if found is None:
                raise RuntimeError(f"no callgrind total in: {text[-500:]}")
            counts.append(int(found.group(1)))
    return (counts[1] - counts[0]) / (2 * k)


def group_callgrind(reps: int) -> float:
    """Instructions of ``with group(): pass`` over the bare pair, per use, counted by
    :func:`callgrind_per_call` (loops of ``reps`` and ``3 * reps`` of this script's
    ``--group-loop MODE``)."""
    per = {m: callgrind_per_call([str(SCRIPT), "--group-loop", m], reps) for m in ("bare", "group")}
    return per["group"] - per["bare"]


def run_group_loop(mode: str, k: int) -> int:
    """The child of :func:`group_callgrind`: one loop of ``k``, ``mode`` "bare" or "group"."""
    from pynccl.testing import loopback

    bare, with_group = group_loops(ctypes.CDLL(loopback.use(null=True).nccl), k)
    (with_group if mode == "group" else bare)()
    return 0
