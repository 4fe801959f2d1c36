"""Argument resolution for every generated collective: the one slow path.

The generated methods (:mod:`._codegen`) handle the common raw-pointer call inline;
everything else — arrays, ``None`` buffers, in place, names, odd values — comes here, so
that every collective checks the same things in the same order and words each mistake
the same way (the rules themselves are :mod:`pynccl._limits`).
"""

from __future__ import annotations

from ctypes import c_int, c_size_t

from .. import _adapt
from .._adapt import _BUFFER_HANDLERS, as_stream, buffer_handler, check_device
from .._capi._binding import SIZE_ARGS, SIZE_ARGS_LIMIT, size_arg
from .._capi._enumargs import C_REDOP
from .._limits import (
    U64,
    check_count,
    check_extent,
    check_index,
    check_pointer,
    index_int,
    is_pointer_object,
    pointer_int,
)
from ..dtypes import as_datatype, canonical_name
from ..enums import DataType, RedOp
from ..errors import NotSupportedError
from ._collconfig import CollConfig
from ._spec import CollSpec

__all__ = [
    "RANK_ARGS_LIMIT",
    "Plan",
    "config_arg",
    "op_table",
    "prepare",
    "rank_args",
    "resolve_op",
    "size_arg",
]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..enums import Release
    from ..typing import StreamLike
    from ._communicator import Communicator

#: What the slow path hands back: ``[(row index, C arguments before (comm, stream))]``
#: (several rows for a grouped fallback), the stream, and the ``const ncclCollConfig_t*``
#: argument of the row's ``nccl*Config`` variant (None: the plain call).
Plan = tuple[list[tuple[int, tuple[object, ...]]], int, object]

# -- ops ----------------------------------------------------------------------------------

_AVG_SINCE: Release = (2, 10, 3)
_NO_COMPLEX = frozenset({RedOp.PROD, RedOp.MAX, RedOp.MIN})
_OP_FORMS = (
    "a pynccl.RedOp, one of 'sum', 'prod', 'max', 'min', 'avg', "
    "or an int op from create_premul_sum()"
)
_OP_TABLES: dict[tuple[Release, bool], dict[object, c_int | None]] = {}


def op_table(version: Release, arrays: bool = False) -> dict[object, c_int | None]:
    """RedOp members and their names -> the shared c_int NCCL takes; ``None`` for avg
    on a library older than 2.10.3 (the slow path then raises NotSupportedError), and
    with ``arrays`` for prod/max/min too (the slow path checks them against complex)."""
    table = _OP_TABLES.get((version, arrays))
    if table is None:
        table = {}
        for op in RedOp:
            code = None if op is RedOp.AVG and version < _AVG_SINCE else C_REDOP[op]
            if arrays and op in _NO_COMPLEX:
                code = None
            table[op] = code
            table[op.name.lower()] = code
            table[op.c_name] = code
        _OP_TABLES[(version, arrays)] = table
    return table


def _builtin(op: object) -> RedOp | None:
    """The RedOp that ``op`` names, None for an int op handle that is no built-in."""
    if type(op) is RedOp:
        return op
    if type(op) is str:
        for member in RedOp:
            if op in (member.name.lower(), member.c_name):
                return member
        raise ValueError(f"op {op!r} is not a reduction op; expected {_OP_FORMS}")
    value = index_int(op, "op", _OP_FORMS)
    try:
        return RedOp(value)
    except ValueError:
        return None


def resolve_op(op: object, comm: Communicator, objs: tuple[object, ...] = ()) -> c_int | int:
    """The ncclRedOp_t argument for ``op``: refuses floats/bools/unknown names/handles,
    avg before 2.10.3, and prod/max/min on complex arrays among ``objs``."""
    member = _builtin(op)
    if member is None:
        value = index_int(op, "op", _OP_FORMS)
        if value not in comm._custom_ops:
            raise ValueError(
                f"op {value} is not a reduction op; expected {_OP_FORMS} on this communicator"
            )
        return value
    if member is RedOp.AVG and comm._lib.version < _AVG_SINCE:
        raise NotSupportedError("ncclAvg", _AVG_SINCE, comm._lib.version)
    if member in _NO_COMPLEX and objs:
        is_complex = getattr(_adapt, "is_complex", None)
        for obj in objs:
            if obj is not None and type(obj) is not int and is_complex is not None:
                if is_complex(obj):
                    raise TypeError(
                        f"op '{member.name.lower()}' is not defined for complex arrays; "
                        "complex numbers reduce with 'sum' or 'avg' only"
                    )
    return C_REDOP[member]


