"""Build and open times on an object store against a local directory, the file cache's first and
second open, and builds through Beam's portable path with 1 and 2 worker processes.

The object store is moto's S3 server started here on 127.0.0.1 (an emulator in one Python
process: its latency and throughput are not a cloud's; the comparison shows specstore's own
overhead of going through the filesystem layer, the conditional commit and the cache). The
portable run uses Beam's Python job service and an EXTERNAL worker pool, started here too
(one worker per job: that service does not spread a job over several); 1 against 2 worker
processes is measured with the DirectRunner's multi-processing mode.

    python benchmarks/object_store.py --corpus /work/scale/code-1m.jsonl --index sparse \
        [--dense-corpus ../shared/data/codealpaca/code_alpaca_2k.jsonl.gz --dense-max-docs 300]

Prints one JSON object (seconds and tokens/s per case); nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers: the moto server, the portable services


def _timed_build(store: str, options: dict, corpus: list[str], *, name: str, extra: list[str]) -> dict:
    from specstore.runtime.cli import main

    opts = [a for k, v in options.items() for a in ("--storage-option", f"{k}={v}")] if store.startswith("s3://") else []
    started = time.perf_counter()
    code = main(["build", "--store", store, *opts, "--name", name, "--corpus", *corpus, *extra])
    seconds = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"build into {store} failed ({code})")
    from specstore.runtime.store import Store

    m = Store(store, storage_options=options if store.startswith("s3://") else None).resolve(name).manifest
    return {"seconds": round(seconds, 2), "tokens": m.num_tokens, "tokens_per_s": round(m.num_tokens / seconds)}


def _timed_open(store: str, options: dict | None, ref: str, cache: Path | None) -> float:
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.store import Store

    if cache is not None:
        os.environ["SPECSTORE_FILE_CACHE"] = str(cache)
    started = time.perf_counter()
    Datastore.open(Store(store, storage_options=options), ref, dense=False)
    return round(time.perf_counter() - started, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, nargs="+")
    ap.add_argument("--index", default="sparse", choices=["sparse", "dense"])
    ap.add_argument("--max-docs", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--skip-portable", action="store_true")
    args = ap.parse_args(argv)

    from tests.portable_helpers import portable_services
    from tests.s3_helpers import s3_server

    extra = ["--index", args.index, "--dtype", args.dtype] + (["--max-docs", str(args.max_docs)] if args.max_docs else [])
    work = Path(tempfile.mkdtemp(prefix="objstore-bench-"))
    results: dict = {"corpus": args.corpus, "index": args.index, "emulator": "moto S3 server on 127.0.0.1"}
    try:
        with s3_server() as s3:
            local, remote = str(work / "local"), s3.uri()
            _timed_build(str(work / "warm-up"), {}, args.corpus, name="x", extra=extra)  # one-off loads, not measured
            for run in (1, 2):  # alternated, so that drift hits both
                results[f"build_local_{run}"] = _timed_build(local, {}, args.corpus, name=f"x{run}", extra=extra)
                results[f"build_s3_{run}"] = _timed_build(remote, s3.options, args.corpus, name=f"x{run}", extra=extra)
            results["open_local_s"] = [_timed_open(local, None, "x1", None) for _ in range(3)]
            cache = work / "cache"
            results["open_s3_cold_cache_s"] = _timed_open(remote, s3.options, "x1", cache)
            results["open_s3_warm_cache_s"] = [_timed_open(remote, s3.options, "x1", cache) for _ in range(3)]
            results["cache_bytes"] = sum(p.stat().st_size for p in (cache / "objects").glob("*/*") if p.is_file())
            if not args.skip_portable:
                # Beam's Python job service runs a job's stages on one SDK worker (its FnApiRunner's
                # run_via_runner_api does not read --direct_num_workers), so the portable path is
                # measured with its one worker, and 1 vs 2 worker processes with the DirectRunner's
                # multi-processing mode, whose workers are separate processes too
                with portable_services(work) as beam:
                    results["build_portable"] = _timed_build(str(work / "portable"), {}, args.corpus, name="x", extra=extra + beam)
                results["build_portable"]["workers_started"] = (work / "pool.log").read_text().count("Starting worker with command")
                for workers in (1, 2):
                    results[f"build_multiprocessing_{workers}_workers"] = _timed_build(
                        str(work / f"mp-{workers}"), {}, args.corpus, name="x",
                        extra=extra + ["--direct_running_mode=multi_processing", f"--direct_num_workers={workers}"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
