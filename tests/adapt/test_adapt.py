"""pynccl._adapt: buffers and streams in every accepted form, and every refusal.

The producers (tests/support/producers.py) expose numpy arrays' host memory through
``__cuda_array_interface__`` or a ctypes-built DLPack capsule; expectations
come from numpy (address, size, strides, contiguity), never from pynccl.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from ctypes import addressof, c_int, create_string_buffer
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ROOT
from support import producers as P
from support.producers import addr
from support.reference import ML_TYPES, NUMPY_TYPES

from pynccl import DataType
from pynccl._adapt import as_buffer, as_stream, check_device, is_complex

# --- raw pointers -------------------------------------------------------------------------


def test_raw_pointer() -> None:
    assert as_buffer(0x7F00_0000_1000, 10, "float32") == (
        0x7F00_0000_1000,
        10,
        DataType.FLOAT32,
        None,
    )
    assert as_buffer(0x1000, np.int64(3), np.dtype("float16")) == (
        0x1000,
        3,
        DataType.FLOAT16,
        None,
    )
    # A NULL pointer is fine for zero elements (NCCL never dereferences it).
    assert as_buffer(0, 0, DataType.INT8) == (0, 0, DataType.INT8, None)


@pytest.mark.parametrize(
    ("count", "dtype", "missing"),
    [(None, "float32", "count="), (4, None, "dtype="), (None, None, "count= and dtype=")],
)
def test_raw_pointer_needs_count_and_dtype(count: Any, dtype: Any, missing: str) -> None:
    with pytest.raises(TypeError, match=rf"recvbuf is a raw pointer \(0x1000\).*{missing}"):
        as_buffer(0x1000, count, dtype, name="recvbuf")


def test_raw_pointer_refusals() -> None:
    with pytest.raises(ValueError, match=r"^sendbuf is a NULL pointer but 16 bytes are needed"):
        as_buffer(0, 4, "float32")
    with pytest.raises(ValueError, match=r"^recvbuf=-0x8 is not a valid pointer"):
        as_buffer(-8, 4, "float32", name="recvbuf")
    with pytest.raises(ValueError, match=r"is not a valid pointer"):
        as_buffer(1 << 64, 4, "float32")
    with pytest.raises(ValueError, match=r"^count=-1 is out of range; expected 0 <= count < 2"):
        as_buffer(0x1000, -1, "float32")
    # ctypes would wrap a size_t of 2**64 and up into a small count: both paths refuse it.
    for dtype in ("float32", DataType.FLOAT32):
        with pytest.raises(ValueError, match=r"^count=18446744073709551621 is out of range"):
            as_buffer(0x1000, (1 << 64) + 5, dtype)
    with pytest.raises(TypeError, match=r"^count must be a non-negative int, got float 2.0"):
        as_buffer(0x1000, 2.0, "float32")
    with pytest.raises(TypeError, match=r"^count must be a non-negative int, got bool True"):
        as_buffer(0x1000, True, "float32")
    with pytest.raises(TypeError, match=r"dtype for sendbuf: data type 'int16' is not supported"):
        as_buffer(0x1000, 4, "int16")


def test_bool_is_not_a_pointer() -> None:
    with pytest.raises(TypeError, match=r"recvbuf must be an int device pointer.*bool"):
        as_buffer(True, 1, "float32", name="recvbuf")


def test_int_subclass_is_a_pointer() -> None:
    class Address(int):
        pass

    ptr, n, dt, dev = as_buffer(Address(0x2000), 2, "uint8")
    assert (ptr, n, dt, dev) == (0x2000, 2, DataType.UINT8, None)
    assert type(ptr) is int


# --- __cuda_array_interface__ ----------------------------------------------------------------


@pytest.mark.parametrize("producer", [P.CAIArray, P.CAIProperty])
@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize(("np_type", "expected"), NUMPY_TYPES)
def test_cai_types(producer: Any, version: int, np_type: Any, expected: DataType) -> None:
    a = np.zeros((3, 5), dtype=np_type)
    assert as_buffer(producer(a, version=version)) == (addr(a), a.size, expected, None)


def test_cai_shapes() -> None:
    a = np.zeros(7, np.float32)
    assert as_buffer(P.CAIArray(a))[1] == 7
    s = np.zeros((), np.float32)  # 0-d: one element
    assert as_buffer(P.CAIArray(s))[:2] == (addr(s), 1)
    e = np.zeros((4, 0, 3), np.float32)
    assert as_buffer(P.CAIArray(e, strides="always"))[1] == 0


def test_cai_empty_with_null_pointer() -> None:
    cai = P.CAIArray(np.zeros(0, np.float32))
    cai.__cuda_array_interface__["data"] = (0, False)
    assert as_buffer(cai) == (0, 0, DataType.FLOAT32, None)


def test_cai_null_pointer_with_elements() -> None:
    cai = P.CAIArray(np.zeros(3, np.float32))
    cai.__cuda_array_interface__["data"] = (0, False)
    with pytest.raises(
        ValueError, match=r"^recvbuf's data pointer is a NULL pointer but 12 bytes are needed"
    ):
        as_buffer(cai, name="recvbuf")


def test_cai_explicit_c_strides_accepted() -> None:
    a = np.zeros((2, 3, 4), np.int32)
    assert as_buffer(P.CAIArray(a, strides="always")) == (addr(a), 24, DataType.INT32, None)


def test_cai_strided_refused() -> None:
    a = np.zeros((4, 6), np.float32)[:, ::2]
    with pytest.raises(ValueError) as info:
        as_buffer(P.CAIArray(a), name="recvbuf")
    text = str(info.value)
    assert "recvbuf is a strided/non-contiguous view" in text
    assert "shape=(4, 3)" in text and "strides=(24, 8)" in text
    assert "make it contiguous" in text


def test_cai_transposed_refused() -> None:
    a = np.zeros((3, 4), np.float64).T
    with pytest.raises(ValueError, match=r"shape=\(4, 3\), strides=\(8, 32\)"):
        as_buffer(P.CAIArray(a))


def test_cai_masked_refused() -> None:
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"sendbuf is a masked array"):
        as_buffer(P.CAIArray(a, mask=(0x1234, False)))
    assert as_buffer(P.CAIArray(a, mask=None))[1] == 4


def test_cai_readonly() -> None:
    a = np.zeros(4, np.float32)
    ro = P.CAIArray(a, readonly=True)
    assert as_buffer(ro, name="sendbuf") == (addr(a), 4, DataType.FLOAT32, None)
    with pytest.raises(ValueError, match=r"recvbuf is read-only .*data=\(0x[0-9a-f]+, True\)"):
        as_buffer(ro, name="recvbuf", writable=True)


@pytest.mark.parametrize(("ml_type", "expected"), ML_TYPES)
def test_cai_void_typestr_uses_dtype(ml_type: Any, expected: DataType) -> None:
    a = np.zeros(6, dtype=ml_type)
    # numpy has no typestr for these ('<V2', '<V1', '<f1'): the premise of the test
    assert a.dtype.str[1] == "V" or a.dtype.str[1:] == "f1"
    assert as_buffer(P.CAIWithDType(a, a.dtype)) == (addr(a), 6, expected, None)
    # Our own DeviceBuffer's style: .dtype is a DataType, typestr '|V1' / '<V2'.
    cai = P.CAIWithDType(a, expected)
    cai.__cuda_array_interface__["typestr"] = f"{'<' if a.itemsize > 1 else '|'}V{a.itemsize}"
    assert as_buffer(cai) == (addr(a), 6, expected, None)


def test_cai_void_typestr_without_usable_dtype() -> None:
    a = np.zeros(6, dtype=ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=r"sendbuf has typestr '<V2', .*no \.dtype"):
        as_buffer(P.CAIArray(a))
    with pytest.raises(TypeError, match=r"\.dtype='complex64'"):
        as_buffer(P.CAIWithDType(a, "complex64"))


def test_cai_void_typestr_size_mismatch() -> None:
    a = np.zeros(6, dtype=ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=r"typestr '<V2' but \.dtype=.*float32.*4 bytes"):
        as_buffer(P.CAIWithDType(a, "float32"))


@pytest.mark.parametrize("np_type", [np.int16, np.bool_, np.float128])
def test_cai_unsupported_types(np_type: Any) -> None:
    a = np.zeros(3, dtype=np_type)
    with pytest.raises(TypeError, match=rf"recvbuf: data type '{a.dtype.str}' is not supported"):
        as_buffer(P.CAIArray(a), name="recvbuf")


def test_cai_big_endian_refused() -> None:
    a = np.zeros(3, dtype=">f4")
    with pytest.raises(TypeError, match=r"big-endian"):
        as_buffer(P.CAIArray(a))


def test_cai_malformed() -> None:
    bad = P.CAIArray(np.zeros(3, np.float32))
    del bad.__cuda_array_interface__["data"]
    with pytest.raises(TypeError, match=r"sendbuf has a malformed __cuda_array_interface__"):
        as_buffer(bad)
    bad = P.CAIArray(np.zeros(3, np.float32))
    bad.__cuda_array_interface__["shape"] = (3, -2)
    with pytest.raises(TypeError, match=r"shape \(3, -2\) is not a tuple of ints >= 0"):
        as_buffer(bad)


def test_cai_count_and_dtype() -> None:
    a = np.zeros((2, 5), np.float32)
    cai = P.CAIArray(a)
    assert as_buffer(cai, 4) == (addr(a), 4, DataType.FLOAT32, None)
    assert as_buffer(cai, 10, np.float32) == (addr(a), 10, DataType.FLOAT32, None)
    assert as_buffer(cai, 0) == (addr(a), 0, DataType.FLOAT32, None)
    with pytest.raises(ValueError, match=r"count=11 is larger than recvbuf, which holds only 10"):
        as_buffer(cai, 11, name="recvbuf")
    with pytest.raises(
        TypeError, match=r"dtype=int32 does not match recvbuf, whose data type is float32"
    ):
        as_buffer(cai, None, "int32", name="recvbuf")


def test_cai_device_from_dlpack_device() -> None:
    a = np.zeros(2, np.float32)
    assert as_buffer(P.CAIWithDLPackDevice(a, (P.kDLCUDA, 3)))[3] == 3
    # Managed memory's device_id is always 0 (dlpack.h): it says nothing.
    assert as_buffer(P.CAIWithDLPackDevice(a, (P.kDLCUDAManaged, 0)))[3] is None


def test_cai_device_from_device_attribute() -> None:
    a = np.zeros(2, np.float32)
    assert as_buffer(P.TorchLikeCAI(a, "cuda", 1))[3] == 1
    assert as_buffer(P.TorchLikeCAI(a, "cuda", None))[3] is None
    assert as_buffer(P.CupyLikeCAI(a, 2))[3] == 2


def test_torch_bf16_like_falls_back_to_dlpack() -> None:
    # torch's __cuda_array_interface__ raises KeyError for bfloat16; its DLPack works.
    a = np.zeros(5, ml_dtypes.bfloat16)
    assert as_buffer(P.TorchBF16Like(a)) == (addr(a), 5, DataType.BFLOAT16, 0)


def test_cai_property_error_is_the_producers() -> None:
    class NoDLPack:
        @property
        def __cuda_array_interface__(self) -> Any:
            raise AttributeError("Can't get __cuda_array_interface__ on a CPU tensor")

    with pytest.raises(AttributeError, match="on a CPU tensor"):
        as_buffer(NoDLPack())


def test_torch_cpu_like_falls_back_to_dlpack() -> None:
    a = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match=r"recvbuf is a CPU array \(kDLCPU\); NCCL needs device"):
        as_buffer(P.TorchCPULike(a), name="recvbuf")


def test_cai_handler_is_cached_per_type() -> None:
    import pynccl._adapt as adapt

    class Fresh(P.CAIArray):
        pass

    a, b = np.zeros(2, np.float32), np.zeros(5, np.int8)
    assert Fresh not in adapt._BUFFER_HANDLERS
    as_buffer(Fresh(a))
    handler = adapt._BUFFER_HANDLERS[Fresh]
    assert as_buffer(Fresh(b)) == (addr(b), 5, DataType.INT8, None)
    assert adapt._BUFFER_HANDLERS[Fresh] is handler


# Contiguity against numpy's own verdict, over random views.
@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    data=st.data(),
)
def test_cai_contiguity_matches_numpy(shape: list[int], data: Any) -> None:
    base = np.zeros(shape, np.float32)
    index = tuple(
        slice(data.draw(st.integers(0, n - 1)), None, data.draw(st.sampled_from([1, 1, 2, -1])))
        for n in shape
    )
    view = base[index]
    if data.draw(st.booleans()):
        view = view.T
    cai = P.CAIArray(view, strides="always")
    if view.flags.c_contiguous:
        assert as_buffer(cai) == (addr(view), view.size, DataType.FLOAT32, None)
    else:
        with pytest.raises(ValueError, match="strided/non-contiguous"):
            as_buffer(cai)


# --- DLPack ---------------------------------------------------------------------------------


@pytest.mark.parametrize("versioned", [False, True])
@pytest.mark.parametrize(("np_type", "expected"), NUMPY_TYPES + ML_TYPES)
def test_dlpack_types(versioned: bool, np_type: Any, expected: DataType) -> None:
    a = np.zeros((2, 3), dtype=np_type)
    p = P.DLPackProducer(a, versioned=versioned, device=(P.kDLCUDA, 1))
    assert as_buffer(p) == (addr(a), 6, expected, 1)


def test_dlpack_capsule_is_released() -> None:
    a = np.zeros(4, np.float32)
    for versioned in (False, True):
        p = P.DLPackProducer(a, versioned=versioned)
        for i in range(3):
            as_buffer(p)
            assert p.deleted == i + 1  # released at once, by the capsule's own destructor
            assert p.exported == 0


def test_dlpack_capsule_is_released_on_error() -> None:
    p = P.DLPackProducer(np.zeros((4, 4), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="strided"):
        as_buffer(p)
    gc.collect()
    assert (p.deleted, p.exported) == (1, 0)


def test_dlpack_versioned_request() -> None:
    a = np.zeros(4, np.float32)
    p = P.DLPackProducer(a)
    as_buffer(p, stream=0x5000)
    assert p.calls == [{"stream": 0x5000, "max_version": (1, 1)}]


def test_dlpack_stream_mapping() -> None:
    p = P.DLPackProducer(np.zeros(4, np.float32))
    as_buffer(p)  # no stream: the producer assumes the legacy default stream
    as_buffer(p, stream=0)  # CUDA's 0 is DLPack's 1 (0 is forbidden by the spec)
    as_buffer(p, stream=2)  # per-thread default stream passes through
    assert [c["stream"] for c in p.calls] == [None, 1, 2]


@pytest.mark.parametrize("producer", [P.StreamOnlyDLPack, P.BareDLPack])
def test_dlpack_older_producers(producer: Any) -> None:
    a = np.zeros((3, 3), np.int64)
    p = producer(a)
    for _ in range(2):  # second call: the learnt calling style
        assert as_buffer(p, stream=7) == (addr(a), 9, DataType.INT64, 0)
    expected = [{"stream": 7}] * 2 if producer is P.StreamOnlyDLPack else [{}] * 2
    assert p.calls == expected
    gc.collect()
    assert (p.deleted, p.exported) == (2, 0)


def test_dlpack_byte_offset() -> None:
    a = np.zeros(8, np.float32)
    p = P.DLPackProducer(a, byte_offset=64)
    assert as_buffer(p)[0] == addr(a)  # data + byte_offset is the array's start


def test_dlpack_managed_memory_has_no_device() -> None:
    p = P.DLPackProducer(np.zeros(2, np.float32), device=(P.kDLCUDAManaged, 0))
    assert as_buffer(p)[3] is None


@pytest.mark.parametrize(
    ("device", "words"),
    [
        ((P.kDLCPU, 0), r"a CPU array \(kDLCPU\); NCCL needs device memory"),
        ((P.kDLCUDAHost, 0), r"in pinned host memory \(kDLCUDAHost\)"),
        ((10, 0), r"a ROCm array \(kDLROCM\)"),
        ((99, 0), r"on DLPack device type 99"),
    ],
)
def test_dlpack_non_cuda_devices_refused(device: tuple[int, int], words: str) -> None:
    p = P.DLPackProducer(np.zeros(2, np.float32), device=device)
    with pytest.raises(ValueError, match=rf"recvbuf is {words}"):
        as_buffer(p, name="recvbuf")
    assert p.calls == []  # refused before any export


def test_numpy_array_refused() -> None:
    with pytest.raises(ValueError, match=r"sendbuf is a CPU array \(kDLCPU\).*DeviceBuffer"):
        as_buffer(np.zeros(3, np.float32))


def test_dlpack_strided_refused() -> None:
    a = np.zeros((4, 6), np.float32)[::2]
    with pytest.raises(ValueError) as info:
        as_buffer(P.DLPackProducer(a))
    assert "shape=(2, 6), strides=(12, 1) in elements" in str(info.value)


def test_dlpack_explicit_c_strides_accepted() -> None:
    a = np.zeros((2, 1, 3), np.float32)
    p = P.DLPackProducer(a, strides=(3, 99, 1))  # extent-1 dims may carry any stride
    assert as_buffer(p) == (addr(a), 6, DataType.FLOAT32, 0)


@pytest.mark.parametrize(
    ("dl_dtype", "words"),
    [
        ((P.kDLFloat, 32, 4), r"a vector type \(4 lanes\)"),
        ((P.kDLInt, 16, 1), r"int of 16 bits, which NCCL does not support"),
        ((P.kDLBool, 8, 1), r"bool of 8 bits"),
        ((P.kDLComplex, 16, 1), r"complex of 16 bits"),
        ((P.kDLComplex, 64, 2), r"a vector type \(2 lanes\)"),
        ((P.kDLFloat8_e4m3, 8, 1), r"IEEE-style; NCCL's FP8 is float8_e4m3fn"),
        ((P.kDLBfloat, 32, 1), r"bfloat of 32 bits"),
        ((200, 8, 1), r"type code 200"),
    ],
)
def test_dlpack_unsupported_dtypes(dl_dtype: tuple[int, int, int], words: str) -> None:
    p = P.DLPackProducer(np.zeros(4, np.float32), dl_dtype=dl_dtype)
    code, bits, lanes = dl_dtype
    with pytest.raises(TypeError) as info:
        as_buffer(p, name="recvbuf")
    text = str(info.value)
    del info  # its traceback holds the frame that held the capsule
    assert f"recvbuf has DLPack dtype (code={code}, bits={bits}, lanes={lanes})" in text
    assert re.search(words, text)
    gc.collect()
    assert p.deleted == 1


def test_dlpack_readonly_flag() -> None:
    a = np.zeros(4, np.float32)
    p = P.DLPackProducer(a, flags=P.FLAG_READ_ONLY)
    assert as_buffer(p, name="sendbuf")[0] == addr(a)
    with pytest.raises(ValueError, match=r"recvbuf is read-only \(DLPack read-only flag\)"):
        as_buffer(p, name="recvbuf", writable=True)


def test_dlpack_copy_refused() -> None:
    p = P.DLPackProducer(np.zeros(4, np.float32), flags=P.FLAG_IS_COPIED)
    with pytest.raises(ValueError, match=r"sendbuf: the DLPack producer exported a copy"):
        as_buffer(p)


def test_dlpack_future_major_version_refused() -> None:
    p = P.DLPackProducer(np.zeros(4, np.float32), version=(2, 0))
    with pytest.raises(ValueError, match=r"exported as DLPack 2.0; pynccl reads DLPack 1.x"):
        as_buffer(p)
    gc.collect()
    assert p.deleted == 1  # the deleter sits before the version-dependent fields


def test_dlpack_consumed_capsule_refused() -> None:
    p = P.DLPackProducer(np.zeros(4, np.float32), capsule_name=P.NAME_USED)
    with pytest.raises(ValueError, match=r"capsule named b'used_dltensor'"):
        as_buffer(p)


def test_dlpack_null_data() -> None:
    p = P.DLPackProducer(np.zeros(0, np.float32), null_data=True)
    assert as_buffer(p) == (0, 0, DataType.FLOAT32, 0)
    p = P.DLPackProducer(np.zeros(3, np.float32), null_data=True)
    with pytest.raises(ValueError, match=r"DLPack data pointer is NULL for 3 elements"):
        as_buffer(p)


def test_dlpack_count_and_dtype() -> None:
    a = np.zeros(10, ml_dtypes.bfloat16)
    p = P.DLPackProducer(a)
    assert as_buffer(p, 3, "bfloat16") == (addr(a), 3, DataType.BFLOAT16, 0)
    with pytest.raises(ValueError, match=r"count=11 is larger than sendbuf, which holds only 10"):
        as_buffer(p, 11)
    with pytest.raises(TypeError, match=r"dtype=float16 does not match sendbuf.* bfloat16"):
        as_buffer(p, None, np.float16)


def test_dlpack_returns_non_capsule() -> None:
    class Liar:
        def __dlpack_device__(self) -> tuple[int, int]:
            return (P.kDLCUDA, 0)

        def __dlpack__(self, **kw: Any) -> Any:
            return b"not a capsule"

    with pytest.raises(TypeError, match=r"sendbuf.__dlpack__\(\) returned bytes"):
        as_buffer(Liar())


@settings(max_examples=100, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_dlpack_contiguity_matches_numpy(shape: list[int], data: Any) -> None:
    base = np.zeros(shape, np.int32)
    index = tuple(
        slice(data.draw(st.integers(0, n - 1)), None, data.draw(st.sampled_from([1, 2])))
        for n in shape
    )
    view = base[index]
    p = P.DLPackProducer(view, strides="always")
    if view.flags.c_contiguous:
        assert as_buffer(p) == (addr(view), view.size, DataType.INT32, 0)
    else:
        with pytest.raises(ValueError, match="strided/non-contiguous"):
            as_buffer(p)


# --- other objects ------------------------------------------------------------------------------


@pytest.mark.parametrize("obj", [None, "0x1000", 1.5, [1, 2], b"abc", object()])
def test_not_a_buffer(obj: Any) -> None:
    with pytest.raises(TypeError) as info:
        as_buffer(obj, 4, "float32", name="recvbuf")
    text = str(info.value)
    assert text.startswith("recvbuf must be an int device pointer")
    assert "__cuda_array_interface__" in text and "DLPack" in text
    assert type(obj).__qualname__ in text


def test_host_memory_hint() -> None:
    class HostArray:
        __array_interface__ = {"shape": (3,), "typestr": "<f4", "data": (0x1000, False)}

    with pytest.raises(TypeError, match=r"this looks like host memory"):
        as_buffer(HostArray())
    with pytest.raises(TypeError, match=r"this looks like host memory"):
        as_buffer(bytearray(8))


# --- check_device -------------------------------------------------------------------------------


def test_check_device() -> None:
    check_device(None, 0, "recvbuf")
    check_device(1, None, "recvbuf")
    check_device(2, 2, "recvbuf")
    with pytest.raises(
        ValueError, match=r"^`?recvbuf`? is on device 1 but the communicator is on device 0$"
    ):
        check_device(1, 0, "recvbuf")


# --- pynccl.cuda.DeviceBuffer -------------------------------------------------------------------


class _FakeRuntime:
    """The few cudart calls DeviceBuffer makes, over host memory (no GPU here)."""

    def __init__(self) -> None:
        self.device = 0
        self.blocks: dict[int, Any] = {}

    def cudaGetDevice(self, out: Any) -> None:
        out._obj.value = self.device

    def cudaSetDevice(self, device: int) -> None:
        self.device = device

    def cudaMalloc(self, out: Any, nbytes: int) -> None:
        block = create_string_buffer(nbytes)
        self.blocks[addressof(block)] = block
        out._obj.value = addressof(block)

    def cudaFree(self, ptr: int) -> None:
        del self.blocks[ptr]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    from pynccl import cuda
    from pynccl.cuda import _runtime

    rt = _FakeRuntime()
    monkeypatch.setattr(_runtime, "_rt", lambda: rt)
    yield cuda, rt
    assert rt.blocks == {}  # every buffer made in the test was freed


@pytest.mark.parametrize(
    ("dtype", "expected"), [("float32", DataType.FLOAT32), ("bfloat16", DataType.BFLOAT16)]
)
def test_device_buffer(fake_cuda: Any, dtype: str, expected: DataType) -> None:
    cuda, rt = fake_cuda
    import pynccl._adapt as adapt

    with cuda.DeviceBuffer((3, 4), dtype, device=1) as buf:
        assert rt.device == 0  # restored after allocating on device 1
        ptr = next(iter(rt.blocks))
        assert as_buffer(buf, name="recvbuf", writable=True) == (ptr, 12, expected, 1)
        assert adapt._BUFFER_HANDLERS[cuda.DeviceBuffer] is adapt._from_device_buffer
        # The property-based fallback (used should DeviceBuffer's slots change) agrees.
        public = adapt._from_device_buffer_public(buf, None, None, "recvbuf", True, None)
        assert public == (ptr, 12, expected, 1)
        assert as_buffer(buf, 5, dtype) == (ptr, 5, expected, 1)
        with pytest.raises(ValueError, match=r"count=13 is larger than sendbuf.*only 12"):
            as_buffer(buf, 13)
        with pytest.raises(TypeError, match=r"does not match sendbuf"):
            as_buffer(buf, None, "int8")
    with pytest.raises(ValueError, match=r"recvbuf is a DeviceBuffer that has been freed"):
        as_buffer(buf, name="recvbuf")
    with pytest.raises(ValueError, match=r"recvbuf is a DeviceBuffer that has been freed"):
        adapt._from_device_buffer_public(buf, None, None, "recvbuf", True, None)


def test_device_buffer_through_its_cai(fake_cuda: Any) -> None:
    # A subclass misses the fast path and goes through __cuda_array_interface__ and
    # .dtype (typestr '<V2' for bfloat16): the result must be the same.
    cuda, rt = fake_cuda

    class Sub(cuda.DeviceBuffer):  # type: ignore[misc,name-defined]
        __slots__ = ()

    with Sub(7, "bfloat16") as buf:
        ptr = next(iter(rt.blocks))
        assert as_buffer(buf) == (ptr, 7, DataType.BFLOAT16, 0)


LOOPBACK_SCRIPT = """
import json
from pynccl import cuda
from pynccl._adapt import as_buffer
with cuda.DeviceBuffer(16, "float16", device=1) as buf:
    ptr, n, dt, dev = as_buffer(buf, name="recvbuf", writable=True)
    print(json.dumps([ptr, buf.ptr, n, dt.name, dev, cuda.get_device()]))
