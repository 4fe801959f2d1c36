"""The rendezvous interface and the backends that do not need a socket of their own.

A rendezvous hands rank 0's payload (``n x 128`` bytes of unique ids) to every
other rank. :class:`TcpRendezvous` (in :mod:`pynccl.bootstrap.tcp`) needs
nothing but an address; the backends here reuse something the job already has:
a key-value store (:class:`StoreRendezvous`), an MPI communicator
(:class:`MpiRendezvous`) or a shared file system (:class:`FileRendezvous`).
"""

from __future__ import annotations

import hmac
import os
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ._common import check_share_args, ranks_phrase
from ._seal import DIGEST, KEY_ENV, mac, nonce, normalize_key, open_box, seal
from ._wire import DEFAULT_MAX_PAYLOAD
from .errors import (
    RendezvousError,
    RendezvousMismatchError,
    RendezvousProtocolError,
    RendezvousTimeoutError,
)

__all__ = ["FileRendezvous", "MpiRendezvous", "Rendezvous", "StoreRendezvous"]


@runtime_checkable
class Rendezvous(Protocol):
    """Anything that can hand rank 0's bytes to the other ranks of a job."""

    def share(self, payload: bytes | None, *, rank: int, world_size: int, timeout: float) -> bytes:
        """Rank 0 passes ``payload`` and gets it back; the others pass ``None`` (ignored)
        and get rank 0's payload. Raises a :class:`RendezvousError` subclass on failure
        (:class:`RendezvousTimeoutError` after ``timeout`` seconds)."""
        ...


def _backoff(delay: float, deadline: float, cap: float) -> float:
    """Sleep ``delay`` (not past ``deadline``) and return the next, doubled, delay."""
    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
    return min(delay * 2, cap)


# -- key-value store ----------------------------------------------------------------------------

_STORE_TAG = "pynccl-store-v1"
_generation_lock = threading.Lock()
_generations: dict[tuple[int, str, int], list[Any]] = {}


class _StrongRef:
    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __call__(self) -> object:
        return self.obj


def _next_generation(store: object, prefix: str, rank: int) -> int:
    """How many rendezvous ``rank`` already did on ``store`` under ``prefix``.

    Every rank performs the same sequence of rendezvous, so the count names the same
    key on all of them; a second ``from_env`` on one store therefore never reads the
    first one's id. Counted per rank so that ranks living as threads of one process
    stay in step. A store with ``add(key, n)`` (``torch.distributed.Store``) keeps the
    count itself, so that a fresh store object (a new client of the same server, a
    restarted process) continues it; for other stores it is counted in this process,
    per store object.
    """
    add = getattr(store, "add", None)
    if callable(add):
        key = f"{prefix}/count/{rank}"
        total = add(key, 1)
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise RendezvousProtocolError(
                f"rank {rank}: store.add({key!r}, 1) returned {total!r}, not the new count "
                "(a store's add must add to a counter and return its value)"
            )
        return total - 1
    k = (id(store), prefix, rank)
    with _generation_lock:
        entry = _generations.get(k)
        if entry is None or entry[0]() is not store:

            def forget(_: object, k: tuple[int, str, int] = k) -> None:
                with _generation_lock:
                    _generations.pop(k, None)

            ref: Callable[[], object]
            try:
                ref = weakref.ref(store, forget)
            except TypeError:  # not weak-referenceable: keep it (one entry per store)
                ref = _StrongRef(store)
            entry = [ref, 0]
            _generations[k] = entry
        gen: int = entry[1]
        entry[1] = gen + 1
        return gen


