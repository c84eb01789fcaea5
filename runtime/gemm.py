"""specstore's own product kernel for decoding's few-row products on the CPU (csrc/small_gemm.c).

A decoding step multiplies each weight of the model by 1 to ~65 rows. There a product should
cost what reading its weight from memory costs, and each further row little: the kernel reads
each weight once, in panels of 16 outputs packed once, and every row multiplies it while it is
in registers (AVX2 + FMA, float32 accumulation). On this project's 2-core AMD EPYC (AVX2, no
AVX-512), the 210 projections of the default model's 30 layers, float32, cold caches
(``benchmarks/small_gemm.py``; docs/decoding.md has the table): oneDNN's packed product 31-44 ms
at 1-5 rows, 81 at 9, 94 at 17; this kernel 19-24 ms at 1-5 rows (the memory's bandwidth), 38 at
9, 52 at 17. It also makes a row's result independent of how many rows are multiplied with
it, bit for bit (the accumulation order is fixed: csrc/small_gemm.c), so plain decoding and a
tree verification agree exactly in the linear layers.

``library()`` compiles the C source once per machine with the system's C compiler (``$CC``, else
``cc`` / ``gcc``) into ``cache_dir()/kernels`` (keyed by the source, the flags and the
compiler), loads it and checks it against ``torch.nn.functional.linear``; it is None, with
``unavailable_reason()`` saying why, where the CPU lacks AVX2 or FMA, no compiler works, the
check fails, or ``SPECSTORE_CPU_KERNEL=0``. Threads: OpenMP, the same runtime torch runs on
(torch's ``libgomp.so.1`` is loaded first, and the kernel's reference to that name resolves to
it), as many as ``torch.get_num_threads()``; where a second OpenMP runtime would be loaded the
kernel is not used (two thread pools spinning on 2 cores slow each other several times over).

Where the CPU has AVX-512 BF16 the same library holds bf16 attention for decoding's steps and
trees (``attention``, taken by attention.py), ReSpec's entropy trigger (``entropy``) and the RMS
norm and gated-MLP middle (``rmsnorm``, ``silu_mul``, taken by fused.py). Every build holds the
float32 draft head's guess beside other work (``head_beside`` with float32 tensors) and float32
attention for steps and trees (``attention`` with float32 tensors), the ones CPUs without AVX-512
BF16 run: with it a float32 tree verification gives plain decoding's logits bit for bit (torch's
attention rounds a many-row forward differently from a 1-row one).

linear.py routes products of up to ``MAX_ROWS`` rows here (float32 always; bf16 on CPUs
without native bf16, where oneDNN emulates it); larger ones (a prompt's prefill) keep torch's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch

from specstore.runtime.device import cpu_flags
from specstore.runtime.models import cache_dir

SOURCE = Path(__file__).resolve().parent / "csrc" / "small_gemm.c"
# built into the same library: the cost-aware pruner's per-node loops (runtime/tree_kernel.py)
TREE_SOURCE = SOURCE.parent / "draft_tree.c"
TREE_ABI = 2  # specstore_tree_abi() of that source
ABI = 2  # specstore_gemm_abi() of the source this module speaks to
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
# added on CPUs with AVX-512 BF16: bf16 products through its dot-product instruction (the source's
# specstore_linear_bf16dp; module doc)
DOT_BF16_FLAGS = ("-mavx512f", "-mavx512bf16")
NB = 16  # outputs per panel (csrc/small_gemm.c)
# products of up to this many rows go to the kernel: a 64-node tree and its pending token, with
# room; at 65 rows it still beat oneDNN here on every shape of the default model (the head:
# 32.8 against 34.3 ms), at 129 it did not (63.3 against 56.5 ms)
MAX_ROWS = 72
_OPENMP_NAMES = ("libgomp", "libiomp", "libomp")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False


def unavailable_reason() -> str | None:
    """Why the kernel is not used here (None when it is); loads it first if not yet tried."""
    library()
    return _reason


def available() -> bool:
    return library() is not None


def library() -> ctypes.CDLL | None:
    """The compiled kernel, compiled and checked on first use (module doc); None where it cannot run."""
    global _lib, _reason, _loaded
    if _loaded:
        return _lib
    with _lock:
        if not _loaded:
            try:
                _lib, _reason = _load()
            except Exception as exc:  # never let the fast path break decoding: torch's products remain
                _lib, _reason = None, f"the kernel could not be loaded ({type(exc).__name__}: {exc})"
            _loaded = True
    return _lib


def _reset_for_tests() -> None:
    global _lib, _reason, _loaded
    with _lock:
        _lib, _reason, _loaded = None, None, False


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC")
    if cc:
        return cc.split()
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _openmp_libraries() -> set[str]:
    """Files of OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    except OSError:
        return set()
    return {os.path.realpath(p) for p in paths if any(Path(p).name.startswith(n) for n in _OPENMP_NAMES)}


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("SPECSTORE_CPU_KERNEL", "1") == "0":
        return None, "SPECSTORE_CPU_KERNEL=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the kernel is written for x86-64 (AVX2), this is {platform.machine()}"
    missing = {"avx2", "fma"} - cpu_flags()
    if missing:
        return None, f"the CPU lacks {', '.join(sorted(missing))}"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (set CC, or install gcc)"
    source = SOURCE.read_bytes() + TREE_SOURCE.read_bytes()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the C compiler {cc[0]} does not run ({exc})"
    flag_sets = [FLAGS]
    if {"avx512f", "avx512_bf16"} <= cpu_flags() and os.environ.get("SPECSTORE_CPU_KERNEL_BF16_DOT", "1") != "0":
        flag_sets.insert(0, FLAGS + DOT_BF16_FLAGS)  # a compiler without them: the plain build
    problem = None
    for flags in flag_sets:
        target, problem = _compiled(cc, version, source, flags)
        if target is not None:
            break
    if target is None:
        return None, problem
    before = _openmp_libraries()
    lib = ctypes.CDLL(str(target))
    after = _openmp_libraries()
    if len(after) > 1 and after != before:
        return None, f"the kernel would run a second OpenMP runtime beside torch's ({', '.join(sorted(after))})"
    if lib.specstore_gemm_abi() != ABI:
        return None, f"{target} speaks ABI {lib.specstore_gemm_abi()}, not {ABI}"
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.specstore_linear_f32.argtypes = [p, i64, p, p, p, i64, i64, i32]
    lib.specstore_linear_f32.restype = None
    lib.specstore_linear_bf16.argtypes = [p, i64, p, p, p, i64, i64, i32]
    lib.specstore_linear_bf16.restype = i32
    lib.specstore_gemm_features.restype = i32
    lib.dot_bf16 = bool(lib.specstore_gemm_features() & 1)
    if lib.dot_bf16:  # only the AVX-512 BF16 build has it (csrc/small_gemm.c); the plain build is AVX2's
        lib.specstore_linear_bf16dp.argtypes = [p, i64, p, p, p, i64, i64, i32]
        lib.specstore_linear_bf16dp.restype = i32
    lib.attention = bool(lib.specstore_gemm_features() & 2)
    if lib.attention:
        lib.specstore_attention_bf16.argtypes = [p, i64, i64, i64, p, i64, p, i64, i64, i64, p, i64,
                                                 ctypes.c_float, p, i32]
        lib.specstore_attention_bf16.restype = i32
        lib.specstore_entropy_bf16.argtypes = [p, i64]
        lib.specstore_entropy_bf16.restype = ctypes.c_double
    lib.attention_f32 = bool(lib.specstore_gemm_features() & 128)
    if lib.attention_f32:
        lib.specstore_attention_f32.argtypes = [p, i64, i64, i64, p, i64, p, i64, i64, i64, p, i64,
                                                ctypes.c_float, p, i32]
        lib.specstore_attention_f32.restype = i32
    lib.decoder_f32 = bool(lib.specstore_gemm_features() & 256)
    if lib.decoder_f32:  # kernel_forward.py
        f = ctypes.c_float
        lib.specstore_decoder_f32.argtypes = [i64, i64, i64, i64, i64, i64, i64, f, f, p, p, p, p, p, p, p, p, p, p, p,
                                              p, p, i64, i64, p, p, p, i64, p, p, i32]
        lib.specstore_decoder_f32.restype = i32
    lib.elementwise = bool(lib.specstore_gemm_features() & 4)
    if lib.elementwise:
        lib.specstore_argmax_bf16.argtypes = [p, i64]
        lib.specstore_argmax_bf16.restype = i64
        lib.specstore_rmsnorm_bf16.argtypes = [p, p, p, i64, i64, ctypes.c_float]
        lib.specstore_rmsnorm_bf16.restype = None
        lib.specstore_silu_mul_bf16.argtypes = [p, p, p, i64]
        lib.specstore_silu_mul_bf16.restype = None
    lib.specstore_sa_longest.argtypes = [p, p, i32, i64, p, i64, p, i64, i64, p]
    lib.specstore_sa_longest.restype = i64
    lib.specstore_context_matches.argtypes = [p, i64, i64, i64, i64, p, p, p]
    lib.specstore_context_matches.restype = i64
    lib.specstore_move_rows.argtypes = [p, i64, i64, i64, i64, i64, p, i64]
    lib.specstore_move_rows.restype = None
    lib.rotary = bool(lib.specstore_gemm_features() & 16)
    if lib.rotary:
        lib.specstore_rotary_bf16.argtypes = [p, i64, i64, i64, i64, i64, p, p, i64, p]
        lib.specstore_rotary_bf16.restype = None
    lib.dense = bool(lib.specstore_gemm_features() & 8)
    if lib.dense:
        lib.specstore_dense_top.argtypes = [p, i32, i64, p, p, i64, ctypes.c_float, p, p, i32, i64, i64, i32, p, p, p]
        lib.specstore_dense_top.restype = i64
        lib.specstore_dense_rerank.argtypes = [p, p, i64, p, i32, i64, p, i64, i64, p, p]
        lib.specstore_dense_rerank.restype = i64
    if lib.specstore_tree_abi() != TREE_ABI:
        return None, f"{target} speaks tree ABI {lib.specstore_tree_abi()}, not {TREE_ABI}"
    lib.specstore_tree_size.argtypes = [i64, p, p, p, ctypes.c_double, p, i64, ctypes.c_double, ctypes.c_double, p, p, p,
                                        ctypes.c_double, p, p, p]
    lib.specstore_tree_size.restype = i64
    lib.specstore_calibrate.argtypes = [i64, p, p, p, i64, p, i64]
    lib.specstore_calibrate.restype = i64
    lib.specstore_respec_trie.argtypes = [i64, p, p, i64, p, p, p, p, p, p, p, i64, i64, p, p, p, p, p]
    lib.specstore_respec_trie.restype = i64
    lib.specstore_respec_sized.argtypes = [i64, p, p, i64, p, p, p, p, p, p, p, i64, i64, i64, p, i64, ctypes.c_double,
                                           ctypes.c_double, p, p, p, ctypes.c_double, p, p, p, p, p, p]
    lib.specstore_respec_sized.restype = i64
    lib.head = bool(lib.specstore_gemm_features() & 32)
    if lib.head:
        lib.specstore_head_beside.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, p, p]
        lib.specstore_head_beside.restype = i32
    lib.head_f32 = bool(lib.specstore_gemm_features() & 64)
    if lib.head_f32:
        lib.specstore_head_beside_f32.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, p, p, i32]
        lib.specstore_head_beside_f32.restype = i32
    lib.argmax_f32 = bool(lib.specstore_gemm_features() & 1024)
    if lib.argmax_f32:
        lib.specstore_argmax_f32.argtypes = [p, i64]
        lib.specstore_argmax_f32.restype = i64
    lib.entropy_f32 = bool(lib.specstore_gemm_features() & 512)
    if lib.entropy_f32:
        lib.specstore_entropy_f32.argtypes = [p, i64]
        lib.specstore_entropy_f32.restype = ctypes.c_double
    problem = _self_check(lib)
    if problem:
        return None, problem
    return lib, None


