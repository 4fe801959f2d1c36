"""TCP rendezvous: rank 0 serves the unique id(s) at ``MASTER_ADDR:MASTER_PORT``, the
other ranks fetch them.

:class:`TcpRendezvous` is the client and the :class:`Rendezvous` object; rank 0's
server is :class:`~.tcp_server.TcpRendezvousServer`; the frames and the mutually
authenticated handshake (HMAC-SHA256 on the job key, the id sealed under a
per-connection session key) are described in :mod:`._wire`. The id and the key
never appear in logs, exception messages or reprs.
"""

from __future__ import annotations

import hmac
import os
import random
import socket
import time
from collections.abc import Mapping, Sequence

from ._common import check_share_args
from ._conventions import detected, missing_address
from ._progress import report_interval, say
from ._roots import check_parts_args
from ._seal import DIGEST, KEY_ENV, NONCE, mac, normalize_key, open_box, seal, warn_keyless
from ._wire import (
    AUTH,
    CHALLENGE,
    DEFAULT_MAX_PAYLOAD,
    ERROR,
    ERROR_CLASSES,
    FLAG_KEY,
    FLAG_UPLOAD,
    HEADER,
    HELLO,
    HELLO_BODY,
    MAGIC,
    MAX_ERROR_TEXT,
    PAYLOAD,
    VERSION,
    check_host_port,
    check_positive,
    clean_text,
    frame,
    transcript,
)
from .env import LaunchEnv, detect_launch_env
from .errors import (
    LaunchEnvError,
    RendezvousAuthError,
    RendezvousError,
    RendezvousProtocolError,
    RendezvousTimeoutError,
)
from .tcp_server import TcpRendezvousServer

__all__ = ["DEFAULT_MAX_PAYLOAD", "TcpRendezvous", "TcpRendezvousServer"]


class _Retry(Exception):
    """The server closed the connection without answering: try again. It may be
    restarting, or it dropped this unauthenticated connection to make room for others
    (a server never refuses a rank silently: a refusal is an error frame)."""


