"""The kernel's attention and its fused norms / MLP middles on this CPU (runtime/gemm.py,
runtime/fused.py, csrc/small_gemm.c).

    python benchmarks/kernel_parts.py --part attention [--dtype float32]
    python benchmarks/kernel_parts.py --part steps --context 300
    python benchmarks/kernel_parts.py --part attention-steps [--dtype float32]
    git show ed88703:runtime/csrc/small_gemm.c > /tmp/old_small_gemm.c
    python benchmarks/kernel_parts.py --part attention --dtype float32 --against /tmp/old_small_gemm.c
    python benchmarks/kernel_parts.py --part attention-steps --dtype float32 --against /tmp/old_small_gemm.c

``attention``: one layer's attention of the default model's shape (9 query heads over 3
key/value heads of 64), 1-17 query tokens over 300 and 1,000 keys under a tree's additive mask
(zeros where allowed): SDPA over packed heads (attention.py's path without the kernel) and the
kernel on both threads and on one, median of ``--rounds`` x 300 calls, microseconds; in bf16
(the kernel's attention needs AVX-512 BF16) or float32 (AVX2).

``attention-steps``: whole verification steps of the default model (``cost.ForwardStep``, as the
cost table times them: bushy trees of 0-16 nodes after 300 and 1,000 cached tokens) with the
kernel's attention and with torch's (``SPECSTORE_CPU_ATTENTION=0``'s path), the two alternating
step by step in one process, ``--rounds`` x 4 steps each; medians in milliseconds and the
median of the paired ratios.

``--against SOURCE`` (``attention`` and ``attention-steps``): the kernel built from another
source (another commit's csrc/small_gemm.c, loaded beside this checkout's) against this one's
instead of against torch, the two alternating call by call: one layer under a tree's mask (the
cache and each node's ancestors) over 300 / 1,000 / 2,000 keys, medians of ``--rounds`` x 4 x 20
calls, microseconds, whether the outputs are the same bits, and the median [quartiles] of the
paired ratios; or whole steps as above with 2,000 cached tokens too.

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


def attention(rounds: int, dtype_name: str) -> None:
    import torch

    from specstore.runtime import gemm

    dtype = getattr(torch, dtype_name)
    if not gemm.has_attention(dtype=dtype):
        print(f"the kernel has no {dtype_name} attention here (bf16 needs AVX-512 BF16, float32 AVX2 and FMA)")
        return
    print(f"{dtype_name}: keys | query tokens | SDPA packed | kernel | kernel, 1 thread   (us a layer)")
    for keys in (300, 1000):
        for nq in (1, 5, 9, 17):
            a, b, c = _attention_times(keys, nq, rounds, dtype)
            print(f"{keys} | {nq} | {a * 1e6:.0f} | {b * 1e6:.0f} | {c * 1e6:.0f}", flush=True)


def _attention_times(keys: int, nq: int, rounds: int, dtype) -> tuple[float, float, float]:
    import torch

    from specstore.runtime import gemm

    q = torch.randn(1, 9, nq, 64).to(dtype)
    k, v = torch.randn(1, 3, keys, 64).to(dtype), torch.randn(1, 3, keys, 64).to(dtype)
    mask = torch.zeros(1, 1, nq, keys).to(dtype) if nq > 1 else None
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


def _alternating(ways: dict, run, rounds: int, warmup: int, calls: int = 1) -> dict:
    """``run`` under each of two ways (name -> a function that switches to it), the two
    alternating and their order flipping each round: {name: seconds a call, an array of
    ``rounds`` rounds of ``calls`` calls, after ``warmup`` rounds}."""
    import numpy as np

    times = {name: [] for name in ways}
    for r in range(rounds + warmup):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            ways[name]()
            start = time.perf_counter()
            for _ in range(calls):
                run()
            if r >= warmup:
                times[name].append((time.perf_counter() - start) / calls)
    return {name: np.array(t) for name, t in times.items()}


def _paired_steps(step, ways: dict, contexts: tuple[int, ...], rounds: int):
    """Whole verification steps (``cost.ForwardStep``: bushy trees of 0-16 nodes after each of
    ``contexts`` cached tokens) under two ways (``_alternating``), ``rounds`` x 4 each after two
    rounds of warm-up: yields (context, nodes, {name: seconds, an array})."""
    for context in contexts:
        for nodes in (0, 4, 8, 16):
            yield context, nodes, _alternating(ways, lambda c=context, n=nodes: step(n, c), rounds * 4, 2)


def _library_from(source: str):
    """(the kernel of ``source``, this checkout's kernel), both loaded; this one stays the module's."""
    from pathlib import Path

    from specstore.runtime import gemm

    mine, keep = gemm.library(), gemm.SOURCE
    gemm.SOURCE = Path(source)
    gemm._reset_for_tests()
    try:
        other = gemm.library()
        reason = gemm.unavailable_reason()
    finally:
        gemm.SOURCE = keep
        gemm._reset_for_tests()
    if mine is None or other is None:
        raise SystemExit(f"a kernel did not load: {gemm.unavailable_reason() if mine is None else reason}")
    assert gemm.library() is not None
    return other, mine


def _tree_mask(nq: int, keys: int, dtype, seed: int = 0):
    """[1, 1, nq, keys]: every row the cache (the first keys - nq) and its ancestors in a random tree."""
    import torch

    g = torch.Generator().manual_seed(seed)
    allowed = torch.zeros(nq, keys, dtype=torch.bool)
    allowed[:, : keys - nq] = True
    for i in range(nq):
        allowed[i, keys - nq + i] = True
        if i:
            parent = int(torch.randint(0, i, (1,), generator=g))
            allowed[i, keys - nq :] |= allowed[parent, keys - nq :]
    return torch.zeros(1, 1, nq, keys, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def attention_against(rounds: int, dtype_name: str, source: str) -> None:
    import numpy as np
    import torch

    from specstore.runtime import gemm

    dtype = getattr(torch, dtype_name)
    libs = dict(zip(("other", "this"), _library_from(source), strict=True))
    ways = {name: (lambda lib=lib: setattr(gemm, "_lib", lib)) for name, lib in libs.items()}
    print(f"{dtype_name}, one layer: keys | query tokens | {source} | this checkout | same bits | this / other [quartiles]   (us)")
    try:
        for keys in (300, 1000, 2000):
            for nq in (1, 5, 9, 17):
                q = torch.randn(1, 9, nq, 64).to(dtype)
                k, v = torch.randn(1, 3, keys, 64).to(dtype), torch.randn(1, 3, keys, 64).to(dtype)
                mask = _tree_mask(nq, keys, dtype) if nq > 1 else None
                times = _alternating(ways, lambda q=q, k=k, v=v, mask=mask: gemm.attention(q, k, v, mask, None),
                                     rounds * 4, 1, calls=20)
                outs = {}
                for name in ways:
                    ways[name]()
                    outs[name] = gemm.attention(q, k, v, mask, None)
                a, b = times["other"], times["this"]
                lo, mid, hi = np.percentile(b / a, [25, 50, 75])
                same = "yes" if torch.equal(outs["other"], outs["this"]) else "no"
                print(f"{keys} | {nq} | {np.median(a) * 1e6:.0f} | {np.median(b) * 1e6:.0f} | {same} | {mid:.3f} [{lo:.3f}, {hi:.3f}]",
                      flush=True)
    finally:
        gemm._lib = libs["this"]


def steps_against(rounds: int, dtype_name: str, source: str) -> None:
    import numpy as np

    from specstore.runtime import gemm
    from specstore.runtime.cost import ForwardStep
    from specstore.runtime.models import load_model

    libs = dict(zip(("other", "this"), _library_from(source), strict=True))
    step = ForwardStep(load_model(None, dtype=dtype_name, device="cpu").model)
    print(f"{dtype_name} steps, ms (median of {rounds * 4}): cached | nodes | {source} | this checkout | this / other [quartiles]")
    ways = {name: (lambda lib=lib: setattr(gemm, "_lib", lib)) for name, lib in libs.items()}
    try:
        for context, nodes, times in _paired_steps(step, ways, (300, 1000, 2000), rounds):
            a, b = times["other"], times["this"]
            lo, mid, hi = np.percentile(b / a, [25, 50, 75])
            print(f"{context} | {nodes} | {np.median(a) * 1e3:.1f} | {np.median(b) * 1e3:.1f} | {mid:.3f} [{lo:.3f}, {hi:.3f}]",
                  flush=True)
    finally:
        gemm._lib = libs["this"]


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


def attention_steps(rounds: int, dtype_name: str) -> None:
    import numpy as np

    from specstore.runtime import attention as attention_module
    from specstore.runtime.cost import ForwardStep
    from specstore.runtime.models import load_model

    step = ForwardStep(load_model(None, dtype=dtype_name, device="cpu").model)
    ways = {name: (lambda on=on: setattr(attention_module, "_KERNEL_ATTENTION", on))
            for name, on in (("torch's attention", False), ("the kernel's", True))}
    print(f"{dtype_name} steps, ms (median of {rounds * 4}); kernel / torch: median of the paired ratios")
    print("cached | nodes | torch's attention | the kernel's | kernel / torch")
    try:
        for context, nodes, times in _paired_steps(step, ways, (300, 1000), rounds):
            torch_s, kernel_s = (times[name] for name in ways)
            print(f"{context} | {nodes} | {np.median(torch_s) * 1e3:.1f} | {np.median(kernel_s) * 1e3:.1f} | "
                  f"{np.median(kernel_s / torch_s):.3f}", flush=True)
    finally:
        attention_module._KERNEL_ATTENTION = True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["attention", "steps", "attention-steps"], default="attention")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--context", type=int, default=300, help="cached tokens before the steps (--part steps)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="--part attention and attention-steps: the dtype of the attention / the model")
    p.add_argument("--against", metavar="SOURCE",
                   help="another build's csrc/small_gemm.c (e.g. from git show REV:runtime/csrc/small_gemm.c): "
                        "time this checkout's kernel against it instead of against torch")
    args = p.parse_args()
    if args.against and args.part not in ("attention", "attention-steps"):
        p.error("--against takes --part attention or attention-steps")
    if args.against:
        (attention_against if args.part == "attention" else steps_against)(args.rounds, args.dtype, args.against)
    elif args.part == "attention":
        attention(args.rounds, args.dtype)
    elif args.part == "attention-steps":
        attention_steps(args.rounds, args.dtype)
    else:
        steps(args.rounds, args.context)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