def _compiled(cc: list[str], version: list[str], source: bytes, flags: tuple[str, ...]) -> tuple[Path | None, str | None]:
    """The library compiled with ``flags`` into the cache (once per source, flags and compiler)."""
    key = hashlib.sha256(source + repr((flags, cc, version)).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"small_gemm-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([*cc, *flags, str(SOURCE), str(TREE_SOURCE), "-o", tmp], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                return None, f"compiling {SOURCE.name} and {TREE_SOURCE.name} failed: {(done.stderr or done.stdout).strip()[-400:]}"
            os.replace(tmp, target)  # atomic: concurrent processes each compile, one file wins
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target, None


def dot_bf16(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the loaded kernel multiplies bf16 through AVX-512 BF16 dot products (module doc)."""
    lib = lib or library()
    return bool(lib is not None and getattr(lib, "dot_bf16", False))


def has_attention(lib: ctypes.CDLL | None = None, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the loaded kernel has the attention of few query rows in ``dtype`` (csrc/small_gemm.c:
    bf16 where the CPU has AVX-512 BF16, float32 wherever the kernel loads)."""
    lib = lib or library()
    flag = {torch.bfloat16: "attention", torch.float32: "attention_f32"}.get(dtype)
    return bool(lib is not None and flag and getattr(lib, flag, False))


ATTENTION_MAX_QUERIES = 128  # query tokens of a forward the kernel's attention takes (steps and trees)


def attention_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask) -> bool:
    """Whether ``attention`` computes this call: the kernel has it here for the dtype (bf16 or
    float32, ``has_attention``), on the CPU, one sequence, up to ``ATTENTION_MAX_QUERIES`` query
    tokens, head dims a multiple of 32 (bf16) or 8 (float32) up to 256, key/value rows contiguous,
    and either one query without a mask or an additive mask of the same dtype [1, 1, q, keys]."""
    dtype = query.dtype
    if dtype not in (torch.bfloat16, torch.float32) or key.dtype != dtype or value.dtype != dtype:
        return False
    if not has_attention(dtype=dtype):
        return False
    if query.device.type != "cpu" or query.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1:
        return False
    heads, nq, dim = query.shape[1:]
    if nq > ATTENTION_MAX_QUERIES or dim % (32 if dtype == torch.bfloat16 else 8) or dim > 256:
        return False
    if key.shape[-1] != dim or value.shape[-1] != dim:
        return False
    if key.shape[1] == 0 or heads % key.shape[1] or value.shape[:3] != key.shape[:3]:
        return False
    if key.stride(-1) != 1 or key.stride(-2) != dim or value.stride(-1) != 1 or value.stride(-2) != dim:
        return False
    if mask is None:
        return nq == 1
    return (isinstance(mask, torch.Tensor) and mask.dtype == dtype and mask.dim() == 4
            and mask.shape[0] == 1 and mask.shape[1] == 1 and tuple(mask.shape[2:]) == (nq, key.shape[2])
            and mask.stride(-1) == 1)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None) -> torch.Tensor:
    """softmax(q k^T x scale + mask) v for one sequence (``attention_takes``), query heads
    grouped over the key/value heads as transformers' ``repeat_kv`` groups them; returns
    [1, q, heads, dim] in the query's dtype (the layout attention functions hand back). Each
    row's result depends only on its query and its allowed keys in order (csrc/small_gemm.c)."""
    lib = _lib or library()
    query = query.contiguous()
    heads, nq, dim = query.shape[1:]
    out = torch.empty((1, nq, heads, dim), dtype=query.dtype)
    scale = dim ** -0.5 if scale is None else float(scale)
    m_ptr, m_stride = (None, 0) if mask is None else (mask.data_ptr(), mask.stride(2))
    fn = lib.specstore_attention_f32 if query.dtype == torch.float32 else lib.specstore_attention_bf16
    code = fn(query.data_ptr(), heads, nq, dim, key.data_ptr(), key.stride(1), value.data_ptr(), value.stride(1),
              key.shape[1], key.shape[2], m_ptr, m_stride, scale, out.data_ptr(), torch.get_num_threads())
    if code == -2:
        raise MemoryError("small_gemm: no memory for the attention's scratch")
    if code != 0:
        raise ValueError(f"small_gemm: attention refused its shapes ({code})")
    return out


