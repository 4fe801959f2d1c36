"""The launcher's side of flight records: ``--flight-dir`` / ``--dump-grace``.

With a flight directory (``--flight-dir DIR``, or ``PYNCCL_FLIGHT_DIR`` exported to the
launcher) every rank gets ``PYNCCL_FLIGHT_DIR=DIR``; before the launcher terminates a job
that failed or timed out, it sends ``SIGUSR1`` to every rank still running (each dumps its
record), waits until every rank's ``rank<R>.json`` is newer than the request or
``--dump-grace`` seconds passed, then terminates as without one, and prints where the
dumps are and the first line of ``python -m pynccl analyze DIR``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

__all__ = ["add_options", "all_dumped", "prepare", "report"]

OPTIONS = ("--flight-dir", "--dump-grace")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--flight-dir",
        default=None,
        help="directory where each rank dumps its flight record (rank<R>.json: sets "
        "PYNCCL_FLIGHT_DIR); a failed or timed-out job is asked for them (SIGUSR1) before "
        "it is terminated, and the launcher prints python -m pynccl analyze's verdict "
        "(default: $PYNCCL_FLIGHT_DIR, else none)",
    )
    p.add_argument(
        "--dump-grace",
        type=float,
        default=3.0,
        help="seconds the ranks get to dump their flight records before SIGTERM (default 3)",
    )


def prepare(opts: argparse.Namespace, envs: list[dict[str, str]]) -> str | None:
    """The flight directory (made; absolute), set in every rank's environment; None."""
    if opts.dump_grace < 0 or opts.dump_grace != opts.dump_grace:
        raise ValueError(f"--dump-grace {opts.dump_grace}: must be a number of seconds >= 0")
    where = opts.flight_dir or os.environ.get("PYNCCL_FLIGHT_DIR") or None
    if where is None:
        return None
    where = os.path.abspath(where)
    os.makedirs(where, exist_ok=True)
    for env in envs:
        env["PYNCCL_FLIGHT_DIR"] = where
    return where


def all_dumped(where: str, ranks: list[int]) -> Callable[[float], bool]:
    """``dumped(since)``: every rank's dump was written at or after ``since`` (time.time())."""

    def dumped(since: float) -> bool:
        for rank in ranks:
            try:
                if os.stat(os.path.join(where, f"rank{rank}.json")).st_mtime < since - 0.05:
                    return False
            except OSError:
                return False
        return True

    return dumped


def report(where: str, say: Callable[[str], None]) -> None:
    """Say where the dumps are, and analyze's first line."""
    from ..analyze import analyze, load

    try:
        verdict = analyze(load(where))["verdict"]
    except (ValueError, OSError) as exc:
        say(f"flight records in {where}: {exc}")
        return
    say(f"flight records in {where} (python -m pynccl analyze {where}): {verdict}")
