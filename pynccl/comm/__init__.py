"""The object API: :class:`UniqueId`, :class:`Config` and :class:`Communicator`.

A package by role (see the README's layout table): ``_spec`` (the table of collectives),
``_codegen`` (rows -> methods), ``_args`` (the one slow path and its argument rules),
``_fallback`` (grouped send/recv plans below 2.28), ``_handle`` (the state machine and the
gate), ``_recorder`` (the flight recorder), ``_watchdog``, ``_observe`` / ``_extras`` /
``_collectives`` (the collectives' slow path) / ``_communicator`` (the class), ``_uid``,
``_config``, ``_collconfig`` (per-call ``CollConfig``), ``_persistent`` (``<method>_init``
operations) and ``_from_env``.

Importing it loads no library; it avoids :mod:`dataclasses`, :mod:`typing` and
:mod:`hashlib`, so that the first use of the object API stays cheap.
"""

from __future__ import annotations

from ._collconfig import CollConfig
from ._communicator import Communicator
from ._config import Config
from ._handle import State
from ._uid import UniqueId

__all__ = ["CollConfig", "Communicator", "Config", "PersistentOp", "State", "UniqueId", "from_env"]


def __getattr__(name: str) -> object:
    if name == "from_env":
        from ._from_env import from_env

        return from_env
    if name == "PersistentOp":  # imported with the first generated method
        from ._persistent import PersistentOp

        return PersistentOp
    raise AttributeError(f"module 'pynccl.comm' has no attribute {name!r}")
