"""Compile the loopback libcudart and libnccl with the system C compiler, cached.

Only the standard library is used here: this runs in CI images and in child
processes that have nothing else.

Cache layout, under :func:`cache_dir`::

    cudart-<hash>/libpynccl_loopback_cudart.so   one per (cudart sources, sanitize, compiler)
    nccl-<hash>/libnccl.so.2                     one per (nccl sources, version, null,
                                                 sanitize, compiler, cudart build)

Each directory appears by an atomic rename of a finished temporary directory, under an
``fcntl`` lock, so concurrent builders (threads or processes) agree on one file and
never see a half-written library.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Union

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

#: Where the C sources live (this package's directory).
SOURCE_DIR = Path(__file__).resolve().parent
CUDART_SONAME = "libpynccl_loopback_cudart.so"
NCCL_SONAME = "libnccl.so.2"
#: The NCCL release the loopback libnccl reports unless told otherwise.
DEFAULT_VERSION = (2, 32, 3)
_OLDEST = (2, 18, 0)
_NEWEST_MINOR = (2, 32)

_BASE_FLAGS = (
    "-O2",
    "-g",
    "-shared",
    "-fPIC",
    "-pthread",
    "-std=gnu11",
    "-Wall",
    "-Wextra",
    "-Werror=implicit-function-declaration",
)
_SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer")
# CPython itself "leaks" at exit, and loopback allocations made through ctypes carry
# interpreter frames, so suppressing CPython would hide them too: leaks are checked by
# tests/loopback/test_loopback_leaks.py, whose C driver runs with detect_leaks=1. cudaMalloc(huge)
# must fail with an error, not abort.
_ASAN_OPTIONS = "detect_leaks=0:allocator_may_return_null=1"
_UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"

VersionLike = Union[str, Sequence[int], None]


class LoopbackBuildError(RuntimeError):
    """The loopback libraries could not be built (no compiler, or a compile error)."""


class LoopbackBuild(NamedTuple):
    """Absolute paths of a loopback build; unpacks as ``nccl, cudart = build()``."""

    nccl: str
    cudart: str


class _Compiler(NamedTuple):
    argv: tuple[str, ...]  # the resolved executable, then any arguments from $CC
    version: str


_lock = threading.Lock()  # one builder per process at a time; flock orders processes
_compilers: dict[tuple[str, str, float], _Compiler] = {}


def _compiler() -> _Compiler:
    spec = os.environ.get("CC") or "cc"
    argv = shlex.split(spec)
    exe = shutil.which(argv[0]) if argv else None
    if exe is None:
        raise LoopbackBuildError(
            f"no C compiler: CC={spec!r} was not found. The pynccl loopback libraries are "
            "built on demand with the system compiler: install one (e.g. `apt-get install "
            "gcc`) or set CC to a working compiler"
        )
    exe = os.path.realpath(exe)
    key = (spec, exe, os.stat(exe).st_mtime)
    cached = _compilers.get(key)
    if cached is not None:
        return cached
    full = (exe, *argv[1:])
    try:
        proc = subprocess.run(
            [*full, "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LoopbackBuildError(f"C compiler {spec!r} ({exe}) does not run: {exc}") from exc
    if proc.returncode != 0:
        raise LoopbackBuildError(
            f"C compiler {spec!r} ({exe}) failed `--version` (exit {proc.returncode}): "
            f"{(proc.stdout + proc.stderr).strip()}"
        )
    found = _Compiler(full, proc.stdout.strip())
    _compilers[key] = found
    return found


def cache_dir() -> Path:
    """The loopback build cache: ``$PYNCCL_CACHE_DIR``, ``$XDG_CACHE_HOME/pynccl``
    or ``~/.cache/pynccl``, then ``loopback/``."""
    explicit = os.environ.get("PYNCCL_CACHE_DIR")
    if explicit:
        base = Path(explicit)
    elif os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"]) / "pynccl"
    else:
        try:
            base = Path.home() / ".cache" / "pynccl"
        except RuntimeError as exc:  # no HOME and no passwd entry
            raise LoopbackBuildError(
                f"cannot place the loopback build cache: {exc}. Set PYNCCL_CACHE_DIR to a "
                "writable directory (e.g. PYNCCL_CACHE_DIR=/tmp/pynccl-cache)"
            ) from exc
    return base.expanduser().resolve() / "loopback"


def _unwritable(root: Path, exc: OSError) -> LoopbackBuildError:
    """The error for a cache that cannot be written: which variable placed it, which moves it."""
    if os.environ.get("PYNCCL_CACHE_DIR"):
        source = "$PYNCCL_CACHE_DIR"
    elif os.environ.get("XDG_CACHE_HOME"):
        source = "$XDG_CACHE_HOME"
    else:
        source = "the home directory"
    return LoopbackBuildError(
        f"cannot write the loopback build cache {root} (under {source}): "
        f"{exc.strerror or exc}. Set PYNCCL_CACHE_DIR to a writable directory, where the "
        "loopback libraries are compiled and kept (e.g. PYNCCL_CACHE_DIR=/tmp/pynccl-cache)"
    )


def parse_version(version: VersionLike) -> tuple[int, int, int]:
    """``(major, minor, patch)`` from ``"2.18.1"``, ``(2, 18, 1)`` or ``None`` (the default).

    Raises ``ValueError`` for a malformed version or one outside 2.18.0 .. 2.32.x,
    the releases the loopback emulates.
    """
    if version is None:
        return DEFAULT_VERSION
    if isinstance(version, str):
        parts = version.strip().split(".")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"NCCL version {version!r} is not of the form 'X.Y.Z'")
        triple = (int(parts[0]), int(parts[1]), int(parts[2]))
    elif isinstance(version, Sequence):
        ints = [i for i in version if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
        if len(ints) != 3 or len(version) != 3:
            raise ValueError(f"NCCL version {version!r} is not three non-negative integers")
        triple = (ints[0], ints[1], ints[2])
    else:
        raise TypeError(
            f"NCCL version must be 'X.Y.Z', a (major, minor, patch) tuple or None, "
            f"not {type(version).__name__}: {version!r}"
        )
    if triple < _OLDEST or triple[:2] > _NEWEST_MINOR or triple[2] > 99:
        raise ValueError(
            f"NCCL version {version!r} is outside what the loopback emulates (2.18.0 to 2.32.x)"
        )
    return triple


def _version_code(version: tuple[int, int, int]) -> int:
    major, minor, patch = version
    return major * 10000 + minor * 100 + patch  # NCCL_VERSION() for releases >= 2.9


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        handle = open(path, "a+b")
    except OSError as exc:  # the cache exists but is read-only
        raise _unwritable(path.parent, exc) from exc
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _digest(parts: dict[str, object], files: Sequence[Path], src: Path) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(parts, sort_keys=True).encode())
    for f in files:
        # The path inside the source tree ("cudart/core.c"), not where the tree lives.
        name = f.relative_to(src).as_posix() if f.is_relative_to(src) else f.name
        h.update(name.encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:24]


def _compile(
    tag: str,
    what: str,
    out_name: str,
    sources: Sequence[Path],
    headers: Sequence[Path],
    flags: Sequence[str],
    link: Sequence[str],
    key: dict[str, object],
    src: Path,
) -> str:
    """Compile ``sources`` into ``<cache>/<tag>-<hash>/<out_name>`` unless it is cached.

    The key covers the sources' names and contents, not where they live: identical
    sources in two places share one build.
    """
    cc = _compiler()
    where = str(src)
    portable = [f.replace(where, "<src>") for f in flags]
    digest = _digest(
        {**key, "flags": portable, "link": list(link), "cc": list(cc.argv), "ccv": cc.version},
        [*sources, *headers],
        src,
    )
    root = cache_dir()
    final = root / f"{tag}-{digest}"
    target = final / out_name
    if target.is_file():
        return str(target)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only HOME, a file in the way
        raise _unwritable(root, exc) from exc
    with _lock, _file_lock(root / f".{tag}-{digest}.lock"):
        if target.is_file():  # another builder finished while we waited
            return str(target)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{tag}-{digest}.", dir=root))
        except OSError as exc:
            raise _unwritable(root, exc) from exc
        try:
            cmd = [*cc.argv, *flags, "-o", str(tmp / out_name), *map(str, sources), *link]
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
            output = (proc.stdout + proc.stderr).strip()
            if proc.returncode != 0:
                raise LoopbackBuildError(
                    f"compiling the {what} failed (exit {proc.returncode}):\n"
                    f"$ {shlex.join(cmd)}\n{output}"
                )
            info = {"command": cmd, "compiler": cc.version, "output": output, **key}
            (tmp / "build.json").write_text(json.dumps(info, indent=1, default=str))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
            if final.exists():  # left incomplete by hand (the .so removed): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def build_cudart(sanitize: bool = False, *, source_dir: Path | None = None) -> str:
    """Build (or find cached) ``libpynccl_loopback_cudart.so``; returns its absolute path.

    One file per (sources, ``sanitize``, compiler): every loopback libnccl links this
    exact file, so all of them, and pynccl, share one cudart instance in a process.
    """
    src = SOURCE_DIR if source_dir is None else Path(source_dir).resolve()
    sources = _cudart_sources(src)
    # Only what cudart/*.c include: an edit to the nccl headers must not rebuild it.
    headers = sorted({*(src / "cudart").glob("*.h"), *(src / "include").glob("*.h")})
    flags = [*_BASE_FLAGS, *_include_flags(src), f"-Wl,-soname,{CUDART_SONAME}"]
    if sanitize:
        flags += _SANITIZE_FLAGS
    return _compile(
        "cudart",
        "loopback libcudart",
        CUDART_SONAME,
        sources,
        headers,
        flags,
        [],
        {"sanitize": sanitize},
        src,
    )


def _include_flags(src: Path) -> list[str]:
    # include/ holds what both libraries share (the CUDA slice, the cudart<->nccl bridge,
    # the environment parsers, libnccl's C API); each library's private header is the
    # internal.h next to its sources.
    return [f"-I{src / 'include'}"]


def _cudart_sources(src: Path) -> list[Path]:
    sources = sorted((src / "cudart").glob("*.c"))
    if not sources:
        raise LoopbackBuildError(f"no cudart/*.c sources in {src}")
    return sources


def _nccl_sources(src: Path) -> list[Path]:
    sources = sorted((src / "nccl").glob("*.c"))
    if not sources:
        raise LoopbackBuildError(f"no nccl/*.c sources in {src}: the loopback libnccl is missing")
    return sources


def _build_nccl(
    version: tuple[int, int, int],
    null: bool,
    sanitize: bool,
    cudart: str,
    source_dir: Path | None = None,
) -> str:
    src = SOURCE_DIR if source_dir is None else Path(source_dir).resolve()
    sources = _nccl_sources(src)
    headers = sorted({*(src / "nccl").glob("*.h"), *(src / "include").glob("*.h")})
    flags = [
        *_BASE_FLAGS,
        *_include_flags(src),
        f"-DLB_NCCL_VERSION_CODE={_version_code(version)}",
        f"-Wl,-soname,{NCCL_SONAME}",
    ]
    if null:
        flags.append("-DLB_NULL=1")
    if sanitize:
        flags += _SANITIZE_FLAGS
    lib_dir = os.path.dirname(cudart)
    link = [f"-L{lib_dir}", "-lpynccl_loopback_cudart", f"-Wl,-rpath,{lib_dir}", "-lm"]
    key: dict[str, object] = {
        "version": list(version),
        "null": null,
        "sanitize": sanitize,
        "cudart": cudart,
    }
    what = "loopback libnccl"
    return _compile("nccl", what, NCCL_SONAME, sources, headers, flags, link, key, src)


def build(version: VersionLike = None, null: bool = False, sanitize: bool = False) -> LoopbackBuild:
    """Build (or find cached) the loopback libnccl and libcudart.

    ``version``: the NCCL release to emulate, ``"2.18.1"`` or ``(2, 18, 1)``
    (default 2.32.3); ``null``: a libnccl whose collectives move no data (for
    overhead measurements); ``sanitize``: ASan + UBSan builds (load them only in a
    process started with :func:`env`). Raises :class:`LoopbackBuildError` without a
    compiler or on a compile error, ``ValueError`` for an unsupported version.
    """
    triple = parse_version(version)
    _nccl_sources(SOURCE_DIR)  # fail before spending time on the cudart
    cudart = build_cudart(sanitize)
    return LoopbackBuild(_build_nccl(triple, bool(null), bool(sanitize), cudart), cudart)


def _asan_runtime() -> str:
    cc = _compiler()
    proc = subprocess.run(
        [*cc.argv, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    )
    path = proc.stdout.strip()
    if proc.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
        raise LoopbackBuildError(
            f"the compiler ({cc.argv[0]}) has no AddressSanitizer runtime (libasan.so); "
            "install it (e.g. `apt-get install libasan8`) or build without sanitize"
        )
    return os.path.realpath(path)


def _asan_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libasan" in line for line in maps)
    except OSError:
        return False


def _merge_options(defaults: str, existing: str | None) -> str:
    # The caller's own settings come last, so they win.
    return defaults if not existing else f"{defaults}:{existing}"


def env(version: VersionLike = None, null: bool = False, sanitize: bool = False) -> dict[str, str]:
    """Environment variables for a child process that should use the loopback.

    Builds first. For ``sanitize`` builds this includes ``LD_PRELOAD`` of the ASan
    runtime (ASan must be the first library of a process) and ``ASAN_OPTIONS`` /
    ``UBSAN_OPTIONS``. Use as ``subprocess.run(..., env={**os.environ, **env()})``.
    """
    b = build(version, null, sanitize)
    out = {"PYNCCL_NCCL_LIBRARY": b.nccl, "PYNCCL_CUDART_LIBRARY": b.cudart}
    if sanitize:
        out.update(_sanitizer_env())
    return out


def _sanitizer_env() -> dict[str, str]:
    preload = os.environ.get("LD_PRELOAD", "").split()
    runtime = _asan_runtime()
    return {
        "LD_PRELOAD": " ".join([runtime, *(p for p in preload if p != runtime)]),
        "ASAN_OPTIONS": _merge_options(_ASAN_OPTIONS, os.environ.get("ASAN_OPTIONS")),
        "UBSAN_OPTIONS": _merge_options(_UBSAN_OPTIONS, os.environ.get("UBSAN_OPTIONS")),
    }


def use(version: VersionLike = None, null: bool = False, sanitize: bool = False) -> LoopbackBuild:
    """Build the loopback and make this process's pynccl use it.

    Sets ``$PYNCCL_NCCL_LIBRARY`` / ``$PYNCCL_CUDART_LIBRARY``; if pynccl already
    loaded other libraries, swaps them (communicators made before must not be used
    again). Several versions may be used in turn: they share one loopback cudart.
    """
    if sanitize and not _asan_loaded():
        raise LoopbackBuildError(
            "a sanitize=True loopback can only be loaded into a process that starts with the "
            "ASan runtime: run it in a child process with env(sanitize=True)"
        )
    b = build(version, null, sanitize)
    os.environ["PYNCCL_NCCL_LIBRARY"] = b.nccl
    os.environ["PYNCCL_CUDART_LIBRARY"] = b.cudart
    library = sys.modules.get("pynccl.library")
    if library is not None:  # nothing was loaded if pynccl.library was never imported
        nccl, cudart = library.loaded()
        swap_nccl = nccl is not None and not _same_file(nccl.path, b.nccl)
        swap_cudart = cudart is not None and not _same_file(cudart.path, b.cudart)
        if swap_nccl or swap_cudart:
            library._replace_for_testing(
                b.nccl if swap_nccl else None, b.cudart if swap_cudart else None
            )
    return b


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