"""


def test_device_buffer_on_loopback_cudart() -> None:
    # A real DeviceBuffer over the loopback libcudart, in a child: loading a libcudart
    # is for the whole process.
    loopback = pytest.importorskip("pynccl.testing.loopback")
    try:
        cudart = loopback.build_cudart()
    except loopback.LoopbackBuildError as exc:
        pytest.skip(f"loopback libcudart cannot be built here: {exc}")
    env = {**os.environ, "PYNCCL_CUDART_LIBRARY": cudart, "PYNCCL_LOOPBACK_DEVICES": "2"}
    root = str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", LOOPBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    ptr, buf_ptr, n, dt, dev, current = json.loads(out.stdout)
    assert ptr == buf_ptr != 0
    assert (n, dt, dev, current) == (16, "FLOAT16", 1, 0)


# --- streams -------------------------------------------------------------------------------


def test_stream_none_and_ints() -> None:
    assert as_stream(None) == 0
    assert as_stream(0) == 0
    assert as_stream(0x7F12_3456_0000) == 0x7F12_3456_0000
    assert as_stream(np.uint64(2)) == 2
    with pytest.raises(ValueError, match=r"stream handle -1 is out of range"):
        as_stream(-1)
    with pytest.raises(ValueError, match=r"stream handle 18446744073709551616 is out of range"):
        as_stream(1 << 64)


@pytest.mark.parametrize(
    "make",
    [P.ProtocolStream, P.ProtocolAttrStream, P.TorchLikeStream, P.CupyLikeStream],
)
def test_stream_objects(make: Any) -> None:
    assert as_stream(make(0x5555_0000)) == 0x5555_0000
    assert as_stream(make(0x6666_0000)) == 0x6666_0000  # cached handler, new instance


def test_stream_cuda_python_like_uses_int_not_getptr() -> None:
    s = P.CudaPythonLikeStream(0x7777_0000)
    assert s.getPtr() != 0x7777_0000  # the premise: getPtr() is not the handle
    assert as_stream(s) == 0x7777_0000


def test_stream_pynccl_stream() -> None:
    cuda = pytest.importorskip("pynccl.cuda")
    s = cuda.Stream._borrow(0x4242_0000, None) if hasattr(cuda.Stream, "_borrow") else None
    if s is None:
        pytest.skip("pynccl.cuda.Stream cannot be made without a GPU")
    assert as_stream(s) == 0x4242_0000
    assert as_stream(cuda.Stream.legacy_default()) == 1


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        (P.TorchLikeStream(-5), r"stream \.cuda_stream is -5; expected a cudaStream_t handle"),
        (P.CupyLikeStream("x"), r"^stream \.ptr must be an int handle, got str 'x'$"),
        (P.CupyLikeStream(True), r"^stream \.ptr must be an int handle, got bool True$"),
        (P.CupyLikeStream(1.0), r"^stream \.ptr must be an int handle, got float 1.0$"),
        (P.ProtocolStream(1 << 64), r"__cuda_stream__ handle is 18446744073709551616"),
    ],
)
def test_stream_bad_handles(obj: Any, words: str) -> None:
    with pytest.raises((TypeError, ValueError), match=words):
        as_stream(obj)


def test_stream_bad_protocol_value() -> None:
    class Broken:
        def __cuda_stream__(self) -> Any:
            return 5

    with pytest.raises(
        TypeError, match=r"Broken.__cuda_stream__ gave 5; expected \(version, handle\)"
    ):
        as_stream(Broken())


@pytest.mark.parametrize("obj", [True, 1.0, "0", b"0", object(), [1], c_int(3)])
def test_stream_refused(obj: Any) -> None:
    with pytest.raises(TypeError) as info:
        as_stream(obj)
    text = str(info.value)
    assert text.startswith("stream must be None, an int cudaStream_t handle")
    assert "__cuda_stream__" in text and ".cuda_stream" in text and ".ptr" in text
    assert type(obj).__qualname__ in text


def test_stream_handler_lost_attribute() -> None:
    # Same type, attribute missing on a later instance: a TypeError, not AttributeError.
    # (Which protocol a later instance speaks is decided for it: see the next test.)
    class Flaky:
        pass

    ok = Flaky()
    ok.cuda_stream = 9  # type: ignore[attr-defined]
    assert as_stream(ok) == 9
    with pytest.raises(TypeError, match=r"stream must be"):
        as_stream(Flaky())


def test_import_pulls_in_no_third_party() -> None:
    # The adaptation layer recognises torch/CuPy objects by protocol only.
    code = (
        "import sys, pynccl._adapt; "
        "print(sorted(m for m in ('numpy', 'torch', 'cupy', 'ml_dtypes') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- complex data: pairs of floats ----------------------------------------------------------

# numpy complex type -> the float type of each half (written out, not derived).
COMPLEX_TYPES = [(np.complex64, DataType.FLOAT32), (np.complex128, DataType.FLOAT64)]


def _as_floats(a: np.ndarray, ptr: int, n: int, dt: DataType) -> np.ndarray:
    # What NCCL would see at (ptr, n, dt), read back from host memory through numpy.
    assert ptr == addr(a)
    floats = np.dtype({DataType.FLOAT32: np.float32, DataType.FLOAT64: np.float64}[dt])
    return np.frombuffer(a.data, dtype=floats, count=n)


@pytest.mark.parametrize(("np_type", "part"), COMPLEX_TYPES)
@pytest.mark.parametrize(
    "make",
    [P.CAIArray, P.CAIProperty, P.DLPackProducer, lambda a: P.DLPackProducer(a, versioned=False)],
    ids=["cai", "cai-property", "dlpack", "dlpack-legacy"],
)
def test_complex_arrays_are_float_pairs(make: Any, np_type: Any, part: DataType) -> None:
    a = (np.arange(12) + 1j * np.arange(100, 112)).astype(np_type).reshape(3, 4)
    ptr, n, dt, _dev = as_buffer(make(a), name="recvbuf", writable=True)
    assert (n, dt) == (2 * a.size, part)
    # The floats NCCL reduces are numpy's own view of the data as reals.
    np.testing.assert_array_equal(_as_floats(a, ptr, n, dt), a.reshape(-1).view(part.name.lower()))
    # count= counts the caller's complex elements; dtype= names the complex type.
    for spelling in (np_type, np.dtype(np_type), np.dtype(np_type).name):
        assert as_buffer(make(a), 5, spelling) == (addr(a), 10, part, _dev)
    with pytest.raises(ValueError, match=r"count=13 is larger than sendbuf, which holds only 12"):
        as_buffer(make(a), 13)
    with pytest.raises(TypeError, match=r"dtype=float32 does not match sendbuf, whose data type"):
        as_buffer(make(a), None, "float32")
    assert is_complex(make(a))
    assert not is_complex(make(a.real.copy()))


def test_complex_strided_views_refused() -> None:
    a = np.zeros((4, 6), np.complex64)
    view = a[:, ::2]
    with pytest.raises(ValueError, match=r"strided/non-contiguous"):
        as_buffer(P.CAIArray(view))
    with pytest.raises(ValueError, match=r"strided/non-contiguous"):
        as_buffer(P.DLPackProducer(view))
    # Contiguous C strides given explicitly, in bytes of the complex element: accepted.
    assert as_buffer(P.CAIArray(a, strides="always"))[1:3] == (48, DataType.FLOAT32)


def test_complex_dlpack_complex32_is_float16_pairs() -> None:
    a = np.arange(8, dtype=np.float16)  # 4 complex32 numbers as their halves
    p = P.DLPackProducer(a[:4], dl_dtype=(P.kDLComplex, 32, 1))
    # The producer claims 4 complex32 elements over the first 8 bytes of a.
    assert as_buffer(p) == (addr(a), 8, DataType.FLOAT16, 0)
    assert is_complex(P.DLPackProducer(a[:4], dl_dtype=(P.kDLComplex, 32, 1)))


@pytest.mark.parametrize(("np_type", "part"), COMPLEX_TYPES)
def test_complex_raw_pointer(np_type: Any, part: DataType) -> None:
    name = np.dtype(np_type).name
    for spelling in (name, np_type, np.dtype(np_type), f"torch.{name}"):
        assert as_buffer(0x1000, 7, spelling) == (0x1000, 14, part, None)
        assert is_complex(0x1000, spelling)
    assert not is_complex(0x1000, "float32")
    assert not is_complex(0x1000, DataType.FLOAT64)
    assert not is_complex(0x1000)
    with pytest.raises(ValueError, match=r"expected fewer than 2\*\*64"):
        as_buffer(0x1000, 1 << 63, name)


def test_complex_big_endian_refused() -> None:
    a = np.zeros(3, dtype=">c8")
    with pytest.raises(TypeError, match=r"recvbuf: data type '>c8' is not supported"):
        as_buffer(P.CAIArray(a), name="recvbuf")
    assert not is_complex(P.CAIArray(a))


def test_is_complex_never_raises() -> None:
    class Broken:
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            raise RuntimeError("boom")

    assert not is_complex(Broken())
    assert not is_complex(object())
    assert not is_complex(None)
    assert not is_complex(P.TorchCPULike(np.zeros(2, np.float32)))
    assert is_complex(P.TorchBF16Like(np.zeros(2, np.complex64)))  # the CAI refuses: DLPack
    # A DLPack-only producer without a .dtype is answered from its capsule.
    p = P.DLPackProducer(np.zeros(2, np.complex128))
    assert is_complex(p)
    gc.collect()
    assert p.exported == 0  # the probe's capsule was released


def test_is_complex_probe_cached_per_type() -> None:
    import pynccl._adapt as adapt

    class Fresh(P.CAIArray):
        pass

    assert is_complex(Fresh(np.zeros(1, np.complex64)))
    probe = adapt._COMPLEX_PROBES[Fresh]
    assert not is_complex(Fresh(np.zeros(1, np.float32)))
    assert adapt._COMPLEX_PROBES[Fresh] is probe


@pytest.mark.parametrize(("np_type", "part"), COMPLEX_TYPES)
def test_device_buffer_complex(fake_cuda: Any, np_type: Any, part: DataType) -> None:
    cuda, rt = fake_cuda
    with cuda.DeviceBuffer((2, 3), np_type) as buf:
        ptr = next(iter(rt.blocks))
        assert buf.is_complex and buf.dtype is part
        assert (buf.size, buf.nbytes) == (6, 6 * np.dtype(np_type).itemsize)
        assert as_buffer(buf, name="recvbuf", writable=True) == (ptr, 12, part, 0)
        assert as_buffer(buf, 4, np_type) == (ptr, 8, part, 0)
        with pytest.raises(ValueError, match=r"count=7 is larger than sendbuf.*only 6"):
            as_buffer(buf, 7)
        with pytest.raises(TypeError, match=r"does not match sendbuf"):
            as_buffer(buf, None, part)
        assert buf.__cuda_array_interface__["typestr"] == np.dtype(np_type).str
        assert "dtype=" + np.dtype(np_type).name in repr(buf)
        assert is_complex(buf)
    with cuda.DeviceBuffer(3, "float32") as real:
        assert not real.is_complex and not is_complex(real)
    with pytest.raises(TypeError, match=r"complex32.*complex64 or complex128"):
        cuda.DeviceBuffer(3, "complex32")


# --- the argument policy: the same words as pynccl._limits ----------------------------------


@pytest.mark.parametrize("dtype", ["float32", DataType.FLOAT32])
def test_raw_pointer_extent_and_end_of_address_space(dtype: Any) -> None:
    from pynccl import _limits

    # count x item size at 2**64: refused as _limits.check_extent words it.
    with pytest.raises(ValueError) as info:
        as_buffer(0x1000, 1 << 62, dtype)
    with pytest.raises(ValueError) as expected:
        _limits.check_extent(1 << 62, 4, "sendbuf")
    assert str(info.value) == str(expected.value)
    # A range that runs past 2**64, on both the fast and the exact path.
    top = (1 << 64) - 8
    with pytest.raises(ValueError, match=r"^sendbuf=0xfffffffffffffff8 \+ 12 bytes passes the end"):
        as_buffer(top, 3, dtype)
    assert as_buffer(top, 2, dtype) == (top, 2, DataType.FLOAT32, None)  # exactly to the end
    assert as_buffer(top, 1, "float64") == (top, 1, DataType.FLOAT64, None)


@pytest.mark.parametrize(
    "count", [-1, 1 << 64, 2.0, True, np.float64(3.0), "3", np.int64(-2), None]
)
def test_count_refusals_match_limits(count: Any) -> None:
    # For every buffer kind, a bad count= gets exactly _limits.check_count's exception.
    from pynccl import _limits

    if count is None:
        return
    with pytest.raises((TypeError, ValueError)) as expected:
        _limits.check_count(count)
    a = np.zeros(8, np.float32)
    for obj in (0x1000, P.CAIArray(a), P.DLPackProducer(a)):
        with pytest.raises(type(expected.value)) as info:
            as_buffer(obj, count, "float32")
        assert str(info.value) == str(expected.value)
    assert as_buffer(P.CAIArray(a), np.int64(3)) == (addr(a), 3, DataType.FLOAT32, None)


def test_cai_shape_product_at_2_64_refused() -> None:
    a = np.zeros(4, np.float32)
    for shape in [(1 << 62,), (1 << 32, 1 << 30), (1 << 64,)]:
        cai = P.CAIArray(a)
        cai.__cuda_array_interface__["shape"] = shape
        with pytest.raises(ValueError, match=r"^recvbuf spans \d+ elements of 4 bytes"):
            as_buffer(cai, name="recvbuf")


def test_cai_pointer_range_refused() -> None:
    a = np.zeros(4, np.float32)
    for ptr, words in [
        ((1 << 64) - 8, r"\+ 16 bytes passes the end of the address space"),
        (1 << 64, r"is not a valid pointer"),
        (-16, r"is not a valid pointer"),
    ]:
        cai = P.CAIArray(a)
        cai.__cuda_array_interface__["data"] = (ptr, False)
        with pytest.raises(ValueError, match=rf"^sendbuf's data pointer.*{words}"):
            as_buffer(cai)
    cai = P.CAIArray(a)
    cai.__cuda_array_interface__["data"] = ("0x1000", False)
    with pytest.raises(TypeError, match=r"sendbuf: __cuda_array_interface__ data pointer '0x1000'"):
        as_buffer(cai)


@pytest.mark.parametrize(
    ("key", "value", "exc", "words"),
    [
        ("shape", 4, TypeError, r"shape 4 is not a tuple of ints"),
        ("shape", (2.0, 2), TypeError, r"shape \(2.0, 2\) is not a tuple of ints"),
        ("shape", (True,), TypeError, r"shape \(True,\) is not a tuple of ints"),
        ("strides", 4, TypeError, r"strides 4 are neither None nor a tuple of ints"),
        ("strides", ("a",), TypeError, r"strides \('a',\) are neither None nor"),
        ("strides", (4, 4), ValueError, r"strides \(4, 4\) have 2 entries for the 1-D shape"),
        ("strides", (8,), ValueError, r"strided/non-contiguous"),
        ("typestr", 5, TypeError, r"typestr 5 is not a str"),
        ("typestr", "f4", TypeError, r"typestr 'f4' has no byte order; expected '<'"),
        ("typestr", "c8", TypeError, r"typestr 'c8' has no byte order"),
        ("data", (1,), TypeError, r"malformed __cuda_array_interface__"),
        ("version", -1, ValueError, r"version=-1 is out of range; pynccl reads versions 0 to 3"),
        ("version", 4, ValueError, r"version=4 is out of range"),
        ("version", "3", TypeError, r"version '3' is not an int \(str\); expected 0, 1, 2 or 3"),
        ("version", 3.0, TypeError, r"version 3.0 is not an int \(float\)"),
        ("version", True, TypeError, r"version True is not an int \(bool\)"),
        ("version", None, TypeError, r"version None is not an int \(NoneType\)"),
        ("stream", 0, ValueError, r"stream=0 is disallowed by the protocol"),
        ("stream", -5, ValueError, r"stream=-5 is out of range"),
        ("stream", 1 << 64, ValueError, r"stream=18446744073709551616 is out of range"),
        ("stream", True, TypeError, r"stream True is not an int \(bool\)"),
        ("stream", 1.0, TypeError, r"stream 1.0 is not an int \(float\)"),
        ("stream", "1", TypeError, r"stream '1' is not an int \(str\)"),
    ],
)
def test_cai_malformed_fields(key: str, value: Any, exc: type, words: str) -> None:
    cai = P.CAIArray(np.zeros(4, np.float32))
    cai.__cuda_array_interface__[key] = value
    with pytest.raises(exc, match=words) as info:
        as_buffer(cai, name="recvbuf")
    assert "recvbuf" in str(info.value)
    empty = P.CAIArray(np.zeros(0, np.float32))  # malformed even when nothing is addressed
    empty.__cuda_array_interface__[key] = value
    if key != "shape" and value != (8,):  # a 0-element array may have any strides
        with pytest.raises(exc, match=words):
            as_buffer(empty, name="recvbuf")


def test_cai_version_may_be_absent_and_stream_none() -> None:
    a = np.zeros(4, np.float32)
    cai = P.CAIArray(a, stream=None)
    del cai.__cuda_array_interface__["version"]
    assert as_buffer(cai) == (addr(a), 4, DataType.FLOAT32, None)
    for version in (0, 1, 2, 3):
        cai.__cuda_array_interface__["version"] = version
        assert as_buffer(cai) == (addr(a), 4, DataType.FLOAT32, None)


def test_cai_not_a_dict() -> None:
    class ListCAI:
        __cuda_array_interface__ = [("shape", (2,))]

    with pytest.raises(TypeError, match=r"^recvbuf has a malformed __cuda_array_interface__"):
        as_buffer(ListCAI(), name="recvbuf")


def _set(**fields: Any) -> Any:
    def tamper(t: Any) -> None:
        for key, value in fields.items():
            if key in ("shape", "strides") and isinstance(value, int):
                value = P.ctypes.cast(value, P.POINTER(P.c_int64))
            setattr(t, key, value)

    return tamper


_BIG = (P.c_int64 * 2)(1 << 62, 1)  # kept alive for the whole module
_BIG_ADDR = addressof(_BIG)


@pytest.mark.parametrize(
    ("tamper", "exc", "words"),
    [
        (_set(ndim=-1), ValueError, r"DLPack ndim=-1 is out of range; expected 0 <= ndim <= 64"),
        (_set(ndim=(1 << 31) - 1), ValueError, r"DLPack ndim=2147483647 is out of range"),
        (_set(ndim=65), ValueError, r"DLPack ndim=65 is out of range"),
        (_set(shape=None), ValueError, r"DLPack shape pointer is NULL for ndim=1"),
        (_set(shape=_BIG_ADDR + 3), ValueError, r"shape pointer 0x[0-9a-f]+ is not an aligned"),
        (_set(shape=(1 << 64) - 8, ndim=2), ValueError, r"shape pointer 0xfff+8 is not an"),
        (_set(shape=_BIG_ADDR, ndim=1), ValueError, r"sendbuf spans 4611686018427387904 elem"),
        (_set(strides=_BIG_ADDR + 4), ValueError, r"strides pointer 0x[0-9a-f]+ is not an"),
        (_set(byte_offset=(1 << 64) - 1), ValueError, r"passes the end of the address space"),
        (_set(data=(1 << 64) - 8), ValueError, r"data pointer=0xfff+8 \+ 16 bytes passes"),
        (_set(device=P.DLDevice(P.kDLCUDA, -1)), ValueError, r"DLPack device_id=-1 is negat"),
        (_set(dtype=P.DLDataType(99, 8, 1)), TypeError, r"type code 99"),
        (_set(dtype=P.DLDataType(2, 32, 0)), TypeError, r"a vector type \(0 lanes\)"),
    ],
)
def test_dlpack_malformed_tensor(tamper: Any, exc: type, words: str) -> None:
    p = P.DLPackProducer(np.zeros(4, np.float32), tamper=tamper)
    with pytest.raises(exc, match=words) as info:
        as_buffer(p)
    assert str(info.value).startswith("sendbuf")
    del info
    gc.collect()
    assert p.deleted == 1  # refused, and released


def test_dlpack_zero_dim_needs_no_shape() -> None:
    a = np.zeros(1, np.float32)
    p = P.DLPackProducer(a, tamper=_set(ndim=0, shape=None))
    assert as_buffer(p) == (addr(a), 1, DataType.FLOAT32, 0)


def test_stream_later_instance_speaks_another_protocol() -> None:
    # One class, instances exposing different protocols: each is read by its own, even
    # though the handler is cached from the first instance of the class.
    import pynccl._adapt as adapt

    class Mixed:
        pass

    def make(**attrs: Any) -> Mixed:
        m = Mixed()
        for k, v in attrs.items():
            setattr(m, k, v)
        return m

    assert as_stream(make(cuda_stream=0x11)) == 0x11
    cached = adapt._STREAM_HANDLERS[Mixed]
    assert as_stream(make(ptr=0x22)) == 0x22
    assert as_stream(make(__cuda_stream__=(0, 0x33))) == 0x33
    assert as_stream(make(cuda_stream=0x44)) == 0x44
    assert adapt._STREAM_HANDLERS[Mixed] is cached  # the cache stays as it was
    with pytest.raises(TypeError, match=r"^stream must be None, an int"):
        as_stream(make())
    with pytest.raises(ValueError, match=r"^stream \.ptr is -1; expected a cudaStream_t"):
        as_stream(make(ptr=-1))


def test_buffer_later_instance_without_its_protocol() -> None:
    # A CAI-by-instance class whose later instance has none: a TypeError naming it.
    class Maybe:
        pass

    a = np.zeros(3, np.float32)
    first = Maybe()
    first.__cuda_array_interface__ = P.cai_dict(a)  # type: ignore[attr-defined]
    assert as_buffer(first) == (addr(a), 3, DataType.FLOAT32, None)
    with pytest.raises(TypeError, match=r"^recvbuf must be an int device pointer.*Maybe"):
        as_buffer(Maybe(), name="recvbuf")


@pytest.mark.parametrize("answer", [None, (2,), ("cuda", 0), (2, 0, 0), (2.0, 0), 7])
def test_dlpack_device_answer_malformed(answer: Any) -> None:
    class OddDevice(P.DLPackProducer):
        def __dlpack_device__(self) -> Any:
            return answer

    class OddCAI(P.CAIWithDLPackDevice):
        pass

    with pytest.raises(TypeError, match=r"^recvbuf\.__dlpack_device__\(\) gave .* two ints$"):
        as_buffer(OddDevice(np.zeros(2, np.float32)), name="recvbuf")
    with pytest.raises(TypeError, match=r"^recvbuf\.__dlpack_device__\(\) gave .* two ints$"):
        as_buffer(OddCAI(np.zeros(2, np.float32), answer), name="recvbuf")  # type: ignore[arg-type]


def test_pointer_2_64_refused_even_for_zero_elements() -> None:
    # Found by the fuzz: the fast paths once let 2**64 through when nothing moves.
    for dtype in (DataType.UINT8, "uint8"):
        with pytest.raises(ValueError, match=r"^sendbuf=0x10000000000000000 is not a valid"):
            as_buffer(1 << 64, 0, dtype)
    cai = P.CAIArray(np.zeros(0, np.uint8))
    cai.__cuda_array_interface__["data"] = (1 << 64, False)
    with pytest.raises(ValueError, match=r"^sendbuf's data pointer=0x10000000000000000 is not"):
        as_buffer(cai)


def test_typing_protocols_describe_the_accepted_forms() -> None:
    # pynccl.typing's Protocols match the producers as_buffer/as_stream accept (isinstance
    # through runtime_checkable: structure only, as a type checker sees them).
    from pynccl import typing as T

    a = np.zeros(2, np.float32)
    assert isinstance(P.CAIProperty(a), T.SupportsCAI)
    assert isinstance(P.CAIArray(a), T.SupportsCAI)
    assert isinstance(P.DLPackProducer(a), T.SupportsDLPack)
    assert isinstance(P.ProtocolStream(5), T.SupportsCudaStream)
    assert isinstance(P.TorchLikeStream(5), T.HasCudaStreamAttr)
    assert isinstance(P.CupyLikeStream(5), T.HasStreamPtr)
    assert not isinstance(P.CupyLikeStream(5), T.HasCudaStreamAttr)
    assert not isinstance(a, T.SupportsCAI)  # host memory is no CUDA array
    from pynccl import cuda

    assert cuda.StreamLike is T.StreamLike


def test_complex_spellings() -> None:
    from pynccl.dtypes import as_element_type, complex_component

    class TorchDType:  # what str() of a torch dtype looks like; torch is not installed
        __module__ = "torch"

        def __init__(self, text: str) -> None:
            self.text = text

        def __str__(self) -> str:
            return self.text

    pairs = {
        "complex64": DataType.FLOAT32,
        "np.complex128": DataType.FLOAT64,
        "<c8": DataType.FLOAT32,
        "c16": DataType.FLOAT64,
        np.complex64: DataType.FLOAT32,
        np.dtype("complex128"): DataType.FLOAT64,
        complex: DataType.FLOAT64,
        TorchDType("torch.complex64"): DataType.FLOAT32,
        TorchDType("torch.cdouble"): DataType.FLOAT64,
        TorchDType("torch.chalf"): DataType.FLOAT16,
    }
    for spelling, part in pairs.items():
        assert complex_component(spelling) is part, spelling
        assert as_element_type(spelling) == (part, 2), spelling
    for other in ("float32", np.float64, DataType.FLOAT32, 5, True, ">c8", "complex", None, 1j):
        assert complex_component(other) is None, other
    assert as_element_type("float16") == (DataType.FLOAT16, 1)
    with pytest.raises(TypeError, match=r"data type '>c8' is not supported"):
        as_element_type(">c8")
