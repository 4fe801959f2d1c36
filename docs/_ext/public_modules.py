"""The modules whose ``__all__`` is pynccl's public API: one list for the reference build
(``pynccl_docs``) and for tests/docs/test_docs.py (which reads it without Sphinx)."""

PUBLIC_MODULES = (
    "pynccl",
    "pynccl.comm",
    "pynccl.enums",
    "pynccl.groups",
    "pynccl.watchdog",
    "pynccl.tuning",
    "pynccl.interop",
    "pynccl.interop.vllm",
    "pynccl.capi",
    "pynccl.cuda",
    "pynccl.bootstrap",
    "pynccl.typing",
    "pynccl.testing.loopback",
    "pynccl.testing.allocator",
)
