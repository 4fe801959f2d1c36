"""The binding against the real libnccl of the nvidia-nccl wheel, on a machine without a GPU.

Each test runs in a fresh interpreter: ncclGetUniqueId starts a listener thread
and a loaded libnccl never unloads, so neither may outlive the test. Expected
values come from nccl.h and from NCCL's documented behaviour, not from pynccl.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.child import last_json, run_python


def _wheel_dir() -> Path | None:
    for entry in sys.path:
        p = Path(entry or ".") / "nvidia" / "nccl"
        if (p / "lib" / "libnccl.so.2").exists():
            return p
    return None


WHEEL = _wheel_dir()
HAS_DRIVER = os.path.exists("/proc/driver/nvidia/version")
pytestmark = pytest.mark.skipif(WHEEL is None, reason="nvidia-nccl wheel not installed")


def header_version() -> tuple[int, int, int]:
    assert WHEEL is not None
    text = (WHEEL / "include" / "nccl.h").read_text()
    parts = [
        int(re.search(rf"#define NCCL_{k}\s+(\d+)", text).group(1))  # type: ignore[union-attr]
        for k in ("MAJOR", "MINOR", "PATCH")
    ]
    return parts[0], parts[1], parts[2]


def run_child(code: str, **env: str) -> Any:
    assert WHEEL is not None
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYNCCL_", "NCCL_"))}
    child_env.update(
        PYTHONPATH=str(ROOT),
        NCCL_SOCKET_IFNAME="lo",
        PYNCCL_NCCL_LIBRARY=str(WHEEL / "lib" / "libnccl.so.2"),
    )
    child_env.update(env)
    prelude = "import ctypes, json\nfrom ctypes import byref, c_int, c_char_p, c_void_p, POINTER\n"
    return last_json(run_python(["-c", prelude + textwrap.dedent(code)], child_env))


def test_version_matches_header() -> None:
    out = run_child(
        """
        from pynccl import library
        L = library.lib()
        print(json.dumps([list(library.version()), L.version_code, L.rule]))
        """
    )
    version, code, rule = out
    major, minor, patch = header_version()
    assert tuple(version) == (major, minor, patch) == (2, 32, 3)
    assert code == major * 10000 + minor * 100 + patch  # NCCL_VERSION(X,Y,Z) for 2.9+
    assert rule == "env:PYNCCL_NCCL_LIBRARY"


def test_get_unique_id() -> None:
    out = run_child(
        """
        from pynccl import library
        from pynccl._capi.structs import ncclUniqueId
        L = library.lib()
        ids = []
        for _ in range(2):
            u = ncclUniqueId()
            L.ncclGetUniqueId(byref(u))
            ids.append(bytes(u).hex())
        print(json.dumps([ctypes.sizeof(ncclUniqueId), ids]))
        """
    )
    size, (a, b) = out
    a_bytes, b_bytes = bytes.fromhex(a), bytes.fromhex(b)
    assert size == 128 == len(a_bytes) == len(b_bytes)  # NCCL_UNIQUE_ID_BYTES
    assert a_bytes != b_bytes
    assert a_bytes[:8] != b_bytes[:8]  # a fresh random magic each call
    # Then the root's listening sockaddr: with NCCL_SOCKET_IFNAME=lo, the loopback address.
    family = int.from_bytes(a_bytes[8:10], "little")
    assert family in (2, 10)  # AF_INET / AF_INET6
    if family == 2:
        assert a_bytes[12:16] == bytes([127, 0, 0, 1])
    assert any(a_bytes[8:36])


# Words that nccl.h's comments / NCCL's documentation use for each ncclResult_t.
EXPECTED_ERROR_WORDS = {
    0: "no error",
    1: "cuda",
    2: "system",
    3: "internal",
    4: "invalid argument",
    5: "invalid usage",
    6: "remote",
    7: "in progress",
    8: "timeout",
}


def test_error_string_for_every_result() -> None:
    out = run_child(
        """
        from pynccl import library
        from pynccl.enums import Result
        L = library.lib()
        print(json.dumps({int(r): L.ncclGetErrorString(r) for r in list(Result) + [9, 1000]}))
        """
    )
    texts = {int(k): v for k, v in out.items()}
    for code, word in EXPECTED_ERROR_WORDS.items():
        assert word in texts[code].lower(), (code, texts[code])
    known = [texts[c] for c in EXPECTED_ERROR_WORDS]
    assert len(set(known)) == len(known)
    assert texts[9] == texts[1000] == "unknown result code"


def test_parameter_api() -> None:
    out = run_child(
        """
        from pynccl import library
        L = library.lib()
        table = POINTER(c_char_p)()
        n = c_int()
        L.ncclParamGetAllParameterKeys(byref(table), byref(n))
        keys = [table[i].decode() for i in range(n.value)]
        value, length = c_char_p(), c_int()
        L.ncclParamGetParameter(b"NCCL_DEBUG_SUBSYS", byref(value), byref(length))
        # The handle API reads a string-typed parameter as a string.
        h = c_void_p()
        L.ncclParamBind(byref(h), b"NCCL_DEBUG_TIMESTAMP_FORMAT")
        s = c_char_p()
        L.ncclParamGetStr(h, byref(s))
        print(json.dumps({"keys": keys, "value": value.value.decode(), "len": length.value,
                          "bound": s.value.decode()}))
        """,
        NCCL_DEBUG_SUBSYS="COLL,P2P",
        NCCL_DEBUG_TIMESTAMP_FORMAT="%H:%M ",
    )
    assert "NCCL_DEBUG_SUBSYS" in out["keys"]
    assert len(out["keys"]) == len(set(out["keys"]))
    assert all(k.startswith("NCCL_") for k in out["keys"])
    assert out["value"] == "COLL,P2P"  # taken from the environment
    assert out["bound"] == "%H:%M "
    assert out["len"] == len("COLL,P2P")


def test_unknown_parameter_raises() -> None:
    out = run_child(
        """
        from pynccl import library
        from pynccl.errors import NcclError
        L = library.lib()
        value, length = c_char_p(), c_int()
        try:
            L.ncclParamGetParameter(b"PYNCCL_NO_SUCH_PARAMETER", byref(value), byref(length))
        except NcclError as e:
            print(json.dumps([type(e).__name__, int(e.result), e.function]))
        else:
            print(json.dumps(None))
        """
    )
    assert out is not None
    name, result, function = out
    assert function == "ncclParamGetParameter"
    assert result != 0 and name.startswith("Nccl")


@pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver")
def test_comm_init_without_gpu_raises_unhandled_cuda_error() -> None:
    out = run_child(
        """
        from pynccl import library
        from pynccl.errors import NcclError, NcclUnhandledCudaError
        from pynccl._capi.structs import ncclUniqueId
        L = library.lib()
        u = ncclUniqueId()
        L.ncclGetUniqueId(byref(u))
        comm = c_void_p()
        try:
            L.ncclCommInitRank(byref(comm), 1, u, 0)
        except NcclError as e:
            last = L.raw("ncclGetLastError")(None).decode()
            print(json.dumps({"type": type(e).__name__,
                              "is_unhandled": isinstance(e, NcclUnhandledCudaError),
                              "result": int(e.result), "function": e.function,
                              "message": str(e), "last": last, "comm": comm.value}))
        else:
            print(json.dumps(None))
        """
    )
    assert out is not None, "ncclCommInitRank succeeded without a GPU"
    assert out["is_unhandled"] and out["type"] == "NcclUnhandledCudaError"
    assert out["result"] == 1  # ncclUnhandledCudaError in nccl.h
    assert out["function"] == "ncclCommInitRank"
    assert out["last"]  # NCCL logged why ...
    assert out["last"] in out["message"]  # ... and the exception carries it
    assert "driver" in out["last"].lower()  # cudaErrorInsufficientDriver's text
    assert not out["comm"]


def test_info_reports_parameters_from_environment() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYNCCL_", "NCCL_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        NCCL_SOCKET_IFNAME="lo",
        NCCL_DEBUG_SUBSYS="INIT,NET",
    )
    proc = run_python(["-m", "pynccl", "info", "--json"], env)
    report = json.loads(proc.stdout)
    params = report["nccl_parameters"]
    assert params["supported"] is True
    assert params["values"]["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert report["environment"]["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert report["nccl"]["version"] == ".".join(map(str, header_version()))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_DRIVER, reason="needs an NVIDIA GPU")
def test_single_rank_communicator_on_gpu() -> None:
    out = run_child(
        """
        from pynccl import cuda, library
        from pynccl._capi.structs import ncclUniqueId
        L = library.lib()
        cuda.set_device(0)
        u = ncclUniqueId()
        L.ncclGetUniqueId(byref(u))
        comm = c_void_p()
        L.ncclCommInitRank(byref(comm), 1, u, 0)
        n, dev, rank = c_int(), c_int(), c_int()
        L.ncclCommCount(comm, byref(n))
        L.ncclCommCuDevice(comm, byref(dev))
        L.ncclCommUserRank(comm, byref(rank))
        L.ncclCommFinalize(comm)
        L.ncclCommDestroy(comm)
        print(json.dumps([n.value, dev.value, rank.value]))
        """
    )
    assert out == [1, 0, 0]
