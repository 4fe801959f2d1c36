"""Mapping between NCCL data types and the dtypes of numpy, ml_dtypes, CuPy and torch.

Nothing here imports numpy, torch or cupy: dtype objects are recognised by
their names (``numpy.dtype.name``, ``str(torch.float32)``), so the mapping
works whatever is installed. Results are cached per dtype object, so the hot
path is one dictionary lookup.
"""

from __future__ import annotations

import sys

from .enums import DataType

TYPE_CHECKING = False  # not imported from typing: keeps `import pynccl` fast
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "as_datatype",
    "as_element_type",
    "canonical_name",
    "complex_component",
    "complex_name",
    "known_names",
    "to_numpy_dtype",
]

# Canonical names, as numpy / ml_dtypes / torch spell them, plus nccl.h's names.
_BY_NAME: dict[str, DataType] = {
    "int8": DataType.INT8,
    "uint8": DataType.UINT8,
    "int32": DataType.INT32,
    "uint32": DataType.UINT32,
    "int64": DataType.INT64,
    "uint64": DataType.UINT64,
    "float16": DataType.FLOAT16,
    "half": DataType.FLOAT16,
    "float32": DataType.FLOAT32,
    "float64": DataType.FLOAT64,
    "double": DataType.FLOAT64,
    "bfloat16": DataType.BFLOAT16,
    "float8_e4m3fn": DataType.FLOAT8_E4M3,
    "float8_e5m2": DataType.FLOAT8_E5M2,
    # The short spellings of ML code (vLLM, SGLang, Megatron configs).
    "bf16": DataType.BFLOAT16,
    "fp16": DataType.FLOAT16,
    "fp32": DataType.FLOAT32,
    "fp64": DataType.FLOAT64,
    "fp8_e4m3": DataType.FLOAT8_E4M3,
    "fp8_e5m2": DataType.FLOAT8_E5M2,
}
_BY_NAME.update({dt.c_name: dt for dt in DataType})
_BY_NAME.update({dt.name.lower(): dt for dt in DataType})  # "float8_e4m3", "bfloat16", ...
# ml_dtypes' ``float8_e4m3`` is the IEEE-style variant, not NVIDIA's e4m3fn: refuse it by
# name below unless it came as nccl.h's or pynccl's own spelling.
del _BY_NAME["float8_e4m3"]

# torch spells a few types by C names where they differ from numpy's meaning.
_TORCH_ALIASES = {"float": "float32", "int": "int32", "long": "int64", "char": "int8"}

_AMBIGUOUS = {
    "float": "numpy reads 'float' as float64 while NCCL's ncclFloat is float32",
    "int": "'int' is 32-bit in C and NCCL but 64-bit in numpy",
    "float8_e4m3": (
        "NCCL's e4m3 is the OCP/NVIDIA 'float8_e4m3fn' format; ml_dtypes' 'float8_e4m3' "
        "is a different (IEEE-style) format"
    ),
}


def _parse_typestr(text: str) -> tuple[str, str, str] | None:
    """``"<f4"`` → ``("<", "f", "4")``; None if ``text`` is no numeric typestr."""
    order = text[:1] if text[:1] in ("<", ">", "|", "=") else ""
    rest = text[len(order) :]
    if len(rest) < 2 or rest[0] not in "iuf" or not rest[1:].isdigit():
        return None
    return order, rest[0], rest[1:]


_CACHE: dict[Any, DataType] = {}


def known_names() -> dict[str, DataType]:
    """Every name :func:`as_datatype` reads without parsing (``"float32"``, ``"bf16"``,
    ``"ncclFloat32"``, ...), with its type: a new dict."""
    return dict(_BY_NAME)

_ML_NAMES = {
    DataType.BFLOAT16: "bfloat16",
    DataType.FLOAT8_E4M3: "float8_e4m3fn",
    DataType.FLOAT8_E5M2: "float8_e5m2",
}


def _unsupported(obj: Any, why: str = "") -> TypeError:
    supported = ", ".join(canonical_name(dt) for dt in DataType)
    text = f"data type {obj!r} is not supported by NCCL"
    if why:
        text += f" ({why})"
    return TypeError(f"{text}; supported: {supported}")