class TcpRendezvous:
    """Share the id over TCP: rank 0 serves at ``host:port``, the others fetch it.

    ``key`` is the job's secret (``str`` or ``bytes``; ``None`` or empty: no key,
    with an :class:`InsecureRendezvousWarning`). Every rank must use the same
    host, port and key. On rank 0 :meth:`share` serves until every other rank
    has the payload and returns it (``wait_for_all=False``: returns at once and
    keeps serving from a daemon thread until done or ``timeout``, logging
    failures instead of raising them). On the other ranks it connects with
    exponential backoff until ``timeout``.

    ``connection_timeout`` bounds each client's handshake on the server (never
    beyond ``timeout``); ``max_connections`` bounds concurrent handshakes (later
    connections wait for a slot, or displace the oldest unauthenticated handshake
    after 0.5 s; a rank dropped that way reconnects); ``bind`` overrides the
    address rank 0 listens on (default: ``host`` if it is a loopback address,
    else all interfaces after checking that ``host`` is local).
    """

    def __init__(
        self,
        host: str,
        port: int,
        key: str | bytes | None = None,
        *,
        connection_timeout: float = 30.0,
        max_connections: int = 1024,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        bind: str | None = None,
        wait_for_all: bool = True,
    ) -> None:
        check_host_port(host, port, allow_zero=False)
        check_positive("connection_timeout", connection_timeout)
        if isinstance(max_payload, bool) or not isinstance(max_payload, int) or max_payload < 1:
            raise ValueError(f"max_payload={max_payload!r} is not a positive integer")
        self.host = host
        self.port = port
        self._key = normalize_key(key)
        self.connection_timeout = float(connection_timeout)
        self.max_connections = max_connections
        self.max_payload = max_payload
        self.bind = bind
        self.wait_for_all = wait_for_all

    @classmethod
    def from_env(
        cls,
        env: LaunchEnv | None = None,
        environ: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> TcpRendezvous:
        """Build from ``MASTER_ADDR``/``MASTER_PORT`` (via :func:`detect_launch_env`) and
        ``PYNCCL_RENDEZVOUS_KEY``; extra keyword arguments go to the constructor."""
        if environ is None:
            environ = os.environ
        if env is None:
            env = detect_launch_env(environ)
        if env.master_addr is None or env.master_port is None:
            raise LaunchEnvError(
                f"{detected(env.launcher)} but the TCP rendezvous has no address: "
                f"{missing_address(env)}. Export it (rank 0's host, a free port there), "
                "or share the id another way (from_env(mpi_comm=...), store=..., file=...)",
                env.launcher,
            )
        return cls(env.master_addr, env.master_port, environ.get(KEY_ENV), **kwargs)  # type: ignore[arg-type]

    @property
    def keyed(self) -> bool:
        """Whether a key protects this rendezvous."""
        return self._key is not None

    def __repr__(self) -> str:
        return f"TcpRendezvous(host={self.host!r}, port={self.port}, keyed={self.keyed})"

    def share(
        self,
        payload: bytes | None,
        *,
        rank: int,
        world_size: int,
        timeout: float,
    ) -> bytes:
        """Rank 0: serve ``payload`` and return it; other ranks: return rank 0's payload."""
        data = check_share_args(payload, rank, world_size, timeout)
        if world_size == 1:
            assert data is not None
            return data
        if self._key is None:
            warn_keyless(f"the TCP rendezvous at {self.host}:{self.port}")
        if rank == 0:
            assert data is not None
            server = self.serve(data, world_size=world_size, timeout=timeout)
            if not self.wait_for_all:
                return data
            try:
                server.wait()
            finally:
                server.close()
            return data
        return self.fetch(rank=rank, world_size=world_size, timeout=timeout)

    def share_parts(
        self,
        part: bytes | None,
        *,
        rank: int,
        world_size: int,
        makers: Sequence[int],
        timeout: float,
    ) -> bytes:
        """See :class:`~.backends.Rendezvous`: rank 0 serves its part and takes the others'
        uploads (each maker's id travels sealed in its handshake); every rank gets them all."""
        _, data = check_parts_args(part, rank, world_size, makers, timeout)
        if world_size == 1:
            assert data is not None
            return data
        if self._key is None:
            warn_keyless(f"the TCP rendezvous at {self.host}:{self.port}")
        if rank != 0:
            return self.fetch(rank=rank, world_size=world_size, timeout=timeout, upload=data)
        assert data is not None
        server = self.serve(data, world_size=world_size, timeout=timeout, makers=makers)
        if not self.wait_for_all:  # the server goes on serving: rank 0 needs the ids only
            try:
                return server.wait_payload()
            except BaseException:
                server.close()
                raise
        try:
            server.wait()
        finally:
            server.close()
        payload = server.payload
        assert payload is not None  # every rank was served
        return payload

    def serve(
        self, payload: bytes, *, world_size: int, timeout: float, makers: Sequence[int] = (0,)
    ) -> TcpRendezvousServer:
        """Start and return rank 0's server (for callers that manage it themselves);
        ``makers``: see :class:`TcpRendezvousServer`."""
        server = TcpRendezvousServer(
            payload,
            host=self.host,
            port=self.port,
            world_size=world_size,
            key=self._key,
            timeout=timeout,
            connection_timeout=self.connection_timeout,
            max_connections=self.max_connections,
            max_payload=self.max_payload,
            bind=self.bind,
            makers=makers,
        )
        return server.start()

    def fetch(
        self, *, rank: int, world_size: int, timeout: float, upload: bytes | None = None
    ) -> bytes:
        """Connect to rank 0 (retrying with backoff) and return the payload it serves;
        ``upload``: the id this rank makes, sent sealed in its handshake."""
        check_share_args(None, rank, world_size, timeout)
        if rank == 0:
            raise ValueError("rank 0 serves the payload; it cannot fetch it")
        where = f"{self.host}:{self.port}"
        start = time.monotonic()
        deadline = start + timeout
        every = report_interval()
        next_report = start + every if every > 0 else float("inf")
        delay = 0.01
        attempts = 0
        last: str = "no attempt made"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousTimeoutError(
                    f"rank {rank}: could not fetch the id from rank 0 at {where} within "
                    f"{timeout:g} s after {attempts} attempt(s); last error: {last}. Is rank 0 "
                    "running, with the same MASTER_ADDR/MASTER_PORT?"
                )
            attempts += 1
            try:
                sock = socket.create_connection((self.host, self.port), timeout=remaining)
            except OSError as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                try:
                    with sock:
                        return self._handshake(sock, rank, world_size, deadline, where, upload)
                except _Retry as e:
                    last = str(e)
            now = time.monotonic()
            if now >= next_report:  # rank 0 is the one missing, from here
                say(
                    f"rank {rank}: rank 0 at {where} has not served the id after "
                    f"{now - start:.0f} s ({attempts} attempt(s); last error: {last})"
                )
                next_report = now + every
            # jittered exponential backoff so that a thousand ranks do not retry in lockstep
            time.sleep(min(delay * random.uniform(0.5, 1.0), max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)

    def _handshake(
        self,
        sock: socket.socket,
        rank: int,
        world_size: int,
        deadline: float,
        where: str,
        upload: bytes | None,
    ) -> bytes:
        key = self._key or b""
        nonce_c = os.urandom(NONCE)
        flags = (FLAG_KEY if self._key is not None else 0) | (FLAG_UPLOAD if upload else 0)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(frame(HELLO, HELLO_BODY.pack(flags, nonce_c, rank, world_size)))
        except OSError as e:
            raise _Retry(f"{type(e).__name__}: {e}") from None
        nonce_s = self._read(sock, CHALLENGE, NONCE, rank, deadline, where, first=True)
        tx = transcript(nonce_c, nonce_s, rank, world_size)
        try:
            proof = mac(key, b"pynccl-rdzv client", tx)
            if upload:
                proof += seal(mac(key, b"pynccl-rdzv session", tx), upload)
            sock.sendall(frame(AUTH, proof))
        except OSError as e:  # dropped to make room (a server under a flood): reconnect
            raise _Retry(f"connection lost during the handshake: {e}") from None
        body = self._read(
            sock, PAYLOAD, 2 * DIGEST + self.max_payload, rank, deadline, where, first=True
        )
        if len(body) < 2 * DIGEST or not hmac.compare_digest(
            body[:DIGEST], mac(key, b"pynccl-rdzv server", tx)
        ):
            raise RendezvousAuthError(
                f"rank {rank}: the server at {where} could not prove it knows this job's "
                f"rendezvous key: it is not this job's rank 0 (another job on the same port, or "
                f"a different {KEY_ENV})"
            )
        payload = open_box(mac(key, b"pynccl-rdzv session", tx), body[DIGEST:])
        if payload is None:
            raise RendezvousProtocolError(
                f"rank {rank}: the payload from {where} failed its integrity check"
            )
        return payload

    def _read(
        self,
        sock: socket.socket,
        kind: int,
        limit: int,
        rank: int,
        deadline: float,
        where: str,
        *,
        first: bool = False,
    ) -> bytes:
        header = self._recv_exact(sock, HEADER.size, rank, deadline, where, first=first)
        magic, version, got, length = HEADER.unpack(header)
        if magic != MAGIC:
            raise RendezvousProtocolError(
                f"rank {rank}: {where} is not a pynccl rendezvous server (it answered "
                f"{header[:4]!r}); is MASTER_PORT taken by another service?"
            )
        if version != VERSION:
            raise RendezvousProtocolError(
                f"rank {rank}: rank 0 at {where} speaks rendezvous protocol version {version}, "
                f"this rank {VERSION}: mixed pynccl versions?"
            )
        if got == ERROR:
            if not 1 <= length <= 1 + MAX_ERROR_TEXT:
                raise RendezvousProtocolError(
                    f"rank {rank}: malformed error message ({length} bytes) from {where}"
                )
            body = self._recv_exact(sock, length, rank, deadline, where)
            cls = ERROR_CLASSES.get(body[0], RendezvousError)
            raise cls(f"rank {rank}: rank 0 at {where} refused this rank: {clean_text(body[1:])}")
        if got != kind:
            raise RendezvousProtocolError(
                f"rank {rank}: message type {got} from {where} where {kind} was expected"
            )
        if length > limit:
            raise RendezvousProtocolError(
                f"rank {rank}: {where} announced a {length}-byte message, over the "
                f"{limit}-byte limit"
            )
        return self._recv_exact(sock, length, rank, deadline, where)

    @staticmethod
    def _recv_exact(
        sock: socket.socket,
        n: int,
        rank: int,
        deadline: float,
        where: str,
        *,
        first: bool = False,
    ) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousTimeoutError(
                    f"rank {rank}: rank 0 at {where} accepted the connection but did not "
                    "finish the handshake within the timeout"
                )
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(n - len(buf))
            except socket.timeout:
                continue
            except OSError as e:
                if first and not buf:
                    raise _Retry(f"{type(e).__name__}: {e}") from None
                raise RendezvousProtocolError(
                    f"rank {rank}: connection to rank 0 at {where} lost: {e}"
                ) from None
            if not chunk:
                if first and not buf:
                    raise _Retry("the server closed the connection before answering")
                raise RendezvousProtocolError(
                    f"rank {rank}: connection closed by {where} after {len(buf)} of {n} bytes "
                    "(truncated message)"
                )
            buf += chunk
        return bytes(buf)
