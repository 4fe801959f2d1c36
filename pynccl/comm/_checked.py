"""The checked path of every collective and send/recv: :class:`Checked`, the core's.

Every call the fast path (:meth:`._collectives.Collectives._call`) does not take comes to
:meth:`Checked._slow`, which checks every argument in one fixed order — config, stream,
root/peer, count, dtype, the buffers (the count's source first), sizes, op — so that the
same mistake meets the same check first and the same words from every row (the rules
themselves are :mod:`pynccl._limits` and :mod:`._args`), then issues the plan: one C call,
or a grouped fallback's sends and receives. What it resolves (a pointer, a count, a dtype
spelling) it leaves in the shared tables, so the fast path knows it from then on.
"""

from __future__ import annotations

from ctypes import c_void_p

from .. import groups as _groups
from .._adapt import _BUFFER_HANDLERS, as_stream, buffer_handler, check_device
from .._capi._binding import count_arg, ptr_arg, size_arg
from .._limits import (
    check_count,
    check_extent,
    check_index,
    check_pointer,
    is_pointer_object,
    pointer_int,
)
from ..cuda._streamlike import CURRENT, current_stream
from ..dtypes import as_datatype, canonical_name
from ..enums import DataType, RedOp
from ..errors import NotSupportedError
from . import _recorder
from ._args import config_arg, learn_dtype, raw_needs, resolve_op
from ._core import Core
from ._spec import BROADCAST, COLLECTIVES, RECV, SEND, CollSpec, Extent, InPlace, On, Side, Where