def _from_name(name: str, original: Any) -> DataType:
    try:
        return _BY_NAME[name]
    except KeyError:
        pass
    if name in _AMBIGUOUS:
        raise _unsupported(original, _AMBIGUOUS[name])
    parsed = _parse_typestr(name)
    if parsed is not None:
        order, kind, size = parsed
        if order == ">" and sys.byteorder == "little" and size != "1":
            raise _unsupported(original, "big-endian data")
        key = {"i": "int", "u": "uint", "f": "float"}[kind] + str(int(size) * 8)
        if key in _BY_NAME:
            return _BY_NAME[key]
    raise _unsupported(original)


def _resolve(obj: Any) -> DataType:
    if isinstance(obj, DataType):
        return obj
    if isinstance(obj, bool):
        raise _unsupported(obj)
    if isinstance(obj, int):
        try:
            return DataType(obj)
        except ValueError:
            raise _unsupported(obj, "not an ncclDataType_t value") from None
    if isinstance(obj, str):
        name = obj.strip()
        if name.startswith("torch."):
            name = name[len("torch.") :]
            name = _TORCH_ALIASES.get(name, name)
        elif name.startswith(("numpy.", "np.")):
            name = name.split(".", 1)[1]
        return _from_name(name, obj)
    if obj is float:
        return DataType.FLOAT64
    if obj is int:
        return DataType.INT64
    module = type(obj).__module__ or ""
    if module.startswith("torch"):
        # str(torch.float32) == "torch.float32"
        return _resolve(str(obj))
    if isinstance(obj, type):
        # numpy / ml_dtypes scalar types such as numpy.float32 or ml_dtypes.bfloat16
        np = sys.modules.get("numpy")
        if np is not None and (obj.__module__ or "").split(".")[0] in ("numpy", "ml_dtypes"):
            return _resolve(np.dtype(obj))
        raise _unsupported(obj)
    # numpy / cupy dtype objects: name, kind, byteorder
    dtype_name = getattr(obj, "name", None)
    if isinstance(dtype_name, str) and hasattr(obj, "itemsize") and hasattr(obj, "kind"):
        if getattr(obj, "byteorder", "=") == ">" and sys.byteorder == "little":
            if getattr(obj, "itemsize", 1) != 1:
                raise _unsupported(obj, "big-endian data")
        return _from_name(dtype_name, obj)
    raise _unsupported(obj)


def as_datatype(obj: Any) -> DataType:
    """Map ``obj`` to a :class:`DataType`.

    Accepts a ``DataType`` or its integer value, numpy / CuPy / ml_dtypes dtypes and
    scalar types, torch dtypes, and names: ``"float32"``, ``"bfloat16"``,
    ``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"torch.float16"``, ``"ncclFloat32"``,
    typestrs such as ``"<f4"``. Unsupported types (bool, complex, int16, object, ...)
    raise ``TypeError`` naming them; complex types, which the adaptation layer moves as
    float pairs, are recognised by :func:`complex_component`.
    """
    if type(obj) is DataType:
        return obj
    try:
        return _CACHE[obj]
    except KeyError:
        pass
    except TypeError:  # unhashable
        return _resolve(obj)
    result = _resolve(obj)
    # Numbers stay out of the cache: True == 1 and 1.0 == 1 would alias int keys.
    if not isinstance(obj, (int, float)) and len(_CACHE) < 4096:
        _CACHE[obj] = result
    return result


# --- complex types: pairs of an NCCL float type -------------------------------------------
# NCCL has no complex type, but a complex array is an array of (real, imag) float pairs, and
# every collective that moves data, and sum/avg, treats each float of a pair on its own: the
# adaptation layer hands such arrays to NCCL as twice as many floats. prod/max/min are not
# componentwise and must be refused by the caller (pynccl._adapt.is_complex).

