"""Exceptions raised while finding the launch environment and sharing unique ids.

None of these messages ever contain a unique id or a rendezvous key: ids are
secrets of the job (whoever holds one can join the communicator).
"""

from __future__ import annotations

__all__ = [
    "LaunchEnvError",
    "RendezvousAddressError",
    "RendezvousAuthError",
    "RendezvousError",
    "RendezvousMismatchError",
    "RendezvousProtocolError",
    "RendezvousTimeoutError",
]


class LaunchEnvError(ValueError):
    """The launcher's environment variables are missing, malformed or contradictory.

    ``launcher`` names the convention that was detected (one of
    :data:`~pynccl.bootstrap.LAUNCHERS`: ``"torchrun"``, ``"env"``, ``"openmpi"``,
    ``"slurm"``, ...; ``"explicit"`` for ``from_env(rank=..., world_size=...)``) or is
    ``None`` when none was.
    """

    def __init__(self, message: str, launcher: str | None = None) -> None:
        super().__init__(message)
        self.launcher = launcher


class RendezvousError(RuntimeError):
    """Sharing the unique id between ranks failed."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """A rank did not get (or rank 0 did not hand out) the id within the timeout."""


class RendezvousAuthError(RendezvousError):
    """The two sides do not share the same rendezvous key (or one side has none)."""


class RendezvousMismatchError(RendezvousError):
    """The peer belongs to a different job: world size or rank do not fit."""


class RendezvousProtocolError(RendezvousError):
    """The peer sent something that is not a well-formed rendezvous message."""


class RendezvousAddressError(RendezvousError, OSError):
    """Rank 0 could not listen on the rendezvous address (port taken, address not local)."""
