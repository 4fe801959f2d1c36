"""``pynccl.params``: NCCL's parameters (the ``ncclParam*`` API, NCCL >= 2.30.3) as a
read-only mapping of name -> value text, with typed getters.

NCCL registers a parameter when the subsystem that reads it first runs: before any
communicator exists only a few are known (2.32.3: the debug subsystem's seven), the rest
appear as the first communicator initialises. Asking for one not registered yet raises a
``KeyError`` that says so, rather than NCCL's bare ``ncclInvalidArgument``.

The key table NCCL returns lists the parameters of NCCL's documentation
(``NCCL_PARAM_DUMP_ALL=true`` lists all); a registered but unlisted parameter can still be
read by name. :mod:`pynccl.info` reads its report through :func:`keys` and :func:`text`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from ctypes import (
    POINTER,
    byref,
    c_char_p,
    c_int,
    c_int8,
    c_int16,
    c_int32,
    c_int64,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
    create_string_buffer,
)

__all__ = ["SINCE", "Params", "keys", "params", "text"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .._capi.nccl import NcclLibrary
    from ..enums import Release

#: The first release with the parameter API.
SINCE: Release = (2, 30, 3)
_INVALID_ARGUMENT = 4
_MAX_BYTES = 4096
# The integer getters, widest first (NCCL accepts only the parameter's own type).
_INT_GETTERS = (
    ("ncclParamGetI64", c_int64),
    ("ncclParamGetU64", c_uint64),
    ("ncclParamGetI32", c_int32),
    ("ncclParamGetU32", c_uint32),
    ("ncclParamGetI16", c_int16),
    ("ncclParamGetU16", c_uint16),
    ("ncclParamGetI8", c_int8),
    ("ncclParamGetU8", c_uint8),
)


def _lib(lib: NcclLibrary | None = None) -> NcclLibrary:
    if lib is None:
        from ..library import lib as load

        lib = load()
    lib.require("the parameter API (ncclParam*)", SINCE)
    return lib


def _name(key: object) -> bytes:
    if type(key) is not str:
        raise TypeError(f"a parameter name must be a str, got {type(key).__name__} {key!r}")
    return key.encode()


def _unknown(key: str, lib: NcclLibrary) -> KeyError:
    return KeyError(
        f"NCCL has no parameter {key!r} registered: NCCL registers most of its parameters "
        "when it initialises its first communicator in this process (before that only the "
        f"debug subsystem's are known; {len(keys(lib))} are listed now), and a name it "
        "does not know at all stays unknown"
    )


def keys(lib: NcclLibrary | None = None) -> list[str]:
    """The names in NCCL's key table now (``ncclParamGetAllParameterKeys``)."""
    L = _lib(lib)
    table = POINTER(c_char_p)()
    count = c_int(0)
    L.ncclParamGetAllParameterKeys(byref(table), byref(count))
    # The table is valid only until the next call on this thread: copy the names out.
    return [(table[i] or b"").decode("utf-8", "replace") for i in range(count.value)]


def text(key: str, lib: NcclLibrary | None = None) -> str | None:
    """``key``'s value as NCCL prints it (``ncclParamGetParameter``); None if unknown."""
    L = _lib(lib)
    value = c_char_p()
    length = c_int(0)
    if L.raw("ncclParamGetParameter")(_name(key), byref(value), byref(length)) != 0:
        return None
    raw = value.value or b""
    return raw[: max(length.value, 0)].decode("utf-8", "replace")


