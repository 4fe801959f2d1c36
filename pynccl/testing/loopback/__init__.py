"""Loopback libnccl and libcudart: host-memory stand-ins for testing without a GPU.

The C sources in this package are compiled on demand with the system C compiler
(``$CC``, else ``cc``) and cached (see :func:`cache_dir`)::

    from pynccl.testing import loopback
    loopback.use()                        # this process: pynccl now uses the loopback
    nccl, cudart = loopback.build("2.18.1")
    child_env = {**os.environ, **loopback.env(sanitize=True)}   # for a subprocess

``python -m pynccl.testing.loopback`` prints the two library paths. The loopback
libcudart reads ``PYNCCL_LOOPBACK_DEVICES`` (default 8), ``PYNCCL_LOOPBACK_STRICT``
(0: copies may use host pointers on the device side), ``PYNCCL_LOOPBACK_DEBUG``
(1: print each error) and ``CUDA_VISIBLE_DEVICES`` (as CUDA) once, when it is loaded;
a malformed ``PYNCCL_LOOPBACK_*`` value makes every call fail with
``cudaErrorInvalidValue`` naming it (the README lists every variable and its rules).

Sources: ``cudart/*.c`` (libcudart), ``nccl/*.c``
(libnccl), ``include/`` (headers both share). Only the standard library is used.
"""

from ._build import (
    CUDART_SONAME,
    DEFAULT_VERSION,
    NCCL_SONAME,
    SOURCE_DIR,
    LoopbackBuild,
    LoopbackBuildError,
    build,
    build_cudart,
    cache_dir,
    env,
    parse_version,
    use,
)

__all__ = [
    "CUDART_SONAME",
    "DEFAULT_VERSION",
    "NCCL_SONAME",
    "SOURCE_DIR",
    "LoopbackBuild",
    "LoopbackBuildError",
    "build",
    "build_cudart",
    "cache_dir",
    "env",
    "parse_version",
    "use",
]
