"""Corpus sources: which format a path holds, its content hash, and its raw records.

Owns the *reading* half of the build: detecting a path's format (``--format auto``), opening
gzip transparently (by magic bytes, not by name), and turning a path into numbered raw records
(one JSON line, one text file, one source file). Broken lines and non-UTF-8 bytes become
records that carry a rejection reason instead of raising. Does not own what a record means
(render.py) nor Beam (transforms.py): everything here is a plain function.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specstore.runtime.errors import SpecstoreError
from specstore.runtime.hashing import file_sha256

FORMATS = ("chat-jsonl", "instruct-jsonl", "text", "code-dir")
_JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
CODE_SUFFIXES = frozenset(
    ".py .pyi .js .jsx .ts .tsx .java .c .h .cc .cpp .hpp .cs .go .rs .rb .php .swift .kt .scala .sh .sql "
    ".r .m .lua .pl .hs .ml .jl .dart .html .css .md .rst .toml .yaml .yml .txt .cfg .ini .json".split()
)
_GZIP_MAGIC = b"\x1f\x8b"
_DETECT_LINES = 20


@dataclass(frozen=True, slots=True)
class Source:
    """One ``--corpus`` path with its resolved format and its index in the build's source list."""

    index: int
    path: str
    format: str


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One record as read: a parsed JSON value or a text, or a rejection ``error``.

    ``origin`` names where it came from (a line number or a file inside a directory).
    """

    source_index: int
    record_index: int
    origin: str
    payload: object = None
    error: str | None = None


def open_binary(path: Path):
    """Open a file for binary reading, decompressing gzip when its first bytes say so."""
    with open(path, "rb") as probe:
        magic = probe.read(2)
    return gzip.open(path, "rb") if magic == _GZIP_MAGIC else open(path, "rb")


def _base_suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def detect_format(path: Path) -> str:
    """The format of a path: a directory is ``code-dir``; JSON lines are ``instruct-jsonl`` when
    their first parseable record has an ``instruction`` field, else ``chat-jsonl``; any other
    file is ``text``."""
    if path.is_dir():
        return "code-dir"
    if _base_suffix(path) not in _JSONL_SUFFIXES:
        return "text"
    try:
        with open_binary(path) as handle:
            for _, line in zip(range(_DETECT_LINES), handle, strict=False):
                try:
                    obj = json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    continue
                if isinstance(obj, dict):
                    return "instruct-jsonl" if "instruction" in obj else "chat-jsonl"
    except (OSError, EOFError) as exc:
        raise SpecstoreError(f"cannot read corpus {path}: {exc}") from None
    return "chat-jsonl"


def resolve_sources(paths: list[str], fmt: str = "auto") -> list[Source]:
    """Check every path exists and resolve its format; raise SpecstoreError with one clear line."""
    if fmt != "auto" and fmt not in FORMATS:
        raise SpecstoreError(f"unknown corpus format {fmt!r}: choose auto or one of {', '.join(FORMATS)}")
    if not paths:
        raise SpecstoreError("no corpus path given")
    sources = []
    for index, raw in enumerate(paths):
        path = Path(raw).expanduser()
        if not path.exists():
            raise SpecstoreError(f"corpus path {raw} does not exist")
        resolved = detect_format(path) if fmt == "auto" else fmt
        if (resolved == "code-dir") != path.is_dir():
            kind = "a directory" if path.is_dir() else "a file"
            raise SpecstoreError(f"corpus path {raw} is {kind}, which format {resolved} cannot read")
        sources.append(Source(index, str(path.resolve()), resolved))
    return sources


def code_files(folder: Path) -> list[Path]:
    """Source files under ``folder`` in a stable order, skipping hidden folders and files."""
    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        if path.suffix.lower() in CODE_SUFFIXES or (path.suffix.lower() == ".gz" and _base_suffix(path) in CODE_SUFFIXES):
            files.append(path)
    return files


def source_sha256(source: Source) -> str:
    """Content hash of a file, or of the sorted (relative path, file hash) list of a directory."""
    path = Path(source.path)
    if not path.is_dir():
        return file_sha256(path)
    digest = hashlib.sha256()
    for f in code_files(path):
        digest.update(f"{f.relative_to(path).as_posix()}={file_sha256(f)}\n".encode())
    return digest.hexdigest()


def _decode(data: bytes) -> tuple[str | None, str | None]:
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 (byte {exc.start})"


CHUNK_BYTES = 8 << 20  # a plain JSONL file is read in chunks of about this size
CHUNK_FILES = 256  # a code directory is read this many files at a time


@dataclass(frozen=True, slots=True)
class Chunk:
    """A part of a source that one worker reads on its own: lines from byte ``start`` to
    ``end`` of a plain JSONL file (``first_record`` records and ``first_line`` lines precede it),
    files ``start`` to ``end`` of a code directory, or (``end`` None) the whole source."""

    source: Source
    start: int = 0
    end: int | None = None
    first_record: int = 0
    first_line: int = 1
    num_records: int | None = None  # records in the chunk, when the plan counted them


def plan_chunks(source: Source, chunk_bytes: int | None = None, chunk_files: int | None = None) -> list[Chunk]:
    """The chunks of a source, in order, each with the record count that precedes it, so that
    workers read a large source in parallel and number its records as one reader would. A
    compressed file or a text file is one chunk. Reads the source once (line breaks only)."""
    chunk_bytes, chunk_files = chunk_bytes or CHUNK_BYTES, chunk_files or CHUNK_FILES
    path = Path(source.path)
    if source.format == "code-dir":
        n = len(code_files(path))
        return [Chunk(source, a, min(a + chunk_files, n), a, 1, min(a + chunk_files, n) - a) for a in range(0, n, chunk_files)] or [
            Chunk(source, 0, 0, 0, 1, 0)]
    if source.format == "text":
        return [Chunk(source, num_records=1)]
    with open(path, "rb") as probe:
        if probe.read(2) == _GZIP_MAGIC:
            return [Chunk(source)]  # no random access into a gzip stream
    chunks, start, first_record, first_line, records, line_no, offset = [], 0, 0, 1, 0, 0, 0
    with open(path, "rb") as handle:
        for line in handle:
            line_no += 1
            offset += len(line)
            records += bool(line.strip())
            if offset - start >= chunk_bytes:
                chunks.append(Chunk(source, start, offset, first_record, first_line, records - first_record))
                start, first_record, first_line = offset, records, line_no + 1
    if offset > start or not chunks:
        chunks.append(Chunk(source, start, offset, first_record, first_line, records - first_record))
    return chunks


def read_chunk(chunk: Chunk, limit: int | None = None) -> Iterator[RawRecord]:
    """The records of one chunk, numbered as ``read_records`` numbers them in the whole source;
    none at or beyond ``limit``."""
    source = chunk.source
    if chunk.end is None:
        yield from read_records(source, limit)
    elif source.format == "code-dir":
        yield from _code_records(source, chunk.start, chunk.end, limit)
    else:
        yield from _json_lines(source, lambda: open(source.path, "rb"), limit, start=chunk.start,
                               size=chunk.end - chunk.start, first_record=chunk.first_record, first_line=chunk.first_line)


def read_records(source: Source, limit: int | None = None) -> Iterator[RawRecord]:
    """The numbered records of a source, at most ``limit`` of them.

    JSONL: one record per non-blank line (blank lines are skipped, not counted). Text: the whole
    file is one record. Code directory: one record per source file.
    """
    path = Path(source.path)
    if source.format == "code-dir":
        yield from _code_records(source, 0, None, limit)
    elif source.format == "text":
        if limit is None or limit > 0:
            yield _text_record(source, 0, path.name, path)
    else:
        yield from _json_lines(source, lambda: open_binary(path), limit)


def _code_records(source: Source, start: int, end: int | None, limit: int | None) -> Iterator[RawRecord]:
    """Files ``start`` to ``end`` of a code directory, one record each, numbered from ``start``."""
    path = Path(source.path)
    for index, f in enumerate(code_files(path)[start:end], start=start):
        if limit is not None and index >= limit:
            return
        yield _text_record(source, index, f.relative_to(path).as_posix(), f)


def _json_lines(source: Source, opener, limit: int | None, *, start: int = 0, size: int | None = None,
                first_record: int = 0, first_line: int = 1) -> Iterator[RawRecord]:
    """One record per non-blank line of ``opener()``, from byte ``start`` for ``size`` bytes
    (None: to the end), numbered from ``first_record`` (records) and ``first_line`` (origins)."""
    count = first_record
    try:
        with opener() as handle:
            if start:
                handle.seek(start)
            read = 0
            for line_no, line in enumerate(handle, start=first_line):
                if size is not None and read >= size:
                    return
                read += len(line)
                if not line.strip():
                    continue
                if limit is not None and count >= limit:
                    return
                yield _json_record(source, count, f"line {line_no}", line)
                count += 1
    except (OSError, EOFError) as exc:  # e.g. a truncated gzip stream: keep what was read
        yield RawRecord(source.index, count, "end of file", error=f"unreadable: {exc}")


def _json_record(source: Source, index: int, origin: str, line: bytes) -> RawRecord:
    text, error = _decode(line)
    if error:
        return RawRecord(source.index, index, origin, error=error)
    try:
        return RawRecord(source.index, index, origin, payload=json.loads(text))
    except ValueError as exc:
        return RawRecord(source.index, index, origin, error=f"broken JSON: {exc.msg} at column {exc.colno}")


def _text_record(source: Source, index: int, origin: str, path: Path) -> RawRecord:
    try:
        with open_binary(path) as handle:
            data = handle.read()
    except (OSError, EOFError) as exc:
        return RawRecord(source.index, index, origin, error=f"unreadable: {exc}")
    if b"\x00" in data:
        return RawRecord(source.index, index, origin, error="binary file (NUL bytes)")
    text, error = _decode(data)
    return RawRecord(source.index, index, origin, payload=text, error=error)