def move_rows(buffers: list[torch.Tensor], start: int, rows: list[int]) -> bool:
    """In each of ``buffers`` (contiguous CPU tensors [..., heads, capacity, dim] of one shape and
    dtype: a cache's key and value buffers), rows ``start + rows[i]`` to ``start + i`` along
    the capacity dim, in one kernel call (specstore_move_rows); ``rows`` increasing with
    ``rows[i] >= i``. False, with nothing moved, where the kernel is missing or the buffers are
    not all alike (the caller moves them with torch)."""
    lib = _lib or library()
    if lib is None or not buffers or (rows and rows[0] < 0) or any(b <= a for a, b in pairwise(rows)):  # so rows[i] >= i
        return False
    first = buffers[0]
    shape, dtype = first.shape, first.dtype
    if first.dim() < 2:
        return False
    for b in buffers:  # properties that cost ~0.1 us each (device.type costs several times more)
        if not (b.is_cpu and b.dtype == dtype and b.shape == shape and b.is_contiguous()):
            return False
    if start < 0 or start + (rows[-1] if rows else 0) >= shape[-2]:
        return False
    heads = first.numel() // (shape[-2] * shape[-1]) if shape[-2] * shape[-1] else 0
    row_bytes = shape[-1] * first.element_size()
    ptrs = (ctypes.c_void_p * len(buffers))(*[b.data_ptr() for b in buffers])
    src = (ctypes.c_int64 * len(rows))(*rows)
    lib.specstore_move_rows(ptrs, len(buffers), heads, shape[-2] * row_bytes, row_bytes, start, src, len(rows))
    return True


