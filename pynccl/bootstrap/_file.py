"""The shared-file-system rendezvous (:class:`FileRendezvous`, public in
:mod:`pynccl.bootstrap.backends`): each id travels sealed in a file that every rank sees."""

from __future__ import annotations

import hmac
import os
import struct
import tempfile
import time
from collections.abc import Sequence

from ._common import backoff as _backoff
from ._common import check_share_args, ranks_phrase
from ._roots import check_parts_args
from ._seal import DIGEST, KEY_ENV, mac, nonce, normalize_key, open_box, seal
from ._wire import DEFAULT_MAX_PAYLOAD
from .errors import RendezvousError, RendezvousMismatchError, RendezvousTimeoutError

__all__ = ["FileRendezvous"]


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

    def share(self, payload: bytes | None, *, rank: int, world_size: int, timeout: float) -> bytes:
        """See :meth:`Rendezvous.share`."""
        data = check_share_args(payload, rank, world_size, timeout)
        if world_size == 1:
            assert data is not None
            return data
        deadline = time.monotonic() + timeout
        file = _File(self.path, b"", 0)
        if rank == 0:
            assert data is not None
            if len(data) > self.max_payload:
                raise ValueError(f"payload of {len(data)} bytes exceeds max_payload")
            file_nonce = self._publish(file, data, world_size)
            self._await_acks(file, file_nonce, world_size, deadline, timeout)
            return data
        return self._fetch(file, rank, world_size, deadline, timeout)

    def share_parts(
        self,
        part: bytes | None,
        *,
        rank: int,
        world_size: int,
        makers: Sequence[int],
        timeout: float,
    ) -> bytes:
        """See :class:`Rendezvous`: part ``i`` of ``n`` in its own file (``path``, then
        ``path.part1``, ...), keyed to its index and ``n``; each maker publishes its file,
        reads the others, then waits for every rank's ack of its own."""
        index, data = check_parts_args(part, rank, world_size, makers, timeout)
        if world_size == 1:
            assert data is not None
            return data
        deadline = time.monotonic() + timeout
        n = len(makers)
        files = [
            _File(f"{self.path}.part{i}" if i else self.path, f" part {i} of {n}".encode(), m)
            for i, m in enumerate(makers)
        ]
        mine = None
        if index is not None:
            assert data is not None
            if len(data) > self.max_payload:
                raise ValueError(f"part of {len(data)} bytes exceeds max_payload")
            mine = self._publish(files[index], data, world_size)
        try:
            parts = [
                data if i == index else self._fetch(file, rank, world_size, deadline, timeout)
                for i, file in enumerate(files)
            ]
        except BaseException:  # raise why at once: no rank waits for this one's ids now
            if index is not None and mine is not None:
                _remove(files[index], mine, world_size)
            raise
        if index is not None and mine is not None:
            self._await_acks(files[index], mine, world_size, deadline, timeout)
        return b"".join(p for p in parts if p is not None)

    def _publish(self, file: _File, data: bytes, world_size: int) -> bytes:
        """Write ``file`` atomically; its nonce."""
        file_nonce = nonce()
        header = _FILE_HEADER.pack(_FILE_MAGIC, _FILE_VERSION, world_size, file_nonce)
        session = mac(self._key, b"pynccl-file session" + file.label, header)
        tag = mac(self._key, b"pynccl-file header" + file.label, header)
        blob = header + tag + seal(session, data)
        directory, name = os.path.split(file.path)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, file.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return file_nonce

    def _await_acks(
        self, file: _File, file_nonce: bytes, world_size: int, deadline: float, timeout: float
    ) -> None:
        """Wait until every other rank acked ``file``, then delete it and the acks (also
        on a timeout)."""
        others = [r for r in range(world_size) if r != file.maker]
        acks = {r: _ack_path(file.path, file_nonce, r) for r in others}
        try:
            delay = self.poll_interval
            while True:
                acks = {r: p for r, p in acks.items() if not os.path.exists(p)}
                if not acks:
                    return
                if time.monotonic() >= deadline:
                    raise RendezvousTimeoutError(
                        f"rank {file.maker}: {ranks_phrase(acks)} of {world_size} did not read "
                        f"{file.path} within {timeout:g} s (did they start, with the same path "
                        "and key?)"
                    )
                delay = _backoff(delay, deadline, 0.25)
        finally:
            _remove(file, file_nonce, world_size)

    def _fetch(
        self, file: _File, rank: int, world_size: int, deadline: float, timeout: float
    ) -> bytes:
        limit = _FILE_HEADER.size + 2 * DIGEST + self.max_payload
        foreign = False
        delay = self.poll_interval
        while True:
            try:
                with open(file.path, "rb") as f:
                    blob = f.read(limit + 1)
            except FileNotFoundError:
                blob = None
            if blob is not None:
                got = self._open(file, blob, limit, rank, world_size)
                if got is not None:
                    file_nonce, data = got
                    ack = _ack_path(file.path, file_nonce, rank)
                    os.close(os.open(ack, os.O_CREAT | os.O_WRONLY, 0o600))
                    return data
                foreign = True
            if time.monotonic() >= deadline:
                why = (
                    "; a file is there but it was not written by this job (a stale file from "
                    "an earlier run, or a different key or nids)"
                    if foreign
                    else ""
                )
                raise RendezvousTimeoutError(
                    f"rank {rank}: rank {file.maker} did not publish the id at {file.path} "
                    f"within {timeout:g} s{why}"
                )
            delay = _backoff(delay, deadline, 0.25)

    def _open(
        self, file: _File, blob: bytes, limit: int, rank: int, world_size: int
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
            mac(self._key, b"pynccl-file header" + file.label, header), blob[head : head + DIGEST]
        ):
            return None  # another key: another job's file
        if size != world_size:
            raise RendezvousMismatchError(
                f"rank {rank}: {file.path} was written by rank {file.maker} for world size "
                f"{size} but this rank has world size {world_size}"
            )
        session = mac(self._key, b"pynccl-file session" + file.label, header)
        data = open_box(session, blob[head + DIGEST :])
        if data is None:
            raise RendezvousError(f"rank {rank}: {file.path} failed its integrity check")
        return bytes(file_nonce), data


class _File:
    """One published part: where, the label its MACs carry, and the rank that writes it."""

    __slots__ = ("label", "maker", "path")

    def __init__(self, path: str, label: bytes, maker: int) -> None:
        self.path = path
        self.label = label
        self.maker = maker


def _remove(file: _File, file_nonce: bytes, world_size: int) -> None:
    """Delete ``file`` and the acks of it (those that are there)."""
    acks = [_ack_path(file.path, file_nonce, r) for r in range(world_size) if r != file.maker]
    for p in [file.path, *acks]:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _ack_path(path: str, file_nonce: bytes, rank: int) -> str:
    return f"{path}.{file_nonce[:8].hex()}.ack{rank}"
