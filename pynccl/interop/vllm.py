"""vLLM's NCCL groups from outside vLLM: join one, make one vLLM can join, sync weights.

An RL trainer that pushes weights into vLLM talks NCCL to processes it does not control.
vLLM's side of that conversation is ``PyNcclCommunicator``
(``vllm/distributed/device_communicators/pynccl.py``, over the ctypes table of
``pynccl_wrapper.py``); its weight-transfer engines
(``vllm/distributed/weight_transfer/nccl_engine.py`` and ``nccl_common.py``) decide the
ranks. What it does, call by call (read from vLLM 0.33's sources, 2026):

1. **The id.** ``PyNcclCommunicator.__init__``: rank 0 calls ``ncclGetUniqueId``; the
   other ranks start from an empty ``ncclUniqueId`` and receive rank 0's 128 bytes
   (``StatelessProcessGroup.broadcast_obj`` over vLLM's TCP store, or a ``dist.broadcast``
   of a 128-byte ``ByteTensor``). Without a store, ``nccl_common.decode_nccl_unique_id``
   takes the bytes as ``nccl_unique_id_b64`` (standard base64, not URL-safe; must decode
   to exactly 128 bytes) and ``uid_init_process_group`` hands them to
   ``PyNcclCommunicator.from_unique_id_bytes(bytes, rank, world_size, device)``, which
   refuses bytes of another length and a rank outside ``[0, world_size)`` with
   ``ValueError``. There is no barrier: every rank must enter init at the same time.
2. **The ranks.** In weight sync the trainer is rank 0 (``trainer_init``); a vLLM worker
   is ``dp_index * (tp * pp) + rank_in_dp + rank_offset``
   (``worker_init_process_group``; ``rank_offset`` is 1 for one trainer) and
   ``world_size`` counts the trainer and every worker. A group of one makes no
   communicator at all (``world_size == 1``: the communicator is disabled).
3. **Init.** With the device current, ``ncclCommInitRank(&comm, world_size, id, rank)``.
4. **The warm-up.** At once, on torch's current stream: a one-element ``float32`` zeros
   tensor all-reduced (``ncclAllReduce(data, out, 1, ncclFloat32, ncclSum, comm,
   stream)``), then ``stream.synchronize()`` (``cudaStreamSynchronize``). It is a
   collective: a peer that skips it deadlocks the group, or matches vLLM's first broadcast
   against it.
5. **Weights.** ``NCCLWeightTransferEngine.trainer_send_weights`` broadcasts each tensor in
   the iterator's order from ``src=0`` on the given (or current) stream;
   ``receive_weights`` allocates each tensor of ``update_info`` (names, dtype names,
   shapes, same order) and calls ``broadcast(weight, src=0)``: ``ncclBroadcast`` with the
   tensor as both buffers on the root and ``sendbuff=NULL`` elsewhere, one call per tensor,
   no group. With ``packed=True`` (``packed_tensor.packed_nccl_broadcast_producer`` /
   ``_consumer``) the tensors are taken in the same order into chunks, a chunk closing
   with the tensor that makes it exceed ``packed_buffer_size_bytes`` (1 GiB by default),
   and each chunk — the tensors' bytes end to end — is one ``uint8`` broadcast; the
   rotating buffers and streams (``packed_num_buffers``) are local and change no call.
6. **The end.** ``PyNcclCommunicator.destroy`` calls ``ncclCommAbort`` (in a daemon thread,
   joined for 5 s, since an abort waits for CUDA graphs that captured the communicator);
   the engine's ``shutdown`` only drops its reference.

Here: :func:`new_unique_id` makes the 128 bytes a trainer publishes (with
:func:`init_info`, the fields of vLLM's ``NCCLWeightTransferInitInfo``); :func:`join`
makes this process one rank of the group from those bytes, or from bytes vLLM published,
and does step 4 exactly as vLLM does, so both sides stay in lock-step;
:func:`broadcast_weights` is step 5 from either side, :func:`broadcast_packed` its packed form
(:func:`packed_chunks`: which tensors share a broadcast). The result of :func:`join` is an
ordinary :class:`~pynccl.Communicator`: end it with ``abort()`` as vLLM does, or
``destroy()``. Mind the order at the end: a rank's abort reaches peers still waiting on the
group as :class:`~pynccl.NcclRemoteError` (the loopback does this), so let every rank see
its last operation complete (``synchronize``) before any rank aborts — as vLLM's
``finish_weight_update`` call after the transfer orders it.

Nothing here imports vLLM, torch or NumPy. The same calls run on the loopback libraries
(``tests/interop/test_vllm.py`` drives vLLM's sequence through raw ctypes in other
processes).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from itertools import accumulate

from .._adapt import as_buffer, as_stream, check_device
from .._capi.structs import NCCL_UNIQUE_ID_BYTES
from .._limits import C_INT_MAX, check_c_int, check_count, check_index, index_int
from ..comm import Communicator, UniqueId
from ..cuda import DeviceBuffer
from ..enums import DataType, RedOp
from ..library import cudart

__all__ = [
    "PACKED_BUFFER_SIZE_BYTES",
    "UNIQUE_ID_BYTES",
    "WARMUP",
    "broadcast_packed",
    "broadcast_weights",
    "init_info",
    "join",
    "new_unique_id",
    "packed_chunks",
]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..typing import BufferLike, DeviceLike, StreamLike

#: The length of an ``ncclUniqueId``: what vLLM publishes and ``from_unique_id_bytes`` takes.
UNIQUE_ID_BYTES: int = NCCL_UNIQUE_ID_BYTES

#: vLLM's warm-up, the first collective of every one of its groups: ``(count, dtype, op)``
#: of the all-reduce ``PyNcclCommunicator`` issues right after ``ncclCommInitRank``.
WARMUP: tuple[int, DataType, RedOp] = (1, DataType.FLOAT32, RedOp.SUM)

#: vLLM's default ``packed_buffer_size_bytes`` (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``): 1 GiB.
PACKED_BUFFER_SIZE_BYTES: int = 1 << 30

_D2D = 3  # cudaMemcpyDeviceToDevice

_WHAT = "for a vLLM group (vLLM makes no NCCL communicator for a group of one)"


def new_unique_id() -> bytes:
    """A new ``ncclUniqueId`` (``ncclGetUniqueId``) as the 128 bytes to publish.

    Give them to vLLM's workers (:func:`init_info`; they join with
    ``PyNcclCommunicator.from_unique_id_bytes``) and to :func:`join` on this side. The
    bytes carry this host's listening address: they are the key to the group."""
    return bytes(UniqueId())