def has_elementwise(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the loaded kernel has the bf16 RMS norm and gated-MLP middle (fused.py takes them)."""
    lib = lib or library()
    return bool(lib is not None and getattr(lib, "elementwise", False))


def _rows_bf16(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' RMS norm of bf16 rows ``x`` [..., dim] with a bf16 ``weight`` [dim] in one
    call (csrc/small_gemm.c: specstore_rmsnorm_bf16); None where the kernel does not take it
    (the caller runs its module's own forward)."""
    if not (has_elementwise() and _rows_bf16(x, weight) and weight.dim() == 1 and x.dim() >= 1
            and x.shape[-1] == weight.shape[0] and x.numel()):
        return None
    out = torch.empty_like(x)
    _lib.specstore_rmsnorm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                                x.shape[-1], float(eps))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of bf16 tensors of one shape, each rounded to bf16 as torch rounds, in
    one call (specstore_silu_mul_bf16); None where the kernel does not take it."""
    if not (has_elementwise() and _rows_bf16(gate, up) and gate.shape == up.shape and gate.numel()):
        return None
    out = torch.empty_like(gate)
    _lib.specstore_silu_mul_bf16(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def has_rotary(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the loaded kernel has the bf16 rotary position embedding (fused.py takes it)."""
    lib = lib or library()
    return bool(lib is not None and getattr(lib, "rotary", False))


