"""What the tests share, one module per concern (``tests/`` is on the path: ``from
support.worlds import ThreadWorld``).

* ``worlds``: the worlds of communicators, one class per level — :class:`ThreadWorld`
  (a thread per rank), :class:`GroupWorld` (``init_all``, one thread), :class:`ProcessWorld`
  (one rank of a job of processes, see ``rank_worker``) — the loopback as this process's
  libraries (``use_loopback``), and buffers of every kind (``Slot``);
* ``suite``: the collective suite, one set of assertions run in every world (``check``);
* ``reference``: the one numpy reference of what a collective produces (``ref_reduce``,
  ``expected``), the inputs it is fed (``rank_data``, ``make_input``, ``small_ints``) and the
  comparisons (``assert_same``, ``assert_matches``);
* ``clib``, ``clib_fixtures``, ``clib_rma``, ``clib_strict``: the loopback libnccl through
  raw ctypes (its own init_all world, ``clib.GroupWorld``, returns raw result codes);
* ``cudart``: the loopback libcudart through raw ctypes, stream gates and :class:`Hold`;
* ``producers``: CAI / DLPack / stream-protocol objects as other libraries make them;
* ``child``: child interpreters; ``wait``: bounded waits and ``threads(n, fn)`` (a one-shot
  thread per rank, for the raw tests); ``comm``: the object API's helpers; ``perf``: ``python
  -m pynccl perf`` run as a user runs it;
* ``rank_worker``, ``fuzz_adapt``, ``workers/``: scripts run in child processes.

Nothing here is imported eagerly: the scripts import what they need.
"""

from pathlib import Path

#: This package's folder (its scripts are started by path), tests/, and the repository.
SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
