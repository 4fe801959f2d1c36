"""Fault tolerance: ``revoke``, ``shrink``, ``grow_id`` / ``grow`` (the :class:`Resilience`
part of :class:`~pynccl.Communicator`) and the checks of ``Communicator.join``.

* :meth:`Resilience.revoke` (``ncclCommRevoke``, NCCL >= 2.28) stops the in-flight
  operations; the communicator becomes ``"revoked"`` and only :meth:`~Resilience.shrink`,
  ``split()``, ``destroy()`` and ``abort()`` remain.
* :meth:`Resilience.shrink` (``ncclCommShrink``, NCCL >= 2.27) makes a child of the ranks
  not excluded, renumbered in order; ``abort=True`` (``NCCL_SHRINK_ABORT``) first
  terminates the parent's operations, which is what works after a peer died; the
  parent's ``destroy()`` then aborts it (NCCL >= 2.31.2's destroy would wait for the
  ranks that aborted).
* :meth:`Resilience.grow_id` / :meth:`Resilience.grow` on the existing ranks and
  ``Communicator.join`` on the new ones (``ncclCommGetUniqueId`` / ``ncclCommGrow``,
  NCCL >= 2.29) make a larger communicator in which the existing ranks keep their numbers.

None of them can be captured in a CUDA graph, and shrink, grow and join cannot be issued
inside a ``group()`` (NCCL would write the new handle at the group's end): each says so
before calling anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from ctypes import byref, c_int

from .. import groups as _groups
from .._capi.structs import ncclUniqueId
from .._limits import C_INT_MAX, check_c_int, check_index
from ..enums import Result, RevokeFlag, ShrinkFlag
from ..errors import NcclInvalidUsage
from ._state import HANDLE, State
from ._uid import UniqueId, as_unique_ids

__all__ = ["Resilience", "check_config", "join_args", "refuse_in_group"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._communicator import Communicator
    from ._config import Config
    from ._extras import Extras


def refuse_in_group(function: str) -> None:
    """An init-like call inside a group would leave the new handle to be written at the
    group's end, after this call has returned: refuse it, clearly."""
    if _groups.group_depth() > 0:
        raise NcclInvalidUsage(
            Result.INVALID_USAGE,
            function,
            f"{function} cannot be issued inside a group(); call it outside the group "
            "(from one thread per rank)",
        )


def check_config(config: object) -> None:
    from ._config import Config

    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a pynccl.Config, got {type(config).__name__}")


def _one_id(unique_id: object) -> UniqueId:
    ids = as_unique_ids(unique_id)
    if len(ids) != 1:
        raise ValueError(f"unique_id must be one unique id (from grow_id()), got {len(ids)}")
    return ids[0]


def join_args(
    nranks: int, unique_id: UniqueId | bytes, rank: int, device: int | None, config: object
) -> tuple[int, UniqueId, int, int | None]:
    """:meth:`Communicator.join`'s arguments, checked: ``(nranks, id, rank, device)``."""
    nranks = check_c_int(nranks, "nranks", 1, C_INT_MAX)
    rank = check_index(rank, "rank", nranks, f"for a communicator of size {nranks}")
    if device is not None:
        device = check_c_int(device, "device", 0)
    uid = _one_id(unique_id)
    check_config(config)
    return nranks, uid, rank, device


