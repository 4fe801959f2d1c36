"""ABI conformance of pynccl's ctypes layer against the real nccl.h (nvidia-nccl wheel).

* prototypes: every entry of the NCCL table vs the header's declaration (parsed
  here in Python: name, argument count, each argument's C type vs its ctypes
  type), the first release of each, and that the real libnccl exports them;
  the libcudart table likewise vs ``cuda_runtime_api.h`` (via the preprocessor);
* enum values, struct sizes, alignments, field offsets and the
  ``NCCL_*_INITIALIZER`` values: from a C probe generated and compiled here.

Skips (with the reason) where the header, the CUDA headers or a C compiler is missing.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT

from pynccl._capi import structs
from pynccl._capi.cudart import CUDART_PROTOTYPES
from pynccl._capi.nccl import PROTOTYPES
from pynccl._capi.nccl_device import (
    DEVICE_PROTOTYPES,
    VALUE_RESULTS,
    make_comm_properties,
    ncclCommProperties_t,
    ncclMultimemHandle_t,
    ncclTeam_t,
)
from pynccl.enums import (
    WIN_REQUIRED_ALIGNMENT,
    CTAPolicy,
    DataType,
    EncryptionMode,
    MemStat,
    RedOp,
    Result,
    RevokeFlag,
    ScalarResidence,
    ShrinkFlag,
    SuspendFlag,
    WinFlag,
)


def _wheel_include() -> Path | None:
    for entry in sys.path:
        p = Path(entry or ".") / "nvidia" / "nccl" / "include"
        if (p / "nccl.h").exists():
            return p
    return None


def _cuda_include() -> Path | None:
    homes = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    for home in homes:
        if home and (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    return None


NCCL_INCLUDE = _wheel_include()
CUDA_INCLUDE = _cuda_include()
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")

needs_header = pytest.mark.skipif(NCCL_INCLUDE is None, reason="no nccl.h (nvidia-nccl wheel)")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")

# First NCCL release exporting each function of nccl.h 2.32.3 (from NCCL's release
# tags and the PyPI wheels; see nccl-abi.md in the project's shared docs).
FIRST_RELEASE: dict[str, tuple[int, int, int]] = {
    "ncclMemAlloc": (2, 19, 1),
    "ncclMemFree": (2, 19, 1),
    "ncclGetVersion": (2, 3, 5),
    "ncclGetUniqueId": (2, 3, 5),
    "ncclCommInitRankConfig": (2, 14, 3),
    "ncclCommInitRank": (2, 3, 5),
    "ncclCommInitAll": (2, 3, 5),
    "ncclCommFinalize": (2, 14, 3),
    "ncclCommDestroy": (2, 3, 5),
    "ncclCommAbort": (2, 4, 2),
    "ncclCommRevoke": (2, 28, 7),
    "ncclCommSplit": (2, 18, 1),
    "ncclCommShrink": (2, 27, 3),
    "ncclCommGetUniqueId": (2, 29, 2),
    "ncclCommGrow": (2, 29, 2),
    "ncclCommInitRankScalable": (2, 23, 4),
    "ncclGetErrorString": (2, 3, 5),
    "ncclGetLastError": (2, 13, 4),
    "ncclResetDebugInit": (2, 24, 3),
    "ncclCommGetAsyncError": (2, 4, 2),
    "ncclCommCount": (2, 3, 5),
    "ncclCommCuDevice": (2, 3, 5),
    "ncclCommUserRank": (2, 3, 5),
    "ncclCommRegister": (2, 19, 1),
    "ncclCommDeregister": (2, 19, 1),
    "ncclCommSuspend": (2, 29, 7),
    "ncclCommResume": (2, 29, 7),
    "ncclCommMemStats": (2, 29, 7),
    "ncclCommWindowRegister": (2, 27, 3),
    "ncclCommWindowDeregister": (2, 27, 3),
    "ncclWinGetUserPtr": (2, 29, 2),
    "ncclRedOpCreatePreMulSum": (2, 11, 4),
    "ncclRedOpDestroy": (2, 11, 4),
    "ncclReduce": (2, 3, 5),
    "ncclBcast": (2, 3, 5),
    "ncclBroadcast": (2, 3, 5),
    "ncclAllReduce": (2, 3, 5),
    "ncclReduceScatter": (2, 3, 5),
    "ncclAllGather": (2, 3, 5),
    "ncclAlltoAll": (2, 28, 3),
    "ncclGather": (2, 28, 3),
    "ncclScatter": (2, 28, 3),
    "ncclAllReduceConfig": (2, 31, 2),
    "ncclBroadcastConfig": (2, 31, 2),
    "ncclReduceConfig": (2, 31, 2),
    "ncclAllGatherConfig": (2, 31, 2),
    "ncclReduceScatterConfig": (2, 31, 2),
    "ncclAlltoAllConfig": (2, 31, 2),
    "ncclGatherConfig": (2, 31, 2),
    "ncclScatterConfig": (2, 31, 2),
    "ncclPutSignal": (2, 29, 2),
    "ncclSignal": (2, 29, 2),
    "ncclWaitSignal": (2, 29, 2),
    "ncclSetEncryption": (2, 32, 3),
    "ncclParamBind": (2, 30, 3),
    "ncclParamGetI8": (2, 30, 3),
    "ncclParamGetI16": (2, 30, 3),
    "ncclParamGetI32": (2, 30, 3),
    "ncclParamGetI64": (2, 30, 3),
    "ncclParamGetU8": (2, 30, 3),
    "ncclParamGetU16": (2, 30, 3),
    "ncclParamGetU32": (2, 30, 3),
    "ncclParamGetU64": (2, 30, 3),
    "ncclParamGetStr": (2, 30, 3),
    "ncclParamGet": (2, 30, 3),
    "ncclParamGetParameter": (2, 30, 3),
    "ncclParamGetAllParameterKeys": (2, 30, 3),
    "ncclParamDumpAll": (2, 30, 3),
    "ncclSend": (2, 7, 3),
    "ncclRecv": (2, 7, 3),
    "ncclGroupStart": (2, 3, 5),
    "ncclGroupEnd": (2, 3, 5),
    "ncclGroupSimulateEnd": (2, 22, 3),
}


# --- C type text <-> ctypes, compared as ABI shapes --------------------------------------

# (kind, bits) of C scalar types on x86-64 Linux (LP64).
_C_SCALARS = {
    "int": ("int", 32),
    "signed int": ("int", 32),
    "unsigned int": ("uint", 32),
    "unsigned": ("uint", 32),
    "long": ("int", 64),
    "unsigned long": ("uint", 64),
    "long long": ("int", 64),
    "unsigned long long": ("uint", 64),
    "size_t": ("uint", 64),
    "int8_t": ("int", 8),
    "int16_t": ("int", 16),
    "int32_t": ("int", 32),
    "int64_t": ("int", 64),
    "uint8_t": ("uint", 8),
    "uint16_t": ("uint", 16),
    "uint32_t": ("uint", 32),
    "uint64_t": ("uint", 64),
    "float": ("float", 32),
    "double": ("float", 64),
    "char": ("char", 8),
    "void": ("void", 0),
}
_CTYPES_CODES = {
    "b": "int",
    "h": "int",
    "i": "int",
    "l": "int",
    "q": "int",
    "B": "uint",
    "H": "uint",
    "I": "uint",
    "L": "uint",
    "Q": "uint",
    "f": "float",
    "d": "float",
    "c": "char",
}
# Typedefs of cuda_runtime_api.h that nccl.h / our cudart table use.
# cudaHostFn_t is a function pointer: opaque, like the handles.
_CUDA_HANDLES = {"cudaStream_t", "cudaEvent_t", "cudaGraph_t", "cudaGraphExec_t", "cudaHostFn_t"}
_CUDA_ENUMS = {"cudaError_t", "cudaMemcpyKind", "cudaStreamCaptureStatus", "cudaStreamCaptureMode"}

Shape = tuple[Any, int]  # (base, pointer depth)


def ctypes_shape(t: Any) -> Shape:
    """ABI shape of a ctypes type: base kind and pointer depth."""
    if t is None:
        return (("void", 0), 0)
    if t is ctypes.c_void_p:
        return ("opaque", 1)
    if t is ctypes.c_char_p:
        return (("char", 8), 1)
    if isinstance(t, type) and issubclass(t, (ctypes.Structure, ctypes.Union)):
        return (f"struct {t.__name__}", 0)
    if hasattr(t, "_type_") and isinstance(t._type_, type):  # POINTER(x)
        base, depth = ctypes_shape(t._type_)
        return base, depth + 1
    code = getattr(t, "_type_", None)
    if isinstance(code, str) and code in _CTYPES_CODES:
        return ((_CTYPES_CODES[code], 8 * ctypes.sizeof(t)), 0)
    raise AssertionError(f"unexpected ctypes type {t!r}")


class CTypes:
    """What a header says its typedef names are."""

    def __init__(self, handles: set[str], enums: set[str], structs: set[str]) -> None:
        self.handles = handles | _CUDA_HANDLES
        self.enums = enums | _CUDA_ENUMS
        self.structs = structs

    def shape(self, text: str) -> Shape:
        depth = text.count("*")
        words = [
            w
            for w in re.sub(r"[*&]", " ", text).split()
            if w not in ("const", "volatile", "struct", "enum", "__restrict__", "restrict")
        ]
        base = " ".join(words)
        if base in self.handles:
            return ("opaque", depth + 1)
        if base in self.enums:
            return (("int", 32), depth)
        if base in _C_SCALARS:
            return (_C_SCALARS[base], depth)
        if base in self.structs:
            return (f"struct {base}", depth)
        raise AssertionError(f"unknown C type {text!r}")


def shapes_match(ours: Shape, c: Shape) -> bool:
    if ours == c:
        return True
    # c_void_p stands for any object pointer (void*, struct ncclComm*, ...);
    # POINTER(c_void_p) for a pointer to one.
    base, depth = ours
    return base == "opaque" and c[1] == depth and c[0] in ("opaque", ("void", 0))


# --- parsing a header ------------------------------------------------------------------


def strip_c(text: str) -> str:
    """Comments, preprocessor lines (with continuations) and attributes removed."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"\\\n", " ", text)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return re.sub(r"__attribute__\s*\(\(.*?\)\)", " ", text)


