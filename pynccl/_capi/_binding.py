"""Lazy, version-aware binding of a C library from a prototype table.

Shared by the libnccl and libcudart tables: each function is looked up on
first use, given its restype/argtypes, wrapped in a generated checking
function (with the C argument names, no ``*args`` overhead) and cached on the
instance, so later calls are a plain attribute lookup.
"""

from __future__ import annotations

import ctypes
from _thread import RLock
from collections import namedtuple
from ctypes import addressof, byref, c_char, c_char_p, c_int, c_size_t, c_void_p

from ..enums import release_str
from ..errors import NotSupportedError

# `typing` (and the `re` and `contextlib` it imports) costs milliseconds: kept out of
# `from pynccl import Communicator`; mypy treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, ClassVar, NamedTuple

    from ..enums import Release

__all__ = [
    "COUNT_ARGS",
    "COUNT_ARGS_LIMIT",
    "PTR_ARGS",
    "PTR_ARGS_LIMIT",
    "SIZE_ARGS",
    "SIZE_ARGS_LIMIT",
    "BoundLibrary",
    "Prototype",
    "arg_value",
    "count_arg",
    "pointer_arg",
    "ptr_arg",
    "size_arg",
]

#: Most shared c_size_t objects :data:`SIZE_ARGS` keeps.
SIZE_ARGS_LIMIT = 4096


#: Counts repeat (the same buffers, call after call) and ctypes converts a c_size_t
#: object for a ``size_t`` parameter much faster than an int, so the low-level wrappers'
#: ``count`` and the Communicator's hot paths pass these: shared, never mutated, keyed by
#: the int (at most SIZE_ARGS_LIMIT kept). A plain dict (a subclass with ``__missing__``
#: defeats the interpreter's specialised subscript): hot paths look a count up with
#: ``try: SIZE_ARGS[n] except KeyError: size_arg(n)``, which costs one subscript on a hit.
SIZE_ARGS: dict[int, c_size_t] = {}


def size_arg(count: int) -> c_size_t:
    """``count`` as a shared c_size_t (the value ctypes would convert it to), kept in
    :data:`SIZE_ARGS` while it holds fewer than :data:`SIZE_ARGS_LIMIT`."""
    arg = SIZE_ARGS.get(count)
    if arg is None:
        arg = c_size_t(count)
        if len(SIZE_ARGS) < SIZE_ARGS_LIMIT:
            SIZE_ARGS[count] = arg
    return arg


#: Most shared pointer arguments :data:`PTR_ARGS` keeps before it starts afresh.
PTR_ARGS_LIMIT = 4096
_P63 = 1 << 63

#: A ctypes type of no size: an object of it made at an address reads nothing there.
_AT = c_char * 0
#: The type of what ``byref`` returns: ctypes passes one to a function without argtypes
#: as it is (no conversion, no object made per call), and ``c_void_p`` argtypes take it.
_CARG: type = type(byref(c_int()))


def pointer_arg(address: int) -> Any:
    """``address`` (in [1, 2**64)) as a pointer argument object: ``byref`` of an object
    of no size made at ``address``, whose C value is ``address`` itself (a ``void *``).
    A function without argtypes passes it with no conversion at all — unlike a
    ``c_void_p`` object, for which ctypes makes a new argument object at every call —
    and a ``c_void_p`` parameter with argtypes takes it as it is. Nothing is ever read
    or written at ``address``."""
    return byref(_AT.from_address(address))


#: Device pointers repeat (a framework's buffers, call after call): the Communicator's
#: hot paths pass these pointer arguments (:func:`pointer_arg`), shared and never
#: mutated, keyed by the address. Only addresses in [1, 2**63) are kept, so a hit is also
#: a range check passed (the hot path checks an address only when it misses). Unlike
#: counts, the set of live addresses drifts as memory is freed and reallocated, so a full
#: cache is emptied and refilled rather than frozen (objects already handed out stay
#: valid: nothing mutates them). Hot paths look an address up with
#: ``try: PTR_ARGS[p] except KeyError: ptr_arg(p)``.
PTR_ARGS: dict[int, Any] = {}


def ptr_arg(address: int) -> Any:
    """``address`` (an int in [0, 2**64)) as a C pointer argument: None (NULL) for 0, the
    shared :func:`pointer_arg` of :data:`PTR_ARGS` for an address in [1, 2**63), else a
    new one. :func:`arg_value` reads it back."""
    arg = PTR_ARGS.get(address)
    if arg is None:
        if not address:
            return None
        arg = pointer_arg(address)
        if 0 < address < _P63:
            if len(PTR_ARGS) >= PTR_ARGS_LIMIT:
                PTR_ARGS.clear()
            PTR_ARGS[address] = arg
    return arg