# -- ranks --------------------------------------------------------------------------------

#: Ranks below this have a shared c_int (:func:`rank_args`); the inline paths send a
#: root/peer at or above it to the slow path.
RANK_ARGS_LIMIT = 1 << 15
_RANK_ARGS: list[c_int] = []


def rank_args(size: int) -> list[c_int]:
    """The shared ``c_int`` of every rank below ``min(size, RANK_ARGS_LIMIT)`` (one list
    for the process, grown on demand, never mutated otherwise): ctypes passes a c_int for
    an ``int`` parameter much faster than it converts a Python int (root, peer)."""
    need = min(size, RANK_ARGS_LIMIT)
    if len(_RANK_ARGS) < need:
        _RANK_ARGS.extend(c_int(r) for r in range(len(_RANK_ARGS), need))
    return _RANK_ARGS


# -- per-call config ----------------------------------------------------------------------


def config_arg(comm: Communicator, spec: CollSpec, config: object) -> object:
    """The ``const ncclCollConfig_t*`` argument for ``config=`` (None for None): a
    :class:`CollConfig` whose fields the loaded library knows, on a collective (NCCL has
    no per-call config for send/recv)."""
    if config is None:
        return None
    if type(config) is not CollConfig:
        raise TypeError(
            f"config must be a pynccl.CollConfig or None, got {type(config).__name__} {config!r}"
        )
    if spec.where == "peer":
        raise NotSupportedError(
            f"config= on {spec.method} (a per-call CollConfig for {spec.cfunc})",
            None,
            comm._lib.version,
            "NCCL has per-call configs (nccl*Config) for collectives only, none for "
            "point-to-point calls",
        )
    return config.check(comm._lib.version, spec.cfunc + "Config")


# -- buffers --------------------------------------------------------------------------------


def _datatype(comm: Communicator, dtype: object) -> DataType:
    dt = as_datatype(dtype)
    if comm._codes[dt] is None:
        raise NotSupportedError(f"data type {dt.c_name}", dt.first_release, comm._lib.version)
    return dt


def _raw_needs(obj: int, name: str, count: object, dtype: object) -> None:
    if count is None or dtype is None:
        missing = " and ".join(a for a, v in (("count=", count), ("dtype=", dtype)) if v is None)
        raise TypeError(
            f"{name} is a raw pointer ({obj:#x}), which carries no size or type: "
            f"{missing} must be given"
        )


def _read(
    obj: object, name: str, writable: bool, dtype: object, s: int, comm: Communicator
) -> tuple[int, int, DataType]:
    """``(ptr, elements it holds, data type)`` of an array argument (not a raw pointer)."""
    handler = _BUFFER_HANDLERS.get(type(obj)) or buffer_handler(obj, name)
    ptr, n, dt, dev = handler(obj, None, dtype, name, writable, s)
    if dev is not None:
        check_device(dev, comm._device, name)
    if comm._codes[dt] is None:
        _datatype(comm, dt)  # raises NotSupportedError naming the type and releases
    return ptr, n, dt


