"""Unique ids made by their roots (issue 22): in a world of several ids, id ``i`` is made by
the first rank of NCCL's group ``i`` (``firstRankFromRoot`` in NCCL's ``src/bootstrap.cc``:
``i * (n // nId) + min(i, n % nId)``), since ``ncclGetUniqueId`` starts the bootstrap root
in the caller; every backend carries each maker's id to every rank in one exchange, and
the TCP rendezvous takes an upload only sealed under the handshake's session key."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import types

import pytest
from support.wait import per_rank
from support.workers._harness import free_port
from support.workers.kv_store import DictStore

from pynccl.bootstrap import (
    FileRendezvous,
    MpiRendezvous,
    RendezvousAuthError,
    RendezvousMismatchError,
    RendezvousTimeoutError,
    StoreRendezvous,
    TcpRendezvous,
    from_env,
)
from pynccl.bootstrap import _wire as wire
from pynccl.bootstrap._roots import id_makers
from pynccl.bootstrap._seal import DIGEST, NONCE, mac, seal

HOST = "127.0.0.1"
KEY = "roots-test-key"
OK_TIMEOUT = 60.0


@pytest.mark.parametrize(
    ("nranks", "nids", "expected"),
    [(5, 2, [0, 3]), (8, 2, [0, 4]), (1537, 4, [0, 385, 769, 1153]), (3, 3, [0, 1, 2]),
     (1024, 1, [0])],
)  # fmt: skip
def test_id_makers_are_ncclS_first_rank_of_each_root(nranks, nids, expected):
    # worked by hand from NCCL's firstRankFromRoot: 1537 = 4 * 384 + 1, so the first
    # group has 385 ranks and the others 384
    assert id_makers(nranks, nids) == expected


def test_id_makers_refuse_more_ids_than_ranks():
    with pytest.raises(ValueError, match=r"nids=5 exceeds nranks=4"):
        id_makers(4, 5)
    with pytest.raises(ValueError, match=r"nids=0 is not a positive integer"):
        id_makers(4, 0)


class _ThreadMpi:
    """mpi4py's ``bcast`` for ranks that are threads: one view per rank."""

    def __init__(self, size):
        self.size = size
        self.slots: dict[int, object] = {}
        self.barrier = threading.Barrier(size)

    def view(self, rank):
        world, seq = self, [0]

        class View:
            def Get_rank(self):
                return rank

            def Get_size(self):
                return world.size

            def bcast(self, obj, root=0):
                seq[0] += 1
                if rank == root:
                    world.slots[seq[0]] = obj
                world.barrier.wait()
                got = world.slots[seq[0]]
                world.barrier.wait()
                return got

        return View()


def _backends(kind, world, tmp_path):
    """One rendezvous object per rank for ``kind``."""
    if kind == "tcp":
        port = free_port()
        return {r: TcpRendezvous(HOST, port, KEY) for r in range(world)}
    if kind == "store":
        store = DictStore()
        return {r: StoreRendezvous(store) for r in range(world)}
    if kind == "file":
        return {r: FileRendezvous(tmp_path / "ids", key=KEY) for r in range(world)}
    mpi = _ThreadMpi(world)
    return {r: MpiRendezvous(mpi.view(r)) for r in range(world)}


@pytest.mark.parametrize("kind", ["tcp", "store", "file", "mpi"])
def test_every_rank_gets_each_makers_part_in_order(kind, tmp_path):
    world, makers = 7, [0, 3, 5]
    parts = {m: bytes([16 + m]) * 128 for m in makers}
    backends = _backends(kind, world, tmp_path)
    got = per_rank(
        lambda r: backends[r].share_parts(
            parts.get(r), rank=r, world_size=world, makers=makers, timeout=OK_TIMEOUT
        ),
        range(world),
    )
    expected = parts[0] + parts[3] + parts[5]
    assert got == dict.fromkeys(range(world), expected)
    if kind == "file":
        assert os.listdir(tmp_path) == []  # every file and ack removed


def test_tcp_ranks_waiting_for_a_late_maker_leave_it_a_slot():
    # 2 handshake slots, 10 ranks that proved the key before the last maker came: they wait
    # outside the slots, so the maker still gets in and everyone is served
    world, makers = 12, [0, 11]
    port = free_port()
    rdzv = TcpRendezvous(HOST, port, KEY, max_connections=2)
    early = {}

    def rank(r):
        if r == 11:
            while len(early) < 3:  # a few others are already waiting
                threading.Event().wait(0.05)
        early[r] = True
        part = {0: b"a" * 128, 11: b"b" * 128}.get(r)
        return rdzv.share_parts(part, rank=r, world_size=world, makers=makers, timeout=30.0)

    got = per_rank(rank, range(world))
    assert got == dict.fromkeys(range(world), b"a" * 128 + b"b" * 128)