class StoreRendezvous:
    """Share the id through a key-value store with ``set(key, value)`` and ``get(key)``.

    A :class:`torch.distributed.Store` works unchanged: the other ranks poll its
    ``check([key])`` until ``timeout``, then ``get`` the key. For a store without
    ``check`` whose ``get`` raises :class:`KeyError` (or any :class:`LookupError`)
    or returns ``None`` for a missing key, they poll ``get``; a ``get`` that blocks
    waits as the store decides.

    Rank 0 stores an ASCII value (a version tag, the world size and the ids in
    hex) under ``{prefix}/uid/{n}``, where ``n`` counts this rank's earlier
    rendezvous under that prefix: in the store itself (``{prefix}/count/{rank}``)
    when it has ``add(key, n)``, as torch's stores do, else in this process per
    store object. Repeated rendezvous in one job thus do not read stale ids,
    provided every rank does them in the same order; a job that restarts over the
    same store needs a prefix per attempt (``from_env`` adds torchrun's restart
    count). The store is trusted: whoever can read it can read the id.
    """

    def __init__(self, store: Any, prefix: str = "pynccl", *, poll_interval: float = 0.01) -> None:
        for method in ("set", "get"):
            if not callable(getattr(store, method, None)):
                raise TypeError(
                    f"store must have set(key, value) and get(key) methods; "
                    f"{type(store).__name__} has no {method}()"
                )
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix={prefix!r} is not a non-empty string")
        if not isinstance(poll_interval, (int, float)) or not poll_interval > 0:
            raise ValueError(f"poll_interval={poll_interval!r} is not a positive number")
        self.store = store
        self.prefix = prefix
        self.poll_interval = float(poll_interval)

    def __repr__(self) -> str:
        return f"StoreRendezvous(store={type(self.store).__name__}, prefix={self.prefix!r})"

    def share(self, payload: bytes | None, *, rank: int, world_size: int, timeout: float) -> bytes:
        """See :meth:`Rendezvous.share`."""
        data = check_share_args(payload, rank, world_size, timeout)
        if world_size == 1:
            assert data is not None
            return data
        key = f"{self.prefix}/uid/{_next_generation(self.store, self.prefix, rank)}"
        if rank == 0:
            assert data is not None
            self.store.set(key, f"{_STORE_TAG}:{world_size}:{data.hex()}")
            return data
        return self._decode(self._poll(key, rank, timeout), key, rank, world_size)

    def _poll(self, key: str, rank: int, timeout: float) -> object:
        deadline = time.monotonic() + timeout
        delay = self.poll_interval
        check = getattr(self.store, "check", None)  # torch's: is every key there, now?
        while True:
            value = None
            if not callable(check) or check([key]):
                try:
                    value = self.store.get(key)
                except LookupError:
                    value = None
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(
                    f"rank {rank}: key {key!r} did not appear in the store within {timeout:g} s "
                    "(has rank 0 started, with the same store and prefix?)"
                )
            delay = _backoff(delay, deadline, 0.25)

    @staticmethod
    def _decode(value: object, key: str, rank: int, world_size: int) -> bytes:
        if isinstance(value, (bytes, bytearray)):
            try:
                value = bytes(value).decode("ascii")
            except UnicodeDecodeError:
                value = None
        parts = value.split(":") if isinstance(value, str) else []
        if len(parts) != 3 or parts[0] != _STORE_TAG or not parts[1].isdigit():
            raise RendezvousProtocolError(
                f"rank {rank}: store key {key!r} holds something that pynccl did not write "
                "(another program using the same prefix?)"
            )
        if int(parts[1]) != world_size:
            raise RendezvousMismatchError(
                f"rank {rank}: store key {key!r} was written for world size {parts[1]} but "
                f"this rank has world size {world_size}"
            )
        try:
            data = bytes.fromhex(parts[2])
        except ValueError:
            raise RendezvousProtocolError(
                f"rank {rank}: store key {key!r} holds a malformed payload"
            ) from None
        if not data:
            raise RendezvousProtocolError(f"rank {rank}: store key {key!r} holds an empty payload")
        return data


# -- MPI --------------------------------------------------------------------------------------


