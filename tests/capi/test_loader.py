"""Library discovery (pynccl._loader) against the real libnccl of the nvidia-nccl wheel.

Every rule runs in a fresh subprocess: what is mapped in a process, LD_LIBRARY_PATH
and sys.path are per-process facts, and a loaded library can never be unloaded.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.child import last_json, run_python


def _wheel_nccl() -> Path | None:
    for entry in sys.path:
        p = Path(entry or ".") / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if p.exists():
            return p.resolve()
    return None


WHEEL_NCCL = _wheel_nccl()
needs_wheel = pytest.mark.skipif(WHEEL_NCCL is None, reason="nvidia-nccl wheel not installed")
# A libnccl the dynamic loader finds by itself (ld.so.cache) would win over the
# NCCL_HOME / CUDA_HOME rules and the "nothing found" case.
SYSTEM_NCCL = ctypes.util.find_library("nccl")
no_system_nccl = pytest.mark.skipif(
    SYSTEM_NCCL is not None, reason=f"the dynamic loader finds a system {SYSTEM_NCCL}"
)

# Run before the test code in every child: drops the sys.path entries that hold
# an nvidia/nccl wheel, so that the rules after "wheel:" get their turn.
HIDE_WHEELS = """
import os, sys
sys.path[:] = [p for p in sys.path
               if not os.path.isdir(os.path.join(p or ".", "nvidia", "nccl", "lib"))]
"""


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYNCCL_") and k not in ("NCCL_HOME", "CUDA_HOME", "LD_LIBRARY_PATH")
    }
    env["PYTHONPATH"] = str(ROOT)
    env["NCCL_SOCKET_IFNAME"] = "lo"
    env.update(extra)
    return env


def run_child(code: str, env: dict[str, str] | None = None, hide_wheels: bool = False) -> Any:
    """Run ``code`` in a fresh interpreter; it prints one JSON document as its last line."""
    src = (HIDE_WHEELS if hide_wheels else "") + textwrap.dedent(code)
    return last_json(run_python(["-c", src], env if env is not None else child_env()))


OPEN_NCCL = """
import json, ctypes
from pynccl import _loader
from pynccl.errors import LibraryNotFoundError
try:
    f = _loader.open_nccl({arg})
except LibraryNotFoundError as e:
    print(json.dumps({{"error": str(e), "tried": e.tried, "library": e.library}}))
else:
    v = ctypes.c_int()
    f.cdll.ncclGetVersion(ctypes.byref(v))
    print(json.dumps({{"path": f.path, "rule": f.rule, "version": v.value,
                      "mapped": _loader.mapped_libraries("libnccl")}}))
"""


def open_nccl_in_child(
    arg: str = "", env: dict[str, str] | None = None, hide_wheels: bool = False, pre: str = ""
) -> Any:
    return run_child(pre + OPEN_NCCL.format(arg=arg), env=env, hide_wheels=hide_wheels)


@pytest.fixture(scope="module")
def nccl_copy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A byte copy of the wheel's libnccl (another inode: a second, different libnccl)."""
    assert WHEEL_NCCL is not None
    d = tmp_path_factory.mktemp("nccl_copy")
    dst = d / "libnccl.so.2"
    shutil.copyfile(WHEEL_NCCL, dst)
    yield dst
    dst.unlink()


# --- each discovery rule --------------------------------------------------------


@needs_wheel
def test_wheel_rule_by_default() -> None:
    out = open_nccl_in_child()
    assert out["rule"] == "wheel:nvidia-nccl-cu13"
    assert out["path"] == str(WHEEL_NCCL)
    assert out["version"] == 23203
    assert out["mapped"] == [str(WHEEL_NCCL)]


@needs_wheel
def test_explicit_path_file_and_directory() -> None:
    out = open_nccl_in_child(repr(str(WHEEL_NCCL)))
    assert (out["rule"], out["path"]) == ("explicit", str(WHEEL_NCCL))
    out = open_nccl_in_child(repr(str(WHEEL_NCCL.parent)))
    assert (out["rule"], out["path"]) == ("explicit", str(WHEEL_NCCL))


