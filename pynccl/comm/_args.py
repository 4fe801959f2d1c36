"""Argument resolution for every generated collective: the one slow path.

The generated methods (:mod:`._codegen`) handle the common raw-pointer call inline;
everything else — arrays, ``None`` buffers, in place, names, odd values — comes here, so
that every collective checks the same things in the same order and words each mistake
the same way (the rules themselves are :mod:`pynccl._limits`).
"""

from __future__ import annotations

import sys
from ctypes import c_int, c_size_t, c_void_p

from .. import _adapt
from .._adapt import _BUFFER_HANDLERS, as_stream, buffer_handler, check_device
from .._capi._binding import SIZE_ARGS, SIZE_ARGS_LIMIT, ptr_arg, size_arg
from .._capi._enumargs import C_DATATYPE, C_REDOP
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
from ..dtypes import as_datatype, canonical_name, known_names, to_numpy_dtype
from ..enums import DataType, RedOp
from ..errors import NotSupportedError
from ._collconfig import CollConfig
from ._spec import BROADCAST, RECV, SEND, CollSpec, Extent, InPlace, On, Side, Where

__all__ = [
    "RANK_ARGS_LIMIT",
    "OpEntry",
    "Plan",
    "config_arg",
    "dtype_table",
    "learn_dtype",
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

# -- the value-keyed tables of the fast path ----------------------------------------------

_AVG_SINCE: Release = (2, 10, 3)
_NO_COMPLEX = frozenset({RedOp.PROD, RedOp.MAX, RedOp.MIN})
_OP_FORMS = (
    "a pynccl.RedOp, one of 'sum', 'prod', 'max', 'min', 'avg', "
    "or an int op from create_premul_sum()"
)
#: An op table's entry: the key's exact type (a hit of an equal key of another type —
#: ``0`` for ``RedOp.SUM`` — is no hit), the shared c_int NCCL takes, and whether the op
#: is defined for complex arrays.
OpEntry = tuple[type, c_int, bool]
_OP_TABLES: dict[Release, dict[object, OpEntry]] = {}
_DTYPE_TABLES: dict[Release, dict[object, c_int]] = {}
_ML_TYPES = frozenset({DataType.BFLOAT16, DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2})
#: The most keys a data-type table learns (foreign dtype objects are few).
DTYPE_KEYS_LIMIT = 1024


def op_table(version: Release) -> dict[object, OpEntry]:
    """The built-in ops the fast path resolves for a library of ``version``, keyed by
    value: every RedOp member, its name (``"sum"``) and its C name (``"ncclSum"``); avg
    only from 2.10.3 (before, the checked path raises NotSupportedError). One table per
    release, shared by its communicators and never changed."""
    table = _OP_TABLES.get(version)
    if table is None:
        table = {}
        for op in RedOp:
            if op is RedOp.AVG and version < _AVG_SINCE:
                continue
            entry = C_REDOP[op], op not in _NO_COMPLEX
            table[op] = (RedOp, *entry)
            table[op.name.lower()] = (str, *entry)
            table[op.c_name] = (str, *entry)
        _OP_TABLES[version] = table
    return table


def dtype_table(version: Release) -> dict[object, c_int]:
    """The data types the fast path resolves for a library of ``version`` beside the
    DataType members themselves (``Communicator._codes``), keyed by value: their names
    (``"float32"``, ``"bf16"``), numpy's dtypes and scalar types, and every other form the
    checked path has resolved since (:func:`learn_dtype`: torch dtypes, ...). No key
    equals a number (DataType members equal ints: ``7.0 == DataType.FLOAT32``), so no
    number can hit. One table per release, shared; a key's meaning never changes, so
    nothing in it is ever invalidated."""
    table = _DTYPE_TABLES.get(version)
    if table is None:
        table = {}
        for name, dt in known_names().items():
            if version >= dt.first_release:
                table[name] = C_DATATYPE[dt]
        # numpy's dtypes and scalar types, if loaded (never loaded here; else learned on
        # first use), and ml_dtypes' likewise.
        if "numpy" in sys.modules:
            ml = "ml_dtypes" in sys.modules
            for dt in DataType:
                if version >= dt.first_release and (ml or dt not in _ML_TYPES):
                    try:
                        nd = to_numpy_dtype(dt)
                    except TypeError:  # bfloat16 / float8 without ml_dtypes
                        continue
                    table[nd] = table[nd.type] = C_DATATYPE[dt]
        _DTYPE_TABLES[version] = table
    return table


def learn_dtype(table: dict[object, c_int], key: object, code: c_int) -> None:
    """Let the fast path resolve ``key`` (which the checked path just resolved to the
    type whose c_int is ``code``): never a number (``True == 1``; DataType members are
    looked up apart) nor an unhashable object."""
    if isinstance(key, (int, float, complex)) or hasattr(key, "__index__") or (
        hasattr(key, "__float__") and not isinstance(key, type)
    ):
        return
    if len(table) < DTYPE_KEYS_LIMIT:
        try:
            table[key] = code
        except TypeError:  # unhashable
            pass


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
    if spec.where is Where.PEER:
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
    code = comm._codes[dt]
    if code is None:
        raise NotSupportedError(f"data type {dt.c_name}", dt.first_release, comm._lib.version)
    learn_dtype(comm._dtypes, dtype, code)
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
    size = comm._size
    s = comm._stream if stream is None else as_stream(stream)
    w = -1
    if spec.where is not Where.NONE:
        w = check_index(where, spec.where.value, size, f"for a communicator of size {size}")
    n = None if count is None else check_count(count)
    user_dt = None if dtype is None else _datatype(comm, dtype)
    call = _Call(comm, spec, sendbuf, recvbuf, w, n, user_dt, s)
    for side in call.order():
        call.read(side)
    if call.n is None or call.dt is None:  # no buffer given at all
        raise TypeError(f"{spec.method} needs a buffer: sendbuf and recvbuf are both None")
    sp, rp = call.ptrs[Side.SEND], call.ptrs[Side.RECV]
    if call.in_place:
        rp = sp
    elif spec is BROADCAST and w != comm._rank and sendbuf is None:
        sp = rp  # NCCL reads sendbuff on the root only
    code = comm._codes[call.dt]
    cop: object = None
    if spec.has_op:
        cop = resolve_op(op, comm, (sendbuf, recvbuf))
        if type(cop) is int:  # a custom op: its device scalar must outlive this work
            comm._note_op_use(cop, s)
    ptr_arg(s)  # the stream's shared c_void_p, for the fast path's next call
    plan = _args_for(comm, spec, ptr_arg(sp), ptr_arg(rp), size_arg(call.n), call.n, call.dt,
                     code, cop, w)  # fmt: skip
    return plan, s, cfg


class _Call:
    """One call's buffers, read and checked side by side (:func:`prepare`)."""

    def __init__(
        self,
        comm: Communicator,
        spec: CollSpec,
        sendbuf: object,
        recvbuf: object,
        w: int,
        n: int | None,
        dt: DataType | None,
        s: int,
    ) -> None:
        self.comm, self.spec, self.s, self.n, self.dt, self.user_dt = comm, spec, s, n, dt, dt
        is_root = w == comm._rank
        # Which buffers this rank must pass (the others may be None).
        self.in_place = spec.in_place is InPlace.RECVBUF_NONE and recvbuf is None
        need_send = spec.send is not Extent.NONE and (spec.send_on is On.ALL or is_root)
        need_recv = (spec.recv is not Extent.NONE and (spec.recv_on is On.ALL or is_root)
                     and not self.in_place)  # fmt: skip
        self.bufs = {Side.SEND: sendbuf, Side.RECV: recvbuf}
        self.needs = {Side.SEND: need_send or self.in_place, Side.RECV: need_recv}
        self.ptrs = {Side.SEND: 0, Side.RECV: 0}

    def order(self) -> tuple[Side, Side]:
        """The count source first (the other buffer when it is absent or not needed)."""
        first = self.spec.count_from
        other = Side.RECV if first is Side.SEND else Side.SEND
        if (self.bufs[first] is None or not self.needs[first]) and (
            self.bufs[other] is not None and self.needs[other]
        ):
            first, other = other, first
        return first, other

    def read(self, side: Side) -> None:
        spec, obj = self.spec, self.bufs[side]
        name = side.value + "buf"
        kind = spec.extent(side)
        if kind is Extent.NONE or (side is Side.RECV and self.in_place):
            return
        if type(obj) is not int and is_pointer_object(obj):
            obj = pointer_int(obj, name)  # a cuda.bindings CUdeviceptr: its raw pointer
        if obj is None:
            if self.needs[side]:
                on = "" if spec.on(side) is On.ALL else " on the root"
                raise TypeError(f"{name} is required{on} of {spec.method}")
            return
        mult = self.comm._size if kind is Extent.PER_RANK else 1
        if type(obj) is int:
            _raw_needs(obj, name, self.n, self.dt)
            assert self.n is not None and self.dt is not None
            nbytes = check_extent(self.n * mult, self.dt.itemsize, name) if self.needs[side] else 0
            self.ptrs[side] = check_pointer(obj, name, nbytes)
            return
        if isinstance(obj, bool) or isinstance(obj, float):
            raise TypeError(
                f"{name} must be a device buffer or a raw pointer (int), "
                f"got {type(obj).__name__} {obj!r}"
            )
        writable = side is Side.RECV or self.in_place
        ptr, have, got = _read(obj, name, writable, self.user_dt, self.s, self.comm)
        if self.dt is None:
            self.dt = got
        elif got is not self.dt:
            other = "sendbuf" if side is Side.RECV else "recvbuf"
            raise TypeError(
                f"sendbuf and recvbuf have different data types: {other} is "
                f"{canonical_name(self.dt)} but {name} is {canonical_name(got)}"
            )
        if self.n is None:
            if have % mult:
                raise ValueError(
                    f"{name} holds {have} elements, not a multiple of the {self.comm._size} ranks"
                )
            self.n = have // mult
        if self.needs[side] and have < self.n * mult:
            raise ValueError(f"{name} holds {have} elements but this call needs {self.n * mult}")
        self.ptrs[side] = ptr


def _args_for(
    comm: Communicator,
    spec: CollSpec,
    sp: c_void_p,
    rp: c_void_p,
    cn: c_size_t,
    n: int,
    dt: DataType,
    code: c_int | None,
    cop: object,
    w: int,
) -> list[tuple[int, tuple[object, ...]]]:
    """The C calls (before ``comm, stream``) that carry one call of ``spec``."""
    i = spec.index
    if spec is SEND:
        return [(i, (sp, cn, code, w))]
    if spec is RECV:
        return [(i, (rp, cn, code, w))]
    if comm._fn[i] is None and spec.fallback:
        from ._fallback import grouped

        return grouped(spec, comm._rank, comm._size, sp.value or 0, rp.value or 0, n,
                       dt.itemsize, cn, code, w)  # fmt: skip
    pre: tuple[object, ...] = (sp, rp, cn, code)
    if spec.has_op:
        pre += (cop,)
    if spec.where is not Where.NONE:
        pre += (w,)
    return [(i, pre)]


__all__ += ["SIZE_ARGS", "SIZE_ARGS_LIMIT", "U64"]  # SIZE_ARGS: see pynccl._capi._binding
