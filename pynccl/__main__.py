"""``python -m pynccl {info,perf,launch,analyze,ras}`` and ``python -m pynccl --version``."""

from __future__ import annotations

import sys

_USAGE = """usage: python -m pynccl [--version] COMMAND [ARGS...]

commands:
  info     which libnccl / libcudart were found (path, rule, version), the devices or why
           there are none, NCCL_* settings; --loopback: the same on the loopback libraries
  perf     nccl-tests' bandwidth sweep (same flags, columns and -J JSON); without a GPU it
           runs on pynccl's host-memory loopback libraries, and says so
  launch   start N local ranks of a script (or -m module) with the rendezvous environment
           set; --loopback runs them on the loopback libraries; --flight-dir DIR
           collects every rank's flight record when the job fails or times out
  analyze  read the flight-record dumps of every rank (PYNCCL_FLIGHT_DIR) and name the
           rank and the operation at fault
  ras      ask NCCL's RAS service (NCCL >= 2.24) of a running job for its status, naming
           the ranks it sees as missing or dead first; --json for machines

python -m pynccl COMMAND --help shows a command's options.
"""

_COMMANDS = ("info", "perf", "launch", "analyze", "ras")

def main(argv: list[str] | None = None) -> int:
    """Dispatch to the subcommand's own ``main``; returns the exit status (2: usage)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        print(_USAGE, end="", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(_USAGE, end="")
        return 0
    if args[0] in ("-V", "--version"):
        from . import __version__

        print(f"pynccl {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command not in _COMMANDS:
        print(f"pynccl: unknown command {command!r}\n\n{_USAGE}", end="", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(f"pynccl.{command}")
    try:
        return int(module.main(rest))
    except Exception as e:
        from .info import LOOPBACK_HINT, no_gpu_error

        if no_gpu_error(e):
            print(f"python -m pynccl {command}: {type(e).__name__}: {e}", file=sys.stderr)
            print(LOOPBACK_HINT, file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
