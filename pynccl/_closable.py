"""The one shape of a resource freed by ``close()``: a context manager that closes it on
exit, and (for what a subclass says it still holds) a ``__del__`` that closes it quietly —
at interpreter shutdown or in a dead CUDA context there is no one to report to."""

from __future__ import annotations

__all__ = ["Closable"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import TypeVar

    _T = TypeVar("_T", bound="Closable")


class Closable:
    """Base of pynccl's closable objects (``Stream``, ``Event``, ``Graph``,
    ``DeviceBuffer``, ``Registration``, ``Window``, ``PersistentOp``)."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError  # pragma: no cover - every subclass defines it

    def _held(self) -> bool:
        """Whether ``__del__`` must close: something is still owned and freeing it needs
        no other rank (a window's deregistration is collective: never from ``__del__``)."""
        return False

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._held():
            try:
                self.close()
            except Exception:  # interpreter shutdown or a dead context
                pass
