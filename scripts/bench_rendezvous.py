"""How long the TCP rendezvous takes to hand the id to many ranks over loopback.

Rank 0 serves from its thread; ranks 1..N-1 are threads of this process, each
opening its own connection with the HMAC key, as separate processes would.
Prints the wall time of the exchange (all client threads already started and
released together from a barrier) and of the whole run including thread start.

With ``--flood N`` each repeat also runs the exchange while N silent connections
(replaced as soon as the server drops one) compete for ``--max-connections``
slots, interleaved with a run without them, and prints both, their medians' ratio
and the slowest flooded run (a rank displaced from its slot reconnects after a
pause, so a few runs take about a second longer). The flood only competes when
ranks and silent connections together outnumber the slots: give all three, as in
the second line (64 ranks, 200 silent connections, 64 slots); otherwise the script
says that nothing was displaced.

    python scripts/bench_rendezvous.py [--ranks 1024] [--repeat 3] [--ids 1]
    python scripts/bench_rendezvous.py --ranks 64 --flood 200 --max-connections 64 --repeat 20
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import selectors
import socket
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


class Flood:
    """``n`` connections that never speak, each replaced as soon as the server drops it."""

    def __init__(self, port: int, n: int) -> None:
        self.port = port
        self.sel = selectors.DefaultSelector()
        for _ in range(n):
            self.sel.register(socket.create_connection(("127.0.0.1", port)), selectors.EVENT_READ)
        self.replaced = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.02):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                self.sel.unregister(sock)
                sock.close()
                try:
                    new = socket.create_connection(("127.0.0.1", self.port), timeout=1.0)
                except OSError:
                    continue  # the server is gone
                self.sel.register(new, selectors.EVENT_READ)
                self.replaced += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for key in list(self.sel.get_map().values()):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            sock.close()
        self.sel.close()


def run_once(
    ranks: int, nids: int, timeout: float, flood: int = 0, max_connections: int = 1024
) -> tuple[float, float]:
    """(seconds for the exchange, seconds including thread start)."""
    key = secrets.token_hex(32)
    payload = os.urandom(128 * nids)
    t_start = time.perf_counter()
    server = TcpRendezvousServer(
        payload,
        host="127.0.0.1",
        port=0,
        world_size=ranks,
        key=key,
        timeout=timeout,
        max_connections=max_connections,
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
    flooder = Flood(server.address[1], flood) if flood else None
    go.wait()
    t_go = time.perf_counter()
    try:
        for t in threads:
            t.join()
        server.wait()
        t_end = time.perf_counter()
    finally:
        server.close()
        if flooder is not None:
            flooder.close()
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
    p.add_argument("--flood", type=int, default=0, help="silent connections competing")
    p.add_argument("--max-connections", type=int, default=1024, help="the server's slots")
    args = p.parse_args()
    _raise_fd_limit(2 * args.ranks + 2 * args.flood + 256)
    threading.stack_size(256 * 1024)  # a thousand default 8 MiB stacks are wasteful
    exchange, total, flooded = [], [], []
    for i in range(args.repeat):
        e, t = run_once(args.ranks, args.ids, args.timeout, 0, args.max_connections)
        exchange.append(e)
        total.append(t)
        line = (
            f"run {i + 1}: {args.ranks} ranks got {128 * args.ids} B: exchange {e:.3f} s, "
            f"with thread start {t:.3f} s"
        )
        if args.flood:
            f, _ = run_once(args.ranks, args.ids, args.timeout, args.flood, args.max_connections)
            flooded.append(f)
            line += f"; with {args.flood} silent connections: exchange {f:.3f} s"
        print(line)
    print(
        f"median exchange {statistics.median(exchange):.3f} s, "
        f"median total {statistics.median(total):.3f} s "
        f"({os.cpu_count()} CPUs, Python {sys.version.split()[0]})"
    )
    if flooded:
        base, worse = statistics.median(exchange), statistics.median(flooded)
        print(
            f"median exchange of {args.ranks} ranks with {args.flood} silent connections "
            f"against {args.max_connections} slots: {worse:.3f} s ({worse / base:.1f}x), "
            f"slowest {max(flooded):.3f} s"
        )
        if args.ranks - 1 + args.flood <= args.max_connections:
            print(
                f"note: the {args.ranks - 1} ranks' and {args.flood} silent connections fit in "
                f"the {args.max_connections} slots, so none was displaced: pass "
                "--max-connections below their sum to measure the competition"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
