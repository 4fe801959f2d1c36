"""Persistent operations (MPI-4's ``MPI_Allreduce_init``): ``comm.<method>_init(...)``.

The arguments are checked once, by the collectives' checked path
(:meth:`._checked.Checked._prepare`, so the same mistakes raise the same errors), and the C
call is prebuilt: every argument as the fast path passes it (pointer arguments for the
buffers, the handle and the stream, a count argument, ints for
type/op/root/peer, the config's pointer) to a second ctypes function object of the row's
C function that has *no* ``argtypes``, so ctypes converts nothing per call. The
flight-record entry is prebuilt too (the tuple the checked path would store). A call
takes the communicator's gate like every other call, checks that its handle is still the
one the arguments carry (None: destroyed, aborted, suspended, revoked, closing),
records, calls and checks the result.

Anything unusual — a ``stream=`` override, a grouped fallback plan (below NCCL 2.28),
a communicator that is not ready — takes the checked path's issue (:meth:`Communicator._run`)
with the checked plan: the same record, the same errors.
"""

from __future__ import annotations

from ctypes import c_int, c_size_t, c_void_p

from .. import groups as _groups
from .._adapt import as_stream
from .._capi._binding import arg_value, count_arg, ptr_arg
from .._closable import Closable
from ..enums import Result
from ..errors import NcclInvalidUsage
from ._handle import TERMINAL, State
from ._held import HOLDERS, needs_order
from ._recorder import RING_MASK as _MASK
from ._spec import COLLECTIVES, CollSpec

