"""The kernel's bf16 attention and its fused norms / MLP middles on this CPU (runtime/gemm.py,
runtime/fused.py, csrc/small_gemm.c).

    python benchmarks/kernel_parts.py --part attention
    python benchmarks/kernel_parts.py --part steps --context 300

``attention``: one layer's attention of the default model's shape (9 query heads over 3
key/value heads of 64), 1-17 query tokens over 300 and 1,000 keys under a tree's additive mask
(zeros where allowed): SDPA over packed heads (attention.py's path without the kernel) and the
kernel on both threads and on one, median of ``--rounds`` x 300 calls, microseconds.

``steps``: whole verification steps of the default model in bf16, loaded twice, one with torch's
RMS norms and MLP middles (``SPECSTORE_CPU_FUSED=0`` as it runs) and one with the kernel's,
``TreeVerifier.tree_logits`` over chains of 0-8 nodes after ``--context`` cached tokens, the two
models alternating, median of ``--rounds`` x 5, milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _timed(fn, reps: int, rounds: int) -> float:
    for _ in range(20):
        fn()
    runs = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - start) / reps)
    return statistics.median(runs)


def attention(rounds: int) -> None:
    from specstore.runtime import gemm

    if not gemm.has_attention():
        print("the kernel has no bf16 attention here (needs AVX-512 BF16)")
        return
    print("keys | query tokens | SDPA packed | kernel | kernel, 1 thread   (us a layer)")
    for keys in (300, 1000):
        for nq in (1, 5, 9, 17):
            a, b, c = _attention_times(keys, nq, rounds)
            print(f"{keys} | {nq} | {a * 1e6:.0f} | {b * 1e6:.0f} | {c * 1e6:.0f}", flush=True)


def _attention_times(keys: int, nq: int, rounds: int) -> tuple[float, float, float]:
    import torch

    from specstore.runtime import gemm

    q = torch.randn(1, 9, nq, 64).bfloat16()
    k, v = torch.randn(1, 3, keys, 64).bfloat16(), torch.randn(1, 3, keys, 64).bfloat16()
    mask = torch.zeros(1, 1, nq, keys).bfloat16() if nq > 1 else None
    packed, pmask = q.reshape(1, 3, 3 * nq, 64), mask.repeat(1, 1, 3, 1) if mask is not None else None
    sdpa = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(packed, k, v, attn_mask=pmask), 300, rounds)
    kernel = _timed(lambda: gemm.attention(q, k, v, mask, None), 300, rounds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _timed(lambda: gemm.attention(q, k, v, mask, None), 300, rounds)
    finally:
        torch.set_num_threads(threads)
    return sdpa, kernel, alone


def steps(rounds: int, context: int) -> None:
    import numpy as np

    from specstore.runtime import fused
    from specstore.runtime.models import load_model
    from specstore.runtime.tree import DraftTree
    from specstore.runtime.verify import TreeVerifier

    verifiers = {}
    known = (fused.NORMS, fused.MLPS)
    for name, on in (("torch's norms and MLP middles", False), ("the kernel's", True)):
        fused.NORMS, fused.MLPS = known if on else ((), ())
        v = TreeVerifier(load_model(None, dtype="bfloat16", device="cpu").model)
        v.prefill(list(range(1000, 1000 + context)))
        verifiers[name] = v
    fused.NORMS, fused.MLPS = known
    sizes = (0, 4, 6, 8)
    seconds = {(name, n): [] for name in verifiers for n in sizes}
    for r in range(rounds * 5):
        for n in sizes:
            tree = DraftTree(np.arange(2000, 2000 + n), np.arange(-1, n - 1))
            for name in (list(verifiers) if r % 2 == 0 else list(verifiers)[::-1]):
                v = verifiers[name]
                start = time.perf_counter()
                v.tree_logits(5, tree)
                seconds[name, n].append(time.perf_counter() - start)
                if v.num_cached > context:
                    v.cache.crop(-(v.num_cached - context))
    print(f"bf16 steps after {context} cached tokens, ms (median of {rounds * 5})")
    print("nodes | " + " | ".join(str(n) for n in sizes))
    for name in verifiers:
        print(f"{name} | " + " | ".join(f"{statistics.median(seconds[name, n]) * 1e3:.2f}" for n in sizes))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["attention", "steps"], default="attention")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--context", type=int, default=300, help="cached tokens before the steps (--part steps)")
    args = p.parse_args()
    if args.part == "attention":
        attention(args.rounds)
    else:
        steps(args.rounds, args.context)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
