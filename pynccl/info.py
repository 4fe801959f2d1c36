"""``python -m pynccl info [--json] [--loopback]``: what pynccl found on this machine, for
debugging (``--loopback``: on pynccl's host-memory loopback libraries, built if needed).

Reports the pynccl version, which libnccl and libcudart were loaded (path,
discovery rule, version), every libnccl mapped in the process, the CUDA runtime
and driver versions, the visible GPUs (or, plainly, why there are none), the
``NCCL_*``/``PYNCCL_*``/``CUDA_*`` environment variables that are set (secrets such as
``PYNCCL_RENDEZVOUS_KEY`` shown as ``<set>``; a ``PYNCCL_*`` name pynccl does not read
flagged, with the nearest one it does), every ``PYNCCL_*`` variable pynccl reads, the
loaded release's known issues (``pynccl._known_bad``) and,
where libnccl has the parameter API (NCCL >= 2.30), NCCL's parameters and their values.

Exit status: 0 whenever the report was printed, even if a library is missing
or there is no GPU (those are findings, printed in the report); 2 for a usage
error. Nothing here needs a GPU, and no failure of a library call escapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from ctypes import byref, c_int, create_string_buffer
from typing import Any

__all__ = ["LOOPBACK_HINT", "collect", "format_text", "main", "no_gpu_error", "no_gpu_reason"]

#: cudaError_t codes meaning "no usable GPU here" (initialization, stub library,
#: insufficient driver, no device).
_NO_GPU_CODES = frozenset({3, 34, 35, 100})

#: What to try on a machine without a GPU (printed with such errors and in the report).
LOOPBACK_HINT = (
    "hint: there is no usable NVIDIA GPU or driver here; pynccl can run on its host-memory "
    "loopback libraries instead: python -m pynccl launch --loopback ..., python -m pynccl "
    "info --loopback, or pynccl.testing.loopback.use() in a script (perf does it on its own)"
)


def no_gpu_error(error: BaseException) -> bool:
    """True for a :class:`~pynccl.errors.CudaError` that means "no usable GPU here"."""
    from .errors import CudaError

    return isinstance(error, CudaError) and error.code in _NO_GPU_CODES

def no_gpu_reason() -> str | None:
    """Why CUDA cannot be used here ("no GPU: cudaErrorInsufficientDriver (no NVIDIA
    driver)"), or None when it can (a GPU, or the loopback libraries, are configured).

    Loads libcudart and counts devices (no CUDA context is made); never raises.
    """
    cudart, rt = _cudart_section()
    if rt is None:
        return f"no GPU: {cudart.get('error', 'no libcudart')}"
    reason = _cuda_section(rt)["no_gpu_reason"]
    return str(reason) if reason else None


# Plain words for the CUDA errors that mean "no usable GPU".
_NO_GPU_WHY = {
    3: "CUDA initialization failed",
    34: "only the CUDA stub library is installed (no NVIDIA driver)",
    35: "no NVIDIA driver",
    100: "no CUDA-capable device is visible",
}


def _version_str(v: tuple[int, ...] | None) -> str | None:
    return None if v is None else ".".join(str(x) for x in v)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _is_loopback(path: str) -> bool:
    """True for pynccl's host-memory test stand-ins (pynccl.testing.loopback)."""
    base = os.path.basename(path)
    return base.startswith("libpynccl_loopback") or "/pynccl/loopback/" in path.replace(os.sep, "/")


def _nccl_section() -> tuple[dict[str, Any], Any]:
    from . import library
    from .errors import LibraryNotFoundError

    out: dict[str, Any] = {"loaded": False}
    try:
        lib = library.load_library()
    except LibraryNotFoundError as e:
        out["error"] = f"libnccl not found: {len(e.tried)} candidates tried"
        out["tried"] = [list(t) for t in e.tried]
        return out, None
    except Exception as e:  # a broken file, a RuntimeError from the loader...
        out["error"] = _error_text(e)
        return out, None
    out.update(
        loaded=True,
        path=lib.path,
        rule=lib.rule,
        version=_version_str(lib.version),
        version_code=lib.version_code,
        loopback=_is_loopback(lib.path),
    )
    return out, lib