def _rotary_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    heads, n, dim = x.shape[1:]
    out = torch.empty((1, heads, n, dim), dtype=torch.bfloat16)
    _lib.specstore_rotary_bf16(x.data_ptr(), heads, n, dim, x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(),
                               cos.stride(1), out.data_ptr())
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim`` 1) of one
    sequence in bf16: ``x cos + rotate_half(x) sin`` for the query [1, heads, n, dim] and key
    [1, kv_heads, n, dim] rows (any strides, the last dim contiguous) with ``cos``/``sin``
    [1, n, dim], each op rounded to bf16 as torch rounds, in one call each
    (specstore_rotary_bf16); contiguous results. None where the kernel does not take it."""
    if not has_rotary():
        return None
    for t in (q, k, cos, sin):
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(-1) != 1:
            return None
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or q.shape[0] != 1 or k.shape[0] != 1:
        return None
    n, dim = q.shape[2], q.shape[3]
    if dim % 2 or k.shape[2] != n or k.shape[3] != dim or cos.shape != (1, n, dim) or sin.shape != cos.shape \
            or sin.stride(1) != cos.stride(1) or n == 0:
        return None
    return _rotary_one(q, cos, sin), _rotary_one(k, cos, sin)


DENSE_MAX_DIM = 1024  # csrc/small_gemm.c: the widest reduced embedding specstore_dense_top takes
DENSE_MAX_K = 256  # and the most neighbours


def has_dense(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the loaded kernel has the one-call dense search (``dense_top``)."""
    lib = lib or library()
    return bool(lib is not None and getattr(lib, "dense", False))