class Params(Mapping[str, str]):
    """NCCL's parameters: ``params[name]`` is the value as NCCL prints it (a str);
    iteration gives the names in NCCL's key table. Read-only. NCCL >= 2.30.3
    (:class:`~pynccl.NotSupportedError` before).

    Typed reads through the parameter's handle (``ncclParamBind``): :meth:`get_int`,
    :meth:`get_bool`, :meth:`get_str`, :meth:`get_bytes`. Each raises ``KeyError`` for
    a parameter NCCL has not registered (most are registered when the first communicator
    initialises) and ``TypeError`` when the parameter is of another type.
    """

    __slots__ = ()

    def __getitem__(self, key: str) -> str:
        L = _lib()
        value = text(key, L)
        if value is None:
            raise _unknown(key, L)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(keys())

    def __len__(self) -> int:
        return len(keys())

    def __contains__(self, key: object) -> bool:
        return type(key) is str and text(key) is not None

    def __repr__(self) -> str:
        try:
            return f"<pynccl.params: {len(self)} NCCL parameters listed>"
        except Exception as exc:  # no library, or one too old: say why
            return f"<pynccl.params: unavailable ({exc})>"

    # -- typed reads -------------------------------------------------------------------------

    def _handle(self, key: str) -> tuple[NcclLibrary, c_void_p]:
        L = _lib()
        h = c_void_p()
        rc = L.raw("ncclParamBind")(byref(h), _name(key))
        if rc == _INVALID_ARGUMENT or (rc == 0 and not h.value):
            raise _unknown(key, L)
        if rc:
            raise L.make_error(rc, "ncclParamBind")
        return L, h

    @staticmethod
    def _try(L: NcclLibrary, function: str, h: c_void_p, out: Any) -> bool:
        """One typed getter: True if it read, False if the parameter is of another type."""
        rc = L.raw(function)(h, byref(out))
        if rc == _INVALID_ARGUMENT:
            return False
        if rc:
            raise L.make_error(rc, function)
        return True

    def _raw(self, L: NcclLibrary, h: c_void_p, key: str) -> bytes:
        buf = create_string_buffer(_MAX_BYTES)
        length = c_int(0)
        rc = L.raw("ncclParamGet")(h, buf, _MAX_BYTES, byref(length))
        if rc:
            raise L.make_error(rc, "ncclParamGet")
        return buf.raw[: max(length.value, 0)]

    def _is_str(self, L: NcclLibrary, h: c_void_p) -> bool:
        return self._try(L, "ncclParamGetStr", h, c_char_p())

    def get_int(self, key: str) -> int:
        """An integer parameter's value (NCCL's typed getter of its type; an enum-valued
        one, such as ``NCCL_DEBUG``'s level, as its C ``int``)."""
        L, h = self._handle(key)
        for function, ctype in _INT_GETTERS:
            out = ctype()
            if self._try(L, function, h, out):
                return int(out.value)
        if self._is_str(L, h):
            raise TypeError(f"{key} is a string parameter, not an integer; use get_str()")
        raw = self._raw(L, h, key)
        if len(raw) not in (1, 2, 4, 8):
            raise TypeError(f"{key} is not an integer parameter (its value is {len(raw)} bytes)")
        return int.from_bytes(raw, "little", signed=True)

    def get_bool(self, key: str) -> bool:
        """A boolean parameter's value (``NCCL_SET_THREAD_NAME`` and the like)."""
        L, h = self._handle(key)
        if any(self._try(L, f, h, t()) for f, t in _INT_GETTERS[-2:]):
            raise TypeError(f"{key} is an integer parameter, not a boolean; use get_int()")
        if self._is_str(L, h):
            raise TypeError(f"{key} is a string parameter, not a boolean; use get_str()")
        raw = self._raw(L, h, key)
        if len(raw) != 1:
            raise TypeError(f"{key} is not a boolean parameter (its value is {len(raw)} bytes)")
        return raw != b"\0"

    def get_str(self, key: str) -> str:
        """A string parameter's value (``""`` when unset and without a default)."""
        L, h = self._handle(key)
        out = c_char_p()
        if not self._try(L, "ncclParamGetStr", h, out):
            raise TypeError(
                f"{key} is not a string parameter; params[{key!r}] gives any parameter's "
                "value as text, get_int()/get_bool() its typed value"
            )
        return (out.value or b"").decode("utf-8", "replace")

    def get_bytes(self, key: str) -> bytes:
        """The parameter's value in its native binary layout (``ncclParamGet``; requires
        NCCL >= 2.30.3)."""
        L, h = self._handle(key)
        return self._raw(L, h, key)


#: The one instance: ``pynccl.params``.
params = Params()
