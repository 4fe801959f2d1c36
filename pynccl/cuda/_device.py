"""Devices: count, current device, versions, synchronisation, pointer attributes."""

from __future__ import annotations

from ctypes import byref, c_int
from enum import IntEnum

from .._limits import check_pointer
from ..errors import CudaError, LibraryNotFoundError
from . import _runtime
from ._runtime import _NO_GPU, _check_index

TYPE_CHECKING = False  # not imported from typing: mypy reads it as true
if TYPE_CHECKING:
    from ..typing import DeviceLike, IndexLike


def device_count() -> int:
    """Number of visible CUDA devices; 0 where there is no usable GPU.

    0 covers "no NVIDIA driver" (``cudaErrorInsufficientDriver``), "no device"
    (``cudaErrorNoDevice``) and "no libcudart found at all": code that only asks
    whether GPUs exist needs no ``try``. ``python -m pynccl info`` says which.
    Other errors propagate as :class:`CudaError`.
    """
    try:
        rt = _runtime._rt()
    except LibraryNotFoundError:
        return 0
    n = c_int(0)
    try:
        rt.cudaGetDeviceCount(byref(n))
    except CudaError as e:
        if e.code in _NO_GPU:
            return 0
        raise
    return n.value


def get_device() -> int:
    """The calling thread's current device (``cudaGetDevice``)."""
    d = c_int(-1)
    _runtime._rt().cudaGetDevice(byref(d))
    return d.value


def set_device(device: DeviceLike) -> None:
    """Make ``device`` current for the calling thread (``cudaSetDevice``).

    Raises ``TypeError``/``ValueError`` for a non-int or negative index, and
    :class:`CudaError` (``cudaErrorInvalidDevice``) for one that does not exist.
    """
    index = _check_index("device", device)
    _runtime._rt().cudaSetDevice(index)


def synchronize() -> None:
    """Wait for all work on the current device (``cudaDeviceSynchronize``)."""
    _runtime._rt().cudaDeviceSynchronize()


def _decode_cuda_version(code: int) -> tuple[int, int]:
    return code // 1000, (code % 1000) // 10


def runtime_version() -> tuple[int, int]:
    """``(major, minor)`` of the loaded CUDA runtime, e.g. ``(13, 0)``; needs no driver."""
    v = c_int(0)
    _runtime._rt().cudaRuntimeGetVersion(byref(v))
    return _decode_cuda_version(v.value)


def driver_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the CUDA version the driver supports; ``None`` without a driver."""
    v = c_int(0)
    try:
        _runtime._rt().cudaDriverGetVersion(byref(v))
    except CudaError as e:
        if e.code in _NO_GPU:
            return None
        raise
    return _decode_cuda_version(v.value) if v.value > 0 else None


class _DeviceScope:
    """Make ``device`` current inside a ``with`` block, restoring the previous one."""

    __slots__ = ("_device", "_previous")

    def __init__(self, device: DeviceLike | None) -> None:
        self._device = None if device is None else _check_index("device", device)
        self._previous = -1

    def __enter__(self) -> int:
        # Returns the device in use, or -1 when none was asked for (no call made).
        if self._device is None:
            return -1
        current = get_device()
        if self._device != current:
            self._previous = current
            set_device(self._device)
        return self._device

    def __exit__(self, *exc: object) -> None:
        if self._previous >= 0:
            set_device(self._previous)


class MemoryType(IntEnum):
    """``cudaMemoryType``: where a pointer lives."""

    UNREGISTERED = 0
    HOST = 1
    DEVICE = 2
    MANAGED = 3


def pointer_attributes(ptr: IndexLike) -> tuple[MemoryType, int]:
    """``(memory type, device)`` of ``ptr`` (``cudaPointerGetAttributes``).

    Plain host memory gives ``(MemoryType.UNREGISTERED, -2)`` (device is
    whatever CUDA reports; -2 is its "no device" value for such memory).
    """
    from .._capi.structs import cudaPointerAttributes

    ptr = check_pointer(ptr, "ptr", 0)  # an int in [0, 2**64): ctypes would wrap others
    attrs = cudaPointerAttributes()
    _runtime._rt().cudaPointerGetAttributes(byref(attrs), ptr)
    try:
        kind = MemoryType(attrs.type)
    except ValueError:
        raise CudaError(
            0, "cudaPointerGetAttributes", "", f"unknown cudaMemoryType {attrs.type}"
        ) from None
    return kind, int(attrs.device)
