"""Compatibility: the watchdog and the flight recorder moved into :mod:`pynccl.comm`
(``pynccl.comm._watchdog``, ``pynccl.comm._recorder``); these names stay importable."""

from __future__ import annotations

from .comm._recorder import RING_MASK, RING_SIZE, FlightRecord, format_record
from .comm._watchdog import Watchdog

__all__ = ["RING_MASK", "RING_SIZE", "FlightRecord", "Watchdog", "format_record"]
