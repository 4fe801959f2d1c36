"""The communicator's verbs beyond collectives: ``split`` (and the one way a parent makes
a child: split, shrink, grow) and custom reduction ops (``create_premul_sum`` /
``destroy_op``). Buffer registration is in :mod:`._memory`."""

from __future__ import annotations

from ctypes import byref, c_int, c_void_p

from .. import groups as _groups
from .._adapt import as_buffer
from .._capi.structs import NCCL_SPLIT_NOCOLOR
from .._limits import C_INT_MAX, check_c_int, index_int, is_bool
from ..enums import DataType, Result, ScalarResidence
from ._state import HANDLE, State

__all__ = ["Extras"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..typing import DTypeLike
    from ._communicator import Communicator
    from ._config import Config
    from ._suspend import Suspend

    #: Makes the child communicator of a new handle: (handle, blocking, config struct).
    MakeChild = Callable[[int, bool, object], Communicator]


class Extras:
    """split (and the children of shrink and grow) and custom ops: a part of
    :class:`~pynccl.Communicator`, over its core's public surface."""

    __slots__ = ("blocking", "core", "custom_ops", "make_child", "suspend")

    def __init__(
        self,
        core: Communicator,
        custom_ops: dict[int, tuple[object, set[int]]],
        make_child: MakeChild,
        suspend: Suspend,
    ) -> None:
        self.core = core
        #: Each live custom op: the object holding its device scalar (None: a host scalar
        #: or a raw pointer) and the streams it was issued on (the communicator's
        #: ``_custom_ops``).
        self.custom_ops = custom_ops
        self.make_child = make_child
        #: Whether a child inherits a blocking configuration (the parent's).
        self.blocking = True
        self.suspend = suspend  # a child may share the parent's memory manager

    # -- splitting -----------------------------------------------------------------------

    def split(
        self, color: int | None, key: int | None = None, config: Config | None = None
    ) -> Communicator | None:
        """``ncclCommSplit`` (NCCL >= 2.18): every rank calls it; ranks with the same
        ``color`` form a new communicator, ordered by ``key`` (default: this rank).
        ``color=None`` (``NCCL_SPLIT_NOCOLOR``) takes no part and returns ``None``.
        A revoked communicator may be split (NCCL: "safe for destroy, split, and
        shrink")."""
        core = self.core
        revoked = core.state is State.REVOKED
        if not revoked:
            core.live()
        if color is None:
            color = NCCL_SPLIT_NOCOLOR
        elif type(color) is int and color == NCCL_SPLIT_NOCOLOR:
            pass
        else:
            try:
                color = check_c_int(color, "color", 0, C_INT_MAX)
            except ValueError:
                raise ValueError(
                    f"color must be a non-negative int or None, got {color!r}"
                ) from None
        key = core.rank if key is None else check_c_int(key, "key")
        core.refuse_if_capturing("ncclCommSplit")
        return self.new_comm("ncclCommSplit", (HANDLE, color, key), (), config, ready=not revoked)

    def new_comm(
        self,
        function: str,
        pre: tuple[object, ...],
        post: tuple[object, ...],
        config: Config | None,
        ready: bool = True,
    ) -> Communicator | None:
        """``function(*pre, &newcomm, config, *post)`` with this communicator's handle for
        :data:`HANDLE` (split, shrink, grow), then the child once it is ready; None if NCCL
        made none (a split with ``NCCL_SPLIT_NOCOLOR``). Non-blocking: the new handle is
        written later by NCCL, so the parent is polled first. A child that shares this
        communicator's memory manager joins its group (:mod:`._suspend`)."""
        core = self.core
        shares = self.suspend.shares_memory(function, post)
        cfg = None if config is None else config.to_struct(core.library.version)
        out = c_void_p()
        result = core.call_locked(
            function, *pre, byref(out), None if cfg is None else byref(cfg), *post, ready=ready
        )
        blocking = (
            self.blocking if config is None or config.blocking is None else bool(config.blocking)
        )
        if result == Result.IN_PROGRESS or (not blocking and not out.value):
            core.mark_pending()  # the parent's own state; a revoked one stays revoked
            core.wait_ready()
        if not out.value:
            return None
        child = self.make_child(out.value, blocking, cfg)
        self.suspend.adopt_child(child, shares)
        return child

    # -- custom reduction ops ------------------------------------------------------------

    def create_premul_sum(
        self, scalar: object, dtype: DTypeLike, residence: ScalarResidence | str = "host"
    ) -> int:
        """``ncclRedOpCreatePreMulSum`` (NCCL >= 2.11): an op computing sum(scalar * x).

        ``residence="host"`` (or ``ScalarResidence.HOST_IMMEDIATE``) reads ``scalar`` now:
        a real number, exactly representable as ``dtype`` — for an integer type a whole
        number in its range, for a float type a finite number within its range (rounded
        to the nearest value of the type); bools, strings, None and sequences are refused.
        ``residence="device"`` (``ScalarResidence.DEVICE``) takes one element of device
        memory (a raw pointer, or an array or buffer, which the op keeps referenced until
        :meth:`destroy_op` and the work issued with it has run), read while each
        collective runs. Release the op with :meth:`destroy_op`.
        """
        core = self.core
        core.live()
        dt = core.datatype(dtype)
        res = _residence(residence)
        keep: object = None
        if res is ScalarResidence.HOST_IMMEDIATE:
            value = _host_scalar(scalar, dt)
            ptr = value.ctypes.data
            keep = value  # read by NCCL during the call below
        else:
            if is_bool(scalar):
                raise TypeError(f"scalar must be a device pointer or buffer, got {scalar!r}")
            ptr, _, _, _ = as_buffer(scalar, 1, dt, name="scalar")  # type: ignore[arg-type]
        op = c_int()
        core.call_locked("ncclRedOpCreatePreMulSum", byref(op), ptr, int(dt), int(res), HANDLE)
        # NCCL reads a device scalar while each collective using the op runs: the object
        # holding it stays referenced (a raw pointer is the caller's to keep).
        device = None if res is ScalarResidence.HOST_IMMEDIATE or type(scalar) is int else scalar
        self.custom_ops[op.value] = (device, set())
        del keep
        return op.value

    def note_op_use(self, op: int, stream: int) -> None:
        """A collective with custom op ``op`` is being issued on ``stream``: its device
        scalar must outlive that work (see :meth:`destroy_op`)."""
        entry = self.custom_ops.get(op)
        if entry is not None and entry[0] is not None:
            entry[1].add(stream)

    def destroy_op(self, op: int) -> None:
        """``ncclRedOpDestroy`` for an op made by :meth:`create_premul_sum`.

        A device scalar's buffer stays referenced until the work issued with the op on
        each stream has run (inside a group: until the group ends), so a stream-ordered
        allocator cannot hand its memory out while a collective still reads it."""
        value = index_int(op, "op", "an int op from create_premul_sum()")
        if value not in self.custom_ops:
            raise ValueError(f"op {value!r} was not created on this communicator")
        self.core.call_locked("ncclRedOpDestroy", value, HANDLE)
        device, streams = self.custom_ops.pop(value)
        if device is not None and not _groups.keep_alive(device) and streams:
            from ..cuda._stream import keep_until_done

            keep_until_done(device, streams, self.core.device)


def _residence(residence: object) -> ScalarResidence:
    """``residence`` as a ScalarResidence: ``"host"``, ``"device"``, a member or its int
    value (0 device, 1 host); a bool is neither."""
    if type(residence) is str:
        if residence == "host":
            return ScalarResidence.HOST_IMMEDIATE
        if residence == "device":
            return ScalarResidence.DEVICE
        raise ValueError(
            f"residence must be 'host' or 'device', got {residence!r} (or a "
            "pynccl.ScalarResidence)"
        )
    if isinstance(residence, ScalarResidence):
        return residence
    expected = "'host', 'device' or a pynccl.ScalarResidence"
    value = index_int(residence, "residence", expected)  # refuses bools and floats
    try:
        return ScalarResidence(value)
    except ValueError:
        raise ValueError(
            f"residence={value} is out of range; expected {expected} "
            "(0: device, 1: host)"
        ) from None


def _host_scalar(scalar: object, dt: DataType) -> Any:
    """``scalar`` as a one-element numpy array of ``dt``, exactly: an integer type takes a
    whole number in its range, a float type a finite real within its range."""
    import math
    import numbers

    import numpy as np

    from ..dtypes import canonical_name, to_numpy_dtype

    what = canonical_name(dt)
    if is_bool(scalar) or not isinstance(scalar, numbers.Real):
        raise TypeError(
            f"scalar must be a real number for a {what} PreMulSum, got "
            f"{type(scalar).__name__} {scalar!r}"
        )
    np_type = to_numpy_dtype(dt)
    if dt.is_integer:
        try:
            whole = int(scalar)  # type: ignore[call-overload]
        except (OverflowError, ValueError):  # inf, nan
            whole = None
        if whole is None or whole != scalar:
            raise ValueError(
                f"scalar={scalar!r} is not a whole number; a {what} PreMulSum takes integers"
            )
        info = np.iinfo(np_type)
        if not info.min <= whole <= info.max:
            raise ValueError(
                f"scalar={whole} is out of range; expected {info.min} <= scalar <= "
                f"{info.max} for {what}"
            )
        return np.array([whole], dtype=np_type)
    try:
        number = float(scalar)
    except OverflowError:  # an int or Fraction beyond every float
        number = math.inf
    if math.isfinite(number):
        with np.errstate(over="ignore"):
            value = np.array([number], dtype=np_type)
        if np.isfinite(value.astype(np.float64)[0]):
            return value
    largest = _largest(np_type)
    raise ValueError(
        f"scalar={scalar!r} is out of range; expected a finite number of magnitude at most "
        f"{largest} for {what}"
    )


def _largest(np_type: Any) -> object:
    import numpy as np

    try:
        return np.finfo(np_type).max
    except (TypeError, ValueError):  # bfloat16, float8: ml_dtypes' own finfo
        import ml_dtypes

        return ml_dtypes.finfo(np_type).max  # type: ignore[no-untyped-call]
