"""Argument resolution for every collective: the fast path's value-keyed tables, and the
rules of the checked path.

The fast path (:meth:`._collectives.Collectives._call`) resolves the common forms through
the tables here; everything else — a form seen for the first time, ``None`` buffers, odd
values — goes to the checked path (:meth:`._checked.Checked._prepare`), which applies the
rules here and in :mod:`pynccl._limits`, so that every collective checks the same things in
the same order and words each mistake the same way.
"""

from __future__ import annotations

import sys

from .. import _adapt
from .._limits import index_int
from ..dtypes import known_names, to_numpy_dtype
from ..enums import DataType, RedOp
from ..errors import NotSupportedError
from ._collconfig import CollConfig
from ._spec import CollSpec, Where

__all__ = [
    "NO_COMPLEX",
    "config_arg",
    "dtype_table",
    "learn_dtype",
    "op_table",
    "raw_needs",
    "resolve_op",
]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Container

    from ..enums import Release

# -- the value-keyed tables of the fast path ----------------------------------------------

_AVG_SINCE: Release = (2, 10, 3)
#: The ops NCCL does not define for complex numbers.
NO_COMPLEX = frozenset({RedOp.PROD, RedOp.MAX, RedOp.MIN})
_OP_FORMS = (
    "a pynccl.RedOp, one of 'sum', 'prod', 'max', 'min', 'avg', "
    "or an int op from create_premul_sum()"
)
_OP_TABLES: dict[Release, dict[object, RedOp]] = {}
_DTYPE_TABLES: dict[Release, dict[object, DataType]] = {}
_ML_TYPES = frozenset({DataType.BFLOAT16, DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2})
#: The most keys a data-type table learns (foreign dtype objects are few).
DTYPE_KEYS_LIMIT = 1024


def op_table(version: Release) -> dict[object, RedOp]:
    """The built-in ops the fast path resolves for a library of ``version``, keyed by
    value: every RedOp member, its name (``"sum"``) and its C name (``"ncclSum"``), each
    to the ``ncclRedOp_t`` NCCL takes (the member: an int, which a function without
    argtypes passes as a C int with no conversion); a hit counts only for a member (which
    maps to itself) or a str: another key that equals one (``0.0``, ``False``) is the
    checked path's to accept or refuse. Avg only from 2.10.3 (before, the checked path raises
    NotSupportedError). One table per release, shared by its communicators and never
    changed."""
    table = _OP_TABLES.get(version)
    if table is None:
        table = {}
        for op in RedOp:
            if op is RedOp.AVG and version < _AVG_SINCE:
                continue
            table[op] = table[op.name.lower()] = table[op.c_name] = op
        table = _OP_TABLES.setdefault(version, table)  # threads racing here share one
    return table


def dtype_table(version: Release) -> dict[object, DataType]:
    """The data types the fast path resolves for a library of ``version`` beside the
    DataType members themselves (``Communicator._codes``), keyed by value: their names
    (``"float32"``, ``"bf16"``), numpy's dtypes and scalar types, and every other form the
    checked path has resolved since (:func:`learn_dtype`: torch dtypes, ...), each to its
    DataType (an int: the ``ncclDataType_t`` NCCL takes). No key
    equals a number (DataType members equal ints: ``7.0 == DataType.FLOAT32``), so no
    number can hit. One table per release, shared; a key's meaning never changes, so
    nothing in it is ever invalidated."""
    table = _DTYPE_TABLES.get(version)
    if table is None:
        table = {}
        for name, dt in known_names().items():
            if version >= dt.first_release:
                table[name] = dt
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
                    table[nd] = table[nd.type] = dt
        table = _DTYPE_TABLES.setdefault(version, table)  # threads racing here share one
    return table


def learn_dtype(table: dict[object, DataType], key: object, code: DataType) -> None:
    """Let the fast path resolve ``key`` (which the checked path just resolved to
    ``code``): never a number (``True == 1``; DataType members are
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


def resolve_op(
    op: object, version: Release, custom: Container[int], objs: tuple[object, ...] = ()
) -> RedOp | int:
    """The ncclRedOp_t argument for ``op`` (a RedOp, or the int handle of a custom op) on
    a library of ``version`` whose communicator made the ops ``custom``: refuses
    floats/bools/unknown names/handles, avg before 2.10.3, and prod/max/min on complex
    arrays among ``objs``."""
    member = _builtin(op)
    if member is None:
        value = index_int(op, "op", _OP_FORMS)
        if value not in custom:
            raise ValueError(
                f"op {value} is not a reduction op; expected {_OP_FORMS} on this communicator"
            )
        return value
    if member is RedOp.AVG and version < _AVG_SINCE:
        raise NotSupportedError("ncclAvg", _AVG_SINCE, version)
    if member in NO_COMPLEX and objs:
        is_complex = getattr(_adapt, "is_complex", None)
        for obj in objs:
            if obj is not None and type(obj) is not int and is_complex is not None:
                if is_complex(obj):
                    raise TypeError(
                        f"op '{member.name.lower()}' is not defined for complex arrays; "
                        "complex numbers reduce with 'sum' or 'avg' only"
                    )
    return member


# -- per-call config ----------------------------------------------------------------------


def config_arg(version: Release, spec: CollSpec, config: object) -> object:
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
            version,
            "NCCL has per-call configs (nccl*Config) for collectives only, none for "
            "point-to-point calls",
        )
    return config.check(version, spec.cfunc + "Config")


# -- buffers --------------------------------------------------------------------------------


def raw_needs(obj: int, name: str, count: object, dtype: object) -> None:
    if count is None or dtype is None:
        missing = " and ".join(a for a, v in (("count=", count), ("dtype=", dtype)) if v is None)
        raise TypeError(
            f"{name} is a raw pointer ({obj:#x}), which carries no size or type: "
            f"{missing} must be given"
        )


