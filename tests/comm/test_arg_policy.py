"""One argument policy: the same mistake gets the same exception type and the same
message from every generated method (one matrix of mistakes x every row of the spec
table), and nothing reaches NCCL (the flight record does not grow)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pynccl import DataType, RedOp
from pynccl.comm import Communicator, UniqueId
from pynccl.comm._spec import COLLECTIVES, Where
from pynccl.cuda import DeviceBuffer
from pynccl.groups import group

N = 8
METHODS = [row.method for row in COLLECTIVES]
REDUCING = [row.method for row in COLLECTIVES if row.has_op]


@pytest.fixture(scope="module")
def bufs(lb: Any) -> Iterator[tuple[DeviceBuffer, DeviceBuffer]]:
    a = DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32), device=0)
    b = DeviceBuffer(N, "float32", device=0)
    yield a, b
    a.close()
    b.close()


def _call(comm: Communicator, method: str, bufs: Any, **override: Any) -> None:
    """``method`` called with valid arguments (raw pointers, count, dtype), then
    ``override`` replacing some of them."""
    a, b = bufs
    args: dict[str, Any] = {
        "sendbuf": a.ptr,
        "recvbuf": b.ptr,
        "op": RedOp.SUM,
        "root": 0,
        "peer": 0,
        "count": N,
        "dtype": DataType.FLOAT32,
        "stream": None,
    }
    if method == "recv":
        args["recvbuf"] = a.ptr
    args.update(override)
    params = inspect.signature(getattr(comm, method)).parameters
    if "recvbuf" in params and "sendbuf" not in params and "buf" in override:
        args["recvbuf"] = override["buf"]
    elif "buf" in override:
        args["sendbuf"] = override["buf"]
    getattr(comm, method)(**{k: v for k, v in args.items() if k in params})


def _shape(text: str) -> str:
    """The message with the method-specific names made uniform."""
    text = re.sub(r"\b(send|recv)buf\b", "buf", text)
    return re.sub(r"\b(root|peer)\b", "rank", text)


def _same(text: str) -> str:
    """For comparing across methods: addresses of the valid buffers masked too."""
    return re.sub(r"\(0x[0-9a-f]+\)", "(0x...)", text)


RANKED = [row.method for row in COLLECTIVES if row.where is not Where.NONE]


class BrokenIndex:
    """An integer-like whose ``__index__`` raises (its error is chained, not leaked)."""

    def __index__(self) -> int:
        raise RuntimeError("index is broken")


MISTAKES: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "float count": ({"count": 1.5}, TypeError, "count must be a non-negative int, got float 1.5"),
    "bool count": ({"count": True}, TypeError, "count must be a non-negative int, got bool True"),
    "str count": ({"count": "8"}, TypeError, "count must be a non-negative int, got str '8'"),
    "negative count": ({"count": -1}, ValueError, "count=-1 is out of range"),
    "count of 2**64": ({"count": 1 << 64}, ValueError, "count=18446744073709551616 is out of"),
    "numpy float count": ({"count": np.float64(8)}, TypeError, "got float64"),
    "unknown dtype": ({"dtype": "float33"}, TypeError, "float33"),
    "float rank": ({"root": 0.0, "peer": 0.0}, TypeError, "rank must be an int, got float 0.0"),
    "rank out of range": (
        {"root": 1, "peer": 1},
        ValueError,
        "rank=1 is out of range; expected 0 <= rank < 1 for a communicator of size 1",
    ),
    "rank of 2**32": ({"root": 1 << 32, "peer": 1 << 32}, ValueError, "rank=4294967296 is out"),
    "float buffer": ({"buf": 1.5}, TypeError, "buf"),
    "pointer of 2**64": ({"buf": 1 << 64}, ValueError, "buf=0x10000000000000000 is not a valid"),
    "negative pointer": ({"buf": -16}, ValueError, "is not a valid pointer"),
    "NULL pointer": ({"buf": 0}, ValueError, "buf is a NULL pointer but 32 bytes are needed"),
    "raw pointer, no dtype": ({"dtype": None}, TypeError, "dtype= must be given"),
    "raw pointer, no count": ({"count": None}, TypeError, "count= must be given"),
    "bad stream": ({"stream": "s"}, TypeError, "stream"),
    "float stream": ({"stream": 1.5}, TypeError, "stream must be None, an int"),
    "bool stream": ({"stream": True}, TypeError, "got builtins.bool True"),
    "numpy bool stream": ({"stream": np.True_}, TypeError, "got numpy.bool np.True_"),
    "stream whose __index__ raises": (
        {"stream": BrokenIndex()},
        TypeError,
        "got test_arg_policy.BrokenIndex, whose int() raised RuntimeError: index is broken",
    ),
    "negative stream": ({"stream": -1}, ValueError, "stream handle -1 is out of range"),
    "stream of 2**64": ({"stream": 1 << 64}, ValueError, "stream handle 18446744073709551616"),
    # The stream is checked before everything but config, whichever path the call takes.
    "bad stream and count": ({"stream": -1, "count": 1.5}, ValueError, "stream handle -1"),
    "bad stream and rank": (
        {"stream": -1, "root": 1 << 32, "peer": 1 << 32},
        ValueError,
        "stream handle -1",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_same_mistake_reads_the_same_from_every_method(
    solo: Communicator, bufs: Any, mistake: str
) -> None:
    override, exc, words = MISTAKES[mistake]
    seen: dict[str, tuple[type, str]] = {}
    for method in RANKED if "root" in override else METHODS:
        before = solo.flight_record()[-1:]
        with pytest.raises(Exception) as info:
            _call(solo, method, bufs, **override)
        assert solo.flight_record()[-1:] == before, f"{method}: the bad call was issued"
        seen[method] = (type(info.value), _shape(str(info.value)))
    assert {t for t, _ in seen.values()} == {exc}, seen
    assert len({_same(m) for _, m in seen.values()}) == 1, seen  # one wording, every method
    assert words in next(iter(seen.values()))[1]


OP_MISTAKES: dict[str, tuple[Any, type[Exception], str]] = {
    "float op": (1.0, TypeError, "op must be a pynccl.RedOp"),
    "bool op": (True, TypeError, "got bool True"),
    "numpy float op": (np.float64(3.0), TypeError, "got float64"),
    "unknown name": ("mean", ValueError, "op 'mean' is not a reduction op"),
    "unknown handle": (12345, ValueError, "op 12345 is not a reduction op"),
    "object": (object(), TypeError, "op must be"),
}


@pytest.mark.parametrize("mistake", list(OP_MISTAKES))
@pytest.mark.parametrize("kind", ["raw", "array"])
def test_the_same_bad_op_reads_the_same_from_every_reduction(
    solo: Communicator, bufs: Any, mistake: str, kind: str
) -> None:
    op, exc, words = OP_MISTAKES[mistake]
    texts = set()
    for method in REDUCING:
        with pytest.raises(exc) as info:
            if kind == "raw":
                _call(solo, method, bufs, op=op)
            else:
                getattr(solo, method)(bufs[0], bufs[1], op)
        texts.add(str(info.value))
    assert len(texts) == 1, texts
    assert words in texts.pop()


@pytest.mark.parametrize("method", METHODS)
def test_numpy_integers_are_counts_and_ranks(solo: Communicator, bufs: Any, method: str) -> None:
    numpy_ints = {"count": np.int64(N), "root": np.int32(0), "peer": np.int8(0)}
    if method in ("send", "recv"):  # to self: with its partner, in a group
        with group():
            _call(solo, method, bufs, **numpy_ints)
            _call(solo, "recv" if method == "send" else "send", bufs)
    else:
        _call(solo, method, bufs, **numpy_ints)
    solo.synchronize(timeout=60)
    assert solo.flight_record()[-1][2] in (-1, 0)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"nranks": 1 << 32}, ValueError, "nranks=4294967296 is out of range"),
        ({"nranks": 1.0}, TypeError, "nranks must be an int, got float 1.0"),
        ({"rank": 1 << 32}, ValueError, "rank=4294967296 is out of range"),
        ({"device": 1 << 32}, ValueError, "device=4294967296 is out of range"),
        ({"device": True}, TypeError, "device must be an int, got bool True"),
    ],
)
def test_c_ints_of_the_constructor_are_range_checked(
    lb: Any, kwargs: dict[str, Any], exc: type, words: str
) -> None:
    args: dict[str, Any] = {"nranks": 1, "unique_id": UniqueId(), "rank": 0}
    args.update(kwargs)
    with pytest.raises(exc, match=re.escape(words)):
        Communicator(args.pop("nranks"), args.pop("unique_id"), args.pop("rank"), **args)


def test_split_color_and_key_are_range_checked(solo: Communicator) -> None:
    with pytest.raises(ValueError, match="4294967296"):
        solo.split(1 << 32)
    with pytest.raises(ValueError, match="key=4294967296 is out of range"):
        solo.split(0, key=1 << 32)
    with pytest.raises(TypeError, match="key must be an int, got float"):
        solo.split(0, key=0.5)
