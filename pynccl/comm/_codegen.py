"""Rows -> methods: one template turns each :data:`~._spec.COLLECTIVES` row into a method
of :class:`~pynccl.Communicator`, once, at import.

The generated code is straight-line for its row (no run-time branches on spec flags):
the raw-pointer call checked inline — pointers, count, dtype, op, root/peer — then the
gate, one flight-recorder store, the C call through the row's slot in ``self._bfn`` (a
function without argtypes, which the watchdog may swap; every argument a shared ctypes
object, so ctypes converts nothing) and one result check. Anything else — a ``stream=``, a
``config=`` (the row's ``nccl*Config`` variant), names, odd values — goes to the one slow
path, ``Collectives._slow``, which words every error the same way for every row. Each row
also gets ``<method>_init`` (same signature): a persistent operation
(:mod:`._persistent`) checked by the same slow path.

The source is served to :mod:`linecache` by the ``__loader__`` of the generated code's
globals, so tracebacks show real lines (see :func:`source`).
"""

from __future__ import annotations

from .._adapt._cai import CAI_TYPES, NO_DEVICE, common_case, common_case_globals
from .._capi._binding import PTR_ARGS, ptr_arg
from .._capi._enumargs import C_REDOP
from ..enums import DataType, RedOp
from ._args import SIZE_ARGS, size_arg
from ._memos import (
    ARRAYS,
    INTERFACES,
    TAIL,
    array_key,
    buffer_count,
    cai_memo_hit,
    gated,
    join,
    keep,
    memo_hit,
    memo_key,
    record,
    same,
)
from ._spec import COLLECTIVES, CollSpec

