"""Buffer and stream adaptation: whatever a caller passes becomes plain ints (layer 5).

:func:`as_buffer` turns a buffer argument into ``(ptr, nelems, DataType, device)``:

* a raw ``int`` device pointer, with ``count`` and ``dtype`` given (:mod:`._pointer`);
* :class:`pynccl.cuda.DeviceBuffer` (:mod:`._devbuf`);
* anything exposing ``__cuda_array_interface__`` (v2/v3: CuPy, Numba, PyTorch, ...;
  :mod:`._cai`);
* anything exposing DLPack (``__dlpack__`` / ``__dlpack_device__``), read with
  ctypes straight from the capsule, legacy ``DLManagedTensor`` or DLPack >= 1.0
  ``DLManagedTensorVersioned`` (:mod:`._dlpack`).

Complex arrays (complex64 / complex128, and DLPack's complex32) are handed out as twice
as many floats of their halves' type; :func:`is_complex` tells them apart for callers
that must refuse them (prod, max, min).

:func:`as_stream` (from :mod:`pynccl.cuda`, layer 4) turns a stream argument into a
``cudaStream_t`` int.

Both dispatch on ``type(obj)`` through a cache of handler functions (:mod:`._dispatch`):
the first object of a type is probed (``hasattr``), later ones of that type go straight
to their handler; raw ints skip even that. Nothing here calls into CUDA, so the
device an array lives on is what the array itself says (``None`` when it says
nothing), and the ``stream`` entry of a v3 ``__cuda_array_interface__`` (the
producer's stream, which a consumer should wait on) is not acted upon: callers
that mix streams must order them themselves.
"""

from __future__ import annotations

from ..cuda._streamlike import _STREAM_HANDLERS as _STREAM_HANDLERS
from ..cuda._streamlike import as_stream
from ._common import _PTR_LIMIT as _PTR_LIMIT
from ._common import check_pointer as check_pointer
from ._complex import _COMPLEX_PROBES as _COMPLEX_PROBES
from ._complex import is_complex
from ._devbuf import _from_device_buffer as _from_device_buffer
from ._devbuf import _from_device_buffer_public as _from_device_buffer_public
from ._dispatch import _BUFFER_HANDLERS as _BUFFER_HANDLERS
from ._dispatch import as_buffer, check_device
from ._dispatch import buffer_handler as buffer_handler

__all__ = ["as_buffer", "as_stream", "check_device", "is_complex"]
