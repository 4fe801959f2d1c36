"""Who is missing from a rendezvous: the interval between progress lines
(``PYNCCL_RENDEZVOUS_REPORT``) and the words of those lines, written on stderr."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping

from ._common import format_ranks, ranks_phrase

__all__ = ["REPORT_ENV", "arrived_phrase", "missing_report", "report_interval", "say"]

#: Seconds between "still waiting" lines while a rendezvous waits (0: none).
REPORT_ENV = "PYNCCL_RENDEZVOUS_REPORT"
DEFAULT_INTERVAL = 30.0


def report_interval(value: float | None = None, env: str = REPORT_ENV) -> float:
    """``value`` if given, else ``$env`` (``PYNCCL_RENDEZVOUS_REPORT``; init reads
    ``PYNCCL_INIT_REPORT``), else 30 s; 0 means never.

    Raises ``ValueError`` naming the value when it is not a finite number >= 0.
    """
    source = "report_interval"
    if value is None:
        text = os.environ.get(env, "").strip()
        if not text:
            return DEFAULT_INTERVAL
        source = env
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"{env}={text!r} is not a number of seconds (expected e.g. 30, or 0 "
                "for no progress lines)"
            ) from None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (0 <= value < float("inf"))
    ):
        raise ValueError(f"{source}={value!r} is not a finite number of seconds >= 0")
    return float(value)


def arrived_phrase(hosts: Mapping[int, str]) -> str:
    """``{1: "10.0.0.2", 2: "10.0.0.2", 4: "10.0.0.3"}`` ->
    ``"ranks 1-2 from 10.0.0.2, rank 4 from 10.0.0.3"`` ("none" when empty)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in sorted(hosts.items()):
        by_host.setdefault(host, []).append(rank)
    if not by_host:
        return "none"
    return ", ".join(f"{ranks_phrase(r)} from {h}" for h, r in by_host.items())


def missing_report(
    missing: Iterable[int], world_size: int, hosts: Mapping[int, str], waited: float
) -> str:
    """One line: who has not arrived after ``waited`` seconds, and where the others came from."""
    gone = sorted(set(missing))
    which, verb = ("rank", "has") if len(gone) == 1 else ("ranks", "have")
    return (
        f"{which} {format_ranks(gone)} of {world_size} {verb} not arrived after {waited:.0f} s; "
        f"arrived: {arrived_phrase(hosts)}"
    )


def say(line: str, stage: str = "rendezvous") -> None:
    """Write one progress line on stderr, as ``pynccl <stage>: <line>`` (never raises:
    stderr may be closed)."""
    try:
        sys.stderr.write(f"pynccl {stage}: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
