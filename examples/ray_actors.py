"""Ray actors, one communicator each; the unique id travels through Ray's object store.

No launcher: Ray starts the processes. As vLLM does it, rank 0's actor makes the id
(128 bytes), the driver puts it in the object store once and hands that same object to
every actor, and each actor creates ``Communicator(n, uid, rank)`` on the one GPU Ray
gave it (``num_gpus=1``: ``CUDA_VISIBLE_DEVICES`` shows it as device 0). The
communicator never leaves its actor (it cannot be pickled); results come back as numpy
arrays, checked against numpy here::

    python examples/ray_actors.py              # one actor per GPU, at most 4
    python examples/ray_actors.py --loopback   # 4 actors on the loopback libraries

With ``--loopback`` Ray is told of 4 GPUs, which it hands out as
``CUDA_VISIBLE_DEVICES``, and the loopback libraries, like CUDA, honour it. Needs
``pip install ray``.
"""

from __future__ import annotations

import sys

import numpy as np
import ray

N_MAX = 4
COUNT = 1000


@ray.remote(num_gpus=1)
class Rank:
    """One rank: a process of its own with one GPU."""

    def __init__(self) -> None:
        self.comm = None

    def new_id(self) -> bytes:
        from pynccl import UniqueId

        return bytes(UniqueId())  # rank 0 makes it, where NCCL runs

    def join(self, uid: bytes, rank: int, size: int) -> int:
        import pynccl

        # collective: every actor's join runs at the same time (one process each)
        self.comm = pynccl.Communicator(size, pynccl.UniqueId.from_bytes(uid), rank, device=0)
        return int(ray.get_gpu_ids()[0])  # the GPU Ray gave this actor

    def work(self) -> tuple[np.ndarray, np.ndarray]:
        from pynccl.cuda import DeviceBuffer

        comm = self.comm
        assert comm is not None
        mine = np.arange(COUNT, dtype=np.float32) + 100 * comm.rank
        total = DeviceBuffer.from_numpy(mine)
        comm.all_reduce(total, op="sum")  # in place
        everyone = DeviceBuffer((comm.size, COUNT), "float32")
        comm.all_gather(DeviceBuffer.from_numpy(mine), everyone)
        comm.synchronize(timeout=60)
        return total.to_numpy(), everyone.to_numpy()

    def leave(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None


def main() -> None:
    if "--loopback" in sys.argv:
        from pynccl.testing import loopback

        n = N_MAX  # Ray's "GPUs" here are loopback devices; the actors load its libraries
        ray.init(num_cpus=n, num_gpus=n, runtime_env={"env_vars": loopback.env()})
    else:
        ray.init()
        n = min(N_MAX, int(ray.cluster_resources().get("GPU", 0)))
        if n < 1:
            sys.exit("no GPU for Ray to hand out (run with --loopback without one)")
    try:
        ranks = [Rank.remote() for _ in range(n)]  # type: ignore[attr-defined]
        uid = ray.put(ray.get(ranks[0].new_id.remote()))  # in the object store, once
        gpus = ray.get([a.join.remote(uid, r, n) for r, a in enumerate(ranks)])
        results = ray.get([a.work.remote() for a in ranks])

        inputs = np.stack([np.arange(COUNT, dtype=np.float32) + 100 * r for r in range(n)])
        for total, everyone in results:
            np.testing.assert_array_equal(total, inputs.sum(axis=0))
            np.testing.assert_array_equal(everyone, inputs)
        ray.get([a.leave.remote() for a in ranks])
        print(f"{n} Ray actors on GPUs {sorted(gpus)}: all_reduce and all_gather OK")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
