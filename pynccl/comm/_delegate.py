"""Communicator's methods implemented by its parts: ``name = delegate("_part", Part.name)``
is one typed line per method. The method keeps the part's name, docstring and signature
(``__wrapped__``), so help(), Sphinx and type checkers see the part's method."""

from __future__ import annotations

__all__ = ["delegate", "delegate_property"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

    P = ParamSpec("P")
    R = TypeVar("R")
    T = TypeVar("T")

    class ReadOnly(Generic[R]):
        """What a type checker sees of a delegated property: a read-only ``R``."""

        def __get__(self, obj: object, owner: object = None) -> R: ...


def delegate(part: str, method: Callable[Concatenate[T, P], R]) -> Callable[Concatenate[Any, P], R]:
    """A method calling ``method`` on the object at attribute ``part`` of ``self``."""

    def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(getattr(self, part), *args, **kwargs)

    _wraps(call, method)
    return call


def delegate_property(part: str, prop: Callable[[T], R]) -> ReadOnly[R]:
    """A read-only property reading property ``prop`` of the object at attribute ``part``
    (a type checker sees a class's property as its getter)."""
    fget = getattr(prop, "fget")  # noqa: B009 - typed as its getter, a property at run time

    def get(self: Any) -> R:
        return fget(getattr(self, part))  # type: ignore[no-any-return]

    _wraps(get, fget)
    return property(get, doc=prop.__doc__)  # type: ignore[return-value]


def _wraps(wrapper: Any, wrapped: Any) -> None:
    """``functools.update_wrapper`` without importing functools for it."""
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(wrapper, name, getattr(wrapped, name))
    wrapper.__wrapped__ = wrapped
