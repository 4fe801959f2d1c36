"""A communicator's states (:class:`State`), the terminal ones, the :data:`HANDLE`
placeholder of :meth:`~._handle.CommHandle.call_locked`, and the registry of live
communicators (walked when a CUDA-graph capture begins or ends)."""

from __future__ import annotations

from _weakref import ref as _ref
from enum import Enum

__all__ = ["GONE_TAILS", "HANDLE", "TERMINAL", "State", "live_handles", "track"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class State(str, Enum):
    """A communicator's state (compares equal to its value: ``comm.state == "ready"``)."""

    INITIALIZING = "initializing"  #: a non-blocking init/split/finalize still in progress
    READY = "ready"
    FINALIZED = "finalized"  #: ncclCommFinalize done; only destroy is left
    SUSPENDED = "suspended"  #: ncclCommSuspend (NCCL >= 2.29) done; resume() readies it
    REVOKED = "revoked"  #: ncclCommRevoke (NCCL >= 2.28): only split, shrink, destroy, abort left
    DESTROYED = "destroyed"
    ABORTED = "aborted"
    CLOSED = "closed"  #: a borrowed handle, forgotten

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({State.DESTROYED, State.ABORTED, State.CLOSED})
#: Stands for the communicator's handle in the arguments of ``call_locked``.
HANDLE = object()
#: What a communicator in a non-terminal state without a usable handle still allows.
GONE_TAILS = {
    State.SUSPENDED: "call resume() first",
    State.REVOKED: "only split(), shrink(), destroy() or abort() are possible",
}
#: Every communicator that adopted a handle and still exists, as weak references (each
#: drops itself when its communicator goes). A set of references rather than a WeakSet:
#: listing a WeakSet iterates it in Python, and a communicator made or collected on
#: another thread meanwhile (any time without the GIL, at a switch with it) ends that
#: with "Set changed size during iteration"; ``set.copy()`` is one C call, atomic under
#: the GIL and under the set's own lock in a free-threaded build.
_LIVE: set[Any] = set()


def track(comm: object) -> None:
    """Remember ``comm`` (weakly) as a communicator that adopted a handle."""
    _LIVE.add(_ref(comm, _LIVE.discard))


def live_handles() -> list[Any]:
    """The communicators alive now that adopted a handle."""
    return [comm for comm in map(_ref.__call__, _LIVE.copy()) if comm is not None]
