"""The loopback's environment: strict PYNCCL_LOOPBACK_* parsing in both libraries, and
CUDA_VISIBLE_DEVICES as CUDA applies it.

The libcudart reads its variables when it is loaded, so those cases run in a child
process; the libnccl reads its own at each init, so those run here (monkeypatch). The
expected values are written out by hand from the rules (CUDA's documented
CUDA_VISIBLE_DEVICES rule, the README's table), not computed by the code under test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from ctypes import byref, c_void_p
from typing import Any

import numpy as np
import pytest
from support.clib import INVALID_ARG, REMOTE, GroupWorld, Lib

from pynccl.testing import loopback

NO_DEVICE, INVALID_VALUE, INVALID_DEVICE = 100, 1, 101


def _child_env(**extra: str | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYNCCL_LOOPBACK_") and k != "CUDA_VISIBLE_DEVICES"
    }
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


_PROBE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
lib.pynccl_lb_last_error_detail.restype = ctypes.c_char_p
n = ctypes.c_int(-1)
rc = lib.cudaGetDeviceCount(ctypes.byref(n))
detail = lib.pynccl_lb_last_error_detail().decode()
buses, phys = [], []
for d in range(max(n.value, 0)):
    buf = ctypes.create_string_buffer(32)
    assert lib.cudaDeviceGetPCIBusId(buf, 32, d) == 0
    buses.append(buf.value.decode())
    phys.append(lib.pynccl_lb_device_physical(d))
out = {"rc": rc, "count": n.value, "detail": detail, "buses": buses, "phys": phys,
       "set_first": lib.cudaSetDevice(0), "set_past": lib.cudaSetDevice(max(n.value, 0)),
       "phys_past": lib.pynccl_lb_device_physical(max(n.value, 0)),
       "lb_count": lib.pynccl_lb_device_count()}
print(json.dumps(out))
"""


def probe(cudart: str, **env: str | None) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, cudart],
        env=_child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout), proc.stderr


def bus(physical: int) -> str:
    """The loopback's PCI bus id of a physical device (README: bus = device + 1)."""
    return f"0000:{physical + 1:02x}:00.0"


# ---- CUDA_VISIBLE_DEVICES -------------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "physical"),
    [
        (None, [0, 1, 2, 3]),  # unset: every device, in order
        ("2,0", [2, 0]),  # selects and renumbers
        ("3", [3]),
        ("0,2,-1,1", [0, 2]),  # CUDA's own example: the list ends at the invalid entry
        ("1,1,2", [1]),  # a repeat is invalid
        ("3,7,1", [3]),  # 7 is past the 4 physical devices
        (" 1 , 2 ", [1, 2]),  # spaces around entries are ignored
        ("0,1,2,3,0", [0, 1, 2, 3]),
        ("1,x", [1]),
        ("2,1a,0", [2]),
        ("1,,2", [1]),  # an empty entry ends the list
        ("GPU-0123", []),  # no UUIDs on the loopback
        ("-1", []),
        ("", []),  # empty: no devices
    ],
)
def test_cuda_visible_devices(build: Any, visible: str | None, physical: list[int]) -> None:
    out, _ = probe(build.cudart, PYNCCL_LOOPBACK_DEVICES="4", CUDA_VISIBLE_DEVICES=visible)
    assert out["count"] == len(physical) == out["lb_count"]
    assert out["phys"] == physical
    assert out["buses"] == [bus(p) for p in physical]  # the physical device's identity
    assert out["phys_past"] == -1
    if physical:
        assert out["rc"] == 0 and out["set_first"] == 0
        assert out["set_past"] == INVALID_DEVICE
    else:  # as CUDA: no device at all
        assert out["rc"] == NO_DEVICE and out["set_first"] == NO_DEVICE
        assert "CUDA_VISIBLE_DEVICES" in out["detail"]


