"""Grouped send/recv plans for the collectives NCCL exports only from 2.28 on
(``ncclGather``, ``ncclScatter``, ``ncclAlltoAll``): the same result from ``ncclSend`` /
``ncclRecv`` calls issued inside one group, as NCCL's own documentation describes them."""

from __future__ import annotations

from ._spec import CollSpec, by_cfunc

__all__ = ["grouped"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ctypes import c_size_t

_SEND = by_cfunc("ncclSend").index
_RECV = by_cfunc("ncclRecv").index


def grouped(
    spec: CollSpec,
    rank: int,
    size: int,
    sp: int,
    rp: int,
    n: int,
    itemsize: int,
    cn: c_size_t,
    code: object,
    root: int,
) -> list[tuple[int, tuple[object, ...]]]:
    """The send/recv calls (arguments before ``comm, stream``) that carry ``spec``."""
    nbytes = n * itemsize
    plan: list[tuple[int, tuple[object, ...]]]
    if spec.cfunc == "ncclGather":
        plan = [(_SEND, (sp, cn, code, root))]
        if rank == root:
            plan += [(_RECV, (rp + r * nbytes, cn, code, r)) for r in range(size)]
        return plan
    if spec.cfunc == "ncclScatter":
        plan = []
        if rank == root:
            plan += [(_SEND, (sp + r * nbytes, cn, code, r)) for r in range(size)]
        return [*plan, (_RECV, (rp, cn, code, root))]
    if spec.cfunc == "ncclAlltoAll":
        plan = []
        for r in range(size):
            plan.append((_SEND, (sp + r * nbytes, cn, code, r)))
            plan.append((_RECV, (rp + r * nbytes, cn, code, r)))
        return plan
    raise AssertionError(f"{spec.cfunc} has no grouped fallback")  # pragma: no cover
