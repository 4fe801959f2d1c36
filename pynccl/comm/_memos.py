"""The generated methods' memos: what each row remembers of its last checked call, and the
source lines that test a call against it (see :func:`memo_hit`); with :func:`gated`, the
frame of every generated C call, which memo hits share with the checked calls.

:mod:`._codegen` puts these lines into each row's method.
"""

from __future__ import annotations

from .._adapt._cai import same_case
from ..groups import JOIN, KEEP_ALIVE
from ._recorder import RING_MASK
from ._spec import COLLECTIVES, CollSpec

__all__ = ["ARRAYS", "INTERFACES", "TAIL", "array_key", "buffer_count", "cai_memo_hit",
           "empty_memos", "gated", "join", "keep", "memo_hit", "memo_key", "record",
           "same"]  # fmt: skip

#: ``self._memo`` is one list of every row's memos: the raw-pointer memo of row ``i`` at
#: ``i``, its DeviceBuffer memo at ``ARRAYS + i``, its interface memo at ``INTERFACES + i``.
#: The checked path binds the list once, first (``memo = self._memo``), and stores into
#: that list: whatever changes what a memo's C arguments were built from (the default
#: stream, the size, the row's function — the watchdog swaps it) changes it first, then
#: replaces the list (``_forget_memos``), so a call that read the old values can only
#: store into the old list, never into the one later calls read.
ARRAYS = len(COLLECTIVES)
INTERFACES = 2 * len(COLLECTIVES)
#: What every memo holds after its key: the row's function and the gate (for the call,
#: without two attribute lookups), the C arguments, the flight-record entry (the interface
#: memo, whose hits unpack it apart from the key, as one tuple).
TAIL = "fn, gate, args, entry"


def record(i: int, args: str, entry: str) -> str:
    """The flight-record entry of a call of row ``i`` whose C arguments are ``args``: the
    prebuilt ``entry`` (``(i, args)``) outside a group, else ``(i, args, gid)``, the group
    number :func:`keep` or :func:`join` bound."""
    return f"({i}, {args}, gid) if gid else {entry}"


def gated(
    i: int, prepare: list[str], record: str, call: str, slow: str, gate: bool = True
) -> list[str]:
    """Every generated C call's frame: take the gate (``gate``: bind it from ``self._gate``
    first; a memo hit has it from the memo), test the handle, run ``prepare``, store
    ``record`` in the flight recorder, make the C call ``call``, give the gate back; then
    ``slow`` (a statement) if the handle was gone, and the result check."""
    return [
        *(["gate = self._gate"] if gate else []),
        "try:",
        "    gate.pop()",
        "except IndexError:",
        "    self._wait_gate()",
        "try:",
        "    h = self._h",
        "    if h is not None:",
        *["        " + line for line in prepare],
        "        seq = self._seq + 1",
        "        self._seq = seq",
        f"        self._ring[seq & {RING_MASK}] = {record}",
        f"        rc = {call}",
        "finally:",
        "    gate.append(True)",
        "if h is None:",
        f"    {slow}",
        "if rc:",
        f"    self._failed({i}, rc)",
        "return",
    ]


def memo_key(spec: CollSpec) -> list[str]:
    """The parameters whose objects identify a call for the memo (``stream`` and
    ``config`` must be None)."""
    key = ["sendbuf"] if spec.send != "-" else []
    key += ["recvbuf"] if spec.recv != "-" else []
    key += ["count", "dtype"] + (["op"] if spec.has_op else [])
    return key + ([spec.where] if spec.where else [])


#: The raw-pointer memo's keys that are ints (pointers, count): callers make them afresh
#: at every call (``t.data_ptr()``, ``t.numel()``), equal to the last call's.
_INT_KEYS = ("sendbuf", "recvbuf", "count")


def same(name: str, kept: str) -> str:
    """The test that parameter ``name`` is what the memo item ``kept`` was made from: the
    very object, or — for an int key — an int of the same value (the checks it passed
    hold for any int equal to it; a bool, a float or a numpy integer is not an int)."""
    if name in _INT_KEYS:
        return f"({name} is {kept} or type({name}) is int and {name} == {kept})"
    return f"{name} is {kept}"


def memo_hit(
    memo: str,
    conds: list[str],
    n: int,
    at: str,
    i: int,
    slow: str,
    pre: tuple[str, ...] = (),
) -> list[str]:
    """A memo (``{memo}[{at}]``): a call whose arguments are those its row's last checked
    call of that kind was made from (``conds``, tests against the memo's first ``n``
    items, unpacked as ``m0``, ``m1``, ...: identity, or :func:`same`) reuses that call's
    function, C arguments (shared ctypes objects) and record entry (:data:`TAIL`), after
    the lines ``pre``.

    The raw-pointer memo remembers the argument objects themselves: only ints, a
    DataType, an op name/member and None (immutable, so the earlier checks still hold,
    and nothing large is kept alive; a PreMulSum op, an int, takes the slow path and is
    never remembered); its int keys also match an equal int (:func:`same`). The
    DeviceBuffer memo remembers each buffer's ``_arg`` tuple, not the buffer: a closed
    buffer's is None, a new buffer's a new tuple, and the buffer itself is not kept
    alive (the interface memo, for ``__cuda_array_interface__`` arrays:
    :func:`cai_memo_hit`). ``comm.stream = ...`` forgets them all. Anything else falls
    through to the checks. The lines ``pre`` (:func:`keep` or :func:`join`, where
    ``margs[-1]`` is the stream) bind ``gid``, the group number to record."""
    entry = record(i, "margs", "mentry")
    names = ", ".join(f"m{j}" for j in range(n))
    body = [
        f"{names}, fn, gate, margs, mentry = {memo}[{at}]",
        "if " + " and ".join(conds) + ":",
        *["    " + line for line in pre],
        *["    " + line for line in gated(i, [], entry, "fn(*margs)", "return " + slow, False)],
    ]
    return body


