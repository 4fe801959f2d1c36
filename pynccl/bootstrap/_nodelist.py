"""Slurm's compressed host lists: ``node[01-03,07],gpu3``."""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_nodelist", "first_host"]

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in node list {nodelist!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {nodelist!r}")
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in node list {nodelist!r}")
    items.append(nodelist[start:])
    return items


def _parse_ranges(spec: str, nodelist: str) -> list[tuple[int, int, int]]:
    """``"01-03,7"`` -> ``[(1, 3, 2), (7, 7, 1)]``: (low, high, zero-padded width)."""
    ranges: list[tuple[int, int, int]] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"malformed range {part!r} in node list {nodelist!r}")
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise ValueError(f"descending range {part!r} in node list {nodelist!r}")
        ranges.append((lo, hi, len(lo_text)))  # Slurm keeps the lower bound's zero padding
    return ranges


def _parse_nodelist(nodelist: str) -> list[list[str | list[tuple[int, int, int]]]]:
    """Each host expression as [literal, ranges, literal, ranges, ..., literal]."""
    if not nodelist.strip():
        raise ValueError("empty node list")
    items = []
    for item in _split_top_level(nodelist.strip()):
        item = item.strip()
        if not item:
            raise ValueError(f"empty host name in node list {nodelist!r}")
        pieces = _BRACKET.split(item)  # literal, range spec, literal, ..., literal
        items.append(
            [
                piece if i % 2 == 0 else _parse_ranges(piece, nodelist)
                for i, piece in enumerate(pieces)
            ]
        )
    return items


def _choices(piece: str | list[tuple[int, int, int]]) -> list[str]:
    if isinstance(piece, str):
        return [piece]
    return [str(n).zfill(width) for lo, hi, width in piece for n in range(lo, hi + 1)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm compressed host list: ``"node[01-03,07],gpu3"`` ->
    ``["node01", "node02", "node03", "node07", "gpu3"]``.

    Zero padding and several bracket groups per name (``"r[1-2]n[1-2]"``) are
    handled; malformed lists raise :class:`ValueError`.
    """
    hosts: list[str] = []
    for item in _parse_nodelist(nodelist):
        hosts.extend("".join(combo) for combo in itertools.product(*map(_choices, item)))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm compressed host list, without expanding the list.

    The whole list is validated (:class:`ValueError` if malformed).
    """
    first = _parse_nodelist(nodelist)[0]
    return "".join(
        piece if isinstance(piece, str) else str(piece[0][0]).zfill(piece[0][2]) for piece in first
    )
