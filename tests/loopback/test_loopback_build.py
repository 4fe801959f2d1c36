"""The loopback builder: caching, locking, errors, versions, use()/env() and the CLI.

The libnccl side is exercised with a small stand-in ``nccl/fake.c`` written into a copy
of the source directory, so these tests do not depend on the real loopback libnccl.
Compiler invocations are counted through a logging wrapper set as ``$CC``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ROOT

from pynccl.testing import loopback
from pynccl.testing.loopback import __main__ as cli
from pynccl.testing.loopback import _build

REPO = ROOT
REAL_CC = shutil.which(os.environ.get("CC") or "cc")
pytestmark = pytest.mark.skipif(REAL_CC is None, reason="no C compiler")

FAKE_NCCL = r"""
#include "lb_internal.h"
/* Stand-in libnccl: enough to check flags, linking and the shared cudart. */
int ncclGetVersion(int *version) { *version = LB_NCCL_VERSION_CODE; return 0; }
int lb_test_null(void) {
#ifdef LB_NULL
    return LB_NULL;
#else
    return 0;
#endif
}
int lb_test_current_device(void) { return pynccl_lb_current_device(); }
"""


def make_sources(dest: Path, with_nccl: bool = True) -> Path:
    """A source directory: the real cudart sources plus (optionally) the stand-in nccl/."""
    dest.mkdir(parents=True, exist_ok=True)
    for sub in ("cudart", "include"):
        shutil.copytree(loopback.SOURCE_DIR / sub, dest / sub, dirs_exist_ok=True)
    if with_nccl:
        (dest / "nccl").mkdir(exist_ok=True)
        (dest / "nccl" / "fake.c").write_text(FAKE_NCCL)
    return dest


def make_cc_wrapper(directory: Path) -> tuple[str, Path]:
    """A $CC that logs each compile (not --version probes) and then runs the real one."""
    log = directory / "cc.log"
    wrapper = directory / "cc-wrapper"
    wrapper.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            case "$*" in *-shared*) echo compile >> "{log}"; sleep 0.3 ;; esac
            exec "{REAL_CC}" "$@"
            """
        )
    )
    wrapper.chmod(0o755)
    return str(wrapper), log


def compiles(log: Path) -> int:
    return len(log.read_text().split()) if log.exists() else 0


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PYNCCL_CACHE_DIR", str(root))
    return root / "loopback"


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-cache")


@pytest.fixture(scope="module")
def shared_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sources(tmp_path_factory.mktemp("fake-package"))


