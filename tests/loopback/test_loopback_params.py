"""The parameter API (ncclParam*, NCCL 2.30.3+) of the loopback libnccl, raw ctypes.

Before any communicator exists NCCL 2.32.3 serves 7 parameters (the debug subsystem's),
each with its type, default, value string and native bytes. The same probe runs in a
child process against the loopback and, when the nvidia-nccl wheel is installed, the
real libnccl (it needs no GPU for this), under the default environment and a set one;
the two must agree. The expected values are also written out here from NCCL's
documentation of these variables, independently of both libraries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

KEYS = [
    "NCCL_DEBUG_FILE",
    "NCCL_DEBUG_TIMESTAMP_FORMAT",
    "NCCL_DEBUG_TIMESTAMP_LEVELS",
    "NCCL_SET_THREAD_NAME",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_DEBUG_LEVELS",
    "NCCL_DEBUG",
]
SET_ENV = {
    "NCCL_DEBUG": "WARN",
    "NCCL_SET_THREAD_NAME": "1",
    "NCCL_DEBUG_SUBSYS": "^INIT,COLL",
    "NCCL_DEBUG_TIMESTAMP_LEVELS": "ALL",
    "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p",
}

PROBE = textwrap.dedent(
    """
    import ctypes, json, sys
    from ctypes import POINTER, byref, c_char_p, c_int, c_void_p, create_string_buffer
    L = ctypes.CDLL(sys.argv[1])
    out = {}
    table, n = POINTER(c_char_p)(), c_int()
    out["all_rc"] = L.ncclParamGetAllParameterKeys(byref(table), byref(n))
    keys = [table[i].decode() for i in range(n.value)]
    out["keys"] = keys
    getters = {"I8": ctypes.c_int8, "I16": ctypes.c_int16, "I32": ctypes.c_int32,
               "I64": ctypes.c_int64, "U8": ctypes.c_uint8, "U16": ctypes.c_uint16,
               "U32": ctypes.c_uint32, "U64": ctypes.c_uint64}
    L.ncclParamGetParameter.argtypes = [c_char_p, POINTER(c_char_p), POINTER(c_int)]
    vals = {}
    for k in keys + ["NCCL_NO_SUCH_PARAMETER"]:
        v, ln = c_char_p(), c_int()
        rc = L.ncclParamGetParameter(k.encode(), byref(v), byref(ln))
        h = c_void_p()
        brc = L.ncclParamBind(byref(h), k.encode())
        entry = {"rc": rc, "value": v.value.decode() if rc == 0 else None,
                 "len": ln.value if rc == 0 else None, "bind": brc}
        if brc == 0:
            typed = {}
            for name, t in getters.items():
                o = t()
                if getattr(L, "ncclParamGet" + name)(h, byref(o)) == 0:
                    typed[name] = o.value
            entry["typed"] = typed
            s = c_char_p()
            entry["str_rc"] = L.ncclParamGetStr(h, byref(s))
            entry["str"] = s.value.decode() if entry["str_rc"] == 0 else None
            buf, ln2 = create_string_buffer(64), c_int()
            entry["raw_rc"] = L.ncclParamGet(h, buf, 64, byref(ln2))
            entry["raw"] = buf.raw[: ln2.value].hex()
            entry["short_rc"] = L.ncclParamGet(h, buf, 0, byref(ln2))
        vals[k] = entry
    out["values"] = vals
    o = ctypes.c_uint64()
    out["null"] = [L.ncclParamBind(None, b"NCCL_DEBUG"), L.ncclParamBind(byref(c_void_p()), None),
                   L.ncclParamGetAllParameterKeys(None, byref(n)),
                   L.ncclParamGetParameter(b"NCCL_DEBUG", None, byref(n)),
                   L.ncclParamGetU64(None, byref(o))]
    sys.stdout.flush()
    L.ncclParamDumpAll()
    sys.stdout.flush()
    print("\\nJSON " + json.dumps(out))
    """
)


def _probe(lib_path: str, env: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    child = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "PYNCCL_"))}
    child.update(NCCL_SOCKET_IFNAME="lo", **env)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, lib_path],
        env=child,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    data = json.loads(next(x for x in lines if x.startswith("JSON "))[5:])
    dump = [x for x in lines if not x.startswith("JSON ")]
    return data, dump


def _wheel_lib() -> str | None:
    for entry in sys.path:
        p = Path(entry or ".") / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if p.exists():
            return str(p)
    return None


@pytest.fixture(scope="module")
def loopback_nccl() -> str:
    from pynccl.testing import loopback

    try:
        return loopback.build().nccl
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"cannot build the loopback libraries: {exc}")


def _current(dump: list[str]) -> dict[str, str]:
    """{key: 'Current value=... set_by=... default=...'} from ncclParamDumpAll's output."""
    out: dict[str, str] = {}
    key = None
    for line in dump:
        if line.startswith("NCCL_"):
            key = line.split()[0] + " " + line.split()[1]  # name and (type)
        elif line.strip().startswith("Current value=") and key:
            out[key] = line.strip()
    return out


