#!/usr/bin/env python3
"""Import time of pynccl as users get it: from a wheel, in a fresh virtual environment.

An editable install's import finder adds ~15 ms to every first import of the package, so
the figures of issues 10 and 21 are measured from a wheel: this script copies the source
tree (the working tree, uncommitted edits included, without build outputs), builds a wheel
of it with ``pip wheel --no-deps``, installs the wheel into a temporary venv (no other
package; ``.pyc`` files compiled, as an installer does), and then times, in ``--runs``
fresh interpreters each (``python -I``: no user site, the current directory not on
``sys.path``), interleaved:

* ``import pynccl`` (target <= 10 ms);
* ``from pynccl import Communicator`` (a figure: what the object API's modules cost);
* ``first collective``: ``from pynccl import Communicator`` and the first collective, a
  1-rank ``all_reduce`` over a ``DeviceBuffer`` on the loopback libraries (the venv's own
  ``pynccl.testing.loopback``, built once, before timing), until the call returns
  (target <= 25 ms); its phases are printed too (import, ``UniqueId()``, which loads the
  libraries, ``Communicator(...)``, ``DeviceBuffer(...)``, ``all_reduce``).

It prints the medians and the best run against the targets and, with ``--top N``, the N
modules with the largest self time (``python -X importtime``, medians) for each statement.
Everything it made is removed on exit (the loopback's build cache aside).

With ``--baseline OLD.whl`` the same is done for that wheel in a second venv, interleaved
run by run with this one, and the ratios new/old are printed (a before/after comparison on
a shared machine: noise hits both alike).

    python scripts/bench_import.py [--runs 21] [--top 15] [--wheel path.whl]
                                   [--baseline old.whl]
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The checkpoints ``mark()`` records are the phases of a statement; ``None``: no target.
FIRST_COLLECTIVE = """\
from pynccl import Communicator, DeviceBuffer, UniqueId
mark('import')
uid = UniqueId()
mark('UniqueId (loads the libraries)')
comm = Communicator(1, uid, 0, device=0)
mark('Communicator')
buf = DeviceBuffer(1024, 'float32')
mark('DeviceBuffer')
comm.all_reduce(buf, buf)
mark('all_reduce')
"""
STATEMENTS: dict[str, tuple[str, float | None]] = {
    "import pynccl": ("import pynccl", 10.0),
    "from pynccl import Communicator": ("from pynccl import Communicator", None),
    "first collective": (FIRST_COLLECTIVE, 25.0),
}
_TIMER = """\
import time
_t0 = time.perf_counter()
_marks = []
def mark(name):
    _marks.append((name, time.perf_counter() - _t0))
"""
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
    (wheel,) = out.glob("pynccl_ctypes-*.whl")
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


def time_once(python: Path, code: str, env: dict[str, str]) -> list[tuple[str, float]]:
    """``[(phase, ms since the start)]`` of ``code`` in a fresh interpreter; the last is the
    whole statement."""
    script = f"{_TIMER}{code}\nmark('total')\nprint(repr(_marks))"
    out = subprocess.run([str(python), "-I", "-c", script], capture_output=True, text=True,
                         check=True, cwd="/", env=env).stdout  # fmt: skip
    marks: list[tuple[str, float]] = ast.literal_eval(out.strip().splitlines()[-1])
    return [(name, seconds * 1e3) for name, seconds in marks]


def loopback_env(python: Path) -> dict[str, str]:
    """The environment that points the venv's pynccl at the loopback libraries (built by the
    venv's own copy, once, before any timing)."""
    out = subprocess.run([str(python), "-I", "-m", "pynccl.testing.loopback"],
                         capture_output=True, text=True, check=True, cwd="/").stdout  # fmt: skip
    nccl, cudart = out.split()[-2:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYNCCL_")}
    return {**env, "PYNCCL_NCCL_LIBRARY": nccl, "PYNCCL_CUDART_LIBRARY": cudart}


def self_times(python: Path, code: str, env: dict[str, str]) -> dict[str, int]:
    """``{module: self time in us}`` from ``-X importtime`` for the modules ``code`` adds."""
    base = _importtime(python, "pass", env)
    return {m: t for m, t in _importtime(python, f"{_TIMER}{code}", env).items() if m not in base}


def _importtime(python: Path, code: str, env: dict[str, str]) -> dict[str, int]:
    err = subprocess.run([str(python), "-I", "-X", "importtime", "-c", code],
                         capture_output=True, text=True, check=True, cwd="/",
                         env=env).stderr  # fmt: skip
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
        env = loopback_env(python)
        old_env = loopback_env(old) if old is not None else env
        env_note = f"{wheel.name}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
        print(f"import time from a wheel in a fresh venv ({env_note}), {args.runs} runs each")
        samples: dict[str, list[list[tuple[str, float]]]] = {s: [] for s in STATEMENTS}
        before: dict[str, list[list[tuple[str, float]]]] = {s: [] for s in STATEMENTS}
        for _ in range(args.runs):  # interleaved: noise hits every variant alike
            for name, (code, _target) in STATEMENTS.items():
                samples[name].append(time_once(python, code, env))
                if old is not None:
                    before[name].append(time_once(old, code, old_env))
        missed = 0
        for name, (_code, target) in STATEMENTS.items():
            totals = [run[-1][1] for run in samples[name]]
            median, best = statistics.median(totals), min(totals)
            verdict = "a figure"
            if target is not None:
                ok = median <= target
                missed += not ok
                verdict = f"target <= {target:.0f} ms: {'ok' if ok else 'MISSED'}"
            print(f"{name:<34} median {median:6.1f} ms  best {best:6.1f} ms  ({verdict})")
            if len(samples[name][0]) > 2:  # the phases, each from the previous checkpoint
                for i, (phase, _ms) in enumerate(samples[name][0][:-1]):
                    spans = [run[i][1] - (run[i - 1][1] if i else 0.0) for run in samples[name]]
                    print(f"  {phase:<32} median {statistics.median(spans):6.1f} ms")
            if old is not None:
                was_runs = [run[-1][1] for run in before[name]]
                was, was_best = statistics.median(was_runs), min(was_runs)
                ratios = f"now {median / was:.2f}x, best {best / was_best:.2f}x"
                print(f"{'  baseline':<34} median {was:6.1f} ms  best {was_best:6.1f} ms"
                      f"  ({ratios})")  # fmt: skip
        for name, (code, _target) in STATEMENTS.items() if args.top else ():
            runs = [self_times(python, code, env) for _ in range(max(3, args.runs // 4))]
            names = set().union(*runs)
            med = {n: statistics.median(r.get(n, 0) for r in runs) for n in names}
            print(f"\nslowest modules for {name!r} (self time, median us):")
            for mod in sorted(med, key=med.__getitem__, reverse=True)[: args.top]:
                print(f"  {med[mod]:8.0f}  {mod}")
        print(f"{missed} import target(s) missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
