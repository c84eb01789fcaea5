"""One place that decides the device and dtype: CUDA (bf16) when present, the CPU otherwise;
and the dtype a build embeds in (``resolve_build_dtype``): bf16 where the hardware runs it fast."""

from __future__ import annotations

from pathlib import Path

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


# CPU flags of native bf16 matrix arithmetic (Intel AMX, AVX512-BF16): bf16 builds ran ~6x
# faster than float32 end to end on such a CPU; without them bf16 is emulated and slower
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where ``cpuinfo`` is unreadable, e.g. not Linux)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def fast_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[bool, str]:
    """Whether bf16 runs fast here, and why (a CUDA GPU, or the CPU flag that says so)."""
    if torch.cuda.is_available():
        return True, "a CUDA GPU is present"
    flags = cpu_flags(cpuinfo) & set(BF16_CPU_FLAGS)
    if flags:
        return True, f"the CPU has {', '.join(sorted(flags))}"
    return False, f"no CUDA GPU and no {' or '.join(BF16_CPU_FLAGS)} CPU flag"


def resolve_build_dtype(dtype: str | None = None, cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The dtype name a build embeds in: ``dtype`` as given (``float32`` or ``bfloat16``), or for
    None / ``auto`` bfloat16 where ``fast_bf16`` and float32 otherwise. Never returns ``auto``:
    the manifest records what ran, so an unchanged rebuild is recognised only in the same dtype."""
    if dtype is None or dtype == "auto":
        return "bfloat16" if fast_bf16(cpuinfo)[0] else "float32"
    if dtype not in ("float32", "bfloat16"):
        raise SpecstoreError(f"unknown build dtype {dtype!r}: choose auto, float32 or bfloat16")
    return dtype
