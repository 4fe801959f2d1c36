"""NCCL's enums with the values of nccl.h 2.32.3.

Each member also knows the first NCCL release that accepts it, so callers can
refuse what the loaded library lacks before any C call.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "WIN_REQUIRED_ALIGNMENT",
    "CTAPolicy",
    "DataType",
    "EncryptionMode",
    "GinConnectionType",
    "GinType",
    "MemStat",
    "RedOp",
    "Result",
    "RevokeFlag",
    "ScalarResidence",
    "ShrinkFlag",
    "SuspendFlag",
    "WinFlag",
    "release_str",
]

Release = tuple[int, int, int]


def release_str(release: Release) -> str:
    """``(2, 24, 3)`` → ``"2.24.3"``."""
    return ".".join(str(part) for part in release)


class Result(IntEnum):
    """``ncclResult_t``."""

    SUCCESS = 0
    UNHANDLED_CUDA_ERROR = 1
    SYSTEM_ERROR = 2
    INTERNAL_ERROR = 3
    INVALID_ARGUMENT = 4
    INVALID_USAGE = 5
    REMOTE_ERROR = 6  # NCCL >= 2.13.4
    IN_PROGRESS = 7  # NCCL >= 2.14.3
    TIMEOUT = 8  # NCCL >= 2.30.3

    @property
    def c_name(self) -> str:
        """The enumerator's name in nccl.h, e.g. ``ncclInvalidUsage``."""
        return _RESULT_C_NAMES[self]


_RESULT_C_NAMES = {
    Result.SUCCESS: "ncclSuccess",
    Result.UNHANDLED_CUDA_ERROR: "ncclUnhandledCudaError",
    Result.SYSTEM_ERROR: "ncclSystemError",
    Result.INTERNAL_ERROR: "ncclInternalError",
    Result.INVALID_ARGUMENT: "ncclInvalidArgument",
    Result.INVALID_USAGE: "ncclInvalidUsage",
    Result.REMOTE_ERROR: "ncclRemoteError",
    Result.IN_PROGRESS: "ncclInProgress",
    Result.TIMEOUT: "ncclTimeout",
}


class DataType(IntEnum):
    """``ncclDataType_t``; ``itemsize`` in bytes, ``first_release`` of NCCL."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9  # NCCL >= 2.10.3
    FLOAT8_E4M3 = 10  # NCCL >= 2.24.3
    FLOAT8_E5M2 = 11  # NCCL >= 2.24.3

    @property
    def itemsize(self) -> int:
        """Size of one element in bytes."""
        return _ITEMSIZE[self]

    @property
    def first_release(self) -> Release:
        """The first NCCL release that accepts this type."""
        return _TYPE_RELEASE.get(self, (2, 3, 5))

    @property
    def is_integer(self) -> bool:
        """True for the integer types (on which ``avg`` is refused)."""
        return self <= DataType.UINT64

    @property
    def is_float(self) -> bool:
        """True for the floating-point types."""
        return not self.is_integer

    @property
    def c_name(self) -> str:
        """The enumerator's name in nccl.h, e.g. ``ncclFloat32``."""
        return _TYPE_C_NAMES[self]


_ITEMSIZE = {
    DataType.INT8: 1,
    DataType.UINT8: 1,
    DataType.INT32: 4,
    DataType.UINT32: 4,
    DataType.INT64: 8,
    DataType.UINT64: 8,
    DataType.FLOAT16: 2,
    DataType.FLOAT32: 4,
    DataType.FLOAT64: 8,
    DataType.BFLOAT16: 2,
    DataType.FLOAT8_E4M3: 1,
    DataType.FLOAT8_E5M2: 1,
}
_TYPE_RELEASE: dict[DataType, Release] = {
    DataType.BFLOAT16: (2, 10, 3),
    DataType.FLOAT8_E4M3: (2, 24, 3),
    DataType.FLOAT8_E5M2: (2, 24, 3),
}
_TYPE_C_NAMES = {
    DataType.INT8: "ncclInt8",
    DataType.UINT8: "ncclUint8",
    DataType.INT32: "ncclInt32",
    DataType.UINT32: "ncclUint32",
    DataType.INT64: "ncclInt64",
    DataType.UINT64: "ncclUint64",
    DataType.FLOAT16: "ncclFloat16",
    DataType.FLOAT32: "ncclFloat32",
    DataType.FLOAT64: "ncclFloat64",
    DataType.BFLOAT16: "ncclBfloat16",
    DataType.FLOAT8_E4M3: "ncclFloat8e4m3",
    DataType.FLOAT8_E5M2: "ncclFloat8e5m2",
}


