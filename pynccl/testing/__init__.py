"""Testing helpers for pynccl and for projects that embed it (loopback libraries)."""
