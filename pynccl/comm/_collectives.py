"""Every collective and send/recv of :class:`~pynccl.Communicator`, through one path.

Each method is a line that names its row of the spec table (:mod:`._spec`) and hands its
arguments to :meth:`Collectives._call`, the one fast path, written once and read top to
bottom. It resolves every documented argument form through the same cheap step — value-keyed
tables, as NCCL's own ``ncclEnqueueCheck`` fills one ``ncclInfo``:

* ``dtype`` and ``op`` through a dict keyed by value (:func:`._args.dtype_table`,
  :func:`._args.op_table`): ``DataType``/``RedOp`` members, names and aliases, and every
  form the checked path has resolved before (numpy dtypes and scalar types, torch dtypes),
  each to its member (an int, which ctypes passes as a C int as it is);
* raw pointers (the same ints or made afresh: keyed by value), counts and stream handles
  through the shared pointer and count arguments of :mod:`pynccl._capi._binding`
  (``byref`` objects, which ctypes passes with no object made per call); roots and peers
  as the ints themselves;
* arrays (``DeviceBuffer``, ``__cuda_array_interface__``, DLPack) through their type's
  handler (:mod:`pynccl._adapt`), once per buffer.

then joins the open group, takes the gate, stores one flight-record entry, makes one C
call (a function without argtypes: every argument is already what C takes) and checks
its result. Anything else — a form seen for the first time, ``None`` buffers, a per-call
``config=``, a capture under way, a communicator not ready — goes to the checked path
(:meth:`._checked.Checked._slow`, ``_prepare``), which words every mistake the same way
for every row; what it resolves, the fast path knows from then on. No cache here needs
invalidating: every table maps a value to what that value means.
"""

from __future__ import annotations

from .. import groups as _groups
from .._adapt import _BUFFER_HANDLERS, _STREAM_HANDLERS, is_complex
from .._capi._binding import COUNT_ARGS, PTR_ARGS
from ..enums import DataType
from . import _colldocs, _recorder
from ._args import NO_COMPLEX
from ._checked import Checked
from ._persistent import PersistentOp, persistent
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
)
from ._work import Work, issue

