"""One layer's packed attention on the CPU: SDPA's fused kernel against attention.py's matmul
path, per cached length and packed query rows (3 per token for SmolLM2-135M's 9 over 3 heads).

    python benchmarks/attention_kernels.py --dtype bfloat16

Prints the median microseconds of each (warm; 5 rounds of --calls calls each).
"""

from __future__ import annotations

import argparse
import time

import torch

from specstore.runtime.attention import _matmul_attention


def median_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(rounds)[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--heads", type=int, default=3, help="key/value heads")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--keys", default="128,512,1024,2048", help="cached lengths")
    ap.add_argument("--rows", default="3,27,51", help="packed query rows")
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print("| cached keys | rows | SDPA + mask (us) | matmul + softmax (us) |\n|---|---|---|---|")
    for keys in (int(k) for k in args.keys.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            q = torch.randn(1, args.heads, rows, args.dim, generator=gen).to(dtype)
            k = torch.randn(1, args.heads, keys, args.dim, generator=gen).to(dtype)
            v = torch.randn(1, args.heads, keys, args.dim, generator=gen).to(dtype)
            mask = torch.zeros(1, 1, rows, keys, dtype=dtype)
            fused = median_us(lambda q=q, k=k, v=v, m=mask: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m),
                              args.calls)
            matmul = median_us(lambda q=q, k=k, v=v, m=mask: _matmul_attention(q, k, v, m, None), args.calls)
            print(f"| {keys:,} | {rows} | {fused:.1f} | {matmul:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