__all__ = ["FILENAME", "compile_method", "generate", "install", "source"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

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
    sig += ["count=None", "dtype=None", "stream=None", "config=None"]
    send = "sendbuf" if spec.send != "-" else "None"
    recv = "recvbuf" if spec.recv != "-" else "None"
    return ", ".join(sig), f"{send}, {recv}", spec.where or "None"


def _issue(
    cargs: list[str],
    i: int,
    pad: str,
    slow: str,
    memos: tuple[tuple[str, str, str], ...] = (),
    ptrs: tuple[str, ...] = (),
) -> list[str]:
    """The shared count argument and the shared pointer arguments of ``ptrs`` (ints, as
    ``c_<name>``), then the gated call (:func:`~._memos.gated`) at indent ``pad``: every argument a
    ctypes object, passed to the row's function without argtypes (``self._bfn``: ctypes
    converts nothing). ``slow`` is the slow-path call taken when the handle is gone once
    the gate is held. With ``memos`` — each ``(index in memo, condition or "", what it
    holds, :data:`~._memos.TAIL` included)`` — the C arguments are remembered for the next
    identical call (see :func:`memo_hit`) in the first memo whose condition holds, in the
    memo list the call bound first (``memo``). The lines before bound ``gid``, the group
    number to record (:func:`~._memos.keep` or :func:`~._memos.join`)."""
    prepare = [f"args = ({', '.join(cargs)})"]
    entry = record(i, "args", f"({i}, args)")
    if memos:
        prepare += [f"entry = ({i}, args)"]
        entry = record(i, "args", "entry")
    for j, (at, condition, items) in enumerate(memos):
        store = f"memo[{at}] = ({items})"
        if not condition:
            prepare.append(store)
        else:
            prepare += [f"{'elif' if j else 'if'} {condition}:", "    " + store]
    body = _shared_arg("cn", "n", "_SIZE_ARGS", "_size_arg")
    for name in ptrs:
        # A cached address passed the range check before (PTR_ARGS keeps only those).
        body += _shared_arg(f"c_{name}", name, "_PTRS", "_ptr_arg", f"0 < {name} < _P63", slow)
    body += gated(i, prepare, entry, "fn(*args)", slow)
    return [pad + line for line in body]


def _shared_arg(
    var: str, value: str, table: str, make: str, check: str = "", otherwise: str = ""
) -> list[str]:
    """``var`` = the shared ctypes object of ``value`` (one subscript when cached); on a
    miss, made only if ``check`` (if given) holds, else the statement ``otherwise`` runs
    instead."""
    lookup = ["try:", f"    {var} = {table}[{value}]", "except KeyError:"]
    if not check:
        return [*lookup, f"    {var} = {make}({value})"]
    return [*lookup, f"    if {check}:", f"        {var} = {make}({value})", "    else:",
            f"        {otherwise}"]  # fmt: skip


def slow_call(spec: CollSpec) -> str:
    """The row's call of the one slow path, with the method's own arguments."""
    _, bufs, where = _params(spec)
    op = "op" if spec.has_op else "None"
    return f"self._slow(_ROWS[{spec.index}], {bufs}, {op}, {where}, count, dtype, stream, config)"


def _method_source(spec: CollSpec) -> str:
    """One row's method: the inline raw-pointer path, the inline array path (objects
    whose handler is cached, no count/dtype; a live DeviceBuffer's ``_arg`` read inline,
    exactly what its handler ``_from_device_buffer`` returns, without the handler lookup),
    then the slow path for anything else."""
    sig, bufs, _ = _params(spec)
    i = spec.index
    lines = [f"def {spec.method}(self, {sig}):"]
    key = memo_key(spec)
    conds = [same(k, f"m{j}") for j, k in enumerate(key)] + ["stream is None", "config is None"]
    hit = memo_hit("self._memo", conds, len(key), str(i), i, slow_call(spec), join())
    lines += ["    " + line for line in hit]
    has_send, has_recv = spec.send != "-", spec.recv != "-"
    recv = "recvbuf"
    if spec.in_place == "recvbuf=None":
        lines.append("    rb = sendbuf if recvbuf is None else recvbuf")
        recv = "rb"
    names = ([("sendbuf", "sp", "sn", spec.send)] if has_send else []) + (
        [(recv, "rp", "rn", spec.recv)] if has_recv else []
    )
    assert len(names) == buffer_count(spec)
    # DeviceBuffers again: the DeviceBuffer memo (each buffer's _arg tuple, the op, the
    # root/peer), tried when the first buffer is one, before the checks it stands for.
    first_buf = names[0][0]
    akey = [f"{first_buf}._arg is m0"] + [
        f"type({b}) is _DeviceBuffer and {b}._arg is m{j}"
        for j, (b, _, _, _) in enumerate(names)
        if j
    ]
    extra = array_key(spec)
    akey += [f"{k} is m{len(names) + j}" for j, k in enumerate(extra)]
    # A memo hit's stream is its C arguments' last (the default stream's shared c_void_p).
    # A group keeps buffers for their stream only where a free could hand their memory
    # out while NCCL still uses it: not DeviceBuffers from cudaMalloc (cudaFree waits for
    # the device), whose entry carries no stream (see pynccl.comm._held).
    nccl_memory = " or ".join(f"{b}._nccl" for b, _, _, _ in names)
    devbuf_kept = keep(bufs, f"margs[-1] if {nccl_memory} else None")
    hit_kept = keep(bufs, "margs[-1]")
    conds = [*akey, "count is None", "dtype is None", "stream is None", "config is None"]
    hit = memo_hit(
        "self._memo", conds, len(akey), str(ARRAYS + i), i, slow_call(spec), devbuf_kept
    )
    lines.append(f"    if type({first_buf}) is _DeviceBuffer:")
    lines += ["        " + line for line in hit]
    # The memo list every later read and store of this call uses (see _memos.ARRAYS).
    lines.append("    memo = self._memo")
    first = ["config is None"]
    if spec.where:
        first.append(f"type({spec.where}) is int and 0 <= {spec.where} < self._fast_w")
    # A root/peer goes as its shared c_int (faster for ctypes than an int).
    tail = ["cn", "code"] + (["cop"] if spec.has_op else [])
    tail += [f"self._wargs[{spec.where}]"] if spec.where else []
    tail += ["h", "cs"]
    lines.append("    if " + " and ".join(first) + ":")
    # The stream argument: the default one's shared c_void_p, a handle's (a cached one
    # is a range check passed), or any stream-like's, as the slow path reads it (its
    # first check after config: the same mistake meets the same error). Calls given a
    # stream are never remembered (a stream object's handle may go with it).
    lines += [
        "        if stream is None:",
        "            cs = self._cstream",
        "        elif type(stream) is int and (cs := _PTRS.get(stream)) is not None:",
        "            s = stream",
        "        else:",
        "            s = _as_stream(stream)",
        "            cs = _ptr_arg(s)",
    ]
    # -- raw pointers ------------------------------------------------------------------
    raw = [f"type({b}) is int" for b, _, _, _ in names[1:]] + [
        "type(count) is int",
        "type(dtype) is _DataType",
    ]
    ranges = ["0 <= count < self._fast_n"]  # the pointers': in _issue, on a cache miss
    lines += [
        f"        if type({names[0][0]}) is int:",
        "            if " + " and ".join(raw) + " and " + " and ".join(ranges) + ":",
        "                n = count",
        "                code = self._codes[dtype]",
    ]
    ready = ["code is not None", "fn is not None"]
    if spec.has_op:
        # The default op costs one identity test; other names and members one lookup
        # (the type test first: an unhashable op must reach the slow path's TypeError).
        lines.append(
            "                cop = _C_SUM if op is _SUM else self._ops.get(op) "
            "if type(op) is _RedOp or type(op) is str else None"
        )
        ready.insert(1, "cop is not None")
    lines += [
        f"                fn = self._bfn[{i}]",
        "                if " + " and ".join(ready) + ":",
    ]
    slow = "return " + slow_call(spec)
    bufs_raw = tuple(b for b, _, _, _ in names)
    memo = (str(i), "stream is None", ", ".join([*key, TAIL]))
    lines += [" " * 20 + line for line in join()]
    lines += _issue([f"c_{b}" for b in bufs_raw] + tail, i, " " * 20, slow, (memo,), bufs_raw)
    # -- arrays with a cached handler ------------------------------------------------------
    lines.append("        elif count is None and dtype is None:")
    # The interface memo (its arrays' types first; a DeviceBuffer's type is never in it).
    hit = cai_memo_hit([b for b, _, _, _ in names], extra, i, slow_call(spec), hit_kept)
    lines += ["            " + line for line in hit]
    lines += [
        "            if stream is None:",
        "                s = self._stream",
        "            dev = self._device",
    ]
    conds = []
    ordered = names if spec.count_from == "send" or len(names) == 1 else names[::-1]
    for b, p, nvar, _ in ordered:
        label = '"sendbuf"' if b == "sendbuf" else '"recvbuf"'
        writable = "True" if b != "sendbuf" else "recvbuf is None" if recv == "rb" else "False"
        shared = _shared_arg(p, p, "_PTRS", "_ptr_arg")
        handler = [
            f"{p}, {nvar}, dt_{p}, dev_{p} = hd({b}, None, None, {label}, {writable}, s)",
            *shared,
        ]
        # An array type read through __cuda_array_interface__: its common case inline
        # (the handlers' own definition, _adapt._cai.common_case), else its handler. A
        # cached pointer argument is a range check passed (PTR_ARGS keeps only those).
        # k_<p>: what a memo would key this buffer on — its _arg tuple (a DeviceBuffer),
        # False (an interface the interface memo may remember: CAI_TYPES holds None); 0
        # for another interface read inline (never complex: complex typestrs take the
        # handler); None when read by its handler (complex arrays come as float pairs).
        ok = [
            *_shared_arg(p, p, "_PTRS", "_ptr_arg", f"0 < {p} < _P63", "cai = None"),
            "if cai is not None:",
            "    if dg is None:",
            f"        dev_{p} = None",
            f"        k_{p} = False",
            "    elif dg is _NO_DEVICE:",
            f"        dev_{p} = None",
            f"        k_{p} = 0",
            "    else:",
            f"        dev_{p} = dg({b}, {label})",
            f"        k_{p} = 0",
        ]
        parts = (f"sh_{p}", f"d_{p}", f"ts_{p}")
        cai = common_case(b, writable, (p, nvar, f"dt_{p}"), ok, False, parts, "s")
        lines += [
            f"            if type({b}) is _DeviceBuffer and (t := {b}._arg) is not None:",
            f"                {p}, {nvar}, dt_{p}, dev_{p} = t",
            f"                k_{p} = t",
            f"            elif (dg := _CAI_TYPES.get(type({b}), _NO)) is not _NO:",
            f"                k_{p} = None",
            *["                " + line for line in cai],
            "                if cai is None:",
            f"                    hd = _HANDLERS[type({b})]",
            *["                    " + line for line in handler],
            f"            elif type({b}) is int or (hd := _HANDLERS.get(type({b}))) is None:",
            f"                {slow}",
            "            else:",
            f"                k_{p} = None",
            *["                " + line for line in handler],
        ]
        conds.append(f"(dev_{p} is None or dev_{p} == dev)")
    src_p, src_n, src_kind = (
        (names[0][1], names[0][2], names[0][3])
        if spec.count_from == "send" or len(names) == 1
        else (names[1][1], names[1][2], names[1][3])
    )
    lines.append("            dt = dt_" + src_p)
    if len(names) == 2:
        conds.insert(0, f"dt_{ordered[1][1]} is dt")
    if src_kind == "n":
        lines.append(f"            n, extra = divmod({src_n}, self._size)")
        conds.append("extra == 0")
    else:
        lines.append(f"            n = {src_n}")
    for _, p, nvar, kind in names:
        if p != src_p:
            conds.append(f"{nvar} >= n * self._size" if kind == "n" else f"{nvar} >= n")
    lines += [
        "            if " + " and ".join(conds) + ":",
        "                code = self._codes[dt]",
    ]
    if spec.has_op:
        # prod/max/min are undefined for complex arrays: only buffers known to be real take
        # them here (a complex DeviceBuffer, or a handler's float pairs, the slow path).
        real = [f"k_{p} is not None" for _, p, _, _ in names]
        real += [f"(type({b}) is not _DeviceBuffer or not {b}.is_complex)" for b, _, _, _ in names]
        lines += [
            "                cop = _C_SUM if op is _SUM else self._array_ops.get(op) "
            "if type(op) is _RedOp or type(op) is str else None",
            "                if cop is None and (type(op) is _RedOp or type(op) is str) and "
            + " and ".join(real)
            + ":",
            "                    cop = self._ops.get(op)",
        ]
    # k_<p> is a DeviceBuffer's _arg tuple (see above): cudaMalloc ones need no stream.
    cuda_only = " and ".join(f"type(k_{p}) is tuple and not {b}._nccl" for b, p, _, _ in names)
    lines += [
        f"                fn = self._bfn[{i}]",
        "                if " + " and ".join(ready) + ":",
        *["                    " + line for line in keep(bufs, f"None if {cuda_only} else cs")],
    ]
    tokens = [f"k_{p}" for _, p, _, _ in names]
    # Remembered when every buffer was an interface the interface memo may remember, or
    # when every buffer was a DeviceBuffer.
    interfaces = " and ".join([f"{k} is False" for k in tokens] + ["stream is None"])
    remembered = [f"type({b}), sh_{p}, d_{p}, ts_{p}" for b, p, _, _ in names]
    remembered += extra + [f"ps_{p}" for _, p, _, _ in names]  # see cai_memo_hit
    cmemo = (str(INTERFACES + i), interfaces, ", ".join([*remembered, f"({TAIL})"]))
    amemo = (str(ARRAYS + i), " and ".join([*tokens, "stream is None"]),
             ", ".join([*tokens, *extra, TAIL]))  # fmt: skip
    cargs = [p for _, p, _, _ in names] + tail
    lines += _issue(cargs, i, " " * 20, slow, (cmemo, amemo))
    lines.append("    " + slow)
    return "\n".join(lines) + "\n"


def _init_source(spec: CollSpec) -> str:
    """One row's ``<method>_init``: the method's signature, validated by the same slow path,
    returning a :class:`~._persistent.PersistentOp`."""
    sig, bufs, where = _params(spec)
    op = "op" if spec.has_op else "None"
    return (
        f"def {spec.method}_init(self, {sig}):\n"
        f"    return _persist(self, _ROWS[{spec.index}], {bufs}, {op}, {where}, count, dtype, "
        "stream, config)\n"
    )


def _sources() -> list[tuple[str, str]]:
    """``(function name, source)``: every row's method, then every row's ``_init``."""
    return [(spec.method, _method_source(spec)) for spec in COLLECTIVES] + [
        (spec.method + "_init", _init_source(spec)) for spec in COLLECTIVES
    ]


def source() -> str:
    """The generated source of every row, as compiled (a golden test diffs it)."""
    return "\n".join(text for _, text in _sources())


_ENV: dict[str, object] = {}


def _env() -> dict[str, object]:
    """The generated code's globals (built on first use: the groups/adapt imports)."""
    if not _ENV:
        from .. import groups
        from .._adapt import _BUFFER_HANDLERS, as_stream
        from ..cuda import DeviceBuffer
        from ._persistent import persistent

        _ENV.update(
            __name__=_MODULE,
            __loader__=_SourceLoader(source()),
            _DataType=DataType,
            _RedOp=RedOp,
            _SUM=RedOp.SUM,
            _C_SUM=C_REDOP[RedOp.SUM],
            _P63=1 << 63,
            _SIZE_ARGS=SIZE_ARGS,
            _size_arg=size_arg,
            _PTRS=PTR_ARGS,
            _as_stream=as_stream,
            _ptr_arg=ptr_arg,
            _persist=persistent,
            _ROWS=COLLECTIVES,
            _HANDLERS=_BUFFER_HANDLERS,
            _CAI_TYPES=CAI_TYPES,
            _NO=object(),
            _NO_DEVICE=NO_DEVICE,
            **common_case_globals(),
            _DeviceBuffer=DeviceBuffer,
            _GROUPS=groups._local,
            _OPEN=groups.OPEN,
        )
    return _ENV


def compile_method(spec: CollSpec, init: bool = False) -> Callable[..., Any]:
    """Compile one row's method (its ``_init`` with ``init``). Its lines are numbered as in
    :func:`source` (blank lines before it), which the generated globals' ``__loader__``
    serves to tracebacks."""
    texts = _sources()
    at = spec.index + (len(COLLECTIVES) if init else 0)
    name, text = texts[at]
    offset = sum(t.count("\n") + 1 for _, t in texts[:at])
    env = _env()
    code = compile("\n" * offset + text, FILENAME, "exec")
    exec(code, env)
    fn: Any = env[name]
    fn.__doc__ = _init_doc(spec) if init else spec.doc
    fn.__qualname__ = f"Communicator.{name}"
    fn.__module__ = "pynccl.comm"
    return fn  # type: ignore[no-any-return]


def _init_doc(spec: CollSpec) -> str:
    return (
        f"Persistent :meth:`{spec.method}`: the same arguments, checked once (the same errors "
        f"as :meth:`{spec.method}`); returns a :class:`~pynccl.PersistentOp` whose call "
        "``op()`` (or ``op(stream=s)``) issues the same operation again with prebuilt ctypes "
        "arguments, on the same buffers, which it keeps alive until :meth:`~pynccl."
        "PersistentOp.close`."
    )


class _Lazy:
    """A method compiled on first access (keeps ``import pynccl.comm`` cheap): the class
    attribute is then replaced by the compiled function."""

    def __init__(self, spec: CollSpec, init: bool = False) -> None:
        self.spec = spec
        self.init = init
        self.name = spec.method + ("_init" if init else "")
        self.__doc__ = _init_doc(spec) if init else spec.doc

    def __get__(self, obj: object, cls: type | None = None) -> object:
        owner = cls if cls is not None else type(obj)
        fn = compile_method(self.spec, self.init)
        setattr(owner, self.name, fn)
        return fn if obj is None else fn.__get__(obj, owner)


def install(cls: type) -> None:
    """Give ``cls`` one method per row of the table and its ``_init``, each compiled on
    first use."""
    for spec in COLLECTIVES:
        setattr(cls, spec.method, _Lazy(spec))
        setattr(cls, spec.method + "_init", _Lazy(spec, True))


def generate() -> dict[str, Callable[..., Any]]:
    """Compile every row's method and ``_init`` now; ``{name: function}``."""
    out = {spec.method: compile_method(spec) for spec in COLLECTIVES}
    out.update({spec.method + "_init": compile_method(spec, True) for spec in COLLECTIVES})
    return out