def _serve_two_ids(port, world=4):
    """Rank 0 of a 2-id world (makers 0 and 2) in a thread; its result lands in the dict."""
    rdzv = TcpRendezvous(HOST, port, KEY, connection_timeout=5.0)
    out: dict[str, object] = {}

    def rank0():
        try:
            out["got"] = rdzv.share_parts(
                b"z" * 128, rank=0, world_size=world, makers=[0, 2], timeout=3.0
            )
        except BaseException as e:  # the server times out: nobody completes it here
            out["got"] = e

    t = threading.Thread(target=rank0)
    t.start()
    return t, out


def test_tcp_refuses_ranks_that_disagree_on_who_makes_the_ids():
    port = free_port()
    t, _ = _serve_two_ids(port)
    try:
        client = TcpRendezvous(HOST, port, KEY)
        # rank 1 makes no id in a world of 4 with 2 ids; rank 2 makes id 1
        with pytest.raises(RendezvousMismatchError, match="rank 1 offers an id"):
            client.fetch(rank=1, world_size=4, timeout=10.0, upload=b"x" * 128)
        with pytest.raises(RendezvousMismatchError, match=r"rank 2 makes no id.*nids"):
            client.fetch(rank=2, world_size=4, timeout=10.0)
    finally:
        t.join(30)


def _raw_upload(port, rank, world, sealed_with):
    """A maker's handshake whose id is sealed under ``sealed_with(tx)``; the server's answer."""
    key = KEY.encode()
    for _ in range(200):  # rank 0's thread may not listen yet
        try:
            conn = socket.create_connection((HOST, port), timeout=10)
            break
        except ConnectionRefusedError:
            threading.Event().wait(0.05)
    with conn as s:
        nonce_c = os.urandom(NONCE)
        flags = wire.FLAG_KEY | wire.FLAG_UPLOAD
        s.sendall(wire.frame(wire.HELLO, wire.HELLO_BODY.pack(flags, nonce_c, rank, world)))
        head = s.recv(wire.HEADER.size, socket.MSG_WAITALL)
        assert wire.HEADER.unpack(head)[2] == wire.CHALLENGE
        nonce_s = s.recv(NONCE, socket.MSG_WAITALL)
        tx = wire.transcript(nonce_c, nonce_s, rank, world)
        body = mac(key, b"pynccl-rdzv client", tx) + seal(sealed_with(key, tx), b"u" * 128)
        assert len(body) == 2 * DIGEST + 128
        s.sendall(wire.frame(wire.AUTH, body))
        head = s.recv(wire.HEADER.size, socket.MSG_WAITALL)
        _, _, kind, length = wire.HEADER.unpack(head)
        return kind, s.recv(length, socket.MSG_WAITALL)


def test_tcp_takes_an_upload_only_sealed_under_the_session_key():
    port = free_port()
    t, out = _serve_two_ids(port)
    try:
        # the right client proof, but the id sealed under a key an eavesdropper could know
        kind, body = _raw_upload(port, 2, 4, lambda key, tx: b"\0" * 32)
        assert kind == wire.ERROR and body[0] == wire.ERR_AUTH
        assert b"uploaded failed its integrity check" in body
        assert wire.ERROR_CLASSES[body[0]] is RendezvousAuthError
    finally:
        t.join(30)
    assert isinstance(out["got"], Exception)  # nobody completed the ids: rank 0 timed out


class _RecordingId:
    """A stand-in UniqueId that records which rank's thread made it (ncclGetUniqueId's
    caller, where NCCL starts the root)."""

    who = threading.local()
    made: dict[bytes, int] = {}

    def __init__(self, data=None):
        if data is None:
            data = os.urandom(128)
            _RecordingId.made[data] = self.who.rank
        self.data = bytes(data)

    @classmethod
    def from_bytes(cls, data):
        return cls(bytes(data))

    def __bytes__(self):
        return self.data


class _Comm:
    def __init__(self, nranks, uid, rank, **kw):
        self.args = (nranks, uid, rank)


@pytest.mark.parametrize("backend", ["tcp", "store"])
def test_from_env_ids_come_from_rank_0_and_the_first_rank_of_root_1(monkeypatch, backend):
    module = types.ModuleType("pynccl.comm")
    module.UniqueId = _RecordingId
    module.Communicator = _Comm
    monkeypatch.setitem(sys.modules, "pynccl.comm", module)
    _RecordingId.made.clear()
    world, port, store = 5, free_port(), DictStore()

    def rank(r):
        _RecordingId.who.rank = r
        environ = {
            "PYNCCL_RENDEZVOUS_KEY": KEY, "MASTER_ADDR": HOST, "MASTER_PORT": str(port)
        }  # fmt: skip
        kw = {"store": store} if backend == "store" else {}
        return from_env(
            rank=r, world_size=world, nids=2, device=0, environ=environ, timeout=OK_TIMEOUT, **kw
        )

    comms = per_rank(rank, range(world))
    ids = [[bytes(u) for u in comms[r].args[1]] for r in range(world)]
    assert all(x == ids[0] for x in ids)
    # NCCL's firstRankFromRoot(1, 5, 2) = 1 * (5 // 2) + min(1, 5 % 2) = 3
    assert [_RecordingId.made[i] for i in ids[0]] == [0, 3]
    assert len(_RecordingId.made) == 2  # nobody else made an id