def _id_bytes(unique_id: object) -> UniqueId:
    """``unique_id`` (128 bytes or a :class:`~pynccl.UniqueId`), with UniqueId's wording."""
    if isinstance(unique_id, UniqueId):
        return unique_id
    if isinstance(unique_id, str):
        raise TypeError(
            f"unique_id must be the {UNIQUE_ID_BYTES} id bytes, got str (decode vLLM's "
            "nccl_unique_id_b64 with base64.b64decode first)"
        )
    return UniqueId.from_bytes(unique_id)  # type: ignore[arg-type]  # it refuses the rest


def _check_ranks(rank: object, world_size: object) -> tuple[int, int]:
    """``(rank, world_size)`` checked as :class:`~pynccl.Communicator` checks them, with a
    group of one refused (vLLM would make no communicator to meet)."""
    size = check_c_int(world_size, "world_size", 2, C_INT_MAX, _WHAT)
    return check_index(rank, "rank", size, f"for a communicator of size {size}"), size


def init_info(
    unique_id: bytes | UniqueId, world_size: int, *, rank_offset: int = 1
) -> dict[str, object]:
    """The fields of vLLM's ``NCCLWeightTransferInitInfo`` in its unique-id mode:
    ``{"nccl_unique_id_b64": ..., "rank_offset": ..., "world_size": ...}`` (what vLLM's
    ``init_weight_transfer_engine`` takes; its workers join at ranks ``rank_offset`` and
    up). The id is in standard base64, as vLLM requires.

    vLLM's workers block in ``ncclCommInitRank`` until every rank is there: send this
    without waiting for the answer, then call :func:`join`."""
    uid = _id_bytes(unique_id)
    _, size = _check_ranks(0, world_size)
    offset = check_index(rank_offset, "rank_offset", size, f"for a group of size {size}")
    if offset == 0:
        raise ValueError("rank_offset=0 is out of range; expected >= 1: rank 0 is the trainer")
    return {
        "nccl_unique_id_b64": base64.b64encode(bytes(uid)).decode("ascii"),
        "rank_offset": offset,
        "world_size": size,
    }


