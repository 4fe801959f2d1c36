"""The object API: :class:`UniqueId`, :class:`Config` and :class:`Communicator`.

A package by role (see docs/architecture.md): ``_spec`` (the table of collectives, typed),
``_args`` (the fast path's value-keyed tables and the checked path with its argument rules),
``_fallback`` (grouped send/recv plans below 2.28), ``_recorder`` (the flight recorder),
``_watchdog``; the core of a communicator (``_handle``: state machine and gate,
``_observe``, ``_watched``, ``_core``), its parts over the core's public surface
(``_memory``, ``_window``, ``_signals``, ``_suspend``, ``_extras``, ``_resilience``,
``_vcoll``, ``_introspect``), ``_collectives`` (every collective, through the one fast
path),
``_communicator`` (the class), ``_uid``, ``_config``, ``_collconfig`` (per-call
``CollConfig``), ``_persistent`` (``<method>_init`` operations), ``_work`` (completion handles) and
``_from_env``.

Importing it loads no library; it avoids :mod:`dataclasses`, :mod:`typing` and
:mod:`hashlib`, so that the first use of the object API stays cheap.
"""

from __future__ import annotations

from ._collconfig import CollConfig
from ._communicator import Communicator
from ._config import Config
from ._memory import Registration
from ._signals import SignalWait
from ._state import State
from ._uid import UniqueId
from ._window import Window
from ._work import Work

__all__ = [
    "CollConfig",
    "CommProperties",
    "Communicator",
    "Config",
    "Params",
    "PeerArray",
    "PersistentOp",
    "Registration",
    "SignalWait",
    "State",
    "UniqueId",
    "Window",
    "Work",
    "from_env",
    "params",
]


# Loaded on first access: `_properties` imports dataclasses, `_params` builds a mapping.
_LAZY = {
    "PeerArray": "_peerview",
    "from_env": "_from_env",
    "CommProperties": "_properties",
    "Params": "_params",
    "params": "_params",
    "PersistentOp": "_persistent",  # imported with the first persistent operation
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is not None:
        return getattr(__import__(f"{__name__}.{module}", fromlist=[name]), name)
    raise AttributeError(f"module 'pynccl.comm' has no attribute {name!r}")
