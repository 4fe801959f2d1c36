"""What ``perf -c 1`` (the numpy check) costs: the same sweep with and without it.

    python scripts/bench_perf_check.py                    # the default loopback sweep
    python scripts/bench_perf_check.py --repeats 5 -- all_gather -g 4 -b 1M -e 64M

Runs ``python -m pynccl perf ARGS -c 0`` and ``... -c 1`` alternately (interleaved, so
both see the same machine load), ``--repeats`` times each, and prints the median wall
time of each and the check's share of a checked run, ``(t1 - t0) / t1``. The target is
at most ~20 %. Without a GPU the runs use the loopback libraries (built once, first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], check: int) -> float:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pynccl", "perf", *args, "-c", str(check)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    parser.add_argument("perf_args", nargs="*", help="arguments for perf (after --)")
    ns = parser.parse_args()
    args = list(ns.perf_args)
    _run([*args, "-b", "8", "-e", "8"], 0)  # builds the loopback once, untimed
    plain: list[float] = []
    checked: list[float] = []
    for _ in range(ns.repeats):
        plain.append(_run(args, 0))
        checked.append(_run(args, 1))
    t0, t1 = statistics.median(plain), statistics.median(checked)
    print(f"perf {' '.join(args) or '(defaults)'}: {ns.repeats} runs each, interleaved")
    print(f"  -c 0  median {t0:7.2f} s   ({', '.join(f'{t:.2f}' for t in plain)})")
    print(f"  -c 1  median {t1:7.2f} s   ({', '.join(f'{t:.2f}' for t in checked)})")
    print(f"  the check's share of a checked run: {(t1 - t0) / t1:6.1%}")


if __name__ == "__main__":
    main()
