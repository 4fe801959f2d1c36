"""The communicator's introspection: :attr:`properties` (``ncclCommQueryProperties``)."""

from __future__ import annotations

from ._state import HANDLE

__all__ = ["Introspection"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._core import Core
    from ._properties import CommProperties


class Introspection:
    """``properties``: a part of :class:`~pynccl.Communicator`, over its core's public
    surface."""

    __slots__ = ("core",)

    def __init__(self, core: Core) -> None:
        self.core = core

    @property
    def properties(self) -> CommProperties:
        """A :class:`~pynccl.CommProperties` from ``ncclCommQueryProperties`` (NCCL >=
        2.29.2; :class:`~pynccl.NotSupportedError` before): ``rank``, ``size``, ``device``
        and every other field the loaded release fills (``None`` where it is too old).

        Queried on each read (nothing is cached: the values belong to this handle, and
        the call is cheap); works in any state but a terminal one, waiting for a
        non-blocking initialisation to finish first.
        """
        from ._properties import query

        core = self.core
        return query(core.library, lambda p: core.call_locked("ncclCommQueryProperties", HANDLE, p))
