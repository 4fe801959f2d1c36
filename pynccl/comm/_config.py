"""``Config``: communicator options, turned into an ``ncclConfig_t``.

A plain class with ``__slots__`` (not a dataclass: importing :mod:`dataclasses` costs
milliseconds on the first use of the object API). Its fields come from one table that
also gives each field's ``ncclConfig_t`` name; the minimum releases come from the
ctypes layer's own table (``CONFIG_FIELD_RELEASE``) and appear in ``help(Config)``.
"""

from __future__ import annotations

from .._capi.structs import CONFIG_FIELD_RELEASE, make_config, ncclConfig_t
from .._limits import C_INT_MAX, C_INT_MIN, check_c_int, check_flag

__all__ = ["Config"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..enums import Release

#: ``(python name, ncclConfig_t name, value type, what it does)``, in ncclConfig_t order.
FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("blocking", "blocking", "bool", "False: calls may return ncclInProgress (non-blocking)"),
    ("cga_cluster_size", "cgaClusterSize", "int", "CGA cluster size of NCCL kernels"),
    ("min_ctas", "minCTAs", "int", "minimum CTAs per kernel"),
    ("max_ctas", "maxCTAs", "int", "maximum CTAs per kernel"),
    ("net_name", "netName", "str", "network module to use"),
    ("split_share", "splitShare", "bool", "children of split share resources"),
    ("traffic_class", "trafficClass", "int", "network traffic class"),
    ("comm_name", "commName", "str", "communicator name in NCCL's logs"),
    ("collnet_enable", "collnetEnable", "bool", "use CollNet"),
    ("cta_policy", "CTAPolicy", "int", "CTA scheduling policy"),
    ("shrink_share", "shrinkShare", "bool", "children of shrink share resources"),
    ("nvls_ctas", "nvlsCTAs", "int", "CTAs for NVLS"),
    ("n_channels_per_net_peer", "nChannelsPerNetPeer", "int", "channels per network peer"),
    ("nvlink_centric_sched", "nvlinkCentricSched", "bool", "NVLink-centric scheduling"),
    ("graph_usage_mode", "graphUsageMode", "int", "CUDA graph usage mode"),
    ("num_rma_ctx", "numRmaCtx", "int", "RMA contexts"),
    ("max_p2p_peers", "maxP2pPeers", "int", "maximum point-to-point peers"),
    ("graph_stream_ordering", "graphStreamOrdering", "int", "graph stream ordering"),
    ("launch_order_implicit", "launchOrderImplicit", "bool", "implicit launch order"),
    ("num_rma_sig", "numRmaSig", "int", "RMA signals"),
    ("rma_eager_init", "rmaEagerInit", "bool", "initialise RMA eagerly"),
    ("host_cft_mode", "hostCftMode", "int", "host CFT mode"),
    ("nvls_host_mode", "nvlsHostMode", "int", "NVLS host mode"),
)
_NAMES = tuple(f[0] for f in FIELDS)
_KINDS = {f[0]: (f[1], f[2]) for f in FIELDS}


def check_field(name: str, value: Any) -> Any:
    """``value`` for field ``name`` (None: unset), by the rules :class:`~pynccl.CollConfig`
    applies too: an int field takes an ``int`` or ``__index__`` integer (numpy's) that
    fits the C ``int``, never a bool or float; a bool field a bool (numpy's too), never
    an int; a str field a str without NUL."""
    if value is None:
        return None
    c_name, kind = _KINDS[name]
    if kind == "int":
        what = f"(ncclConfig_t.{c_name}, a 32-bit int)"
        return check_c_int(value, name, C_INT_MIN, C_INT_MAX, what)
    if kind == "bool":
        return check_flag(value, name)
    if type(value) is not str:
        raise TypeError(
            f"{name} (ncclConfig_t.{c_name}) must be a str, got {type(value).__name__} {value!r}"
        )
    if "\0" in value:
        raise ValueError(f"{name} must not contain NUL: {value!r}")
    return value