@pytest.fixture
def fake_package(
    shared_sources: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """SOURCE_DIR pointing at sources with the stand-in nccl/; a cache shared by tests."""
    src = shared_sources
    monkeypatch.setattr(_build, "SOURCE_DIR", src)
    monkeypatch.setenv("PYNCCL_CACHE_DIR", str(shared_cache))
    yield src


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# ---- the cache ----------------------------------------------------------------


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PYNCCL_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert loopback.cache_dir() == tmp_path / "home" / ".cache" / "pynccl" / "loopback"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loopback.cache_dir() == tmp_path / "xdg" / "pynccl" / "loopback"
    monkeypatch.setenv("PYNCCL_CACHE_DIR", str(tmp_path / "mine"))
    assert loopback.cache_dir() == tmp_path / "mine" / "loopback"


def test_second_build_is_a_cache_hit(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cc, log = make_cc_wrapper(tmp_path)
    monkeypatch.setenv("CC", cc)
    first = loopback.build_cudart()
    assert compiles(log) == 1
    stat = os.stat(first)
    assert loopback.build_cudart() == first
    assert compiles(log) == 1
    assert os.stat(first).st_mtime_ns == stat.st_mtime_ns
    # Another process finds it too.
    out = run_python(
        "from pynccl.testing import loopback; print(loopback.build_cudart())",
        {"CC": cc, "PYNCCL_CACHE_DIR": os.environ["PYNCCL_CACHE_DIR"]},
    )
    assert out.stdout.strip() == first, out.stderr
    assert compiles(log) == 1
    assert Path(first).name == loopback.CUDART_SONAME
    assert Path(first).parent.parent == cache
    info = json.loads((Path(first).parent / "build.json").read_text())
    assert "-fPIC" in info["command"] and info["sanitize"] is False


def test_cache_key_follows_sources_and_options(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_sources(tmp_path / "src")
    cudart = loopback.build_cudart(source_dir=src)
    nccls = {
        _build._build_nccl(v, null, False, cudart, src)
        for v, null in (((2, 18, 1), False), ((2, 32, 3), False), ((2, 32, 3), True))
    }
    assert len(nccls) == 3
    assert all(Path(p).name == "libnccl.so.2" for p in nccls)
    # Same inputs: same file. Edited source: a new build.
    assert _build._build_nccl((2, 18, 1), False, False, cudart, src) in nccls
    with open(src / "cudart" / "core.c", "a") as f:
        f.write("\n/* edited */\n")
    assert loopback.build_cudart(source_dir=src) != cudart
    # Where the sources live does not matter, only what they are.
    twin = make_sources(tmp_path / "twin")
    shutil.copy(src / "cudart" / "core.c", twin / "cudart" / "core.c")
    assert loopback.build_cudart(source_dir=twin) == loopback.build_cudart(source_dir=src)
    # A nccl-only header does not touch the cudart build.
    before = loopback.build_cudart(source_dir=src)
    (src / "nccl" / "extra.h").write_text("/* nccl side only */\n")
    assert loopback.build_cudart(source_dir=src) == before


@pytest.mark.slow
def test_concurrent_builds_make_one_library(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cc, log = make_cc_wrapper(tmp_path)
    env = {**os.environ, "CC": cc}
    code = "from pynccl.testing import loopback; print(loopback.build_cudart())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    assert compiles(log) == 1
    entries = sorted(p.name for p in cache.iterdir())
    assert [e for e in entries if not e.endswith(".lock")] == [Path(paths.pop()).parent.name]
    check = run_python(
        """
        import ctypes, sys
        from pynccl.testing import loopback
        lib = ctypes.CDLL(loopback.build_cudart())
        n = ctypes.c_int()
        print(lib.cudaGetDeviceCount(ctypes.byref(n)), n.value)
        """,
        {"CC": cc, "PYNCCL_LOOPBACK_DEVICES": "5"},
    )
    assert check.stdout.split() == ["0", "5"], check.stderr


# ---- errors -------------------------------------------------------------------


def test_missing_compiler_says_what_to_do(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(loopback.LoopbackBuildError) as info:
        loopback.build_cudart()
    text = str(info.value)
    assert "/nonexistent/cc" in text and "apt-get install gcc" in text and "CC" in text
    assert isinstance(info.value, RuntimeError)


def test_compile_error_carries_the_compiler_output(cache: Path, tmp_path: Path) -> None:
    src = make_sources(tmp_path / "src")
    with open(src / "cudart" / "mem.c", "a") as f:
        f.write("\n#error broken on purpose\n")
    with pytest.raises(loopback.LoopbackBuildError) as info:
        loopback.build_cudart(source_dir=src)
    assert "broken on purpose" in str(info.value)
    assert "cudart/mem.c" in str(info.value)
    assert not any(p.name.startswith(".cudart-") and p.is_dir() for p in cache.iterdir())


def test_build_without_nccl_sources(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_build, "SOURCE_DIR", make_sources(tmp_path / "src", with_nccl=False))
    with pytest.raises(loopback.LoopbackBuildError, match=r"no nccl/\*\.c sources"):
        loopback.build()


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, (2, 32, 3)),
        ("2.18.1", (2, 18, 1)),
        (" 2.32.3 ", (2, 32, 3)),
        ((2, 18, 0), (2, 18, 0)),
        ([2, 32, 99], (2, 32, 99)),
        ("2.25.1", (2, 25, 1)),
    ],
)
def test_version_accepted(given: object, expected: tuple[int, int, int]) -> None:
    assert loopback.parse_version(given) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "given", ["2.17.9", "2.33.0", (3, 0, 0), (2, 14, 3), "2.18", "2.x.1", (2, 18), (2, 18, -1)]
)
def test_version_refused(given: object) -> None:
    with pytest.raises(ValueError, match="NCCL version") as info:
        loopback.parse_version(given)  # type: ignore[arg-type]
    assert repr(given) in str(info.value)


@pytest.mark.parametrize("given", [2.18, 21801, b"2.18.1"])
def test_version_wrong_type(given: object) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        loopback.parse_version(given)  # type: ignore[arg-type]
    assert repr(given) in str(info.value)


# ---- linking, use(), env(), the CLI --------------------------------------------


def test_every_nccl_build_shares_one_cudart(fake_package: Path) -> None:
    b18 = loopback.build("2.18.1")
    b32 = loopback.build((2, 32, 3), null=True)
    assert b18.cudart == b32.cudart
    nccl, cudart = b18  # unpacks as (nccl, cudart)
    assert (nccl, cudart) == (b18.nccl, b18.cudart)
    code = f"""
        import ctypes
        cudart = ctypes.CDLL({b18.cudart!r})
        a, b = ctypes.CDLL({b18.nccl!r}), ctypes.CDLL({b32.nccl!r})
        assert cudart.cudaSetDevice(3) == 0
        v = ctypes.c_int()
        a.ncclGetVersion(ctypes.byref(v)); va = v.value
        b.ncclGetVersion(ctypes.byref(v)); vb = v.value
        print(va, vb, a.lb_test_null(), b.lb_test_null(),
              a.lb_test_current_device(), b.lb_test_current_device())
        """
    out = run_python(code)
    # Both libnccls see the device set through the cudart loaded by path: one instance.
    assert out.stdout.split() == ["21801", "23203", "0", "1", "3", "3"], out.stderr
    readelf = shutil.which("readelf")
    if readelf is not None:
        dyn = subprocess.run(
            [readelf, "-d", b18.nccl], capture_output=True, text=True, check=True
        ).stdout
        assert "Library soname: [libnccl.so.2]" in dyn
        assert f"Shared library: [{loopback.CUDART_SONAME}]" in dyn
        assert os.path.dirname(b18.cudart) in dyn  # RUNPATH to that exact cudart


def test_use_sets_the_environment_and_swaps_loaded_libraries(fake_package: Path) -> None:
    code = f"""
        import os
        from pynccl.testing.loopback import _build
        _build.SOURCE_DIR = _build.Path({str(fake_package)!r})
        from pynccl.testing import loopback
        b = loopback.use()
        assert os.environ["PYNCCL_NCCL_LIBRARY"] == b.nccl
        assert os.environ["PYNCCL_CUDART_LIBRARY"] == b.cudart
        from pynccl import library
        first = library.load_library()
        assert first.path == b.nccl, (first.path, b.nccl)
        assert library.load_cudart().path == b.cudart
        b18 = loopback.use("2.18.1")
        nccl, cudart = library.loaded()
        assert nccl.path == b18.nccl and cudart.path == b.cudart
        print(tuple(first.version), tuple(nccl.version))
        """
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "(2, 32, 3) (2, 18, 1)"


def test_use_refuses_sanitized_builds_without_asan(fake_package: Path) -> None:
    with pytest.raises(loopback.LoopbackBuildError, match="env\\(sanitize=True\\)"):
        loopback.use(sanitize=True)


def test_env_for_child_processes(fake_package: Path) -> None:
    plain = loopback.env("2.20.3")
    assert set(plain) == {"PYNCCL_NCCL_LIBRARY", "PYNCCL_CUDART_LIBRARY"}
    assert all(os.path.isfile(p) for p in plain.values())
    try:
        sanitized = loopback.env(sanitize=True)
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"no sanitizer toolchain: {exc}")
    assert "libasan" in sanitized["LD_PRELOAD"].split()[0]
    assert os.path.isfile(sanitized["LD_PRELOAD"].split()[0])
    assert "detect_leaks=0" in sanitized["ASAN_OPTIONS"]
    assert sanitized["PYNCCL_NCCL_LIBRARY"] != plain["PYNCCL_NCCL_LIBRARY"]
    code = """
        import ctypes, os
        lib = ctypes.CDLL(os.environ["PYNCCL_NCCL_LIBRARY"])
        v = ctypes.c_int()
        lib.ncclGetVersion(ctypes.byref(v))
        print(v.value)
        """
    out = run_python(code, sanitized)
    assert out.returncode == 0 and out.stdout.strip() == "23203", out.stderr[-3000:]


