"""``CollConfig``: per-call options of one collective, as an ``ncclCollConfig_t`` (NCCL >= 2.31).

Frozen: the fields are checked and the C struct is built once, in ``__init__``; a call
that passes ``config=`` hands NCCL a pointer to that struct (the ``nccl*Config`` variant
of the collective). The struct always has the 2.32 layout (older libraries copy the part
they know, nccl-abi.md §3); a field that the loaded library would ignore is refused at the
call, by :meth:`CollConfig.check`, naming the release that added it.
"""

from __future__ import annotations

from ctypes import byref

from .._capi.structs import COLL_CONFIG_FIELD_RELEASE, make_coll_config
from .._limits import C_INT_MAX, check_c_int, check_flag, index_int
from ..errors import NotSupportedError

__all__ = ["COLL_CONFIG_SINCE", "CollConfig"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .._capi.structs import ncclCollConfig_t
    from ..enums import Release

#: The first release with the ``nccl*Config`` collectives (``ncclAllReduceConfig``, ...).
COLL_CONFIG_SINCE: Release = (2, 31, 2)

#: ``(python name, ncclCollConfig_t name, value type, what it does)``, in struct order.
FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("min_ctas", "minCTAs", "int", "lower bound on the CTAs (channels) of this call"),
    ("max_ctas", "maxCTAs", "int", "upper bound on the CTAs; at most the communicator's"),
    ("nvls_ctas", "nvlsCTAs", "int", "CTA cap of the NVLS pool"),
    ("cga_cluster_size", "cgaClusterSize", "int", "thread-block-cluster size (Hopper+)"),
    ("alg_selection", "algSelection", "str", "which algorithm(s) the call may use"),
    ("force_alg_selection", "forceAlgSelection", "bool", "an unsatisfiable selection is an "
     "error (NCCL's default True)"),
    ("cta_policy", "CTAPolicy", "int", "NCCL_CTA_POLICY_* bitmask (default: the "
     "communicator's)"),
    ("user_profiler_tag", "userProfilerTag", "int", "opaque tag handed to profiler plugins "
     "(below 2**63)"),
    ("launch_completion_event", "launchCompletionEvent", "Event", "a pynccl.cuda.Event (or "
     "cudaEvent_t as an int) recorded when the kernel launch completes"),
)  # fmt: skip
_NAMES = tuple(f[0] for f in FIELDS)
_C_NAMES = {f[0]: f[1] for f in FIELDS}


def _release_str(release: Release) -> str:
    major, minor, patch = release
    return f"{major}.{minor}" + (f".{patch}" if patch else "")


def _field_doc() -> str:
    lines = []
    for name, c_name, kind, what in FIELDS:
        since = max(COLL_CONFIG_FIELD_RELEASE[c_name], COLL_CONFIG_SINCE)
        lines.append(f"* ``{name}`` ({kind}, ``{c_name}``, NCCL >= {_release_str(since)}): {what}")
    return "\n".join(lines)


def _event_handle(value: object) -> int:
    handle = getattr(value, "handle", None)
    if handle is None:
        handle = index_int(value, "launch_completion_event", "a pynccl.cuda.Event or an int")
    if type(handle) is not int or not 0 < handle < 1 << 64:
        raise ValueError(
            f"launch_completion_event must be a live CUDA event (a non-NULL cudaEvent_t), "
            f"got {value!r}"
        )
    return handle


