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
    (``Checked._slow``)."""
    from pynccl.comm._checked import Checked  # where _slow is defined

    seen: list[object] = []
    checked = Checked._slow

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(args)
        checked(self, *args, **kwargs)

    Checked._slow = spy  # type: ignore[method-assign]
    try:
        call(*args, **kwargs)
    finally:
        Checked._slow = checked  # type: ignore[method-assign]
    return not seen
