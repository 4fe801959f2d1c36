"""Rows -> methods: one template turns each :data:`~._spec.COLLECTIVES` row into a method
of :class:`~pynccl.Communicator`, once, at import.

The generated code is straight-line for its row (no run-time branches on spec flags):
the raw-pointer call checked inline — pointers, count, dtype, op, root/peer — then the
gate, one flight-recorder store, the C call through the row's slot in ``self._fn`` (which
the watchdog may swap) and one result check. Anything else goes to the one slow path,
``Communicator._slow``, which words every error the same way for every row.

The source is served to :mod:`linecache` by the ``__loader__`` of the generated code's
globals, so tracebacks show real lines (see :func:`source`).
"""

from __future__ import annotations

from ..enums import DataType, RedOp
from ._args import SIZE_ARGS, size_arg
from ._recorder import RING_MASK
from ._spec import COLLECTIVES, CollSpec

__all__ = ["FILENAME", "generate", "source"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

#: The file name generated code reports in tracebacks.
FILENAME = __file__.rsplit(".", 1)[0] + "_generated.py"
_MODULE = "pynccl.comm._generated"


class _SourceLoader:
    """Serves the generated source to linecache (``linecache.lazycache`` asks the
    ``__loader__`` of a frame's globals for ``get_source``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def get_source(self, name: str) -> str:
        return self.text


def _params(spec: CollSpec) -> tuple[str, str, str]:
    """(signature after self, buffer names for the call, where-argument name or 'None')."""
    sig: list[str] = []
    if spec.send != "-":
        sig.append("sendbuf")
    if spec.recv != "-":
        optional = spec.in_place == "recvbuf=None" or spec.recv_on == "root"
        sig.append("recvbuf=None" if optional else "recvbuf")
    if spec.where == "peer":
        sig.append("peer")
    if spec.has_op:
        sig.append("op=_SUM")
    sig.append("*")
    if spec.where == "root":
        sig.append("root=0")
    sig += ["count=None", "dtype=None", "stream=None"]
    send = "sendbuf" if spec.send != "-" else "None"
    recv = "recvbuf" if spec.recv != "-" else "None"
    return ", ".join(sig), f"{send}, {recv}", spec.where or "None"


def _method_source(spec: CollSpec) -> str:
    sig, bufs, where = _params(spec)
    i = spec.index
    lines = [f"def {spec.method}(self, {sig}):"]
    checks = ["type(count) is int", "type(dtype) is _DataType", "stream is None"]
    cargs: list[str] = []
    if spec.in_place == "recvbuf=None":
        lines.append("    rb = sendbuf if recvbuf is None else recvbuf")
        recv_name = "rb"
    else:
        recv_name = "recvbuf"
    if spec.send != "-":
        checks.append("type(sendbuf) is int")
        cargs.append("sendbuf")
    if spec.recv != "-":
        checks.append(f"type({recv_name}) is int")
        cargs.append(recv_name)
    if spec.where:
        checks.append(f"type({spec.where}) is int")
    if spec.has_op:
        checks.append("(type(op) is _RedOp or type(op) is str)")
    ranges = [f"0 < {b} < _P63" for b in cargs] + ["0 <= count < self._fast_n"]
    if spec.where:
        ranges.append(f"0 <= {spec.where} < self._size")
    cargs += ["cn", "code"]
    if spec.has_op:
        cargs.append("cop")
    if spec.where:
        cargs.append(spec.where)
    cargs += ["h", "self._stream"]
    ready = ["code is not None", "fn is not None", "self._h is not None"]
    lines += [
        "    if (" + "\n            and ".join(checks) + "):",
        "        if " + " and ".join(ranges) + ":",
        "            code = self._codes[dtype]",
    ]
    if spec.has_op:
        lines.append("            cop = self._ops.get(op)")
        ready.insert(1, "cop is not None")
    lines += [
        f"            fn = self._fn[{i}]",
        "            if " + " and ".join(ready) + ":",
        "                if (cn := _SIZE_ARGS.get(count)) is None:",
        "                    cn = _size_arg(count)",
        "                gate = self._gate",
        "                if not gate.acquire(False):",
        "                    self._wait_gate()",
        "                try:",
        "                    h = self._h",
        "                    if h is None:",
        "                        h = self._gone()",
        f"                    args = ({', '.join(cargs)})",
        "                    seq = self._seq + 1",
        "                    self._seq = seq",
        f"                    self._ring[seq & _MASK] = ({i}, args)",
        "                    rc = fn(*args)",
        "                finally:",
        "                    gate.release()",
        "                if rc:",
        f"                    self._failed({i}, rc)",
        "                return",
        f"    self._slow(_ROWS[{i}], {bufs}, {'op' if spec.has_op else 'None'}, {where}, "
        "count, dtype, stream)",
    ]
    return "\n".join(lines) + "\n"


def source() -> str:
    """The generated source of every row, as compiled (a golden test diffs it)."""
    return "\n\n".join(_method_source(spec) for spec in COLLECTIVES)


def generate() -> dict[str, Callable[..., None]]:
    """Compile every row's method; returns ``{method name: function}``."""
    text = source()
    env: dict[str, object] = {
        "__name__": _MODULE,
        "__loader__": _SourceLoader(text),
        "_DataType": DataType,
        "_RedOp": RedOp,
        "_SUM": RedOp.SUM,
        "_P63": 1 << 63,
        "_MASK": RING_MASK,
        "_SIZE_ARGS": SIZE_ARGS,
        "_size_arg": size_arg,
        "_ROWS": COLLECTIVES,
    }
    exec(compile(text, FILENAME, "exec"), env)
    out: dict[str, Callable[..., None]] = {}
    for spec in COLLECTIVES:
        fn = env[spec.method]
        fn.__doc__ = spec.doc
        fn.__qualname__ = f"Communicator.{spec.method}"  # type: ignore[attr-defined]
        fn.__module__ = "pynccl.comm"
        out[spec.method] = fn  # type: ignore[assignment]
    return out