_PROTO = re.compile(r"([A-Za-z_][\w\s\*]*?)\b((?:nccl|cuda)\w+)\s*\(([^()]*)\)\s*;")


def parse_prototypes(text: str, prefix: str) -> dict[str, tuple[str, list[str]]]:
    """``name -> (return type, [argument types])`` for functions named ``prefix*``."""
    out: dict[str, tuple[str, list[str]]] = {}
    for m in _PROTO.finditer(text):
        ret, name, args = m.group(1), m.group(2), m.group(3)
        if not name.startswith(prefix):
            continue
        ret = " ".join(w for w in ret.split() if w not in ("extern", "CUDARTAPI"))
        arg_types = []
        for a in (x.strip() for x in args.split(",")):
            if a in ("", "void"):
                continue
            # Drop the parameter name (the last identifier), keep any '*'s.
            t = re.sub(r"\b[A-Za-z_]\w*\s*(\[\s*\w*\s*\])?$", "", a).strip()
            if a.endswith("]"):
                t += "*"
            arg_types.append(t or a)
        out[name] = (ret, arg_types)
    return out


def nccl_header_types(text: str) -> CTypes:
    handles = set(re.findall(r"typedef\s+struct\s+\w+\s*\*\s*(\w+)\s*;", text))
    enums = set(re.findall(r"typedef\s+enum\s*\w*\s*\{[^}]*\}\s*(\w+)\s*;", text, flags=re.S))
    named = set(re.findall(r"typedef\s+struct\s*\w*\s*\{.*?\}\s*(\w+)\s*;", text, flags=re.S))
    return CTypes(handles, enums, named | {"cudaPointerAttributes", "ncclConfigExt_t"})