class MpiRendezvous:
    """Share the id with a broadcast from rank 0 over an mpi4py communicator.

    ``comm`` is an ``mpi4py.MPI.Comm`` (or anything with ``bcast(obj, root=0)``);
    its ranks must be the NCCL ranks. MPI offers no timeout: ``timeout`` is
    checked but a missing rank blocks the broadcast as MPI would.
    """

    def __init__(self, comm: Any) -> None:
        if not callable(getattr(comm, "bcast", None)):
            raise TypeError(
                f"comm must be an mpi4py communicator (with bcast), got {type(comm).__name__}"
            )
        self.comm = comm

    def __repr__(self) -> str:
        return f"MpiRendezvous(comm={type(self.comm).__name__})"

    def share(self, payload: bytes | None, *, rank: int, world_size: int, timeout: float) -> bytes:
        """See :meth:`Rendezvous.share`."""
        data = check_share_args(payload, rank, world_size, timeout)
        checks = (("Get_size", world_size, "size"), ("Get_rank", rank, "rank"))
        for getter, expected, what in checks:
            fn = getattr(self.comm, getter, None)
            if callable(fn) and fn() != expected:
                raise RendezvousMismatchError(
                    f"the MPI communicator's {what} is {fn()} but the NCCL {what} is {expected}"
                )
        received = self.comm.bcast(data if rank == 0 else None, root=0)
        if not isinstance(received, (bytes, bytearray)) or not received:
            raise RendezvousProtocolError(
                f"rank {rank}: the MPI broadcast delivered {type(received).__name__}, not the "
                "id bytes (does rank 0 of the communicator call share() too?)"
            )
        return bytes(received)


# -- shared file system -------------------------------------------------------------------------

_FILE_MAGIC = b"PNFR"
_FILE_VERSION = 1
_FILE_HEADER = struct.Struct("!4sBI32s")  # magic, version, world size, nonce


