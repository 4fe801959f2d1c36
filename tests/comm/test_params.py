"""``pynccl.params`` (NCCL's parameter API) on the loopback and, in a child process, on the
real libnccl of the nvidia-nccl wheel (its parameter API needs no GPU). The expected
values are NCCL's documented defaults of the debug subsystem's parameters, written out
here; typed reads refuse other types and unknown names with words that say why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.worlds import use_loopback

import pynccl
from pynccl import NotSupportedError, Params, params

DEFAULTS = {
    "NCCL_DEBUG_FILE": "",
    "NCCL_DEBUG_TIMESTAMP_FORMAT": "[%F %T] ",
    "NCCL_DEBUG_TIMESTAMP_LEVELS": "WARN,ATTN",
    "NCCL_SET_THREAD_NAME": "FALSE",
    "NCCL_DEBUG_SUBSYS": "INIT,ENV,BOOTSTRAP",
    "NCCL_DEBUG_LEVELS": "NONE",
    "NCCL_DEBUG": "<unknown>",  # NCCL's text until the variable is set (or NCCL inits)
}
VARS = ("NCCL_DEBUG", "NCCL_SET_THREAD_NAME", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")


@pytest.fixture
def clean_env(lb: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in (*VARS, "NCCL_DEBUG_LEVELS", "NCCL_DEBUG_TIMESTAMP_LEVELS"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


def test_a_read_only_mapping_of_the_registered_parameters(clean_env: Any) -> None:
    assert isinstance(params, Params) and pynccl.params is params
    assert sorted(params) == sorted(DEFAULTS) and len(params) == len(DEFAULTS)
    assert dict(params) == DEFAULTS
    assert "NCCL_DEBUG" in params and "NCCL_NO_SUCH" not in params and 5 not in params
    assert params.get("NCCL_NO_SUCH", "x") == "x"
    with pytest.raises(TypeError):
        params["NCCL_DEBUG"] = "INFO"  # type: ignore[index]
    assert "7 NCCL parameters" in repr(params)


def test_typed_reads(clean_env: pytest.MonkeyPatch) -> None:
    # Level bits are 1 << ncclDebugLogLevel (WARN 2), ATTN 1 << 6; subsystem bits:
    # INIT 1, ENV 128, BOOTSTRAP 4096 (NCCL's debug.h).
    assert params.get_int("NCCL_DEBUG_TIMESTAMP_LEVELS") == (1 << 2) | (1 << 6)
    assert params.get_int("NCCL_DEBUG_LEVELS") == 0
    assert params.get_int("NCCL_DEBUG_SUBSYS") == 1 | 128 | 4096
    assert params.get_bool("NCCL_SET_THREAD_NAME") is False
    assert params.get_str("NCCL_DEBUG_TIMESTAMP_FORMAT") == "[%F %T] "
    assert params.get_bytes("NCCL_DEBUG_TIMESTAMP_FORMAT") == b"[%F %T] \0"
    assert params.get_str("NCCL_DEBUG_FILE") == ""
    clean_env.setenv("NCCL_DEBUG", "WARN")
    clean_env.setenv("NCCL_SET_THREAD_NAME", "1")
    clean_env.setenv("NCCL_DEBUG_SUBSYS", "^INIT,COLL")
    clean_env.setenv("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p")
    assert params["NCCL_DEBUG"] == "WARN" and params.get_int("NCCL_DEBUG") == 2
    assert params.get_bool("NCCL_SET_THREAD_NAME") is True
    assert params.get_int("NCCL_DEBUG_SUBSYS") == ~(1 | 2) & (2**64 - 1)
    assert params.get_str("NCCL_DEBUG_FILE") == "/tmp/nccl.%h.%p"


def test_mistakes_are_worded(clean_env: Any) -> None:
    with pytest.raises(KeyError, match="registers most of its parameters when it initialises"):
        params["NCCL_ALGO"]
    for getter in (params.get_int, params.get_str, params.get_bool, params.get_bytes):
        with pytest.raises(KeyError, match="NCCL has no parameter 'NCCL_ALGO' registered"):
            getter("NCCL_ALGO")
    with pytest.raises(TypeError, match="NCCL_DEBUG_FILE is a string parameter, not an integer"):
        params.get_int("NCCL_DEBUG_FILE")
    with pytest.raises(TypeError, match="NCCL_DEBUG_SUBSYS is not a string parameter"):
        params.get_str("NCCL_DEBUG_SUBSYS")
    with pytest.raises(TypeError, match="NCCL_DEBUG_FILE is a string parameter, not a boolean"):
        params.get_bool("NCCL_DEBUG_FILE")
    with pytest.raises(TypeError, match="NCCL_DEBUG_LEVELS is not a boolean parameter"):
        params.get_bool("NCCL_DEBUG_LEVELS")
    with pytest.raises(TypeError, match="a parameter name must be a str, got int 3"):
        params.get_int(3)  # type: ignore[arg-type]


def test_not_supported_before_2_30_3() -> None:
    with use_loopback("2.29.2"):
        with pytest.raises(NotSupportedError, match=r"2\.30\.3"):
            len(params)
        with pytest.raises(NotSupportedError, match=r"2\.30\.3"):
            params.get_int("NCCL_DEBUG_LEVELS")
        assert "unavailable" in repr(params)


def _wheel_lib() -> str | None:
    for entry in sys.path:
        p = Path(entry or ".") / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if p.is_file():
            return str(p)
    return None


PROBE = textwrap.dedent(
    """
    import json
    from pynccl import params
    print(json.dumps({"values": dict(params), "subsys": params.get_int("NCCL_DEBUG_SUBSYS"),
                      "thread_name": params.get_bool("NCCL_SET_THREAD_NAME"),
                      "file": params.get_str("NCCL_DEBUG_FILE")}))
    """
)


def test_the_real_libnccl_agrees() -> None:
    real = _wheel_lib()
    if real is None:
        pytest.skip("nvidia-nccl wheel not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env.update(PYNCCL_NCCL_LIBRARY=real, NCCL_SET_THREAD_NAME="1", NCCL_DEBUG_FILE="/tmp/x")
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["subsys"] == 1 | 128 | 4096
    assert got["thread_name"] is True and got["file"] == "/tmp/x"
    assert got["values"] == {
        **DEFAULTS,
        "NCCL_SET_THREAD_NAME": "TRUE",
        "NCCL_DEBUG_FILE": "/tmp/x",
    }
