"""What every worker script in this directory shares: making its communicator, reporting.

A worker prints one-line markers ``TAG rank=R key=value ...`` that the tests parse
(values never contain spaces), and exits 0 when it saw what the scenario promises,
1 otherwise (with a ``FAIL`` marker saying why), so that a test learns every rank's
findings rather than the first traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

# A worker runs as a script: tests/ (for the support package) importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from support.wait import wait_for as wait_until

import pynccl
from pynccl.bootstrap import detect_launch_env


def parser(description: str) -> argparse.ArgumentParser:
    """The options every worker takes: which rendezvous backend ``from_env`` uses."""
    p = argparse.ArgumentParser(description=description)
    backend = p.add_mutually_exclusive_group()
    backend.add_argument("--file", help="share the id through this file (FileRendezvous)")
    backend.add_argument(
        "--store", help="share the id through the kv_store.py server at this AF_UNIX address"
    )
    return p


def communicator(args: argparse.Namespace, **kwargs: Any) -> pynccl.Communicator:
    """``Communicator.from_env`` with the backend the options name (default: TCP)."""
    if args.file:
        kwargs["file"] = args.file
    elif args.store:
        from kv_store import connect

        kwargs["store"] = connect(args.store)
    return pynccl.Communicator.from_env(timeout=60, **kwargs)


def launcher() -> str:
    """The launcher convention ``from_env`` sees in this process's environment."""
    return detect_launch_env().launcher


def one_line(text: object) -> str:
    """``text`` as a single marker value: no spaces, no newlines."""
    return "|".join(str(text).split())


def report(tag: str, **fields: object) -> None:
    """Print the marker line ``TAG key=value ...``."""
    print(tag, *(f"{k}={one_line(v)}" for k, v in fields.items()), flush=True)


def fail(rank: int, why: str) -> None:
    """Report a failed expectation and exit 1."""
    report("FAIL", rank=rank, why=why)
    sys.exit(1)


def shm_names() -> str:
    """The ``/dev/shm/pynccl*`` segments this process maps, comma-separated (or ``-``)."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split(maxsplit=5)[5:]
            # a loopback world: a memfd (older builds: a /dev/shm file)
            if path and path[0].startswith(("/dev/shm/pynccl", "/memfd:pynccl")):
                names.add(path[0].split()[0].rsplit("/", 1)[1].removeprefix("memfd:"))
    return ",".join(sorted(names)) or "-"


class DeferredTerm:
    """Hold SIGTERM back while a scenario finishes, so that a launcher stopping the job
    after one rank's death does not hide what the surviving ranks observed."""

    def __init__(self) -> None:
        self.received = 0
        signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.received += 1


def file_barrier(directory: str, rank: int, size: int, timeout: float = 60.0) -> None:
    """Wait until every rank reached this point, without the communicator: each rank
    drops ``rank<r>`` into ``directory`` and waits for the others' files."""
    open(os.path.join(directory, f"rank{rank}"), "w").close()
    names = [os.path.join(directory, f"rank{r}") for r in range(size)]
    if not wait_until(lambda: all(os.path.exists(n) for n in names), timeout):
        fail(rank, f"file barrier in {directory}: not every rank arrived within {timeout:g} s")
