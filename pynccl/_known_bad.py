"""NCCL releases with a known problem: release range -> what is wrong, where it is written
down, and the first release without it.

Every entry cites NCCL's own release notes or a GitHub issue; an entry is added only when
both ends of its range can be read from those sources (or from NCCL's source history,
noted in the entry). ``python -m pynccl info`` prints the loaded release's entries; loading
a libnccl that has one warns once (:class:`RuntimeWarning`) unless
``PYNCCL_NO_KNOWN_BAD_WARNING=1``.

Only the standard library: this runs when libnccl is first loaded.
"""

from __future__ import annotations

import os

__all__ = ["ENV_SILENCE", "KNOWN_BAD", "KnownIssue", "describe", "issues_for", "warn_once"]

#: Set to 1 to silence the load-time warning (``info`` still lists the entries).
ENV_SILENCE = "PYNCCL_NO_KNOWN_BAD_WARNING"

Release = tuple[int, int, int]


class KnownIssue:
    """One problem of a range of NCCL releases (both ends included)."""

    __slots__ = ("first", "fixed", "last", "source", "summary", "workaround")

    def __init__(
        self,
        first: Release,
        last: Release,
        summary: str,
        source: str,
        fixed: Release | None,
        workaround: str = "",
    ) -> None:
        self.first, self.last, self.summary, self.source = first, last, summary, source
        #: The first release without it, or None when no release fixes it (then ``workaround``).
        self.fixed = fixed
        self.workaround = workaround

    def covers(self, release: Release) -> bool:
        return self.first <= release <= self.last

    def __repr__(self) -> str:
        return f"KnownIssue({describe(self)!r})"


_NOTES = "https://github.com/NVIDIA/nccl/releases/tag/v{}-1"

KNOWN_BAD: tuple[KnownIssue, ...] = (
    KnownIssue(
        (2, 19, 0),
        (2, 19, 99),
        "cuMem allocation is on by default since 2.19 and raises the device memory that "
        "CUDA graph capture of NCCL calls takes (vLLM pinned 2.18 against it, then set "
        "NCCL_CUMEM_ENABLE=0)",
        "https://github.com/NVIDIA/nccl/issues/1234 ; https://github.com/vllm-project/vllm/pull/5091",
        None,
        "NCCL_CUMEM_ENABLE=0",
    ),
    KnownIssue(
        (2, 26, 2),
        (2, 26, 5),
        "the profiler plugin v2 compatibility layer is broken (profiler_v3 dropped "
        "trafficBytes, so v2 event descriptors are misread)",
        _NOTES.format("2.26.6"),
        (2, 26, 6),
    ),
    KnownIssue(
        (2, 26, 2),
        (2, 27, 3),
        "CUDA graph capture overhead increased for large graphs",
        _NOTES.format("2.27.5"),
        (2, 27, 5),
    ),
    KnownIssue(
        (2, 27, 0),
        (2, 27, 4),
        "NCCL_COLLNET_ENABLE is read once and cached: changing it between communicator "
        "inits (as Megatron-LM does) has no effect",
        "https://github.com/NVIDIA/nccl/issues/1741",
        (2, 27, 5),
    ),
    KnownIssue(
        (2, 27, 0),
        (2, 27, 4),
        "NCCL_NET_PLUGIN no longer accepts a path to the plugin",
        "https://github.com/NVIDIA/nccl/issues/1732",
        (2, 27, 5),
    ),
    KnownIssue(
        (2, 27, 5),
        (2, 27, 6),
        "init can fail on GPUs older than Blackwell while loading the fp8 symmetric "
        "multicast kernels",
        _NOTES.format("2.27.7"),
        (2, 27, 7),
    ),
    KnownIssue(
        (2, 27, 3),
        (2, 28, 6),
        "potential data corruption in the built-in symmetric kernels for small messages "
        "with a size granularity under 8 bytes, or several symmetric operations in one group",
        _NOTES.format("2.28.7"),
        (2, 28, 7),
    ),
    KnownIssue(
        (2, 29, 0),
        (2, 29, 2),
        "hang on ARM when NCCL is compiled with gcc < 10 (a compare-and-swap in the proxy's "
        "free-op list, added in 2.29.2, mishandles a weak failure)",
        _NOTES.format("2.29.3"),
        (2, 29, 3),
    ),
)

_warned: set[Release] = set()


def issues_for(release: Release) -> list[KnownIssue]:
    """The entries of :data:`KNOWN_BAD` whose range holds ``release`` ``(major, minor, patch)``."""
    if len(release) != 3 or not all(isinstance(x, int) for x in release):
        raise ValueError(f"release must be (major, minor, patch) integers, not {release!r}")
    key = (release[0], release[1], release[2])
    return [issue for issue in KNOWN_BAD if issue.covers(key)]


def _text(r: Release) -> str:
    return ".".join(str(x) for x in r)


def describe(issue: KnownIssue) -> str:
    """One line: range, what is wrong, the fix (or workaround) and the source."""
    span = (
        _text(issue.first)
        if issue.first == issue.last
        else (f"{_text(issue.first)}-{_text(issue.last)}")
    )
    if issue.fixed is not None:
        fix = f"fixed in {_text(issue.fixed)}"
    else:
        fix = f"no release fixes it; workaround: {issue.workaround}"
    return f"NCCL {span}: {issue.summary} ({fix}; see {issue.source})"


def warn_once(release: Release) -> None:
    """Warn (RuntimeWarning) once per process per release when ``release`` has known issues,
    unless ``PYNCCL_NO_KNOWN_BAD_WARNING=1``."""
    found = issues_for(release)
    if not found or release in _warned or os.environ.get(ENV_SILENCE, "") == "1":
        return
    _warned.add(release)
    import warnings

    lines = "\n".join(f"  - {describe(i)}" for i in found)
    warnings.warn(
        f"the loaded libnccl is NCCL {_text(release)}, which has known issues:\n{lines}\n"
        f"(set {ENV_SILENCE}=1 to silence this warning)",
        RuntimeWarning,
        stacklevel=3,
    )
