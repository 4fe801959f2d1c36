"""The argument rules every layer above the ctypes layer applies: one place, one wording.

ctypes converts a Python int for a C parameter faithfully *and silently wraps* one that does
not fit (a ``size_t`` of ``2**64 + 5`` arrives as 5, an ``int`` of ``2**32`` as 0). The
object API, the adaptation layer and the tools refuse such values here, before any C call,
with the same exception type and message shape wherever the same mistake is made:

* a value of the wrong *type* raises :class:`TypeError` naming the argument, the type
  found and what was expected;
* a value of the right type but out of range raises :class:`ValueError` naming the
  argument, the value and the range.

Integers are ``int`` or any object with ``__index__`` (numpy integers); ``bool`` and
``float`` never count as integers, even where they compare equal to one. A numpy bool
(``numpy.True_``) is a bool everywhere: refused wherever ``bool`` is (:func:`is_bool`).
"""

from __future__ import annotations

TYPE_CHECKING = False  # not imported from typing: keeps import cheap; mypy reads it as true
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "C_INT_MAX",
    "C_INT_MIN",
    "ON_HANG",
    "U64",
    "check_c_int",
    "check_count",
    "check_device_ordinal",
    "check_extent",
    "check_flag",
    "check_index",
    "check_on_hang",
    "check_pointer",
    "check_timeout",
    "index_int",
    "is_bool",
    "is_pointer_object",
    "pointer_int",
]

#: One past the largest ``size_t`` / pointer value on the platforms NCCL supports.
U64 = 1 << 64
C_INT_MIN = -(1 << 31)
C_INT_MAX = (1 << 31) - 1


def index_int(value: Any, name: str, expected: str = "an int") -> int:
    """``value`` as a plain int: an ``int`` or an ``__index__`` object, never bool/float.

    Raises ``TypeError("{name} must be {expected}, got {type} {value!r}")`` otherwise.
    """
    if type(value) is int:
        return value
    if isinstance(value, (bool, float)) or is_bool(value):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    index = getattr(type(value), "__index__", None)
    if index is None:
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    try:
        result = index(value)
    except Exception as exc:  # a broken __index__ is a bad argument, not our crash
        raise TypeError(
            f"{name} must be {expected}, got {type(value).__name__} {value!r} ({exc})"
        ) from None
    if type(result) is not int:
        result = int(result)
    return result


def check_count(value: Any, name: str = "count") -> int:
    """An element count for a ``size_t`` parameter: an integer in [0, 2**64)."""
    if type(value) is int and 0 <= value < U64:
        return value
    n = index_int(value, name, "a non-negative int")
    if not 0 <= n < U64:
        raise ValueError(f"{name}={n} is out of range; expected 0 <= {name} < 2**64")
    return n


def check_c_int(
    value: Any, name: str, lo: int = C_INT_MIN, hi: int = C_INT_MAX, what: str = ""
) -> int:
    """An integer for a C ``int`` parameter, in [lo, hi] (both inclusive).

    ``what`` (e.g. ``"for a communicator of size 4"``) ends the range message.
    """
    if type(value) is int and lo <= value <= hi:
        return value
    n = index_int(value, name)
    if not lo <= n <= hi:
        tail = f" {what}" if what else ""
        raise ValueError(f"{name}={n} is out of range; expected {lo} <= {name} <= {hi}{tail}")
    return n


def check_index(value: Any, name: str, size: int, what: str = "") -> int:
    """A 0-based index (rank, root, peer, device) below ``size``."""
    if type(value) is int and 0 <= value < size:
        return value
    n = index_int(value, name)
    if not 0 <= n < size:
        tail = f" {what}" if what else ""
        raise ValueError(f"{name}={n} is out of range; expected 0 <= {name} < {size}{tail}")
    return n


def check_device_ordinal(value: Any, name: str = "device") -> int:
    """A CUDA device ordinal for a C ``int``: an integer (``int``/``__index__``) in
    [0, 2**31), or an object whose ``device_id`` is one (a cuda.core ``Device``)."""
    if type(value) is int and 0 <= value <= C_INT_MAX:
        return value
    if not hasattr(type(value), "__index__"):
        device_id = getattr(value, "device_id", None)
        if device_id is not None and not isinstance(value, (bool, float, str, bytes)):
            return check_c_int(device_id, f"{name}.device_id", 0)
    return check_c_int(value, name, 0)


