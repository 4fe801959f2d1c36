"""The programs in examples/ run as their docstrings say, and check their own results.

Each example compares what NCCL computed with numpy and exits non-zero otherwise; here
each one runs as a user would start it on the loopback libraries: ``python
examples/NAME.py --loopback`` (multi-rank examples then start their own ranks through
``python -m pynccl launch``), and the multi-rank ones once more under ``launch -n 3
--loopback``, a world size they do not pick themselves. The CuPy and torch examples need
a GPU: they are skipped here and listed in :data:`EXAMPLES` for the GPU check. The Ray
example starts its own actors, on the loopback too, and is skipped where Ray is absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from support import ROOT

EXAMPLES_DIR = ROOT / "examples"


class Example(NamedTuple):
    #: Ranks it needs at least under ``launch`` (0: one process, no launcher).
    min_ranks: int
    #: A module it needs besides pynccl and numpy (skipped with the reason without it).
    needs: str | None = None
    #: What its rank 0 prints when it succeeds.
    says: str = "OK"
    #: Whether it runs on the loopback libraries (``--loopback``); else it needs a GPU.
    loopback: bool = True


#: Every example, for this module and for the GPU check (see :func:`gpu_command`).
EXAMPLES: dict[str, Example] = {
    "allreduce_lowlevel.py": Example(0, says="ncclAllReduce on"),
    "object_api.py": Example(1),
    "sendrecv_ring.py": Example(1, says="steps round the ring OK"),
    "split.py": Example(1, says="half, sum OK"),
    "graph_capture.py": Example(1, says="3 replays of a graph of 2 collectives OK"),
    "dead_peer.py": Example(2, says="peer lost"),
    "cupy_arrays.py": Example(1, needs="cupy", loopback=False),
    "torch_bf16.py": Example(1, needs="torch", loopback=False),
    "ray_actors.py": Example(0, needs="ray", says="all_reduce and all_gather OK"),
}

#: The examples that need a GPU (and another library): the GPU check runs these.
GPU_ONLY = sorted(name for name, ex in EXAMPLES.items() if not ex.loopback)


def gpu_command(name: str, ngpus: int) -> list[str] | None:
    """The arguments after ``sys.executable`` that run example ``name`` on real GPUs (from
    the repository root, with the real libraries), or None when ``ngpus`` is too few."""
    ex = EXAMPLES[name]
    if ex.min_ranks == 0:
        return [f"examples/{name}"] if ngpus >= 1 else None
    n = max(ex.min_ranks, min(2, ngpus))
    if n > ngpus:
        return None
    return ["-m", "pynccl", "launch", "-n", str(n), f"examples/{name}"]


LOOPBACK_EXAMPLES = sorted(name for name, ex in EXAMPLES.items() if ex.loopback)
LAUNCHED_EXAMPLES = sorted(name for name in LOOPBACK_EXAMPLES if EXAMPLES[name].min_ranks)
#: What runs on the loopback, an example that needs a real tool (Ray) among the slow tests.
LOOPBACK_PARAMS = [
    pytest.param(name, marks=pytest.mark.slow) if EXAMPLES[name].needs else name
    for name in LOOPBACK_EXAMPLES
]

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # As a user's shell: no launcher variables, nothing pointing at a library yet.
    drop = (*_LAUNCHER_VARS, "PYNCCL_NCCL_LIBRARY", "PYNCCL_CUDART_LIBRARY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def _run(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out}"
    return out


def _ok_lines(out: str, says: str) -> list[str]:
    return [line for line in out.splitlines() if says in line]


def test_every_example_is_listed() -> None:
    on_disk = sorted(p.name for p in EXAMPLES_DIR.glob("*.py"))
    assert on_disk == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_docstring_says_how_to_run_it(name: str) -> None:
    text = (EXAMPLES_DIR / name).read_text()
    assert text.startswith('"""'), f"{name} opens with no docstring"
    doc = text.split('"""')[1]
    assert f"python examples/{name}" in doc
    if EXAMPLES[name].min_ranks:
        assert "python -m pynccl launch -n" in doc and f"examples/{name}" in doc


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_compiles(name: str) -> None:
    # The GPU-only examples run only where there is a GPU: here they are at least parsed.
    compile((EXAMPLES_DIR / name).read_text(), name, "exec")


@pytest.mark.parametrize("name", LOOPBACK_PARAMS)
def test_example_runs_on_the_loopback(name: str, lb_env: dict[str, str]) -> None:
    ex = EXAMPLES[name]
    if ex.needs is not None:
        pytest.importorskip(ex.needs, reason=f"{name} needs {ex.needs} (pip install {ex.needs})")
    out = _run([f"examples/{name}", "--loopback"], _env())
    if ex.min_ranks == 0:
        assert len(_ok_lines(out, ex.says)) == 1, out
    elif name == "dead_peer.py":
        # The last rank dies; every other rank reports it (here: rank 0 of 2).
        lines = _ok_lines(out, ex.says)
        assert len(lines) == 1 and lines[0].startswith("[rank 0]"), out
        assert "NcclRemoteError" in lines[0] or "NcclTimeoutError" in lines[0], out
    else:
        ranks = 4 if name == "split.py" else 2  # what each starts on the loopback
        lines = _ok_lines(out, ex.says)
        assert sorted(line.split("]")[0] for line in lines) == [
            f"[rank {r}" for r in range(ranks)
        ], out


@pytest.mark.slow
@pytest.mark.parametrize("name", LAUNCHED_EXAMPLES)
def test_example_runs_under_launch_with_three_ranks(name: str, lb_env: dict[str, str]) -> None:
    ex = EXAMPLES[name]
    out = _run(["-m", "pynccl", "launch", "-n", "3", "--loopback", f"examples/{name}"], _env())
    lines = _ok_lines(out, ex.says)
    survivors = 2 if name == "dead_peer.py" else 3  # rank 2 dies in dead_peer
    assert sorted(line.split("]")[0] for line in lines) == [
        f"[rank {r}" for r in range(survivors)
    ], out


@pytest.mark.parametrize("name", GPU_ONLY)
def test_gpu_example_runs_where_there_is_a_gpu(name: str) -> None:
    ex = EXAMPLES[name]
    assert ex.needs is not None
    pytest.importorskip(ex.needs, reason=f"{name} needs {ex.needs} (and a GPU)")
    if not Path("/proc/driver/nvidia/version").exists():
        pytest.skip(f"{name} needs a GPU: the GPU check runs it (EXAMPLES in this module)")
    cmd = gpu_command(name, 1)
    assert cmd is not None
    out = _run(cmd, _env())
    assert len(_ok_lines(out, ex.says)) == 1, out


def test_gpu_command() -> None:
    assert gpu_command("allreduce_lowlevel.py", 1) == ["examples/allreduce_lowlevel.py"]
    launch = "-m pynccl launch -n {} examples/object_api.py"
    assert gpu_command("object_api.py", 8) == launch.format(2).split()
    assert gpu_command("object_api.py", 1) == launch.format(1).split()
    assert gpu_command("dead_peer.py", 1) is None


def test_readme_lists_every_example() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Examples\n") :]
    section = section[: section.index("\n## ")]
    for name in EXAMPLES:
        assert f"python examples/{name}" in section, f"README's Examples section lacks {name}"