class FileRendezvous:
    """Share the id through a file on a file system that every rank sees.

    Rank 0 writes ``path`` atomically (a 0600 temporary file in the same
    directory, fsync, rename). Its content is a header (world size, a fresh
    nonce) MAC'd with the job key, then the ids sealed (encrypted and
    authenticated) under a key derived from the job key and the nonce. Other
    ranks poll until a file that verifies under *their* key appears, so a file
    left by an earlier job (another key) is never read, even if it is there
    before rank 0 starts; after reading, each rank drops an empty
    ``{path}.{nonce}.ack{rank}`` file. Rank 0 waits (until ``timeout``) for every
    rank's ack, then deletes the file and the acks; after a crash they may
    remain and are ignored by later jobs.

    ``key`` defaults to ``PYNCCL_RENDEZVOUS_KEY``; it is required, and it must
    be unique to each run of the job (``python -m pynccl launch`` generates
    one; ``from_env`` also mixes in the launcher's job id). A fixed key reused by
    consecutive runs would let a run read a file that a crashed earlier run left.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        key: str | bytes | None = None,
        *,
        poll_interval: float = 0.02,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        if key is None:
            key = os.environ.get(KEY_ENV)
        k = normalize_key(key)
        if k is None:
            raise ValueError(
                f"FileRendezvous needs a key unique to this run of the job (key=... or "
                f"{KEY_ENV}) so that a file left by an earlier run is never read"
            )
        if not os.path.isdir(os.path.dirname(self.path)):
            raise ValueError(f"the directory of {self.path!r} does not exist")
        if not isinstance(poll_interval, (int, float)) or not poll_interval > 0:
            raise ValueError(f"poll_interval={poll_interval!r} is not a positive number")
        self._key = k
        self.poll_interval = float(poll_interval)
        self.max_payload = max_payload

    def __repr__(self) -> str:
        return f"FileRendezvous(path={self.path!r})"

    def _ack_path(self, file_nonce: bytes, rank: int) -> str:
        return f"{self.path}.{file_nonce[:8].hex()}.ack{rank}"

    def share(self, payload: bytes | None, *, rank: int, world_size: int, timeout: float) -> bytes:
        """See :meth:`Rendezvous.share`."""
        data = check_share_args(payload, rank, world_size, timeout)
        if world_size == 1:
            assert data is not None
            return data
        deadline = time.monotonic() + timeout
        if rank == 0:
            assert data is not None
            if len(data) > self.max_payload:
                raise ValueError(f"payload of {len(data)} bytes exceeds max_payload")
            self._serve(data, world_size, deadline, timeout)
            return data
        return self._fetch(rank, world_size, deadline, timeout)

    def _serve(self, data: bytes, world_size: int, deadline: float, timeout: float) -> None:
        file_nonce = nonce()
        header = _FILE_HEADER.pack(_FILE_MAGIC, _FILE_VERSION, world_size, file_nonce)
        session = mac(self._key, b"pynccl-file session", header)
        blob = header + mac(self._key, b"pynccl-file header", header) + seal(session, data)
        directory, name = os.path.split(self.path)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        acks = {r: self._ack_path(file_nonce, r) for r in range(1, world_size)}
        try:
            delay = self.poll_interval
            while True:
                acks = {r: p for r, p in acks.items() if not os.path.exists(p)}
                if not acks:
                    return
                if time.monotonic() >= deadline:
                    raise RendezvousTimeoutError(
                        f"rank 0: {ranks_phrase(acks)} of {world_size} did not read "
                        f"{self.path} within {timeout:g} s (did they start, with the same path "
                        "and key?)"
                    )
                delay = _backoff(delay, deadline, 0.25)
        finally:
            for p in [self.path] + [self._ack_path(file_nonce, r) for r in range(1, world_size)]:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    def _fetch(self, rank: int, world_size: int, deadline: float, timeout: float) -> bytes:
        limit = _FILE_HEADER.size + 2 * DIGEST + self.max_payload
        foreign = False
        delay = self.poll_interval
        while True:
            try:
                with open(self.path, "rb") as f:
                    blob = f.read(limit + 1)
            except FileNotFoundError:
                blob = None
            if blob is not None:
                got = self._open(blob, limit, rank, world_size)
                if got is not None:
                    file_nonce, data = got
                    ack = os.open(self._ack_path(file_nonce, rank), os.O_CREAT | os.O_WRONLY, 0o600)
                    os.close(ack)
                    return data
                foreign = True
            if time.monotonic() >= deadline:
                why = (
                    "; a file is there but it was not written by this job (a stale file from "
                    "an earlier run, or a different key)"
                    if foreign
                    else ""
                )
                raise RendezvousTimeoutError(
                    f"rank {rank}: rank 0 did not publish the id at {self.path} within "
                    f"{timeout:g} s{why}"
                )
            delay = _backoff(delay, deadline, 0.25)

    def _open(
        self, blob: bytes, limit: int, rank: int, world_size: int
    ) -> tuple[bytes, bytes] | None:
        """(nonce, payload) if ``blob`` is this job's file; ``None`` if it is someone else's."""
        head = _FILE_HEADER.size
        if len(blob) > limit or len(blob) < head + 2 * DIGEST:
            return None
        header = blob[:head]
        magic, version, size, file_nonce = _FILE_HEADER.unpack(header)
        if magic != _FILE_MAGIC or version != _FILE_VERSION:
            return None
        if not hmac.compare_digest(
            mac(self._key, b"pynccl-file header", header), blob[head : head + DIGEST]
        ):
            return None  # another key: another job's file
        if size != world_size:
            raise RendezvousMismatchError(
                f"rank {rank}: {self.path} was written by rank 0 for world size {size} but this "
                f"rank has world size {world_size}"
            )
        data = open_box(mac(self._key, b"pynccl-file session", header), blob[head + DIGEST :])
        if data is None:
            raise RendezvousError(f"rank {rank}: {self.path} failed its integrity check")
        return bytes(file_nonce), data
