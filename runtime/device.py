"""One place that decides the device and dtype: CUDA (bf16) when present, the CPU otherwise."""

from __future__ import annotations

import torch

from specstore.runtime.errors import SpecstoreError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecstoreError("device 'cuda' was asked for but no CUDA device is available")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None = None) -> torch.dtype:
    """bf16 by default (the fast dtype on the CPU here and on GPUs); float32 for exactness checks."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16
    if dtype not in DTYPES:
        raise SpecstoreError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
