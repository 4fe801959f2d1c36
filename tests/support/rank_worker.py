"""One rank of a process world: runs the collective suite's specs and reports them.

Started by tests/comm/test_collectives.py and tests/comm/test_comm_versions.py, either

* directly, with ``PYNCCL_TEST_RANK``, ``PYNCCL_TEST_SIZE`` and ``PYNCCL_TEST_UID``
  (the unique id in hex, made by the parent), or
* by ``python -m pynccl launch -n N --loopback``, which sets ``RANK``/``WORLD_SIZE``
  and the rendezvous variables that ``pynccl.bootstrap.from_env()`` reads.

``PYNCCL_TEST_SPECS`` is a JSON list of :class:`support.suite.Spec` fields. The last
line of output is ``RESULT {"rank": r, "results": [{"spec", "ok", "error"}, ...]}``;
the exit status is 0 when the worker ran to the end (failed specs are reported,
not raised), so that every rank's findings reach the test.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

# Run as a script: tests/ (for the support package) and the repository importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pynccl.comm import Communicator, UniqueId
from support.suite import Spec, check
from support.worlds import ProcessWorld


def _communicator() -> Communicator:
    uid = os.environ.get("PYNCCL_TEST_UID")
    if uid is None:
        from pynccl.bootstrap import from_env

        return from_env(timeout=60)
    rank = int(os.environ["PYNCCL_TEST_RANK"])
    size = int(os.environ["PYNCCL_TEST_SIZE"])
    return Communicator(size, UniqueId.fromhex(uid), rank, device=rank % 8)


def main() -> int:
    specs = [Spec(**fields) for fields in json.loads(os.environ["PYNCCL_TEST_SPECS"])]
    comm = _communicator()
    world = ProcessWorld(comm)
    results: list[dict[str, Any]] = []
    try:
        for spec in specs:
            try:
                check(world, spec)
            except Exception as exc:
                text = "".join(traceback.format_exception(exc)[-6:])
                results.append({"spec": str(spec), "ok": False, "error": text})
                if comm.state != "ready":
                    break  # the communicator was aborted: later specs cannot run
            else:
                results.append({"spec": str(spec), "ok": True, "error": ""})
    finally:
        if comm.state == "ready" and all(r["ok"] for r in results):
            comm.destroy()
        else:
            comm.abort()
    print("RESULT " + json.dumps({"rank": comm.rank, "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
