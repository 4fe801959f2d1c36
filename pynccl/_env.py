"""Every ``PYNCCL_*`` environment variable pynccl reads, in one table; a warning for a set
one that is not among them (a typo is otherwise silently ignored); and the redaction of
secrets wherever pynccl writes the environment out (``perf -J``, ``info``).

Only the standard library: this runs when the libraries are first loaded.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not imported from typing: this runs at the first library load
if TYPE_CHECKING:
    from collections.abc import Mapping

#: name -> what it does. The loopback's variables are read by its C libraries (the README
#: lists their rules); the ``PYNCCL_PERF_*`` ones are set by ``perf`` for its own ranks.
KNOWN: dict[str, str] = {
    "PYNCCL_NCCL_LIBRARY": "path of the libnccl to load",
    "PYNCCL_CUDART_LIBRARY": "path of the libcudart to load",
    "PYNCCL_RENDEZVOUS_KEY": "shared secret authenticating the TCP unique-id rendezvous",
    "PYNCCL_NO_KNOWN_BAD_WARNING": "1: no warning when the loaded libnccl has known issues",
    "PYNCCL_RENDEZVOUS_REPORT": "seconds between rendezvous lines naming missing ranks (30)",
    "PYNCCL_INIT_REPORT": "seconds between ncclCommInitRank lines naming missing ranks (30)",
    "PYNCCL_LAUNCHER": "set by python -m pynccl launch for its ranks",
    "PYNCCL_FLIGHT_DIR": "where each rank dumps its flight record (rank<R>.json)",
    "PYNCCL_FLIGHT_STACKS": "1: the flight record keeps the Python line of each operation",
    "PYNCCL_TRACE_ALGORITHMS": "1: NCCL's TUNING lines to a file, read by pynccl.tuning",
    "PYNCCL_CACHE_DIR": "where the loopback libraries are built (default ~/.cache/pynccl)",
    "PYNCCL_PERF_NGPUS": "set by python -m pynccl perf for the ranks it launches",
    "PYNCCL_PERF_J_PATH": "set by python -m pynccl perf for the ranks it launches",
    "PYNCCL_LOOPBACK_DEVICES": "loopback: number of emulated devices (default 8)",
    "PYNCCL_LOOPBACK_STRICT": "loopback: 0 accepts buffers outside loopback allocations",
    "PYNCCL_LOOPBACK_DEBUG": "loopback: 1 prints every libcudart error on stderr",
    "PYNCCL_LOOPBACK_FAIL_INIT": "loopback fault injection: every init returns this result",
    "PYNCCL_LOOPBACK_ASYNC_ERROR_AFTER": "loopback fault injection: an async error after N ops",
    "PYNCCL_LOOPBACK_HANG": "loopback fault injection: the N-th operation blocks until abort",
    "PYNCCL_LOOPBACK_NONBLOCKING_DELAY": "loopback: polls before a non-blocking comm is ready",
    "PYNCCL_LOOPBACK_INIT_TIMEOUT": "loopback: seconds an init waits for its ranks (300)",
    "PYNCCL_LOOPBACK_CHUNK_BYTES": "loopback: collective slot size per rank",
    "PYNCCL_LOOPBACK_RING_BYTES": "loopback: p2p ring size per ordered pair of ranks",
    "PYNCCL_LOOPBACK_RENDEZVOUS_DIR": "loopback: ranks meet through a socket file there",
    "PYNCCL_LOOPBACK_DIRECT": "loopback: 0 stages every collective through shared memory",
    "PYNCCL_LOOPBACK_SPIN": "loopback: busy-wait pauses before sleeping",
    "PYNCCL_LOOPBACK_YIELDS": "loopback: sched_yield()s before sleeping",
    "PYNCCL_GPU_REHEARSAL": "tests: run the GPU checks on the loopback",
    "PYNCCL_GPU_REHEARSAL_DEVICES": "tests: devices of a GPU rehearsal",
}
#: Prefixes reserved for pynccl's own test suite (its workers' settings).
RESERVED_PREFIXES = ("PYNCCL_TEST_",)

# A variable whose value is a secret, by these words in its name (any case): never written
# out. Substrings, not a regex: `re` would cost the first library load ~1.5 ms to import.
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
_checked = False


def is_secret(name: str) -> bool:
    """Whether ``name`` holds a secret (``PYNCCL_RENDEZVOUS_KEY``, ``*KEY*``, ``*TOKEN*``,
    ``*SECRET*``, ``*PASSWORD*``...)."""
    upper = name.upper()
    return any(word in upper for word in _SECRET_WORDS)


def redact(name: str, value: str) -> str:
    """``value``, or ``"<set>"`` when ``name`` holds a secret (an empty one stays empty)."""
    return "<set>" if value and is_secret(name) else value


def unknown(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The ``PYNCCL_*`` variables set in ``environ`` (default :data:`os.environ`) that
    pynccl does not read: name -> the nearest known name, or None when none is close."""
    env = os.environ if environ is None else environ
    out: dict[str, str | None] = {}
    for name in env:
        if not name.startswith("PYNCCL_") or name in KNOWN:
            continue
        if name.startswith(RESERVED_PREFIXES):
            continue
        import difflib  # only when something is wrong

        close = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.75)
        out[name] = close[0] if close else None
    return out


def describe(name: str, nearest: str | None) -> str:
    """The warning for an unknown ``PYNCCL_*`` variable ``name``."""
    hint = f"did you mean {nearest}? " if nearest else ""
    return (
        f"{name} is set but is not a variable pynccl reads, so it has no effect: {hint}"
        "python -m pynccl info lists the PYNCCL_* variables pynccl knows"
    )


def warn_unknown_once() -> None:
    """Warn (``RuntimeWarning``) once per process for each unknown ``PYNCCL_*`` variable;
    called when the first library is loaded."""
    global _checked
    if _checked:
        return
    _checked = True
    found = unknown()
    if not found:
        return
    import warnings  # only when there is something to say

    for name, nearest in sorted(found.items()):
        # Attributed to the environment, not to a line of pynccl's: no source line shown.
        warnings.warn_explicit(
            describe(name, nearest), RuntimeWarning, "<environment>", 0, module=__name__
        )
