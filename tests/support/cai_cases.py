"""Interfaces (``__cuda_array_interface__`` dicts), well-formed and not, for the tests of
the generated methods' inline paths and their interface memo: each case a change to the
interface of sendbuf and of recvbuf of an ``all_reduce``, applied to a fresh dict or in
place to a remembered one."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np

from pynccl import DataType
from pynccl.comm import Communicator
from pynccl.cuda import DeviceBuffer
from support.producers import cai_dict

N = 8
F32 = DataType.FLOAT32


def interface(buf: DeviceBuffer, **change: Any) -> dict[str, Any]:
    """A float32 interface of ``buf``'s N elements, with ``change`` applied (DROP: delete)."""
    return changed(cai_dict(np.empty(N, np.float32), data=(buf.ptr, False)), change, None)  # type: ignore[no-any-return]


DROP = object()

# (name, change to sendbuf's interface, change to recvbuf's); sendbuf holds 1..N
CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("plain", {}, {}),
    ("read-only recvbuf", {}, {"data": "readonly"}),
    ("read-only sendbuf (not written)", {"data": "readonly"}, {}),
    ("mask", {"mask": object()}, {}),
    ("mask None", {"mask": None}, {}),
    ("strided", {"strides": (8,), "shape": (N // 2,)}, {}),
    ("contiguous strides", {"strides": (4,)}, {}),
    ("2-D", {"shape": (2, N // 2)}, {}),
    ("shape as a list", {"shape": [N]}, {}),
    ("unknown typestr", {"typestr": "<f3"}, {}),
    ("other dtype", {"typestr": "<i4"}, {}),
    ("complex", {"typestr": "<c8", "shape": (N // 2,)}, {"typestr": "<c8", "shape": (N // 2,)}),
    ("float pointer", {"data": "float"}, {}),
    ("pointer past 2**64", {"data": (1 << 64, False)}, {}),
    ("no data", {"data": DROP}, {}),
    ("negative shape", {"shape": (-1,)}, {}),
    ("bool shape", {"shape": (True,)}, {}),
    ("recvbuf too small", {}, {"shape": (N // 2,)}),
    ("not a dict", {"as": types.MappingProxyType}, {}),
    ("no strides key", {"strides": DROP}, {}),
]


def reduce(comm: Communicator, x: object, y: object) -> None:
    comm.all_reduce(x, y)  # type: ignore[arg-type]
    comm.synchronize()


def outcome(call: Callable[[], None], recv: DeviceBuffer) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", repr(recv.to_numpy().tolist())


def resolve(buf: DeviceBuffer, change: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """A case's ``change`` as the keys to set on an interface of ``buf`` (DROP: delete),
    and the mapping type to wrap the interface in (None: it stays a dict)."""
    change = dict(change)
    wrap = change.pop("as", None)
    data = change.get("data")
    if data == "readonly":
        change["data"] = (buf.ptr, True)
    elif data == "float":
        change["data"] = (float(buf.ptr), False)
    return change, wrap


def changed(cai: dict[str, Any], change: dict[str, Any], wrap: Any) -> Any:
    """``cai`` (changed in place) with ``resolve``'s keys set, then wrapped."""
    for key, value in change.items():
        if value is DROP:
            del cai[key]
        else:
            cai[key] = value
    return wrap(cai) if wrap is not None else cai