_COMPLEX_BY_NAME: dict[str, DataType] = {
    "complex32": DataType.FLOAT16,  # torch.complex32 / torch.chalf
    "chalf": DataType.FLOAT16,
    "complex64": DataType.FLOAT32,
    "cfloat": DataType.FLOAT32,
    "complex128": DataType.FLOAT64,
    "cdouble": DataType.FLOAT64,
}
_COMPLEX_NAMES = {
    DataType.FLOAT16: "complex32",
    DataType.FLOAT32: "complex64",
    DataType.FLOAT64: "complex128",
}
# Little-endian typestrs (numpy has no complex32). Big-endian ones stay unrecognised.
_COMPLEX_TYPESTRS = {"c8": DataType.FLOAT32, "c16": DataType.FLOAT64}
_COMPLEX_CACHE: dict[Any, DataType | None] = {}


def _complex_of(obj: Any) -> DataType | None:
    if isinstance(obj, (bool, int, float, DataType)):
        return None
    if obj is complex:
        return DataType.FLOAT64
    if isinstance(obj, str):
        name = obj.strip()
        for prefix in ("torch.", "numpy.", "np."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name[:1] in ("<", "=", "|") or (name[:1] == ">" and sys.byteorder == "big"):
            return _COMPLEX_TYPESTRS.get(name[1:])
        return _COMPLEX_BY_NAME.get(name) or _COMPLEX_TYPESTRS.get(name)
    module = type(obj).__module__ or ""
    if module.startswith("torch"):
        return _complex_of(str(obj))
    if isinstance(obj, type):
        np = sys.modules.get("numpy")
        if np is not None and (obj.__module__ or "").split(".")[0] == "numpy":
            try:
                return _complex_of(np.dtype(obj))
            except TypeError:
                return None
        return None
    dtype_name = getattr(obj, "name", None)
    if isinstance(dtype_name, str) and getattr(obj, "kind", None) == "c":
        if getattr(obj, "byteorder", "=") == ">" and sys.byteorder == "little":
            return None
        return _COMPLEX_BY_NAME.get(dtype_name)
    return None


def complex_component(obj: Any) -> DataType | None:
    """The float type of each half of complex dtype ``obj``, or None if ``obj`` names no
    complex type NCCL can move as float pairs.

    ``"complex64"``, ``numpy.complex64``, ``numpy.dtype("<c8")``, ``torch.complex64``
    give ``FLOAT32``; the complex128 spellings ``FLOAT64``; ``"complex32"`` and
    ``torch.complex32`` (``chalf``) ``FLOAT16``. Never raises.
    """
    try:
        return _COMPLEX_CACHE[obj]
    except KeyError:
        pass
    except TypeError:  # unhashable
        return _complex_of(obj)
    try:
        result = _complex_of(obj)
    except Exception:  # a dtype-like object whose attributes raise: not a complex type
        return None
    if not isinstance(obj, (int, float)) and len(_COMPLEX_CACHE) < 4096:
        _COMPLEX_CACHE[obj] = result
    return result


def as_element_type(obj: Any) -> tuple[DataType, int]:
    """``obj`` as ``(NCCL type, lanes)``: ``(as_datatype(obj), 1)``, or for a complex type
    ``(complex_component(obj), 2)`` (two floats of that type per element). Raises
    :func:`as_datatype`'s ``TypeError`` for anything else."""
    if type(obj) is DataType:
        return obj, 1
    try:
        return as_datatype(obj), 1
    except TypeError:
        part = complex_component(obj)
        if part is None:
            raise
        return part, 2


def complex_name(component: DataType) -> str:
    """The numpy / torch name of the complex type made of two ``component`` floats."""
    return _COMPLEX_NAMES.get(component) or f"complex pairs of {canonical_name(component)}"


def canonical_name(datatype: DataType) -> str:
    """The numpy / ml_dtypes name of ``datatype``, e.g. ``"float8_e4m3fn"``."""
    return _ML_NAMES.get(datatype) or datatype.name.lower()


def to_numpy_dtype(datatype: DataType | Any) -> Any:
    """The numpy dtype for ``datatype`` (bfloat16 and float8 need ``ml_dtypes``)."""
    dt = as_datatype(datatype)
    import numpy as np

    if dt in (DataType.BFLOAT16, DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2):
        try:
            import ml_dtypes
        except ImportError as exc:
            raise TypeError(
                f"{dt.name.lower()} arrays need the 'ml_dtypes' package (pip install ml_dtypes)"
            ) from exc
        return np.dtype(getattr(ml_dtypes, _ML_NAMES[dt]))
    return np.dtype(canonical_name(dt))
