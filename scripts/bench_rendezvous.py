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

With ``--procs P`` rank 0's server runs in a process of its own and the ranks are
spread over P client processes, as asyncio connections (``--client asyncio``, the
default: the handshake of :mod:`pynccl.bootstrap._wire`, so that 65,536 ranks need no
65,536 threads) or as threads calling :meth:`TcpRendezvous.fetch`; each client binds
its own 127.x.y.z source address, as ranks on separate hosts would. It prints the
exchange's wall time, the server's CPU time per rank, how many connections were
displaced and how many connections a rank needed. ``--scale`` runs several world
sizes that way and prints how much the server's CPU per rank grew.

    python scripts/bench_rendezvous.py [--ranks 1024] [--repeat 3] [--ids 1]
    python scripts/bench_rendezvous.py --ranks 64 --flood 200 --max-connections 64 --repeat 20
    python scripts/bench_rendezvous.py --ranks 16384 --procs 4 --client threads --repeat 1
    python scripts/bench_rendezvous.py --scale 1024,4096,16384,65536 --procs 4 --repeat 1
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import multiprocessing
import os
import resource
import secrets
import selectors
import socket
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pynccl.bootstrap import TcpRendezvous, TcpRendezvousServer
from pynccl.bootstrap._seal import DIGEST, NONCE, mac, open_box
from pynccl.bootstrap._wire import (
    AUTH,
    CHALLENGE,
    FLAG_KEY,
    HEADER,
    HELLO,
    HELLO_BODY,
    PAYLOAD,
    frame,
    transcript,
)


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


# -- the server in a process of its own, the ranks in a few client processes ----------------


def _source(rank: int) -> str:
    """A loopback source address per rank, so that 65,536 connections never run out of
    ephemeral ports on one address (ranks on separate hosts would not share them either)."""
    return f"127.{1 + (rank >> 16)}.{(rank >> 8) & 255}.{(rank & 255) or 1}"


def _serve(
    payload: bytes, ranks: int, key: str, timeout: float, slots: int, pipe: Connection
) -> None:
    server = TcpRendezvousServer(
        payload,
        host="127.0.0.1",
        port=0,
        world_size=ranks,
        key=key,
        timeout=timeout,
        max_connections=slots,
    )
    pipe.send(server.address[1])
    pipe.recv()  # go
    before = resource.getrusage(resource.RUSAGE_SELF)  # this process runs the server alone
    t0 = time.perf_counter()
    server.start()
    try:
        server.wait()
    finally:
        server.close()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    pipe.send((wall, cpu, server.evicted))


async def _fetch_async(
    port: int, key: bytes, rank: int, ranks: int, deadline: float, gate: asyncio.Semaphore
) -> tuple[bytes, int]:
    """One rank's fetch as an asyncio connection: (payload, connections it took)."""
    delay, attempts = 0.01, 0
    while time.monotonic() < deadline:
        attempts += 1
        try:
            async with gate:
                return await _handshake_async(port, key, rank, ranks), attempts
        except (OSError, asyncio.IncompleteReadError):  # displaced: reconnect, as fetch() does
            await asyncio.sleep(delay * (0.5 + 0.5 * int.from_bytes(os.urandom(2)) / 65535))
            delay = min(2 * delay, 1.0)
    raise RuntimeError(f"rank {rank}: no payload before the timeout")


async def _handshake_async(port: int, key: bytes, rank: int, ranks: int) -> bytes:
    writer = None
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=(_source(rank), 0)
        )
        nonce_c = os.urandom(NONCE)
        writer.write(frame(HELLO, HELLO_BODY.pack(FLAG_KEY, nonce_c, rank, ranks)))
        kind, nonce_s = await _frame_async(reader)
        if kind != CHALLENGE:
            raise RuntimeError(f"rank {rank}: refused: {nonce_s[1:]!r}")
        tx = transcript(nonce_c, nonce_s, rank, ranks)
        writer.write(frame(AUTH, mac(key, b"pynccl-rdzv client", tx)))
        kind, body = await _frame_async(reader)
        if kind != PAYLOAD or not hmac.compare_digest(
            body[:DIGEST], mac(key, b"pynccl-rdzv server", tx)
        ):
            raise RuntimeError(f"rank {rank}: refused or not proven: {body[1:]!r}")
        got = open_box(mac(key, b"pynccl-rdzv session", tx), body[DIGEST:])
        if got is None:
            raise RuntimeError(f"rank {rank}: the payload failed its integrity check")
        return got
    finally:
        if writer is not None:
            writer.close()


