"""Bounded waits for what another thread brings about (a watchdog's abort, threads that end)."""

from __future__ import annotations

import time
from collections.abc import Callable


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