def has_head(lib: ctypes.CDLL | None = None, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the loaded kernel has the draft head's guess beside other work (``head_beside``)
    for a head computing in ``dtype``: bf16 where the CPU has AVX-512 BF16, float32 on every
    CPU the kernel runs on."""
    lib = lib or library()
    if dtype == torch.float32:
        return bool(lib is not None and getattr(lib, "head_f32", False))
    return bool(lib is not None and dtype == torch.bfloat16 and getattr(lib, "head", False))


HEAD_MAX_K = 64  # csrc/small_gemm.c
_beside = threading.local()  # what the one callback below runs on this thread, and what it gave


def _run_beside() -> None:
    try:
        _beside.result = (True, _beside.fn())
    except BaseException as exc:  # raised by head_beside, on this side of the C call
        _beside.result = (False, exc)


# one ctypes callback for every call, made once: a callback made per call (a libffi closure
# allocated and freed each time) slowed the next verification forward by 0.2-0.7 ms a step here,
# more than the guess beside the search saved (BENCHMARKS.md, twenty-sixth session)
_BESIDE_CALLBACK = ctypes.CFUNCTYPE(None)(_run_beside)


def head_beside(fn, hidden: torch.Tensor, pending: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                b2: torch.Tensor | None, out: torch.Tensor, vocab: int, probs: np.ndarray, top: np.ndarray):
    """A draft head's guess on the OpenMP runtime's second thread while this one runs ``fn()``
    (csrc/small_gemm.c: specstore_head_beside and specstore_head_beside_f32;
    runtime/draft_head.py: DraftHead.guess_beside): ``hidden`` [H] and ``pending`` [I], the three
    weights as ``pack`` gives them, ``b2`` [H] or None, all bf16 (pair panels; CPUs with AVX-512
    BF16) or all float32 (any CPU the kernel runs on; the three weights may instead be bf16 panels
    packed with ``pairs=False``, widened as read: half the bytes); the probabilities go to ``probs``
    (float32 [vocab]) and the ``len(top)`` likeliest indices to ``top`` (int64, -1 past the
    last). Returns ``(True, fn())``; ``(False, None)`` where the kernel does not take the call
    (nothing run). What ``fn`` raises is raised here, after the guess is done."""
    lib = library()
    dtype = hidden.dtype
    if not has_head(lib, dtype) or not 0 <= len(top) <= HEAD_MAX_K:
        return False, None
    weights = (fc1, fc2, out)
    w16 = dtype == torch.float32 and all(w.dtype == torch.bfloat16 for w in weights)
    vectors = (hidden, pending) + (() if b2 is None else (b2,))
    if (any(t.dtype != dtype for t in vectors + (() if w16 else weights))
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in vectors + weights)):
        return False, None
    h, i = hidden.numel(), pending.numel()
    if dtype == torch.float32:  # float32 or bf16 weights, plain panels
        shapes = ((-(-i // NB), h, NB), (-(-h // NB), i, NB), (-(-vocab // NB), h, NB))
    else:
        shapes = ((-(-i // NB), h // 2, NB, 2), (-(-h // NB), i // 2, NB, 2), (-(-vocab // NB), h // 2, NB, 2))
    if ((dtype == torch.bfloat16 and (h % 2 or i % 2)) or probs.dtype != np.float32 or top.dtype != np.int64
            or probs.shape != (vocab,) or (fc1.shape, fc2.shape, out.shape) != shapes
            or (b2 is not None and b2.numel() != h)):
        return False, None
    call = lib.specstore_head_beside_f32 if dtype == torch.float32 else lib.specstore_head_beside
    outer = getattr(_beside, "fn", None), getattr(_beside, "result", None)  # a call from inside fn nests
    _beside.fn, _beside.result = fn, None
    try:
        status = call(_BESIDE_CALLBACK, hidden.data_ptr(), pending.data_ptr(), fc1.data_ptr(), fc2.data_ptr(),
                      None if b2 is None else b2.data_ptr(), out.data_ptr(), h, i, vocab, len(top), probs.ctypes.data,
                      top.ctypes.data, *((int(w16),) if dtype == torch.float32 else ()))
        result = _beside.result
    finally:
        _beside.fn, _beside.result = outer
    if status != 0:
        return False, None
    done, value = result
    if not done:
        raise value
    return True, value


def dense_top(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, scales: np.ndarray | None,
              rows: np.ndarray | None, k: int, want_query: bool = False):
    """One query's dense search in one call (csrc/small_gemm.c: specstore_dense_top): the unit
    query ``p / max(|p|, eps)`` with ``p = hidden @ weight + bias`` (``hidden`` [H] bf16 or
    float32 on the CPU; ``weight`` [H, D], ``bias`` [D] float32, contiguous), the ``k`` best of
    ``rows`` [n, D] (int8 codes with per-dimension float32 ``scales``, or float32 rows with
    ``scales`` None; C-contiguous; None: no scan) by inner product, best first, ties to the lower
    offset. Returns (offsets int64 [m], scores float32 [m], the unit query float32 [D] or None
    without ``want_query``), or None where the kernel does not take the call (the caller runs
    torch's way)."""
    if not has_dense() or hidden.device.type != "cpu" or hidden.dtype not in (torch.bfloat16, torch.float32):
        return None
    if weight.dtype != torch.float32 or bias.dtype != torch.float32 or not (weight.is_contiguous() and bias.is_contiguous()):
        return None
    hsize, dim = weight.shape
    if hidden.numel() != hsize or bias.numel() != dim or dim > DENSE_MAX_DIM or not 0 <= k <= DENSE_MAX_K:
        return None
    if (rows is not None and not _dense_rows_ok(rows, scales, dim)) or not _scales_ok(scales, dim):
        return None
    n = 0 if rows is None else rows.shape[0]
    hidden = hidden.detach().reshape(-1).contiguous()
    idx, scores = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.float32)
    query = np.empty(dim, dtype=np.float32) if want_query else None
    found = _lib.specstore_dense_top(
        hidden.data_ptr(), int(hidden.dtype == torch.bfloat16), hsize, weight.data_ptr(), bias.data_ptr(), dim,
        float(eps), None if scales is None else scales.ctypes.data, None if n == 0 else rows.ctypes.data,
        int(rows is not None and rows.dtype == np.int8), n, k, torch.get_num_threads(),
        None if query is None else query.ctypes.data, idx.ctypes.data, scores.ctypes.data)
    if found < 0:
        return None
    return idx[:found], scores[:found], query


def _dense_rows_ok(rows: np.ndarray, scales: np.ndarray | None, dim: int) -> bool:
    """Rows the dense kernel reads: [n, dim] C-contiguous, int8 codes with scales or float32 without."""
    int8 = rows.dtype == np.int8
    return ((int8 or rows.dtype == np.float32) and rows.ndim == 2 and rows.shape[1] == dim
            and rows.flags.c_contiguous and (scales is None) != int8)


def _scales_ok(scales: np.ndarray | None, dim: int) -> bool:
    return scales is None or (scales.dtype == np.float32 and scales.shape == (dim,) and scales.flags.c_contiguous)


def dense_rerank(query: np.ndarray, scales: np.ndarray | None, rows: np.ndarray, ids: np.ndarray, k: int):
    """An approximate index's candidates reranked exactly in one call (csrc/small_gemm.c:
    specstore_dense_rerank): the ``k`` best of ``rows`` [n, D] (int8 codes with float32
    ``scales``, or float32 rows with ``scales`` None; C-contiguous) at offsets ``ids`` (int64;
    outside [0, n) or repeated: dropped) by inner product with ``query / scales`` (float32 [D]),
    best first, ties to the lower offset. Returns (offsets int64 [m], scores float32 [m]), or None
    where the kernel does not take the call (the caller reranks in numpy)."""
    if not has_dense():
        return None
    dim = query.shape[0] if query.ndim == 1 else -1
    if (query.dtype != np.float32 or not query.flags.c_contiguous or dim <= 0 or dim > DENSE_MAX_DIM
            or not 0 <= k <= DENSE_MAX_K or not _dense_rows_ok(rows, scales, dim) or not _scales_ok(scales, dim)
            or ids.dtype != np.int64 or ids.ndim != 1 or not ids.flags.c_contiguous):
        return None
    int8 = rows.dtype == np.int8
    idx, scores = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.float32)
    found = _lib.specstore_dense_rerank(query.ctypes.data, None if scales is None else scales.ctypes.data, dim,
                                        rows.ctypes.data if rows.shape[0] else None, int(int8), rows.shape[0],
                                        ids.ctypes.data, ids.shape[0], k, idx.ctypes.data, scores.ctypes.data)
    if found < 0:
        return None
    return idx[:found], scores[:found]