async def _frame_async(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    _, _, kind, length = HEADER.unpack(await reader.readexactly(HEADER.size))
    return kind, await reader.readexactly(length)


def _clients(
    port: int,
    key: str,
    mine: list[int],
    ranks: int,
    mode: str,
    timeout: float,
    inflight: int,
    pipe: Connection,
) -> None:
    _raise_fd_limit(len(mine) + 256)
    deadline = time.monotonic() + timeout
    if mode == "asyncio":

        async def everyone() -> list[tuple[bytes, int]]:
            await asyncio.get_running_loop().run_in_executor(None, _ready_go, pipe)
            d = time.monotonic() + timeout
            # Handshakes in flight per client process: one process stands for many hosts, so
            # it answers a challenge as promptly as they would only when it does not juggle
            # 16,384 at once on a shared core.
            gate = asyncio.Semaphore(inflight)
            return await asyncio.gather(
                *(_fetch_async(port, key.encode(), r, ranks, d, gate) for r in mine)
            )

        results = asyncio.run(everyone())
    else:
        threading.stack_size(256 * 1024)
        client = TcpRendezvous("127.0.0.1", port, key)
        got: dict[int, tuple[bytes, int]] = {}
        _ready_go(pipe)

        def rank(r: int) -> None:
            got[r] = (
                client.fetch(rank=r, world_size=ranks, timeout=deadline - time.monotonic()),
                1,
            )

        threads = [threading.Thread(target=rank, args=(r,)) for r in mine]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [got[r] for r in mine if r in got]
    pipe.send((len(results), {p for p, _ in results}, sum(a for _, a in results)))


def _ready_go(pipe: Connection) -> None:
    pipe.send("ready")
    pipe.recv()


def run_procs(
    ranks: int, procs: int, mode: str, nids: int, timeout: float, slots: int, inflight: int = 512
) -> tuple[float, float, int, float]:
    """(exchange seconds, server CPU seconds, connections displaced, connections per rank)."""
    ctx = multiprocessing.get_context("fork")
    key = secrets.token_hex(32)
    payload = os.urandom(128 * nids)
    here, there = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(payload, ranks, key, timeout, slots, there))
    server.start()
    port = here.recv()
    clients = []
    for i in range(procs):
        mine = list(range(1 + i, ranks, procs))
        a, b = ctx.Pipe()
        p = ctx.Process(target=_clients, args=(port, key, mine, ranks, mode, timeout, inflight, b))
        p.start()
        clients.append((p, a))
    for _, a in clients:
        a.recv()  # ready
    here.send("go")
    for _, a in clients:
        a.send("go")
    wall, cpu, displaced = here.recv()
    served, payloads, connections = 0, set(), 0
    for p, a in clients:
        n, got, conns = a.recv()
        served, connections = served + n, connections + conns
        payloads |= got
        p.join()
    server.join()
    if served != ranks - 1 or payloads != {payload}:
        raise RuntimeError(f"{ranks - 1 - served} rank(s) failed or got a different payload")
    return wall, cpu, displaced, connections / (ranks - 1)


def _report_procs(args: argparse.Namespace, sizes: list[int]) -> None:
    per_rank: dict[int, float] = {}
    for ranks in sizes:
        _raise_fd_limit(4 * args.max_connections + 256)
        runs = [
            run_procs(
                ranks,
                args.procs,
                args.client,
                args.ids,
                args.timeout,
                args.max_connections,
                args.inflight,
            )
            for _ in range(args.repeat)
        ]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        per_rank[ranks] = cpu / (ranks - 1)
        print(
            f"{ranks} ranks in {args.procs} {args.client} client processes: exchange "
            f"{wall:.2f} s (slowest {max(r[0] for r in runs):.2f} s), server CPU {cpu:.2f} s = "
            f"{1e3 * per_rank[ranks]:.3f} ms per rank, {max(r[2] for r in runs)} connections "
            f"displaced, {max(r[3] for r in runs):.2f} connections per rank",
            flush=True,
        )
    if len(per_rank) > 1:
        lo, hi = min(per_rank.values()), max(per_rank.values())
        print(
            f"server CPU per rank from {min(sizes)} to {max(sizes)} ranks: "
            f"{1e3 * lo:.3f}..{1e3 * hi:.3f} ms ({hi / lo:.2f}x) "
            f"({os.cpu_count()} CPUs, Python {sys.version.split()[0]})"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ids", type=int, default=1, help="unique ids per payload (128 B each)")
    p.add_argument("--timeout", type=float, default=0.0, help="default 60 s, 600 s with --procs")
    p.add_argument("--flood", type=int, default=0, help="silent connections competing")
    p.add_argument("--max-connections", type=int, default=1024, help="the server's slots")
    p.add_argument(
        "--procs", type=int, default=0, help="server in its own process, ranks in P processes"
    )
    p.add_argument("--client", choices=("asyncio", "threads"), default="asyncio")
    p.add_argument("--scale", help="comma-separated world sizes to run with --procs")
    p.add_argument(
        "--inflight", type=int, default=512, help="asyncio handshakes at once per client process"
    )
    args = p.parse_args()
    args.timeout = args.timeout or (600.0 if args.scale or args.procs else 60.0)
    if args.scale or args.procs:
        args.procs = args.procs or 4
        sizes = [int(n) for n in args.scale.split(",")] if args.scale else [args.ranks]
        _report_procs(args, sizes)
        return 0
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