@needs_wheel
def test_env_var_rule() -> None:
    out = open_nccl_in_child(env=child_env(PYNCCL_NCCL_LIBRARY=str(WHEEL_NCCL)))
    assert (out["rule"], out["path"]) == ("env:PYNCCL_NCCL_LIBRARY", str(WHEEL_NCCL))


@needs_wheel
def test_already_mapped_wins_over_wheel(nccl_copy: Path) -> None:
    pre = f"import ctypes; ctypes.CDLL({str(nccl_copy)!r})\n"
    out = open_nccl_in_child(pre=pre)
    assert (out["rule"], out["path"]) == ("already-mapped", str(nccl_copy))
    assert out["mapped"] == [str(nccl_copy)]  # no second copy was loaded beside it


@needs_wheel
def test_dynamic_loader_rule(tmp_path: Path) -> None:
    (tmp_path / "libnccl.so.2").symlink_to(WHEEL_NCCL)
    out = open_nccl_in_child(env=child_env(LD_LIBRARY_PATH=str(tmp_path)), hide_wheels=True)
    assert (out["rule"], out["path"]) == ("dynamic-loader", str(WHEEL_NCCL))


@needs_wheel
@no_system_nccl
@pytest.mark.parametrize(("var", "sub"), [("NCCL_HOME", "lib"), ("CUDA_HOME", "lib64")])
def test_home_rules(tmp_path: Path, var: str, sub: str) -> None:
    (tmp_path / sub).mkdir()
    (tmp_path / sub / "libnccl.so.2").symlink_to(WHEEL_NCCL)
    out = open_nccl_in_child(env=child_env(**{var: str(tmp_path)}), hide_wheels=True)
    assert out["rule"] == var
    assert out["path"] == str(WHEEL_NCCL)  # the real path behind the symlink
    assert out["version"] == 23203


# --- failures -----------------------------------------------------------------------


