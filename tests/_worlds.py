"""What the lead's modules at tests/ root (test_fast_path.py, test_spec.py) import from the old
helper: a re-export of ``support``, until those modules are rewritten (issue 21)."""

from support.suite import COLLECTIVES
from support.worlds import ThreadWorld

__all__ = ["COLLECTIVES", "ThreadWorld"]