class RedOp(IntEnum):
    """Built-in ``ncclRedOp_t`` values (PreMulSum ops are per-communicator ints ≥ 5)."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4  # NCCL >= 2.10.3

    @property
    def first_release(self) -> Release:
        """The first NCCL release that accepts this op."""
        return (2, 10, 3) if self is RedOp.AVG else (2, 3, 5)

    @property
    def c_name(self) -> str:
        """The enumerator's name in nccl.h, e.g. ``ncclSum``."""
        return "ncclAvg" if self is RedOp.AVG else "nccl" + self.name.capitalize()


class ScalarResidence(IntEnum):
    """``ncclScalarResidence_t`` (NCCL >= 2.11.4), for ``ncclRedOpCreatePreMulSum``."""

    DEVICE = 0
    HOST_IMMEDIATE = 1


class WinFlag(IntEnum):
    """``NCCL_WIN_*`` flags of ``ncclCommWindowRegister`` (NCCL >= 2.27.3; bits, OR them)."""

    DEFAULT = 0x00
    COLL_SYMMETRIC = 0x01
    STRICT_ORDERING = 0x02
    GIN_ONLY = 0x04  # nccl.h 2.32.3
    CFT_COUNTED = 0x08  # nccl.h 2.32.3


#: ``NCCL_WIN_REQUIRED_ALIGNMENT``: symmetric windows start on this many bytes.
WIN_REQUIRED_ALIGNMENT = 4096


class CTAPolicy(IntEnum):
    """``NCCL_CTA_POLICY_*`` for ``ncclConfig_t.CTAPolicy`` / ``ncclCollConfig_t.CTAPolicy``."""

    DEFAULT = 0x00
    EFFICIENCY = 0x01
    ZERO = 0x02


class ShrinkFlag(IntEnum):
    """``NCCL_SHRINK_*`` flags of ``ncclCommShrink`` (NCCL >= 2.27.3)."""

    DEFAULT = 0x00
    ABORT = 0x01  # terminate the parent's ongoing operations first


class RevokeFlag(IntEnum):
    """``NCCL_REVOKE_*`` flags of ``ncclCommRevoke`` (NCCL >= 2.28.7; must be 0)."""

    DEFAULT = 0x00


class SuspendFlag(IntEnum):
    """``NCCL_SUSPEND_*`` flags of ``ncclCommSuspend`` (NCCL >= 2.29.7)."""

    MEM = 0x01  # release dynamic GPU memory allocations


class MemStat(IntEnum):
    """``ncclCommMemStat_t`` ids of ``ncclCommMemStats`` (NCCL >= 2.29.7)."""

    GPU_MEM_SUSPEND = 0  # suspendable GPU memory (bytes)
    GPU_MEM_SUSPENDED = 1  # 1 while suspended
    GPU_MEM_PERSIST = 2  # GPU memory that cannot be suspended (bytes)
    GPU_MEM_TOTAL = 3  # all GPU memory NCCL tracks (bytes)


class EncryptionMode(IntEnum):
    """``ncclEncryptionMode_t`` of ``ncclEncryptionConfig_t`` (NCCL >= 2.32.3)."""

    NONE = 0
    PSK = 1


class GinType(IntEnum):
    """``ncclGinType_t`` (``nccl_device/core.h``): a GPU-initiated networking backend, as
    :attr:`pynccl.CommProperties.gin_type` reports it (NCCL >= 2.29)."""

    NONE = 0
    PROXY = 2  # not 1: matches NCCL_NET_DEVICE_GIN_PROXY
    GDAKI = 3
    GPI = 4
    EFA_GDA = 5


class GinConnectionType(IntEnum):
    """``ncclGinConnectionType_t`` (``nccl_device/core.h``): which ranks GIN connects."""

    NONE = 0
    FULL = 1
    RAIL = 2
    CUSTOM_STRIDE = 3
