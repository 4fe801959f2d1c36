"""The rendezvous interface and the backends that do not need a socket of their own.

A rendezvous hands rank 0's payload (``n x 128`` bytes of unique ids) to every
other rank. :class:`TcpRendezvous` (in :mod:`pynccl.bootstrap.tcp`) needs
nothing but an address; the backends here reuse something the job already has:
a key-value store (:class:`StoreRendezvous`), an MPI communicator
(:class:`MpiRendezvous`) or a shared file system (:class:`FileRendezvous`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ._common import backoff as _backoff
from ._common import check_share_args
from ._file import FileRendezvous
from ._roots import check_parts_args
from .errors import (
    RendezvousMismatchError,
    RendezvousProtocolError,
    RendezvousTimeoutError,
)

__all__ = ["FileRendezvous", "MpiRendezvous", "Rendezvous", "StoreRendezvous"]


@runtime_checkable
class Rendezvous(Protocol):
    """Anything that can hand rank 0's bytes to the other ranks of a job.

    pynccl's backends also have ``share_parts(part, *, rank, world_size, makers,
    timeout)``: each rank of ``makers`` (increasing, from rank 0) passes its part, the
    others ``None``, and every rank gets the parts joined in ``makers``' order. ``from_env``
    uses it so that the rank that starts each bootstrap root makes its unique id (see
    :mod:`pynccl.bootstrap._roots`); with a backend without it, rank 0 makes every id.
    """

    def share(self, payload: bytes | None, *, rank: int, world_size: int, timeout: float) -> bytes:
        """Rank 0 passes ``payload`` and gets it back; the others pass ``None`` (ignored)
        and get rank 0's payload. Raises a :class:`RendezvousError` subclass on failure
        (:class:`RendezvousTimeoutError` after ``timeout`` seconds)."""
        ...


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

    def share_parts(
        self,
        part: bytes | None,
        *,
        rank: int,
        world_size: int,
        makers: Sequence[int],
        timeout: float,
    ) -> bytes:
        """See :class:`Rendezvous`: part ``i`` of ``n`` under ``{prefix}/uid/{gen}/{i}of{n}``
        (a rank that expects another count of parts waits for keys that never come)."""
        index, data = check_parts_args(part, rank, world_size, makers, timeout)
        if world_size == 1:
            assert data is not None
            return data
        n = len(makers)
        base = f"{self.prefix}/uid/{_next_generation(self.store, self.prefix, rank)}"
        if data is not None:
            self.store.set(f"{base}/{index}of{n}", f"{_STORE_TAG}:{world_size}:{data.hex()}")
        deadline = time.monotonic() + timeout
        parts = []
        for i, maker in enumerate(makers):
            if i == index:
                assert data is not None
                parts.append(data)
                continue
            key = f"{base}/{i}of{n}"
            value = self._poll(key, rank, max(1e-3, deadline - time.monotonic()), maker)
            parts.append(self._decode(value, key, rank, world_size))
        return b"".join(parts)

    def _poll(self, key: str, rank: int, timeout: float, maker: int = 0) -> object:
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
                    f"(has rank {maker} started, with the same store, prefix and nids?)"
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
        self._check_comm(rank, world_size)
        return self._bcast(data, rank, 0)

    def share_parts(
        self,
        part: bytes | None,
        *,
        rank: int,
        world_size: int,
        makers: Sequence[int],
        timeout: float,
    ) -> bytes:
        """See :class:`Rendezvous`: one broadcast from each maker, in order."""
        _, data = check_parts_args(part, rank, world_size, makers, timeout)
        self._check_comm(rank, world_size)
        return b"".join(self._bcast(data if rank == m else None, rank, m) for m in makers)

    def _check_comm(self, rank: int, world_size: int) -> None:
        checks = (("Get_size", world_size, "size"), ("Get_rank", rank, "rank"))
        for getter, expected, what in checks:
            fn = getattr(self.comm, getter, None)
            if callable(fn) and fn() != expected:
                raise RendezvousMismatchError(
                    f"the MPI communicator's {what} is {fn()} but the NCCL {what} is {expected}"
                )

    def _bcast(self, data: bytes | None, rank: int, root: int) -> bytes:
        received = self.comm.bcast(data if rank == root else None, root=root)
        if not isinstance(received, (bytes, bytearray)) or not received:
            raise RendezvousProtocolError(
                f"rank {rank}: the MPI broadcast from rank {root} delivered "
                f"{type(received).__name__}, not the id bytes (does rank {root} of the "
                "communicator call share() too?)"
            )
        return bytes(received)
