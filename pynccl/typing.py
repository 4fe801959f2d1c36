"""Types of what pynccl accepts, for annotations in user code and in pynccl itself.

Importing this module costs nothing at run time beyond :mod:`typing` (already loaded by any
program that annotates); it loads no library.

* :class:`SupportsCAI` — an object with ``__cuda_array_interface__`` (CuPy, Numba, PyTorch).
* :class:`SupportsDLPack` — an object with ``__dlpack__`` / ``__dlpack_device__``.
* :class:`SupportsCudaStream` — an object with ``__cuda_stream__`` (cuda.core and others);
  :class:`HasCudaStreamAttr` — ``.cuda_stream`` (torch); :class:`HasStreamPtr` — ``.ptr``
  (CuPy).
* ``BufferLike`` — what a collective takes as ``sendbuf`` / ``recvbuf``: either protocol, a
  :class:`pynccl.cuda.DeviceBuffer`, or a raw device pointer (``int``).
* ``StreamLike`` — what ``stream=`` takes: None (the default stream), an ``int`` handle,
  a :class:`pynccl.cuda.Stream`, or any object speaking a stream protocol; the
  collectives, send/recv and v-collectives also take ``"current"`` (the array library's
  current stream, see the README).
* ``DTypeLike``, ``OpLike`` and ``IndexLike`` — what ``dtype=``, ``op=`` and counts or
  indices (``count=``, ``root=``) take; ``DeviceLike`` — what ``device=`` takes (an index,
  or :class:`HasDeviceId`: a cuda.core ``Device``).
"""

from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    Protocol,
    SupportsIndex,
    SupportsInt,
    Union,
    runtime_checkable,
)

if TYPE_CHECKING:
    from .enums import DataType, RedOp

__all__ = [
    "BufferLike",
    "DTypeLike",
    "DeviceLike",
    "HasCudaStreamAttr",
    "HasDeviceId",
    "HasStreamPtr",
    "IndexLike",
    "OpLike",
    "StreamLike",
    "SupportsCAI",
    "SupportsCudaStream",
    "SupportsDLPack",
]


@runtime_checkable
class SupportsCAI(Protocol):
    """Exposes ``__cuda_array_interface__`` (version 2 or 3): a dict with ``data``,
    ``shape``, ``typestr`` and optionally ``strides`` and ``stream``."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...


@runtime_checkable
class SupportsDLPack(Protocol):
    """Exposes DLPack: ``__dlpack__(stream=...)`` returning a capsule, and
    ``__dlpack_device__()`` returning ``(device_type, device_id)``."""

    def __dlpack__(self, *, stream: Any = ...) -> Any: ...

    def __dlpack_device__(self) -> tuple[int, int]: ...


@runtime_checkable
class SupportsCudaStream(Protocol):
    """Exposes ``__cuda_stream__()`` returning ``(version, handle)`` (cuda.core, CuPy >= 13,
    :class:`pynccl.cuda.Stream`)."""

    def __cuda_stream__(self) -> tuple[int, int]: ...


@runtime_checkable
class HasCudaStreamAttr(Protocol):
    """Has ``.cuda_stream``, the ``cudaStream_t`` as an int (``torch.cuda.Stream``)."""

    @property
    def cuda_stream(self) -> int: ...


@runtime_checkable
class HasStreamPtr(Protocol):
    """Has ``.ptr``, the ``cudaStream_t`` as an int (``cupy.cuda.Stream``)."""

    @property
    def ptr(self) -> int: ...


@runtime_checkable
class HasDeviceId(Protocol):
    """Has ``.device_id``, a CUDA device ordinal (``cuda.core.Device``)."""

    @property
    def device_id(self) -> int: ...


#: A buffer for a collective: an array protocol object (a :class:`pynccl.cuda.DeviceBuffer`
#: is a ``SupportsCAI``) or a raw device pointer (``int``, with ``count=`` and ``dtype=``).
BufferLike = Union[SupportsCAI, SupportsDLPack, int]
#: A CUDA stream: None (the default stream), an int handle, or a stream object speaking one
#: of the protocols above; ``SupportsInt`` stands for cuda-python's ``cudaStream_t`` /
#: ``CUstream``, whose ``int()`` is the handle (floats and other numbers are refused at run
#: time).
StreamLike = Union[
    None, int, SupportsCudaStream, HasCudaStreamAttr, HasStreamPtr, SupportsInt, Literal["current"]
]
#: A data type: a DataType, a name ("float32", "complex64"), a numpy/CuPy/ml_dtypes dtype or
#: scalar type, or a torch dtype (which no Protocol describes, hence ``object``).
DTypeLike = Union["DataType", str, int, type, object]
#: A reduction op: a RedOp, a name ("sum", "avg"), or an int op from create_premul_sum().
OpLike = Union["RedOp", str, int]
#: A count or an index: an int or any integer with ``__index__`` (numpy integers).
IndexLike = SupportsIndex
#: A CUDA device: an ordinal (an int or any ``__index__`` integer) or an object with a
#: ``device_id`` (a cuda.core ``Device``); see :func:`pynccl._limits.check_device_ordinal`.
DeviceLike = Union[SupportsIndex, HasDeviceId]