def test_explicit_failure_does_not_fall_through(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "libnccl.so.2"
    out = open_nccl_in_child(repr(str(missing)))
    assert out["library"] == "libnccl"
    assert out["tried"] == [[f"explicit: {missing}", "not found"]]


def test_env_var_failure_is_immediate(tmp_path: Path) -> None:
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_bytes(b"this is not an ELF file\n" * 64)
    out = open_nccl_in_child(env=child_env(PYNCCL_NCCL_LIBRARY=str(bogus)))
    assert len(out["tried"]) == 1
    candidate, reason = out["tried"][0]
    assert candidate == f"env:PYNCCL_NCCL_LIBRARY: {bogus}"
    assert reason.startswith("found but failed to load: ")
    assert "invalid ELF header" in reason  # the dlerror text
    assert str(bogus) in out["error"]


def test_wrong_library_is_refused() -> None:
    # Loads fine, but it is not a libnccl: refused rather than failing later.
    libm = "libm.so.6"
    out = open_nccl_in_child(repr(libm))
    ((_candidate, reason),) = out["tried"]
    assert reason.startswith("found but failed to load: ")
    assert "ncclGetVersion" in reason


@no_system_nccl
def test_search_failure_lists_every_rule(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnccl.so.2").write_bytes(b"\x7fELF garbage")
    out = open_nccl_in_child(env=child_env(NCCL_HOME=str(tmp_path)), hide_wheels=True)
    tried = dict((c.split(":")[0], r) for c, r in out["tried"])
    assert tried["env"] == "not set"
    assert tried["already-mapped"].startswith("no libnccl mapped")
    assert tried["dynamic-loader"] == "not found"
    assert tried["CUDA_HOME"] == "not set"
    by_candidate = dict(map(tuple, out["tried"]))
    bad = f"NCCL_HOME: {tmp_path / 'lib' / 'libnccl.so.2'}"
    assert by_candidate[bad].startswith("found but failed to load: ")
    assert by_candidate[f"NCCL_HOME: {tmp_path / 'lib' / 'libnccl.so'}"] == "not found"


# --- what is mapped -----------------------------------------------------------------


@needs_wheel
def test_two_libnccl_files_warn_once(nccl_copy: Path) -> None:
    code = f"""
    import ctypes, json, warnings
    from pynccl import _loader
    ctypes.CDLL({str(nccl_copy)!r})
    ctypes.CDLL({str(WHEEL_NCCL)!r})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        f = _loader.open_nccl()
        _loader.open_nccl()
    print(json.dumps({{"rule": f.rule, "dups": _loader.duplicate_libraries(),
                      "warnings": [(c.category.__name__, str(c.message)) for c in w]}}))
    """
    out = run_child(code)
    assert out["rule"] == "already-mapped"
    assert sorted(out["dups"]) == sorted([str(nccl_copy), str(WHEEL_NCCL)])
    assert len(out["warnings"]) == 1  # once, not per call
    category, message = out["warnings"][0]
    assert category == "RuntimeWarning"
    assert str(nccl_copy) in message and str(WHEEL_NCCL) in message


@needs_wheel
def test_same_file_twice_is_not_a_duplicate(tmp_path: Path) -> None:
    link = tmp_path / "libnccl.so.2"
    link.symlink_to(WHEEL_NCCL)
    code = f"""
    import ctypes, json, warnings
    from pynccl import _loader
    ctypes.CDLL({str(link)!r})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        f = _loader.open_nccl({str(WHEEL_NCCL)!r})
    print(json.dumps({{"dups": _loader.duplicate_libraries(), "n": len(w),
                      "mapped": _loader.mapped_libraries("libnccl")}}))
    """
    out = run_child(code)
    assert out == {"dups": [], "n": 0, "mapped": [str(WHEEL_NCCL)]}


def test_mapped_libraries_prefix_and_plugins(tmp_path: Path) -> None:
    # A plugin-like name (libnccl-net-*.so) is listed by prefix but is not a core libnccl.
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    src = tmp_path / "p.c"
    src.write_text("int pynccl_test_plugin(void) { return 7; }\n")
    so = tmp_path / "libnccl-net-test.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    code = f"""
    import ctypes, json
    from pynccl import _loader
    ctypes.CDLL({str(so)!r})
    print(json.dumps({{"pre": _loader.mapped_libraries("libnccl"),
                      "core": _loader.duplicate_libraries(),
                      "other": _loader.mapped_libraries("libnccl-net")}}))
    """
    out = run_child(code)
    assert str(so) in out["pre"]
    assert out["other"] == [str(so)]
    assert out["core"] == []


def test_import_pynccl_loads_no_library() -> None:
    code = """
    import json
    import pynccl
    with open("/proc/self/maps") as f:
        names = sorted({l.split()[-1].rsplit("/", 1)[-1] for l in f if "/" in l})
    print(json.dumps([n for n in names if "nccl" in n or "cudart" in n or "cuda" in n]))
    """
    assert run_child(code) == []


# --- libcudart -----------------------------------------------------------------------

CUDART = "/usr/local/cuda/lib64/libcudart.so.13"
needs_cudart = pytest.mark.skipif(not os.path.exists(CUDART), reason=f"no {CUDART}")

OPEN_CUDART = """
import json, ctypes
from pynccl import _loader
from pynccl.errors import LibraryNotFoundError
try:
    f = _loader.open_cudart({arg})
except LibraryNotFoundError as e:
    print(json.dumps({{"error": str(e), "tried": e.tried}}))
else:
    v = ctypes.c_int()
    f.cdll.cudaRuntimeGetVersion(ctypes.byref(v))
    print(json.dumps({{"path": f.path, "rule": f.rule, "version": v.value}}))
"""


@needs_cudart
def test_cudart_explicit_and_env() -> None:
    real = os.path.realpath(CUDART)
    out = run_child(OPEN_CUDART.format(arg=repr(CUDART)))
    assert (out["rule"], out["path"]) == ("explicit", real)
    assert out["version"] >= 12000
    out = run_child(OPEN_CUDART.format(arg=""), env=child_env(PYNCCL_CUDART_LIBRARY=CUDART))
    assert (out["rule"], out["path"]) == ("env:PYNCCL_CUDART_LIBRARY", real)


@needs_cudart
def test_cudart_already_mapped() -> None:
    pre = f"import ctypes; ctypes.CDLL({CUDART!r})\n"
    out = run_child(pre + OPEN_CUDART.format(arg=""))
    assert (out["rule"], out["path"]) == ("already-mapped", os.path.realpath(CUDART))


def test_cudart_explicit_failure(tmp_path: Path) -> None:
    bogus = tmp_path / "libcudart.so.13"
    bogus.write_text("nope")
    out = run_child(OPEN_CUDART.format(arg=repr(str(bogus))))
    ((candidate, reason),) = out["tried"]
    assert candidate == f"explicit: {bogus}"
    assert reason.startswith("found but failed to load: ")


def test_cudart_wheel_layouts(tmp_path: Path) -> None:
    # A fake site dir with the cu13 wheel layout: listed as a wheel candidate, by
    # its distribution name, in the search order (checked without loading it).
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.13").write_text("")
    (tmp_path / "nvidia_cuda_runtime-13.0.96.dist-info").mkdir()
    code = f"""
    import json, sys
    sys.path.insert(0, {str(tmp_path)!r})
    from pynccl import _loader
    print(json.dumps([list(c) for c in _loader._cudart_candidates()]))
    """
    cands = run_child(code, env=child_env(CUDA_HOME="/opt/cuda-x"))
    rules = [r for r, _ in cands]
    assert ["wheel:nvidia-cuda-runtime", str(lib / "libcudart.so.13")] in cands
    # order: mapped, wheels, loader, CUDA_HOME, /usr/local/cuda
    first = {r: rules.index(r) for r in reversed(rules)}
    assert (
        first["already-mapped"]
        < first["wheel:nvidia-cuda-runtime"]
        < first["dynamic-loader"]
        < first["CUDA_HOME"]
        < first["/usr/local/cuda"]
    )
    assert ["CUDA_HOME", "/opt/cuda-x/lib64/libcudart.so.13"] in cands


# --- libcudart too new for the driver: the fall back to .so.12 ---------------------------------

# A stand-in libcudart whose runtime and driver versions are set at build time, and
# whose cudaGetDeviceCount answers as the real runtime does (cudart's documented
# behaviour): cudaErrorInsufficientDriver (35) when the driver's CUDA major version is
# older than the runtime's, cudaErrorNoDevice (100) when no driver is installed
# (cudaDriverGetVersion then reports 0), else one device.
FAKE_CUDART = r"""
static int last_error = 0;
int cudaRuntimeGetVersion(int *v) { *v = RUNTIME; return 0; }
int cudaDriverGetVersion(int *v) { *v = DRIVER; return 0; }
int cudaGetDeviceCount(int *n) {
    *n = 0;
    if (DRIVER == 0) return last_error = 35;
    if (DRIVER / 1000 < RUNTIME / 1000) return last_error = 35;
    *n = 1;
    return 0;
}
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
int cudaPeekAtLastError(void) { return last_error; }
const char *cudaGetErrorName(int e) { return e == 35 ? "cudaErrorInsufficientDriver" : "?"; }
const char *cudaGetErrorString(int e) { return e == 35 ? "insufficient driver" : "?"; }
"""

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _fake_cudart(directory: Path, soname: str, runtime: int, driver: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / f"{soname}.c"
    src.write_text(FAKE_CUDART)
    so = directory / soname
    subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            f"-DRUNTIME={runtime}",
            f"-DDRIVER={driver}",
            f"-Wl,-soname,{soname}",
            "-o",
            str(so),
            str(src),
        ],
        check=True,
    )
    return so


def _open_cudart_in(env: dict[str, str], arg: str = "") -> Any:
    return run_child(OPEN_CUDART.format(arg=arg), env=env, hide_wheels=True)


@needs_cc
def test_cudart_13_too_new_for_the_driver_falls_back_to_12(tmp_path: Path) -> None:
    # Driver 12.4 (< 580): CUDA 13.0's runtime fails every call with error 35; 12.8's
    # runs on it (minor-version compatibility), so the search must go on to .so.12.
    new = _fake_cudart(tmp_path, "libcudart.so.13", 13000, 12040)
    old = _fake_cudart(tmp_path, "libcudart.so.12", 12080, 12040)
    out = _open_cudart_in(child_env(LD_LIBRARY_PATH=str(tmp_path)))
    assert out["path"] == str(old) and out["version"] == 12080
    assert out["rule"].startswith(f"dynamic-loader, fallback: {new} passed over (")
    assert "cudaErrorInsufficientDriver (35)" in out["rule"]
    assert "CUDA runtime 13.0 needs a newer driver than this one (CUDA 12.4)" in out["rule"]


@needs_cc
def test_cudart_13_missing_falls_back_to_12_in_a_directory(tmp_path: Path) -> None:
    old = _fake_cudart(tmp_path / "only12", "libcudart.so.12", 12080, 12040)
    out = _open_cudart_in(child_env(), repr(str(old.parent)))
    assert (out["path"], out["rule"], out["version"]) == (str(old), "explicit", 12080)


@needs_cc
def test_cudart_explicit_directory_falls_back_and_a_file_is_kept(tmp_path: Path) -> None:
    new = _fake_cudart(tmp_path, "libcudart.so.13", 13000, 12040)
    old = _fake_cudart(tmp_path, "libcudart.so.12", 12080, 12040)
    out = _open_cudart_in(child_env(PYNCCL_CUDART_LIBRARY=str(tmp_path)))
    assert out["path"] == str(old)
    assert out["rule"].startswith(f"env:PYNCCL_CUDART_LIBRARY, fallback: {new} passed over")
    # a file the user named is used as it is: the error then comes from its calls
    out = _open_cudart_in(child_env(), repr(str(new)))
    assert (out["path"], out["rule"]) == (str(new), "explicit")


@needs_cc
@pytest.mark.parametrize(
    ("driver", "why"),
    [
        (13000, "the driver runs CUDA 13.0"),
        (13020, "a newer 13.x driver"),
        (0, "no driver at all: no other runtime would do better"),
    ],
)
def test_cudart_13_kept_when_the_driver_allows_it(tmp_path: Path, driver: int, why: str) -> None:
    new = _fake_cudart(tmp_path, "libcudart.so.13", 13000, driver)
    _fake_cudart(tmp_path, "libcudart.so.12", 12080, driver)
    out = _open_cudart_in(child_env(LD_LIBRARY_PATH=str(tmp_path)))
    assert (out["path"], out["rule"]) == (str(new), "dynamic-loader"), why


@needs_cc
def test_cudart_every_candidate_too_new_keeps_the_first(tmp_path: Path) -> None:
    # Driver 11.8: neither runtime can run; the first that loaded is kept (its calls
    # then say cudaErrorInsufficientDriver), rather than "libcudart not found".
    new = _fake_cudart(tmp_path, "libcudart.so.13", 13000, 11080)
    _fake_cudart(tmp_path, "libcudart.so.12", 12080, 11080)
    # (a directory named alone: the search would go on to this machine's own libcudart)
    out = _open_cudart_in(child_env(PYNCCL_CUDART_LIBRARY=str(tmp_path)))
    assert (out["path"], out["rule"]) == (str(new), "env:PYNCCL_CUDART_LIBRARY")


@needs_cc
def test_info_shows_the_fallback_rule(tmp_path: Path) -> None:
    new = _fake_cudart(tmp_path, "libcudart.so.13", 13000, 12040)
    old = _fake_cudart(tmp_path, "libcudart.so.12", 12080, 12040)
    env = child_env(LD_LIBRARY_PATH=str(tmp_path))
    code = HIDE_WHEELS + textwrap.dedent(
        """
        import sys
        from pynccl.info import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    for args in (["--json"], []):
        proc = run_python(["-c", code, *args], env)
        if args:
            cudart = json.loads(proc.stdout)["cudart"]
            assert cudart["path"] == str(old)
            assert cudart["rule"].startswith(f"dynamic-loader, fallback: {new} passed over")
        else:
            line = next(x for x in proc.stdout.splitlines() if x.startswith("libcudart"))
            assert f"{old}  (found by rule: dynamic-loader, fallback: {new}" in line
