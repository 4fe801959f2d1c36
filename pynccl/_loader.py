"""Find and open libnccl and libcudart, remembering which rule found each file.

Layer 1: imports nothing from pynccl but :mod:`pynccl.errors`, and nothing heavy
(no subprocess, no ``dataclasses``/``logging``/``re`` at import), because
``pynccl.library`` calls it on first use and ``import pynccl`` must stay cheap.

Search order for libnccl (the first that loads wins; the rule is remembered):

1. ``explicit``                 the ``path`` argument
2. ``env:PYNCCL_NCCL_LIBRARY``  that environment variable
3. ``already-mapped``           a libnccl already in this process (torch, cupy, ...),
                                so that we never load a second, different copy beside it
4. ``wheel:nvidia-nccl-cu13``,  ``nvidia/nccl/lib/libnccl.so.2`` under a ``sys.path``
   ``wheel:nvidia-nccl-cu12``   entry (found by scanning, without importing ``nvidia``)
5. ``dynamic-loader``           ``dlopen("libnccl.so.2")`` (LD_LIBRARY_PATH, ld.so.cache)
6. ``NCCL_HOME``, ``CUDA_HOME`` ``$NCCL_HOME/lib``, ``$CUDA_HOME/lib64``

libcudart follows the same scheme: ``explicit``, ``env:PYNCCL_CUDART_LIBRARY``,
``already-mapped``, ``wheel:<distribution>`` (``nvidia/cu13/lib``,
``nvidia/cuda_runtime/lib``), ``dynamic-loader`` (``libcudart.so.13``, then ``.12``),
``CUDA_HOME``, ``/usr/local/cuda``. A libcudart that loads but is newer than the
driver (a CUDA 13 runtime needs driver >= 580: every call would fail with
``cudaErrorInsufficientDriver``, 35) is passed over for the next candidate, so that
``.so.12`` serves an older driver; the rule then says so (``dynamic-loader, fallback:
...``). Where no candidate suits the driver, the first that loaded is kept, and its
calls report error 35 (``python -m pynccl info`` explains it).

An explicit path or environment variable that fails is an error at once: falling
through to some other library would hide the user's mistake.
"""

from __future__ import annotations

import ctypes
import os
import sys
from _thread import allocate_lock
from collections.abc import Callable, Iterator

from .errors import LibraryNotFoundError

__all__ = [
    "CUDART_ENV",
    "NCCL_ENV",
    "Found",
    "duplicate_libraries",
    "library_path",
    "mapped_libraries",
    "open_cudart",
    "open_nccl",
    "warn_duplicate_nccl",
]

NCCL_ENV = "PYNCCL_NCCL_LIBRARY"
CUDART_ENV = "PYNCCL_CUDART_LIBRARY"

# A symbol every real (or loopback) library of that kind exports: a file that
# loads but lacks it is some other library given by mistake.
_NCCL_PROBE = "ncclGetVersion"
_CUDART_PROBE = "cudaRuntimeGetVersion"

_NOT_FOUND = "not found"
_LOAD_FAILED = "found but failed to load: "


class Found:
    """A loaded library: its real ``path``, the discovery ``rule`` and the ``cdll``.

    A frozen record (like ``@dataclass(frozen=True)``, written by hand to keep
    ``dataclasses`` and its imports out of ``import pynccl``).
    """

    __slots__ = ("cdll", "path", "rule")

    path: str
    rule: str
    cdll: ctypes.CDLL

    def __init__(self, path: str, rule: str, cdll: ctypes.CDLL) -> None:
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "cdll", cdll)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Found is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Found is immutable; cannot delete {name!r}")

    def __repr__(self) -> str:
        return f"Found(path={self.path!r}, rule={self.rule!r}, cdll={self.cdll!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Found):
            return NotImplemented
        return (self.path, self.rule, self.cdll) == (other.path, other.rule, other.cdll)

    def __hash__(self) -> int:
        return hash((self.path, self.rule, id(self.cdll)))


# --- /proc/self/maps ---------------------------------------------------------


