"""Enums, dtype mapping and typed errors (no library needed)."""

from __future__ import annotations

import pickle

import ml_dtypes
import numpy as np
import pytest

import pynccl
from pynccl import DataType, RedOp, Result
from pynccl.dtypes import as_datatype, canonical_name, to_numpy_dtype
from pynccl.errors import (
    CudaError,
    LibraryNotFoundError,
    NcclError,
    NcclInternalError,
    NcclInvalidArgument,
    NcclInvalidUsage,
    NcclRemoteError,
    NcclSystemError,
    NcclTimeoutError,
    NcclUnhandledCudaError,
    NotSupportedError,
)

# nccl.h 2.32.3 values, written out independently of pynccl.enums.
NCCL_H_TYPES = {
    "ncclInt8": 0, "ncclUint8": 1, "ncclInt32": 2, "ncclUint32": 3, "ncclInt64": 4,
    "ncclUint64": 5, "ncclFloat16": 6, "ncclFloat32": 7, "ncclFloat64": 8, "ncclBfloat16": 9,
    "ncclFloat8e4m3": 10, "ncclFloat8e5m2": 11,
}  # fmt: skip
NCCL_H_RESULTS = {
    "ncclSuccess": 0, "ncclUnhandledCudaError": 1, "ncclSystemError": 2, "ncclInternalError": 3,
    "ncclInvalidArgument": 4, "ncclInvalidUsage": 5, "ncclRemoteError": 6, "ncclInProgress": 7,
    "ncclTimeout": 8,
}  # fmt: skip


def test_enum_values_match_nccl_h() -> None:
    assert {dt.c_name: int(dt) for dt in DataType} == NCCL_H_TYPES
    assert {r.c_name: int(r) for r in Result} == NCCL_H_RESULTS
    assert [int(op) for op in (RedOp.SUM, RedOp.PROD, RedOp.MAX, RedOp.MIN, RedOp.AVG)] == [
        0, 1, 2, 3, 4,
    ]  # fmt: skip
    assert RedOp.AVG.c_name == "ncclAvg" and RedOp.SUM.c_name == "ncclSum"


@pytest.mark.parametrize("dt", list(DataType))
def test_itemsize_matches_numpy(dt: DataType) -> None:
    assert dt.itemsize == to_numpy_dtype(dt).itemsize
    assert as_datatype(to_numpy_dtype(dt)) is dt
    assert as_datatype(canonical_name(dt)) is dt
    assert as_datatype(dt.c_name) is dt
    assert as_datatype(int(dt)) is dt


def test_first_releases() -> None:
    assert DataType.BFLOAT16.first_release == (2, 10, 3)
    assert DataType.FLOAT8_E4M3.first_release == (2, 24, 3)
    assert DataType.FLOAT8_E5M2.first_release == (2, 24, 3)
    assert DataType.FLOAT32.first_release <= (2, 18, 1)
    assert RedOp.AVG.first_release == (2, 10, 3)


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (np.float32, DataType.FLOAT32),
        (np.dtype("float16"), DataType.FLOAT16),
        ("<f8", DataType.FLOAT64),
        ("|u1", DataType.UINT8),
        ("i8", DataType.INT64),
        ("float32", DataType.FLOAT32),
        ("torch.float", DataType.FLOAT32),
        ("torch.bfloat16", DataType.BFLOAT16),
        ("torch.long", DataType.INT64),
        ("half", DataType.FLOAT16),
        (ml_dtypes.bfloat16, DataType.BFLOAT16),
        (np.dtype(ml_dtypes.float8_e4m3fn), DataType.FLOAT8_E4M3),
        (np.dtype(ml_dtypes.float8_e5m2), DataType.FLOAT8_E5M2),
        ("float8_e4m3fn", DataType.FLOAT8_E4M3),
        (float, DataType.FLOAT64),
        (int, DataType.INT64),
    ],
)
def test_as_datatype(obj: object, expected: DataType) -> None:
    assert as_datatype(obj) is expected
    assert as_datatype(obj) is expected  # cached path


class FakeTorchDtype:
    """Looks like torch.dtype to the mapper: module 'torch', str 'torch.<name>'."""

    __module__ = "torch"

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


FakeTorchDtype.__module__ = "torch"


def test_torch_like_dtype_without_torch() -> None:
    assert as_datatype(FakeTorchDtype("float16")) is DataType.FLOAT16
    assert as_datatype(FakeTorchDtype("float8_e5m2")) is DataType.FLOAT8_E5M2
    with pytest.raises(TypeError, match=r"torch\.complex64"):
        as_datatype(FakeTorchDtype("complex64"))


@pytest.mark.parametrize(
    "bad",
    [bool, np.bool_, True, np.complex64, "complex128", object, np.int16, "float", "int",
     np.dtype(">f4"), ml_dtypes.float8_e4m3, "nonsense", 99, -1],
)  # fmt: skip
def test_unsupported_types_raise_typeerror_naming_them(bad: object) -> None:
    with pytest.raises(TypeError) as info:
        as_datatype(bad)
    text = str(info.value)
    assert "not supported" in text
    assert "float32" in text  # lists what is supported


def test_bool_does_not_alias_int_cache() -> None:
    assert as_datatype(1) is DataType.UINT8
    with pytest.raises(TypeError):
        as_datatype(True)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (1, NcclUnhandledCudaError),
        (2, NcclSystemError),
        (3, NcclInternalError),
        (4, NcclInvalidArgument),
        (5, NcclInvalidUsage),
        (6, NcclRemoteError),
        (8, NcclTimeoutError),
    ],
)
def test_nccl_error_picks_subclass_and_pickles(code: int, cls: type) -> None:
    err = NcclError(code, "ncclAllReduce", "boom")
    assert type(err) is cls
    assert isinstance(err, RuntimeError) and isinstance(err, NcclError)
    assert err.result == code and isinstance(err.result, Result)
    assert err.function == "ncclAllReduce"
    assert "ncclAllReduce" in str(err) and "boom" in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert (back.result, back.function, back.message) == (err.result, err.function, err.message)


def test_unknown_result_code_is_plain_nccl_error() -> None:
    err = NcclError(42, "ncclFoo")
    assert type(err) is NcclError
    assert err.result == 42 and not isinstance(err.result, Result)
    assert "42" in str(err)
    assert type(pickle.loads(pickle.dumps(err))) is NcclError


def test_other_errors_pickle_and_say_what() -> None:
    nse = NotSupportedError("ncclAlltoAll", (2, 28, 3), (2, 18, 1))
    assert isinstance(nse, NotImplementedError)
    assert "ncclAlltoAll" in str(nse) and "2.28.3" in str(nse) and "2.18.1" in str(nse)
    assert str(pickle.loads(pickle.dumps(nse))) == str(nse)
    cerr = CudaError(35, "cudaMalloc", "cudaErrorInsufficientDriver", "no driver")
    assert "cudaErrorInsufficientDriver" in str(cerr) and "cudaMalloc" in str(cerr)
    assert str(pickle.loads(pickle.dumps(cerr))) == str(cerr)
    lnf = LibraryNotFoundError("libnccl", [("/x/libnccl.so.2", "not found")])
    assert "/x/libnccl.so.2: not found" in str(lnf) and isinstance(lnf, OSError)
    assert str(pickle.loads(pickle.dumps(lnf))) == str(lnf)


def test_public_names_resolve() -> None:
    for name in pynccl.__all__:
        assert getattr(pynccl, name) is not None
