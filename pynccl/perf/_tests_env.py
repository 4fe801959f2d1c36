"""nccl-tests' environment variables (``src/common.cu``): ``NCCL_TESTS_DEVICE``,
``NCCL_TESTS_SPLIT`` / ``NCCL_TESTS_SPLIT_MASK`` and ``NCCL_TESTS_MIN_BW`` (alltoallv's
own are in :mod:`._traffic`).

* ``NCCL_TESTS_DEVICE=D``: the ranks of one nccl-tests process use devices ``D, D+1,
  ...`` instead of ``local rank * ranks per process``. perf's own launch is one such
  process (its ranks use ``D + local rank``); under another launcher each rank is a
  process of one GPU, so every rank uses device ``D`` (of its visible devices).
* ``NCCL_TESTS_SPLIT="<op> <value>"``: ranks with the same color ``rank <op> value``
  (``AND``/``&``, ``OR``/``|``, ``MOD``/``%``, ``DIV``/``/``; the value decimal, ``0x``
  hexadecimal or ``0b`` binary) form one group, and every group runs the sweep at the
  same time on its own communicator (``ncclCommSplit``); the reported bandwidth is one
  group's. ``NCCL_TESTS_SPLIT_MASK=<hex>`` is ``NCCL_TESTS_SPLIT="&0x<hex>"``. Here every
  rank is a process, so the rank is nccl-tests' process number. Unlike nccl-tests, the
  groups must all have the same size (each sweep step lines up every rank), and a
  malformed value is refused instead of ignored.
* ``NCCL_TESTS_MIN_BW=B``: the run fails (the bandwidth line says ``FAILED``, the
  exit status is 1) when the average bus bandwidth is below 90% of ``B`` GB/s.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ._sweep import PerfError

ENV_DEVICE = "NCCL_TESTS_DEVICE"
ENV_SPLIT = "NCCL_TESTS_SPLIT"
ENV_SPLIT_MASK = "NCCL_TESTS_SPLIT_MASK"
ENV_MIN_BW = "NCCL_TESTS_MIN_BW"

_SPLIT_OPS = {"and": "&", "&": "&", "or": "|", "|": "|", "mod": "%", "%": "%", "div": "/", "/": "/"}
_SPLIT_RE = re.compile(r"^\s*(and|or|mod|div|[&|%/])\s*(\S+)\s*$", re.IGNORECASE)
_C_INT_MAX = (1 << 31) - 1


def finite_float(name: str, text: str, what: str = "number") -> float:
    """The value of the variable ``name`` set to ``text``: a float, finite; else a
    PerfError naming the variable, its text and what it must be."""
    try:
        value = float(text)
    except ValueError:
        raise PerfError(f"{name}={text!r}: expected a {what}") from None
    if not math.isfinite(value):
        raise PerfError(f"{name}={text!r}: expected a finite {what}")
    return value


def _split_value(name: str, text: str, value: str, base: int = 0) -> int:
    try:
        if base == 0 and value[:2].lower() == "0b":
            number = int(value[2:], 2)
        else:
            number = int(value, base)
    except ValueError:
        raise PerfError(
            f"{name}={text!r}: {value!r} is not a number (decimal, 0x hexadecimal or 0b binary)"
        ) from None
    if not 0 <= number <= _C_INT_MAX:
        raise PerfError(f"{name}={text!r}: the value must be in 0..{_C_INT_MAX}")
    return number


@dataclass(frozen=True)
class NcclTestsEnv:
    """What nccl-tests' variables ask for (see the module docstring)."""

    #: NCCL_TESTS_DEVICE: the first device of a process's ranks (None: not set).
    device: int | None = None
    #: NCCL_TESTS_SPLIT as (operator, value): "&", "|", "%" or "/" (None: one group).
    split: tuple[str, int] | None = None
    #: NCCL_TESTS_MIN_BW in GB/s (None: not checked).
    min_bw: float | None = None
    #: Which variable gave the split (for messages).
    split_var: str = ENV_SPLIT

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NcclTestsEnv:
        """Read and check the variables (a malformed one raises :class:`PerfError`)."""
        env = os.environ if environ is None else environ
        device = None
        text = env.get(ENV_DEVICE)
        if text is not None and text.strip():
            try:
                device = int(text.strip(), 10)
            except ValueError:
                raise PerfError(f"{ENV_DEVICE}={text!r}: expected a device index >= 0") from None
            if device < 0:
                device = None  # nccl-tests' -1: the default placement
        split, split_var = None, ENV_SPLIT
        mask = env.get(ENV_SPLIT_MASK)
        text = env.get(ENV_SPLIT)
        if mask is not None and mask.strip():  # nccl-tests reads the mask first
            split = ("&", _split_value(ENV_SPLIT_MASK, mask, mask.strip(), 16))
            split_var = ENV_SPLIT_MASK
        elif text is not None and text.strip():
            match = _SPLIT_RE.match(text)
            if match is None:
                raise PerfError(
                    f"{ENV_SPLIT}={text!r}: expected an operator (AND, OR, MOD, DIV or &, |, "
                    "%, /) and a value, e.g. 'AND 0x7' or 'MOD 2'"
                )
            op = _SPLIT_OPS[match.group(1).lower()]
            value = _split_value(ENV_SPLIT, text, match.group(2))
            if op in "%/" and value == 0:
                raise PerfError(f"{ENV_SPLIT}={text!r}: cannot divide by 0")
            split = (op, value)
        min_bw = None
        text = env.get(ENV_MIN_BW)
        if text is not None and text.strip():
            min_bw = finite_float(ENV_MIN_BW, text, "bandwidth in GB/s")
            if min_bw == -1:
                min_bw = None  # nccl-tests' "unchecked"
        return cls(device, split, min_bw, split_var)

    def color(self, rank: int) -> int:
        """The NCCL_TESTS_SPLIT group of ``rank`` (0 without a split)."""
        if self.split is None:
            return 0
        op, value = self.split
        if op == "&":
            return rank & value
        if op == "|":
            return rank | value
        if op == "%":
            return rank % value
        return rank // value

    def check_groups(self, nranks: int) -> None:
        """Refuse a split into groups of different sizes, before any rank starts."""
        if self.split is None:
            return
        sizes: dict[int, int] = {}
        for rank in range(nranks):
            color = self.color(rank)
            sizes[color] = sizes.get(color, 0) + 1
        if len(set(sizes.values())) > 1:
            shown = ", ".join(f"{n} (color {c})" for c, n in sorted(sizes.items()))
            raise PerfError(
                f"{self.split_var} splits the {nranks} ranks into groups of {shown} ranks: "
                "pynccl runs the groups' sweeps in step, so every group must have the same size"
            )

    def bandwidth_ok(self, avg: float) -> bool | None:
        """nccl-tests' check of the average bus bandwidth: None when not asked for."""
        if self.min_bw is None:
            return None
        return not avg < self.min_bw * 0.9
