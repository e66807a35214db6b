"""The dtypes a flattened bucket may carry, by name: descriptions name a dtype, and a receiver looks the
name up in this table, never through ``getattr(torch, name)`` on input."""
from __future__ import annotations

import torch

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "complex64", "complex128", "int64", "int32", "int16", "int8", "uint64", "uint32",
    "uint16", "uint8", "bool",
)
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
"""Name -> dtype of every dtype a bucket may hold (those this torch has)."""
_DTYPE_TO_NAME = {d: n for n, d in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; ValueError for a dtype outside :data:`DTYPES`."""
    try:
        return _DTYPE_TO_NAME[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported in a flattened bucket; supported: {sorted(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (also accepts ``"torch.bfloat16"``); ValueError otherwise."""
    key = name[len("torch."):] if isinstance(name, str) and name.startswith("torch.") else name
    try:
        return DTYPES[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype name {name!r}; supported: {sorted(DTYPES)}") from None
