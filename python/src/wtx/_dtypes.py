"""Dtypes both ways: torch, numpy and safetensors names <-> wtx.v1.DType values."""
from __future__ import annotations

from typing import Any

# wtx.v1.DType value -> (name, element bytes, safetensors name); the C table
# WTX_DTYPE_MAP in include/wtx/tensor.h.
WIRE = {
    1: ("float32", 4, "F32"), 2: ("float16", 2, "F16"), 3: ("bfloat16", 2, "BF16"),
    4: ("float8_e4m3fn", 1, "F8_E4M3"), 5: ("float8_e5m2", 1, "F8_E5M2"),
    6: ("int8", 1, "I8"), 7: ("uint8", 1, "U8"), 8: ("int16", 2, "I16"),
    9: ("int32", 4, "I32"), 10: ("int64", 8, "I64"), 11: ("bool", 1, "BOOL"),
    12: ("float64", 8, "F64"), 13: ("uint16", 2, "U16"), 14: ("uint32", 4, "U32"),
    15: ("uint64", 8, "U64"),
}
BY_NAME = {name: v for v, (name, _, _) in WIRE.items()}
BY_SAFETENSORS = {st: v for v, (_, _, st) in WIRE.items()}


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def to_wire(dtype: Any) -> int:
    """The wire value of a torch dtype, a numpy dtype, or a name ("bfloat16",
    "F32", "torch.float16"). ValueError names what has no wire value."""
    torch = _torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        if dtype in BY_SAFETENSORS:
            return BY_SAFETENSORS[dtype]
        name = dtype.removeprefix("torch.")
    else:
        import numpy as np
        name = np.dtype(dtype).name
        name = {"bool_": "bool"}.get(name, name)
    if name not in BY_NAME:
        raise ValueError(f"dtype {dtype!r} has no wtx wire type (supported: {', '.join(BY_NAME)})")
    return BY_NAME[name]


def to_torch(wire: int):
    """The torch dtype of a wire value."""
    torch = _torch()
    if torch is None:
        raise ImportError("wtx: torch is needed for torch tensors (pip install torch)")
    return getattr(torch, WIRE[wire][0])


def to_numpy(wire: int):
    """The numpy dtype of a wire value (bf16 and fp8 have none in numpy:
    ValueError)."""
    import numpy as np
    name = WIRE[wire][0]
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        raise ValueError(f"numpy has no {name}; use torch tensors for it")
    return np.dtype(name)


def element_size(wire: int) -> int:
    return WIRE[wire][1]
