"""pynccl.interop.vllm against vLLM's own sequence of NCCL calls.

"vLLM" is ``support/workers/vllm_sync.py``'s :class:`RawVllm`: the C calls vLLM 0.33's
``PyNcclCommunicator`` makes (init from the 128 id bytes, the one-element float32 warm-up
all-reduce, one broadcast per weight with ``sendbuff=NULL`` off the root, abort), through
raw ctypes, never pynccl's object API. In threads of this process (quick) and as separate
processes (slow): the trainer joining a group vLLM made, and vLLM joining the trainer's
through the init info its ``NCCLWeightTransferInitInfo`` reads. Weights of five dtypes
(bf16 and float16 among them) are checked against numpy where they arrive.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.child import result_line, run_ranks
from support.workers.vllm_sync import SPECS, RawVllm, weight

from pynccl.comm import Communicator, UniqueId
from pynccl.comm._state import live_handles
from pynccl.cuda import DeviceBuffer, Stream
from pynccl.errors import NcclError, NcclTimeoutError
from pynccl.interop import vllm

WORKER = Path(__file__).resolve().parents[1] / "support" / "workers" / "vllm_sync.py"
TIMEOUT = 60.0


# --- arguments: refused before any NCCL call, in pynccl's words ----------------------------


@pytest.mark.parametrize(
    ("uid", "rank", "world", "error", "message"),
    [
        (bytes(64), 0, 2, ValueError, "a unique id is 128 bytes, got 64 bytes"),
        (bytes(129), 0, 2, ValueError, "a unique id is 128 bytes, got 129 bytes"),
        ("AAAA", 0, 2, TypeError, "got str (decode vLLM's nccl_unique_id_b64"),
        (12, 0, 2, TypeError, "UniqueId.from_bytes needs bytes, got int"),
        (bytes(128), -1, 2, ValueError,
         "rank=-1 is out of range; expected 0 <= rank < 2 for a communicator of size 2"),
        (bytes(128), 2, 2, ValueError,
         "rank=2 is out of range; expected 0 <= rank < 2 for a communicator of size 2"),
        (bytes(128), 0, 1, ValueError,
         "world_size=1 is out of range; expected 2 <= world_size <= 2147483647 for a vLLM "
         "group (vLLM makes no NCCL communicator for a group of one)"),
        (bytes(128), 0, 2.0, TypeError, "world_size"),
        (bytes(128), 1.0, 2, TypeError, "rank"),
    ],
)  # fmt: skip
def test_join_refuses_bad_arguments_before_any_nccl_call(
    uid: Any, rank: Any, world: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        vllm.join(uid, rank, world)
    assert message in str(info.value)


def test_the_wording_is_pyncclss_own() -> None:
    with pytest.raises(ValueError) as ours:
        vllm.join(bytes(7), 0, 2)
    with pytest.raises(ValueError) as theirs:
        UniqueId.from_bytes(bytes(7))
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError) as ours:
        vllm.join(bytes(128), 3, 2)
    with pytest.raises(ValueError) as theirs:
        Communicator(2, bytes(128), 3)
    assert str(ours.value) == str(theirs.value)


def test_broadcast_weights_checks_src() -> None:
    class Two:  # only what the check reads: no communicator is made
        size = 2

    with pytest.raises(ValueError, match=r"src=2 is out of range; expected 0 <= src < 2"):
        vllm.broadcast_weights(Two(), [], src=2)  # type: ignore[arg-type]


def test_init_info_is_what_vllms_init_info_decodes(lb: Any) -> None:
    uid = vllm.new_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128 == vllm.UNIQUE_ID_BYTES
    assert vllm.new_unique_id() != uid
    info = vllm.init_info(uid, 3)
    assert set(info) == {"nccl_unique_id_b64", "rank_offset", "world_size"}
    assert (info["rank_offset"], info["world_size"]) == (1, 3)
    text = info["nccl_unique_id_b64"]
    assert isinstance(text, str)
    # vLLM's decode_nccl_unique_id: standard base64 (RFC 4648 alphabet), validated, 128 bytes
    assert re.fullmatch(r"[A-Za-z0-9+/]*={0,2}", text) and len(text) == 172
    assert binascii.a2b_base64(text, strict_mode=True) == uid
    assert vllm.init_info(UniqueId.from_bytes(uid), 5, rank_offset=2)["rank_offset"] == 2
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"rank_offset={bad} is out of range"):
            vllm.init_info(uid, 3, rank_offset=bad)


@pytest.mark.parametrize(
    ("nbytes", "limit", "chunks"),
    [
        ([128, 32, 30, 56, 33], 100, [[0], [1, 2, 3], [4]]),  # the weights of vllm_sync.py
        ([10, 10, 10], 20, [[0, 1, 2]]),  # 20 does not exceed 20: the third closes it
        ([10, 10, 10], 19, [[0, 1], [2]]),
        ([500, 1, 1], 100, [[0], [1, 2]]),  # larger than the buffer: a chunk of its own
        ([0, 0], 100, [[0, 1]]),  # empty tensors still travel, in a 0-byte broadcast
        ([], 100, []),
    ],
)
def test_packed_chunks_close_as_vllms_pack_tensors_does(
    nbytes: list[int], limit: int, chunks: list[list[int]]
) -> None:
    assert [list(r) for r in vllm.packed_chunks(nbytes, limit)] == chunks


def test_packed_chunks_refuse_a_buffer_of_nothing() -> None:
    with pytest.raises(ValueError, match=r"buffer_size_bytes=0 is out of range; expected >= 1"):
        vllm.packed_chunks([1], 0)


# --- vLLM's sequence in a thread of this process ---------------------------------------------


def _both(trainer: Callable[[], Any], peer: Callable[[], Any]) -> tuple[Any, Any]:
    """Run ``peer`` on a thread and ``trainer`` here; both results (or raise either's error)."""
    out: dict[str, Any] = {}

    def run_peer() -> None:
        try:
            out["peer"] = peer()
        except BaseException as exc:  # re-raised below, on the test's thread
            out["peer_error"] = exc

    thread = threading.Thread(target=run_peer)
    thread.start()
    try:
        mine = trainer()
    finally:
        thread.join(TIMEOUT)
    assert not thread.is_alive(), "the vLLM thread is still running"
    if "peer_error" in out:
        raise out["peer_error"]
    return mine, out["peer"]


def test_join_keeps_step_with_vllms_warm_up_and_broadcasts(lb: Any) -> None:
    uid = vllm.new_unique_id()
    # vLLM aborts at teardown: only once the trainer has seen its broadcasts complete
    # (an abort reaches the peers as a remote error), as finish_weight_update orders it.
    sent = threading.Event()

    def peer() -> list[bool]:
        raw = RawVllm()
        raw.init(uid, 2, 1)
        got = [raw.broadcast(weight(i), 0, 1, d) for i, (d, _) in enumerate(SPECS)]
        sent.wait(TIMEOUT)
        raw.abort()
        return [bool(np.array_equal(g.view(np.uint8), weight(i).view(np.uint8)))
                for i, g in enumerate(got)]  # fmt: skip

    def trainer() -> int:
        comm = vllm.join(uid, 0, 2, device=0, timeout=TIMEOUT)
        bufs = [DeviceBuffer.from_numpy(weight(i), device=0) for i in range(len(SPECS))]
        try:
            issued = vllm.broadcast_weights(comm, bufs)
            comm.synchronize(timeout=TIMEOUT)
        finally:
            sent.set()
            comm.destroy()
            for b in bufs:
                b.close()
        return issued

    issued, ok = _both(trainer, peer)
    assert issued == len(SPECS)
    assert ok == [True] * len(SPECS)


def test_packed_weights_reach_vllms_packed_consumer(lb: Any) -> None:
    uid = vllm.new_unique_id()
    sent = threading.Event()

    def peer() -> list[bool]:
        raw = RawVllm()
        raw.init(uid, 2, 1)
        got = raw.receive_packed(100, 0)
        sent.wait(TIMEOUT)
        raw.abort()
        return [bool(np.array_equal(g.view(np.uint8), weight(i).view(np.uint8)))
                for i, g in enumerate(got)]  # fmt: skip

    def trainer() -> tuple[int, str]:
        comm = vllm.join(uid, 0, 2, device=0, timeout=TIMEOUT)
        bufs = [DeviceBuffer.from_numpy(weight(i), device=0) for i in range(len(SPECS))]
        try:
            issued = vllm.broadcast_packed(comm, bufs, buffer_size_bytes=100, timeout=TIMEOUT)
            last = comm.last_operation()
        finally:
            sent.set()
            comm.destroy()
            for b in bufs:
                b.close()
        return issued, last

    (issued, last), ok = _both(trainer, peer)
    assert issued == 3 and ok == [True] * len(SPECS)
    assert "ncclBroadcast count=33 dtype=ncclUint8 root=0" in last, last


def test_without_the_warm_up_vllms_first_collective_is_mismatched(lb: Any) -> None:
    # What pynccl offered before: UniqueId.from_bytes + Communicator, then the broadcast.
    # vLLM's warm-up all-reduce meets that broadcast, and the loopback reports it.
    uid = vllm.new_unique_id()

    def peer() -> None:
        raw = RawVllm()
        try:
            raw.init(uid, 2, 1)  # vLLM checks no async error: its side just goes on
        finally:
            raw.abort()

    def trainer() -> str:
        comm = Communicator(2, UniqueId.from_bytes(uid), 0, device=0)
        buf = DeviceBuffer.from_numpy(weight(0), device=0)
        try:
            comm.broadcast(buf, root=0)
            comm.synchronize(timeout=TIMEOUT)
        except NcclError as exc:
            return str(exc)
        finally:
            comm.abort()
            buf.close()
        return "no error"

    mine, _ = _both(trainer, peer)
    assert "mismatched collectives at collective #1" in mine, mine
    assert "ncclAllReduce" in mine and "ncclBroadcast" in mine, mine


def test_join_on_a_stream_waits_for_the_warm_up_there(lb: Any) -> None:
    uid = vllm.new_unique_id()
    stream = Stream()
    joined = threading.Event()

    def peer() -> None:
        raw = RawVllm()
        raw.init(uid, 2, 1)
        joined.wait(TIMEOUT)
        raw.abort()

    def trainer() -> tuple[int, str]:
        try:
            comm = vllm.join(uid, 0, 2, device=0, stream=stream, timeout=TIMEOUT)
        finally:
            joined.set()
        comm.abort()
        return comm.stream, comm.last_operation()

    (kept, last), _ = _both(trainer, peer)
    assert kept == stream.handle
    assert last.startswith("#1 ncclAllReduce count=1 dtype=ncclFloat32 op=sum"), last
    assert f"stream={stream.handle:#x}" in last, last
    stream.close()


def test_a_peer_without_the_warm_up_times_join_out(lb: Any) -> None:
    # A peer that inits and then issues nothing: the warm-up never completes. join
    # raises within timeout + 1 s, and the communicator it made is aborted.
    uid = vllm.new_unique_id()
    done = threading.Event()

    def peer() -> None:
        raw = RawVllm()
        raw.init(uid, 2, 1, warm_up=False)
        done.wait(TIMEOUT)
        raw.abort()

    def trainer() -> tuple[float, BaseException | None]:
        started = time.monotonic()
        try:
            vllm.join(uid, 0, 2, device=0, timeout=1.0)
        except NcclTimeoutError as exc:
            return time.monotonic() - started, exc
        finally:
            done.set()
        return time.monotonic() - started, None

    (seconds, error), _ = _both(trainer, peer)
    assert isinstance(error, NcclTimeoutError), error
    assert "did not finish within 1 s" in str(error) and "ncclAllReduce" in str(error)
    assert seconds < 1.0 + 1.0 + 1.0  # init (the peer is there at once) + timeout + 1 s
    assert not [c for c in live_handles() if c.state not in ("aborted", "destroyed")]


# --- separate processes: the trainer and "vLLM" ---------------------------------------------


def _shm_of(uid: bytes) -> str:
    """The loopback's /dev/shm name for the communicator of ``uid``."""
    return "/dev/shm/pynccl-lb-" + uid[0:8].hex() + uid[64:80].hex()


def _run(lb_env: dict[str, str], ranks: list[dict[str, str]], id_file: Path) -> list[Any]:
    envs = [{**lb_env, "ID_FILE": str(id_file), **r} for r in ranks]
    results = []
    for rc, out, err in run_ranks([str(WORKER)], envs, timeout=120):
        assert rc == 0, err[-3000:]
        results.append(json.loads(result_line(out)[len("RESULT ") :]))
    return results


@pytest.mark.slow
def test_trainer_joins_a_group_vllm_created(lb_env: dict[str, str], tmp_path: Path) -> None:
    # vLLM's rank 0 makes the id (PyNcclCommunicator.__init__) and publishes its bytes;
    # the trainer joins as rank 1, another vLLM rank as 2. The trainer's weights go out
    # from rank 1, then vLLM's rank 0 sends one array back to both.
    id_file = tmp_path / "uid"
    common = {"WORLD": "3", "SRC": "1", "REPLY_SRC": "0"}
    vllm0, trainer, vllm2 = _run(
        lb_env,
        [
            {**common, "ROLE": "vllm", "MINT": "1", "RANK": "0"},
            {**common, "ROLE": "trainer", "RANK": "1"},
            {**common, "ROLE": "vllm", "RANK": "2"},
        ],
        id_file,
    )
    n = len(SPECS)
    assert trainer == {"rank": 1, "ok": [True] * (n + 1), "issued": n}
    for rank, got in ((0, vllm0), (2, vllm2)):
        assert got == {"rank": rank, "ok": [True] * (n + 1), "pynccl_imported": False}
    assert not os.path.exists(_shm_of(bytes.fromhex(id_file.read_text())))


@pytest.mark.slow
@pytest.mark.parametrize(("packed", "broadcasts"), [(None, len(SPECS)), (100, 3)])
def test_vllm_joins_a_group_the_trainer_created(
    lb_env: dict[str, str], tmp_path: Path, packed: int | None, broadcasts: int
) -> None:
    # The trainer makes the id and publishes init_info (NCCLWeightTransferInitInfo's
    # fields); two vLLM workers decode it and join at WORKER + rank_offset, as
    # from_unique_id_bytes does; the weights go out from rank 0, as receive_weights expects
    # (one by one, or packed in chunks of 100 bytes: weights 0 | 1-3 | 4).
    id_file = tmp_path / "init_info.json"
    common = {"WORLD": "3", "SRC": "0", **({} if packed is None else {"PACKED": str(packed)})}
    trainer, worker0, worker1 = _run(
        lb_env,
        [
            {**common, "ROLE": "trainer", "MINT": "1", "RANK": "0"},
            {**common, "ROLE": "vllm", "WORKER": "0"},
            {**common, "ROLE": "vllm", "WORKER": "1"},
        ],
        id_file,
    )
    n = len(SPECS)
    assert trainer == {"rank": 0, "ok": [True] * n, "issued": broadcasts}
    assert worker0 == {"rank": 1, "ok": [True] * n, "pynccl_imported": False}
    assert worker1 == {"rank": 2, "ok": [True] * n, "pynccl_imported": False}
    info = json.loads(id_file.read_text())
    assert not os.path.exists(_shm_of(base64.b64decode(info["nccl_unique_id_b64"])))


def test_broadcast_packed_refuses_an_array_on_another_device_as_broadcast_weights(
    lb: Any,
) -> None:
    comm = Communicator(1, UniqueId(), 0, device=0)
    here = DeviceBuffer.from_numpy(np.arange(4, dtype=np.float32), device=0)
    there = DeviceBuffer((4,), "float32", 1)
    try:
        for send in (vllm.broadcast_weights, vllm.broadcast_packed):
            with pytest.raises(
                ValueError, match=r"(sendbuf|arrays\[1\]) is on device 1 but the communicator"
            ):
                send(comm, [here, there])
        assert vllm.broadcast_packed(comm, [here], timeout=TIMEOUT) == 1  # one device: sent
    finally:
        comm.destroy()
        here.close()
        there.close()


def test_packed_chunks_refuse_sizes_that_are_no_byte_counts() -> None:
    # A size is a count of bytes (pynccl's count check and wording): a negative size would
    # pull later tensors into an earlier chunk, a float or bool is no count.
    with pytest.raises(ValueError, match=r"nbytes\[0\]=-10 is out of range; expected 0 <= "):
        vllm.packed_chunks([-10, 5], 4)
    with pytest.raises(TypeError, match=r"nbytes\[1\] must be a non-negative int, got float"):
        vllm.packed_chunks([3, 1.5], 4)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"nbytes\[0\] must be a non-negative int, got bool"):
        vllm.packed_chunks([True], 4)