def sa_longest(stream: np.ndarray, sa: np.ndarray, first: np.ndarray | None, context, max_len: int,
               min_len: int) -> tuple[int, int, int] | None:
    """The longest suffix of ``context`` (``min_len`` .. ``max_len`` tokens) found in a suffix
    array, in one call (csrc/small_gemm.c: specstore_sa_longest): ``(length, lo, hi)``, length 0
    where none is; ``stream`` int32 and ``sa`` int32 or int64 (C-contiguous, of one length),
    ``first``: int64 ranks where each first token starts (``first[t + 1]``), or None. None where
    the kernel is not loaded or the arrays are of another kind (the caller searches in numpy)."""
    lib = _lib or library()
    if lib is None or stream.dtype != np.int32 or sa.dtype not in (np.int32, np.int64) or stream.ndim != 1:
        return None
    if sa.shape != stream.shape or not (stream.flags.c_contiguous and sa.flags.c_contiguous):
        return None
    if first is not None and (first.dtype != np.int64 or first.ndim != 1 or not first.flags.c_contiguous):
        return None
    max_len = min(int(max_len), len(context))
    if max_len < min_len or max_len <= 0:
        return 0, 0, 0
    ctx = np.asarray(context[-max_len:], dtype=np.int64)
    out = np.zeros(2, dtype=np.int64)
    length = lib.specstore_sa_longest(stream.ctypes.data, sa.ctypes.data, int(sa.dtype == np.int64), stream.shape[0],
                                      None if first is None else first.ctypes.data, 0 if first is None else first.shape[0],
                                      ctx.ctypes.data, max_len, int(min_len), out.ctypes.data)
    return int(length), int(out[0]), int(out[1])


def context_matches(tokens: np.ndarray, max_ngram: int, min_ngram: int, cap: int = 0):
    """Prompt lookup's search in one call (csrc/small_gemm.c: specstore_context_matches):
    ``(n, starts, back)`` for int64 C-contiguous ``tokens`` [T]: the longest n-gram length found
    (0: none), the offsets after its occurrences (ascending, int64) and how far back each one
    matches the context's end, up to ``cap`` (n where ``cap`` <= n); None where the kernel is not
    loaded or ``tokens`` is of another kind (retrieval.py searches in numpy)."""
    lib = _lib or library()
    if lib is None or tokens.dtype != np.int64 or tokens.ndim != 1 or not tokens.flags.c_contiguous or tokens.size < 2:
        return None
    size = tokens.shape[0]
    starts, back, n = np.empty(size, dtype=np.int64), np.empty(size, dtype=np.int64), ctypes.c_int64(0)
    count = lib.specstore_context_matches(tokens.ctypes.data, size, int(max_ngram), int(min_ngram), int(cap),
                                          ctypes.byref(n), starts.ctypes.data, back.ctypes.data)
    return int(n.value), starts[:count], back[:count]