def prepare(
    comm: Communicator,
    spec: CollSpec,
    sendbuf: object,
    recvbuf: object,
    op: object,
    where: object,
    count: object,
    dtype: object,
    stream: StreamLike,
    config: object = None,
) -> Plan:
    """Check every argument of one call of ``spec`` and return its plan.

    Order (the same for every row, so the same mistake meets the same check first):
    config, stream, root/peer, count, dtype, the buffers (count source first), sizes, op.
    """
    cfg = config_arg(comm, spec, config)
    size, rank = comm._size, comm._rank
    s = comm._stream if stream is None else as_stream(stream)
    w = -1
    if spec.where:
        w = check_index(where, spec.where, size, f"for a communicator of size {size}")
    n = None if count is None else check_count(count)
    user_dt = None if dtype is None else _datatype(comm, dtype)
    dt = user_dt
    is_root = w == rank
    # Which buffers this rank must pass (the others may be None).
    in_place = spec.in_place == "recvbuf=None" and recvbuf is None
    need_send = spec.send != "-" and (spec.send_on == "all" or is_root)
    need_recv = spec.recv != "-" and (spec.recv_on == "all" or is_root) and not in_place
    if in_place:
        need_send = True
    bufs = {"send": sendbuf, "recv": recvbuf}
    needs = {"send": need_send, "recv": need_recv}
    first = spec.count_from
    if bufs[first] is None or not needs[first]:
        other = "recv" if first == "send" else "send"
        if bufs[other] is not None and needs[other]:
            first = other
    order = (first, "recv" if first == "send" else "send")
    ptrs = {"send": 0, "recv": 0}
    for which in order:
        obj = bufs[which]
        if type(obj) is not int and is_pointer_object(obj):
            obj = pointer_int(obj, which)  # a cuda.bindings CUdeviceptr: its raw pointer
        name = which + "buf"
        kind = spec.send if which == "send" else spec.recv
        if kind == "-" or (which == "recv" and in_place):
            continue
        if obj is None:
            if needs[which]:
                on = "" if _on_all(spec, which) else " on the root"
                raise TypeError(f"{name} is required{on} of {spec.method}")
            continue
        mult = size if kind == "n" else 1
        writable = which == "recv" or (which == "send" and in_place)
        if type(obj) is int:
            _raw_needs(obj, name, n, dt)
            assert n is not None and dt is not None
            nbytes = check_extent(n * mult, dt.itemsize, name) if needs[which] else 0
            ptrs[which] = check_pointer(obj, name, nbytes)
            continue
        if isinstance(obj, bool) or isinstance(obj, float):
            raise TypeError(
                f"{name} must be a device buffer or a raw pointer (int), "
                f"got {type(obj).__name__} {obj!r}"
            )
        ptr, have, got = _read(obj, name, writable, user_dt, s, comm)
        if dt is None:
            dt = got
        elif got is not dt:
            other = "sendbuf" if which == "recv" else "recvbuf"
            raise TypeError(
                f"sendbuf and recvbuf have different data types: {other} is "
                f"{canonical_name(dt)} but {name} is {canonical_name(got)}"
            )
        if n is None:
            if have % mult:
                raise ValueError(
                    f"{name} holds {have} elements, not a multiple of the {size} ranks"
                )
            n = have // mult
        if needs[which] and have < n * mult:
            raise ValueError(f"{name} holds {have} elements but this call needs {n * mult}")
        ptrs[which] = ptr
    if n is None or dt is None:  # no buffer given at all
        raise TypeError(f"{spec.method} needs a buffer: sendbuf and recvbuf are both None")
    sp, rp = ptrs["send"], ptrs["recv"]
    if in_place:
        rp = sp
    elif spec.method == "broadcast" and not is_root and sendbuf is None:
        sp = rp  # NCCL reads sendbuff on the root only
    code = comm._codes[dt]
    cop: object = None
    if spec.has_op:
        cop = resolve_op(op, comm, (sendbuf, recvbuf))
        if type(cop) is int:  # a custom op: its device scalar must outlive this work
            comm._note_op_use(cop, s)
    cn = size_arg(n)
    return _args_for(comm, spec, sp, rp, cn, n, dt, code, cop, w), s, cfg


def _on_all(spec: CollSpec, which: str) -> bool:
    return (spec.send_on if which == "send" else spec.recv_on) == "all"


def _args_for(
    comm: Communicator,
    spec: CollSpec,
    sp: int,
    rp: int,
    cn: c_size_t,
    n: int,
    dt: DataType,
    code: c_int | None,
    cop: object,
    w: int,
) -> list[tuple[int, tuple[object, ...]]]:
    """The C calls (before ``comm, stream``) that carry one call of ``spec``."""
    i = spec.index
    if spec.cfunc == "ncclSend":
        return [(i, (sp, cn, code, w))]
    if spec.cfunc == "ncclRecv":
        return [(i, (rp, cn, code, w))]
    if comm._fn[i] is None and spec.fallback:
        from ._fallback import grouped

        return grouped(spec, comm._rank, comm._size, sp, rp, n, dt.itemsize, cn, code, w)
    pre: tuple[object, ...] = (sp, rp, cn, code)
    if spec.has_op:
        pre += (cop,)
    if spec.where:
        pre += (w,)
    return [(i, pre)]


__all__ += ["SIZE_ARGS", "SIZE_ARGS_LIMIT", "U64"]  # SIZE_ARGS: see pynccl._capi._binding