class CollConfig:
    __slots__ = (*_NAMES, "__weakref__", "_c_fields", "_hash", "_pointer", "_since", "_struct")
    __doc__ = (
        "Per-call options of a collective (``ncclCollConfig_t``, NCCL >= 2.31); ``None`` "
        "leaves NCCL's default.\n\n``comm.all_reduce(x, config=CollConfig(max_ctas=4))``: "
        "every collective method (and its ``*_init`` persistent form) takes ``config=`` and "
        "then calls the collective's ``nccl*Config`` variant. Set the same config on every "
        "rank (NCCL checks it only locally). Frozen: fields are checked and the C struct is "
        "built once, when the object is made; a field the loaded library lacks raises "
        ":class:`~pynccl.NotSupportedError` at the call instead of being silently ignored. "
        "``send``/``recv`` take ``config=`` too, but NCCL has no per-call config for "
        "point-to-point calls, so a non-None one raises :class:`~pynccl.NotSupportedError`."
        "\n\n" + _field_doc() + "\n"
    )

    #: Python name -> ``ncclCollConfig_t`` name.
    C_NAMES: dict[str, str] = _C_NAMES

    min_ctas: int | None
    max_ctas: int | None
    nvls_ctas: int | None
    cga_cluster_size: int | None
    alg_selection: str | None
    force_alg_selection: bool | None
    cta_policy: int | None
    user_profiler_tag: int | None
    launch_completion_event: Any
    _c_fields: dict[str, Any]
    _hash: int | None
    _pointer: object
    _since: Release
    _struct: ncclCollConfig_t

    def __init__(
        self,
        *,
        min_ctas: int | None = None,
        max_ctas: int | None = None,
        nvls_ctas: int | None = None,
        cga_cluster_size: int | None = None,
        alg_selection: str | None = None,
        force_alg_selection: bool | None = None,
        cta_policy: int | None = None,
        user_profiler_tag: int | None = None,
        launch_completion_event: object = None,
    ) -> None:
        c: dict[str, Any] = {}
        values: dict[str, Any] = {}
        for name, value in (
            ("min_ctas", min_ctas),
            ("max_ctas", max_ctas),
            ("nvls_ctas", nvls_ctas),
            ("cga_cluster_size", cga_cluster_size),
            ("cta_policy", cta_policy),
        ):
            if value is not None:
                value = check_c_int(value, name, 0, C_INT_MAX)
                c[_C_NAMES[name]] = value
            values[name] = value
        if alg_selection is not None:
            c["algSelection"] = _alg_selection(alg_selection)
        values["alg_selection"] = alg_selection
        if force_alg_selection is not None:
            # The rule of Config's bool fields too: a bool (numpy's included), never an int.
            force_alg_selection = check_flag(force_alg_selection, "force_alg_selection")
            c["forceAlgSelection"] = int(force_alg_selection)
        values["force_alg_selection"] = force_alg_selection
        if user_profiler_tag is not None:
            c["userProfilerTag"] = user_profiler_tag = _profiler_tag(user_profiler_tag)
        values["user_profiler_tag"] = user_profiler_tag
        if launch_completion_event is not None:
            c["launchCompletionEvent"] = _event_handle(launch_completion_event)
        # The object itself is kept (an Event stays alive as long as the config).
        values["launch_completion_event"] = launch_completion_event
        for name, value in values.items():
            object.__setattr__(self, name, value)
        since = COLL_CONFIG_SINCE
        for c_name in c:
            since = max(since, COLL_CONFIG_FIELD_RELEASE[c_name])
        struct = make_coll_config(c)
        object.__setattr__(self, "_c_fields", c)
        object.__setattr__(self, "_since", since)
        object.__setattr__(self, "_struct", struct)
        object.__setattr__(self, "_pointer", byref(struct))
        object.__setattr__(self, "_hash", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"CollConfig is frozen: cannot set {name!r}; make a new one")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"CollConfig is frozen: cannot delete {name!r}")

    def _key(self) -> tuple[object, ...]:
        return tuple(getattr(self, n) for n in _NAMES)

    def __eq__(self, other: object) -> bool:
        if type(other) is not CollConfig:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash(tuple(id(v) if n == "launch_completion_event" else v
                           for n, v in zip(_NAMES, self._key())))  # fmt: skip
            object.__setattr__(self, "_hash", h)
        return h

    def __repr__(self) -> str:
        set_ = ", ".join(
            f"{n}={getattr(self, n)!r}" for n in _NAMES if getattr(self, n) is not None
        )
        return f"CollConfig({set_})"

    def c_fields(self) -> dict[str, Any]:
        """The fields that are set, by their ``ncclCollConfig_t`` names (C values)."""
        return dict(self._c_fields)

    @property
    def struct(self) -> ncclCollConfig_t:
        """The ``ncclCollConfig_t`` (built once; do not modify it)."""
        return self._struct

    @property
    def since(self) -> Release:
        """The first NCCL release that knows every field that is set."""
        return self._since

    def check(self, loaded: Release, function: str) -> object:
        """The struct's pointer for a call of ``function`` (``"ncclAllReduceConfig"``, NCCL
        >= 2.31) on a library of version ``loaded``; :class:`~pynccl.NotSupportedError`
        naming the release when that library lacks the ``nccl*Config`` calls or a field that
        is set."""
        if loaded < self._since:
            if loaded < COLL_CONFIG_SINCE:
                raise NotSupportedError(
                    f"{function} (a per-call CollConfig)", COLL_CONFIG_SINCE, loaded
                )
            for c_name in self._c_fields:
                release = COLL_CONFIG_FIELD_RELEASE[c_name]
                if loaded < release:
                    raise NotSupportedError(
                        f"ncclCollConfig_t.{c_name} (CollConfig.{_py_name(c_name)})",
                        release,
                        loaded,
                        "an older library would silently ignore it",
                    )
        return self._pointer


def _py_name(c_name: str) -> str:
    for name, c in _C_NAMES.items():
        if c == c_name:
            return name
    return c_name  # pragma: no cover - every C name is in FIELDS


def _alg_selection(alg_selection: object) -> bytes:
    """``alg_selection`` as the C string NCCL reads."""
    if type(alg_selection) is not str:
        raise TypeError(
            f"alg_selection must be a str (NCCL's algorithm selection string), "
            f"got {type(alg_selection).__name__} {alg_selection!r}"
        )
    if "\0" in alg_selection:
        raise ValueError(f"alg_selection must not contain NUL: {alg_selection!r}")
    return alg_selection.encode()


def _profiler_tag(user_profiler_tag: object) -> int:
    """``user_profiler_tag`` checked: NCCL reserves the tags with the top bit set."""
    tag = index_int(user_profiler_tag, "user_profiler_tag")
    if not 0 <= tag < 1 << 63:
        raise ValueError(
            f"user_profiler_tag={tag} is out of range; expected 0 <= user_profiler_tag "
            "< 2**63 (NCCL reserves the tags with the top bit set)"
        )
    return tag
