"""``python -m pynccl {info,perf,launch}``."""

from __future__ import annotations

import sys

_USAGE = """usage: python -m pynccl COMMAND [ARGS...]

commands:
  info     what libnccl / libcudart were found, their versions, devices, NCCL_* settings
  perf     nccl-tests-style bandwidth sweep (on the loopback libraries without a GPU)
  launch   start N local ranks of a script with the rendezvous environment set
"""


_COMMANDS = ("info", "perf", "launch")


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the subcommand's own ``main``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_USAGE, end="")
        return 0
    command, rest = args[0], args[1:]
    if command not in _COMMANDS:
        print(f"pynccl: unknown command {command!r}\n\n{_USAGE}", end="", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(f"pynccl.{command}")
    return int(module.main(rest))


if __name__ == "__main__":
    sys.exit(main())
