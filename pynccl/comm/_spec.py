"""The table of collectives: one row per method of :class:`~pynccl.Communicator` that
issues NCCL work (every collective, plus ``send`` and ``recv``).

Each row is data about the C call, in small enums: its name and first release, whether it
takes an op, a root or a peer (:class:`Where`), how large its buffers are in units of
``count`` (:class:`Extent`), on which ranks NCCL reads or writes them (:class:`On`), its
in-place form (:class:`InPlace`), and whether it has a grouped send/recv fallback below
NCCL 2.28. The checked path (:mod:`._args`), the fallback (:mod:`._fallback`), the flight
recorder and ``perf`` read these rows; ``tests/comm/test_spec.py`` compares them with the
loopback libnccl's own table (``collectives.h``), so the two cannot drift.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["COLLECTIVES", "CollSpec", "Extent", "InPlace", "On", "Side", "Where", "by_cfunc",
           "by_method"]  # fmt: skip

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..enums import Release


class Extent(Enum):
    """How many elements a buffer spans, in units of ``count``."""

    NONE = "-"  #: the call has no such buffer
    COUNT = "1"  #: ``count`` elements
    PER_RANK = "n"  #: ``count * nranks`` elements


class Where(Enum):
    """The rank argument a call takes."""

    NONE = ""
    ROOT = "root"
    PEER = "peer"


class On(Enum):
    """The ranks on which NCCL reads (send) or writes (recv) a buffer; elsewhere it may be
    ``None``."""

    ALL = "all"
    ROOT = "root"


class InPlace(Enum):
    """How a call is made in place."""

    NONE = ""  #: it is not
    RECVBUF_NONE = "recvbuf=None"  #: omit ``recvbuf``
    OFFSET = "offset"  #: NCCL's form: ``sendbuf`` is this rank's block of ``recvbuf``


class Side(Enum):
    """A buffer argument."""

    SEND = "send"
    RECV = "recv"


#: A row as the fast path reads it, in one tuple: ``(index, has_op, takes a root or peer,
#: in place by omitting recvbuf, has no send buffer, has no recv buffer, layout, send spans
#: count * nranks, recv spans count * nranks, the count comes from sendbuf, its buffers
#: matter on the root only)``.
Fast = tuple[int, bool, bool, bool, bool, bool, int, bool, bool, bool, bool]


class CollSpec:
    """One row of :data:`COLLECTIVES` (read-only by convention)."""

    __slots__ = ("cfunc", "count_from", "fallback", "fast", "has_op", "in_place", "index",
                 "layout", "method", "recv", "recv_on", "send", "send_on", "since",
                 "where")  # fmt: skip

    def __init__(
        self,
        method: str,
        cfunc: str,
        since: Release,
        *,
        send: Extent,
        recv: Extent,
        count_from: Side,
        has_op: bool = False,
        where: Where = Where.NONE,
        send_on: On = On.ALL,
        recv_on: On = On.ALL,
        in_place: InPlace = InPlace.NONE,
        fallback: bool = False,
    ) -> None:
        self.method = method  #: the ``Communicator`` method (``"all_reduce"``)
        self.cfunc = cfunc  #: the C function (``"ncclAllReduce"``)
        self.since = since  #: first NCCL release exporting ``cfunc``
        self.send = send
        self.recv = recv
        #: The buffer that gives NCCL's count when ``count=`` is omitted.
        self.count_from = count_from
        self.has_op = has_op
        self.where = where
        self.send_on = send_on
        self.recv_on = recv_on
        self.in_place = in_place
        #: Below NCCL 2.28 (no native call) it is issued as grouped ``ncclSend``/``ncclRecv``.
        self.fallback = fallback
        self.index = -1  #: position in :data:`COLLECTIVES` (set below)
        #: The C arguments before ``(comm, stream)``: 0 ``(send, recv, count, type)``, 1 the
        #: same and ``op``, 2 and ``root``, 3 and ``op, root``; 4 ``(send, count, type,
        #: peer)``; 5 ``(recv, count, type, peer)``.
        self.layout = (4 if recv is Extent.NONE else 5 if send is Extent.NONE else
                       has_op + 2 * (where is Where.ROOT))  # fmt: skip
        #: What the fast path reads of the row, in one tuple (set below): see :data:`Fast`.
        self.fast: Fast = (-1, False, False, False, False, False, -1, False, False, False,
                           False)  # fmt: skip

    def extent(self, side: Side) -> Extent:
        return self.send if side is Side.SEND else self.recv

    def multiplier(self, side: Side, nranks: int) -> int:
        """Elements of the ``side`` buffer per ``count``."""
        kind = self.extent(side)
        return 0 if kind is Extent.NONE else nranks if kind is Extent.PER_RANK else 1

    def on(self, side: Side) -> On:
        return self.send_on if side is Side.SEND else self.recv_on

    def __repr__(self) -> str:
        return f"<CollSpec {self.method} ({self.cfunc})>"


_1, _N, _0 = Extent.COUNT, Extent.PER_RANK, Extent.NONE
_S, _R = Side.SEND, Side.RECV
_ROOT = On.ROOT

ALL_REDUCE = CollSpec("all_reduce", "ncclAllReduce", (2, 3, 5), send=_1, recv=_1,
                      count_from=_S, has_op=True, in_place=InPlace.RECVBUF_NONE)  # fmt: skip
BROADCAST = CollSpec("broadcast", "ncclBroadcast", (2, 3, 5), send=_1, recv=_1, count_from=_S,
                     where=Where.ROOT, send_on=_ROOT, in_place=InPlace.RECVBUF_NONE)  # fmt: skip
REDUCE = CollSpec("reduce", "ncclReduce", (2, 3, 5), send=_1, recv=_1, count_from=_S,
                  has_op=True, where=Where.ROOT, recv_on=_ROOT,
                  in_place=InPlace.RECVBUF_NONE)  # fmt: skip
ALL_GATHER = CollSpec("all_gather", "ncclAllGather", (2, 3, 5), send=_1, recv=_N,
                      count_from=_S, in_place=InPlace.OFFSET)  # fmt: skip
REDUCE_SCATTER = CollSpec("reduce_scatter", "ncclReduceScatter", (2, 3, 5), send=_N, recv=_1,
                          count_from=_R, has_op=True, in_place=InPlace.OFFSET)  # fmt: skip
GATHER = CollSpec("gather", "ncclGather", (2, 28, 3), send=_1, recv=_N, count_from=_S,
                  where=Where.ROOT, recv_on=_ROOT, in_place=InPlace.OFFSET,
                  fallback=True)  # fmt: skip
SCATTER = CollSpec("scatter", "ncclScatter", (2, 28, 3), send=_N, recv=_1, count_from=_R,
                   where=Where.ROOT, send_on=_ROOT, in_place=InPlace.OFFSET,
                   fallback=True)  # fmt: skip
ALL_TO_ALL = CollSpec("all_to_all", "ncclAlltoAll", (2, 28, 3), send=_N, recv=_N,
                      count_from=_S, fallback=True)  # fmt: skip
SEND = CollSpec("send", "ncclSend", (2, 7, 3), send=_1, recv=_0, count_from=_S,
                where=Where.PEER)  # fmt: skip
RECV = CollSpec("recv", "ncclRecv", (2, 7, 3), send=_0, recv=_1, count_from=_R,
                where=Where.PEER)  # fmt: skip

COLLECTIVES: tuple[CollSpec, ...] = (ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER,
                                     GATHER, SCATTER, ALL_TO_ALL, SEND, RECV)  # fmt: skip
for _i, _row in enumerate(COLLECTIVES):
    _row.index = _i
    _row.fast = (_i, _row.has_op, _row.where is not Where.NONE,
                 _row.in_place is InPlace.RECVBUF_NONE, _row.send is Extent.NONE,
                 _row.recv is Extent.NONE, _row.layout, _row.send is Extent.PER_RANK,
                 _row.recv is Extent.PER_RANK, _row.count_from is Side.SEND,
                 _row.send_on is not _row.recv_on)  # fmt: skip
del _i, _row

_BY_METHOD = {row.method: row for row in COLLECTIVES}
_BY_CFUNC = {row.cfunc: row for row in COLLECTIVES}


def by_method(name: str) -> CollSpec:
    """The row of method ``name`` (``KeyError`` if none)."""
    return _BY_METHOD[name]


def by_cfunc(name: str) -> CollSpec:
    """The row of C function ``name`` (``KeyError`` if none)."""
    return _BY_CFUNC[name]
