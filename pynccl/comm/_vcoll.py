"""The v-collectives (``all_gather_v``, ``reduce_scatter_v``, ``all_to_all_v``) and
``barrier``: NCCL has no native call for them, so each is one group of the table's own
primitives (``send``/``recv``, ``reduce``, ``all_reduce``), issued through the fast
methods with raw pointers — recorded, gated and error-checked like any collective, and
stream-ordered, so they capture into a CUDA graph.

Every count, displacement and buffer is checked before the group opens: a mistake raises
with nothing issued (the receive buffer untouched). Counts and displacements are in
elements of the buffers' type (complex elements for complex arrays); displacements
default to the prefix sums of the counts. A raw pointer carries no size: its extent is
what the counts and displacements reach (checked as a pointer range), and ``dtype=`` is
required for it.
"""

from __future__ import annotations

from .. import groups as _groups
from .._adapt import as_buffer, check_device, is_complex
from .._limits import check_count, check_extent, check_flag, check_pointer, is_pointer_object
from ..dtypes import as_element_type, canonical_name, complex_name
from ..enums import DataType, RedOp
from ._args import resolve_op
from ._work import Work, after, refuse, stream_of

__all__ = ["VCollectives"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Container, Sequence
    from typing import Any

    from ..cuda import DeviceBuffer
    from ..typing import BufferLike, DTypeLike, OpLike, StreamLike
    from ._communicator import Communicator

# One buffer as the group needs it: (pointer, NCCL type, lanes = floats per element).
_Buf = tuple[int, DataType, int]


class VCollectives:
    """all_gather_v, reduce_scatter_v, all_to_all_v and barrier: a part of
    :class:`~pynccl.Communicator`, over its core's public surface and its collectives."""

    __slots__ = ("barrier_buf", "core", "custom_ops")

    def __init__(
        self, core: Communicator, barrier_buf: list[DeviceBuffer], custom_ops: Container[int]
    ) -> None:
        self.core = core
        #: The barrier's buffer once allocated (the communicator's ``_barrier_buf``).
        self.barrier_buf = barrier_buf
        #: The ops ``create_premul_sum`` made (the communicator's ``_custom_ops``).
        self.custom_ops = custom_ops
        core.on_retire(self._free_barrier)

    # -- argument rules, shared by the three v-collectives ----------------------------------

    def _v_counts(self, values: Any, name: str) -> list[int]:
        """One non-negative count per rank."""
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(
                f"{name} must be a sequence of {self.core.size} counts (one per rank), "
                f"got {type(values).__name__} {values!r}"
            )
        if len(values) != self.core.size:
            raise ValueError(
                f"{name} has {len(values)} entries; expected one per rank ({self.core.size})"
            )
        return [check_count(v, f"{name}[{i}]") for i, v in enumerate(values)]

    def _v_displs(self, values: Any, name: str, counts: list[int]) -> list[int]:
        """Displacements, one per rank; by default the prefix sums of ``counts``."""
        if values is None:
            out, at = [], 0
            for c in counts:
                out.append(at)
                at += c
            return out
        return self._v_counts(values, name)

    def _v_buffer(
        self,
        obj: Any,
        name: str,
        writable: bool,
        dtype: DTypeLike,
        extent: int,
        what: str,
        s: int,
    ) -> _Buf:
        """``obj``'s pointer and type, checked to hold ``extent`` elements (``what`` says
        which count or displacement needs them)."""
        if type(obj) is not int and is_pointer_object(obj):
            obj = int(obj)  # a cuda.bindings CUdeviceptr
        if type(obj) is int:
            if dtype is None:
                raise TypeError(
                    f"{name} is a raw pointer ({obj:#x}), which carries no type: dtype= must "
                    "be given"
                )
            dt, lanes = as_element_type(dtype)
            self.core.datatype(dt)
            nbytes = check_extent(extent * lanes, dt.itemsize, name)
            return check_pointer(obj, name, nbytes), dt, lanes
        if obj is None or isinstance(obj, (bool, float)):
            raise TypeError(
                f"{name} must be a device buffer or a raw pointer (int), "
                f"got {type(obj).__name__} {obj!r}"
            )
        ptr, n, dt, dev = as_buffer(obj, None, dtype, name=name, writable=writable, stream=s)
        check_device(dev, self.core.device, name)
        self.core.datatype(dt)
        lanes = 2 if is_complex(obj) else 1
        have = n // lanes
        if extent > have:
            raise ValueError(f"{name} holds {have} elements but {what} needs {extent}")
        return ptr, dt, lanes

    def _v_reach(self, counts: list[int], displs: list[int], name: str) -> tuple[int, str]:
        """How many elements the blocks reach (the largest ``displ + count`` of a non-empty
        block), and the words naming that block."""
        reach, what = 0, ""
        for i, (c, d) in enumerate(zip(counts, displs)):
            if c and d + c > reach:
                reach = d + c
                what = f"{name}displs[{i}] + {name}counts[{i}] = {d} + {c}"
        return reach, what

    @staticmethod
    def _v_same_type(send: _Buf, recv: _Buf) -> None:
        if send[1:] != recv[1:]:
            sname = complex_name(send[1]) if send[2] == 2 else canonical_name(send[1])
            rname = complex_name(recv[1]) if recv[2] == 2 else canonical_name(recv[1])
            raise TypeError(
                f"sendbuf and recvbuf have different data types: sendbuf is {sname} but "
                f"recvbuf is {rname}"
            )

    def _v_stream(self, stream: StreamLike, *arrays: object) -> int:
        self.core.live()
        return stream_of(self.core, stream, arrays)

    # -- the v-collectives ------------------------------------------------------------------

    def all_gather_v(
        self,
        sendbuf: BufferLike | None,
        recvbuf: BufferLike,
        counts: Sequence[int],
        *,
        displs: Sequence[int] | None = None,
        dtype: DTypeLike = None,
        stream: StreamLike = None,
        async_op: bool = False,
    ) -> Work | None:
        """Gather ``counts[j]`` elements from every rank ``j`` into ``recvbuf`` at
        ``displs[j]`` (default: the prefix sums of ``counts``), on every rank.

        ``sendbuf`` holds this rank's ``counts[rank]`` elements; ``sendbuf=None`` works in
        place (this rank's block is already at ``displs[rank]`` in ``recvbuf``). Every rank
        passes the same ``counts`` and ``displs``. Grouped ``ncclSend``/``ncclRecv``.
        """
        s = self._v_stream(stream, sendbuf, recvbuf)
        self._v_refuse(s, async_op)
        counts = self._v_counts(counts, "counts")
        displs = self._v_displs(displs, "displs", counts)
        me = self.core.rank
        reach, what = self._v_reach(counts, displs, "")
        recv = self._v_buffer(recvbuf, "recvbuf", True, dtype, reach, what, s)
        if sendbuf is None:
            send = (recv[0] + displs[me] * recv[1].itemsize * recv[2], recv[1], recv[2])
        else:
            send = self._v_buffer(
                sendbuf, "sendbuf", False, dtype, counts[me], f"counts[{me}] = {counts[me]}", s
            )
            self._v_same_type(send, recv)
        ptr, dt, lanes = recv
        size = dt.itemsize * lanes
        sends = [(j, send[0], counts[me]) for j in range(self.core.size)]
        recvs = [(j, ptr + displs[j] * size, counts[j]) for j in range(self.core.size)]
        if sendbuf is None:  # in place: nothing to move to itself
            sends[me] = recvs[me] = (me, 0, 0)
        self._v_issue(sends, recvs, dt, lanes, s, (sendbuf, recvbuf))
        return after(self.core, s) if async_op else None

    def all_to_all_v(
        self,
        sendbuf: BufferLike,
        recvbuf: BufferLike,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        send_displs: Sequence[int] | None = None,
        recv_displs: Sequence[int] | None = None,
        dtype: DTypeLike = None,
        stream: StreamLike = None,
        async_op: bool = False,
    ) -> Work | None:
        """Send ``send_counts[j]`` elements at ``send_displs[j]`` of ``sendbuf`` to rank
        ``j`` and receive ``recv_counts[j]`` elements from rank ``j`` into ``recvbuf`` at
        ``recv_displs[j]`` (displacements default to the prefix sums of the counts).

        ``send_counts[j]`` on this rank must equal ``recv_counts[rank]`` on rank ``j``.
        Grouped ``ncclSend``/``ncclRecv``.
        """
        s = self._v_stream(stream, sendbuf, recvbuf)
        self._v_refuse(s, async_op)
        scounts = self._v_counts(send_counts, "send_counts")
        rcounts = self._v_counts(recv_counts, "recv_counts")
        sdispls = self._v_displs(send_displs, "send_displs", scounts)
        rdispls = self._v_displs(recv_displs, "recv_displs", rcounts)
        reach, what = self._v_reach(rcounts, rdispls, "recv_")
        recv = self._v_buffer(recvbuf, "recvbuf", True, dtype, reach, what, s)
        reach, what = self._v_reach(scounts, sdispls, "send_")
        send = self._v_buffer(sendbuf, "sendbuf", False, dtype, reach, what, s)
        self._v_same_type(send, recv)
        dt, lanes = recv[1], recv[2]
        size = dt.itemsize * lanes
        n = self.core.size
        sends = [(j, send[0] + sdispls[j] * size, scounts[j]) for j in range(n)]
        recvs = [(j, recv[0] + rdispls[j] * size, rcounts[j]) for j in range(n)]
        self._v_issue(sends, recvs, dt, lanes, s, (sendbuf, recvbuf))
        return after(self.core, s) if async_op else None

    def reduce_scatter_v(
        self,
        sendbuf: BufferLike,
        recvbuf: BufferLike,
        counts: Sequence[int],
        op: OpLike = RedOp.SUM,
        *,
        displs: Sequence[int] | None = None,
        dtype: DTypeLike = None,
        stream: StreamLike = None,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce block ``j`` (``counts[j]`` elements at ``displs[j]`` of every rank's
        ``sendbuf``; displacements default to the prefix sums) with ``op`` into rank
        ``j``'s ``recvbuf``, which holds ``counts[rank]`` elements.

        Every rank passes the same ``counts`` and ``displs``. NCCL has no native call:
        one ``ncclReduce`` per non-empty block, rooted at its owner, in one group.
        """
        s = self._v_stream(stream, sendbuf, recvbuf)
        self._v_refuse(s, async_op)
        counts = self._v_counts(counts, "counts")
        displs = self._v_displs(displs, "displs", counts)
        me = self.core.rank
        recv = self._v_buffer(
            recvbuf, "recvbuf", True, dtype, counts[me], f"counts[{me}] = {counts[me]}", s
        )
        reach, what = self._v_reach(counts, displs, "")
        send = self._v_buffer(sendbuf, "sendbuf", False, dtype, reach, what, s)
        self._v_same_type(send, recv)
        resolve_op(op, self.core.library.version, self.custom_ops, (sendbuf, recvbuf))
        dt, lanes = recv[1], recv[2]
        size = dt.itemsize * lanes
        blocks = [(j, send[0] + displs[j] * size, counts[j] * lanes) for j in range(self.core.size)]
        reduce = self.core.reduce
        # Inside an outer group the buffers live until its work has run on s (the
        # reduces below are issued with raw pointers, which keep nothing).
        _groups.keep_alive((sendbuf, recvbuf), self.core, s)
        with _groups.inner_group():
            for root, sp, n in blocks:
                if n:  # NCCL writes recvbuff on the root only: elsewhere pass sp (unused)
                    rp = recv[0] if root == me else sp
                    reduce(sp, rp, op, root=root, count=n, dtype=dt, stream=s)
        # A Graph capturing them keeps the buffers (raw pointers above).
        self.core.note_capture(s, (sendbuf, recvbuf))
        return after(self.core, s) if async_op else None

    def _v_refuse(self, s: int, async_op: object) -> None:
        """``async_op=True`` checked before anything is issued (:mod:`._work`)."""
        if async_op is not False and check_flag(async_op, "async_op"):
            refuse(self.core, s, _groups.group_depth())

    def _v_issue(
        self,
        sends: list[tuple[int, int, int]],
        recvs: list[tuple[int, int, int]],
        dt: DataType,
        lanes: int,
        s: int,
        keep: tuple[object, ...],
    ) -> None:
        """One group: a recv from and a send to each peer with a non-empty block (the
        rank's own block too: NCCL copies a send-to-self within the group)."""
        send = self.core.send
        recv = self.core.recv
        _groups.keep_alive(keep, self.core, s)
        with _groups.inner_group():
            for (peer, rp, rn), (_, sp, sn) in zip(recvs, sends):
                if rn:
                    recv(rp, peer, count=rn * lanes, dtype=dt, stream=s)
                if sn:
                    send(sp, peer, count=sn * lanes, dtype=dt, stream=s)
        # A Graph capturing them keeps the buffers (raw pointers above).
        self.core.note_capture(s, keep)

    # -- barrier ------------------------------------------------------------------------------

    def barrier(self, stream: StreamLike = None, *, async_op: bool = False) -> Work | None:
        """A stream-ordered barrier: work queued on ``stream`` after it starts only once
        every rank has queued its barrier and reached it (a 1-element ``ncclAllReduce``
        on a buffer of the communicator's, allocated by the first call and freed with the
        communicator). It does not block the calling thread: :meth:`synchronize` does.

        The first call allocates, so it cannot be the one captured in a CUDA graph; later
        calls capture and replay like any collective.
        """
        s = self._v_stream(stream)
        if not self.barrier_buf:
            self.core.refuse_if_capturing("barrier's first call (it allocates a 4-byte buffer)")
            from ..cuda import DeviceBuffer

            buf = DeviceBuffer(1, DataType.INT32, device=self.core.device)
            buf.fill_zero()
            self.barrier_buf.append(buf)
        ptr = self.barrier_buf[0].ptr
        return self.core.all_reduce(ptr, ptr, RedOp.SUM, count=1, dtype=DataType.INT32, stream=s,
                                    async_op=async_op)  # fmt: skip

    def _free_barrier(self, kind: str) -> None:
        """The core's retire hook: the barrier's buffer goes once the handle is retired
        (nothing can be queued on it any more)."""
        if self.barrier_buf:
            buf = self.barrier_buf.pop()
            try:
                buf.close()
            except Exception:  # a dead context at exit, or the watchdog thread
                if kind != "watchdog":
                    raise