def keep(bufs: str, stream: str) -> tuple[str, ...]:
    """Keeping a call's buffers (``bufs``: a tuple's items) alive until the work of the
    group it is queued in has run on ``stream`` (an expression: the call's stream
    argument), counting the communicator among the group's, and binding ``gid``, the
    group's number (0: none) for the flight record, in one look at the thread's group
    state (:data:`pynccl.groups.KEEP_ALIVE`)."""
    return tuple(line.format(comm="self", stream=stream, objs=bufs) for line in KEEP_ALIVE)


def join() -> tuple[str, ...]:
    """:func:`keep` for a call that keeps nothing alive (raw pointers): the communicator
    joins the open group (:data:`pynccl.groups.JOIN`), ``gid`` is bound."""
    return tuple(line.format(comm="self") for line in JOIN)


def cai_memo_hit(
    names: list[str], extra: list[str], i: int, slow: str, kept: tuple[str, ...]
) -> list[str]:
    """The interface memo, ``cm = memo[INTERFACES + i]``: a call of ``__cuda_array_interface__``
    arrays (parameters ``names``) of the types the row's last such call had, whose
    interfaces hold that call's very shape, data, typestr and stream objects (tuples of
    ints, a str, an int or None: immutable) with no strides or mask
    (:func:`~pynccl._adapt._cai.same_case`; the memo is forgotten when the communicator's
    stream changes, so the producers' streams still need no order) — ``cm`` holds, per
    buffer, its type and its first three, then ``extra``'s objects, then each buffer's
    stream, then the tuple of :data:`TAIL` — reuses the C arguments. The
    common case would read the same again, for any array of those types; the array
    itself is not kept alive.

    Only types whose arrays tell no device and keep their interface (the same dict at
    every read: ``CAI_TYPES`` holds None for them) are remembered; most producers (CuPy,
    Numba, PyTorch) build theirs afresh, and their calls pay no memo store. A call that
    misses reads a kept interface again in the checks (the same dict)."""
    key = [f"type({b}) is cm[{4 * j}]" for j, b in enumerate(names)]
    key += [f"{k} is cm[{4 * len(names) + j}]" for j, k in enumerate(extra)] + ["stream is None"]
    tail = 4 * len(names) + len(extra)  # where the streams start
    body: list[str] = []
    for j, b in enumerate(names):
        parts = (f"cm[{4 * j + 1}]", f"cm[{4 * j + 2}]", f"cm[{4 * j + 3}]", f"cm[{tail + j}]")
        found = same_case("cai", parts)
        pad = "    " * j
        body += [f"{pad}cai = {b}.__cuda_array_interface__"]
        body += [f"{pad}hit = {found}"] if j == len(names) - 1 else [f"{pad}if {found}:"]
    entry = record(i, "margs", "mentry")
    return [
        f"cm = memo[{INTERFACES + i}]",
        "if " + " and ".join(key) + ":",
        "    hit = False",
        "    try:",
        *["        " + line for line in body],
        "    except Exception:  # the checks read the interface again and say why",
        "        pass",
        "    if hit:",
        "        fn, gate, margs, mentry = cm[-1]",
        *["        " + line for line in kept],
        *["        " + line for line in gated(i, [], entry, "fn(*margs)", "return " + slow, False)],
    ]


def array_key(spec: CollSpec) -> list[str]:
    """What the DeviceBuffer memo tests besides the buffers' ``_arg``: op, root/peer."""
    return (["op"] if spec.has_op else []) + ([spec.where] if spec.where else [])


def buffer_count(spec: CollSpec) -> int:
    return (spec.send != "-") + (spec.recv != "-")


_EMPTY: list[tuple[object, ...]] = []


def empty_memos() -> list[tuple[object, ...]]:
    """A fresh ``self._memo`` with nothing remembered: each row's raw-pointer, DeviceBuffer
    and interface memo (at ``i``, ``ARRAYS + i``, ``INTERFACES + i``) with as many items as
    the generated code unpacks, each an object no argument (nor its type) can be (the
    tuples, made once, are shared)."""
    if not _EMPTY:
        nothing = object()
        tail = len(TAIL.split(", "))
        for per_buffer in (0, 1, 5):  # interface memos: 4 a buffer, then its stream
            _EMPTY.extend(
                (nothing,)
                * (len(memo_key(spec)) if per_buffer == 0 else
                   per_buffer * buffer_count(spec) + len(array_key(spec)))
                + (nothing,) * (tail if per_buffer < 4 else 1)
                for spec in COLLECTIVES
            )  # fmt: skip
    return list(_EMPTY)
