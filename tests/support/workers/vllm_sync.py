"""One rank of a trainer <-> vLLM weight sync (tests/interop/test_vllm.py starts them).

``ROLE=vllm``: vLLM's side, as vLLM 0.33's ``PyNcclCommunicator`` issues it, through raw
ctypes against the libraries named by ``PYNCCL_NCCL_LIBRARY`` / ``PYNCCL_CUDART_LIBRARY``
(like ``pynccl_wrapper.NCCLLibrary``: ``ctypes.CDLL``, then the C functions; pynccl is
never imported): ``ncclGetUniqueId`` on the minting rank, ``cudaSetDevice``,
``ncclCommInitRank``, the one-element float32 warm-up ``ncclAllReduce`` on the current
(legacy) stream and ``cudaStreamSynchronize``, one ``ncclBroadcast`` per weight
(``sendbuff=NULL`` off the root), ``ncclCommAbort``.

``ROLE=trainer``: the trainer, through ``pynccl.interop.vllm``.

Environment: ``ROLE``, ``WORLD``, ``ID_FILE`` (where the id is published), ``MINT=1`` on
the rank that makes the id, ``RANK`` (a trainer's rank, or a vLLM rank that mints) or
``WORKER`` (a vLLM worker's index: its rank is ``WORKER + rank_offset`` from the init
info), ``SRC`` (the weights' root), ``REPLY_SRC`` (if set: afterwards one more broadcast,
of :func:`reply`, from that rank), ``PACKED`` (if set: vLLM's ``packed=True`` transfer with
that ``packed_buffer_size_bytes``). Prints ``RESULT {json}``: what this rank received,
checked against numpy.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import sys
import time
from ctypes import byref, c_size_t, c_void_p
from typing import Any

import ml_dtypes
import numpy as np

#: The weights, in vLLM's update_info order: (dtype name, shape).
SPECS: list[tuple[str, tuple[int, ...]]] = [
    ("float32", (4, 8)),
    ("bfloat16", (16,)),
    ("float16", (3, 5)),
    ("int64", (7,)),
    ("uint8", (33,)),
]
#: nccl.h's ncclDataType_t for each (as pynccl_wrapper's ncclDataTypeEnum numbers them).
NCCL_TYPES = {"uint8": 1, "int64": 4, "float16": 6, "float32": 7, "bfloat16": 9}
NCCL_FLOAT32, NCCL_SUM = 7, 0


def np_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def weight(i: int) -> np.ndarray:
    """Weight ``i`` of :data:`SPECS`, the same in every process."""
    name, shape = SPECS[i]
    rng = np.random.default_rng(1000 + i)
    if name in ("uint8", "int64"):
        return rng.integers(0, 200, shape).astype(name)
    return rng.standard_normal(shape).astype(np.float32).astype(np_dtype(name))


def reply() -> np.ndarray:
    """What a vLLM rank sends back after the weights (a step counter, say)."""
    return np.arange(5, dtype=np.int64) * 7 + 3


def publish(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def finished(env: dict[str, str], rank: int) -> None:
    """Say this rank's last operation completed, then wait for every rank to say so before
    the teardown (out of band, as vLLM's finish_weight_update is): an abort reaches the
    peers as a remote error, which a peer still waiting for its stream would raise."""
    publish(f"{env['ID_FILE']}.done{rank}", "")
    for r in range(int(env["WORLD"])):
        read_published(f"{env['ID_FILE']}.done{r}")


def read_published(path: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing published at {path} within {timeout} s")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


# --- vLLM's side, raw ctypes -----------------------------------------------------------------


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class RawVllm:
    """The C calls of vLLM's PyNcclCommunicator, each result checked."""

    def __init__(self) -> None:
        self.nccl = ctypes.CDLL(os.environ["PYNCCL_NCCL_LIBRARY"])
        self.rt = ctypes.CDLL(os.environ["PYNCCL_CUDART_LIBRARY"])
        self.nccl.ncclGetErrorString.restype = ctypes.c_char_p
        self.comm = c_void_p()
        self.stream = c_void_p(0)  # torch's current stream: the legacy default stream

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned {rc}: {self.nccl.ncclGetErrorString(rc)!r}")

    def cuda(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned cudaError {rc}")

    def unique_id(self) -> bytes:
        uid = ncclUniqueId()
        self.check(self.nccl.ncclGetUniqueId(byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def init(self, uid_bytes: bytes, world: int, rank: int, warm_up: bool = True) -> None:
        """from_unique_id_bytes: init, then the warm-up (left out with ``warm_up=False``:
        a peer that does not keep step)."""
        if len(uid_bytes) != 128:  # from_unique_id_bytes's first check
            raise ValueError(f"expected a 128-byte id, got {len(uid_bytes)}")
        uid = ncclUniqueId()
        ctypes.memmove(byref(uid), uid_bytes, 128)
        self.cuda(self.rt.cudaSetDevice(rank), "cudaSetDevice")
        self.check(self.nccl.ncclCommInitRank(byref(self.comm), world, uid, rank), "init")
        if not warm_up:
            return
        # the warm-up: torch.zeros(1) and empty_like, all_reduce, stream.synchronize()
        data, out = self.malloc(4), self.malloc(4)
        self.cuda(self.rt.cudaMemsetAsync(data, 0, c_size_t(4), self.stream), "memset")
        self.check(
            self.nccl.ncclAllReduce(
                data, out, c_size_t(1), NCCL_FLOAT32, NCCL_SUM, self.comm, self.stream
            ),
            "ncclAllReduce",
        )
        self.cuda(self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        self.free(data)
        self.free(out)

    def malloc(self, nbytes: int) -> c_void_p:
        ptr = c_void_p()
        self.cuda(self.rt.cudaMalloc(byref(ptr), c_size_t(nbytes)), "cudaMalloc")
        return ptr

    def free(self, ptr: c_void_p) -> None:
        self.cuda(self.rt.cudaFree(ptr), "cudaFree")

    def broadcast(self, host: np.ndarray, src: int, rank: int, dtype: str) -> np.ndarray:
        """PyNcclCommunicator.broadcast of a tensor like ``host`` (sent from it on ``src``),
        then the tensor's contents back on the host."""
        ptr = self.malloc(host.nbytes)
        if rank == src:
            self.cuda(self.rt.cudaMemcpy(ptr, host.ctypes.data_as(c_void_p),
                                         c_size_t(host.nbytes), 1), "cudaMemcpy H2D")  # fmt: skip
        send = ptr if rank == src else c_void_p(None)
        self.check(
            self.nccl.ncclBroadcast(send, ptr, c_size_t(host.size), NCCL_TYPES[dtype], src,
                                    self.comm, self.stream),
            "ncclBroadcast",
        )  # fmt: skip
        self.cuda(self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        got = np.empty_like(host)
        self.cuda(self.rt.cudaMemcpy(got.ctypes.data_as(c_void_p), ptr,
                                     c_size_t(host.nbytes), 2), "cudaMemcpy D2H")  # fmt: skip
        self.free(ptr)
        return got

    def receive_packed(self, limit: int, src: int) -> list[np.ndarray]:
        """packed_nccl_broadcast_consumer: take the weights' (shape, dtype) in order until
        the chunk's bytes exceed ``limit``, broadcast that many uint8, split it."""
        got: list[np.ndarray] = []
        pending: list[int] = []
        for i in range(len(SPECS) + 1):
            if i < len(SPECS):
                pending.append(i)
                if sum(weight(k).nbytes for k in pending) <= limit:
                    continue
            if not pending:
                break
            host = np.zeros(sum(weight(k).nbytes for k in pending), np.uint8)
            raw = self.broadcast(host, src, -1, "uint8")
            at = 0
            for k in pending:
                n = weight(k).nbytes
                got.append(raw[at : at + n].view(weight(k).dtype).reshape(weight(k).shape))
                at += n
            pending = []
        return got

    def abort(self) -> None:
        self.check(self.nccl.ncclCommAbort(self.comm), "ncclCommAbort")


def vllm_rank(env: dict[str, str]) -> dict[str, Any]:
    raw = RawVllm()
    world = int(env["WORLD"])
    if env.get("MINT") == "1":  # PyNcclCommunicator's rank 0: it makes and publishes the id
        rank = int(env["RANK"])
        uid = raw.unique_id()
        publish(env["ID_FILE"], uid.hex())
    else:  # a worker joining from NCCLWeightTransferInitInfo (or from rank 0's bytes)
        text = read_published(env["ID_FILE"])
        if text.startswith("{"):
            info = json.loads(text)
            uid = base64.b64decode(info["nccl_unique_id_b64"], validate=True)
            rank = int(env["WORKER"]) + int(info["rank_offset"])
            if int(info["world_size"]) != world:
                raise ValueError(f"init info says world_size={info['world_size']}")
        else:
            uid, rank = bytes.fromhex(text), int(env["RANK"])
    raw.init(uid, world, rank)
    src = int(env["SRC"])
    if "PACKED" in env:
        got = raw.receive_packed(int(env["PACKED"]), src)
    else:
        got = [raw.broadcast(weight(i), src, rank, d) for i, (d, _) in enumerate(SPECS)]
    ok = [bool(np.array_equal(g.view(np.uint8), weight(i).view(np.uint8)))
          for i, g in enumerate(got)]  # fmt: skip
    if "REPLY_SRC" in env:
        got = raw.broadcast(reply(), int(env["REPLY_SRC"]), rank, "int64")
        ok.append(bool(np.array_equal(got, reply())))
    finished(env, rank)
    raw.abort()
    return {"rank": rank, "ok": ok, "pynccl_imported": "pynccl" in sys.modules}


# --- the trainer, through pynccl.interop.vllm ----------------------------------------------


def trainer_rank(env: dict[str, str]) -> dict[str, Any]:
    from pynccl.cuda import DeviceBuffer
    from pynccl.interop import vllm

    world, rank = int(env["WORLD"]), int(env["RANK"])
    if env.get("MINT") == "1":
        uid = vllm.new_unique_id()
        publish(env["ID_FILE"], json.dumps(vllm.init_info(uid, world)))
    else:
        uid = bytes.fromhex(read_published(env["ID_FILE"]))
    comm = vllm.join(uid, rank, world, device=rank, timeout=60)
    src = int(env["SRC"])
    hosts = [weight(i) if rank == src else np.zeros_like(weight(i)) for i in range(len(SPECS))]
    bufs = [DeviceBuffer.from_numpy(h, device=rank) for h in hosts]
    if "PACKED" in env:
        issued = vllm.broadcast_packed(comm, bufs, src=src, buffer_size_bytes=int(env["PACKED"]))
    else:
        issued = vllm.broadcast_weights(comm, bufs, src=src)
    comm.synchronize(timeout=60)
    ok = [bool(np.array_equal(b.to_numpy().view(np.uint8), weight(i).view(np.uint8)))
          for i, b in enumerate(bufs)]  # fmt: skip
    if "REPLY_SRC" in env:
        back = DeviceBuffer.from_numpy(np.zeros(5, np.int64), device=rank)
        vllm.broadcast_weights(comm, [back], src=int(env["REPLY_SRC"]))
        comm.synchronize(timeout=60)
        ok.append(bool(np.array_equal(back.to_numpy(), reply())))
        bufs.append(back)
    for b in bufs:
        b.close()
    finished(env, rank)
    comm.destroy()
    return {"rank": rank, "ok": ok, "issued": issued}


if __name__ == "__main__":
    env = dict(os.environ)
    result = vllm_rank(env) if env["ROLE"] == "vllm" else trainer_rank(env)
    print("RESULT " + json.dumps(result), flush=True)
