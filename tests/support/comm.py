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


def takes_fast_path(call: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether ``call(*args, **kwargs)`` issued without the checked path
    (``Collectives._slow``)."""
    from pynccl.comm._checked import Checked as Collectives  # where _slow is defined

    seen: list[object] = []
    checked = Collectives._slow

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(args)
        checked(self, *args, **kwargs)

    Collectives._slow = spy  # type: ignore[method-assign]
    try:
        call(*args, **kwargs)
    finally:
        Collectives._slow = checked  # type: ignore[method-assign]
    return not seen