#: Most shared count arguments :data:`COUNT_ARGS` keeps.
COUNT_ARGS_LIMIT = 4096

#: Counts (``size_t``) as the hot paths pass them to functions *without* argtypes: the
#: pointer argument of the count's value (:func:`pointer_arg`). A ``size_t`` and a
#: pointer are passed alike on every ABI NCCL runs on (LP64 x86-64, aarch64, ppc64le: both
#: the machine word, in the same registers and stack slots), and a pointer argument is
#: passed with no object made per call, where a ``c_size_t`` makes one at every call.
#: Shared, never mutated, keyed by the count (at most COUNT_ARGS_LIMIT kept). Functions
#: with argtypes take :data:`SIZE_ARGS` instead (a ``c_size_t`` parameter refuses these).
COUNT_ARGS: dict[int, Any] = {}


def count_arg(count: int) -> Any:
    """``count`` (an int in [0, 2**64)) as a ``size_t`` argument for a function without
    argtypes: the shared one of :data:`COUNT_ARGS` for a count below 2**63 (kept while it
    holds fewer than :data:`COUNT_ARGS_LIMIT`), else a new one. :func:`arg_value` reads it
    back."""
    arg = COUNT_ARGS.get(count)
    if arg is None:
        arg = pointer_arg(count)
        if 0 <= count < _P63 and len(COUNT_ARGS) < COUNT_ARGS_LIMIT:
            COUNT_ARGS[count] = arg
    return arg


def arg_value(arg: object) -> object:
    """A C argument as the hot paths pass it — an int, None (NULL), a pointer or count
    argument (:func:`ptr_arg`, :func:`count_arg`), or a ctypes ``c_void_p``/``c_int``/
    ``c_size_t`` object — as a plain value: an int for each of those (0 for NULL); anything else as it is."""
    if type(arg) is int or arg is None:
        return arg or 0
    if type(arg) is _CARG:
        return addressof(arg._obj)  # type: ignore[attr-defined]  # CArgObject's referent
    if isinstance(arg, (c_void_p, c_int, c_size_t)):
        return arg.value or 0
    return arg


if TYPE_CHECKING:

    class Prototype(NamedTuple):
        """``first`` release exporting it, C return type, and ``(name, ctype)`` arguments."""

        first: Release
        restype: Any
        args: tuple[tuple[str, Any], ...]

else:  # the same tuple type, without typing.NamedTuple's class machinery at import
    Prototype = namedtuple("Prototype", ("first", "restype", "args"))
    Prototype.__doc__ = (
        "``first`` release exporting it, C return type, and ``(name, ctype)`` arguments."
    )


def _generate(
    name: str,
    proto: Prototype,
    cfunc: Any,
    fail: Callable[[int, str], Any],
    ok: Any,
    doc: str,
    enum_args: dict[str, tuple[type, dict[Any, Any]]],
    value_result: bool = False,
) -> Any:
    params = ", ".join(arg for arg, _ in proto.args)
    namespace: dict[str, Any] = {"_cfunc": cfunc, "_fail": fail, "_ok": ok}
    # An enum member for a C int parameter (DataType for `datatype`, ...) becomes the
    # same value as a shared c_int, which ctypes converts much faster; others pass as given.
    # A plain int ``count`` (size_t) becomes its shared c_size_t (:data:`SIZE_ARGS`): the
    # same value, converted faster.
    prologue = ""
    for arg, ctype in proto.args:
        if ctype is c_int and arg in enum_args:
            namespace[f"_E_{arg}"], namespace[f"_C_{arg}"] = enum_args[arg]
            prologue += f"    if type({arg}) is _E_{arg}:\n        {arg} = _C_{arg}[{arg}]\n"
        elif ctype is c_size_t and arg == "count":
            namespace["_SIZE_ARGS"], namespace["_size_arg"] = SIZE_ARGS, size_arg
            prologue += (
                f"    if type({arg}) is int:\n        try:\n"
                f"            {arg} = _SIZE_ARGS[{arg}]\n        except KeyError:\n"
                f"            {arg} = _size_arg({arg})\n"
            )
    if proto.restype is c_int and not value_result:
        # A nonzero code goes to _fail, which raises (or returns a non-error such as
        # ncclInProgress / cudaErrorNotReady).
        body = f"    rc = _cfunc({params})\n    if rc:\n        return _fail(rc, {name!r})\n    return _ok\n"
    elif proto.restype is c_char_p:
        body = (
            f"    text = _cfunc({params})\n"
            "    return '' if text is None else text.decode('utf-8', 'replace')\n"
        )
    else:  # void (None), or a value the C function returns (VALUE_RESULTS)
        body = f"    return _cfunc({params})\n"
    exec(f"def {name}({params}):\n{prologue}{body}", namespace)
    wrapper = namespace[name]
    wrapper.__doc__ = doc
    return wrapper


