"""The environment as users meet it (issue 22): a mistyped ``PYNCCL_*`` variable warns with
the nearest known name, secrets are never written out, a read-only home directory names
``PYNCCL_CACHE_DIR``, and ``launch`` without a GPU says once what to do."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import ROOT

from pynccl import _env

_QUOTED = re.compile(r"[\"'`](PYNCCL_[A-Z0-9_]*[A-Z0-9])[\"'`]")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYNCCL_", "NCCL_"))}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _run(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- the table ---------------------------------------------------------------------------


def test_the_table_lists_every_variable_the_code_reads() -> None:
    # Every PYNCCL_* name quoted in the package (Python and the loopback's C) or the
    # scripts is in the one table, and every name there is read somewhere.
    read: set[str] = set()
    for path in [*ROOT.joinpath("pynccl").rglob("*"), *ROOT.joinpath("scripts").rglob("*.py")]:
        if path.suffix in (".py", ".c", ".h") and path.name != "_env.py":
            read |= set(_QUOTED.findall(path.read_text(errors="replace")))
    read.discard("PYNCCL_LOOPBACK_")  # the prefix, in messages
    unknown = sorted(n for n in read if n not in _env.KNOWN)
    assert unknown == [], f"PYNCCL_* variables read but missing from pynccl._env.KNOWN: {unknown}"
    everywhere = "".join(
        p.read_text(errors="replace")
        for d in ("pynccl", "tests", "scripts")
        for p in ROOT.joinpath(d).rglob("*")
        if p.suffix in (".py", ".c", ".h") and p.name != "_env.py"
    )
    stale = sorted(n for n in _env.KNOWN if n not in everywhere)
    assert stale == [], f"names in pynccl._env.KNOWN that nothing reads: {stale}"


@pytest.mark.parametrize(
    ("name", "nearest"),
    [
        ("PYNCCL_LOOPBACK_DEVICE", "PYNCCL_LOOPBACK_DEVICES"),
        ("PYNCCL_RENDEZVOUS_KEYS", "PYNCCL_RENDEZVOUS_KEY"),
        ("PYNCCL_NCCL_LIB", "PYNCCL_NCCL_LIBRARY"),
        ("PYNCCL_CACHEDIR", "PYNCCL_CACHE_DIR"),
        ("PYNCCL_SOMETHING_ELSE_ENTIRELY", None),
    ],
)
def test_unknown_names_and_their_nearest(name: str, nearest: str | None) -> None:
    env = {name: "1", "PYNCCL_LOOPBACK_DEVICES": "3", "PYNCCL_TEST_RANK": "0", "HOME": "/x"}
    assert _env.unknown(env) == {name: nearest}


def test_mistyped_variable_warns_once_at_library_load(lb_env: dict[str, str]) -> None:
    env = {**lb_env, "PYNCCL_LOOPBACK_DEVICE": "3"}
    proc = _run(
        """
        import pynccl, pynccl.cuda
        print(pynccl.cuda.device_count())
        pynccl.lib()  # a second library: no second warning
        """,
        env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "8"  # the typo did nothing: the default device count
    warnings = [line for line in proc.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warnings) == 1, proc.stderr
    assert "PYNCCL_LOOPBACK_DEVICE is set but is not a variable pynccl reads" in warnings[0]
    assert "did you mean PYNCCL_LOOPBACK_DEVICES?" in warnings[0]
    # Known names only: not a word.
    quiet = _run("import pynccl.cuda; pynccl.cuda.device_count()", lb_env)
    assert quiet.returncode == 0 and "RuntimeWarning" not in quiet.stderr, quiet.stderr


# -- secrets -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("PYNCCL_RENDEZVOUS_KEY", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("HF_TOKEN", True),
        ("DB_PASSWORD", True),
        ("GITHUB_token", True),
        ("NCCL_DEBUG", False),
        ("PATH", False),
    ],
)
def test_redact(name: str, secret: bool) -> None:
    assert _env.redact(name, "hunter2") == ("<set>" if secret else "hunter2")
    assert _env.redact(name, "") == ""  # nothing to hide


def test_info_never_prints_the_rendezvous_key(tmp_path: Path) -> None:
    env = _clean_env(PYNCCL_RENDEZVOUS_KEY="hunter2-secret", PYNCCL_LOOPBACK_DEVICE="3")
    for args in (["--json"], []):
        proc = subprocess.run(
            [sys.executable, "-m", "pynccl", "info", *args],
            env=env,
            cwd=str(ROOT),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "hunter2-secret" not in proc.stdout + proc.stderr
    report = json.loads(
        subprocess.run(
            [sys.executable, "-m", "pynccl", "info", "--json"],
            env=env,
            cwd=str(ROOT),
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )
    assert report["environment"]["PYNCCL_RENDEZVOUS_KEY"] == "<set>"
    assert report["unknown_variables"] == {"PYNCCL_LOOPBACK_DEVICE": "PYNCCL_LOOPBACK_DEVICES"}
    assert report["pynccl_variables"] == _env.KNOWN
    assert "^ not a variable pynccl reads: did you mean PYNCCL_LOOPBACK_DEVICES?" in proc.stdout


# -- the loopback's cache ----------------------------------------------------------------

_BUILD = """
    from pynccl.testing import loopback
    loopback.build()
