"""Typed errors for NCCL results, CUDA runtime errors and missing features.

``NcclError(result, function, message)`` picks the subclass for ``result``
itself, so code that maps a C return code never needs a lookup of its own.
Every error pickles, since errors cross process boundaries (launchers,
multiprocessing pools).
"""

from __future__ import annotations

from .enums import Result

TYPE_CHECKING = False  # not imported from typing: keeps `import pynccl` fast
if TYPE_CHECKING:
    from typing import Any, ClassVar

__all__ = [
    "CudaError",
    "LibraryNotFoundError",
    "NcclError",
    "NcclInProgress",
    "NcclInternalError",
    "NcclInvalidArgument",
    "NcclInvalidUsage",
    "NcclRemoteError",
    "NcclSystemError",
    "NcclTimeoutError",
    "NcclUnhandledCudaError",
    "NotSupportedError",
]


def _as_result(code: int) -> Result | int:
    try:
        return Result(code)
    except ValueError:
        return int(code)


class NcclError(RuntimeError):
    """An NCCL call returned an error.

    ``result`` is a :class:`~pynccl.Result` (a plain ``int`` for a code this
    binding does not know), ``function`` the C function that failed.
    ``NcclError(result, ...)`` returns the subclass that matches ``result``.
    """

    result_code: ClassVar[Result | None] = None
    _by_result: ClassVar[dict[int, type[NcclError]]] = {}

    result: Result | int
    function: str
    message: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.result_code is not None:
            NcclError._by_result[int(cls.result_code)] = cls

    def __new__(cls, result: int, function: str = "", message: str = "") -> NcclError:
        if cls is NcclError:
            cls = NcclError._by_result.get(int(result), NcclError)
        return super().__new__(cls)

    def __init__(self, result: int, function: str = "", message: str = "") -> None:
        super().__init__(result, function, message)
        self.result = _as_result(result)
        self.function = function
        self.message = message

    def __str__(self) -> str:
        name = self.result.c_name if isinstance(self.result, Result) else f"result {self.result}"
        text = self.message or name
        return f"{self.function}: {text}" if self.function else text

    def __reduce__(self) -> tuple[Any, ...]:
        return (NcclError, (int(self.result), self.function, self.message))


class NcclUnhandledCudaError(NcclError):
    """``ncclUnhandledCudaError``: a CUDA call inside NCCL failed."""

    result_code = Result.UNHANDLED_CUDA_ERROR


class NcclSystemError(NcclError):
    """``ncclSystemError``: a system call (socket, malloc, ...) failed."""

    result_code = Result.SYSTEM_ERROR


class NcclInternalError(NcclError):
    """``ncclInternalError``: an NCCL bug or memory corruption."""

    result_code = Result.INTERNAL_ERROR


class NcclInvalidArgument(NcclError):
    """``ncclInvalidArgument``: a bad argument reached NCCL."""

    result_code = Result.INVALID_ARGUMENT


class NcclInvalidUsage(NcclError):
    """``ncclInvalidUsage``: a call in the wrong state or order."""

    result_code = Result.INVALID_USAGE


class NcclRemoteError(NcclError):
    """``ncclRemoteError`` (NCCL >= 2.13.4): a peer failed or went away."""

    result_code = Result.REMOTE_ERROR


class NcclInProgress(NcclError):
    """``ncclInProgress`` where completion was required (non-blocking comm not ready)."""

    result_code = Result.IN_PROGRESS


class NcclTimeoutError(NcclError):
    """``ncclTimeout`` (NCCL >= 2.30.3), or a pynccl-side timeout waiting for NCCL."""

    result_code = Result.TIMEOUT


class NotSupportedError(NotImplementedError):
    """The loaded library lacks a function, type, op or config field.

    ``feature`` names what is missing, ``required`` is the first NCCL release
    that has it, ``loaded`` the version of the library in use.
    """

    def __init__(
        self,
        feature: str,
        required: tuple[int, int, int] | None = None,
        loaded: tuple[int, int, int] | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(feature, required, loaded, detail)
        self.feature = feature
        self.required = required
        self.loaded = loaded
        self.detail = detail

    def __str__(self) -> str:
        parts = [f"{self.feature} is not supported by the loaded NCCL"]
        if self.loaded is not None:
            parts[0] += " " + ".".join(map(str, self.loaded))
        if self.required is not None:
            parts.append(f"it requires NCCL >= {'.'.join(map(str, self.required))}")
        if self.detail:
            parts.append(self.detail)
        return "; ".join(parts)


class CudaError(RuntimeError):
    """A CUDA runtime call failed: ``code`` (``cudaError_t``), ``name``, ``function``."""

    def __init__(
        self, code: int, function: str = "", name: str = "", description: str = ""
    ) -> None:
        super().__init__(code, function, name, description)
        self.code = int(code)
        self.function = function
        self.name = name or f"cudaError {code}"
        self.description = description

    def __str__(self) -> str:
        text = f"{self.name} ({self.code})"
        if self.description:
            text += f": {self.description}"
        return f"{self.function}: {text}" if self.function else text


class LibraryNotFoundError(OSError):
    """No usable ``library`` was found; ``tried`` lists ``(candidate, reason)`` pairs."""

    def __init__(self, library: str, tried: list[tuple[str, str]]) -> None:
        super().__init__(library, tried)
        self.library = library
        self.tried = list(tried)

    def __str__(self) -> str:
        lines = [f"could not load {self.library}; tried:"]
        lines += [f"  - {candidate}: {reason}" for candidate, reason in self.tried]
        if not self.tried:
            lines.append("  (no candidates)")
        return "\n".join(lines)
