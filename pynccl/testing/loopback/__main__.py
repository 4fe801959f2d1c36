"""``python -m pynccl.testing.loopback``: build the loopback and print where it is."""

from __future__ import annotations

import argparse
import shlex
import sys

from ._build import LoopbackBuildError, build, env


def main(argv: list[str] | None = None) -> int:
    """Print the loopback libnccl and libcudart paths (or ``export`` lines)."""
    parser = argparse.ArgumentParser(
        prog="python -m pynccl.testing.loopback",
        description="Build the pynccl loopback libnccl/libcudart (cached) and print their paths.",
    )
    parser.add_argument("--nccl-version", default=None, help="NCCL release to emulate (X.Y.Z)")
    parser.add_argument("--null", action="store_true", help="collectives move no data")
    parser.add_argument("--sanitize", action="store_true", help="ASan + UBSan build")
    parser.add_argument(
        "--export",
        action="store_true",
        help='print shell `export` lines instead (eval "$(python -m ... --export)")',
    )
    args = parser.parse_args(argv)
    try:
        if args.export:
            for name, value in env(args.nccl_version, args.null, args.sanitize).items():
                print(f"export {name}={shlex.quote(value)}")
        else:
            nccl, cudart = build(args.nccl_version, args.null, args.sanitize)
            print(nccl)
            print(cudart)
    except (LoopbackBuildError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
