#!/usr/bin/env python3
"""Import time of pynccl as users get it: from a wheel, in a fresh virtual environment.

An editable install's import finder adds ~15 ms to every first import of the package, so
the figures of issue 10 are measured from a wheel: this script copies the source tree
(the working tree, uncommitted edits included, without build outputs), builds a wheel of
it with ``pip wheel --no-deps``, installs the wheel into a temporary venv (no other
package), and then times ``import pynccl`` and ``from pynccl import Communicator`` in
``--runs`` fresh interpreters each (``python -I``: no user site, the current directory
not on ``sys.path``), interleaved. It prints the medians and the best run against the
targets (``import pynccl`` <= 10 ms, ``from pynccl import Communicator`` <= 25 ms) and,
with ``--top N``, the N modules with the largest self time (``python -X importtime``,
medians) for each statement. Everything it made is removed on exit.

With ``--baseline OLD.whl`` the same is done for that wheel in a second venv, interleaved
run by run with this one, and the ratios new/old are printed (a before/after comparison on
a shared machine: noise hits both alike).

    python scripts/bench_import.py [--runs 21] [--top 15] [--wheel path.whl]
                                   [--baseline old.whl]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATEMENTS = {
    "import pynccl": 10.0,
    "from pynccl import Communicator": 25.0,
}
_SKIP = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".*_cache", "docs"
)


def build_wheel(dest: Path) -> Path:
    """A wheel of the working tree, built from a clean copy (no stale ``build/`` files)."""
    src = dest / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    out = dest / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        check=True,
    )
    (wheel,) = out.glob("pynccl-*.whl")
    return wheel


def make_venv(dest: Path, wheel: Path, name: str = "venv") -> Path:
    """A venv with only ``wheel`` installed; returns its interpreter."""
    env_dir = dest / name
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-compile", str(wheel)],
        check=True,
    )  # fmt: skip
    # Compile once, as an installer would (the first run would otherwise write .pyc files).
    subprocess.run([str(python), "-I", "-m", "compileall", "-q", str(env_dir / "lib")], check=True)
    return python


def time_once(python: Path, statement: str) -> float:
    """Milliseconds ``statement`` takes in a fresh interpreter."""
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    out = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True,
                         check=True, cwd="/").stdout  # fmt: skip
    return float(out) * 1e3


def self_times(python: Path, statement: str) -> dict[str, int]:
    """``{module: self time in us}`` from ``-X importtime`` for the modules ``statement`` adds."""
    base = _importtime(python, "pass")
    return {m: t for m, t in _importtime(python, statement).items() if m not in base}


def _importtime(python: Path, statement: str) -> dict[str, int]:
    err = subprocess.run([str(python), "-I", "-X", "importtime", "-c", statement],
                         capture_output=True, text=True, check=True, cwd="/").stderr  # fmt: skip
    times: dict[str, int] = {}
    for line in err.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _cumulative, name = line[len("import time:") :].split("|")
        times[name.strip()] = int(self_us)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="fresh interpreters per statement")
    parser.add_argument("--top", type=int, default=0, help="list the N slowest modules")
    parser.add_argument("--wheel", type=Path, help="time this wheel instead of building one")
    parser.add_argument("--baseline", type=Path, help="also time this wheel, interleaved")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pynccl-bench-import-") as tmp:
        dest = Path(tmp)
        wheel = args.wheel.resolve() if args.wheel else build_wheel(dest)
        python = make_venv(dest, wheel)
        old = make_venv(dest, args.baseline.resolve(), "baseline") if args.baseline else None
        env_note = f"{wheel.name}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
        print(f"import time from a wheel in a fresh venv ({env_note}), {args.runs} runs each")
        samples: dict[str, list[float]] = {s: [] for s in STATEMENTS}
        before: dict[str, list[float]] = {s: [] for s in STATEMENTS}
        for _ in range(args.runs):  # interleaved: noise hits every variant alike
            for statement in STATEMENTS:
                samples[statement].append(time_once(python, statement))
                if old is not None:
                    before[statement].append(time_once(old, statement))
        missed = 0
        for statement, target in STATEMENTS.items():
            median = statistics.median(samples[statement])
            best = min(samples[statement])
            ok = median <= target
            missed += not ok
            verdict = "ok" if ok else "MISSED"
            print(f"{statement:<34} median {median:6.1f} ms  best {best:6.1f} ms"
                  f"  (target <= {target:.0f} ms: {verdict})")  # fmt: skip
            if old is not None:
                was, was_best = statistics.median(before[statement]), min(before[statement])
                ratios = f"now {median / was:.2f}x, best {best / was_best:.2f}x"
                print(f"{'  baseline':<34} median {was:6.1f} ms  best {was_best:6.1f} ms"
                      f"  ({ratios})")  # fmt: skip
        for statement in STATEMENTS if args.top else ():
            runs = [self_times(python, statement) for _ in range(max(3, args.runs // 4))]
            names = set().union(*runs)
            med = {n: statistics.median(r.get(n, 0) for r in runs) for n in names}
            print(f"\nslowest modules for {statement!r} (self time, median us):")
            for name in sorted(med, key=med.__getitem__, reverse=True)[: args.top]:
                print(f"  {med[name]:8.0f}  {name}")
        print(f"{missed} import target(s) missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