__all__ = ["Checked", "Plan"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..typing import StreamLike

#: A checked call: ``[(row index, C arguments before (comm, stream))]`` (several rows for a
#: grouped fallback), the stream, and the ``const ncclCollConfig_t*`` argument of the row's
#: ``nccl*Config`` variant (None: the plain call).
Plan = tuple[list[tuple[int, tuple[object, ...]]], int, object]

_IN_PROGRESS = 7
_OPEN = _groups.OPEN
_GROUPS = _groups.STATE
_MASK = _recorder.RING_MASK


class Checked(Core):
    """The core's checked path of the collectives (see the module's docstring)."""

    __slots__ = ()

    # Set up by Communicator._setup: the tables the fast path reads, which this path fills.
    _optab: dict[object, RedOp]
    _dtypes: dict[object, DataType]
    _codes: dict[DataType, DataType | None]
    _custom_ops: dict[int, tuple[object, set[int]]]

    def _slow(self, spec: CollSpec, sendbuf: object, recvbuf: object, op: object,
              where: object, count: object, dtype: object, stream: StreamLike,
              config: object = None) -> None:  # fmt: skip
        """Check one call in full and issue it. ``sendbuf``/``recvbuf`` (and ``config``)
        stay referenced by this frame until the C calls return (and by the group, if one is
        open, until it ends)."""
        self.live()
        plan, s, cfg = self._prepare(spec, sendbuf, recvbuf, op, where, count, dtype, stream,
                                     config)  # fmt: skip
        if type(sendbuf) is not int or type(recvbuf) is not int or config is not None:
            _groups.keep_alive((sendbuf, recvbuf, config), self, s)
        self._run(plan, s, cfg, config)
        if self._captures:  # a Graph capture under way: it keeps what it captured alive
            self.note_capture(s, (sendbuf, recvbuf, config))

    def _prepare(self, spec: CollSpec, sendbuf: object, recvbuf: object, op: object,
                 where: object, count: object, dtype: object, stream: StreamLike,
                 config: object = None) -> Plan:  # fmt: skip
        """Check every argument of one call of ``spec`` and return its plan, in the order
        of the module's docstring."""
        version = self._lib.version
        cfg = config_arg(version, spec, config)
        size = self._size
        s = self._stream if stream is None else (
            current_stream((sendbuf, recvbuf), self._stream)
            if type(stream) is str and stream == CURRENT else as_stream(stream))  # fmt: skip
        w = -1
        if spec.where is not Where.NONE:
            w = check_index(where, spec.where.value, size, f"for a communicator of size {size}")
        n = None if count is None else check_count(count)
        user_dt = None if dtype is None else self._datatype_of(dtype)
        call = _Buffers(spec, sendbuf, recvbuf, w == self._rank, n, user_dt, size, s)
        for side in call.order():
            call.read(side, self._read_array)
        if call.n is None or call.dt is None:  # no buffer given at all
            raise TypeError(f"{spec.method} needs a buffer: sendbuf and recvbuf are both None")
        sp, rp = call.ptrs[Side.SEND], call.ptrs[Side.RECV]
        if call.in_place:
            rp = sp
        elif spec is BROADCAST and w != self._rank and sendbuf is None:
            sp = rp  # NCCL reads sendbuff on the root only
        cop: object = None
        if spec.has_op:
            cop = resolve_op(op, version, self._custom_ops, (sendbuf, recvbuf))
            if type(cop) is int:  # a custom op: its device scalar must outlive this work
                self._note_op_use(cop, s)  # type: ignore[attr-defined]  # Extras' (delegated)
        ptr_arg(s)  # the stream's shared pointer argument, for the fast path's next call
        plan = self._plan(spec, sp, rp, call.n, call.dt, cop, w)
        return plan, s, cfg

    def _datatype_of(self, dtype: object) -> DataType:
        """``dtype=`` as a DataType the library has (else NotSupportedError naming the
        releases); the fast path knows its spelling from now on."""
        dt = as_datatype(dtype)
        code = self._codes[dt]
        if code is None:
            raise NotSupportedError(f"data type {dt.c_name}", dt.first_release,
                                    self._lib.version)  # fmt: skip
        learn_dtype(self._dtypes, dtype, code)
        return dt

    def _read_array(self, obj: object, name: str, writable: bool, dtype: DataType | None,
                    s: int) -> tuple[int, int, DataType]:  # fmt: skip
        """``(ptr, elements it holds, data type)`` of an array argument (no raw pointer)."""
        handler = _BUFFER_HANDLERS.get(type(obj)) or buffer_handler(obj, name)
        ptr, n, dt, dev = handler(obj, None, dtype, name, writable, s)
        if dev is not None:
            check_device(dev, self._device, name)
        if self._codes[dt] is None:
            self._datatype_of(dt)  # raises NotSupportedError naming the type and releases
        return ptr, n, dt

    def _plan(self, spec: CollSpec, send: int, recv: int, n: int, dt: DataType, cop: object,
              w: int) -> list[tuple[int, tuple[object, ...]]]:  # fmt: skip
        """The C calls (before ``comm, stream``) that carry one call of ``spec`` on the
        pointers ``send`` and ``recv`` (0: none), each argument as the fast path passes it
        (and left in its tables for the fast path's next call)."""
        i = spec.index
        sp, rp, cn, code = ptr_arg(send), ptr_arg(recv), size_arg(n), self._codes[dt]
        count_arg(n)  # the fast path's (its functions have no argtypes)
        if spec is SEND:
            return [(i, (sp, cn, code, w))]
        if spec is RECV:
            return [(i, (rp, cn, code, w))]
        if self._fn[i] is None and spec.fallback:
            from ._fallback import grouped

            return grouped(spec, self._rank, self._size, send, recv, n, dt.itemsize, cn, code,
                           w)  # fmt: skip
        pre: tuple[object, ...] = (sp, rp, cn, code)
        if spec.has_op:
            pre += (cop,)
        if spec.where is not Where.NONE:
            pre += (w,)
        return [(i, pre)]

    def _run(self, plan: list[tuple[int, tuple[object, ...]]], s: int, cfg: object = None,
             config: object = None) -> None:  # fmt: skip
        """Issue a checked plan: one call, or a grouped fallback's calls in one group."""
        if len(plan) == 1:
            self._issue(plan[0][0], plan[0][1], s, cfg, config)
            return
        with _groups.inner_group():
            for index, pre in plan:
                self._issue(index, pre, s)

    def _issue(self, index: int, pre: tuple[object, ...], s: int, cfg: object = None,
               config: object = None) -> None:  # fmt: skip
        """One checked C call of row ``index`` (its ``nccl*Config`` variant when ``cfg``,
        the config struct's pointer, is given; ``config`` is the CollConfig recorded)."""
        row = COLLECTIVES[index]
        if cfg is None:
            fn = self._fn[index]
            if fn is None:
                raise NotSupportedError(row.cfunc, row.since, self._lib.version)
        else:  # outside the watchdog's slots: it is told below
            fn = self.sited(self._lib.raw(row.cfunc + "Config"))
        if _OPEN:  # one of the group's communicators (see pynccl.groups)
            _groups.in_progress_later(self, s)

        def issue(h: c_void_p) -> tuple[int, int]:
            seq = self._seq + 1
            self._seq = seq
            gid = _GROUPS.s.gid if _OPEN else 0
            args: tuple[object, ...] = (*pre, h, s) if cfg is None else (*pre, h, s, cfg)
            self._ring[seq & _MASK] = ((index, args, gid) if cfg is None and gid else
                                       (index, args) if cfg is None else
                                       (index, args, gid, config))  # fmt: skip
            return fn(*args), seq

        rc, seq = self.under_gate(issue)
        if rc:
            self._failed(index, rc, cfg is not None)
        if cfg is not None and self._watch is not None:  # issued, or in progress: watched
            self._watch.enqueued(seq, s)

    def _failed(self, index: int, rc: int, config: bool = False) -> None:
        """A call of row ``index`` returned ``rc``: in progress (non-blocking), or raise."""
        if rc == _IN_PROGRESS:
            if _groups.group_depth() > 0:
                _groups.in_progress_later(self)
            else:
                self.mark_pending()
            return
        name = COLLECTIVES[index].cfunc
        raise self._lib.make_error(rc, name + "Config" if config else name)


class _Buffers:
    """One call's buffers, read and checked side by side (:meth:`Checked._prepare`)."""

    def __init__(self, spec: CollSpec, sendbuf: object, recvbuf: object, is_root: bool,
                 n: int | None, dt: DataType | None, size: int, s: int) -> None:  # fmt: skip
        self.spec, self.n, self.dt, self.user_dt, self.size, self.s = spec, n, dt, dt, size, s
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

    def read(self, side: Side, read_array: _ReadArray) -> None:
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
        mult = self.size if kind is Extent.PER_RANK else 1
        if type(obj) is int:
            raw_needs(obj, name, self.n, self.dt)
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
        ptr, have, got = read_array(obj, name, writable, self.user_dt, self.s)
        self._take(side, name, ptr, have, got, mult)

    def _take(self, side: Side, name: str, ptr: int, have: int, got: DataType,
              mult: int) -> None:  # fmt: skip
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
                    f"{name} holds {have} elements, not a multiple of the {self.size} ranks"
                )
            self.n = have // mult
        if self.needs[side] and have < self.n * mult:
            raise ValueError(f"{name} holds {have} elements but this call needs {self.n * mult}")
        self.ptrs[side] = ptr


if TYPE_CHECKING:
    from collections.abc import Callable

    _ReadArray = Callable[[object, str, bool, "DataType | None", int], tuple[int, int, DataType]]