class Resilience:
    """revoke, shrink and grow: a part of :class:`~pynccl.Communicator`, over its core's
    public surface (and the split part, which makes children)."""

    __slots__ = ("core", "extras")

    def __init__(self, core: Communicator, extras: Extras) -> None:
        self.core = core
        self.extras = extras

    def _new_child(
        self,
        function: str,
        pre: tuple[object, ...],
        post: tuple[object, ...],
        config: Config | None,
        ready: bool,
    ) -> Communicator:
        """:meth:`~._extras.Extras.new_comm` for a call that always makes a child."""
        child = self.extras.new_comm(function, pre, post, config, ready=ready)
        if child is None:
            raise self.core.library.make_error(Result.INTERNAL_ERROR, function)
        return child

    # -- revoke --------------------------------------------------------------------------

    def revoke(self) -> None:
        """``ncclCommRevoke`` (NCCL >= 2.28): stop every operation in flight on this rank
        (a hung one included) and wait until the communicator is quiescent.

        The communicator is then ``"revoked"``: collectives and most verbs raise
        :class:`~pynccl.NcclInvalidUsage` saying so; :meth:`shrink` (every surviving
        rank, usually with ``abort=True``), ``split()``, ``destroy()`` and ``abort()``
        remain (NCCL: "safe for destroy, split, and shrink").
        A second call does nothing.
        """
        core = self.core
        core.require("revoke", "ncclCommRevoke")
        if core.state is State.REVOKED:
            return
        core.live()
        core.refuse_if_capturing("ncclCommRevoke")
        flags = int(RevokeFlag.DEFAULT)
        rc = core.call_locked("ncclCommRevoke", HANDLE, flags, then=State.REVOKED)
        if rc == Result.IN_PROGRESS:  # non-blocking: quiescent once the async error is success
            core.wait_ready()

    # -- shrink --------------------------------------------------------------------------

    def shrink(
        self, exclude: Sequence[int], *, abort: bool = False, config: Config | None = None
    ) -> Communicator:
        """``ncclCommShrink`` (NCCL >= 2.27): a new communicator of the ranks not in
        ``exclude``, renumbered in order (rank r becomes r minus the excluded ranks below
        it). Every remaining rank calls it with the same ``exclude``; the excluded ranks
        do not call it (they may be dead).

        ``abort=True`` (``NCCL_SHRINK_ABORT``) first terminates this communicator's
        operations (needed when a peer died or after :meth:`revoke`); the default waits
        for them. ``config=None`` inherits this communicator's configuration. This
        communicator stays to be destroyed or aborted; after ``abort=True`` its
        ``destroy()`` aborts it (with NCCL >= 2.31.2 a destroy would wait for ever in a
        barrier with the ranks that aborted, pytorch#194775). ``exclude`` must not be
        empty (NCCL refuses an empty exclusion list).
        """
        core = self.core
        core.require("shrink", "ncclCommShrink")
        if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Sequence):
            raise TypeError(
                f"exclude must be a sequence of ranks, got {type(exclude).__name__} {exclude!r}"
            )
        if type(abort) is not bool:
            raise TypeError(f"abort must be a bool, got {type(abort).__name__} {abort!r}")
        check_config(config)
        size, me = core.size, core.rank
        ranks: list[int] = []
        for i, value in enumerate(exclude):
            r = check_index(value, f"exclude[{i}]", size, f"for a communicator of size {size}")
            if r in ranks:
                raise ValueError(f"exclude names rank {r} twice: {list(exclude)!r}")
            if r == me:
                raise ValueError(
                    f"exclude names rank {r}, the caller: excluded ranks do not call shrink()"
                )
            ranks.append(r)
        revoked = core.state is State.REVOKED
        if not revoked:
            core.live()
        core.refuse_if_capturing("ncclCommShrink")
        refuse_in_group("ncclCommShrink")
        if not ranks:  # after the state checks, as every verb reports its state first
            raise ValueError(
                "exclude must name at least one rank to remove, got an empty sequence "
                "(NCCL returns ncclInvalidArgument for an empty exclusion list); "
                "split() makes a copy of a communicator"
            )
        array = (c_int * len(ranks))(*ranks)
        flags = int(ShrinkFlag.ABORT if abort else ShrinkFlag.DEFAULT)
        pre = (HANDLE, array, len(ranks))
        child = self._new_child("ncclCommShrink", pre, (flags,), config, ready=not revoked)
        if abort:
            # Its operations were terminated; from NCCL 2.31.2 on, its destroy would wait
            # in a barrier for the ranks that aborted (pytorch#194775): destroy() aborts.
            core.abort_at_destroy()
        return child

    # -- grow ----------------------------------------------------------------------------

    def grow_id(self) -> UniqueId:
        """``ncclCommGetUniqueId`` (NCCL >= 2.29): the id of a :meth:`grow`, taken by one
        existing rank (the *root* of the grow, usually rank 0) and handed to the new
        ranks (for :meth:`join`). A new id can be taken once the previous one was used."""
        core = self.core
        core.require("grow_id", "ncclCommGetUniqueId")
        core.live()
        core.refuse_if_capturing("ncclCommGetUniqueId")
        uid = ncclUniqueId()
        core.call_locked("ncclCommGetUniqueId", HANDLE, byref(uid))
        return UniqueId(bytes(uid))

    def grow(
        self,
        nranks: int,
        unique_id: UniqueId | bytes | None = None,
        *,
        config: Config | None = None,
    ) -> Communicator:
        """``ncclCommGrow`` (NCCL >= 2.29) on an existing rank: a communicator of
        ``nranks`` ranks in which every existing rank keeps its number and the new ranks
        (:meth:`join`) take the others.

        The rank that took the id with :meth:`grow_id` passes it as ``unique_id``; the
        other existing ranks pass None. Returns once every rank has joined.
        """
        core = self.core
        core.require("grow", "ncclCommGrow")
        size = core.size
        nranks = check_c_int(
            nranks, "nranks", size + 1, C_INT_MAX, f"(more than the communicator's {size} ranks)"
        )
        uid = None if unique_id is None else _one_id(unique_id)
        check_config(config)
        core.live()
        core.refuse_if_capturing("ncclCommGrow")
        refuse_in_group("ncclCommGrow")
        ref = None if uid is None else byref(uid.struct)
        return self._new_child("ncclCommGrow", (HANDLE, nranks, ref, -1), (), config, ready=True)
