"""The table of collectives: one row per method of :class:`~pynccl.Communicator` that
issues NCCL work (every collective, plus ``send`` and ``recv``).

Each row is data about the C call: its name and first release, whether it takes an op,
a root or a peer, how large its buffers are (in units of ``count``: ``"1"`` or ``"n"``
for ``count * nranks``, ``"-"`` for none), on which ranks NCCL reads/writes them, its
in-place rule and its fallback below NCCL 2.28. The methods are generated from these rows
(:mod:`._codegen`); the flight recorder and ``perf`` read the same rows.
"""

from __future__ import annotations

__all__ = ["COLLECTIVES", "CollSpec", "by_cfunc", "by_method"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..enums import Release


class CollSpec:
    """One row of :data:`COLLECTIVES` (read-only by convention; compared by value)."""

    __slots__ = (
        "cfunc",
        "count_from",
        "doc",
        "fallback",
        "has_op",
        "in_place",
        "index",
        "method",
        "recv",
        "recv_on",
        "send",
        "send_on",
        "since",
        "where",
    )

    def __init__(
        self,
        method: str,
        cfunc: str,
        since: Release,
        *,
        send: str,
        recv: str,
        count_from: str,
        has_op: bool = False,
        where: str = "",
        send_on: str = "all",
        recv_on: str = "all",
        in_place: str = "",
        fallback: str = "",
        doc: str = "",
    ) -> None:
        #: The ``Communicator`` method (``"all_reduce"``).
        self.method = method
        #: The C function (``"ncclAllReduce"``).
        self.cfunc = cfunc
        #: First NCCL release exporting ``cfunc``.
        self.since = since
        #: ``send`` / ``recv`` buffer sizes in units of ``count``: ``"1"``, ``"n"``
        #: (``count * nranks``) or ``"-"`` (no such buffer).
        self.send = send
        self.recv = recv
        #: Which buffer gives NCCL's count when ``count=`` is omitted: ``"send"``/``"recv"``.
        self.count_from = count_from
        #: Takes a reduction op.
        self.has_op = has_op
        #: ``"root"``, ``"peer"`` or ``""``: the rank argument it takes.
        self.where = where
        #: ``"all"`` or ``"root"``: the ranks on which NCCL reads sendbuf / writes recvbuf;
        #: elsewhere the buffer may be ``None``.
        self.send_on = send_on
        self.recv_on = recv_on
        #: ``"recvbuf=None"`` (omit recvbuf to work in place), ``"offset"`` (NCCL's in-place
        #: form: sendbuf is this rank's block of recvbuf) or ``""`` (none).
        self.in_place = in_place
        #: Below 2.28 (no native call): ``"grouped send/recv"``; ``""`` when always native.
        self.fallback = fallback
        #: The method's docstring.
        self.doc = doc
        #: Position in :data:`COLLECTIVES` (set below).
        self.index = -1

    def multiplier(self, which: str, nranks: int) -> int:
        """Elements of the ``which`` (``"send"``/``"recv"``) buffer per ``count``."""
        kind = self.send if which == "send" else self.recv
        return 0 if kind == "-" else nranks if kind == "n" else 1

    def __repr__(self) -> str:
        return f"<CollSpec {self.method} ({self.cfunc})>"


_COMMON = """

``count`` is NCCL's ``count`` ({unit}); omitted, it is read from {count_from}. Buffers are
raw device pointers (``int``, with ``count=`` and ``dtype=``), ``DeviceBuffer`` objects or
objects exposing ``__cuda_array_interface__`` or DLPack on this communicator's device.
``stream=None`` uses :attr:`stream`.{extra}"""

COLLECTIVES: tuple[CollSpec, ...] = (
    CollSpec(
        "all_reduce",
        "ncclAllReduce",
        (2, 3, 5),
        send="1",
        recv="1",
        count_from="send",
        has_op=True,
        in_place="recvbuf=None",
        doc="``ncclAllReduce``: every rank gets op(sendbuf of all ranks) in ``recvbuf``.\n\n"
        "``recvbuf=None`` reduces in place into ``sendbuf``.",
    ),
    CollSpec(
        "broadcast",
        "ncclBroadcast",
        (2, 3, 5),
        send="1",
        recv="1",
        count_from="send",
        where="root",
        send_on="root",
        in_place="recvbuf=None",
        doc="``ncclBroadcast``: copy ``root``'s ``sendbuf`` into every rank's ``recvbuf``.\n\n"
        "``recvbuf=None`` broadcasts in place in ``sendbuf``; on the other ranks ``sendbuf`` "
        "may be ``None`` (NCCL reads it on the root only).",
    ),
    CollSpec(
        "reduce",
        "ncclReduce",
        (2, 3, 5),
        send="1",
        recv="1",
        count_from="send",
        has_op=True,
        where="root",
        recv_on="root",
        in_place="recvbuf=None",
        doc="``ncclReduce``: op(sendbuf of all ranks) into ``root``'s ``recvbuf``.\n\n"
        "``recvbuf=None`` reduces in place (on the root the result lands in ``sendbuf``).",
    ),
    CollSpec(
        "all_gather",
        "ncclAllGather",
        (2, 3, 5),
        send="1",
        recv="n",
        count_from="send",
        in_place="offset",
        doc="``ncclAllGather``: ``recvbuf`` = every rank's ``sendbuf`` (``count`` each), by rank.",
    ),
    CollSpec(
        "reduce_scatter",
        "ncclReduceScatter",
        (2, 3, 5),
        send="n",
        recv="1",
        count_from="recv",
        has_op=True,
        in_place="offset",
        doc="``ncclReduceScatter``: rank r gets block r (``count`` elements) of op(sendbuf).",
    ),
    CollSpec(
        "gather",
        "ncclGather",
        (2, 28, 3),
        send="1",
        recv="n",
        count_from="send",
        where="root",
        recv_on="root",
        in_place="offset",
        fallback="grouped send/recv",
        doc="Gather ``count`` elements from each rank into ``root``'s ``recvbuf``, in rank "
        "order.\n\n``ncclGather`` where the library has it (NCCL >= 2.28), otherwise grouped "
        "``ncclSend``/``ncclRecv`` with the same result. ``recvbuf`` matters on the root only "
        "(may be ``None`` elsewhere).",
    ),
    CollSpec(
        "scatter",
        "ncclScatter",
        (2, 28, 3),
        send="n",
        recv="1",
        count_from="recv",
        where="root",
        send_on="root",
        in_place="offset",
        fallback="grouped send/recv",
        doc="Scatter block r (``count`` elements) of ``root``'s ``sendbuf`` to rank r's "
        "``recvbuf``.\n\n``ncclScatter`` where available (NCCL >= 2.28), otherwise grouped "
        "send/recv. ``sendbuf`` matters on the root only (may be ``None`` elsewhere).",
    ),
    CollSpec(
        "all_to_all",
        "ncclAlltoAll",
        (2, 28, 3),
        send="n",
        recv="n",
        count_from="send",
        fallback="grouped send/recv",
        doc="Send block r (``count`` elements) of ``sendbuf`` to rank r; receive rank r's "
        "block for this rank into block r of ``recvbuf``.\n\n``ncclAlltoAll`` where available "
        "(NCCL >= 2.28), otherwise grouped send/recv. ``count`` defaults to "
        "``len(sendbuf) // size``.",
    ),
    CollSpec(
        "send",
        "ncclSend",
        (2, 7, 3),
        send="1",
        recv="-",
        count_from="send",
        where="peer",
        doc="``ncclSend`` (NCCL >= 2.7): send ``count`` elements to ``peer`` (pair with its recv).",
    ),
    CollSpec(
        "recv",
        "ncclRecv",
        (2, 7, 3),
        send="-",
        recv="1",
        count_from="recv",
        where="peer",
        doc="``ncclRecv`` (NCCL >= 2.7): receive ``count`` elements from ``peer``.",
    ),
)

for _i, _row in enumerate(COLLECTIVES):
    _row.index = _i
    _unit = "elements per rank" if "n" in (_row.send, _row.recv) else "elements"
    _src = "``sendbuf``" if _row.count_from == "send" else "``recvbuf``"
    _row.doc += _COMMON.format(unit=_unit, count_from=_src, extra="")
del _i, _row, _unit, _src

_BY_METHOD = {row.method: row for row in COLLECTIVES}
_BY_CFUNC = {row.cfunc: row for row in COLLECTIVES}


def by_method(name: str) -> CollSpec:
    """The row of method ``name`` (``KeyError`` if none)."""
    return _BY_METHOD[name]


def by_cfunc(name: str) -> CollSpec:
    """The row of C function ``name`` (``KeyError`` if none)."""
    return _BY_CFUNC[name]
