"""The communicator's verbs beyond collectives: ``split`` and custom reduction ops
(``create_premul_sum`` / ``destroy_op``). Buffer registration is in :mod:`._memory`."""

from __future__ import annotations

from ctypes import byref, c_int, c_void_p

from .. import groups as _groups
from .._adapt import as_buffer
from .._capi.structs import NCCL_SPLIT_NOCOLOR
from .._limits import C_INT_MAX, check_c_int, index_int, is_bool
from ..dtypes import as_datatype
from ..enums import DataType, Result, ScalarResidence
from ..errors import NotSupportedError
from ._core import Core
from ._handle import HANDLE, State

__all__ = ["Extras"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ctypes import c_int as _CInt
    from typing import Any

    from ..typing import DTypeLike
    from ._communicator import Communicator
    from ._config import Config


class Extras(Core):
    """split and custom ops (a base of Communicator)."""

    __slots__ = ("_blocking", "_codes", "_config", "_custom_ops")

    _blocking: bool
    _codes: dict[DataType, _CInt | None]
    #: Each live custom op: the object holding its device scalar (None: a host scalar or
    #: a raw pointer) and the streams it was issued on.
    _custom_ops: dict[int, tuple[object, set[int]]]
    _config: object

    def _child(self, handle: int, blocking: bool, cfg: object) -> Communicator:
        raise NotImplementedError  # pragma: no cover - Communicator defines it

    def _datatype(self, dtype: DTypeLike) -> DataType:
        dt = as_datatype(dtype)
        if self._codes[dt] is None:
            raise NotSupportedError(f"data type {dt.c_name}", dt.first_release, self._lib.version)
        return dt

    # -- splitting -----------------------------------------------------------------------

    def split(
        self, color: int | None, key: int | None = None, config: Config | None = None
    ) -> Communicator | None:
        """``ncclCommSplit`` (NCCL >= 2.18): every rank calls it; ranks with the same
        ``color`` form a new communicator, ordered by ``key`` (default: this rank).
        ``color=None`` (``NCCL_SPLIT_NOCOLOR``) takes no part and returns ``None``.
        A revoked communicator may be split (NCCL: "safe for destroy, split, and
        shrink")."""
        revoked = self._state is State.REVOKED
        if not revoked:
            self._live()
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
        key = self._rank if key is None else check_c_int(key, "key")
        self._refuse_if_capturing("ncclCommSplit")
        return self._new_comm("ncclCommSplit", (HANDLE, color, key), (), config, ready=not revoked)

    def _new_comm(
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
        written later by NCCL, so the parent is polled first."""
        cfg = None if config is None else config.to_struct(self._lib.version)
        out = c_void_p()
        result = self._call_locked(
            function, *pre, byref(out), None if cfg is None else byref(cfg), *post, ready=ready
        )
        blocking = (
            self._blocking if config is None or config.blocking is None else bool(config.blocking)
        )
        if result == Result.IN_PROGRESS or (not blocking and not out.value):
            self._mark_pending()  # the parent's own state; a revoked one stays revoked
            self.wait_ready()
        if not out.value:
            return None
        return self._child(out.value, blocking, cfg)

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
        self._live()
        dt = self._datatype(dtype)
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
        self._call_locked("ncclRedOpCreatePreMulSum", byref(op), ptr, int(dt), int(res), HANDLE)
        # NCCL reads a device scalar while each collective using the op runs: the object
        # holding it stays referenced (a raw pointer is the caller's to keep).
        device = None if res is ScalarResidence.HOST_IMMEDIATE or type(scalar) is int else scalar
        self._custom_ops[op.value] = (device, set())
        del keep
        return op.value

    def _note_op_use(self, op: int, stream: int) -> None:
        """A collective with custom op ``op`` is being issued on ``stream``: its device
        scalar must outlive that work (see :meth:`destroy_op`)."""
        entry = self._custom_ops.get(op)
        if entry is not None and entry[0] is not None:
            entry[1].add(stream)

    def destroy_op(self, op: int) -> None:
        """``ncclRedOpDestroy`` for an op made by :meth:`create_premul_sum`.

        A device scalar's buffer stays referenced until the work issued with the op on
        each stream has run (inside a group: until the group ends), so a stream-ordered
        allocator cannot hand its memory out while a collective still reads it."""
        value = index_int(op, "op", "an int op from create_premul_sum()")
        if value not in self._custom_ops:
            raise ValueError(f"op {value!r} was not created on this communicator")
        self._call_locked("ncclRedOpDestroy", value, HANDLE)
        device, streams = self._custom_ops.pop(value)
        if device is not None and not _groups.keep_alive(device) and streams:
            from ..cuda._stream import keep_until_done

            keep_until_done(device, streams, self._device)


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
