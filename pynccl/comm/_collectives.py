"""The collectives' side of :class:`~pynccl.Communicator` (a mixin): the one slow path
every generated method falls back to (:meth:`Collectives._slow`), the issue of a checked
plan, the result check, and the generated methods' signatures for type checkers.

The methods themselves (every row of :data:`~._spec.COLLECTIVES` and its ``_init``) are
generated from the spec table (:mod:`._codegen`) and installed on ``Communicator``.
"""

from __future__ import annotations

from .. import groups as _groups
from ..errors import NotSupportedError
from . import _recorder
from ._args import prepare
from ._observe import Observed
from ._spec import COLLECTIVES, CollSpec

__all__ = ["Collectives"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..typing import BufferLike, DTypeLike, OpLike, StreamLike
    from ._collconfig import CollConfig
    from ._communicator import Communicator
    from ._persistent import PersistentOp

_IN_PROGRESS = 7


class Collectives(Observed):
    """The collectives' shared path (a base of Communicator)."""

    __slots__ = ()

    def _slow(
        self,
        spec: CollSpec,
        sendbuf: object,
        recvbuf: object,
        op: object,
        where: object,
        count: object,
        dtype: object,
        stream: StreamLike,
        config: object = None,
    ) -> None:
        """Every call the generated inline path does not take: checked in full here.
        ``sendbuf``/``recvbuf`` (and ``config``) stay referenced by this frame until the C
        calls return (and by the group, if one is open, until it ends)."""
        self._live()
        comm: Communicator = self  # type: ignore[assignment]  # the only subclass
        plan, s, cfg = prepare(
            comm, spec, sendbuf, recvbuf, op, where, count, dtype, stream, config
        )
        if type(sendbuf) is not int or type(recvbuf) is not int or config is not None:
            _groups.keep_alive((sendbuf, recvbuf, config), comm, s)
        self._run(plan, s, cfg, config)
        if self._captures:  # a Graph capture under way: it keeps what it captured alive
            self._note_capture(s, (sendbuf, recvbuf, config))

    def _run(
        self,
        plan: list[tuple[int, tuple[object, ...]]],
        s: int,
        cfg: object = None,
        config: object = None,
    ) -> None:
        """Issue a checked plan (:func:`._args.prepare`): one call, or a grouped fallback's
        calls inside one group."""
        if len(plan) == 1:
            self._issue(plan[0][0], plan[0][1], s, cfg, config)
            return
        with _groups.group():
            for index, pre in plan:
                self._issue(index, pre, s)

    def _issue(
        self,
        index: int,
        pre: tuple[object, ...],
        s: int,
        cfg: object = None,
        config: object = None,
    ) -> None:
        """One checked C call of row ``index`` (its ``nccl*Config`` variant when ``cfg``,
        the config struct's pointer, is given; ``config`` is the CollConfig recorded)."""
        row = COLLECTIVES[index]
        if cfg is None:
            fn = self._fn[index]
            if fn is None:
                raise NotSupportedError(row.cfunc, row.since, self._lib.version)
        else:  # outside the watchdog's slots: it is told below
            fn = self._lib.raw(row.cfunc + "Config")

        if _groups.OPEN:  # one of the group's communicators (see pynccl.groups)
            _groups.in_progress_later(self)  # type: ignore[arg-type]

        def issue(h: int) -> tuple[int, int]:
            seq = self._seq + 1
            self._seq = seq
            gid = _groups._local.s.gid if _groups.OPEN else 0
            if cfg is None:
                args: tuple[object, ...] = (*pre, h, s)
                slot: tuple[object, ...] = (index, args, gid) if gid else (index, args)
            else:
                args = (*pre, h, s, cfg)
                slot = (index, args, gid, config)
            self._ring[seq & _recorder.RING_MASK] = slot
            return fn(*args), seq

        rc, seq = self._under_gate(issue)
        if rc:
            self._failed(index, rc, cfg is not None)
        elif cfg is not None and self._watch is not None:
            self._watch.enqueued(seq, s)

    def _failed(self, index: int, rc: int, config: bool = False) -> None:
        if rc == _IN_PROGRESS:
            if _groups.group_depth() > 0:
                comm: Communicator = self  # type: ignore[assignment]  # the only subclass
                _groups.in_progress_later(comm)
            else:
                self._mark_pending()
            return
        name = COLLECTIVES[index].cfunc
        raise self._lib.make_error(rc, name + "Config" if config else name)

    if TYPE_CHECKING:
        # Generated from the spec table (see _codegen); declared here for type checkers.
        def all_reduce(
            self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, op: OpLike = ...,
            *, count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def broadcast(
            self, sendbuf: BufferLike | None, recvbuf: BufferLike | None = None, *,
            root: int = 0, count: int | None = None, dtype: DTypeLike = None,
            stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def reduce(
            self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, op: OpLike = ...,
            *, root: int = 0, count: int | None = None, dtype: DTypeLike = None,
            stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def all_gather(
            self, sendbuf: BufferLike, recvbuf: BufferLike, *, count: int | None = None,
            dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def reduce_scatter(
            self, sendbuf: BufferLike, recvbuf: BufferLike, op: OpLike = ..., *,
            count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def gather(
            self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, *, root: int = 0,
            count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def scatter(
            self, sendbuf: BufferLike | None, recvbuf: BufferLike, *, root: int = 0,
            count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def all_to_all(
            self, sendbuf: BufferLike, recvbuf: BufferLike, *, count: int | None = None,
            dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def send(
            self, sendbuf: BufferLike, peer: int, *, count: int | None = None,
            dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def recv(
            self, recvbuf: BufferLike, peer: int, *, count: int | None = None,
            dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> None: ...  # fmt: skip
        def all_reduce_init(
            self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, op: OpLike = ...,
            *, count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip
        def broadcast_init(
            self, sendbuf: BufferLike | None, recvbuf: BufferLike | None = None, *,
            root: int = 0, count: int | None = None, dtype: DTypeLike = None,
            stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip
        def reduce_init(
            self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, op: OpLike = ...,
            *, root: int = 0, count: int | None = None, dtype: DTypeLike = None,
            stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip
        def all_gather_init(
            self, sendbuf: BufferLike, recvbuf: BufferLike, *, count: int | None = None,
            dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip
        def reduce_scatter_init(
            self, sendbuf: BufferLike, recvbuf: BufferLike, op: OpLike = ..., *,
            count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip
        def gather_init(
            self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, *, root: int = 0,
            count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip
        def scatter_init(
            self, sendbuf: BufferLike | None, recvbuf: BufferLike, *, root: int = 0,
            count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip
        def all_to_all_init(
            self, sendbuf: BufferLike, recvbuf: BufferLike, *, count: int | None = None,
            dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip
        def send_init(
            self, sendbuf: BufferLike, peer: int, *, count: int | None = None,
            dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip
        def recv_init(
            self, recvbuf: BufferLike, peer: int, *, count: int | None = None,
            dtype: DTypeLike = None, stream: StreamLike = None,
            config: CollConfig | None = None,
        ) -> PersistentOp: ...  # fmt: skip

