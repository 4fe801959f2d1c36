"""Flight-record dumps: every communicator's record of this process, as one JSON file.

With ``PYNCCL_FLIGHT_DIR`` set, each process writes ``<dir>/rank<R>.json`` (``R``: the
``RANK`` of its environment, else its first communicator's rank) when a watchdog trips,
on ``SIGUSR1``, on ``SIGTERM`` (then ends as the signal's previous disposition says),
and on an unhandled exception (``sys.excepthook``). Handlers are installed when the first
communicator is made (signals only from the main thread); whatever handler was there is
called after the dump, never replaced silently. ``python -m pynccl analyze DIR`` reads
the files of every rank. Each operation carries its state as the watchdog's events tell
(``completed`` / ``started`` / ``issued``) and, with ``PYNCCL_FLIGHT_STACKS=1``, the
Python line that issued it.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref

from . import _recorder
from ._state import live_handles

__all__ = ["FORMAT", "adopted", "dump", "install", "on_trip", "snapshot", "uninstall"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType, TracebackType
    from typing import Any

#: The ``format`` field of every dump (and its version, ``version``: 1).
FORMAT = "pynccl-flight"
_SIGNALS = ("SIGUSR1", "SIGTERM")
#: Reentrant: a SIGTERM that lands while the main thread dumps for SIGUSR1 dumps again.
_LOCK = threading.RLock()
_TMP = itertools.count()
#: The order communicators were made in this process (matches them across ranks).
_ORDER: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_COUNT = itertools.count()
#: What :func:`install` replaced: ``{signal number: previous handler}``, and the hook.
_PREVIOUS: dict[int, Any] = {}
_HOOK: list[Any] = []


def directory() -> str | None:
    """``PYNCCL_FLIGHT_DIR``, or None when unset or empty."""
    return os.environ.get("PYNCCL_FLIGHT_DIR") or None


def adopted(comm: object) -> None:
    """A communicator was made: number it, and install the handlers once."""
    if comm not in _ORDER:
        _ORDER[comm] = next(_COUNT)
    if not _HOOK and directory():
        install()


def _comm_record(comm: Any) -> dict[str, object]:
    from ._watchdog import WATCHED

    entries = comm.flight_entries()
    items = [item for item, _ in entries]
    sites = getattr(comm, "_sites", None)
    watch = WATCHED.get(comm)
    if watch is not None and watch.running:
        try:
            watch.refresh()
        except Exception:  # a dump says what it knows; the watchdog reports CUDA trouble
            pass
    ops = []
    for item, gid in entries:
        op = _recorder.fields(item)
        op["group"] = gid
        op["state"] = "issued" if watch is None else watch.state(item[0])
        site = None if sites is None else sites[item[0] & _recorder.RING_MASK]
        if site is not None:
            code, line = site
            op["site"] = f"{code.co_filename}:{line} in {code.co_name}"
        ops.append(op)
    verdict = None if watch is None or watch.reason is None else str(watch.reason)
    error = comm.error if hasattr(comm, "error") else None
    try:
        async_error = comm.watch_status()[2]  # without the gate, as the watchdog reads it
    except Exception:
        async_error = None
    return {
        "index": _ORDER.get(comm, -1),
        "rank": comm.rank,
        "size": comm.size,
        "state": str(comm.state),
        "issued": items[-1][0] if items else 0,
        "watchdog": None
        if watch is None
        else {"timeout": watch.timeout, "completed": watch.done, "verdict": verdict},
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "async_error": None if async_error is None else str(async_error).split("\n", 1)[0],
        "ops": ops,
    }


def _main_stack() -> list[str]:
    """Where the main thread is now: ``file:line in function``, innermost last."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return []
    # A dump from a signal handler runs on the main thread: its frames, and whatever they
    # called, are no news. Cut at the outermost of them, not only at this file's frames: a
    # second signal can arrive while the first dump is in another module's code
    # (os.environ.get), whose frames would then pass for where the program was.
    frames = traceback.extract_stack(frame)
    ours = next((i for i, f in enumerate(frames) if f.filename == __file__), len(frames))
    return [f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else "")
            for f in frames[:ours][-8:]]  # fmt: skip


def snapshot(reason: str) -> dict[str, object]:
    """This process's dump: rank, size, pid, host, time, why, where the main thread is,
    and every live communicator's record with its operations' states."""
    comms = sorted(live_handles(), key=lambda c: _ORDER.get(c, 1 << 30))
    records = [_comm_record(c) for c in comms]
    env_rank = os.environ.get("RANK", "")
    rank = int(env_rank) if env_rank.isdigit() else (records[0]["rank"] if records else -1)
    env_size = os.environ.get("WORLD_SIZE", "")
    size = int(env_size) if env_size.isdigit() else (records[0]["size"] if records else 0)
    return {
        "format": FORMAT,
        "version": 1,
        "rank": rank,
        "size": size,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": time.time(),
        "reason": reason,
        "main_thread": _main_stack(),
        "comms": records,
    }


def dump(reason: str, where: str | None = None) -> str | None:
    """Write :func:`snapshot` to ``<where or PYNCCL_FLIGHT_DIR>/rank<R>.json`` (atomically:
    a reader never sees half a file); returns its path, None without a directory. Never
    raises for an I/O error: it says so on stderr (a dump must not hide the failure that
    asked for it)."""
    target = where or directory()
    if not target:
        return None
    tmp = ""
    with _LOCK:
        try:
            data = snapshot(reason)
            os.makedirs(target, exist_ok=True)
            path = os.path.join(target, f"rank{data['rank']}.json")
            tmp = f"{path}.{os.getpid()}.{next(_TMP)}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)
        except Exception as exc:
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)  # nothing left behind
            print(f"pynccl: flight-record dump failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)  # fmt: skip
            return None
    return path


def on_trip(reason: BaseException) -> None:
    """A watchdog tripped (its thread): dump, when a directory is set."""
    if directory():
        dump(f"watchdog: {type(reason).__name__}: {reason}")


def _on_signal(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    dump(f"signal {name}")
    previous = _PREVIOUS.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif signum == signal.SIGTERM and previous in (signal.SIG_DFL, None):
        signal.signal(signum, signal.SIG_DFL)  # end as SIGTERM would have: by the signal
        os.kill(os.getpid(), signum)


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    dump(f"unhandled {kind.__name__}: {value}")
    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGUSR1) is _on_signal
    ):
        # The process ends: Python's exit resets its handlers to the default (SIGUSR1's
        # kills), not an ignored one; a late request for a dump must not kill it.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    previous = _HOOK[0] if _HOOK else sys.__excepthook__
    previous(kind, value, tb)


def install() -> None:
    """The dump triggers: ``sys.excepthook`` (chained), and from the main thread the
    ``SIGUSR1`` / ``SIGTERM`` handlers (the previous ones called after the dump). Once."""
    if _HOOK:
        return
    _HOOK.append(sys.excepthook)
    sys.excepthook = _excepthook
    if threading.current_thread() is not threading.main_thread():
        return
    for name in _SIGNALS:
        signum = getattr(signal, name)
        previous = signal.getsignal(signum)
        if previous is _on_signal:
            continue
        _PREVIOUS[signum] = previous
        signal.signal(signum, _on_signal)


def uninstall() -> None:
    """Put back what :func:`install` replaced (where nobody replaced it since)."""
    if _HOOK:
        if sys.excepthook is _excepthook:
            sys.excepthook = _HOOK[0]
        _HOOK.clear()
    for signum, previous in list(_PREVIOUS.items()):
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _PREVIOUS[signum]
