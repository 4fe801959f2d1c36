"""The flight recorder: the last operations issued on a communicator, one entry format.

The hot path stores one ``(row, args)`` tuple per operation into a fixed ring
(``ring[seq & RING_MASK]``): ``row`` is the operation's index in
:data:`~pynccl.comm._spec.COLLECTIVES`, ``args`` the C call's argument tuple (as passed:
ints or shared ctypes objects); inside a
group ``(row, args, group)``; a call with a per-call config ``(row, args, group, config)``
(``args`` then ends with the config pointer, and the function is the row's
``nccl*Config``). A persistent operation stores a tuple it built once. Operations are
numbered from #1, as the loopback's mismatch report counts them. Everything else
(decoding, text) happens only when a record is read.
"""

from __future__ import annotations

from .._capi._binding import arg_value
from ..enums import DataType, RedOp
from ._spec import COLLECTIVES, Where

__all__ = [
    "RING_MASK",
    "RING_SIZE",
    "FlightRecord",
    "entry",
    "fields",
    "format_lines",
    "format_record",
    "groups",
    "record",
]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: Entries kept (a power of two: the slot of operation ``seq`` is ``seq & RING_MASK``).
RING_SIZE = 64
#: ``RING_SIZE - 1``: operation ``seq``'s entry is ``ring[seq & RING_MASK]``.
RING_MASK = RING_SIZE - 1
#: Lines of the record an exception's text carries (the whole record is an attribute).
SHORT = 4

#: ``(seq, C function, root or peer (-1: none), the C call's arguments as plain values)``
FlightRecord = tuple[int, str, int, tuple[object, ...]]
_P2P = ("ncclSend", "ncclRecv")


def entry(ring: list[Any], newest: int, seq: int) -> FlightRecord | None:
    """Operation ``seq`` as a :data:`FlightRecord`, or None if not issued or overwritten."""
    slot = ring[seq & RING_MASK]
    if slot is None or seq < 1 or not 0 <= newest - seq < RING_SIZE:
        return None
    row, args = slot[0], slot[1]
    spec = COLLECTIVES[row]
    name = spec.cfunc
    if len(slot) > 3:  # a per-call config: nccl*Config, its pointer last
        name += "Config"
        args = args[:-1]
    plain = tuple(_plain(a) for a in args)
    # root / peer sit just before (comm, stream) in every prototype that has one.
    where = int(plain[-3]) if spec.where is not Where.NONE else -1  # type: ignore[call-overload]
    return (seq, name, where, plain)


def _plain(arg: object) -> object:
    """A C argument as the hot path passed it (an int, None for NULL, a shared pointer
    argument, a ``c_void_p`` handle, a ``c_size_t`` count...) as a plain value."""
    return arg_value(arg)


def record(ring: list[Any], newest: int) -> list[FlightRecord]:
    """Every entry still in the ring, oldest first."""
    entries = (entry(ring, newest, i) for i in range(max(1, newest - RING_SIZE + 1), newest + 1))
    return [e for e in entries if e is not None]


def groups(ring: list[Any], items: list[FlightRecord]) -> list[int]:
    """The group number (0: none) each of ``items`` was issued in, as the hot path stored
    it: ``(row, args, group)`` inside a group, ``(row, args)`` outside."""
    out = []
    for item in items:
        slot = ring[item[0] & RING_MASK]
        out.append(slot[2] if slot is not None and len(slot) > 2 else 0)
    return out


def _op_name(code: int) -> str:
    try:
        return RedOp(code).name.lower()
    except ValueError:
        return f"premulsum({code})"


def fields(item: FlightRecord) -> dict[str, object]:
    """One entry decoded: ``seq``, ``function``, ``count``, ``dtype`` (its C name), ``op``
    (reductions), ``root`` or ``peer``, ``stream`` (the handle, an int)."""
    seq, name, where, args = item
    p2p = name in _P2P
    count, dtype = (args[1], args[2]) if p2p else (args[2], args[3])
    try:
        dname = DataType(int(dtype)).c_name  # type: ignore[call-overload]
    except ValueError:
        dname = str(dtype)
    out: dict[str, object] = {"seq": seq, "function": name, "count": count, "dtype": dname}
    if not p2p and len(args) > 4 and COLLECTIVES_HAS_OP.get(name):
        out["op"] = _op_name(int(args[4]))  # type: ignore[call-overload]
    if where >= 0:
        out["peer" if p2p else "root"] = where
    out["stream"] = args[-1] or 0
    return out


def format_record(item: FlightRecord) -> str:
    """One entry as a line of text: ``#3 ncclReduce count=7 dtype=ncclFloat32 op=max root=0
    stream=0x0``."""
    f = fields(item)
    text = f"#{f['seq']} {f['function']} count={f['count']} dtype={f['dtype']}"
    for key in ("op", "root", "peer"):
        if key in f:
            text += f" {key}={f[key]}"
    return text + f" stream={f['stream']:#x}"


COLLECTIVES_HAS_OP = {row.cfunc: row.has_op for row in COLLECTIVES}
COLLECTIVES_HAS_OP.update({name + "Config": op for name, op in list(COLLECTIVES_HAS_OP.items())})


def format_lines(
    entries: list[FlightRecord],
    rank: int,
    size: int,
    last: int = 0,
    marks: list[int] | None = None,
) -> str:
    """The record as text; ``last`` > 0 keeps only the newest ``last`` entries; ``marks``
    (from :func:`groups`) tags the operations issued inside a group with its number."""
    if not entries:
        return f"No operation issued yet on rank {rank}."
    shown = entries[-last:] if last else entries
    tags = (marks or [0] * len(entries))[-len(shown) :]
    head = f"Last {len(shown)} operations issued on rank {rank}/{size}"
    if len(shown) < len(entries):
        head += f" (of {len(entries)} recorded; the whole record is the error's flight_record)"
    lines = ["  " + format_record(e) + (f" [group {g}]" if g else "") for e, g in zip(shown, tags)]
    return "\n".join([head + ":", *lines])
