"""``python -m pynccl perf``: bandwidth sweeps of NCCL collectives, after NVIDIA's nccl-tests.

Usage::

    python -m pynccl perf [COLLECTIVE] [-b MIN] [-e MAX] [-f FACTOR | -i STEP] [-g NRANKS]
                          [-n ITERS] [-w WARMUP] [-c CHECK] [-o OP] [-d TYPE] [-r ROOT]
                          [-G GRAPH_LAUNCHES] [-a AVERAGE] [-T TIMEOUT]
                          [--json FILE] [--plot FILE.png]

COLLECTIVE is one of all_reduce (default), all_gather, reduce_scatter, broadcast,
reduce, gather, scatter, all_to_all, sendrecv. The flags mean what they mean for
nccl-tests' ``*_perf`` binaries (``-g`` is the number of ranks, one GPU and one
process each), and so do the columns: per size, the time of one operation (µs),
the algorithm bandwidth (bytes / time, GB/s = 1e9 B/s) and the bus bandwidth
(algorithm bandwidth times nccl-tests' factor: 2(n-1)/n for all-reduce; (n-1)/n
for all-gather, reduce-scatter, gather, scatter and all-to-all; 1 for broadcast,
reduce and send/recv), out of place and in place, and with ``-c`` the number of
wrong elements against a numpy reference computed on the host. Sizes and counts
follow nccl-tests too (per-rank counts of the gather/scatter family are rounded
down to 16 bytes), so the rows compare line by line with theirs.

Where it runs:

* Started by hand it launches ``-g`` ranks itself (through ``python -m pynccl
  launch``, which also enforces ``-T``), one per GPU; ``-g 1`` without ``-T``
  runs in this process. Rank 0's lines are shown without the launcher's prefix.
* Started by a launcher (torchrun, ``python -m pynccl launch``, mpirun, srun:
  whatever :func:`pynccl.bootstrap.detect_launch_env` recognises) each process is
  one rank and joins through :func:`pynccl.bootstrap.from_env`.
* Without a GPU it runs on pynccl's host-memory loopback libraries, says so in a
  banner and in the JSON, and keeps its default sweep short: those figures
  measure host memory and Python, not NCCL.

Defaults: on a GPU nccl-tests' own (``-b 32M -e 32M -i 1M -n 20 -w 1 -c 1``) with
``-g`` = every visible GPU; on the loopback ``-g 2 -b 8 -e 32M -f 2`` (a few
seconds). ``-c`` defaults to 0, with a note, where numpy is not installed: the
sweep itself needs nothing but the standard library. ``-d``/``-o`` take
nccl-tests' names (``float``, ``half``, ``bfloat16``, ``f8e4m3``...; ``sum``...
``mulsum``), comma-separated lists or ``all``; ``-r -1`` runs every root.
``mulsum`` is NCCL's PreMulSum with each rank scaling its own input by its own
scalar (1 on even ranks, 2 on odd ones).

Timing follows nccl-tests: a host clock around ``-n`` back-to-back operations and
a stream synchronize (or around ``-G`` replays of a CUDA graph holding them),
averaged over the ranks (``-a``); the same method on the loopback and on a GPU.

Exit status: 0 when every check passed, 1 when results were wrong or a rank
failed, 2 for a usage error (a bad flag or flag combination).
"""

# The old single module's other public names, and the private helpers the tests reach
# through ``pynccl.perf`` (``perf._parse``, ``perf._Data``...).
from ._options import Options as Options
from ._options import _parse as _parse
from ._reference import _Data as _Data
from ._reference import _expected as _expected
from ._report import LOOPBACK_BANNER as LOOPBACK_BANNER
from ._report import LOOPBACK_NOTE as LOOPBACK_NOTE
from ._report import _fmt as _fmt
from ._run import main
from ._sweep import COLLECTIVES, Collective, Counts, PerfError, bus_factor, parse_size, sweep_sizes

__all__ = [
    "COLLECTIVES",
    "Collective",
    "Counts",
    "PerfError",
    "bus_factor",
    "main",
    "parse_size",
    "sweep_sizes",
]