@pytest.fixture(scope="module")
def nccl_h() -> str:
    if NCCL_INCLUDE is None:
        pytest.skip("no nccl.h (nvidia-nccl wheel)")
    return strip_c((NCCL_INCLUDE / "nccl.h").read_text())


# --- prototypes -------------------------------------------------------------------------


def test_table_covers_the_header(nccl_h: str) -> None:
    header = parse_prototypes(nccl_h, "nccl")
    assert len(header) >= 73  # nccl.h 2.32.3
    assert sorted(set(header) - set(PROTOTYPES)) == []
    assert sorted(set(PROTOTYPES) - set(header)) == []


def test_every_prototype_matches_the_header(nccl_h: str) -> None:
    header = parse_prototypes(nccl_h, "nccl")
    types = nccl_header_types(nccl_h)
    problems = []
    for name, proto in PROTOTYPES.items():
        ret, args = header[name]
        if not shapes_match(ctypes_shape(proto.restype), types.shape(ret)):
            problems.append(f"{name}: returns {ret}, table has {proto.restype}")
        if len(args) != len(proto.args):
            problems.append(f"{name}: {len(args)} arguments in nccl.h, {len(proto.args)} in table")
            continue
        for i, (c_text, (arg_name, ours)) in enumerate(zip(args, proto.args)):
            if not shapes_match(ctypes_shape(ours), types.shape(c_text)):
                problems.append(f"{name} argument {i} ({arg_name}): C {c_text!r}, table {ours}")
    assert problems == []


