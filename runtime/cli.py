"""The ``specstore`` command line: one parser per command, handlers imported lazily.

User mistakes (a SpecstoreError) print one line to stderr and exit with status 2. Before a
command does any work, ``cli_options`` refuses a URI store and any option the command does not
define, except the Beam pipeline options that ``build`` forwards. Only ``build`` imports the
pipelines (and Beam), when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from specstore.runtime.dense_files import ANN_THRESHOLD
from specstore.runtime.errors import SpecstoreError

# the build's --dtype help (runtime/device.resolve_build_dtype decides; not imported here: it imports torch)
BUILD_DTYPE_HELP = (
    "model dtype for embedding; default auto: bfloat16 on a CUDA GPU or a CPU with native bf16 "
    "(amx_bf16 or avx512_bf16 in /proc/cpuinfo; ~6x faster builds there), float32 elsewhere. "
    "The resolved dtype is recorded in the manifest's settings"
)
# decoding's --dtype help (runtime/device.resolve_dtype decides)
DTYPE_HELP = (
    "model dtype for decoding; default auto: bfloat16 on a CUDA GPU or a CPU with native bf16 (amx_bf16 or "
    "avx512_bf16), float32 elsewhere, where emulated bf16 makes every tree verification several times dearer. "
    "float32 for exact identity with ar"
)
DTYPES = ["auto", "float32", "bfloat16"]


def _add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, metavar="DIR|URI",
                   help="the store: a local directory or an object-store URI (s3://bucket/prefix, gs://..., az://...)")
    p.add_argument("--storage-option", action="append", default=None, metavar="KEY=VALUE",
                   help="object-store option with Lance's name, repeatable (aws_endpoint, allow_http, aws_region, "
                   "aws_access_key_id, aws_secret_access_key, ...); unset ones come from the environment as the cloud "
                   "SDKs read it (AWS_REGION, AWS_ENDPOINT_URL, ...)")


def _add_cost_options(p: argparse.ArgumentParser, both: str | None = None, online: bool = True) -> None:
    """``--cost-aware`` (with ``both`` among its choices when ``both`` explains it), ``--refresh-cost``
    and, for commands that decode (``online``), ``--cost-online``."""
    from specstore.runtime.drafters import registry

    modes = [*registry.COST_AWARE_MODES, "both"] if both else list(registry.COST_AWARE_MODES)
    p.add_argument("--cost-aware", default=registry.COST_AWARE_DEFAULT, choices=modes,
                   help=registry.COST_AWARE_HELP + (both or "") + f" (default {registry.COST_AWARE_DEFAULT})")
    p.add_argument("--refresh-cost", action="store_true",
                   help="measure the verification cost model again (else cached per model, device, dtype, torch)")
    if not online:
        return
    p.add_argument("--cost-online", default="on", choices=["on", "off"],
                   help="on (default): correct the measured cost model from the verification steps decoding times, so it "
                   "follows the machine's load and clocks (docs/decoding.md); off: the cached table as measured, so that "
                   "trees depend on the text alone (reproducible)")


def _add_calibration_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", default="on", choices=["on", "off"],
                   help="on (default): a cost-aware method starts from the acceptance calibration that earlier runs of "
                   "this model, method, options and datastore saved, and saves what this run learns (in "
                   "$SPECSTORE_CALIBRATION_DIR, default ~/.cache/specstore/calibration; docs/decoding.md); off: start from the "
                   "priors and save nothing, so that trees do not depend on earlier runs")


def _add_corpus(p: argparse.ArgumentParser) -> None:
    """The corpus and model options of the commands that read corpora (build, train-head)."""
    p.add_argument("--corpus", required=True, nargs="+", metavar="PATH", help="JSONL/text files or a source-code directory; .gz is read transparently")
    p.add_argument("--format", default="auto", choices=["auto", "chat-jsonl", "instruct-jsonl", "text", "code-dir"], help="corpus format (default: detect per path)")
    p.add_argument("--model", default=None, help="local Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specstore",
        description="Versioned retrieval datastores and retrieval-based speculative decoding (REST, DReSD, ReSpec).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "build",
        help="build a new version of a datastore from corpora (Apache Beam pipeline)",
        description="Read corpora, tokenise (and optionally regenerate responses with the model), embed every "
        "token with the model's last hidden layer, fit the normaliser (z-score, PCA, L2), and commit the tokens "
        "table, suffix array, normaliser and manifest as one new version; with --index sparse, only tokenise and commit the "
        "token stream, suffix array and manifest (no model forward). Options specstore does not define are "
        "passed to Beam if the installed Beam's pipeline options define them (e.g. --direct_running_mode=multi_processing "
        "--direct_num_workers=2, or --job_endpoint HOST:PORT for the PortableRunner); any other option is an error "
        "before the build starts. Options are never abbreviated here, so that none is mistaken for a Beam option.",
        allow_abbrev=False,
    )
    _add_store(p)
    p.add_argument("--name", required=True, help="datastore name (one per domain), e.g. code or chat")
    _add_corpus(p)
    p.add_argument("--regenerate", action="store_true", help="have the model write the responses itself (in-domain datastore)")
    p.add_argument("--max-docs", type=int, default=None, metavar="N", help="use only the first N records (quick builds)")
    p.add_argument("--max-doc-tokens", type=int, default=2048, metavar="N", help="reject chat/instruction records longer than N tokens; text and code are split into N-token chunks (default 2048)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="response length when regenerating (default 256)")
    p.add_argument("--pca-dims", type=int, default=64, metavar="D", help="embedding dimensions after PCA (default 64)")
    p.add_argument("--continuation-length", type=int, default=10, metavar="L", help="stored next tokens per position (default 10)")
    p.add_argument("--batch-tokens", type=int, default=4096, metavar="N", help="tokens per embedding batch (default 4096)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help=BUILD_DTYPE_HELP)
    p.add_argument("--tag", default=None, help="tag the new version (e.g. prod, 2026-11-29)")
    p.add_argument("--runner", default="DirectRunner", help="Beam runner (default DirectRunner)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--append", action="store_true", help="add the corpora the newest version lacks, reusing its rows and normaliser (its settings win)")
    mode.add_argument("--refit", action="store_true", help="rebuild the newest version's corpora plus these, refitting the normaliser")
    p.add_argument("--sa-shard-tokens", type=int, default=None, metavar="N", help="build the suffix array in shards of at most N tokens, on separate workers (large corpora)")
    p.add_argument("--index", default=None, choices=["dense", "sparse"],
                   help="dense (default): embed every token with the model (tokens table + normaliser: dresd, respec's dense source); "
                   "sparse: token stream and suffix array only, tokenizer alone, no model forward (rest, pld, respec without its "
                   "dense source; much faster, for large corpora). --append keeps the parent's kind")
    p.add_argument("--ann-threshold", type=int, default=None, metavar="N",
                   help=f"dense: next-token blocks of at least N rows get an approximate (faiss) index, smaller ones are searched "
                   f"exactly (default {ANN_THRESHOLD}; --append keeps the parent's)")
    p.add_argument("--force", action="store_true", help="build even when corpus content, settings and model are unchanged")
    p.add_argument("--resume", action="store_true",
                   help="dense: reuse the embedded batches of the newest unfinished (killed or crashed) build of this datastore "
                   "made with the same corpus, settings and model, and embed only the rest; an error when there is none. "
                   "Only once that build has stopped")
    p.set_defaults(handler=_cmd_build, forwards_to="beam")

    p = sub.add_parser(
        "train-head",
        help="train a draft head for ReSpec: the model's next token after the pending one, from its hidden state",
        description="Run the model once over a corpus (any format build reads) and train a small network that "
        "guesses, from the model's last hidden state and the token it just chose, the token it will choose next "
        "(distillation from the model itself, so the corpus need not be the model's own text). ReSpec drafts the "
        "head's guess as one more candidate where a head exists (--option respec.head=auto, the default, finds it in "
        "the default place for the datastore's model; respec.head=PATH or =off). Writes one safetensors file and "
        "prints how often the head's first guess matched the model on held-out documents.",
    )
    _add_corpus(p)
    p.add_argument("--max-docs", type=int, default=None, metavar="N", help="use only the first N records of all corpora together")
    p.add_argument("--max-doc-tokens", type=int, default=1024, metavar="N", help="skip chat/instruction records longer than N tokens; text is split into N-token chunks (default 1024)")
    p.add_argument("--max-tokens", type=int, default=2_000_000, metavar="N", help="training positions collected at most (default 2000000)")
    p.add_argument("--epochs", type=int, default=6, help="passes over the positions (default 6)")
    p.add_argument("--vocabulary", type=int, default=4096, metavar="N", help="tokens the head can guess: the N most frequent in the corpus (default 4096)")
    p.add_argument("--holdout", type=float, default=0.05, help="share of the documents (the last ones) kept out to score the head (default 0.05)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="the model's dtype for the forward (default auto)")
    p.add_argument("--out", default=None, metavar="FILE", help="where to write the head (default: the cache's place for this model, where respec.head=auto looks)")
    p.set_defaults(handler=_cmd_train_head)

    p = sub.add_parser("versions", help="list the versions of a datastore", description="List versions with tags, counts and creation time.")
    _add_store(p)
    p.add_argument("--name", required=True)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(handler=_cmd_versions)

    p = sub.add_parser("tag", help="tag a datastore version", description="Point TAG at NAME@VERSION (moving the tag if it exists).")
    _add_store(p)
    p.add_argument("--ref", required=True, metavar="NAME@VERSION", help="NAME, NAME@VERSION or NAME@TAG")
    p.add_argument("--tag", required=True)
    p.set_defaults(handler=_cmd_tag)

    p = sub.add_parser(
        "verify",
        help="check every file of a version against its manifest's checksums",
        description="Hash every file of NAME@VERSION and compare it with the checksum its manifest recorded at build "
        "(opening a version only checks sizes and headers). Prints one line and exits 0 when all match; otherwise one "
        "error line naming the missing or damaged file, exit 2.",
    )
    _add_store(p)
    p.add_argument("--ref", required=True, metavar="NAME@VERSION", help="NAME, NAME@VERSION or NAME@TAG")
    p.set_defaults(handler=_cmd_verify)

    p = sub.add_parser(
        "gc",
        help="remove old untagged versions and unfinished builds",
        description="Keep the newest N versions and every tagged one; remove the others (catalogue rows and files) and the "
        "files of builds that never committed once untouched for the grace period. Readers that already opened a version keep working.",
    )
    _add_store(p)
    p.add_argument("--name", required=True)
    p.add_argument("--keep", type=int, required=True, metavar="N", help="newest versions to keep (>= 1)")
    p.add_argument("--grace-seconds", type=float, default=6 * 3600, metavar="S", help="leave unfinished builds younger than this (default 6 h)")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    p.set_defaults(handler=_cmd_gc)

    from specstore.runtime.drafters import registry  # light: method names and their CLI modules, no torch

    p = sub.add_parser(
        "generate",
        help="decode a prompt with a drafting method",
        description="Send PROMPT as a user message through the model's chat template and decode it, streaming text as it is accepted.",
    )
    _add_store(p)
    p.add_argument("--datastore", default=None, metavar="REF", help=f"NAME, NAME@VERSION or NAME@TAG (needed by {', '.join(registry.datastore_methods(registry.available()))}); "
                   "a comma list routes the prompt to the nearest domain")
    p.add_argument("--method", default="rest", choices=registry.available())
    p.add_argument("--prompt", required=True)
    p.add_argument("--model", default=None, help="local Hugging Face model folder (default: the embedded model)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples losslessly")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_cost_options(p)
    _add_calibration_option(p)
    registry.add_cli_options(p)  # each method's own options (ReSpec's: drafters/respec_cli.py)
    p.set_defaults(handler=_cmd_generate)

    p = sub.add_parser(
        "bench",
        help="measure methods side by side on a question file",
        description="Run every method on every question, interleaved prompt by prompt, and report MAT, acceptance, "
        "tokens/s, speedup over ar (same run), drafting share, retrieval latency and identity to ar. Also runs "
        "transformers' own greedy generate (hf) and prompt lookup (hf-pld) when named in --methods.",
    )
    _add_store(p)
    p.add_argument("--datastore", default=None, metavar="REF", help="NAME, NAME@VERSION or NAME@TAG")
    p.add_argument("--questions", required=True, metavar="FILE", help="MT-Bench/Spec-Bench, HumanEval or instruction JSONL (.gz ok)")
    p.add_argument("--methods", default="ar,pld,rest,dresd", help="comma list of ar,pld,rest,dresd,respec,hf,hf-pld (default ar,pld,rest,dresd)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="first N questions")
    p.add_argument("--skip", type=int, default=0, metavar="N", help="skip the first N questions")
    p.add_argument("--turns", type=int, default=1, help="MT-Bench turns to ask (1 or 2; default 1)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP + " (the result records the dtype that ran)")
    p.add_argument("--device", default="auto")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.KEY=VALUE", help="drafter option, e.g. rest.max_nodes=32 (repeatable)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the JSON result here")
    _add_cost_options(p, both="; both: run each such method both ways, the cost-aware one as METHOD+cost")
    p.set_defaults(handler=_cmd_bench)

    p = sub.add_parser(
        "simulate",
        help="model-free MAT and predicted speedup from stored ar references (sweep draft shapes in seconds)",
        description="Replay greedy ar references from a bench result: under greedy verification the accepted length "
        "follows from the reference alone, so MAT for any drafter setting is computed without decoding. The predicted "
        "speedup over ar adds the measured verification cost of each replayed tree (runtime/cost.py, for --dtype on this "
        "machine) and the replayed drafting time; --sweep rows are ranked by it. Each side is priced with the cost "
        "model its method ended the bench with (corrected online from its own steps; the table alone where the "
        "result holds no such copy for the method or for ar, or with --refresh-cost).",
    )
    _add_store(p)
    p.add_argument("--datastore", default=None, metavar="REF")
    p.add_argument("--references", required=True, metavar="FILE", help="a bench result JSON that includes method ar")
    p.add_argument("--methods", default="pld,rest,dresd")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.KEY=VALUE")
    p.add_argument("--sweep", action="append", default=[], metavar="METHOD.KEY=V1,V2,...", help="try several values of one option")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="dtype whose verification cost predicts the speed, where the references hold no cost model "
                   "(default: the dtype the bench ran in, as its result records)")
    p.add_argument("--device", default="auto", help="device whose verification cost predicts the speed (default auto)")
    _add_cost_options(p, online=False)  # a replay takes no real time: nothing to correct
    p.add_argument("--by-category", action="store_true",
                   help="also print each method's MAT per question category (the JSON always has it: mat_by_category)")
    p.add_argument("--warm-drafting", action="store_true",
                   help="replay without streaming over the target's weight bytes between steps (faster; drafting then "
                   "runs on warm caches and costs ~2-3x less than in decoding, so speed is over-predicted)")
    p.add_argument("--drafting-ms", type=float, default=None, metavar="MS",
                   help="price every replayed step's drafting at MS milliseconds, in the pruner and in the predicted "
                   "speed, instead of the time the replay measures: replays of the same settings then give the same "
                   "trees and numbers, so a sweep's rows differ only by what the options change (default: measured)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_simulate)

    p = sub.add_parser("report", help="Markdown tables and PNG plots from bench results")
    p.add_argument("results", nargs="+", metavar="RESULTS.json")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    p.set_defaults(handler=_cmd_report)

    p = sub.add_parser(
        "serve",
        help="serve the OpenAI API over a model and datastores (follows tags)",
        description="Hold the model and datastore references open and answer /v1/chat/completions (through the chat "
        "template), /v1/completions (raw text), /v1/models and /health, streaming or not; requests are served in turn. "
        "A reference by tag or bare name follows new versions between requests. Needs the 'serve' extra.",
    )
    _add_store(p)
    p.add_argument("--datastore", default=None, metavar="REF", help="NAME, NAME@VERSION or NAME@TAG (needed by rest, dresd, respec); "
                   "a comma list serves each as a model id and routes requests for the model's own name")
    p.add_argument("--method", default="rest", choices=registry.available(), help="default method (a request may ask for another in its 'specstore' field)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log", default=None, metavar="PATH", help="append each served request to this JSONL file (for build --append)")
    p.add_argument("--max-queue", type=int, default=16, metavar="N", help="requests that may wait besides the one being served; more get 503 (default 16)")
    p.add_argument("--refresh-seconds", type=float, default=5.0, metavar="S", help="check tags for new versions at most this often (default 5)")
    p.add_argument("--overlay", default="on", choices=["on", "off"],
                   help="learn while serving: keep what was served in memory and draft from it too (pld, rest, respec; "
                        "default on: on 200-prompt code and chat streams it was faster or the same, never slower; BENCHMARKS.md)")
    p.add_argument("--overlay-tokens", type=int, default=65536, metavar="N",
                   help="tokens the overlay holds; the oldest requests are evicted beyond it (default 65536)")
    p.add_argument("--overlay-prompts", action="store_true", help="the overlay keeps prompts too, not only responses")
    p.add_argument("--model", default=None, help="local Hugging Face model folder (default: the embedded model)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="for requests that do not say (max_tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="for requests that do not say; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="for requests that do not say (default: a fresh seed per request)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    _add_cost_options(p)
    _add_calibration_option(p)
    registry.add_cli_options(p)  # each method's own options, as for generate
    p.set_defaults(handler=_cmd_serve)
    return parser


def _cmd_build(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.cli_options import quiet_beam_import

    quiet_beam_import()
    from specstore.pipelines.build import run_from_args  # imports Beam only here

    return run_from_args(args, extra)


def _cmd_train_head(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.pipelines.draft_head import run_from_args

    return run_from_args(args)


def _cmd_versions(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.store import Store, validate_name

    records = Store.from_args(args).versions(validate_name(args.name))
    rows = [
        {
            "version": r.version,
            "tags": list(r.tags),
            "created_at": r.created_at,
            "num_documents": r.manifest.num_documents,
            "num_tokens": r.manifest.num_tokens,
            "num_rejected": r.manifest.num_rejected,
            "build_id": r.build_id,
            "model": r.manifest.model.model_id,
            "regenerated": r.manifest.regenerated,
            "index": r.manifest.index,
        }
        for r in records
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no versions of '{args.name}' in {args.store}")
        return 0
    print(f"{'version':>7}  {'tags':<20} {'index':<6} {'documents':>9} {'tokens':>10} {'rejected':>8}  created_at")
    for r in rows:
        print(f"{r['version']:>7}  {','.join(r['tags']) or '-':<20} {r['index']:<6} {r['num_documents']:>9} {r['num_tokens']:>10} "
              f"{r['num_rejected']:>8}  {r['created_at']}")
    return 0


def _cmd_tag(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.store import Store

    record = Store.from_args(args).set_tag(args.ref, args.tag)
    print(f"{record.name}@{args.tag} -> version {record.version}")
    return 0


def _cmd_verify(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.cli_verify import run_verify

    return run_verify(args)


def _cmd_gc(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.retention import run_gc_command

    return run_gc_command(args)


def _cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.cli_generate import run_generate

    return run_generate(args)


def _cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.bench.runner import run_bench_command

    return run_bench_command(args)


def _cmd_simulate(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.bench.simulate import run_simulate_command

    return run_simulate_command(args)


def _cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.bench.report import report

    print(report(args.results, args.plots))
    return 0


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """Before any work: a store URI of an unknown scheme is refused, and every option left over must be one the command
    forwards (build: Beam's pipeline options) — else one error line naming it."""
    from specstore.runtime.cli_options import check_beam_options, check_store, reject_unknown

    check_store(getattr(args, "store", None), getattr(args, "storage_option", None))
    command = args.command
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    if getattr(args, "forwards_to", None) == "beam":
        check_beam_options(command, sub, args.runner, extra)
    else:
        reject_unknown(command, sub, extra)


def _cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    from specstore.runtime.cli_serve import run_serve  # imports Starlette and uvicorn only here

    return run_serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        _check_arguments(parser, args, extra)
        return int(args.handler(args, extra) or 0)
    except SpecstoreError as exc:
        print(f"specstore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specstore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
