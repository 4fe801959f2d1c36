"""``python -m pynccl perf``: bandwidth sweeps of NCCL collectives, after NVIDIA's nccl-tests.

Usage::

    python -m pynccl perf [COLLECTIVE] [nccl-tests' flags] [--json FILE] [--plot FILE.png]

COLLECTIVE is one of all_reduce (default), all_gather, reduce_scatter, broadcast, reduce,
gather, scatter, all_to_all, sendrecv, and nccl-tests 2.19's hypercube (an all-gather by
recursive doubling over sends and receives, on a power-of-two number of ranks) and
alltoallv (an all-to-all with a different size for each peer: see
:mod:`pynccl.perf._traffic` for its ``NCCL_TESTS_ALLTOALLV_*`` variables). Every flag of
nccl-tests' ``*_perf`` binaries means what it means there (``python -m pynccl perf
--help`` lists them; an unknown one is refused by name): ``-b``/``-e`` sizes, ``-f``
factor or ``-i`` linear step (a given ``-i`` without ``-f`` steps linearly, as nccl-tests'
default factor is 1), ``-g`` GPUs and ``-t`` threads (here every rank is one process with
one GPU, so ``-t T -g G`` runs T*G ranks; ``-t T`` alone, as nccl-tests' default ``-g 1``,
T ranks), ``-n``/``-w``/``-m``/``-N`` iterations, warm-up, aggregation in a group and
cycles, ``-c`` checks, ``-o``/``-d`` op and type (names, lists or ``all``), ``-r`` root
(``all``/``-1``: every rank), ``-z`` blocking, ``-y`` NULL stream, ``-T`` timeout of each
wait, ``-G`` CUDA graphs, ``-C`` cputime, ``-S`` timestamps, ``-J`` JSON, ``-a``
averaging, ``-u`` unalign, ``-R`` registered buffers (1: ``ncclMemAlloc`` buffers
registered with ``ncclCommRegister``, NCCL >= 2.19; 2: in symmetric windows,
``ncclCommWindowRegister`` with ``NCCL_WIN_COLL_SYMMETRIC``, NCCL >= 2.27). Flags it lacks
(``-x``, ``-D``, ``-V``, ``-M``, ``-I``, ``-K``) are refused by name, except with their
default value. nccl-tests' variables work as there: ``NCCL_TESTS_MIN_BW`` (the run fails,
exit status 1, when the average bus bandwidth is below 90% of it), ``NCCL_TESTS_DEVICE``
(the first device) and ``NCCL_TESTS_SPLIT`` / ``NCCL_TESTS_SPLIT_MASK`` (groups of ranks
running the sweep side by side, each on its own communicator; see
:mod:`pynccl.perf._tests_env`).

The output is nccl-tests 2.19's, line for line (a golden test holds it to formats
captured from nccl-tests' source): version, "Collective test starting", the
parameters, device lines (GPU name, ``[dddd:bb:dd]`` bus id), the table, the footer and
"Collective test concluded"; ``-J`` writes its JSON (file version 3). Columns: per
size, the time of one operation (µs), the algorithm bandwidth (bytes / time, GB/s = 1e9
B/s) and the bus bandwidth (times nccl-tests' factor: 2(n-1)/n for all-reduce; (n-1)/n
for all-gather, reduce-scatter, gather, scatter and all-to-all; 1 for broadcast, reduce
and send/recv), out of place and in place (all-to-all and send/recv in place are timed,
not checked: ``N/A``), and with ``-c`` the wrong elements against a numpy reference.
Sizes and counts follow nccl-tests too (per-rank counts of the gather/scatter family
are rounded down to 16 bytes). The loopback banner is pynccl's own. ``--json`` writes
pynccl's own report (library paths, every row).

Where it runs:

* Started by hand it launches the ranks itself (through ``python -m pynccl launch``),
  one per GPU; one rank runs in this process. Rank 0's lines are shown without the
  launcher's prefix, each row as soon as it is done; on a terminal a status line on
  stderr shows progress (also while the loopback compiles on first use).
* Started by a launcher (torchrun, ``python -m pynccl launch``, mpirun, srun:
  whatever :func:`pynccl.bootstrap.detect_launch_env` recognises) each process is
  one rank and joins through :func:`pynccl.bootstrap.from_env`.
* Without a GPU it runs on pynccl's host-memory loopback libraries, says so in a
  banner and in the JSON, and keeps its default sweep short: those figures
  measure host memory and Python, not NCCL. Every loopback rank is a process working
  in host memory: a run whose buffers would not fit in the available memory is refused,
  and one with more ranks than CPU cores (beyond a few) says that they take turns.

Defaults: on a GPU nccl-tests' own (``-b 32M -e 32M -i 1M -n 20 -w 1 -c 1``) with
``-g`` = every visible GPU; on the loopback ``-g 2 -b 8 -e 32M -f 2`` (a few
seconds). ``-c`` defaults to 0, with a note, where numpy is not installed: the
sweep itself needs nothing but the standard library. ``mulsum`` is NCCL's PreMulSum
with each rank scaling its own input by its own scalar (1 on even ranks, 2 on odd
ones); integer ``avg`` is NCCL's, the sum divided by the ranks truncated toward zero.
Output paths (``-J``, ``--json``, ``--plot``) are checked before anything starts. ``-J``
records the environment as nccl-tests does, but never a secret: ``PYNCCL_RENDEZVOUS_KEY``
and any ``*KEY*``, ``*TOKEN*``, ``*SECRET*`` or ``*PASSWORD*`` variable appear as ``<set>``.

Timing follows nccl-tests: a host clock around ``-n`` back-to-back operations and
a stream synchronize (or around ``-G`` replays of a CUDA graph holding them),
averaged over the ranks (``-a``); the same method on the loopback and on a GPU.

Exit status: 0 when every check passed, 1 when results were wrong, the bandwidth was below
``NCCL_TESTS_MIN_BW``, a rank failed or a wait timed out (-T), 2 for a usage error (a bad
flag, flag combination or ``NCCL_TESTS_*`` value).
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