__all__ = ["PersistentOp", "persistent"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..typing import StreamLike
    from ._communicator import Communicator

_OPEN = _groups.OPEN
#: The most streams a persistent operation keeps a prebuilt call for (more are built per call).
_STREAMS_KEPT = 64
_GROUPS = _groups.STATE  # the thread's group state (groups.keep_alive, inline below)


def _ctype_args(cfunc: str, values: tuple[object, ...]) -> tuple[object, ...]:
    """``values`` (the checked path's C arguments) as a function without argtypes takes
    them: C ints as ints, counts and pointers (buffers, ``ncclComm_t``, ``cudaStream_t``)
    as count and pointer arguments (:mod:`pynccl._capi._binding`; None: NULL), the
    config's ``byref`` as it is."""
    from .._capi.nccl import PROTOTYPES  # loaded with the library, not with the object API

    out: list[object] = []
    value: Any
    for (_, ctype), value in zip(PROTOTYPES[cfunc].args, values):
        if ctype is c_int:
            out.append(int(arg_value(value)))  # type: ignore[call-overload]
        elif ctype is c_size_t:
            out.append(count_arg(arg_value(value)))  # type: ignore[arg-type]
        elif ctype is c_void_p or getattr(ctype, "_type_", None) == "P":
            out.append(ptr_arg(arg_value(value)))  # type: ignore[arg-type]
        else:  # POINTER(ncclCollConfig_t): the byref() the checked path made
            out.append(value)
    return tuple(out)


class PersistentOp(Closable):
    """A collective (or send/recv) checked once, issued again with every call.

    Made by ``comm.<method>_init(...)`` (``all_reduce_init``, ``send_init``, ... — one per
    collective, with the method's signature; ``config=`` included). ``op()`` issues the
    same operation on the same buffers and stream; ``op(stream=s)`` on another stream.
    Each call is recorded in the flight record, its result checked, and serialized with
    the communicator's other calls; inside :func:`pynccl.group` the buffers stay alive
    until the group ends. The operation keeps its buffers (and config) alive until
    :meth:`close`; a call after the communicator is destroyed, aborted, suspended or
    revoked raises :class:`~pynccl.NcclInvalidUsage` like any call, and one after
    :meth:`close`, or after a ``DeviceBuffer`` it uses was closed, raises too (before
    anything reaches NCCL). Usable as a context manager (closed on exit).

    The stream it issues on (``stream=`` of ``<method>_init``, else the communicator's
    default stream when it was made) is kept referenced as long as the buffers. The
    arrays' producer streams (``__cuda_array_interface__`` v3, DLPack) are ordered before
    it once, when the operation is made; order later writes to its buffers yourself (on
    the same stream, or with :meth:`pynccl.cuda.Stream.wait`).
    """

    __slots__ = (
        "__weakref__",
        "_args",
        "_by_stream",
        "_cfg",
        "_checks",
        "_comm",
        "_config",
        "_custom",
        "_devbufs",
        "_fn",
        "_group_stream",
        "_h",
        "_keep",
        "_plain",
        "_plan",
        "_row",
        "_slot",
        "_stream",
        "_stream_ref",
        "_streams",
    )

    def __init__(
        self,
        comm: Communicator,
        spec: CollSpec,
        plan: list[tuple[int, tuple[object, ...]]],
        s: int,
        cfg: object,
        config: object,
        keep: tuple[object, ...],
        stream_ref: object = None,
    ) -> None:
        from ..cuda import DeviceBuffer

        self._comm = comm
        self._row = spec.index
        self._plan = plan
        self._stream = s
        # The object owning stream s (a Stream, a __cuda_stream__ provider...): kept, so
        # the handle every call passes is never a destroyed stream's.
        self._stream_ref = stream_ref
        # Every stream it may have issued on: close() keeps the buffers until they passed.
        self._streams = {s}
        self._cfg = cfg
        self._config = config
        self._keep: tuple[object, ...] | None = keep
        # What a group the operation is issued in holds it for (pynccl.comm._held): its
        # stream where its buffers' memory could be handed out while the work runs.
        self._group_stream = s if needs_order(keep) else None
        self._devbufs = tuple(b for b in keep if isinstance(b, DeviceBuffer))
        custom = None
        if spec.has_op and len(plan) == 1:
            cop = plan[0][1][4]
            custom = cop if type(cop) is int else None  # an op handle from create_premul_sum
        self._custom = custom
        self._h: c_void_p | None = None
        self._fn: Any = None
        self._args: tuple[object, ...] = ()
        # The prebuilt call for each other stream it was issued on: (stream, arguments,
        # record), made with the handle of the binding (see _on).
        self._by_stream: dict[int, tuple[int, tuple[object, ...], tuple[object, ...]]] = {}
        self._slot: tuple[object, ...] = ()
        # One native call: prebuilt; a grouped fallback replays its plan.
        self._plain = len(plan) == 1
        # Something to check, or to do, before each call: the general path.
        self._checks = bool(self._devbufs) or custom is not None or not self._plain
        if self._plain:
            self._bind(comm._h)

    def _bind(self, h: c_void_p | None) -> None:
        """Prebuild the call for handle ``h`` (the communicator's, READY)."""
        if h is None:
            return
        index, pre = self._plan[0]
        cfunc = COLLECTIVES[index].cfunc
        rec: tuple[object, ...] = (*pre, h, self._stream)
        if self._cfg is None:
            self._slot = (index, rec)
        else:
            cfunc += "Config"
            rec += (self._cfg,)
            self._slot = (index, rec, 0, self._config)
        self._fn = self._comm.sited(self._comm.library.bare(cfunc))
        self._args = _ctype_args(cfunc, rec)
        self._by_stream = {}  # made with the old handle
        self._h = h

    # -- the call ---------------------------------------------------------------------------

    def __call__(self, stream: StreamLike = None) -> None:
        """Issue the operation again (on ``stream`` if given, else the stream it was made
        with)."""
        if self._checks and self._general(stream):
            return
        if stream is None:
            s, args, slot = self._stream, self._args, self._slot
        else:  # the prebuilt call for that stream (made on its first use)
            try:
                if type(stream) is not int:  # keyed by handle: 1.0 == 1, True == 1
                    raise KeyError(stream)
                s, args, slot = self._by_stream[stream]
            except KeyError:
                s, args, slot = self._on(stream)
        comm = self._comm
        gate = comm._gate
        try:
            gate.pop()
        except IndexError:
            comm._wait_gate()
        try:
            if comm._h is self._h:
                seq = comm._seq + 1
                comm._seq = seq
                if _OPEN and (gid := (st := _GROUPS.s).gid):
                    # groups.keep_alive: until the work passed its stream, if it must
                    st.keep.append((comm, None if self._group_stream is None else s, self))
                    comm._ring[seq & _MASK] = (slot[0], slot[1], gid, *slot[3:])
                else:
                    comm._ring[seq & _MASK] = slot
                rc = self._fn(*args)
            else:
                rc = -1
        finally:
            gate.append(True)
        if rc:
            if rc == -1:
                # Not ready (waits for a non-blocking communicator) or gone (raises why).
                self._bind(comm.live())
                return self(stream)
            comm._failed(self._row, rc, self._cfg is not None)  # raises, unless in progress
        if comm._watch is not None:  # issued (in progress on a non-blocking one too): watched
            comm._watch.enqueued(seq, s)
        if comm._captures:  # a Graph capturing it keeps what it uses alive (in progress too)
            comm.note_capture(s, (self, self._keep, self._config))

    def _on(self, stream: StreamLike) -> tuple[int, tuple[object, ...], tuple[object, ...]]:
        """The call on ``stream`` (checked as every call checks it), prebuilt for this
        binding and kept by the handle (int) for the next call on it: ``(stream handle,
        C arguments, flight-record entry)``. The streams it was issued on are waited for by
        close()."""
        s = as_stream(stream)
        hit = self._by_stream.get(s)
        if hit is not None:
            return hit
        self._streams.add(s)  # close() waits for it too
        at = len(self._plan[0][1]) + 1  # where the stream is among the arguments
        args = (*self._args[:at], ptr_arg(s), *self._args[at + 1 :])
        slot = (self._row, args) if self._cfg is None else (self._row, args, 0, self._config)
        hit = (s, args, slot)
        if len(self._by_stream) < _STREAMS_KEPT:
            self._by_stream[s] = hit
        return hit

    def _general(self, stream: StreamLike) -> bool:
        """The checks a call needs beyond the plain prebuilt one (closed, a closed
        DeviceBuffer, a destroyed custom op); then another stream or a fallback plan is
        issued here, through the checked path's issue (True), or the prebuilt call is left to
        the caller (False)."""
        comm = self._comm
        method = COLLECTIVES[self._row].method
        if self._keep is None:
            raise NcclInvalidUsage(
                Result.INVALID_USAGE,
                "",
                f"this persistent {method} was closed; make a new one with "
                f"comm.{method}_init(...)",
            )
        for buf in self._devbufs:
            if buf.closed:  # freed
                raise ValueError(
                    f"a DeviceBuffer of this persistent {method} was closed ({buf!r}); its "
                    "memory is gone: make a new persistent operation"
                )
        if self._custom is not None and self._custom not in comm._custom_ops:
            raise ValueError(
                f"op {self._custom} of this persistent {method} was destroyed (destroy_op); "
                "make a new persistent operation"
            )
        if self._plain:
            return False
        s = self._stream if stream is None else as_stream(stream)
        comm.live()
        self._streams.add(s)
        if self._custom is not None:
            comm._note_op_use(self._custom, s)
        _groups.keep_alive(self, comm, s)
        comm._run(self._plan, s, self._cfg, self._config)
        if comm._captures:  # a Graph capturing it keeps what it uses alive
            comm.note_capture(s, (self, self._keep, self._config))
        return True

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Release the buffers, stream and config; calls afterwards raise
        :class:`~pynccl.NcclInvalidUsage`.

        Work issued from this operation may still be queued or running: the objects stay
        referenced until every stream it issued on has passed this point (an event
        recorded on each; see :func:`pynccl.cuda._stream.keep_until_done`), and inside a
        group until the group ends. Nothing waits here: a stream-ordered allocator cannot
        hand the memory out while NCCL still reads or writes it."""
        if self._keep is None:
            return
        kept = (*self._keep, self._config, self._stream_ref)
        streams = tuple(self._streams)
        self._keep = None
        self._config = None
        self._stream_ref = None
        self._devbufs = ()
        self._checks = True
        self._plain = False
        self._args = ()
        self._by_stream = {}
        self._h = None
        if _groups.keep_alive(kept):
            return  # queued in the open group: issued at its end (which keeps them)
        comm = self._comm
        if comm.state is State.INITIALIZING:
            # A non-blocking call may not be on its stream yet: an event recorded now
            # could complete before it.
            try:
                comm.wait_ready()
            except Exception:  # failed: its work will not run
                return
        if comm.state in TERMINAL:
            return  # destroyed (its work finished) or aborted (its work stopped)
        from ..cuda._stream import keep_until_done

        keep_until_done(kept, streams, comm.watch_device())

    @property
    def method(self) -> str:
        """The Communicator method this operation repeats (``"all_reduce"``)."""
        return COLLECTIVES[self._row].method

    @property
    def function(self) -> str:
        """The C function each call issues (``"ncclAllReduce"``; with a config the NCCL >= 2.31
        variant ``"ncclAllReduceConfig"``; a grouped fallback's plan issues
        ``ncclSend``/``ncclRecv``)."""
        return COLLECTIVES[self._row].cfunc + ("" if self._cfg is None else "Config")

    @property
    def kept(self) -> tuple[object, ...] | None:
        """The objects it keeps alive (its buffers); None once closed."""
        return self._keep

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._keep is None

    def __repr__(self) -> str:
        state = " closed" if self._keep is None else ""
        return f"<pynccl.PersistentOp {self.function} on {self._comm!r}{state}>"


HOLDERS.add(PersistentOp)  # a group holds an operation as it holds its buffers


def persistent(
    comm: Communicator,
    spec: CollSpec,
    sendbuf: object,
    recvbuf: object,
    op: object,
    where: object,
    count: object,
    dtype: object,
    stream: StreamLike,
    config: object,
) -> PersistentOp:
    """``comm.<spec.method>_init(...)``: check the call once and prebuild it."""
    comm.live()
    plan, s, cfg = comm._prepare(spec, sendbuf, recvbuf, op, where, count, dtype, stream, config)
    # The object owning the stream it issues on: the one given, or the communicator's
    # default stream's (which a later ``comm.stream = ...`` would otherwise drop).
    owner = comm._stream_ref if stream is None else None if type(stream) is int else stream
    return PersistentOp(comm, spec, plan, s, cfg, config, (sendbuf, recvbuf), owner)