def _cudart_section() -> tuple[dict[str, Any], Any]:
    from . import library
    from .errors import LibraryNotFoundError

    out: dict[str, Any] = {"loaded": False}
    try:
        rt = library.load_cudart()
    except LibraryNotFoundError as e:
        out["error"] = f"libcudart not found: {len(e.tried)} candidates tried"
        out["tried"] = [list(t) for t in e.tried]
        return out, None
    except Exception as e:
        out["error"] = _error_text(e)
        return out, None
    out.update(loaded=True, path=rt.path, rule=rt.rule, loopback=_is_loopback(rt.path))
    return out, rt


def _cuda_section(rt: Any) -> dict[str, Any]:
    """Runtime/driver versions and devices, from raw (unchecked) calls: nothing raises."""
    out: dict[str, Any] = {
        "runtime_version": None,
        "driver_version": None,
        "device_count": 0,
        "devices": [],
        "no_gpu_reason": None,
    }
    if rt is None:
        out["no_gpu_reason"] = "no GPU: no libcudart was loaded, so CUDA cannot be used"
        return out
    v = c_int(0)
    try:
        if rt.raw("cudaRuntimeGetVersion")(byref(v)) == 0:
            out["runtime_version"] = f"{v.value // 1000}.{(v.value % 1000) // 10}"
        v.value = 0
        if rt.raw("cudaDriverGetVersion")(byref(v)) == 0 and v.value > 0:
            out["driver_version"] = f"{v.value // 1000}.{(v.value % 1000) // 10}"
        n = c_int(0)
        rc = rt.raw("cudaGetDeviceCount")(byref(n))
        if rc != 0:
            rt.raw("cudaGetLastError")()  # do not leave a sticky error behind
            name = rt.error_name(rc) or f"cudaError {rc}"
            why = _NO_GPU_WHY.get(rc, rt.error_string(rc))
            if rc == 35 and out["driver_version"] is not None:
                why = (
                    f"the NVIDIA driver supports CUDA {out['driver_version']}, older than "
                    f"this CUDA runtime ({out['runtime_version']})"
                )
            out["no_gpu_reason"] = f"no GPU: {name} ({why})"
            return out
        out["device_count"] = n.value
        if n.value == 0:
            out["no_gpu_reason"] = "no GPU: cudaGetDeviceCount reports 0 devices"
        for i in range(n.value):
            buf = create_string_buffer(32)
            dev: dict[str, Any] = {"index": i}
            if rt.raw("cudaDeviceGetPCIBusId")(buf, len(buf), i) == 0:
                dev["pci_bus_id"] = buf.value.decode("ascii", "replace")
            out["devices"].append(dev)
    except Exception as e:  # a stand-in library lacking a symbol, etc.
        out["error"] = _error_text(e)
    return out


def _nccl_params(lib: Any) -> dict[str, Any]:
    """NCCL's parameter table (NCCL >= 2.30): key -> value, as strings."""
    if lib is None:
        return {"supported": False, "reason": "no libnccl loaded"}
    if not (lib.has("ncclParamGetAllParameterKeys") and lib.has("ncclParamGetParameter")):
        return {
            "supported": False,
            "reason": f"libnccl {_version_str(lib.version)} has no parameter API (NCCL >= 2.30)",
        }
    from .comm._params import keys, text

    values: dict[str, str | None] = {}
    try:
        for key in keys(lib):
            values[key] = text(key, lib)
    except Exception as e:
        return {"supported": True, "error": _error_text(e), "values": values}
    return {
        "supported": True,
        "values": dict(sorted(values.items())),
        "note": "NCCL registers most parameters when it first initializes; "
        "these are the ones registered so far",
    }


