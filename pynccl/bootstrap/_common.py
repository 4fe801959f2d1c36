"""Argument checks and small helpers shared by the rendezvous backends."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable


def check_share_args(
    payload: bytes | bytearray | memoryview | None,
    rank: object,
    world_size: object,
    timeout: object,
) -> bytes | None:
    """Validate :meth:`Rendezvous.share` arguments; returns rank 0's payload as bytes."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not a positive integer")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} is not an integer in [0, {world_size})")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(f"timeout={timeout!r} is not a positive finite number of seconds")
    if rank != 0:
        return None  # only rank 0's payload matters
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"rank 0 must provide the payload as bytes, got {type(payload).__name__}")
    data = bytes(payload)
    if not data:
        raise ValueError("rank 0's payload is empty")
    return data


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``[1]`` -> ``"rank 1"``, ``[1, 2, 3, 7]`` -> ``"ranks 1-3, 7"`` (for messages)."""
    ranks = set(ranks)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}"


def format_ranks(ranks: Iterable[int], limit: int = 20) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``, truncated after ``limit`` groups."""
    groups: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            groups.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        groups.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    if len(groups) > limit:
        return ", ".join(groups[:limit]) + f", ... ({len(groups) - limit} more ranges)"
    return ", ".join(groups)


def backoff(delay: float, deadline: float, cap: float) -> float:
    """Sleep ``delay`` (not past ``deadline``) and return the next, doubled, delay."""
    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
    return min(delay * 2, cap)