def test_first_releases() -> None:
    ours = {name: proto.first for name, proto in PROTOTYPES.items()}
    assert ours == FIRST_RELEASE


def _shared_tsv(name: str) -> Path | None:
    for docs in (ROOT.parent / "shared" / "docs", ROOT / "shared" / "docs"):
        if (docs / name).exists():
            return docs / name
    return None


def test_first_releases_vs_shared_table() -> None:
    # The project's fact sheet, where this checkout has it beside it (not in every CI).
    path = _shared_tsv("nccl-first-release.tsv")
    if path is None:
        pytest.skip("shared/docs/nccl-first-release.tsv not beside this checkout")
    expected = {}
    for line in path.read_text().splitlines():
        cols = line.split("\t")
        m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", cols[1]) if len(cols) > 1 else None
        if m and (len(cols) < 3 or not cols[2].strip()):
            expected[cols[0]] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    for name, proto in PROTOTYPES.items():
        assert expected.get(name, proto.first) == proto.first, name


def test_real_library_exports_the_table() -> None:
    if NCCL_INCLUDE is None:
        pytest.skip("no nvidia-nccl wheel")
    lib = NCCL_INCLUDE.parent / "lib" / "libnccl.so.2"
    code = (
        "import ctypes, json, sys\n"
        f"L = ctypes.CDLL({str(lib)!r})\n"
        "print(json.dumps([n for n in json.loads(sys.argv[1]) if not hasattr(L, n)]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(sorted(PROTOTYPES))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


@needs_cc
def test_cudart_table_matches_cuda_runtime_api() -> None:
    if CUDA_INCLUDE is None:
        pytest.skip("no CUDA headers (cuda_runtime_api.h)")
    assert CC is not None
    proc = subprocess.run(
        [CC, "-E", "-P", f"-I{CUDA_INCLUDE}", "-x", "c", "-"],
        input="#include <cuda_runtime_api.h>\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = strip_c(proc.stdout)
    header = parse_prototypes(text, "cuda")
    types = CTypes(set(), set(), {"cudaPointerAttributes"})
    problems = []
    for name, proto in CUDART_PROTOTYPES.items():
        if name not in header:
            problems.append(f"{name}: not declared in cuda_runtime_api.h")
            continue
        ret, args = header[name]
        if not shapes_match(ctypes_shape(proto.restype), types.shape(ret)):
            problems.append(f"{name}: returns {ret}, table has {proto.restype}")
        if len(args) != len(proto.args):
            problems.append(f"{name}: {len(args)} arguments in the header, {len(proto.args)}")
            continue
        for i, (c_text, (arg_name, ours)) in enumerate(zip(args, proto.args)):
            if not shapes_match(ctypes_shape(ours), types.shape(c_text)):
                problems.append(f"{name} argument {i} ({arg_name}): C {c_text!r}, table {ours}")
    assert problems == []


# --- the compiled probe ---------------------------------------------------------------------

STRUCTS: dict[str, str] = {  # ctypes class name -> C type
    "ncclUniqueId": "ncclUniqueId",
    "ncclConfig_t": "ncclConfig_t",
    "ncclCollConfig_t": "ncclCollConfig_t",
    "ncclSimInfo_t": "ncclSimInfo_t",
    "ncclConfigExt_t": "ncclConfigExt_t",
    "ncclWaitSignalDesc_t": "ncclWaitSignalDesc_t",
    "ncclEncryptionConfig_t": "ncclEncryptionConfig_t",
    "cudaPointerAttributes": "struct cudaPointerAttributes",
}
INITIALIZERS = {  # C macro -> (ctypes class, pynccl's maker)
    "NCCL_CONFIG_INITIALIZER": ("ncclConfig_t", structs.make_config),
    "NCCL_COLLCONFIG_INITIALIZER": ("ncclCollConfig_t", structs.make_coll_config),
    "NCCL_SIM_INFO_INITIALIZER": ("ncclSimInfo_t", structs.make_sim_info),
}
SCALAR_RESIDENCE_C = {
    ScalarResidence.DEVICE: "ncclScalarDevice",
    ScalarResidence.HOST_IMMEDIATE: "ncclScalarHostImmediate",
}


def enum_c_names() -> dict[str, int]:
    names: dict[str, int] = {}
    for e in (*Result, *DataType, *RedOp):
        names[e.c_name] = int(e)
    for e in ScalarResidence:
        names[SCALAR_RESIDENCE_C[e]] = int(e)
    return names


def struct_fields(cls: Any, prefix: str = "", base: int = 0) -> list[tuple[str, int, int, Any]]:
    """``(C member designator, offset, size, ctype)`` of every (nested) field."""
    out = []
    for field in cls._fields_:
        name, ftype = field[0], field[1]
        desc = getattr(cls, name)
        path, offset = prefix + name, base + desc.offset
        out.append((path, offset, desc.size, ftype))
        if isinstance(ftype, type) and issubclass(ftype, (ctypes.Structure, ctypes.Union)):
            out += struct_fields(ftype, path + ".", offset)
    return out


def _is_pointer(t: Any) -> bool:
    return t in (ctypes.c_void_p, ctypes.c_char_p) or (
        hasattr(t, "_type_") and isinstance(t._type_, type)
    )


def _is_float(t: Any) -> bool:
    return t in (ctypes.c_float, ctypes.c_double)


def probe_source() -> str:
    lines = [
        "#include <nccl.h>",
        "#include <stddef.h>",
        "#include <stdio.h>",
        '#define E(n) printf("enum %s %lld\\n", #n, (long long)(n));',
        '#define S(py, T) printf("size %s %zu %zu\\n", py, sizeof(T), _Alignof(T));',
        '#define F(py, T, m) printf("field %s %s %zu %zu\\n", py, #m, offsetof(T, m),'
        " sizeof(((T*)0)->m));",
        "int main(void) {",
    ]
    for name in [*enum_c_names(), "ncclNumResults", "ncclNumTypes", "ncclNumOps"]:
        lines.append(f"  E({name})")
    for t in ("ncclResult_t", "ncclDataType_t", "ncclRedOp_t", "ncclScalarResidence_t"):
        lines.append(f'  S("{t}", {t})')
    for t in ("ncclComm_t", "ncclWindow_t", "cudaStream_t"):
        lines.append(f'  S("{t}", {t})')
    for py, c in STRUCTS.items():
        if c.startswith("struct cuda") and CUDA_INCLUDE is None:
            continue
        lines.append(f'  S("{py}", {c})')
        for path, _off, _size, _t in struct_fields(getattr(structs, py)):
            if "[" not in path:
                lines.append(f'  F("{py}", {c}, {path})')
    for macro, (py, _make) in INITIALIZERS.items():
        c = STRUCTS[py]
        lines.append(f"  {{ {c} v = {macro};")
        for path, _off, _size, t in struct_fields(getattr(structs, py)):
            if _is_pointer(t):
                expr, fmt = f"(long long)(v.{path} != NULL)", "%lld"
            elif _is_float(t):
                expr, fmt = f"(double)v.{path}", "%.9g"
            elif hasattr(t, "_length_"):
                continue
            else:
                expr, fmt = f"(long long)v.{path}", "%lld"
            lines.append(f'    printf("init {macro} {path} {fmt}\\n", {expr});')
        lines.append("  }")
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if NCCL_INCLUDE is None:
        pytest.skip("no nccl.h (nvidia-nccl wheel)")
    if CC is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("abi_probe")
    includes = [f"-I{NCCL_INCLUDE}"]
    if CUDA_INCLUDE is not None:
        includes.append(f"-I{CUDA_INCLUDE}")
    else:
        # nccl.h includes these; it uses only size_t, cudaStream_t and cudaEvent_t from
        # them (its bf16/fp8 parts are behind CUDART_VERSION, which stays undefined).
        stub = d / "stub"
        stub.mkdir()
        (stub / "cuda_runtime.h").write_text(
            "#include <stddef.h>\n"
            "typedef struct CUstream_st *cudaStream_t;\n"
            "typedef struct CUevent_st *cudaEvent_t;\n"
        )
        (stub / "cuda_fp16.h").write_text("")
        includes.append(f"-I{stub}")
    src = d / "probe.c"
    src.write_text(probe_source())
    exe = d / "probe"
    cc = subprocess.run(
        [CC, "-std=gnu11", "-Wall", "-Werror", *includes, str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cc.returncode == 0, f"probe did not compile:\n{cc.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True)
    out: dict[str, Any] = {"enum": {}, "size": {}, "field": {}, "init": {}}
    for line in run.stdout.splitlines():
        kind, *rest = line.split()
        if kind == "enum":
            out["enum"][rest[0]] = int(rest[1])
        elif kind == "size":
            out["size"][rest[0]] = (int(rest[1]), int(rest[2]))
        elif kind == "field":
            out["field"][(rest[0], rest[1])] = (int(rest[2]), int(rest[3]))
        else:
            out["init"][(rest[0], rest[1])] = float(rest[2])
    return out


def test_enum_values(probe: dict[str, Any]) -> None:
    assert {k: probe["enum"][k] for k in enum_c_names()} == enum_c_names()
    # Every value the header defines has a member (the counts are the enums' sizes).
    assert probe["enum"]["ncclNumResults"] == len(Result)
    assert probe["enum"]["ncclNumTypes"] == len(DataType)
    assert probe["enum"]["ncclNumOps"] == len(RedOp)
    for t in ("ncclResult_t", "ncclDataType_t", "ncclRedOp_t", "ncclScalarResidence_t"):
        assert probe["size"][t] == (ctypes.sizeof(ctypes.c_int), ctypes.alignment(ctypes.c_int))


def test_handles_are_pointers(probe: dict[str, Any]) -> None:
    for t in ("ncclComm_t", "ncclWindow_t", "cudaStream_t"):
        assert probe["size"][t][0] == ctypes.sizeof(ctypes.c_void_p)


@pytest.mark.parametrize("name", list(STRUCTS))
def test_struct_layout(probe: dict[str, Any], name: str) -> None:
    if name not in probe["size"]:
        pytest.skip(f"{STRUCTS[name]} needs the CUDA headers")
    cls = getattr(structs, name)
    assert probe["size"][name] == (ctypes.sizeof(cls), ctypes.alignment(cls))
    for path, offset, size, _t in struct_fields(cls):
        if "[" in path:
            continue
        assert probe["field"][(name, path)] == (offset, size), path


def test_ncclUniqueId_is_128_bytes(probe: dict[str, Any]) -> None:
    assert probe["size"]["ncclUniqueId"][0] == 128 == ctypes.sizeof(structs.ncclUniqueId)


@pytest.mark.parametrize("macro", list(INITIALIZERS))
def test_initializers(probe: dict[str, Any], macro: str) -> None:
    py, make = INITIALIZERS[macro]
    ours = make()
    checked = 0
    for path, _off, _size, t in struct_fields(getattr(structs, py)):
        key = (macro, path)
        if key not in probe["init"]:
            continue
        value: Any = ours
        for part in path.split("."):
            value = getattr(value, part)
        if _is_pointer(t):
            assert float(bool(value)) == probe["init"][key], path
        else:
            assert float(value) == probe["init"][key], path
        checked += 1
    assert checked == len([f for f in struct_fields(getattr(structs, py)) if "[" not in f[0]])


# --- nccl_device/host.h: the host functions libnccl exports --------------------------------

# Device-side structs the table passes as opaque pointers, and host.h's other type names.
_DEVICE_OPAQUE = {
    "ncclDevComm_t",
    "ncclDevComm",
    "ncclDevCommRequirements_t",
    "ncclDevResourceRequirements_t",
    "ncclDevResourceRequirements",
    "ncclLsaBarrierHandle_t",
    "ncclGinBarrierHandle_t",
    "ncclCftBarrierHandle_t",
    "ncclLLA2AHandle_t",
    "ncclGinOutboxHandle",
    "ncclGinInboxA2AHandle",
}
_DEVICE_ALIASES = {"ncclTeam": "ncclTeam_t", "ncclMultimemHandle": "ncclMultimemHandle_t"}
#: Declared by host.h 2.32.3 but not exported by its libnccl.
_DEVICE_NOT_EXPORTED = {"ncclCftBarrierCreateRequirement"}


def _device_shape(text: str) -> Shape:
    words = [
        _DEVICE_ALIASES.get(w, w)
        for w in re.sub(r"[*&]", " ", text).split()
        if w not in ("const", "struct")
    ]
    base, depth = " ".join(words), text.count("*")
    if base in _DEVICE_OPAQUE:
        return ("opaque", depth)
    if base == "ncclCftLeId":
        return (("uint", 32), depth)
    if base in ("ncclCftTeamMode_t", "ncclGinType_t", "ncclGinConnectionType_t"):
        return (("int", 32), depth)
    if base in ("ncclTeam_t", "ncclMultimemHandle_t", "ncclCommProperties_t"):
        return (f"struct {base}", depth)
    return CTypes({"ncclComm_t", "ncclWindow_t"}, {"ncclResult_t"}, set()).shape(text)


@pytest.fixture(scope="module")
def host_h() -> dict[str, tuple[str, list[str]]]:
    if NCCL_INCLUDE is None or not (NCCL_INCLUDE / "nccl_device" / "host.h").exists():
        pytest.skip("no nccl_device/host.h (nvidia-nccl wheel)")
    text = strip_c((NCCL_INCLUDE / "nccl_device" / "host.h").read_text())
    text = text.replace("NCCL_EXTERN_C", " ")
    text = re.sub(r"\s*=\s*NCCL_CFT_TEAM_FLAT", "", text)  # the C++ default argument
    return parse_prototypes(text, "nccl")


def test_device_table_covers_host_h(host_h: dict[str, tuple[str, list[str]]]) -> None:
    assert sorted(set(host_h) - _DEVICE_NOT_EXPORTED) == sorted(DEVICE_PROTOTYPES)
    assert not set(DEVICE_PROTOTYPES) & set(PROTOTYPES)


def test_every_device_prototype_matches_host_h(host_h: dict[str, tuple[str, list[str]]]) -> None:
    problems = []
    for name, proto in DEVICE_PROTOTYPES.items():
        ret, args = host_h[name]
        if not shapes_match(ctypes_shape(proto.restype), _device_shape(ret)):
            problems.append(f"{name}: returns {ret}, table has {proto.restype}")
        if (proto.restype is ctypes.c_int and ret == "int") != (name in VALUE_RESULTS):
            problems.append(f"{name}: an int result must be listed in VALUE_RESULTS")
        if len(args) != len(proto.args):
            problems.append(f"{name}: {len(args)} arguments in host.h, {len(proto.args)} in table")
            continue
        for i, (c_text, (arg_name, ours)) in enumerate(zip(args, proto.args)):
            if not shapes_match(ctypes_shape(ours), _device_shape(c_text)):
                problems.append(f"{name} argument {i} ({arg_name}): C {c_text!r}, table {ours}")
    assert problems == []


def test_device_first_releases_vs_shared_table() -> None:
    path = _shared_tsv("nccl-first-release.tsv")
    if path is None:
        pytest.skip("shared/docs/nccl-first-release.tsv not beside this checkout")
    expected = {}
    for line in path.read_text().splitlines():
        cols = line.split("\t")
        m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", cols[1]) if len(cols) > 1 else None
        if m:
            expected[cols[0]] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    assert {n: expected.get(n) for n in DEVICE_PROTOTYPES} == {
        n: p.first for n, p in DEVICE_PROTOTYPES.items()
    }


def test_real_library_exports_the_device_table() -> None:
    if NCCL_INCLUDE is None:
        pytest.skip("no nvidia-nccl wheel")
    lib = NCCL_INCLUDE.parent / "lib" / "libnccl.so.2"
    code = (
        "import ctypes, json, sys\n"
        f"L = ctypes.CDLL({str(lib)!r})\n"
        "print(json.dumps([n for n in json.loads(sys.argv[1]) if hasattr(L, n) != "
        "(n in json.loads(sys.argv[2]))]))\n"
    )
    names = sorted({*DEVICE_PROTOTYPES, *_DEVICE_NOT_EXPORTED})
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(names), json.dumps(sorted(DEVICE_PROTOTYPES))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


@needs_cc
def test_device_struct_layouts_and_initializer(tmp_path: Path) -> None:
    if NCCL_INCLUDE is None or CUDA_INCLUDE is None:
        pytest.skip("needs the wheel's headers and the CUDA headers")
    lines = [
        "#include <nccl.h>",
        "#include <nccl_device/host.h>",
        "#include <stddef.h>",
        "#include <stdio.h>",
        "int main(void) {",
        "  ncclCommProperties_t init = NCCL_COMM_PROPERTIES_INITIALIZER;",
        '  printf("init %zu %u %u\\n", init.size, init.magic, init.version);',
    ]
    for cls in (ncclCommProperties_t, ncclTeam_t, ncclMultimemHandle_t):
        c = cls.__name__
        lines.append(f'  printf("size {c} %zu %zu\\n", sizeof({c}), _Alignof({c}));')
        for path, _off, _size, _t in struct_fields(cls):
            lines.append(
                f'  printf("field {c} {path} %zu %zu\\n", offsetof({c}, {path}),'
                f" sizeof((({c}*)0)->{path}));"
            )
    lines += ["  return 0;", "}"]
    src, exe = tmp_path / "device_probe.c", tmp_path / "device_probe"
    src.write_text("\n".join(lines) + "\n")
    cc = subprocess.run(
        [CC, "-std=gnu11", f"-I{NCCL_INCLUDE}", f"-I{CUDA_INCLUDE}", str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cc.returncode == 0, cc.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "init":
            ours = make_comm_properties()
            assert [ours.size, ours.magic, ours.version] == [int(x) for x in rest]
        elif kind == "size":
            cls = {"ncclCommProperties_t": ncclCommProperties_t, "ncclTeam_t": ncclTeam_t}.get(
                rest[0], ncclMultimemHandle_t
            )
            assert (ctypes.sizeof(cls), ctypes.alignment(cls)) == (int(rest[1]), int(rest[2]))
        else:
            c, path, offset, size = rest
            cls = {"ncclCommProperties_t": ncclCommProperties_t, "ncclTeam_t": ncclTeam_t}.get(
                c, ncclMultimemHandle_t
            )
            desc = getattr(cls, path)
            assert (desc.offset, desc.size) == (int(offset), int(size)), f"{c}.{path}"


def test_named_constants_match_nccl_h(nccl_h_raw: str) -> None:
    defines = dict(re.findall(r"#define\s+(NCCL_\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", nccl_h_raw))
    expected = {
        **{f"NCCL_WIN_{m.name}": int(m) for m in WinFlag},
        "NCCL_WIN_REQUIRED_ALIGNMENT": WIN_REQUIRED_ALIGNMENT,
        **{f"NCCL_CTA_POLICY_{m.name}": int(m) for m in CTAPolicy},
        **{f"NCCL_SHRINK_{m.name}": int(m) for m in ShrinkFlag},
        **{f"NCCL_REVOKE_{m.name}": int(m) for m in RevokeFlag},
        **{f"NCCL_SUSPEND_{m.name}": int(m) for m in SuspendFlag},
    }
    assert {k: int(defines[k], 0) for k in expected} == expected
    stats = dict(re.findall(r"ncclStat(\w+)\s*=\s*(\d+)", nccl_h_raw))
    camel = {m: "".join(p.capitalize() for p in m.name.split("_")) for m in MemStat}
    assert {m: int(stats[camel[m]]) for m in MemStat} == {m: int(m) for m in MemStat}
    modes = dict(re.findall(r"NCCL_ENCRYPTION_MODE_(\w+)\s*=\s*(\d+)", nccl_h_raw))
    assert {m.name: int(m) for m in EncryptionMode} == {k: int(v) for k, v in modes.items()}


@pytest.fixture(scope="module")
def nccl_h_raw() -> str:
    if NCCL_INCLUDE is None:
        pytest.skip("no nccl.h (nvidia-nccl wheel)")
    return (NCCL_INCLUDE / "nccl.h").read_text()