def collect() -> dict[str, Any]:
    """Everything ``info`` reports, as a JSON-ready dict (loads the libraries)."""
    from . import __version__, _env, _loader

    nccl, lib = _nccl_section()
    cudart, rt = _cudart_section()
    env = {
        k: _env.redact(k, v)
        for k, v in sorted(os.environ.items())
        if k.startswith(("NCCL_", "PYNCCL_", "CUDA_"))
    }
    cuda = _cuda_section(rt)
    if cuda["no_gpu_reason"]:
        cuda["hint"] = LOOPBACK_HINT
    return {
        "pynccl": {
            "version": __version__,
            "path": os.path.dirname(os.path.abspath(__file__)),
            **_distribution(),
        },
        "python": {"version": sys.version.split()[0], "executable": sys.executable},
        "nccl": nccl,
        "nccl_mapped": _loader.mapped_libraries("libnccl"),
        "nccl_duplicates": _loader.duplicate_libraries("libnccl"),
        "cudart": cudart,
        "cuda": cuda,
        "environment": env,
        "unknown_variables": _env.unknown(),
        "pynccl_variables": dict(_env.KNOWN),
        "nccl_parameters": _nccl_params(lib),
        "known_issues": _known_issues(lib),
    }


#: This project's distribution name; "pynccl" on PyPI is an unrelated project that imports as
#: ``pynccl`` too.
DISTRIBUTION = "pynccl-ctypes"
_UNRELATED = "pynccl"
#: This project's summary (pyproject's description): an install of this project made before
#: the rename, under the old name "pynccl", is this project, not the unrelated one.
SUMMARY = (
    "A pure-ctypes Python binding to NVIDIA NCCL, with a host-memory loopback for GPU-less testing"
)


