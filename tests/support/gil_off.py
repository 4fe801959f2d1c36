"""A pytest plugin for a free-threaded interpreter: the GIL stays off throughout the run.

``scripts/free_threaded.sh`` loads it (``-p support.gil_off``). A free-threaded CPython turns
the GIL back on for good the moment a C extension that does not declare itself free-threading
safe is imported (and says so in a RuntimeWarning that is easy to miss), after which every
test would run with the GIL again and prove nothing. So: the session refuses to start on an
interpreter with the GIL enabled, each test fails if the GIL was on after it ran (naming the
first such test: whatever it imported turned it on), and the session fails if the GIL is on at
its end. ``PYTHON_GIL`` must be unset: ``PYTHON_GIL=0`` would force the GIL off and hide an
extension that needs it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from typing import Any

import pytest

_ON: list[str] = []  # the first test after which the GIL was found on


def _gil_enabled() -> bool:
    probe = getattr(sys, "_is_gil_enabled", None)
    return True if probe is None else bool(probe())


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTHON_GIL") is not None:
        raise pytest.UsageError(
            f"PYTHON_GIL={os.environ['PYTHON_GIL']!r} is set: unset it, so that the GIL is off "
            "because every imported module allows it, not because it is forced off"
        )
    if _gil_enabled():
        raise pytest.UsageError(
            f"the GIL is enabled in {sys.executable} ({sys.version.split()[0]}): "
            "support.gil_off needs a free-threaded build (python3.13t) with the GIL off"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[Any]
) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if call.when != "teardown" or not _gil_enabled():
        return
    if not _ON:
        _ON.append(item.nodeid)
    report.outcome = "failed"
    report.longrepr = (
        f"the GIL is enabled after {item.nodeid} (first found on after {_ON[0]}): a C "
        "extension imported without declaring free-threading support turned it on"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _gil_enabled():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nsupport.gil_off: the GIL is enabled at the end of the run (first after "
              f"{_ON[0] if _ON else 'the last test'})")  # fmt: skip
    else:
        print("\nsupport.gil_off: the GIL was off before, during and after every test")
