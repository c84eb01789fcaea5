"""Load check of ``specstore serve``: C concurrent clients x R requests each on 127.0.0.1.

Starts ``specstore serve`` (float32 by default, so answers must equal ``ar``), has C threads
each send R chat requests in turn through the official ``openai`` client (no retries), stops
the server, then checks, for every request: answered (200) or refused (503), nothing else; each
answered request appears exactly once in the server's log and no refused one does; and every
answer equals what the engine gives for the same prompt with plain greedy decoding (``ar``,
computed in this process after the server stopped). Prompts are distinct per request (a
numbered instruction from the questions file), so a lost or duplicated request shows.

    python benchmarks/serve_load.py --store /work/speedstore --datastore code@prod \
        --questions ../shared/data/codealpaca/... --clients 8 --requests 25 --max-new-tokens 32

Exit status 0 when every check holds; prints a JSON summary (counts, latency percentiles, the
server's tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(path: str, count: int, skip: int) -> list[str]:
    from specstore.runtime.bench.questions import load_questions

    questions = load_questions(path, limit=count, skip=skip)
    if len(questions) < count:
        raise SystemExit(f"{path} has {len(questions)} questions after skipping {skip}; {count} needed")
    return [q.turns[0] for q in questions]


def _wait_up(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not come up")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--datastore", required=True)
    ap.add_argument("--questions", required=True, help="question file (any format specstore bench reads)")
    ap.add_argument("--skip", type=int, default=0, help="questions to skip first")
    ap.add_argument("--method", default="rest")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=25, help="per client")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=4, help="server's --max-queue (small: exercises 503)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="write the JSON summary here too")
    args = ap.parse_args(argv)

    import openai

    total = args.clients * args.requests
    prompts = _prompts(args.questions, total, args.skip)
    if len(set(prompts)) != len(prompts):
        raise SystemExit("the questions are not distinct; choose another --skip or file")
    work = Path(tempfile.mkdtemp(prefix="serve-load-"))
    log = work / "served.jsonl"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "specstore.runtime.cli", "serve", "--store", args.store, "--datastore", args.datastore,
           "--method", args.method, "--dtype", args.dtype, "--port", str(port), "--log", str(log),
           "--max-queue", str(args.max_queue), "--max-new-tokens", str(args.max_new_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(work / "server.err", "w"), env={**os.environ, "HF_HUB_OFFLINE": "1"})
    outcomes: dict[int, dict] = {}
    lock = threading.Lock()
    try:
        _wait_up(url, proc, 300)
        started = time.monotonic()

        def client(c: int) -> None:
            api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            for r in range(args.requests):
                i = c * args.requests + r
                t0 = time.monotonic()
                try:
                    reply = api.chat.completions.create(model=args.datastore, messages=[{"role": "user", "content": prompts[i]}],
                                                        max_tokens=args.max_new_tokens)
                    out = {"status": 200, "text": reply.choices[0].message.content, "mat": reply.model_extra["specstore"]["mat"]}
                except openai.APIStatusError as exc:
                    out = {"status": exc.status_code}
                except Exception as exc:  # a lost request: recorded, reported, fails the run
                    out = {"status": None, "error": repr(exc)}
                out["seconds"] = time.monotonic() - t0
                with lock:
                    if i in outcomes:
                        outcomes[i]["duplicate"] = True
                    else:
                        outcomes[i] = out

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    answered = {i for i, o in outcomes.items() if o["status"] == 200}
    refused = {i for i, o in outcomes.items() if o["status"] == 503}
    other = {i: o for i, o in outcomes.items() if o["status"] not in (200, 503)}
    logged: dict[str, int] = {}
    for line in log.read_text(encoding="utf-8").splitlines() if log.exists() else []:
        record = json.loads(line)
        prompt = record["messages"][0]["content"]
        logged[prompt] = logged.get(prompt, 0) + 1
    log_problems = [i for i in range(total) if logged.get(prompts[i], 0) != (1 if i in answered else 0)]

    from specstore.runtime.engine import Engine

    engine = Engine.load(args.store, args.datastore, model=args.model, dtype=args.dtype, method="ar", refresh_seconds=None)
    mismatched = []
    for i in sorted(answered):
        ref = engine.generate(prompts[i], method="ar", max_new_tokens=args.max_new_tokens).text
        if ref != outcomes[i]["text"]:
            mismatched.append(i)
    latencies = sorted(o["seconds"] for i, o in outcomes.items() if i in answered)
    summary = {
        "clients": args.clients, "requests_per_client": args.requests, "method": args.method, "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens, "max_queue": args.max_queue, "sent": total, "outcomes": len(outcomes),
        "answered": len(answered), "refused_503": len(refused), "other": {str(i): o for i, o in other.items()},
        "duplicates": sum(1 for o in outcomes.values() if o.get("duplicate")), "log_problems": log_problems,
        "identical_to_ar": len(answered) - len(mismatched), "mismatched": mismatched, "wall_seconds": round(wall, 1),
        "latency_p50_s": round(statistics.median(latencies), 2) if latencies else None,
        "latency_max_s": round(latencies[-1], 2) if latencies else None,
        "mean_mat": round(statistics.fmean(outcomes[i]["mat"] for i in answered), 3) if answered else None,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    ok = (len(outcomes) == total and not other and not summary["duplicates"] and not log_problems and not mismatched
          and len(answered) + len(refused) == total)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