__all__ = ["Collectives"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..typing import BufferLike, DTypeLike, OpLike, StreamLike
    from ._collconfig import CollConfig
    from ._communicator import Communicator

_OPEN = _groups.OPEN  # threads with a group open (empty: nothing to look up)
_GROUPS = _groups.STATE  # the calling thread's group state: ``.s``
_MASK = _recorder.RING_MASK
#: What :meth:`Collectives._arrays` resolves: send and recv pointer arguments (None for a
#: buffer the row has not), count, type.
_Resolved = tuple[object, object, object, "DataType | None"]
_SLOW = (KeyError, TypeError, IndexError)  # a miss in a table: the checked path decides
_ABSENT = {True: None}  # a row without the buffer: None; a row with it: KeyError

def _issue(comm: Collectives, row: CollSpec, async_op: object, *args: Any) -> Work | None:
    """A call with ``async_op=True``: through the one path, then its handle (:mod:`._work`;
    ``args`` as :meth:`Collectives._call` takes them, the stream seventh)."""
    return issue(comm._me(), lambda: comm._call(row, *args), args[6], async_op, args[:2])


class Collectives(Checked):
    """The core's collectives: the one fast path and the checked one (Communicator
    subclasses this; one line of inheritance: handle, record, core, collectives)."""

    __slots__ = ()

    # Set up by Communicator._setup (see there): the raw-pointer count bound.
    _fast_n: int

    def _call(self, row: CollSpec, sendbuf: object, recvbuf: object, op: object, where: object,
              count: object, dtype: object, stream: StreamLike,
              config: object) -> None:  # fmt: skip
        """The one path of every collective and send/recv (see the module's docstring).

        An op hits only as a RedOp (its own value) or a name: another key that equals one
        (``0.0 == RedOp.SUM``) goes to the checked path, as does a buffer that is no int
        (``_ABSENT``: None for a buffer the row has not, else KeyError). Inside this
        thread's group, the call joins it (:func:`pynccl.groups.keep_alive`, inline):
        arrays stay alive until the group's work has run on the stream. The C arguments
        are in nccl.h's order for the row (``CollSpec.layout``), two tests away for the
        most used ones."""
        i, has_op, has_where, in_place, no_send, no_recv, lay, _, _, _, _ = row.fast
        try:  # fn None: not exported, or a capture under way (the checked path)
            if (fn := self._bfn[i]) is None or config is not None:
                raise KeyError(config)
            if stream is None:
                s, cst = self._stream, self._cstream
            else:
                s = stream if type(stream) is int else _STREAM_HANDLERS[type(stream)](stream)
                cst = PTR_ARGS[s] if s else None
            if has_op:
                cop = self._optab[op]
                if cop is not op and type(op) is not str:
                    raise KeyError(op)
            if has_where and (type(where) is not int or not 0 <= where < self._size):
                raise KeyError(where)
            if type(count) is int and count < self._fast_n:  # raw pointers (a miss: < 0)
                keep = False
                code = self._codes[dtype] if type(dtype) is DataType else self._dtypes[dtype]
                cn = COUNT_ARGS[count]
                cs = PTR_ARGS[sendbuf] if type(sendbuf) is int else _ABSENT[no_send]
                cr = (PTR_ARGS[recvbuf] if type(recvbuf) is int else
                      cs if in_place and recvbuf is None else _ABSENT[no_recv])  # fmt: skip
                if code is None:  # a type too new for the library: the checked path says so
                    raise KeyError(dtype)
            else:  # arrays: each read by its type's handler
                cs, cr, cn, code = self._arrays(row, sendbuf, recvbuf, op, where, s, count, dtype)
                keep = True
        except _SLOW:
            return self._slow(row, sendbuf, recvbuf, op, where, count, dtype, stream, config)
        gid = 0
        if _OPEN and (gid := (st := _GROUPS.s).gid):  # a group of this thread is open
            st.keep.append((self, s, sendbuf, recvbuf)) if keep else st.comms.append((self, s))
        gate = self._gate
        try:
            gate.pop()
        except IndexError:
            self._wait_gate()
        try:
            h = self._h
            if h is not None:
                args = (((cs, cr, cn, code, cop, h, cst) if lay == 1 else
                         (cs, cr, cn, code, h, cst)) if lay < 2 else
                        ((cs, cn, code, where, h, cst) if lay == 4 else
                         (cr, cn, code, where, h, cst)) if lay > 3 else
                        (cs, cr, cn, code, where, h, cst) if lay == 2 else
                        (cs, cr, cn, code, cop, where, h, cst))  # fmt: skip
                seq = self._seq + 1
                self._seq = seq
                self._ring[seq & _MASK] = (i, args, gid) if gid else (i, args)
                rc = fn(*args)
        finally:
            gate.append(True)
        if h is None:  # not ready yet, or gone: the checked path waits, or says why
            return self._slow(row, sendbuf, recvbuf, op, where, count, dtype, stream, config)
        if rc:
            self._failed(i, rc)

    def _arrays(self, row: CollSpec, sendbuf: object, recvbuf: object, op: object,
                where: object, s: int, count: object, dtype: object) -> _Resolved:  # fmt: skip
        """The fast path's arrays, each read once by its type's handler, as
        :meth:`._checked.Checked._prepare` reads them (the count's source first): ``(send
        pointer argument, recv pointer argument, count argument, DataType)``, None for a
        buffer the row has not. Raises KeyError for what the checked path must look at
        instead: count= or dtype= given, a type read for the first time, a buffer on
        another device or of another type, odd sizes, a rooted call off its root, a
        complex array with prod/max/min."""
        _, has_op, _, in_place, no_send, no_recv, _, send_n, recv_n, first, rooted = row.fast
        in_place = in_place and recvbuf is None
        if count is not None or dtype is not None:
            raise KeyError(count)
        if has_op and self._optab[op] in NO_COMPLEX and (
            is_complex(sendbuf) or (not in_place and is_complex(recvbuf))
        ):
            raise KeyError(op)  # the checked path words it
        if in_place or no_send or no_recv:  # one buffer
            one, name = (recvbuf, "recvbuf") if no_send else (sendbuf, "sendbuf")
            ptr, n, dt, dev = _BUFFER_HANDLERS[type(one)](one, None, None, name,
                                                          in_place or no_send, s)  # fmt: skip
            # A pointer or count not seen yet: the checked path makes its shared argument.
            cs = None if no_send else PTR_ARGS[ptr]
            cr = None if no_recv else PTR_ARGS[ptr]
        else:
            if rooted and where != self._rank:
                raise KeyError(where)  # which buffers this rank reads depends on the root
            read = _BUFFER_HANDLERS
            if first:  # the count's source first
                sp, n, dt, dev = read[type(sendbuf)](sendbuf, None, None, "sendbuf", False, s)
                rp, n2, dt2, dev2 = read[type(recvbuf)](recvbuf, None, None, "recvbuf", True, s)
            else:
                rp, n, dt, dev = read[type(recvbuf)](recvbuf, None, None, "recvbuf", True, s)
                sp, n2, dt2, dev2 = read[type(sendbuf)](sendbuf, None, None, "sendbuf", False, s)
            if send_n or recv_n:  # a per-rank extent: n elements are count * its multiplier
                size = self._size
                ma, mb = (size if send_n else 1, size if recv_n else 1)
                if not first:
                    ma, mb = mb, ma
                if n % ma:
                    raise KeyError(n)
                n //= ma
                n2 //= mb
            if n2 < n or dt2 is not dt or (dev2 is not None and dev2 != self._device):
                raise KeyError(n2)
            cs, cr = PTR_ARGS[sp], PTR_ARGS[rp]
        code = self._codes[dt]
        if code is None or (dev is not None and dev != self._device):
            raise KeyError(dt)
        return cs, cr, COUNT_ARGS[n], code

    def _me(self) -> Communicator:
        return self  # type: ignore[return-value]  # the only subclass

    # -- the collectives ---------------------------------------------------------------------

    def all_reduce(self, sendbuf: BufferLike, recvbuf: BufferLike | None = None,
                   op: OpLike = "sum", *, count: int | None = None, dtype: DTypeLike = None,
                   stream: StreamLike = None,
                   config: CollConfig | None = None,
                   async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, ALL_REDUCE, async_op, sendbuf, recvbuf, op, None, count, dtype,
                          stream, config)  # fmt: skip
        self._call(ALL_REDUCE, sendbuf, recvbuf, op, None, count, dtype, stream, config)
        return None

    def broadcast(self, sendbuf: BufferLike | None, recvbuf: BufferLike | None = None, *,
                  root: int = 0, count: int | None = None, dtype: DTypeLike = None,
                  stream: StreamLike = None,
                  config: CollConfig | None = None,
                  async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, BROADCAST, async_op, sendbuf, recvbuf, None, root, count, dtype,
                          stream, config)  # fmt: skip
        self._call(BROADCAST, sendbuf, recvbuf, None, root, count, dtype, stream, config)
        return None

    def reduce(self, sendbuf: BufferLike, recvbuf: BufferLike | None = None,
               op: OpLike = "sum", *, root: int = 0, count: int | None = None,
               dtype: DTypeLike = None, stream: StreamLike = None,
               config: CollConfig | None = None,
               async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, REDUCE, async_op, sendbuf, recvbuf, op, root, count, dtype, stream,
                          config)  # fmt: skip
        self._call(REDUCE, sendbuf, recvbuf, op, root, count, dtype, stream, config)
        return None

    def all_gather(self, sendbuf: BufferLike, recvbuf: BufferLike, *,
                   count: int | None = None, dtype: DTypeLike = None,
                   stream: StreamLike = None,
                   config: CollConfig | None = None,
                   async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, ALL_GATHER, async_op, sendbuf, recvbuf, None, None, count, dtype,
                          stream, config)  # fmt: skip
        self._call(ALL_GATHER, sendbuf, recvbuf, None, None, count, dtype, stream, config)
        return None

    def reduce_scatter(self, sendbuf: BufferLike, recvbuf: BufferLike, op: OpLike = "sum", *,
                       count: int | None = None, dtype: DTypeLike = None,
                       stream: StreamLike = None,
                       config: CollConfig | None = None,
                       async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, REDUCE_SCATTER, async_op, sendbuf, recvbuf, op, None, count, dtype,
                          stream, config)  # fmt: skip
        self._call(REDUCE_SCATTER, sendbuf, recvbuf, op, None, count, dtype, stream, config)
        return None

    def gather(self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, *, root: int = 0,
               count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
               config: CollConfig | None = None,
               async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, GATHER, async_op, sendbuf, recvbuf, None, root, count, dtype,
                          stream, config)  # fmt: skip
        self._call(GATHER, sendbuf, recvbuf, None, root, count, dtype, stream, config)
        return None

    def scatter(self, sendbuf: BufferLike | None, recvbuf: BufferLike, *, root: int = 0,
                count: int | None = None, dtype: DTypeLike = None, stream: StreamLike = None,
                config: CollConfig | None = None,
                async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, SCATTER, async_op, sendbuf, recvbuf, None, root, count, dtype,
                          stream, config)  # fmt: skip
        self._call(SCATTER, sendbuf, recvbuf, None, root, count, dtype, stream, config)
        return None

    def all_to_all(self, sendbuf: BufferLike, recvbuf: BufferLike, *, count: int | None = None,
                   dtype: DTypeLike = None, stream: StreamLike = None,
                   config: CollConfig | None = None,
                   async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, ALL_TO_ALL, async_op, sendbuf, recvbuf, None, None, count, dtype,
                          stream, config)  # fmt: skip
        self._call(ALL_TO_ALL, sendbuf, recvbuf, None, None, count, dtype, stream, config)
        return None

    def send(self, sendbuf: BufferLike, peer: int, *, count: int | None = None,
             dtype: DTypeLike = None, stream: StreamLike = None,
             config: CollConfig | None = None,
             async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, SEND, async_op, sendbuf, None, None, peer, count, dtype, stream,
                          config)  # fmt: skip
        self._call(SEND, sendbuf, None, None, peer, count, dtype, stream, config)
        return None

    def recv(self, recvbuf: BufferLike, peer: int, *, count: int | None = None,
             dtype: DTypeLike = None, stream: StreamLike = None,
             config: CollConfig | None = None,
             async_op: bool = False) -> Work | None:  # fmt: skip
        if async_op is not False:
            return _issue(self, RECV, async_op, None, recvbuf, None, peer, count, dtype, stream,
                          config)  # fmt: skip
        self._call(RECV, None, recvbuf, None, peer, count, dtype, stream, config)
        return None

    # -- persistent operations: checked once, issued with prebuilt arguments ---------------

    def all_reduce_init(self, sendbuf: BufferLike, recvbuf: BufferLike | None = None,
                        op: OpLike = "sum", *, count: int | None = None,
                        dtype: DTypeLike = None, stream: StreamLike = None,
                        config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), ALL_REDUCE, sendbuf, recvbuf, op, None, count, dtype, stream,
                          config)  # fmt: skip

    def broadcast_init(self, sendbuf: BufferLike | None, recvbuf: BufferLike | None = None,
                       *, root: int = 0, count: int | None = None, dtype: DTypeLike = None,
                       stream: StreamLike = None,
                       config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), BROADCAST, sendbuf, recvbuf, None, root, count, dtype, stream,
                          config)  # fmt: skip

    def reduce_init(self, sendbuf: BufferLike, recvbuf: BufferLike | None = None,
                    op: OpLike = "sum", *, root: int = 0, count: int | None = None,
                    dtype: DTypeLike = None, stream: StreamLike = None,
                    config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), REDUCE, sendbuf, recvbuf, op, root, count, dtype, stream,
                          config)  # fmt: skip

    def all_gather_init(self, sendbuf: BufferLike, recvbuf: BufferLike, *,
                        count: int | None = None, dtype: DTypeLike = None,
                        stream: StreamLike = None,
                        config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), ALL_GATHER, sendbuf, recvbuf, None, None, count, dtype,
                          stream, config)  # fmt: skip

    def reduce_scatter_init(self, sendbuf: BufferLike, recvbuf: BufferLike,
                            op: OpLike = "sum", *, count: int | None = None,
                            dtype: DTypeLike = None, stream: StreamLike = None,
                            config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), REDUCE_SCATTER, sendbuf, recvbuf, op, None, count, dtype,
                          stream, config)  # fmt: skip

    def gather_init(self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, *,
                    root: int = 0, count: int | None = None, dtype: DTypeLike = None,
                    stream: StreamLike = None,
                    config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), GATHER, sendbuf, recvbuf, None, root, count, dtype, stream,
                          config)  # fmt: skip

    def scatter_init(self, sendbuf: BufferLike | None, recvbuf: BufferLike, *, root: int = 0,
                     count: int | None = None, dtype: DTypeLike = None,
                     stream: StreamLike = None,
                     config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), SCATTER, sendbuf, recvbuf, None, root, count, dtype, stream,
                          config)  # fmt: skip

    def all_to_all_init(self, sendbuf: BufferLike, recvbuf: BufferLike, *,
                        count: int | None = None, dtype: DTypeLike = None,
                        stream: StreamLike = None,
                        config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), ALL_TO_ALL, sendbuf, recvbuf, None, None, count, dtype,
                          stream, config)  # fmt: skip

    def send_init(self, sendbuf: BufferLike, peer: int, *, count: int | None = None,
                  dtype: DTypeLike = None, stream: StreamLike = None,
                  config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), SEND, sendbuf, None, None, peer, count, dtype, stream, config)

    def recv_init(self, recvbuf: BufferLike, peer: int, *, count: int | None = None,
                  dtype: DTypeLike = None, stream: StreamLike = None,
                  config: CollConfig | None = None) -> PersistentOp:  # fmt: skip
        return persistent(self._me(), RECV, None, recvbuf, None, peer, count, dtype, stream, config)



_colldocs.attach(Collectives)
