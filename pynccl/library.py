"""The process-wide libnccl and libcudart: loaded once, on first use, thread-safely.

``load_library()`` / ``lib()`` give the :class:`~pynccl.capi.NcclLibrary`
(functions by their C names, checked); ``load_cudart()`` / ``cudart()`` the
:class:`~pynccl.capi.CudartLibrary`. Nothing is loaded at import.
"""

from __future__ import annotations

import os
from _thread import allocate_lock

# The discovery rules and the prototype tables (ctypes, a few hundred C signatures) are
# imported on first load, not here: the object API imports this module, and
# `from pynccl import Communicator` must stay cheap. mypy treats TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from . import _loader
    from ._capi._binding import BoundLibrary
    from ._capi.cudart import CudartLibrary
    from ._capi.nccl import NcclLibrary
    from .enums import Release

__all__ = ["cudart", "lib", "load_cudart", "load_library", "version"]

_lock = allocate_lock()
_nccl: NcclLibrary | None = None
_cudart: CudartLibrary | None = None

# The loopback libnccl links its own libcudart stand-in; when that is mapped and the
# caller named no libcudart, it is the one whose streams and allocations libnccl sees.
_LOOPBACK_CUDART = "libpynccl_loopback_cudart"


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def load_library(path: str | os.PathLike[str] | None = None) -> NcclLibrary:
    """Load libnccl (once per process) and return it.

    Without ``path`` the library is discovered (``$PYNCCL_NCCL_LIBRARY``, a
    libnccl already in the process, the ``nvidia-nccl-cu13``/``-cu12`` wheels,
    the dynamic loader, ``$NCCL_HOME``, ``$CUDA_HOME``; see ``python -m pynccl
    info``). Loading again returns the same object; asking for a different file
    once one is loaded raises ``RuntimeError`` (one process, one libnccl).
    Raises :class:`~pynccl.LibraryNotFoundError`, listing every candidate tried and
    why it was refused, when no usable libnccl is found.
    """
    global _nccl
    current = _nccl
    if current is not None and path is None:
        return current
    with _lock:
        current = _nccl
        if current is None:
            from . import _env, _loader
            from ._capi.nccl import NcclLibrary

            _env.warn_unknown_once()  # a mistyped PYNCCL_* variable would do nothing
            _trace_algorithms()  # NCCL reads NCCL_DEBUG* once, so set them before it loads
            found = _loader.open_nccl(None if path is None else os.fspath(path))
            current = _nccl = NcclLibrary(found.cdll, found.path, found.rule)
            _warn_known_bad(current)
        else:
            _refuse_another("libnccl", current, path)
        return current


def _trace_algorithms() -> None:
    """PYNCCL_TRACE_ALGORITHMS=1: NCCL's TUNING lines into a file (``pynccl.tuning``)."""
    if not os.environ.get("PYNCCL_TRACE_ALGORITHMS"):
        return
    import atexit

    from . import tuning

    if tuning.prepare():
        atexit.register(tuning.remove_trace_file)


def _warn_known_bad(nccl: NcclLibrary) -> None:
    """Warn once when the loaded release is in pynccl's table of known-bad releases."""
    from . import _known_bad

    _known_bad.warn_once(nccl.version)


def lib() -> NcclLibrary:
    """The process's libnccl (loading it on first use): the low-level, C-named API.

    ``lib().ncclAllReduce(...)`` calls NCCL's function of that name; see
    :class:`~pynccl.capi.NcclLibrary`. Discovery and errors as :func:`load_library`.
    """
    current = _nccl
    return current if current is not None else load_library()


def version() -> Release:
    """``(major, minor, patch)`` of the loaded libnccl (loading it if needed)."""
    return lib().version


def load_cudart(path: str | os.PathLike[str] | None = None) -> CudartLibrary:
    """Load the CUDA runtime (once per process) and return it.

    Without ``path``: ``$PYNCCL_CUDART_LIBRARY``; else the loopback's libcudart when
    the loopback libnccl is mapped; else a libcudart already in the process (torch,
    CuPy: pynccl shares their runtime), the ``nvidia-cuda-runtime`` wheels, the dynamic
    loader, ``$CUDA_HOME`` and ``/usr/local/cuda``. Errors as :func:`load_library`.
    """
    global _cudart
    current = _cudart
    if current is not None and path is None:
        return current
    with _lock:
        current = _cudart
        if current is None:
            from . import _env
            from ._capi.cudart import CudartLibrary

            _env.warn_unknown_once()  # a mistyped PYNCCL_* variable would do nothing
            found = _open_cudart(path)
            current = _cudart = CudartLibrary(found.cdll, found.path, found.rule)
        else:
            _refuse_another("libcudart", current, path)
        return current


def _open_cudart(path: str | os.PathLike[str] | None) -> _loader.Found:
    from . import _loader

    if path is None and os.environ.get(_loader.CUDART_ENV) is None:
        mapped = _loader.mapped_libraries(_LOOPBACK_CUDART)
        if mapped:
            found = _loader.open_cudart(mapped[0])
            return _loader.Found(found.path, "already-mapped", found.cdll)
    return _loader.open_cudart(None if path is None else os.fspath(path))


def _refuse_another(kind: str, current: BoundLibrary, path: str | os.PathLike[str] | None) -> None:
    if path is not None and not _same_file(os.fspath(path), current.path):
        raise RuntimeError(
            f"{kind} is already loaded from {current.path} (rule {current.rule}); "
            f"cannot also load {os.fspath(path)}: a process uses one {kind}"
        )


def cudart() -> CudartLibrary:
    """The process's CUDA runtime (loading it on first use); see :func:`load_cudart`."""
    current = _cudart
    return current if current is not None else load_cudart()


def loaded() -> tuple[NcclLibrary | None, CudartLibrary | None]:
    """The libraries loaded so far, without loading anything."""
    return _nccl, _cudart


def _replace_for_testing(nccl_path: str | None, cudart_path: str | None) -> None:
    """Testing hook: make these files the process's libraries, replacing earlier ones.

    Communicators made with the previous library must not be used afterwards.
    Used by :func:`pynccl.testing.loopback.use` to switch between loopback builds.
    """
    global _nccl, _cudart
    import warnings

    from . import _loader
    from ._capi.cudart import CudartLibrary
    from ._capi.nccl import NcclLibrary

    with _lock, warnings.catch_warnings():
        # A deliberate swap maps a second libnccl file: not the accident the warning is for.
        warnings.simplefilter("ignore", RuntimeWarning)
        if cudart_path is not None:
            found = _loader.open_cudart(cudart_path)
            _cudart = CudartLibrary(found.cdll, found.path, found.rule)
        if nccl_path is not None:
            found = _loader.open_nccl(nccl_path)
            _nccl = NcclLibrary(found.cdll, found.path, found.rule)
