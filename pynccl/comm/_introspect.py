"""The communicator's introspection: :attr:`properties` (``ncclCommQueryProperties``) and
:meth:`algorithms` (NCCL's TUNING lines, ``pynccl.tuning``)."""

from __future__ import annotations

from ._state import HANDLE

__all__ = ["Introspection"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..tuning import AlgorithmRecord
    from ._core import Core
    from ._properties import CommProperties


class Introspection:
    """``properties`` and ``algorithms``: a part of :class:`~pynccl.Communicator`, over
    its core's public surface."""

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

    def algorithms(self, last: int | None = None) -> list[AlgorithmRecord]:
        """Which algorithm NCCL ran for this communicator's recent collectives, as its tuner
        reported it (``NCCL_DEBUG_SUBSYS=TUNING``): one :class:`~pynccl.tuning.
        AlgorithmRecord` per collective, oldest first (the ``last`` ones when given), each
        with ``collective``, ``nbytes``, ``algorithm``, ``protocol``, ``channels`` and
        ``symmetric`` (a symmetric-window kernel or the copy engine ran).

        Needs ``PYNCCL_TRACE_ALGORITHMS=1`` before the library loads
        (:class:`~pynccl.tuning.TracingOffError` otherwise). NCCL reports on rank 0 of a
        communicator only: elsewhere the list is empty. Records are this process's lines
        for this communicator's device; call after the collectives were issued (NCCL
        prints while it plans them, at the call or at the group's end).
        """
        from .. import tuning

        return tuning.recent(last, device=self.core.device)
