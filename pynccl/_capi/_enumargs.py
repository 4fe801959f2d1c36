"""One shared, never-mutated ``c_int`` per :class:`DataType` / :class:`RedOp` member.

ctypes passes such an object for a C ``int`` parameter several times faster than it
converts a Python int; the low-level wrappers (``NcclLibrary.ENUM_ARGS``) and the
object API's hot paths both use these. A module of its own so that the object API can
import them without building the prototype tables (``from pynccl import Communicator``
stays cheap).
"""

from __future__ import annotations

from ctypes import c_int

from ..enums import DataType, RedOp

__all__ = ["C_DATATYPE", "C_REDOP"]

C_DATATYPE: dict[DataType, c_int] = {m: c_int(m) for m in DataType}
C_REDOP: dict[RedOp, c_int] = {m: c_int(m) for m in RedOp}