def join(
    unique_id: bytes | UniqueId, rank: int, world_size: int, *,
    device: DeviceLike | None = None, stream: StreamLike = None, timeout: float | None = None,
) -> Communicator:  # fmt: skip
    """Become rank ``rank`` of the vLLM group named by ``unique_id`` (128 bytes).

    ``ncclCommInitRank`` with ``device`` current, then vLLM's warm-up (:data:`WARMUP`:
    a one-element float32 sum all-reduce of zeros, out of place) on ``stream`` (kept as
    the communicator's :attr:`~pynccl.Communicator.stream`; default the legacy default
    stream, which is torch's current stream unless a program changed it), then a wait
    for that stream — as ``PyNcclCommunicator`` does, so the next collective on either
    side is the same one. Works both ways: bytes that vLLM's rank 0 published, or bytes
    from :func:`new_unique_id` that vLLM joins with ``from_unique_id_bytes``.

    Every rank must call its init at about the same time: init blocks until all
    ``world_size`` ranks are in. ``timeout`` bounds the warm-up's wait (then the
    communicator is aborted and :class:`~pynccl.NcclTimeoutError` raised). Refused before
    any NCCL call: bytes of another length, a rank outside ``[0, world_size)``, and a
    ``world_size`` below 2 (vLLM makes no communicator for one rank)."""
    uid = _id_bytes(unique_id)
    rank, size = _check_ranks(rank, world_size)
    comm = Communicator(size, uid, rank, device=device, stream=stream)
    try:
        _warm_up(comm, timeout)
    except BaseException:
        comm.abort()  # nothing when the timed-out wait aborted it already
        raise
    return comm


def _warm_up(comm: Communicator, timeout: float | None) -> None:
    """vLLM's warm-up on ``comm.stream``: zeros in, one-element all-reduce, stream wait."""
    count, dtype, op = WARMUP
    buffers = [DeviceBuffer((count,), dtype, comm.device) for _ in range(2)]
    data, out = buffers
    try:
        data.fill_zero(comm.stream)  # torch.zeros: a memset on the current stream
        comm.all_reduce(data, out, op, stream=comm.stream)
        comm.synchronize(timeout=timeout)
    except BaseException:
        comm.abort()  # before the frees below: the all-reduce may still use the buffers
        raise
    finally:
        for buffer in buffers:
            buffer.close()


def broadcast_weights(
    comm: Communicator, arrays: Iterable[BufferLike], *, src: int = 0,
    stream: StreamLike = None,
) -> int:  # fmt: skip
    """Broadcast each array of ``arrays`` from rank ``src``, one ``ncclBroadcast`` per
    array in the given order, no group — vLLM's ``trainer_send_weights`` /
    ``receive_weights`` (non-packed). On ``src`` the arrays are sent, elsewhere they are
    written (in place). Returns the number of broadcasts issued.

    The calls are queued on ``stream`` (default ``comm.stream``): wait with
    ``comm.synchronize(stream)`` before reading the arrays on the host or freeing them.
    Both sides must list the same shapes and dtypes in the same order (vLLM's
    ``update_info``: names, dtype names, shapes)."""
    src = check_index(src, "src", comm.size, f"for a communicator of size {comm.size}")
    issued = 0
    for array in arrays:
        comm.broadcast(array, root=src, stream=stream)
        issued += 1
    return issued