def test_visible_devices_reach_libnccl(build: Any) -> None:
    """libnccl counts the visible devices: ncclCommInitAll(3) fails with two visible."""
    code = r"""
import ctypes, sys
nccl = ctypes.CDLL(sys.argv[1]); rt = ctypes.CDLL(sys.argv[2])
comms = (ctypes.c_void_p * 3)()
print(nccl.ncclCommInitAll(comms, 2, None), nccl.ncclCommInitAll(comms, 3, None))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code, build.nccl, build.cudart],
        env=_child_env(CUDA_VISIBLE_DEVICES="5,3"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert proc.stdout.split() == ["0", str(INVALID_ARG)]  # 2 devices visible, not 3


# ---- PYNCCL_LOOPBACK_* in libcudart ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PYNCCL_LOOPBACK_DEVICES", "abc"),
        ("PYNCCL_LOOPBACK_DEVICES", "5x"),
        ("PYNCCL_LOOPBACK_DEVICES", ""),
        ("PYNCCL_LOOPBACK_DEVICES", "-1"),
        ("PYNCCL_LOOPBACK_DEVICES", " 4"),
        ("PYNCCL_LOOPBACK_DEVICES", "1025"),
        ("PYNCCL_LOOPBACK_DEVICES", "0x4"),
        ("PYNCCL_LOOPBACK_STRICT", "2"),
        ("PYNCCL_LOOPBACK_STRICT", "yes"),
        ("PYNCCL_LOOPBACK_DEBUG", "true"),
        ("PYNCCL_LOOPBACK_DEBUG", ""),
    ],
)
def test_cudart_refuses_malformed_values(build: Any, name: str, value: str) -> None:
    out, err = probe(build.cudart, **{name: value})
    assert out["rc"] == INVALID_VALUE and out["set_first"] == INVALID_VALUE
    assert out["count"] == -1  # nothing was written
    message = f"{name}='{value}' is malformed"
    assert message in out["detail"]
    assert err.count(message) == 1  # said once on stderr, not once per call


@pytest.mark.parametrize(
    ("env", "count"),
    [
        ({"PYNCCL_LOOPBACK_DEVICES": "0"}, 0),
        ({"PYNCCL_LOOPBACK_DEVICES": "1024"}, 1024),
        ({"PYNCCL_LOOPBACK_DEVICES": "3", "PYNCCL_LOOPBACK_STRICT": "0"}, 3),
        ({"PYNCCL_LOOPBACK_STRICT": "1", "PYNCCL_LOOPBACK_DEBUG": "0"}, 8),
    ],
)
def test_cudart_accepts_well_formed_values(build: Any, env: dict[str, str], count: int) -> None:
    out, err = probe(build.cudart, **env)
    assert out["count"] == count
    assert out["rc"] == (0 if count else NO_DEVICE)
    assert "malformed" not in err


def test_cudart_debug_prints_errors(build: Any) -> None:
    _, quiet = probe(build.cudart, PYNCCL_LOOPBACK_DEVICES="2", PYNCCL_LOOPBACK_DEBUG="0")
    _, loud = probe(build.cudart, PYNCCL_LOOPBACK_DEVICES="2", PYNCCL_LOOPBACK_DEBUG="1")
    assert "cudaErrorInvalidDevice" not in quiet
    assert "cudaSetDevice: device 2 is out of range [0, 2)" in loud  # set_past's error


# ---- PYNCCL_LOOPBACK_* in libnccl ------------------------------------------------------

#: (variable, malformed values, a well-formed value)
NCCL_VARIABLES = [
    ("PYNCCL_LOOPBACK_STRICT", ["2", "on", ""], "0"),
    ("PYNCCL_LOOPBACK_FAIL_INIT", ["abc", "-1", "99", "2x"], "0"),
    ("PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER", ["x", "2:", "2:0", "2:99", "2:3x", "-1", ""], "5:3"),
    ("PYNCCL_LOOPBACK_HANG", ["-1", "1.5", "abc"], "0"),
    ("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", ["-1", "3x", "99999999999"], "0"),
    ("PYNCCL_LOOPBACK_INIT_TIMEOUT", ["-1", "abc", "5x", "", "1e3", ".", "0.5s"], "0.5"),
    ("PYNCCL_LOOPBACK_CHUNK_BYTES", ["-4096", "4k", ""], "8192"),
    ("PYNCCL_LOOPBACK_RING_BYTES", ["1.5", "0x100"], "4096"),
    ("PYNCCL_LOOPBACK_DIRECT", ["2", "no"], "0"),
    ("PYNCCL_LOOPBACK_SPIN", ["-5", "fast"], "10"),
    ("PYNCCL_LOOPBACK_YIELDS", ["+1", "1 "], "1"),
    ("PYNCCL_LOOPBACK_RENDEZVOUS_DIR", ["tmp", "", "/no/such/dir", "/" + "d" * 40], "/tmp"),
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name, _, _ in NCCL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, bad, _ in NCCL_VARIABLES for v in bad])
def test_nccl_init_refuses_malformed_values(
    lib: Lib, clean_env: pytest.MonkeyPatch, name: str, value: str
) -> None:
    clean_env.setenv(name, value)
    message = f"{name}='{value}' is malformed"
    comm = c_void_p()
    assert lib.ncclCommInitRank(byref(comm), 1, lib.unique_id(), 0) == INVALID_ARG
    assert comm.value is None
    assert "ncclCommInitRank" in lib.last_error() and message in lib.last_error()
    comms = (c_void_p * 2)()
    assert lib.ncclCommInitAll(comms, 2, None) == INVALID_ARG
    assert message in lib.last_error()
    # A split fails the same way (the parent was made while the value was fine).
    clean_env.delenv(name)
    assert lib.ncclCommInitRank(byref(comm), 1, lib.unique_id(), 0) == 0
    try:
        clean_env.setenv(name, value)
        child = c_void_p()
        assert lib.ncclCommSplit(comm, 0, 0, byref(child), None) == INVALID_ARG
        assert "ncclCommSplit" in lib.last_error() and message in lib.last_error()
    finally:
        assert lib.ncclCommDestroy(comm) == 0


@pytest.mark.parametrize(("name", "value"), [(n, good) for n, _, good in NCCL_VARIABLES])
def test_nccl_init_accepts_well_formed_values(
    lib: Lib, clean_env: pytest.MonkeyPatch, name: str, value: str
) -> None:
    clean_env.setenv(name, value)
    w = GroupWorld(lib, 2)
    try:
        p = [w.alloc(r, 64) for r in range(2)]
        for r in range(2):
            lib.upload(p[r], np.full(4, r + 1, np.float32))
        codes = w.run(lambda r: lib.ncclAllReduce(p[r], p[r], 4, 7, 0, w.comms[r], w.streams[r]))
        assert codes == [0, 0]
        for r in range(2):
            np.testing.assert_array_equal(lib.download(p[r], np.float32, 4), np.full(4, 3.0))
    finally:
        w.close()


def test_init_timeout_takes_fractions(lib: Lib, clean_env: pytest.MonkeyPatch) -> None:
    """INIT_TIMEOUT=0.5 is half a second (it used to be read as 0: wait forever)."""
    clean_env.setenv("PYNCCL_LOOPBACK_INIT_TIMEOUT", "0.5")
    comm = c_void_p()
    t0 = time.monotonic()
    rc = lib.ncclCommInitRank(byref(comm), 2, lib.unique_id(), 0)  # rank 1 never comes
    elapsed = time.monotonic() - t0
    assert rc == REMOTE, lib.last_error()
    assert "PYNCCL_LOOPBACK_INIT_TIMEOUT" in lib.last_error()
    assert 0.4 <= elapsed < 5, elapsed


def test_init_timeout_zero_waits(lib: Lib, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PYNCCL_LOOPBACK_INIT_TIMEOUT", "0")
    uid = lib.unique_id()
    comms = [c_void_p(), c_void_p()]
    codes: list[int] = []

    def join(rank: int) -> None:
        lib.set_device(rank)
        codes.append(lib.ncclCommInitRank(byref(comms[rank]), 2, uid, rank))

    first = threading.Thread(target=join, args=(0,))
    first.start()
    first.join(1.0)
    assert first.is_alive()  # still waiting after 1 s (0 = no timeout)
    second = threading.Thread(target=join, args=(1,))
    second.start()
    first.join(30)
    second.join(30)
    assert codes == [0, 0]
    for c in comms:
        assert lib.ncclCommDestroy(c) == 0


def test_the_parsers_cover_every_variable_the_sources_read() -> None:
    """Each PYNCCL_LOOPBACK_* name the C sources read goes through lb_env.h."""
    root = loopback.SOURCE_DIR
    sources = [*(root / "nccl").glob("*.c"), *(root / "cudart").glob("*.c")]
    texts = {p: p.read_text() for p in sources}

    read = {
        m.group(1)
        for text in texts.values()
        for m in re.finditer(r'lb_env_\w+\("(PYNCCL_LOOPBACK_\w+)"', text)
    }
    checked = {
        m.group(1)
        for text in texts.values()
        for m in re.finditer(r'\{"(PYNCCL_LOOPBACK_\w+)", LB_ENV_', text)
    }
    assert read == checked
    assert {n for n, _, _ in NCCL_VARIABLES} | {
        "PYNCCL_LOOPBACK_DEVICES",
        "PYNCCL_LOOPBACK_DEBUG",
    } == checked
    for path, text in texts.items():
        assert not re.search(r'getenv\("PYNCCL_LOOPBACK_', text), path
        assert not re.search(r'lb_env_ll\("PYNCCL_LOOPBACK_', text), path
