"""Where a build's memory goes: resident memory sampled through one in-process build, by stage.

Run: ``python benchmarks/build_memory.py --corpus bench_corpora/chat_large.jsonl --max-docs 600``.
Builds into a temporary store with the default model (DirectRunner, in memory, one process)
while a thread samples this process' resident memory (VmRSS) every ``--interval`` seconds
together with how far each stage's progress bar has come. Prints, per stage, the resident
memory when the stage started and ended and its peak, then the whole build's peak and tokens,
so that memory growing with the corpus can be pinned to the step that holds it. Run it at two
sizes to get the growth per token. Owns no library code.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", nargs="+", required=True)
    ap.add_argument("--max-docs", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--sa-shard-tokens", type=int, default=None)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--out", default=None, help="write the samples and the summary here (JSON)")
    args = ap.parse_args(argv)

    from specstore.pipelines import workers
    from specstore.pipelines.build import build

    samples: list[tuple[float, float, dict]] = []
    done = threading.Event()
    start = time.monotonic()

    def sample() -> None:
        while not done.is_set():
            progress = workers.progress_counts()
            samples.append((time.monotonic() - start, _rss_mib(), progress))
            done.wait(args.interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    with tempfile.TemporaryDirectory(prefix="specstore-mem-") as tmp:
        result = build(Path(tmp) / "store", "mem", args.corpus, max_docs=args.max_docs, dtype=args.dtype,
                       sa_shard_tokens=args.sa_shard_tokens, progress=True)
    done.set()
    thread.join()
    seconds = time.monotonic() - start

    # a stage runs from the first sample where its bar exists to the first one where the next
    # stage's bar appears (the bars are created in the order the stages run)
    order: list[str] = []
    for _, _, progress in samples:
        order += [name for name in progress if name not in order]
    stages = {}
    for name in order:
        idx = [i for i, (_, _, p) in enumerate(samples) if name in p]
        first = idx[0]
        later = [i for i, (_, _, p) in enumerate(samples) if i > first and len(p) > len(samples[first][2])]
        last = later[0] if later else len(samples) - 1
        rss = [samples[i][1] for i in range(first, last + 1)]
        stages[name] = {"start_s": round(samples[first][0], 1), "rss_start_mib": round(rss[0], 1),
                        "rss_end_mib": round(rss[-1], 1), "rss_peak_mib": round(max(rss), 1)}
    summary = {
        "num_tokens": result.manifest.num_tokens, "num_documents": result.manifest.num_documents,
        "seconds": round(seconds, 1), "rss_peak_mib": round(max(s[1] for s in samples), 1),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # the kernel's peak, between samples too
        "rss_before_mib": round(samples[0][1], 1), "stages": stages,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "samples": samples}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
