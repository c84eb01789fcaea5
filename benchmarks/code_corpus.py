"""A real code corpus at scale, written by no one here: the Python sources of installed packages.

Run: ``python benchmarks/code_corpus.py --out /work/scale/code.jsonl`` (default directories:
this interpreter's ``purelib``, i.e. the virtualenv's site-packages, and its standard library,
both from ``sysconfig.get_paths()``), or name the directories: ``python benchmarks/code_corpus.py
DIR [DIR ...] --out FILE``. Collects every ``.py`` file under them (hidden folders and
``__pycache__`` skipped; not UTF-8, NUL bytes or over ``--max-file-bytes``: left out),
deduplicates by content (SHA-256: the same module vendored twice, or installed in two places,
counts once) and writes one JSON line ``{"text": SOURCE, "path": WHERE}`` per file, which
``specstore build --corpus FILE`` reads as text records (``--format auto`` detects it; ``path``
is ignored). Nothing of the corpus is committed.

Order: by content hash, so any prefix is an evenly spread sample of all packages rather than
the first few alphabetically, and deterministic for the same files. ``--max-tokens N`` keeps the
shortest prefix of that order holding at least N tokens (the default model's tokenizer, batched;
the files after it are not tokenised), so slices of 1M, 10M and all tokens are prefixes of one
another: ``--max-tokens 1000000 --out code-1m.jsonl``. ``--max-bytes N`` cuts by source bytes
instead (no tokenizer). Prints what it kept and skipped. Owns no library code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

TOKENIZE_BATCH = 256  # files per batched tokenizer call when counting tokens


def default_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return [paths["purelib"], paths["stdlib"]]


def python_files(folder: Path):
    """``.py`` files under ``folder`` (sorted walk; hidden folders and ``__pycache__`` skipped)."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("."):
                yield Path(root) / name


def collect(dirs: list[str], max_file_bytes: int) -> tuple[list[tuple[str, str, str]], dict[str, int]]:
    """``([(sha256, path, text)] in hash order, counts)``: every distinct readable source file."""
    seen: dict[str, tuple[str, str]] = {}
    counts = {"files": 0, "duplicates": 0, "too_large": 0, "not_utf8": 0, "nul_bytes": 0, "empty": 0}
    for d in dirs:
        folder = Path(d).expanduser().resolve()
        if not folder.is_dir():
            raise SystemExit(f"code_corpus: {d} is not a directory")
        for path in python_files(folder):
            try:
                if path.stat().st_size > max_file_bytes:
                    counts["too_large"] += 1
                    continue
                data = path.read_bytes()
            except OSError:
                continue
            counts["files"] += 1
            if not data.strip():
                counts["empty"] += 1
                continue
            if b"\x00" in data:
                counts["nul_bytes"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                counts["not_utf8"] += 1
                continue
            digest = hashlib.sha256(data).hexdigest()
            if digest in seen:
                counts["duplicates"] += 1
                continue
            seen[digest] = (str(path), text)
    return [(h, p, t) for h, (p, t) in sorted(seen.items())], counts


def cut(files: list[tuple[str, str, str]], max_tokens: int | None, max_bytes: int | None, model: str | None):
    """The shortest prefix holding ``max_tokens`` tokens (or ``max_bytes`` bytes); every file when
    neither is given. Returns ``(prefix, tokens or None)``."""
    if max_bytes is not None:
        total, n = 0, 0
        while n < len(files) and total < max_bytes:
            total += len(files[n][2].encode("utf-8"))
            n += 1
        return files[:n], None
    if max_tokens is None:
        return files, None
    from specstore.pipelines.render import tokenise_batch
    from specstore.runtime.models import folder_model_info

    tokenizer, _ = folder_model_info(model)
    total, n = 0, 0
    while n < len(files) and total < max_tokens:
        batch = files[n : n + TOKENIZE_BATCH]
        for ids in tokenise_batch(tokenizer, [t for _, _, t in batch]):
            total += len(ids)
            n += 1
            if total >= max_tokens:
                break
    return files[:n], total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("dirs", nargs="*", metavar="DIR", help="directories to collect .py files from (default: purelib and stdlib)")
    ap.add_argument("--out", required=True, metavar="FILE", help="JSONL corpus to write")
    ap.add_argument("--max-tokens", type=int, default=None, metavar="N", help="keep the shortest prefix of at least N tokens")
    ap.add_argument("--max-bytes", type=int, default=None, metavar="N", help="keep the shortest prefix of at least N source bytes")
    ap.add_argument("--max-file-bytes", type=int, default=1 << 20, metavar="N", help="leave out files larger than N bytes (default 1 MiB)")
    ap.add_argument("--model", default=None, help="model folder whose tokenizer counts tokens (default: the embedded model)")
    args = ap.parse_args(argv)
    if args.max_tokens is not None and args.max_bytes is not None:
        ap.error("give --max-tokens or --max-bytes, not both")
    started = time.monotonic()
    dirs = args.dirs or default_dirs()
    files, counts = collect(dirs, args.max_file_bytes)
    kept, tokens = cut(files, args.max_tokens, args.max_bytes, args.model)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    num_bytes = 0
    with open(out, "w", encoding="utf-8") as handle:
        for _, path, text in kept:
            num_bytes += len(text.encode("utf-8"))
            handle.write(json.dumps({"text": text, "path": path}, ensure_ascii=False) + "\n")
    summary = {"dirs": dirs, "out": str(out), "distinct_files": len(files), "kept_files": len(kept), "source_bytes": num_bytes,
               "tokens": tokens, **counts, "seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
