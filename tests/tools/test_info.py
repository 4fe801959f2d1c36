"""``python -m pynccl info [--json]``, run as a user would (subprocess), GPU or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT

from pynccl.info import format_text

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


# -- python -m pynccl: the command dispatcher ---------------------------------------------


def run_pynccl(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYNCCL_", "NCCL_"))}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pynccl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )


def test_version() -> None:
    import pynccl

    for flag in ("--version", "-V"):
        proc = run_pynccl(flag)
        assert proc.returncode == 0 and proc.stdout == f"pynccl {pynccl.__version__}\n"


def test_no_command_is_a_usage_error() -> None:
    proc = run_pynccl()
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("usage: python -m pynccl") and "commands:" in proc.stderr
    unknown = run_pynccl("bogus")
    assert unknown.returncode == 2 and "unknown command 'bogus'" in unknown.stderr


def test_help_lists_what_each_command_does() -> None:
    proc = run_pynccl("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for command in ("info", "perf", "launch"):
        assert f"\n  {command} " in proc.stdout
    assert "--loopback" in proc.stdout and "-J JSON" in proc.stdout
    info_help = run_info("--help")
    assert info_help.returncode == 0
    assert "--json" in info_help.stdout and "--loopback" in info_help.stdout


def test_no_gpu_error_gets_the_loopback_hint(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pynccl.__main__ as cli
    from pynccl.errors import CudaError
    from pynccl.info import LOOPBACK_HINT, no_gpu_error

    assert no_gpu_error(CudaError(35, "cudaGetDeviceCount", "cudaErrorInsufficientDriver"))
    assert no_gpu_error(CudaError(100, "cudaSetDevice", "cudaErrorNoDevice"))
    assert not no_gpu_error(CudaError(2, "cudaMalloc", "cudaErrorMemoryAllocation"))
    assert not no_gpu_error(ValueError("x"))

    class Fails:
        @staticmethod
        def main(_argv: list[str]) -> int:
            raise CudaError(35, "cudaSetDevice", "cudaErrorInsufficientDriver", "no driver")

    import importlib

    real = importlib.import_module
    def fake_import(name: str, *args: Any) -> Any:
        return Fails if name == "pynccl.launch" else real(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    assert cli.main(["launch", "-n", "2", "x.py"]) == 1
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert "pynccl launch: CudaError: cudaSetDevice: cudaErrorInsufficientDriver (35)" in err
    assert LOOPBACK_HINT in err and "--loopback" in LOOPBACK_HINT


@pytest.mark.skipif(HAS_DRIVER, reason="an NVIDIA driver is installed here")
def test_report_without_a_gpu_hints_at_the_loopback() -> None:
    proc = run_info()
    assert proc.returncode == 0, proc.stderr
    assert "hint: there is no usable NVIDIA GPU or driver here" in proc.stdout
    assert "info --loopback" in proc.stdout
    report = info_json()
    assert "--loopback" in report["cuda"]["hint"]


def test_info_on_the_loopback() -> None:
    try:
        from pynccl.testing import loopback

        loopback.env()
    except Exception as e:  # no C compiler
        pytest.skip(f"no loopback: {e}")
    proc = run_info("--loopback", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["nccl"]["loopback"] is True and report["cudart"]["loopback"] is True
    assert report["cuda"]["device_count"] >= 1 and "hint" not in report["cuda"]
    # The loopback serves NCCL 2.32.3's parameters known before init (the debug
    # subsystem's), as pynccl.params reads them.
    params = report["nccl_parameters"]
    assert params["supported"] is True and "error" not in params
    assert params["values"]["NCCL_DEBUG_SUBSYS"] == "INIT,ENV,BOOTSTRAP"
    assert len(params["values"]) == 7
    text = run_info("--loopback").stdout
    assert "parameters 7 (NCCL's parameter API" in text
    assert "error" not in text.split("parameters", 1)[1]