def _release(c_name: str) -> Release:
    return CONFIG_FIELD_RELEASE[c_name]


def _field_doc() -> str:
    lines = []
    for name, c_name, kind, what in FIELDS:
        major, minor, patch = _release(c_name)
        since = f"{major}.{minor}" + (f".{patch}" if patch else "")
        lines.append(f"* ``{name}`` ({kind}, ``{c_name}``, NCCL >= {since}): {what}")
    return "\n".join(lines)


class Config:
    __slots__ = _NAMES
    __doc__ = (
        "Communicator options, turned into an ``ncclConfig_t``; ``None`` leaves NCCL's "
        "default.\n\n``Config(blocking=False, comm_name='train', ...)``: every field is a "
        "keyword, and each needs the minimum NCCL release listed here; a field the loaded "
        "library does not know raises :class:`~pynccl.NotSupportedError` rather than being "
        "silently ignored.\n\n" + _field_doc() + "\n"
    )

    #: Python name -> ``ncclConfig_t`` name.
    C_NAMES: dict[str, str] = {f[0]: f[1] for f in FIELDS}
    #: Python name -> first NCCL release with that field.
    RELEASES: dict[str, Release] = {f[0]: _release(f[1]) for f in FIELDS}

    blocking: bool | None
    cga_cluster_size: int | None
    min_ctas: int | None
    max_ctas: int | None
    net_name: str | None
    split_share: bool | None
    traffic_class: int | None
    comm_name: str | None
    collnet_enable: bool | None
    cta_policy: int | None
    shrink_share: bool | None
    nvls_ctas: int | None
    n_channels_per_net_peer: int | None
    nvlink_centric_sched: bool | None
    graph_usage_mode: int | None
    num_rma_ctx: int | None
    max_p2p_peers: int | None
    graph_stream_ordering: int | None
    launch_order_implicit: bool | None
    num_rma_sig: int | None
    rma_eager_init: bool | None
    host_cft_mode: int | None
    nvls_host_mode: int | None

    def __init__(
        self,
        *,
        blocking: bool | None = None,
        cga_cluster_size: int | None = None,
        min_ctas: int | None = None,
        max_ctas: int | None = None,
        net_name: str | None = None,
        split_share: bool | None = None,
        traffic_class: int | None = None,
        comm_name: str | None = None,
        collnet_enable: bool | None = None,
        cta_policy: int | None = None,
        shrink_share: bool | None = None,
        nvls_ctas: int | None = None,
        n_channels_per_net_peer: int | None = None,
        nvlink_centric_sched: bool | None = None,
        graph_usage_mode: int | None = None,
        num_rma_ctx: int | None = None,
        max_p2p_peers: int | None = None,
        graph_stream_ordering: int | None = None,
        launch_order_implicit: bool | None = None,
        num_rma_sig: int | None = None,
        rma_eager_init: bool | None = None,
        host_cft_mode: int | None = None,
        nvls_host_mode: int | None = None,
    ) -> None:
        given = locals()  # every keyword, by its field's name
        for name in _NAMES:
            setattr(self, name, check_field(name, given[name]))

    def __eq__(self, other: object) -> bool:
        if type(other) is not Config:
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in _NAMES)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        set_ = ", ".join(
            f"{n}={getattr(self, n)!r}" for n in _NAMES if getattr(self, n) is not None
        )
        return f"Config({set_})"

    def c_fields(self) -> dict[str, Any]:
        """The fields that are set, by their ``ncclConfig_t`` names (checked again: the
        object is mutable)."""
        out: dict[str, Any] = {}
        for name in _NAMES:
            value = check_field(name, getattr(self, name))
            if value is not None:
                out[self.C_NAMES[name]] = int(value) if isinstance(value, bool) else value
        return out

    def to_struct(self, loaded: Release | None = None) -> ncclConfig_t:
        """The ``ncclConfig_t``; with ``loaded``, refuses fields that release lacks."""
        return make_config(self.c_fields(), loaded)