class BoundLibrary:
    """Base for a loaded library whose functions are attributes named as in C."""

    #: ``{C name: Prototype}``, set by subclasses.
    PROTOTYPES: ClassVar[dict[str, Prototype]] = {}
    #: What a successful checked call returns.
    OK: ClassVar[Any] = 0
    #: Library name used in messages.
    KIND: ClassVar[str] = "library"
    #: ``{C parameter name: (enum class, {member: c_int})}`` for C int parameters.
    ENUM_ARGS: ClassVar[dict[str, tuple[type, dict[Any, Any]]]] = {}
    #: Functions whose C ``int`` return is a value, returned as is (not a result code).
    VALUE_RESULTS: ClassVar[frozenset[str]] = frozenset()

    version: Release | None

    def __init__(self, cdll: ctypes.CDLL, path: str = "", rule: str = "explicit") -> None:
        self._cdll = cdll
        self.path = path or str(getattr(cdll, "_name", ""))
        self.rule = rule
        self.version = None
        # Reentrant: a __del__ that the GC runs while a name is being bound may bind another.
        self._lock = RLock()
        self._raw: dict[str, Any] = {}

    def has(self, name: str) -> bool:
        """True if the loaded library exports ``name`` (a C function name)."""
        try:
            self.raw(name)
        except (NotSupportedError, KeyError):
            return False
        return True

    def raw(self, name: str) -> Any:
        """The bare ctypes function ``name`` with restype/argtypes set; no result check.

        Raises ``KeyError`` for a name not in the prototype table and
        :class:`~pynccl.NotSupportedError` if the library does not export it.
        """
        cfunc = self._raw.get(name)
        if cfunc is not None:
            return cfunc
        proto = self.PROTOTYPES[name]
        # Bound once, under the lock: CDLL caches one function object per name, and two
        # threads setting its argtypes at once race inside ctypes without the GIL.
        with self._lock:
            cfunc = self._raw.get(name)
            if cfunc is not None:
                return cfunc
            try:
                cfunc = getattr(self._cdll, name)
            except AttributeError:
                raise NotSupportedError(
                    name, proto.first, self.version, f"{self.path} does not export it"
                ) from None
            cfunc.restype = proto.restype
            cfunc.argtypes = [ctype for _, ctype in proto.args]
            self._raw[name] = cfunc
        return cfunc

    def extension(self, name: str) -> Any | None:
        """A new ctypes function for ``name``, a symbol outside the prototype table (the
        loopback's ``pynccl_lb_*`` test hooks), or ``None`` if the library lacks it. The
        caller sets its restype and argtypes."""
        try:
            return self._cdll[name]
        except AttributeError:
            return None

    def bare(self, name: str) -> Any:
        """A new ctypes function object for ``name`` with its restype and *no* argtypes
        (so ctypes converts nothing): only for callers that pass every argument as a
        ctypes object of the C parameter's type (``c_void_p``, ``c_size_t``, ``c_int``,
        ``byref(...)``) — a bare int would be passed as a C ``int``. Raises as :meth:`raw`.
        """
        self.raw(name)
        cfunc = self._cdll[name]  # __getitem__ makes a new object; attributes are cached
        cfunc.restype = self.PROTOTYPES[name].restype
        return cfunc

    def __getattr__(self, name: str) -> Any:
        # Only reached while `name` is not bound yet; binding caches it on the instance.
        proto = self.PROTOTYPES.get(name)
        if proto is None or name.startswith("_"):
            raise AttributeError(f"{name!r} is not a function in pynccl's {self.KIND} table")
        with self._lock:
            bound = self.__dict__.get(name)
            if bound is None:
                bound = self._bind(name, proto)
                setattr(self, name, bound)
        return bound

    def _bind(self, name: str, proto: Prototype) -> Any:
        try:
            cfunc = self.raw(name)
        except NotSupportedError as exc:
            error = exc

            def unsupported(*args: Any, **kwargs: Any) -> Any:
                raise error

            unsupported.__name__ = unsupported.__qualname__ = name
            return unsupported
        doc = f"{name} (since {self.KIND} {release_str(proto.first)}); checked call."
        return _generate(
            name, proto, cfunc, self._fail, self.OK, doc, self.ENUM_ARGS, name in self.VALUE_RESULTS
        )

    def _fail(self, code: int, function: str) -> Any:
        raise NotImplementedError
