"""Arguments checked exactly, with one rule wherever the same kind of value is taken:

* PreMulSum host scalars: an integer type takes whole numbers in its range, a float type
  finite reals in its range; nothing is converted silently (numpy would round 0.5 to 0,
  read '3' as 3.0, [2] as 2.0, None as NaN and 1e300 as inf). Results against numpy.
* numpy bools are refused wherever ``bool`` is: streams, timeouts, counts, residences.
* A stream whose ``__index__`` raises is a ``TypeError`` naming the stream (the original
  error chained), in every method that takes a stream; timeouts too large for a float are
  out of range (``ValueError``); ``destroy_op`` checks its argument's type.
* ``Config`` and ``CollConfig`` take the same values for the same kinds of field.
* Malformed ``__cuda_array_interface__`` fields are refused by every path of a method.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from pynccl import CollConfig, Config, DataType, ScalarResidence
from pynccl._adapt import as_buffer
from pynccl.comm import Communicator, UniqueId
from pynccl.cuda import DeviceBuffer

N = 8


# -- PreMulSum scalars ---------------------------------------------------------------------------

ACCEPTED = [
    ("int32", 3),
    ("int32", -(2**31)),
    ("int32", np.int64(7)),
    ("int32", 4.0),  # a float holding a whole number is that number
    ("int32", Fraction(6, 2)),
    ("uint8", 255),
    ("int64", 2**63 - 1),
    ("float32", 2.5),
    ("float32", 3),
    ("float32", np.float64(0.25)),
    ("float32", Fraction(1, 4)),
    ("float32", 3.4e38),  # just under float32's largest
    ("float64", 1e300),
    ("float16", 65504.0),
    ("bfloat16", 1.5),
]


@pytest.mark.parametrize(("dtype", "scalar"), ACCEPTED, ids=[f"{d}-{s!r}" for d, s in ACCEPTED])
def test_premul_sum_takes_exact_scalars(solo: Communicator, dtype: str, scalar: Any) -> None:
    from support.reference import np_dtype

    host = np_dtype(DataType[dtype.upper()])
    x = np.array([1, 0, 1, 0], dtype=host)
    op = solo.create_premul_sum(scalar, dtype)
    try:
        with DeviceBuffer.from_numpy(x, device=0) as buf:
            solo.all_reduce(buf, op=op)
            solo.synchronize(timeout=30)
            got = buf.to_numpy()
    finally:
        solo.destroy_op(op)
    # numpy's reference: the exact value in the type, times each element.
    want = np.array([scalar], dtype=object).astype(host) * x
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


REFUSED = [
    ("int32", 0.5, ValueError, "scalar=0.5 is not a whole number; a int32 PreMulSum takes"),
    ("int32", 1.5, ValueError, "is not a whole number"),
    ("int32", math.inf, ValueError, "scalar=inf is not a whole number"),
    ("int32", math.nan, ValueError, "scalar=nan is not a whole number"),
    ("int32", 2**31, ValueError, "scalar=2147483648 is out of range; expected -2147483648 <="),
    ("uint8", -1, ValueError, "scalar=-1 is out of range; expected 0 <= scalar <= 255"),
    ("int64", 2**64, ValueError, "is out of range"),
    ("int32", True, TypeError, "scalar must be a real number for a int32 PreMulSum, got bool"),
    ("float32", True, TypeError, "got bool True"),
    ("float32", np.True_, TypeError, "got bool np.True_"),
    ("float32", None, TypeError, "got NoneType None"),
    ("float32", "3", TypeError, "got str '3'"),
    ("float32", [2], TypeError, "got list [2]"),
    ("float32", np.array([2.0]), TypeError, "got ndarray"),
    ("float32", 2 + 0j, TypeError, "got complex"),
    ("float32", 1e300, ValueError, "scalar=1e+300 is out of range; expected a finite number"),
    ("float32", -1e39, ValueError, "is out of range"),
    ("float32", 10**400, ValueError, "is out of range"),
    ("float32", math.nan, ValueError, "scalar=nan is out of range"),
    ("float32", math.inf, ValueError, "scalar=inf is out of range"),
    ("float16", 70000.0, ValueError, "at most 65504"),
    ("bfloat16", 1e39, ValueError, "is out of range"),
]


@pytest.mark.parametrize(
    ("dtype", "scalar", "exc", "words"), REFUSED, ids=[f"{r[0]}-{r[1]!r}"[:40] for r in REFUSED]
)
def test_premul_sum_refuses_inexact_scalars(
    solo: Communicator, dtype: str, scalar: Any, exc: type, words: str
) -> None:
    with pytest.raises(exc) as info:
        solo.create_premul_sum(scalar, dtype)
    assert words in str(info.value)


def test_premul_sum_residence_is_a_residence(solo: Communicator) -> None:
    for residence in ("host", ScalarResidence.HOST_IMMEDIATE, 1, np.int32(1)):
        solo.destroy_op(solo.create_premul_sum(2.0, "float32", residence=residence))
    with DeviceBuffer.from_numpy(np.array([2.0], np.float32), device=0) as scalar:
        for residence in ("device", ScalarResidence.DEVICE, 0):
            solo.destroy_op(solo.create_premul_sum(scalar, "float32", residence=residence))
    for bad, exc, words in [
        (True, TypeError, "residence must be 'host', 'device' or a pynccl.ScalarResidence, got"),
        (np.True_, TypeError, "got bool np.True_"),
        (1.0, TypeError, "got float 1.0"),
        (2, ValueError, "residence=2 is out of range"),
        ("gpu", ValueError, "residence must be 'host' or 'device', got 'gpu'"),
    ]:  # fmt: skip
        with pytest.raises(exc) as info:
            solo.create_premul_sum(2.0, "float32", residence=bad)
        assert words in str(info.value)


def test_destroy_op_checks_its_argument(solo: Communicator) -> None:
    op = solo.create_premul_sum(2.0, "float32")
    with pytest.raises(TypeError, match=r"op must be an int op from create_premul_sum\(\), got f"):
        solo.destroy_op(float(op))  # equal to the op, but no op
    with pytest.raises(TypeError, match="got bool True"):
        solo.destroy_op(True)  # type: ignore[arg-type]
    solo.destroy_op(np.int64(op))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"op {op} was not created on this communicator"):
        solo.destroy_op(op)


# -- bools, broken integers and huge timeouts --------------------------------------------------


class BrokenIndex:
    """An integer-like whose ``__index__`` raises."""

    def __index__(self) -> int:
        raise RuntimeError("index is broken")

    def __repr__(self) -> str:
        return "BrokenIndex()"


def _stream_takers(comm: Communicator, buf: DeviceBuffer) -> dict[str, Any]:
    """Every way a stream reaches a communicator outside the generated methods (which
    tests/comm/test_arg_policy.py covers)."""
    return {
        "all_gather_v": lambda s: comm.all_gather_v(buf, buf, [N], stream=s),
        "all_to_all_v": lambda s: comm.all_to_all_v(buf, buf, [N], [N], stream=s),
        "reduce_scatter_v": lambda s: comm.reduce_scatter_v(buf, buf, [N], stream=s),
        "barrier": lambda s: comm.barrier(stream=s),
        "synchronize": lambda s: comm.synchronize(s),
        "persistent op(stream=)": lambda s: comm.all_reduce_init(buf)(stream=s),
        "comm.stream =": lambda s: setattr(comm, "stream", s),
        "Communicator(stream=)": lambda s: Communicator(1, UniqueId(), 0, device=0, stream=s),
    }


@pytest.mark.parametrize(
    "stream", [np.True_, np.False_, BrokenIndex()], ids=["np.True_", "np.False_", "broken"]
)
def test_bad_streams_read_the_same_everywhere(solo: Communicator, stream: Any) -> None:
    with DeviceBuffer.from_numpy(np.arange(N, dtype=np.float32), device=0) as buf:
        texts = set()
        for name, call in _stream_takers(solo, buf).items():
            before = solo.flight_record()[-1:]
            with pytest.raises(TypeError) as info:
                call(stream)
            assert solo.flight_record()[-1:] == before, f"{name}: issued"
            if isinstance(stream, BrokenIndex):
                assert isinstance(info.value.__cause__, RuntimeError), name
            texts.add(str(info.value))
        assert solo.stream == 0
    assert len(texts) == 1, texts
    assert texts.pop().startswith("stream must be None, an int cudaStream_t handle")


@pytest.mark.parametrize(
    ("timeout", "exc", "words"),
    [
        (np.True_, TypeError, "timeout must be a number of seconds or None, got bool np.True_"),
        (2**1024, ValueError, "is out of range; expected a finite number > 0"),
        (Fraction(2**1100), ValueError, "is out of range"),
    ],
    ids=["np.True_", "2**1024", "Fraction(2**1100)"],
)
def test_timeouts_are_numbers_of_seconds(
    solo: Communicator, timeout: Any, exc: type, words: str
) -> None:
    calls = {
        "synchronize": lambda: solo.synchronize(timeout=timeout),
        "wait_ready": lambda: solo.wait_ready(timeout),
        "watchdog_timeout=": lambda: Communicator(
            1, UniqueId(), 0, device=0, watchdog_timeout=timeout
        ),
    }
    for name, call in calls.items():
        with pytest.raises(exc) as info:
            call()
        assert words in str(info.value), name


def test_numpy_bools_are_no_counts_or_ranks(solo: Communicator) -> None:
    with DeviceBuffer(N, "float32", device=0) as buf:
        with pytest.raises(TypeError, match=r"non-negative int, got bool np\.True_"):
            solo.all_reduce(buf, count=np.True_)
        with pytest.raises(TypeError, match=r"root must be an int, got bool np\.False_"):
            solo.broadcast(buf, root=np.False_)


# -- Config and CollConfig: one rule -----------------------------------------------------------


class IndexOnly:
    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"IndexOnly({self.value})"


INT_VALUES = [4, np.int64(4), np.uint8(4), IndexOnly(4), True, np.True_, 4.0, np.float32(4), "4",
              BrokenIndex(), 2**31, -1]  # fmt: skip
BOOL_VALUES = [True, np.True_, False, 1, np.int64(1), 1.0, "yes"]


def _outcome(make: Any) -> tuple[str, Any]:
    try:
        return "ok", make()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, None


@pytest.mark.parametrize("value", INT_VALUES, ids=[repr(v) for v in INT_VALUES])
def test_config_int_fields_take_what_collconfig_takes(value: Any) -> None:
    fields = ("max_ctas", "min_ctas", "nvls_ctas", "cga_cluster_size", "cta_policy")
    for field in fields:
        kw = {field: value}
        coll = _outcome(lambda: CollConfig(**kw).c_fields())  # noqa: B023  # called at once
        comm = _outcome(lambda: Config(**kw).c_fields())  # noqa: B023
        c_name = Config.C_NAMES[field]
        if value == -1 and type(value) is int:  # CollConfig's range starts at 0; Config's C int
            assert coll[0] == "ValueError" and comm == ("ok", {c_name: -1})
            continue
        assert coll[0] == comm[0], (field, coll, comm)
        if comm[0] == "ok":
            assert comm[1] == {c_name: 4} and coll[1] == {c_name: 4}
            assert type(getattr(Config(**{field: value}), field)) is int


@pytest.mark.parametrize("value", BOOL_VALUES, ids=[repr(v) for v in BOOL_VALUES])
def test_config_bool_fields_take_what_collconfig_takes(value: Any) -> None:
    coll = _outcome(lambda: CollConfig(force_alg_selection=value).c_fields())
    for field in ("blocking", "split_share", "collnet_enable", "shrink_share"):
        kw = {field: value}
        comm = _outcome(lambda: Config(**kw).c_fields())  # noqa: B023  # called at once
        assert coll[0] == comm[0], (field, coll, comm)
        if comm[0] == "ok":
            assert comm[1] == {Config.C_NAMES[field]: int(bool(value))}
            assert type(getattr(Config(**{field: value}), field)) is bool
    if coll[0] != "ok":
        with pytest.raises(TypeError, match="blocking must be a bool, got"):
            Config(blocking=value)


def test_config_is_checked_when_used_too() -> None:
    cfg = Config(max_ctas=4)
    cfg.max_ctas = 2.0  # type: ignore[assignment]  # mutable: checked again when used
    with pytest.raises(TypeError, match=r"max_ctas must be an int, got float 2\.0"):
        cfg.to_struct()
    with pytest.raises(TypeError, match=r"comm_name \(ncclConfig_t.commName\) must be a str"):
        Config(comm_name=b"job")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not contain NUL"):
        Config(net_name="So\0cket")


# -- __cuda_array_interface__ fields, on every path of a method ----------------------------------


class Interface:
    def __init__(self, buf: DeviceBuffer, **change: Any) -> None:
        self.cai = {"shape": (N,), "typestr": "<f4", "data": (buf.ptr, False), "version": 3}
        self.cai.update(change)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return dict(self.cai)


BAD_FIELDS = [
    {"version": -1},
    {"version": "3"},
    {"version": 3.0},
    {"version": True},
    {"version": None},
    {"typestr": "f4"},
    {"stream": 0},
    {"stream": np.int64(5)},
    {"stream": False},
]


@pytest.mark.parametrize("change", BAD_FIELDS, ids=[repr(c) for c in BAD_FIELDS])
def test_malformed_interfaces_are_refused_by_every_path(
    solo: Communicator, change: dict[str, Any]
) -> None:
    with DeviceBuffer(N, "float32", device=0) as buf:
        with pytest.raises((TypeError, ValueError)) as cold:
            as_buffer(Interface(buf, **change))
        cls = type("Fresh", (Interface,), {})  # a type no call has seen
        before = solo.flight_record()[-1:]
        for path in ("first call", "inline", "slow path (count=)", "persistent"):
            with pytest.raises(type(cold.value)) as info:
                if path == "slow path (count=)":
                    solo.all_reduce(cls(buf, **change), count=N)
                elif path == "persistent":
                    solo.all_reduce_init(cls(buf, **change))
                else:
                    solo.all_reduce(cls(buf, **change))
            assert str(info.value) == str(cold.value), path
        assert solo.flight_record()[-1:] == before
        solo.all_reduce(Interface(buf))  # the well-formed one is taken
        solo.synchronize(timeout=30)
