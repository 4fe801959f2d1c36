"""What the test_comm*.py modules (the object API on the loopback) share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pynccl.cuda import DeviceBuffer
from support.worlds import ThreadWorld

#: The ``thread_worlds`` fixture (conftest): ``get(n)`` -> a ThreadWorld of ``n`` ranks.
Worlds = Callable[[int], ThreadWorld]


def to_device(values: Any, dtype: Any = np.float32, device: int = 0) -> DeviceBuffer:
    """A new DeviceBuffer on ``device`` holding ``values`` as ``dtype``."""
    return DeviceBuffer.from_numpy(np.asarray(values, dtype=dtype), device=device)