def test_defaults_as_nccl_documents_them(loopback_nccl: str) -> None:
    data, dump = _probe(loopback_nccl, {})
    assert data["all_rc"] == 0 and data["keys"] == KEYS
    v = data["values"]
    assert v["NCCL_DEBUG_SUBSYS"]["value"] == "INIT,ENV,BOOTSTRAP"
    assert v["NCCL_DEBUG_SUBSYS"]["typed"] == {"U64": 1 | 128 | 4096}
    assert v["NCCL_DEBUG_TIMESTAMP_LEVELS"]["value"] == "WARN,ATTN"
    assert v["NCCL_DEBUG_TIMESTAMP_LEVELS"]["typed"] == {"U32": (1 << 2) | (1 << 6)}
    assert v["NCCL_DEBUG_TIMESTAMP_FORMAT"]["str"] == "[%F %T] "
    assert v["NCCL_DEBUG_TIMESTAMP_FORMAT"]["raw"] == b"[%F %T] \0".hex()
    assert v["NCCL_SET_THREAD_NAME"] | {"typed": {}} == v["NCCL_SET_THREAD_NAME"]
    assert (
        v["NCCL_SET_THREAD_NAME"]["value"] == "FALSE" and v["NCCL_SET_THREAD_NAME"]["raw"] == "00"
    )
    assert v["NCCL_DEBUG"]["value"] == "<unknown>" and v["NCCL_DEBUG"]["raw"] == "00000000"
    assert v["NCCL_DEBUG_FILE"]["value"] == "" and v["NCCL_DEBUG_FILE"]["len"] == 0
    assert v["NCCL_NO_SUCH_PARAMETER"]["rc"] == 4 and v["NCCL_NO_SUCH_PARAMETER"]["bind"] == 4
    for k in KEYS:  # strings only through GetStr, and a 0-byte buffer holds nothing
        assert (v[k]["str_rc"] == 0) == (k in ("NCCL_DEBUG_FILE", "NCCL_DEBUG_TIMESTAMP_FORMAT"))
        assert v[k]["short_rc"] == 4
    assert data["null"] == [4] * 5
    assert dump[0] == "=== ncclParam Registry Dump ==="
    cur = _current(dump)
    assert cur["NCCL_DEBUG_SUBSYS (uint64_t)"] == (
        "Current value=INIT,ENV,BOOTSTRAP set_by=Default default=INIT,ENV,BOOTSTRAP"
    )


def test_environment_values(loopback_nccl: str) -> None:
    data, dump = _probe(loopback_nccl, SET_ENV)
    v = data["values"]
    assert v["NCCL_DEBUG"]["value"] == "WARN" and v["NCCL_DEBUG"]["raw"] == "02000000"
    assert v["NCCL_SET_THREAD_NAME"]["value"] == "TRUE" and v["NCCL_SET_THREAD_NAME"]["raw"] == "01"
    assert v["NCCL_DEBUG_SUBSYS"]["typed"] == {"U64": (1 << 64) - 1 - 3}  # all but INIT, COLL
    assert v["NCCL_DEBUG_TIMESTAMP_LEVELS"]["value"] == "ALL"
    assert v["NCCL_DEBUG_FILE"]["str"] == "/tmp/nccl.%h.%p"
    cur = _current(dump)
    assert cur["NCCL_DEBUG (ncclDebugLogLevel)"] == (
        "Current value=WARN set_by=EnvPlugin default=<unknown>"
    )
    # a malformed value falls back to the default
    data, _ = _probe(loopback_nccl, {"NCCL_DEBUG_SUBSYS": "NOT_A_SUBSYSTEM"})
    assert data["values"]["NCCL_DEBUG_SUBSYS"]["value"] == "INIT,ENV,BOOTSTRAP"


@pytest.mark.parametrize("env", [{}, SET_ENV], ids=["defaults", "environment"])
def test_matches_the_real_libnccl(loopback_nccl: str, env: dict[str, str]) -> None:
    real = _wheel_lib()
    if real is None:
        pytest.skip("nvidia-nccl wheel not installed")
    ours, our_dump = _probe(loopback_nccl, env)
    theirs, their_dump = _probe(real, env)
    assert ours == theirs
    assert _current(our_dump) == _current(their_dump)