def test_cli_prints_paths_and_exports(
    fake_package: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([]) == 0
    nccl, cudart = capsys.readouterr().out.split()
    assert (nccl, cudart) == tuple(loopback.build())
    assert cli.main(["--export", "--nccl-version", "2.19.3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("=")[0] for line in lines] == [
        "export PYNCCL_NCCL_LIBRARY",
        "export PYNCCL_CUDART_LIBRARY",
    ]
    assert cli.main(["--nccl-version", "2.1.0"]) == 1
    assert "'2.1.0'" in capsys.readouterr().err


# ---- the C tree ----------------------------------------------------------------------

#: The cudart files bottom to top, as core.c's header comment lists them.
CUDART_ORDER = ("core", "stream", "capture", "graph", "event", "mem", "api", "init")


def _c_code(text: str) -> str:
    """C source without comments, string and character literals."""
    return re.sub(
        r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
        lambda m: "\n" * m.group(0).count("\n") if m.group(0).startswith("/") else '""',
        text,
        flags=re.S,
    )


def _shared_symbols(code: str) -> set[str]:
    """Functions and variables a file defines for the others (not ``static``)."""
    names = set()
    for m in re.finditer(
        r"^(?!static\b)([A-Za-z_][\w \t*]*?)\b(\w+)\s*\(([^;{]*?)\)\s*\{", code, re.M
    ):
        if not m.group(1).strip().startswith(("return", "else", "if", "while", "for")):
            names.add(m.group(2))
    names = {n for n in names if not n.startswith("__")}
    for m in re.finditer(
        r"^LB_HIDDEN\s+[^;(]*?\b(\w+)\s*(?:\[[^\]]*\])?\s*(?:=[^;]*)?;", code, re.M
    ):
        names.add(m.group(1))
    return names


def call_graph(root: Path, lib: str) -> dict[str, set[str]]:
    """file stem -> the stems of the other ``lib/*.c`` files whose symbols it uses."""
    codes = {f.stem: _c_code(f.read_text()) for f in sorted((root / lib).glob("*.c"))}
    defined = {stem: _shared_symbols(code) for stem, code in codes.items()}
    owner = {name: stem for stem, names in defined.items() for name in names}
    graph: dict[str, set[str]] = {}
    for stem, code in codes.items():
        used = set(re.findall(r"\b\w+\b", code))
        graph[stem] = {owner[n] for n in used if n in owner and owner[n] != stem}
    return graph


def _listed_order(core: Path) -> list[str]:
    """The files named in core.c's "Files, bottom to top" paragraph, in order."""
    order = re.search(r"Files, bottom to top.*?\n \*(?:/|\n)", core.read_text(), re.S)
    assert order is not None
    return re.findall(r"\b(\w+)\.c\b", order.group(0))


def test_cudart_files_form_a_dag_with_core_at_the_bottom() -> None:
    graph = call_graph(loopback.SOURCE_DIR, "cudart")
    assert sorted(graph) == sorted(CUDART_ORDER)
    core = _shared_symbols(_c_code((loopback.SOURCE_DIR / "cudart" / "core.c").read_text()))
    assert {"lb_fail", "g_ndev", "cudaGetErrorName", "ptrset_add"} <= core  # the parser sees them
    assert graph["core"] == set()
    assert graph["init"] >= {"core", "stream", "capture", "graph", "event", "mem", "api"}
    for stem, deps in graph.items():
        below = set(CUDART_ORDER[: CUDART_ORDER.index(stem)])
        assert deps <= below, f"cudart/{stem}.c uses {sorted(deps - below)}, above it"
    assert _listed_order(loopback.SOURCE_DIR / "cudart" / "core.c") == list(CUDART_ORDER)


#: The nccl files bottom to top, as nccl/core.c's header comment lists them.
NCCL_ORDER = (
    "core", "reduce", "debug", "crypto", "param", "config", "sync", "initwait", "world",
    "ras_fmt", "ras",
    "exec", "p2p", "window", "comm", "group", "gjob", "teardown", "init", "fault", "suspend",
    "redop", "props", "signal", "winreg", "launch", "enqueue",
)  # fmt: skip
#: The one cycle allowed (as in NCCL): a comm made in a group waits for the group's end,
#: and a group item holds a reference to its comm.
NCCL_CYCLE = ("comm", "group")


def test_nccl_files_form_a_dag_but_for_comm_and_group() -> None:
    graph = call_graph(loopback.SOURCE_DIR, "nccl")
    assert sorted(graph) == sorted(NCCL_ORDER)
    core = _shared_symbols(_c_code((loopback.SOURCE_DIR / "nccl" / "core.c").read_text()))
    assert {"lb_err", "lb_set_error", "ncclGetErrorString", "lb_kind", "lb_span_bytes"} <= core
    assert graph["core"] == set()
    assert graph["enqueue"] >= {"core", "comm", "group", "launch"}
    lower, upper = NCCL_CYCLE
    assert upper in graph[lower] and lower in graph[upper]  # the cycle is real and listed
    for stem, deps in graph.items():
        below = set(NCCL_ORDER[: NCCL_ORDER.index(stem)])
        allowed = below | ({upper} if stem == lower else set())
        assert deps <= allowed, f"nccl/{stem}.c uses {sorted(deps - allowed)}, above it"
    assert _listed_order(loopback.SOURCE_DIR / "nccl" / "core.c") == list(NCCL_ORDER)


def test_the_dag_check_catches_a_back_edge(tmp_path: Path) -> None:
    """The parser sees a call from a lower file into a higher one (not a test that cannot fail)."""
    shutil.copytree(loopback.SOURCE_DIR / "nccl", tmp_path / "nccl")
    assert "launch" not in call_graph(tmp_path, "nccl")["core"]
    with open(tmp_path / "nccl" / "core.c", "a") as f:
        f.write("\nstatic void lb_back_edge(void) { (void)lb_enqueue_task; }\n")
    assert "launch" in call_graph(tmp_path, "nccl")["core"]
