"""The communicator's verbs beyond collectives: ``split`` and custom reduction ops
(``create_premul_sum`` / ``destroy_op``). Buffer registration is in :mod:`._memory`."""

from __future__ import annotations

from ctypes import byref, c_int, c_void_p

from .._adapt import as_buffer
from .._capi.structs import NCCL_SPLIT_NOCOLOR
from .._limits import C_INT_MAX, check_c_int
from ..dtypes import as_datatype
from ..enums import DataType, Result, ScalarResidence
from ..errors import NotSupportedError
from ._handle import HANDLE
from ._observe import Observed

__all__ = ["Extras"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ctypes import c_int as _CInt

    from ..typing import DTypeLike
    from ._communicator import Communicator
    from ._config import Config


class Extras(Observed):
    """split and custom ops (a base of Communicator)."""

    __slots__ = ("_blocking", "_codes", "_config", "_custom_ops")

    _blocking: bool
    _codes: dict[DataType, _CInt | None]
    _custom_ops: set[int]
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
        ``color=None`` (``NCCL_SPLIT_NOCOLOR``) takes no part and returns ``None``."""
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
        return self._new_comm("ncclCommSplit", (HANDLE, color, key), (), config)

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

        ``residence="host"`` reads ``scalar`` (a Python number) now;
        ``residence="device"`` takes a device pointer (int) read while the collective
        runs. Release the op with :meth:`destroy_op`.
        """
        self._live()
        dt = self._datatype(dtype)
        if residence in ("host", ScalarResidence.HOST_IMMEDIATE):
            import numpy as np

            from ..dtypes import to_numpy_dtype

            value = np.array([scalar], dtype=to_numpy_dtype(dt))
            ptr, res, keep = value.ctypes.data, ScalarResidence.HOST_IMMEDIATE, value
        elif residence in ("device", ScalarResidence.DEVICE):
            ptr, _, _, _ = as_buffer(scalar, 1, dt, name="scalar")  # type: ignore[arg-type]
            res, keep = ScalarResidence.DEVICE, None
        else:
            raise ValueError(f"residence must be 'host' or 'device', got {residence!r}")
        op = c_int()
        self._call_locked("ncclRedOpCreatePreMulSum", byref(op), ptr, int(dt), int(res), HANDLE)
        del keep  # read by NCCL during the call above
        self._custom_ops.add(op.value)
        return op.value

    def destroy_op(self, op: int) -> None:
        """``ncclRedOpDestroy`` for an op made by :meth:`create_premul_sum`."""
        if op not in self._custom_ops:
            raise ValueError(f"op {op!r} was not created on this communicator")
        self._call_locked("ncclRedOpDestroy", op, HANDLE)
        self._custom_ops.discard(op)
