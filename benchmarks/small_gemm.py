"""specstore's few-row product kernel (runtime/gemm.py) against torch's products on this CPU.

    python benchmarks/small_gemm.py --dtype float32

Part 1, products: the default model's 210 layer projections (30 layers x q, k, v, o, gate, up,
down, each its own weight, as in a forward: cold caches) and its output head, at 1-65 rows:
milliseconds for all 210 and for the head, through ``F.linear``, oneDNN's packed product (where
it packs this dtype) and the kernel, the three in rotating order, median of ``--rounds``.

Part 2, whole verification steps: the default model loaded twice, one with the kernel and one
with torch's products (linear.py as it runs without the kernel), ``TreeVerifier.tree_logits``
after 200 cached tokens over bushy trees of 0-32 nodes as the cost model builds them,
alternating models, median of ``--rounds``; and the float32 logits of the two side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--products-only", action="store_true", help="part 1 only")
    p.add_argument("--steps-only", action="store_true", help="part 2 only")
    args = p.parse_args()

    import numpy as np
    import torch

    from specstore.runtime import gemm, linear

    if not gemm.available():
        print(f"the kernel does not run here: {gemm.unavailable_reason()}")
        return 1
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if not args.steps_only:
        shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
        weights = [torch.randn(n, k).mul_(0.05).to(dtype) for _ in range(30) for n, k in shapes]
        head = torch.randn(49152, 576).mul_(0.05).to(dtype)

        def onednn_pack(w):
            try:
                return torch.ops.mkldnn._reorder_linear_weight(w, None)
            except RuntimeError:
                return None

        packs = {"F.linear": [None] * len(weights), "oneDNN": [onednn_pack(w) for w in weights],
                 "kernel": [gemm.pack(w) for w in weights]}
        head_packs = {"F.linear": None, "oneDNN": onednn_pack(head), "kernel": gemm.pack(head)}
        if packs["oneDNN"][0] is None:
            del packs["oneDNN"]
            print(f"oneDNN cannot pack {args.dtype} on this CPU: F.linear and the kernel only")

        def product(name, x, w, pk):
            if name == "F.linear":
                return torch.nn.functional.linear(x, w)
            if name == "oneDNN":
                return torch.ops.mkldnn._linear_pointwise(x, pk, None, "none", [], "")
            return gemm.linear(x, pk, None, w.shape[0])

        print(f"{args.dtype}, ms per forward's products (210 projections | the head), median of {args.rounds}")
        print("rows | " + " | ".join(packs))
        with torch.inference_mode():
            for rows in (1, 2, 3, 5, 9, 13, 17, 33, 65):
                xs = {576: torch.randn(rows, 576).to(dtype), 1536: torch.randn(rows, 1536).to(dtype)}
                body, top = {n: [] for n in packs}, {n: [] for n in packs}
                for r in range(args.rounds):
                    names = list(packs)[r % len(packs):] + list(packs)[: r % len(packs)]
                    for name in names:
                        start = time.perf_counter()
                        for w, pk in zip(weights, packs[name], strict=True):
                            product(name, xs[w.shape[1]], w, pk)
                        mid = time.perf_counter()
                        product(name, xs[576], head, head_packs[name])
                        body[name].append(mid - start)
                        top[name].append(time.perf_counter() - mid)
                print(f"{rows} | " + " | ".join(f"{statistics.median(body[n]) * 1e3:.1f} | {statistics.median(top[n]) * 1e3:.2f}"
                                                for n in packs), flush=True)
    if args.products_only:
        return 0

    from specstore.runtime.cost import bushy_tree
    from specstore.runtime.models import load_model
    from specstore.runtime.verify import TreeVerifier

    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 40000, 200).tolist()
    verifiers = {}
    real = linear._kernel_takes
    for name, on in (("kernel", True), ("torch", False)):
        linear._kernel_takes = (lambda d: real(d)) if on else (lambda d: False)
        model = load_model(None, dtype=args.dtype, device="cpu").model
        verifiers[name] = TreeVerifier(model)  # packs its linears now, with this choice
        verifiers[name].prefill(prompt)
    linear._kernel_takes = real
    sizes = (0, 1, 2, 4, 8, 16, 32)
    trees = {n: bushy_tree(n, 40000, rng) for n in sizes}

    def step(v, n):
        before = v.num_cached
        start = time.perf_counter()
        logits, _ = v.tree_logits(1234, trees[n])
        took = time.perf_counter() - start
        v.cache.crop(-(v.num_cached - before))
        return took, logits

    seconds = {(name, n): [] for name in verifiers for n in sizes}
    for name in verifiers:
        for n in sizes:
            step(verifiers[name], n)
    for r in range(args.rounds):
        order = list(verifiers) if r % 2 == 0 else list(verifiers)[::-1]
        for n in sizes:
            for name in order:
                seconds[name, n].append(step(verifiers[name], n)[0])
    print(f"\nverification steps, {args.dtype}, 200 cached tokens, ms (median of {args.rounds})")
    print("nodes | " + " | ".join(str(n) for n in sizes))
    for name in verifiers:
        print(f"{name} | " + " | ".join(f"{statistics.median(seconds[name, n]) * 1e3:.1f}" for n in sizes))
    diff = max(float((step(verifiers["kernel"], n)[1].float() - step(verifiers["torch"], n)[1].float()).abs().max())
               for n in sizes)
    print(f"largest logit difference between the two: {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
