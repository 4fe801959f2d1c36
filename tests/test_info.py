"""``python -m pynccl info [--json]``, run as a user would (subprocess), GPU or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pynccl.info import format_text

ROOT = Path(__file__).resolve().parent.parent
HAS_DRIVER = os.path.exists("/proc/driver/nvidia/version")


def run_info(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYNCCL_", "NCCL_"))}
    child_env.update(PYTHONPATH=str(ROOT), NCCL_SOCKET_IFNAME="lo")
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pynccl", "info", *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )


def info_json(**env: str) -> Any:
    proc = run_info("--json", **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_json_has_every_section() -> None:
    report = info_json(NCCL_ALGO="Ring")
    assert set(report) >= {
        "pynccl",
        "python",
        "nccl",
        "nccl_mapped",
        "nccl_duplicates",
        "cudart",
        "cuda",
        "environment",
        "nccl_parameters",
    }
    import pynccl

    assert report["pynccl"]["version"] == pynccl.__version__
    assert report["environment"]["NCCL_ALGO"] == "Ring"
    assert report["environment"]["NCCL_SOCKET_IFNAME"] == "lo"
    nccl = report["nccl"]
    if nccl["loaded"]:
        assert os.path.isfile(nccl["path"])
        assert nccl["path"] in report["nccl_mapped"]
        assert nccl["rule"]
        major, minor, patch = map(int, nccl["version"].split("."))
        assert nccl["version_code"] == major * 10000 + minor * 100 + patch
    cuda = report["cuda"]
    assert cuda["device_count"] == len(cuda["devices"])
    if cuda["device_count"] == 0:
        assert cuda["no_gpu_reason"].startswith("no GPU")


@pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver")
def test_no_gpu_is_said_plainly() -> None:
    report = info_json()
    if not report["cudart"]["loaded"]:
        pytest.skip("no libcudart on this machine")
    cuda = report["cuda"]
    assert cuda["device_count"] == 0 and cuda["devices"] == []
    assert cuda["driver_version"] is None
    assert cuda["runtime_version"]  # the runtime answers without a driver
    assert "cudaErrorInsufficientDriver" in cuda["no_gpu_reason"]
    assert "no NVIDIA driver" in cuda["no_gpu_reason"]
    text = run_info()
    assert text.returncode == 0
    assert "no GPU: cudaErrorInsufficientDriver (no NVIDIA driver)" in text.stdout


def test_text_output_names_libraries_and_rules() -> None:
    proc = run_info()
    assert proc.returncode == 0, proc.stderr
    report = info_json()
    for key in ("nccl", "cudart"):
        sec = report[key]
        if sec["loaded"]:
            assert sec["path"] in proc.stdout
            assert f"(found by rule: {sec['rule']})" in proc.stdout


def test_missing_libnccl_is_reported_not_raised(tmp_path: Path) -> None:
    missing = str(tmp_path / "libnccl.so.2")
    report = info_json(PYNCCL_NCCL_LIBRARY=missing)
    assert report["nccl"]["loaded"] is False
    assert report["nccl"]["tried"] == [[f"env:PYNCCL_NCCL_LIBRARY: {missing}", "not found"]]
    assert report["nccl_parameters"] == {"supported": False, "reason": "no libnccl loaded"}
    proc = run_info(PYNCCL_NCCL_LIBRARY=missing)
    assert proc.returncode == 0
    assert "libnccl    NOT LOADED" in proc.stdout
    assert missing in proc.stdout


def test_missing_libcudart_is_reported_not_raised(tmp_path: Path) -> None:
    bogus = tmp_path / "libcudart.so.13"
    bogus.write_bytes(b"not a shared object" * 10)
    report = info_json(PYNCCL_CUDART_LIBRARY=str(bogus))
    assert report["cudart"]["loaded"] is False
    ((candidate, reason),) = report["cudart"]["tried"]
    assert candidate.startswith("env:PYNCCL_CUDART_LIBRARY")
    assert reason.startswith("found but failed to load")
    cuda = report["cuda"]
    assert cuda["device_count"] == 0 and "no libcudart" in cuda["no_gpu_reason"]


def test_usage_errors_exit_2() -> None:
    proc = run_info("--no-such-flag")
    assert proc.returncode == 2
    assert "usage:" in proc.stderr
    assert run_info("--help").returncode == 0


def test_format_text_lists_devices_and_duplicates() -> None:
    report: dict[str, Any] = {
        "pynccl": {"version": "9.9.9", "path": "/x/pynccl"},
        "python": {"version": "3.11.0", "executable": "/usr/bin/python3"},
        "nccl": {
            "loaded": True,
            "path": "/a/libnccl.so.2",
            "rule": "already-mapped",
            "version": "2.21.5",
            "version_code": 22105,
        },
        "nccl_mapped": ["/a/libnccl.so.2", "/b/libnccl.so.2"],
        "nccl_duplicates": ["/a/libnccl.so.2", "/b/libnccl.so.2"],
        "cudart": {"loaded": True, "path": "/c/libcudart.so.12", "rule": "CUDA_HOME"},
        "cuda": {
            "runtime_version": "12.4",
            "driver_version": "12.6",
            "device_count": 2,
            "devices": [
                {"index": 0, "pci_bus_id": "0000:07:00.0"},
                {"index": 1, "pci_bus_id": "0000:0A:00.0"},
            ],
            "no_gpu_reason": None,
        },
        "environment": {},
        "nccl_parameters": {"supported": False, "reason": "libnccl 2.21.5 has no parameter API"},
    }
    text = format_text(report)
    assert "2.21.5  /a/libnccl.so.2  (found by rule: already-mapped)" in text
    assert "12.4  /c/libcudart.so.12  (found by rule: CUDA_HOME)" in text
    assert "more than one libnccl" in text
    assert "0: 0000:07:00.0" in text and "1: 0000:0A:00.0" in text
    assert "runtime 12.4, driver 12.6" in text
    assert "no parameter API" in text


def test_loopback_devices_are_listed_and_flagged() -> None:
    try:
        from pynccl.testing import loopback

        cudart = loopback.build_cudart()
    except Exception as e:  # not available, or no compiler
        pytest.skip(f"no loopback libcudart: {e}")
    report = info_json(PYNCCL_CUDART_LIBRARY=cudart, PYNCCL_LOOPBACK_DEVICES="3")
    assert report["cudart"]["loopback"] is True
    assert report["cudart"]["rule"] == "env:PYNCCL_CUDART_LIBRARY"
    cuda = report["cuda"]
    assert cuda["device_count"] == 3
    assert [d["index"] for d in cuda["devices"]] == [0, 1, 2]
    assert all(d["pci_bus_id"] for d in cuda["devices"])
    assert cuda["no_gpu_reason"] is None
    text = run_info(PYNCCL_CUDART_LIBRARY=cudart).stdout
    assert "loopback stand-in" in text
