"""``comm.properties``: :class:`CommProperties`, from ``ncclCommQueryProperties``.

Imported on first use of :attr:`~pynccl.Communicator.properties` (it needs
:mod:`dataclasses`, which ``import pynccl.comm`` avoids).

The query passes the loaded library's version code (clamped to the header's,
:data:`~pynccl._capi.structs.STRUCT_VERSION`), so an older libnccl is asked only for what
it knows; a field newer than the loaded release is ``None`` in the result.
"""

from __future__ import annotations

from ctypes import byref
from dataclasses import dataclass

from .._capi.nccl_device import make_comm_properties
from .._capi.structs import STRUCT_VERSION
from ..enums import GinConnectionType, GinType

__all__ = ["FIELDS", "SINCE", "CommProperties", "query"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .._capi.nccl import NcclLibrary
    from ..enums import Release

#: The first release of ``ncclCommQueryProperties``.
SINCE: Release = (2, 29, 2)

#: ``(attribute, C field, first release filling it)``, in the struct's order.
FIELDS: tuple[tuple[str, str, Release], ...] = (
    ("rank", "rank", SINCE),
    ("size", "nRanks", SINCE),
    ("device", "cudaDev", SINCE),
    ("nvml_device", "nvmlDev", SINCE),
    ("device_api_support", "deviceApiSupport", SINCE),
    ("multimem_support", "multimemSupport", SINCE),
    # NCCL fills these four for callers newer than 2.29.3 only.
    ("gin_type", "ginType", (2, 29, 4)),
    ("lsa_teams", "nLsaTeams", (2, 29, 4)),
    ("host_rma_support", "hostRmaSupport", (2, 29, 4)),
    ("railed_gin_type", "railedGinType", (2, 29, 4)),
    ("comm_hash", "commHash", (2, 30, 3)),
    ("gin_min_stride", "ginMinStride", (2, 30, 3)),
    ("gin_connection_type", "ginConnectionType", (2, 30, 3)),
    ("gin_support", "ginSupport", (2, 30, 3)),
    ("dev_comm_runtime_version_size", "devCommRuntimeVersionSize", (2, 30, 3)),
    ("cft_support", "cftSupport", (2, 31, 2)),
    ("cft_multicast_support", "cftMulticastSupport", (2, 31, 2)),
    ("cft_counted_support", "cftCountedSupport", (2, 31, 2)),
)


@dataclass(frozen=True)
class CommProperties:
    """What ``ncclCommQueryProperties`` (NCCL >= 2.29.2) says about a communicator.

    Queried afresh by each read of :attr:`pynccl.Communicator.properties` (a shrink or
    grow makes a new communicator with its own). A field the loaded release does not
    fill is ``None`` (see :data:`FIELDS` for each field's first release).
    """

    #: This rank (``rank``).
    rank: int
    #: Number of ranks (``nRanks``).
    size: int
    #: CUDA device ordinal (``cudaDev``).
    device: int
    #: NVML device index (``nvmlDev``).
    nvml_device: int
    #: The device API can be used (``deviceApiSupport``).
    device_api_support: bool
    #: Multimem (NVLS) windows are supported (``multimemSupport``).
    multimem_support: bool
    #: The GIN backend usable across nodes (``ginType``; NCCL >= 2.29.4).
    gin_type: GinType | int | None = None
    #: Number of load/store-accessible teams (``nLsaTeams``; NCCL >= 2.29.4).
    lsa_teams: int | None = None
    #: Host RMA is supported (``hostRmaSupport``; NCCL >= 2.29.4).
    host_rma_support: bool | None = None
    #: The railed GIN backend (``railedGinType``; NCCL >= 2.29.4).
    railed_gin_type: GinType | int | None = None
    #: The communicator's hash, as NCCL's logs print it (``commHash``; NCCL >= 2.30.3).
    comm_hash: int | None = None
    #: Smallest GIN rank stride (``ginMinStride``; NCCL >= 2.30.3).
    gin_min_stride: int | None = None
    #: Which ranks GIN connects (``ginConnectionType``; NCCL >= 2.30.3).
    gin_connection_type: GinConnectionType | int | None = None
    #: The GIN types supported (the true entries of ``ginSupport``; NCCL >= 2.30.3).
    gin_support: frozenset[GinType | int] | None = None
    #: Bytes of a device communicator built for the runtime's version
    #: (``devCommRuntimeVersionSize``; NCCL >= 2.30.3).
    dev_comm_runtime_version_size: int | None = None
    #: CFT is supported (``cftSupport``; NCCL >= 2.31.2).
    cft_support: bool | None = None
    #: CFT multicast is supported (``cftMulticastSupport``; NCCL >= 2.31.2).
    cft_multicast_support: bool | None = None
    #: Counted CFT is supported (``cftCountedSupport``; NCCL >= 2.31.2).
    cft_counted_support: bool | None = None

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name, _, _ in FIELDS
            if getattr(self, name) is not None
        )
        return f"CommProperties({shown})"


def _enum(kind: Any, value: int) -> Any:
    try:
        return kind(value)
    except ValueError:  # a backend newer than this table: the number as NCCL gives it
        return value


def _convert(name: str, value: Any) -> Any:
    if name in ("gin_type", "railed_gin_type"):
        return _enum(GinType, value)
    if name == "gin_connection_type":
        return _enum(GinConnectionType, value)
    if name == "gin_support":
        return frozenset(_enum(GinType, i) for i, ok in enumerate(value) if ok)
    if type(value) is bool:
        return value
    return int(value)


def query(lib: NcclLibrary, call: Any) -> CommProperties:
    """The properties: ``call(props_pointer)`` runs ``ncclCommQueryProperties`` on the
    communicator (under its gate)."""
    lib.require("ncclCommQueryProperties", SINCE)
    version = lib.version
    code = min(lib.version_code, STRUCT_VERSION)
    props = make_comm_properties(code)
    call(byref(props))
    values = {
        name: _convert(name, getattr(props, field))
        for name, field, since in FIELDS
        if version >= since
    }
    return CommProperties(**values)
