"""One place that decides the device and dtype: CUDA when present, the CPU otherwise; and the
dtype, for decoding (``resolve_dtype``) and for a build's embeddings (``resolve_build_dtype``)
alike: by default bf16 where the hardware runs it natively (a CUDA GPU, a CPU with AMX or
AVX-512 bf16), float32 elsewhere.

Why float32 on a CPU without native bf16: there oneDNN emulates bf16 products, and their cost
grows steeply with the rows of a forward. On a 2-core Xeon with AVX-512 but neither flag, with
the default model at 128 cached tokens, a plain step took 41 ms in bf16 and 60 in float32, but a
verification over 8 tree nodes 114 ms in bf16 (2.8x its plain step) against 79 in float32
(1.31x); respec ran at 1.18x bf16 plain decoding in bf16 and 1.63x in float32, side by side
(BENCHMARKS.md, "Decoding dtype"): every drafting method pays for its trees several times over
in emulated bf16, and float32 is also the dtype in which the lossless methods match plain decoding exactly."""

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


def resolve_dtype(dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
                  cpuinfo: str | Path = "/proc/cpuinfo") -> torch.dtype:
    """The dtype to decode in on ``device`` (resolved as ``resolve_device`` does): ``dtype`` as
    given, or for None / ``auto`` bf16 where that device runs it natively and float32 elsewhere
    (module doc); float32 is always right for exactness checks."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return DTYPES[auto_dtype_name(device, cpuinfo)]
    if dtype not in DTYPES:
        raise SpecstoreError(f"unknown dtype {dtype!r}: choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (what results and manifests record)."""
    return str(dtype).replace("torch.", "")


# CPU flags of native bf16 matrix arithmetic (Intel AMX, AVX512-BF16): bf16 builds ran ~6x
# faster than float32 end to end on such a CPU; without them bf16 is emulated and slower
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def _cpuinfo_field(names: tuple[str, ...], cpuinfo: str | Path) -> str | None:
    """The value of the first line of ``cpuinfo`` whose key is one of ``names`` (the first CPU's);
    None where the file is unreadable (e.g. not Linux) or has no such line."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value
    return None


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where ``cpuinfo`` is unreadable, e.g. not Linux)."""
    return frozenset((_cpuinfo_field(("flags", "Features"), cpuinfo) or "").split())


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model name (``model name`` in ``cpuinfo``; empty where unreadable or absent)."""
    return " ".join((_cpuinfo_field(("model name",), cpuinfo) or "").split())


def fast_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[bool, str]:
    """Whether bf16 runs fast here, and why (a CUDA GPU, or the CPU flag that says so)."""
    if torch.cuda.is_available():
        return True, "a CUDA GPU is present"
    native, why = native_bf16_cpu(cpuinfo)
    return native, why if native else f"no CUDA GPU and {why}"


def native_bf16_cpu(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[bool, str]:
    """Whether this CPU has native bf16 matrix arithmetic, and why (the flag, or its absence)."""
    flags = cpu_flags(cpuinfo) & set(BF16_CPU_FLAGS)
    if flags:
        return True, f"the CPU has {', '.join(sorted(flags))}"
    return False, f"the CPU has no {' or '.join(BF16_CPU_FLAGS)} flag"


def auto_dtype_name(device: str | torch.device | None = None, cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """``auto`` for decoding on ``device``: bfloat16 on CUDA and on a CPU with native bf16,
    float32 on other CPUs (module doc)."""
    dev = resolve_device(device)
    native = dev.type == "cuda" or (dev.type == "cpu" and native_bf16_cpu(cpuinfo)[0])
    return "bfloat16" if native else "float32"


def resolve_build_dtype(dtype: str | None = None, cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The dtype name a build embeds in: ``dtype`` as given (``float32`` or ``bfloat16``), or for
    None / ``auto`` bfloat16 where ``fast_bf16`` and float32 otherwise. Never returns ``auto``:
    the manifest records what ran, so an unchanged rebuild is recognised only in the same dtype."""
    if dtype is None or dtype == "auto":
        return "bfloat16" if fast_bf16(cpuinfo)[0] else "float32"
    if dtype not in ("float32", "bfloat16"):
        raise SpecstoreError(f"unknown build dtype {dtype!r}: choose auto, float32 or bfloat16")
    return dtype
