"""The docstrings of the collectives (:mod:`._collectives`): one text per row of the spec,
and the sentences every collective shares."""

from __future__ import annotations

from ._spec import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BROADCAST,
    GATHER,
    RECV,
    REDUCE,
    REDUCE_SCATTER,
    SCATTER,
    SEND,
    CollSpec,
    Extent,
)

__all__ = ["attach"]

_COMMON = """

``count`` is NCCL's ``count`` ({unit}); omitted, it is read from ``{count_from}``. Buffers
are raw device pointers (``int``, with ``count=`` and ``dtype=``), ``DeviceBuffer`` objects
or objects exposing ``__cuda_array_interface__`` or DLPack on this communicator's device.
``dtype`` is a :class:`~pynccl.DataType`, its name (``"float32"``, ``"bf16"``), a numpy
dtype or scalar type, or a torch/CuPy dtype; ``op`` a :class:`~pynccl.RedOp`, its name or
an op from :meth:`create_premul_sum`. ``stream=None`` uses :attr:`stream`; an ``int``
handle, a :class:`~pynccl.cuda.Stream` or any stream protocol object is taken too.
``config=`` (a :class:`CollConfig`, NCCL >= 2.31) issues the ``nccl*Config`` variant.
``async_op=True`` returns a :class:`~pynccl.Work` for this operation (else None)."""


def _doc(row: CollSpec, text: str) -> str:
    unit = "elements per rank" if Extent.PER_RANK in (row.send, row.recv) else "elements"
    return text + _COMMON.format(unit=unit, count_from=row.count_from.value + "buf")

_DOCS = {
    ALL_REDUCE: "``ncclAllReduce``: every rank gets op(sendbuf of all ranks) in ``recvbuf``."
    "\n\n``recvbuf=None`` reduces in place into ``sendbuf``.",
    BROADCAST: "``ncclBroadcast``: copy ``root``'s ``sendbuf`` into every rank's ``recvbuf``."
    "\n\n``recvbuf=None`` broadcasts in place in ``sendbuf``; on the other ranks ``sendbuf`` "
    "may be ``None`` (NCCL reads it on the root only).",
    REDUCE: "``ncclReduce``: op(sendbuf of all ranks) into ``root``'s ``recvbuf``.\n\n"
    "``recvbuf=None`` reduces in place (on the root the result lands in ``sendbuf``).",
    ALL_GATHER: "``ncclAllGather``: ``recvbuf`` = every rank's ``sendbuf`` (``count`` each), "
    "by rank.",
    REDUCE_SCATTER: "``ncclReduceScatter``: rank r gets block r (``count`` elements) of "
    "op(sendbuf).",
    GATHER: "Gather ``count`` elements from each rank into ``root``'s ``recvbuf``, in rank "
    "order.\n\n``ncclGather`` where the library has it (NCCL >= 2.28), otherwise grouped "
    "``ncclSend``/``ncclRecv`` with the same result. ``recvbuf`` matters on the root only "
    "(may be ``None`` elsewhere).",
    SCATTER: "Scatter block r (``count`` elements) of ``root``'s ``sendbuf`` to rank r's "
    "``recvbuf``.\n\n``ncclScatter`` where available (NCCL >= 2.28), otherwise grouped "
    "send/recv. ``sendbuf`` matters on the root only (may be ``None`` elsewhere).",
    ALL_TO_ALL: "Send block r (``count`` elements) of ``sendbuf`` to rank r; receive rank r's "
    "block for this rank into block r of ``recvbuf``.\n\n``ncclAlltoAll`` where available "
    "(NCCL >= 2.28), otherwise grouped send/recv. ``count`` defaults to "
    "``len(sendbuf) // size``.",
    SEND: "``ncclSend`` (NCCL >= 2.7): send ``count`` elements to ``peer`` (pair with its "
    "recv).",
    RECV: "``ncclRecv`` (NCCL >= 2.7): receive ``count`` elements from ``peer``.",
}


def attach(cls: type) -> None:
    """Give every collective of ``cls`` and its ``_init`` their docstrings."""
    for row, text in _DOCS.items():
        getattr(cls, row.method).__doc__ = _doc(row, text)
        getattr(cls, row.method + "_init").__doc__ = (
            f"A persistent ``{row.method}`` (:class:`PersistentOp`): the arguments are "
            f"checked once, as :meth:`{row.method}` checks them, and each ``op()`` issues the "
            "same operation again with prebuilt C arguments (``op(stream=s)`` on another "
            "stream)."
        )