"""


def _no_cache_env(home: str) -> dict[str, str]:
    env = _clean_env(HOME=home)
    env.pop("XDG_CACHE_HOME", None)
    return env


@pytest.mark.slow
def test_unwritable_home_names_pynccl_cache_dir(tmp_path: Path) -> None:
    # HOME is a file: the cache under it cannot be made (as a read-only HOME).
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    proc = _run(_BUILD, _no_cache_env(str(home)))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pynccl.testing.loopback._build.LoopbackBuildError: cannot write")
    assert "PYNCCL_CACHE_DIR" in last and str(home) in last, last
    # ... and the fix it names works.
    env = {**_no_cache_env(str(home)), "PYNCCL_CACHE_DIR": str(tmp_path / "cache")}
    proc = _run(_BUILD + "\n    print('built')", env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "built", proc.stderr


def test_read_only_home_through_perf(tmp_path: Path) -> None:
    # A real read-only file system (a private mount namespace), where unshare allows it.
    unshare = shutil.which("unshare")
    home = tmp_path / "ro"
    home.mkdir()
    if unshare is None:
        pytest.skip("no unshare(1) to mount a read-only file system")
    probe = subprocess.run(
        [unshare, "-m", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {home}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {probe.stderr.strip()}")
    cmd = (
        f"mount -t tmpfs -o ro tmpfs {home} && exec {sys.executable} -m pynccl perf "
        "-g 2 -b 8 -e 8 -n 1"
    )
    proc = subprocess.run(
        [unshare, "-m", "sh", "-c", cmd],
        env=_no_cache_env(str(home)),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Read-only file system" in proc.stderr
    assert "Set PYNCCL_CACHE_DIR to a writable directory" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- launch without a GPU ----------------------------------------------------------------


def _launch(
    tmp_path: Path, body: str, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "-m", "pynccl", "launch", "-n", "2", *flags, str(script)],
        env=env or _clean_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _require_no_gpu() -> None:
    probe = _run("import pynccl.cuda as c; print(c.device_count())", _clean_env())
    if probe.returncode != 0 or probe.stdout.strip() != "0":
        pytest.skip("a GPU (or a configured libcudart) is here: nothing to hint")


def test_launch_without_a_gpu_hints_once(tmp_path: Path) -> None:
    _require_no_gpu()
    uses_cuda = """
        import pynccl.cuda
        pynccl.cuda.set_device(0)
    """
    proc = _launch(tmp_path, uses_cuda)
    assert proc.returncode == 1, proc.stderr
    hints = [line for line in proc.stderr.splitlines() if "hint:" in line]
    assert len(hints) == 1, proc.stderr
    assert hints[0].startswith("pynccl launch: hint: no GPU: ")
    assert "Add --loopback" in hints[0]
    # A job that needs no GPU hears nothing; with --loopback there is nothing to hint.
    quiet = _launch(tmp_path, "print('fine')\n")
    assert quiet.returncode == 0 and "hint" not in quiet.stderr, quiet.stderr
    on_loopback = _launch(tmp_path, uses_cuda, "--loopback")
    assert on_loopback.returncode == 0, on_loopback.stderr
    assert "hint" not in on_loopback.stderr