def _distribution() -> dict[str, Any]:
    """Which installed distribution this ``pynccl`` comes from (None: a source tree), and
    the unrelated PyPI project "pynccl" if it is installed too: both own the import name, so
    whichever was installed last wins (``shadow`` says which one that is not this)."""
    from importlib import metadata

    def version_of(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    ours, other = version_of(DISTRIBUTION), version_of(_UNRELATED)
    if other is not None and metadata.metadata(_UNRELATED)["Summary"] == SUMMARY:
        ours, other = ours or other, None  # this project, installed under its old name
    shadow = None
    if other is not None:
        shadow = (
            f"the unrelated PyPI project {_UNRELATED!r} {other} is installed too and also "
            f"imports as 'pynccl'; one overwrites the other's files: pip uninstall "
            f"{_UNRELATED} && pip install --force-reinstall {DISTRIBUTION}"
        )
    return {"distribution": DISTRIBUTION if ours is not None else None,
            "installed_version": ours, "shadow": shadow}  # fmt: skip


def _known_issues(lib: Any) -> list[str] | None:
    """The loaded release's entries in pynccl's known-bad table (None: no libnccl)."""
    from . import _known_bad

    if lib is None:
        return None
    return [_known_bad.describe(i) for i in _known_bad.issues_for(lib.version)]


def _lib_line(name: str, sec: dict[str, Any], version: str | None) -> list[str]:
    if not sec.get("loaded"):
        lines = [f"{name:<11}NOT LOADED: {sec.get('error', 'unknown reason')}"]
        lines += [f"{'':<13}- {cand}: {why}" for cand, why in sec.get("tried", [])]
        return lines
    line = f"{name:<11}{version or '?'}  {sec['path']}  (found by rule: {sec['rule']})"
    if sec.get("loopback"):
        line += "\n" + " " * 11 + "(pynccl's loopback stand-in: host memory, no real GPU)"
    return [line]


def format_text(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`collect`'s report."""
    p, cuda = report["pynccl"], report["cuda"]
    dist = p.get("distribution")
    where = f"  (distribution {dist} {p.get('installed_version')})" if dist else "  (source tree)"
    lines = [
        f"pynccl     {p['version']}  {p['path']}{where}",
        f"python     {report['python']['version']}  {report['python']['executable']}",
    ]
    if p.get("shadow"):
        lines.append(f"{'':<11}WARNING: {p['shadow']}")
    lines += _lib_line("libnccl", report["nccl"], report["nccl"].get("version"))
    lines += _lib_line("libcudart", report["cudart"], cuda.get("runtime_version"))
    issues = report.get("known_issues")
    if issues is not None:
        version = report["nccl"].get("version")
        if issues:
            lines.append(f"{'':<11}KNOWN ISSUES of NCCL {version}:")
            lines += [f"{'':<13}- {text}" for text in issues]
        else:
            lines.append(f"{'':<11}no known issue in pynccl's table for NCCL {version}")
    mapped = report["nccl_mapped"]
    lines.append(f"mapped     libnccl* files in this process: {len(mapped)}")
    lines += [f"{'':<13}{path}" for path in mapped]
    if report["nccl_duplicates"]:
        lines.append(f"{'':<11}WARNING: more than one libnccl is loaded in this process")
    lines.append(
        f"CUDA       runtime {cuda['runtime_version'] or '-'}, driver "
        f"{cuda['driver_version'] or 'none'}"
    )
    if cuda["devices"]:
        lines.append(f"GPUs       {cuda['device_count']}")
        lines += [
            f"{'':<13}{d['index']}: {d.get('pci_bus_id', 'PCI bus id unknown')}"
            for d in cuda["devices"]
        ]
    else:
        lines.append(f"GPUs       {cuda['no_gpu_reason'] or 'none'}")
        words, row = LOOPBACK_HINT.split(), ""
        for word in words:  # wrapped to the report's width
            if row and len(row) + len(word) > 78:
                lines.append(f"{'':<11}{row}")
                row = ""
            row = f"{row} {word}" if row else word
        lines.append(f"{'':<11}{row}")
    if cuda.get("error"):
        lines.append(f"{'':<11}error while asking CUDA: {cuda['error']}")
    env = report["environment"]
    unknown = report.get("unknown_variables", {})
    lines.append(f"environment{'' if env else ' (no NCCL_*, PYNCCL_* or CUDA_* variables set)'}")
    for k, v in env.items():
        lines.append(f"{'':<13}{k}={v}")
        if k in unknown:  # a typo pynccl would otherwise ignore in silence
            near = unknown[k]
            lines.append(
                f"{'':<15}^ not a variable pynccl reads"
                + (f": did you mean {near}?" if near else "")
            )
    known = report.get("pynccl_variables", {})
    if known:
        lines.append("variables  the PYNCCL_* variables pynccl reads:")
        width = max(len(k) for k in known)
        lines += [f"{'':<13}{k:<{width}}  {v}" for k, v in known.items()]
    params = report["nccl_parameters"]
    if not params["supported"]:
        lines.append(f"parameters {params['reason']}")
    else:
        values = params.get("values", {})
        lines.append(f"parameters {len(values)} (NCCL's parameter API; {params.get('note', '')})")
        shown = {None: "(could not be read)", "": "(empty)"}
        lines += [f"{'':<13}{k} = {shown.get(v, v)}" for k, v in values.items()]
        if params.get("error"):
            lines.append(f"{'':<13}error reading parameters: {params['error']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the report (``--json``: as JSON). Returns 0, or 2 for a usage error."""
    parser = argparse.ArgumentParser(
        prog="python -m pynccl info",
        description="Show which libnccl/libcudart pynccl finds, their versions, the GPUs "
        "and NCCL's settings. Needs no GPU.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--loopback",
        action="store_true",
        help="report on pynccl's host-memory loopback libraries (built with the C compiler "
        "on first use), as launch --loopback and perf without a GPU use them",
    )
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse exits on --help (0) and on usage errors (2)
        return int(e.code or 0)
    if args.loopback:
        try:
            from .perf._report import _progress
            from .testing import loopback

            with _progress("preparing pynccl's loopback libraries (compiled on first use)"):
                os.environ.update(loopback.env())
        except Exception as e:
            print(
                f"python -m pynccl info: --loopback: could not prepare the loopback libraries: "
                f"{_error_text(e)}",
                file=sys.stderr,
            )
            return 1
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(format_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