def packed_chunks(
    nbytes: Sequence[int], buffer_size_bytes: int = PACKED_BUFFER_SIZE_BYTES
) -> list[range]:
    """Which tensors vLLM's packed transfer sends together: for tensors of ``nbytes`` bytes
    in order, the index ranges of its chunks. A chunk takes tensors until its size
    exceeds ``buffer_size_bytes``, that tensor included (so a tensor larger than the
    buffer is a chunk of its own); the rest is the last chunk."""
    limit = index_int(buffer_size_bytes, "buffer_size_bytes")
    if limit < 1:
        raise ValueError(f"buffer_size_bytes={limit} is out of range; expected >= 1")
    chunks: list[range] = []
    start = total = 0
    for i, n in enumerate(nbytes):
        total += check_count(n, f"nbytes[{i}]")
        if total > limit:
            chunks.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(nbytes):
        chunks.append(range(start, len(nbytes)))
    return chunks


def broadcast_packed(
    comm: Communicator, arrays: Sequence[BufferLike], *, src: int = 0,
    buffer_size_bytes: int = PACKED_BUFFER_SIZE_BYTES, stream: StreamLike = None,
    timeout: float | None = None,
) -> int:  # fmt: skip
    """:func:`broadcast_weights` as vLLM's ``packed=True`` sends it: per chunk of
    :func:`packed_chunks`, the arrays' bytes end to end in one ``uint8`` broadcast from
    ``src`` (copied in on ``src``, out elsewhere, on ``stream``). ``buffer_size_bytes``
    must be vLLM's ``packed_buffer_size_bytes``. Each chunk is waited for (``timeout``:
    as :meth:`~pynccl.Communicator.synchronize`) before its staging buffer is freed, so
    the arrays are complete when this returns. Returns the number of broadcasts."""
    src = check_index(src, "src", comm.size, f"for a communicator of size {comm.size}")
    spans = []
    for i, array in enumerate(arrays):
        ptr, n, dtype, device = as_buffer(array, name=f"arrays[{i}]", writable=comm.rank != src)
        check_device(device, comm.device, f"arrays[{i}]")  # as broadcast_weights refuses it
        spans.append((ptr, n * dtype.itemsize))
    chunks = packed_chunks([n for _, n in spans], buffer_size_bytes)
    s = comm.stream if stream is None else as_stream(stream)
    for chunk in chunks:
        _one_chunk(comm, [spans[i] for i in chunk], src, s, timeout)
    return len(chunks)


def _one_chunk(
    comm: Communicator, spans: list[tuple[int, int]], src: int, stream: int,
    timeout: float | None,
) -> None:  # fmt: skip
    """One packed broadcast of the arrays at ``spans`` (pointer, bytes), waited for."""
    rt = cudart()
    staging = DeviceBuffer((sum(n for _, n in spans),), DataType.UINT8, comm.device)
    try:
        offsets = list(accumulate((n for _, n in spans[:-1]), initial=staging.ptr))
        if comm.rank == src:
            for (ptr, n), at in zip(spans, offsets):
                if n:
                    rt.cudaMemcpyAsync(at, ptr, n, _D2D, stream)
        comm.broadcast(staging, root=src, stream=stream)
        if comm.rank != src:
            for (ptr, n), at in zip(spans, offsets):
                if n:
                    rt.cudaMemcpyAsync(ptr, at, n, _D2D, stream)
        comm.synchronize(stream, timeout=timeout)
    finally:
        staging.close()