def test_file_maker_that_fails_to_read_raises_why_at_once_and_removes_its_file(tmp_path):
    # rank 0 was started with world size 3, the maker of part 1 with 2: the maker reads
    # part 0, which names the wrong world size. It must raise that mismatch then, not wait
    # out its timeout for acks that cannot come (and raise a timeout in its place), and it
    # must leave no file of its own behind. (Rank 0 polls once, then sleeps to its deadline.)
    slow = FileRendezvous(tmp_path / "ids", key=KEY, poll_interval=100.0)

    def rank0():
        with pytest.raises(RendezvousTimeoutError):
            slow.share_parts(b"\x10" * 128, rank=0, world_size=3, makers=[0, 1], timeout=6.0)

    r0 = threading.Thread(target=rank0)
    r0.start()
    while not (tmp_path / "ids").exists():
        time.sleep(0.01)
    maker = FileRendezvous(tmp_path / "ids", key=KEY)
    start = time.monotonic()
    mismatch = r"world size 3 but this rank has world size 2"
    with pytest.raises(RendezvousMismatchError, match=mismatch):
        maker.share_parts(b"\x11" * 128, rank=1, world_size=2, makers=[0, 1], timeout=30.0)
    assert time.monotonic() - start < 5.0
    assert not (tmp_path / "ids.part1").exists()
    r0.join()
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == []


def test_tcp_timeout_names_the_maker_whose_id_never_came():
    # ranks 1 and 3 came and proved the key; maker rank 2 never did. Rank 0's error must
    # say that the id of rank 2 is what never came and that ranks 1 and 3 did arrive, not
    # that every rank failed to come ("arrived: none").
    port = free_port()
    t, out = _serve_two_ids(port)
    client = TcpRendezvous(HOST, port, KEY)
    waiting = per_rank(lambda r: client.fetch(rank=r, world_size=4, timeout=6.0), [1, 3])
    t.join(30)
    err = out["got"]
    assert isinstance(err, RendezvousTimeoutError), err
    assert "the id made by rank 2 never came" in str(err), err
    assert "ranks 1, 3 came and waited for it" in str(err), err
    assert all(isinstance(e, RendezvousTimeoutError) for e in waiting.values()), waiting


def test_tcp_wait_payload_names_the_makers_whose_ids_have_not_come():
    from pynccl.bootstrap.tcp import TcpRendezvousServer

    server = TcpRendezvousServer(
        b"z" * 128, host=HOST, port=0, world_size=6, key=KEY, timeout=30.0, makers=[0, 2, 4]
    ).start()
    try:
        with pytest.raises(RendezvousTimeoutError, match=r"the ids made by ranks 2, 4 have not"):
            server.wait_payload(timeout=0.2)
    finally:
        server.close()


@pytest.mark.parametrize("rank", [False, 0.0, True])
def test_share_parts_refuses_a_rank_that_is_no_int_as_share_does(rank):
    # False and 0.0 compare equal to 0: they must not pass for rank 0 (the maker of part 0)
    store = StoreRendezvous(DictStore())
    expected = rf"rank={rank!r} is not an integer in \[0, 2\)"
    with pytest.raises(ValueError, match=expected):
        store.share(b"a" * 128, rank=rank, world_size=2, timeout=0.5)
    with pytest.raises(ValueError, match=expected):
        store.share_parts(b"a" * 128, rank=rank, world_size=2, makers=[0, 1], timeout=0.5)


_FD_BOUND_RANK0 = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from pynccl.bootstrap import TcpRendezvous
port, world = int(sys.argv[1]), int(sys.argv[2])
got = TcpRendezvous("127.0.0.1", port, "fd-key", max_connections=8).share_parts(
    b"a" * 128, rank=0, world_size=world, makers=[0, world - 1], timeout=30.0
)
print("rank 0 served", got[:1].decode(), got[-1:].decode())
"""


@pytest.mark.slow
def test_tcp_ranks_waiting_for_an_id_leave_the_late_maker_a_descriptor():
    # rank 0 may open 48 descriptors; 58 ranks prove the key and wait for the id of rank 59,
    # which comes 1.5 s later. The waiting ranks must not hold every descriptor, so that the
    # maker is still accepted (before, none was: every rank timed out).
    import subprocess

    world, port = 60, free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rank0 = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", _FD_BOUND_RANK0, str(port), str(world)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        rdzv = TcpRendezvous(HOST, port, "fd-key")

        def rank(r):
            if r == world - 1:
                time.sleep(1.5)
            part = b"b" * 128 if r == world - 1 else None
            return rdzv.share_parts(part, rank=r, world_size=world, makers=[0, world - 1],
                                    timeout=30.0)  # fmt: skip

        got = per_rank(rank, range(1, world))
        out, _ = rank0.communicate(timeout=60)
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()
    assert out.strip() == "rank 0 served a b"
    assert got == dict.fromkeys(range(1, world), b"a" * 128 + b"b" * 128)
