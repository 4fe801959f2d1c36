"""Bounded waits for what another thread brings about (a watchdog's abort, threads that end),
and :func:`threads`: one call per rank, each on a thread of its own, every wait bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    """Poll ``predicate()`` every 10 ms for up to ``seconds``: True as soon as it holds,
    else its value at the end (callers assert it, with bounds generous enough for a loaded
    machine)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


#: Seconds a rank thread may run before :func:`threads` calls it hung.
TIMEOUT = 60.0


def threads(n: int, fn: Callable[[int], Any], timeout: float = TIMEOUT) -> list[Any]:
    """``fn(rank)`` for every rank of ``n``, each on a new daemon thread, all at once; the
    results in rank order. Re-raises the lowest rank's exception once every rank ended;
    fails if a rank is still running after ``timeout`` seconds (its thread is left behind:
    daemon threads never hold the interpreter's exit)."""
    results: list[Any] = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:  # reported below, in rank order
            results[r] = exc

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=timeout)
        assert not t.is_alive(), "a rank thread hung"
    for res in results:
        if isinstance(res, BaseException):
            raise res
    return results


def per_rank(fn: Callable[[int], Any], ranks: Iterable[int], timeout: float = 2 * TIMEOUT
             ) -> dict[int, Any]:  # fmt: skip
    """``fn(rank)`` for each of ``ranks``, each on a new daemon thread, all at once:
    ``{rank: its result, or the exception it raised}`` (a rank still running after
    ``timeout`` seconds is missing), for tests that assert on each rank's outcome."""
    out: dict[int, Any] = {}

    def body(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:  # collected for the caller's assertions
            out[r] = exc

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in ranks]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    return out