def _maps_entries() -> Iterator[tuple[str, str, int]]:
    """``(path, device, inode)`` of every file-backed mapping, in /proc/self/maps order."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.readlines()
    except OSError:  # not Linux, or /proc not mounted: nothing we can tell
        return
    for line in lines:
        # address perms offset dev inode pathname (the pathname may contain spaces)
        parts = line.rstrip("\n").split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        try:
            inode = int(parts[4])
        except ValueError:
            continue
        yield parts[5], parts[3], inode


def mapped_libraries(prefix: str) -> list[str]:
    """Real paths of the DSOs mapped in this process whose file name starts with ``prefix``.

    ``mapped_libraries("libnccl")`` also lists NCCL plugins (``libnccl-net.so``);
    each file is listed once (by device and inode), in the order of
    ``/proc/self/maps``. Returns ``[]`` where ``/proc/self/maps`` is unreadable.
    """
    seen: set[tuple[str, int]] = set()
    out: list[str] = []
    for path, dev, inode in _maps_entries():
        name = path.rsplit("/", 1)[-1]
        if not name.startswith(prefix) or ".so" not in name or (dev, inode) in seen:
            continue
        seen.add((dev, inode))
        out.append(path)
    return out


def _is_core(name: str, stem: str) -> bool:
    """``libnccl.so`` / ``libnccl.so.2[.x]`` for stem ``libnccl``, not ``libnccl-net.so``."""
    return name == stem + ".so" or name.startswith(stem + ".so.")


def _mapped_core(stem: str) -> list[str]:
    return [p for p in mapped_libraries(stem) if _is_core(p.rsplit("/", 1)[-1], stem)]


def duplicate_libraries(stem: str = "libnccl") -> list[str]:
    """Distinct files named ``<stem>.so*`` mapped in this process, when more than one.

    Returns ``[]`` when zero or one such file is mapped.
    """
    paths = _mapped_core(stem)
    return paths if len(paths) > 1 else []


_warned: set[frozenset[str]] = set()
_warn_lock = allocate_lock()  # threading's Lock, without importing threading


def warn_duplicate_nccl() -> list[str]:
    """Warn (once per set of files) when two different libnccl files are mapped.

    Two copies of NCCL in one process have separate state (communicators of one
    are invalid in the other, and each starts its own threads), which makes for
    hard-to-debug failures. Emits a :class:`RuntimeWarning` and a log record on
    the ``pynccl`` logger; returns the paths (``[]`` when there is one copy).
    """
    paths = duplicate_libraries("libnccl")
    if not paths:
        return []
    key = frozenset(paths)
    with _warn_lock:
        if key in _warned:
            return paths
        _warned.add(key)
    message = (
        f"{len(paths)} different libnccl files are loaded in this process: "
        + ", ".join(paths)
        + "; communicators and state are not shared between them. Point pynccl at the "
        f"one already in use with ${NCCL_ENV} or load_library(path)."
    )
    import logging  # only on this rare path: logging costs milliseconds to import
    import warnings

    logging.getLogger("pynccl").warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return paths


# --- where did dlopen find it ------------------------------------------------


class _LinkMap(ctypes.Structure):
    # The leading, ABI-stable fields of glibc's struct link_map.
    _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]


_RTLD_DI_LINKMAP = 2
_dlinfo_fn: ctypes._NamedFuncPointer | None = None
_dlinfo_probed = False


def _dlinfo() -> ctypes._NamedFuncPointer | None:
    global _dlinfo_fn, _dlinfo_probed
    if not _dlinfo_probed:
        _dlinfo_probed = True
        for name in (None, "libdl.so.2"):  # glibc >= 2.34 has it in libc, older in libdl
            try:
                fn = ctypes.CDLL(name).dlinfo
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _dlinfo_fn = fn
            break
    return _dlinfo_fn


def library_path(cdll: ctypes.CDLL) -> str | None:
    """The file a loaded ``cdll`` came from (real path), or ``None`` if it cannot be told."""
    fn = _dlinfo()
    if fn is None:
        return None
    lm = ctypes.POINTER(_LinkMap)()
    if fn(cdll._handle, _RTLD_DI_LINKMAP, ctypes.byref(lm)) != 0 or not lm:
        return None
    raw = lm.contents.l_name
    if not raw:
        return None
    return os.path.realpath(os.fsdecode(raw))


# --- loading one candidate -----------------------------------------------------


def _try_load(candidate: str, probe: str) -> tuple[ctypes.CDLL | None, str]:
    """Load ``candidate``; return ``(cdll, "")`` or ``(None, why it failed)``."""
    if "/" in candidate and not os.path.exists(candidate):
        return None, _NOT_FOUND
    try:
        cdll = ctypes.CDLL(candidate)
    except OSError as e:
        text = str(e)
        if "/" not in candidate and "No such file or directory" in text:
            return None, _NOT_FOUND  # the dynamic loader did not find the name
        return None, _LOAD_FAILED + text
    if not hasattr(cdll, probe):
        return None, _LOAD_FAILED + f"loaded, but it has no {probe}: not the expected library"
    return cdll, ""


def _resolve(cdll: ctypes.CDLL, candidate: str) -> str:
    path = library_path(cdll)
    if path is None:
        path = os.path.realpath(candidate) if "/" in candidate else candidate
    return path


# Tells why a library that loaded cannot work here ("" when it can, or when that
# cannot be told); a candidate it refuses is passed over for the next one.
_Judge = Callable[[ctypes.CDLL], str]


def _explicit(
    library: str,
    candidate: str,
    rule: str,
    names: tuple[str, ...],
    probe: str,
    judge: _Judge | None = None,
) -> Found:
    """Load a path the user gave (a file, a directory holding ``names``, or a bare soname).

    A file or soname is taken as it is; in a directory, ``judge`` may pass over one
    name for the next (``libcudart.so.13`` for ``.so.12`` under an older driver).
    """
    if not candidate:
        raise LibraryNotFoundError(library, [(f"{rule}: {candidate!r}", "empty path")])
    if not os.path.isdir(candidate):
        judge = None  # the user named this very file: use it, whatever the driver says
        files = [(rule, candidate)]
    else:
        files = [(rule, os.path.join(candidate, n)) for n in names]
    tried: list[tuple[str, str]] = []
    found = _search(library, probe, iter(files), tried, judge)
    if found is None:
        raise LibraryNotFoundError(library, tried)
    return found


def _sys_path_dirs() -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for entry in sys.path:
        d = os.path.abspath(entry or os.curdir)
        if d not in seen and os.path.isdir(d):
            seen.add(d)
            out.append(d)
    return out


def _dists(site: str, prefix: str) -> list[str]:
    """Distribution names (``nvidia-nccl-cu13``) of the ``prefix*.dist-info`` dirs in ``site``."""
    try:
        names = os.listdir(site)
    except OSError:
        return []
    out = []
    for n in sorted(names):
        if n.startswith(prefix) and n.endswith(".dist-info"):
            out.append(n[: -len(".dist-info")].split("-", 1)[0].replace("_", "-").lower())
    return out


def _search(
    library: str,
    probe: str,
    candidates: Iterator[tuple[str, str]],
    tried: list[tuple[str, str]],
    judge: _Judge | None = None,
) -> Found | None:
    """Try ``(rule, candidate)`` pairs in order, recording each failure in ``tried``.

    A candidate that loads but that ``judge`` refuses is recorded too, and the search
    goes on; the one finally taken says in its rule what it stands in for. When every
    candidate that loaded was refused, the first of them is returned as it is: a
    library that fails each call with a clear error beats "not found".
    """
    done: set[str] = set()
    first_refused: Found | None = None
    passed_over: list[str] = []
    for rule, candidate in candidates:
        if candidate.startswith("!"):  # a rule that had nothing to offer: say why
            tried.append((rule, candidate[1:]))
            continue
        key = os.path.realpath(candidate) if "/" in candidate else candidate
        if key in done:
            continue
        done.add(key)
        cdll, why = _try_load(candidate, probe)
        if cdll is None:
            tried.append((f"{rule}: {candidate}", why))
            continue
        found = Found(_resolve(cdll, candidate), rule, cdll)
        refused = judge(cdll) if judge is not None else ""
        if not refused:
            if passed_over:
                found = Found(found.path, f"{rule}, fallback: {'; '.join(passed_over)}", cdll)
            return found
        tried.append((f"{rule}: {candidate}", f"loaded, but {refused}"))
        note = f"{found.path} passed over ({refused})"
        if note not in passed_over:  # one file reached by two names
            passed_over.append(note)
        if first_refused is None:
            first_refused = found
    return first_refused


# --- libnccl -----------------------------------------------------------------

_NCCL_NAMES = ("libnccl.so.2", "libnccl.so")
_NCCL_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")


def _nccl_wheel_candidates() -> list[tuple[str, str]]:
    found: list[tuple[int, str, str]] = []
    for site in _sys_path_dirs():
        for sub in ("nccl", "cu13"):
            f = os.path.join(site, "nvidia", sub, "lib", "libnccl.so.2")
            if not os.path.exists(f):
                continue
            # cu12 and cu13 wheels install the same file name: the dist-info beside
            # it tells which one this is. Unidentified copies come last.
            dists = [d for d in _dists(site, "nvidia_nccl") if d in _NCCL_WHEELS]
            if sub == "cu13" and not dists:
                dists = ["nvidia-nccl-cu13"]
            rank = min((_NCCL_WHEELS.index(d) for d in dists), default=len(_NCCL_WHEELS))
            dist = _NCCL_WHEELS[rank] if rank < len(_NCCL_WHEELS) else "nvidia-nccl"
            found.append((rank, f"wheel:{dist}", f))
    found.sort(key=lambda t: t[0])  # stable: sys.path order within a wheel kind
    return [(rule, f) for _, rule, f in found]


def _nccl_candidates() -> Iterator[tuple[str, str]]:
    mapped = _mapped_core("libnccl")
    if mapped:
        for f in mapped:
            yield "already-mapped", f
    else:
        yield "already-mapped", "!no libnccl mapped in this process"
    wheels = _nccl_wheel_candidates()
    if not wheels:
        yield "wheel:nvidia-nccl-cu13/cu12", "!no nvidia/nccl/lib/libnccl.so.2 on sys.path"
    yield from wheels
    yield "dynamic-loader", "libnccl.so.2"
    for var, sub in (("NCCL_HOME", "lib"), ("CUDA_HOME", "lib64")):
        home = os.environ.get(var)
        if not home:
            yield var, "!not set"
            continue
        for n in _NCCL_NAMES:
            yield var, os.path.join(home, sub, n)


def open_nccl(path: str | os.PathLike[str] | None = None) -> Found:
    """Find and load libnccl; see the module docstring for the order.

    ``path`` (a file, a directory holding ``libnccl.so.2``, or a soname) and
    ``$PYNCCL_NCCL_LIBRARY`` are used alone: if they fail, this raises at once.
    Warns (once) when the process ends up with two different libnccl files.

    Raises:
        LibraryNotFoundError: nothing loaded; ``tried`` says, per candidate,
            "not found" or "found but failed to load: <dlerror text>".
    """
    if path is not None:
        found = _explicit("libnccl", os.fspath(path), "explicit", _NCCL_NAMES, _NCCL_PROBE)
    elif os.environ.get(NCCL_ENV) is not None:
        found = _explicit(
            "libnccl", os.environ[NCCL_ENV], f"env:{NCCL_ENV}", _NCCL_NAMES, _NCCL_PROBE
        )
    else:
        tried: list[tuple[str, str]] = [(f"env:{NCCL_ENV}", "not set")]
        maybe = _search("libnccl", _NCCL_PROBE, _nccl_candidates(), tried)
        if maybe is None:
            raise LibraryNotFoundError("libnccl", tried)
        found = maybe
    warn_duplicate_nccl()
    return found


# --- libcudart -----------------------------------------------------------------

_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


def _cudart_wheel_candidates() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for site in _sys_path_dirs():
        for sub in (("nvidia", "cu13", "lib"), ("nvidia", "cuda_runtime", "lib")):
            d = os.path.join(site, *sub)
            if not os.path.isdir(d):
                continue
            dists = _dists(site, "nvidia_cuda_runtime")
            rule = f"wheel:{dists[0]}" if dists else "wheel:nvidia-cuda-runtime"
            for n in _CUDART_NAMES[:2]:
                f = os.path.join(d, n)
                if os.path.exists(f):
                    out.append((rule, f))
    return out


def _cudart_candidates() -> Iterator[tuple[str, str]]:
    mapped = _mapped_core("libcudart")
    if mapped:
        for f in mapped:
            yield "already-mapped", f
    else:
        yield "already-mapped", "!no libcudart mapped in this process"
    wheels = _cudart_wheel_candidates()
    if not wheels:
        yield "wheel:nvidia-cuda-runtime", "!no nvidia/{cu13,cuda_runtime}/lib on sys.path"
    yield from wheels
    for n in _CUDART_NAMES[:2]:
        yield "dynamic-loader", n
    home = os.environ.get("CUDA_HOME")
    if home:
        for n in _CUDART_NAMES:
            yield "CUDA_HOME", os.path.join(home, "lib64", n)
    else:
        yield "CUDA_HOME", "!not set"
    for n in _CUDART_NAMES:
        yield "/usr/local/cuda", os.path.join("/usr/local/cuda/lib64", n)


_CUDA_ERROR_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def _cudart_too_new(cdll: ctypes.CDLL) -> str:
    """Why this libcudart cannot run on the installed driver ("" when it can, or cannot tell).

    CUDA's minor-version compatibility lets a 12.x runtime run on any 12.x driver,
    so only a runtime of a newer *major* version than the driver is suspect; then
    ``cudaGetDeviceCount`` must confirm it with ``cudaErrorInsufficientDriver`` (a
    forward-compatibility libcuda reports its own, newer version, and passes). No
    driver at all (version 0) is no reason to prefer another runtime. Nothing here
    initializes CUDA unless the versions already disagree.
    """
    runtime, driver, count = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    try:
        # cdll[name] makes a fresh function object: the cached attributes, which the
        # prototype layer configures, are left alone
        if cdll["cudaRuntimeGetVersion"](ctypes.byref(runtime)) != 0:
            return ""
        if cdll["cudaDriverGetVersion"](ctypes.byref(driver)) != 0 or driver.value <= 0:
            return ""
        if driver.value // 1000 >= runtime.value // 1000:
            return ""
        rc = cdll["cudaGetDeviceCount"](ctypes.byref(count))
    except AttributeError:  # a partial stand-in: nothing to judge by
        return ""
    if rc != _CUDA_ERROR_INSUFFICIENT_DRIVER:
        return ""
    return (
        f"CUDA runtime {_cuda_version(runtime.value)} needs a newer driver than this one "
        f"(CUDA {_cuda_version(driver.value)}): cudaGetDeviceCount returned "
        f"cudaErrorInsufficientDriver ({rc})"
    )


def open_cudart(path: str | os.PathLike[str] | None = None) -> Found:
    """Find and load the CUDA runtime (libcudart), same scheme as :func:`open_nccl`.

    ``path`` and ``$PYNCCL_CUDART_LIBRARY`` are used alone (a directory among them
    may fall back from ``.so.13`` to ``.so.12``; a file is taken as it is). A
    libcudart already mapped (torch, cupy) is preferred so that pynccl shares its
    runtime. A runtime too new for the driver is passed over for an older one (see
    the module docstring); the rule of the one taken then names it.

    Raises:
        LibraryNotFoundError: nothing loaded, with the candidates tried and why.
    """
    names, probe, judge = _CUDART_NAMES, _CUDART_PROBE, _cudart_too_new
    if path is not None:
        return _explicit("libcudart", os.fspath(path), "explicit", names, probe, judge)
    env = os.environ.get(CUDART_ENV)
    if env is not None:
        return _explicit("libcudart", env, f"env:{CUDART_ENV}", names, probe, judge)
    tried: list[tuple[str, str]] = [(f"env:{CUDART_ENV}", "not set")]
    found = _search("libcudart", probe, _cudart_candidates(), tried, judge)
    if found is None:
        raise LibraryNotFoundError("libcudart", tried)
    return found
