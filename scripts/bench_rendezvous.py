"""How long the TCP rendezvous takes to hand the id to many ranks over loopback.

Rank 0 serves from its thread; ranks 1..N-1 are threads of this process, each
opening its own connection with the HMAC key, as separate processes would.
Prints the wall time of the exchange (all client threads already started and
released together from a barrier) and of the whole run including thread start.

    python scripts/bench_rendezvous.py [--ranks 1024] [--repeat 3] [--ids 1]
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pynccl.bootstrap import TcpRendezvous, TcpRendezvousServer


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


def run_once(ranks: int, nids: int, timeout: float) -> tuple[float, float]:
    """(seconds for the exchange, seconds including thread start)."""
    key = secrets.token_hex(32)
    payload = os.urandom(128 * nids)
    t_start = time.perf_counter()
    server = TcpRendezvousServer(
        payload, host="127.0.0.1", port=0, world_size=ranks, key=key, timeout=timeout
    )
    client = TcpRendezvous("127.0.0.1", server.address[1], key)
    go = threading.Barrier(ranks)  # the client threads and this one
    got: list[bytes | None] = [None] * ranks
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        go.wait()
        try:
            got[r] = client.fetch(rank=r, world_size=ranks, timeout=timeout)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(1, ranks)]
    for t in threads:
        t.start()
    server.start()
    go.wait()
    t_go = time.perf_counter()
    for t in threads:
        t.join()
    server.wait()
    t_end = time.perf_counter()
    server.close()
    if errors:
        raise RuntimeError(f"{len(errors)} rank(s) failed, first: {errors[0]!r}")
    if any(g != payload for g in got[1:]):
        raise RuntimeError("a rank received a different payload")
    return t_end - t_go, t_end - t_start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ids", type=int, default=1, help="unique ids per payload (128 B each)")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    _raise_fd_limit(2 * args.ranks + 256)
    threading.stack_size(256 * 1024)  # a thousand default 8 MiB stacks are wasteful
    exchange, total = [], []
    for i in range(args.repeat):
        e, t = run_once(args.ranks, args.ids, args.timeout)
        exchange.append(e)
        total.append(t)
        print(
            f"run {i + 1}: {args.ranks} ranks got {128 * args.ids} B: exchange {e:.3f} s, "
            f"with thread start {t:.3f} s"
        )
    print(
        f"median exchange {statistics.median(exchange):.3f} s, "
        f"median total {statistics.median(total):.3f} s "
        f"({os.cpu_count()} CPUs, Python {sys.version.split()[0]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