def is_pointer_object(value: Any) -> bool:
    """cuda.bindings' pointer types (``CUdeviceptr``): ``__int__`` gives the address, but
    they have no ``__index__``. Recognised by type, without importing cuda.bindings."""
    cls = type(value)
    return cls.__name__ == "CUdeviceptr" and cls.__module__.startswith("cuda.bindings")


def pointer_int(value: Any, name: str) -> int:
    """``value`` as a pointer-sized int: an ``int``/``__index__`` object (never bool or
    float), or a cuda.bindings ``CUdeviceptr``. Range checks are :func:`check_pointer`'s."""
    if type(value) is int:
        return value
    if is_pointer_object(value):
        return int(value)
    return index_int(value, name, "a pointer (int)")


def check_pointer(value: Any, name: str, nbytes: int = 1) -> int:
    """A device address for ``nbytes`` bytes: an integer in (0, 2**64) such that the range
    ``[ptr, ptr + nbytes)`` does not pass 2**64. NULL is accepted only when ``nbytes`` is 0
    (NCCL reads nothing then). A cuda.bindings ``CUdeviceptr`` counts as its address."""
    ptr = pointer_int(value, name)
    if ptr < 0 or ptr >= U64:
        raise ValueError(f"{name}={ptr:#x} is not a valid pointer; expected 0 < {name} < 2**64")
    if ptr == 0:
        if nbytes:
            raise ValueError(f"{name} is a NULL pointer but {nbytes} bytes are needed there")
        return 0
    if ptr + nbytes > U64:
        raise ValueError(
            f"{name}={ptr:#x} + {nbytes} bytes passes the end of the address space (2**64)"
        )
    return ptr


def check_extent(count: int, itemsize: int, name: str) -> int:
    """``count * itemsize`` bytes, refused at 2**64 and beyond (no address range is that
    large; ctypes would wrap it)."""
    nbytes = count * itemsize
    if nbytes >= U64:
        raise ValueError(
            f"{name} spans {count} elements of {itemsize} bytes = {nbytes} bytes; "
            "expected fewer than 2**64 bytes"
        )
    return nbytes


def check_timeout(value: Any, name: str = "timeout") -> float | None:
    """A timeout in seconds: None (wait forever) or a finite number > 0 (bool and numpy
    bool refused; a number too large for a float is out of range, not an OverflowError)."""
    if value is None:
        return None
    if isinstance(value, (bool, str, bytes)) or is_bool(value) or not hasattr(value, "__float__"):
        raise TypeError(
            f"{name} must be a number of seconds or None, got {type(value).__name__} {value!r}"
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int (or Fraction) of 2**1024 and up: no float holds it
        seconds = float("inf")
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be a number of seconds or None, got {type(value).__name__} {value!r}"
        ) from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{name}={value!r} is out of range; expected a finite number > 0")
    return seconds


#: What the watchdog may do to a hung communicator.
ON_HANG = ("abort", "revoke")


def check_on_hang(value: object, name: str = "on_hang") -> str:
    """``value`` if it is one of :data:`ON_HANG`, else ValueError naming it."""
    if type(value) is not str or value not in ON_HANG:
        raise ValueError(f"{name} must be 'abort' or 'revoke', got {value!r}")
    return value


# -- bools --------------------------------------------------------------------------------


def is_bool(value: object) -> bool:
    """True for a ``bool`` or a numpy bool (``numpy.True_``; told by its type's name, so
    numpy is not imported): neither is an integer, a number of seconds nor a handle here,
    though both convert to 0 and 1."""
    if isinstance(value, bool):
        return True
    cls = type(value)
    return cls.__module__ == "numpy" and cls.__name__ in ("bool", "bool_")


def check_flag(value: Any, name: str) -> bool:
    """A yes/no option: a ``bool`` or a numpy bool (as a ``bool``); an int, even 0 or 1, is
    refused (``TypeError`` naming ``name``)."""
    if value is True or value is False:
        return bool(value)
    if is_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
