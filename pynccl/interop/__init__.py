"""pynccl inside other people's programs: joining vLLM's NCCL groups, and NCCL memory as the
allocator of CuPy, cuda.core and torch.

Nothing here imports those libraries until a function that serves one of them is called;
each works on the loopback libraries as on a GPU.
"""

from __future__ import annotations

__all__: list[str] = []