def argmax(logits: torch.Tensor) -> int | None:
    """The index of the first largest of 1-D contiguous bf16 or float32 CPU logits in one kernel
    call (specstore_argmax_bf16, specstore_argmax_f32: torch's argmax, first maximum, without a
    copy); None where a logit is NaN (torch takes NaN as the largest) or the kernel does not take
    them (bf16 needs AVX-512)."""
    if logits.device.type != "cpu" or logits.dim() != 1 or not logits.is_contiguous():
        return None
    lib = library()
    if logits.dtype == torch.bfloat16 and getattr(lib, "elementwise", False):
        found = lib.specstore_argmax_bf16(logits.data_ptr(), logits.shape[0])
    elif logits.dtype == torch.float32 and getattr(lib, "argmax_f32", False):
        found = lib.specstore_argmax_f32(logits.data_ptr(), logits.shape[0])
    else:
        return None
    return int(found) if found >= 0 else None


def entropy(logits: torch.Tensor) -> float | None:
    """Entropy in nats of softmax(``logits``) for 1-D contiguous bf16 or float32 CPU logits
    through the kernel (one call, two passes; NaN where a logit is NaN or +inf); None where the
    kernel has no such function here or the logits are of another kind (the caller computes it
    with torch)."""
    if logits.device.type != "cpu" or logits.dim() != 1 or not logits.is_contiguous():
        return None
    lib = library()
    if logits.dtype == torch.bfloat16 and getattr(lib, "attention", False):
        return float(lib.specstore_entropy_bf16(logits.data_ptr(), logits.shape[0]))
    if logits.dtype == torch.float32 and getattr(lib, "entropy_f32", False):
        return float(lib.specstore_entropy_f32(logits.data_ptr(), logits.shape[0]))
    return None


def pack(weight: torch.Tensor, lib: ctypes.CDLL | None = None, pairs: bool = True) -> torch.Tensor:
    """``weight`` [n, k] (float32 or bf16) as the kernel's panels, zero-padded past n:
    [ceil(n / 16), k, 16]; bf16 with even k where the kernel has dot products (and ``pairs``):
    pairs of k, [ceil(n / 16), k / 2, 16, 2] (csrc/small_gemm.c)."""
    n, k = weight.shape
    blocks = -(-n // NB)
    padded = weight.detach()
    if blocks * NB != n:
        padded = torch.cat([padded, padded.new_zeros(blocks * NB - n, k)])
    if pairs and weight.dtype == torch.bfloat16 and k % 2 == 0 and dot_bf16(lib):
        return padded.reshape(blocks, NB, k // 2, 2).transpose(1, 2).contiguous()
    return padded.reshape(blocks, NB, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, panel: torch.Tensor, bias: torch.Tensor | None, n: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [..., k] (the weight as ``pack`` gave it, n outputs),
    in ``x``'s dtype (float32 or bf16, the panel's)."""
    lib = lib or _lib or library()
    k = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    rows = x.numel() // k if k else 0
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    threads = torch.get_num_threads()
    b = None if bias is None else bias.data_ptr()
    if x.dtype == torch.float32:
        lib.specstore_linear_f32(x.data_ptr(), rows, panel.data_ptr(), b, out.data_ptr(), n, k, threads)
    else:  # pairs of k for the dot-product path (pack), else widened
        fn = lib.specstore_linear_bf16dp if panel.dim() == 4 else lib.specstore_linear_bf16
        if fn(x.data_ptr(), rows, panel.data_ptr(), b, out.data_ptr(), n, k, threads) != 0:
            raise MemoryError("small_gemm: no memory for a float32 copy of the inputs")
    return out


def _self_check(lib: ctypes.CDLL) -> str | None:
    """The compiled kernel against float64 products, on shapes that take every path (a partial
    last panel, a bias, row counts across register blocks); a message where it is wrong."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for n, k, rows, with_bias in ((40, 33, 1, False), (37, 70, 7, True), (16, 8, 13, True), (21, 64, 25, True)):
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(rows, k, generator=g).to(dtype)
            bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
            got = linear(x, pack(w, lib), bias, n, lib).double()
            want = x.double() @ w.double().T + (0 if bias is None else bias.double())
            if not torch.allclose(got, want, rtol=tol, atol=tol * max(1.0, float(want.abs().max()))):
                err = float((got - want).abs().max())
                warnings.warn(f"specstore's CPU kernel gave wrong products here (max error {err:.3g}); not using it", stacklevel=3)
                return f"the compiled kernel failed its check ({dtype}, {n}x{k}, {rows} rows: max error {err:.3g})"
    return None
