"""Corpus reading: format detection, gzip, numbering, broken and non-UTF-8 records, path errors."""

from __future__ import annotations

import gzip
import json

import pytest

from specstore.pipelines.corpus import (
    Source,
    detect_format,
    plan_chunks,
    read_chunk,
    read_records,
    resolve_sources,
    source_sha256,
)
from specstore.runtime.errors import SpecstoreError


def _jsonl(path, rows, *, gz=False):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def test_detect_formats(tmp_path):
    assert detect_format(_jsonl(tmp_path / "a.jsonl", [{"instruction": "x", "output": "y"}])) == "instruct-jsonl"
    assert detect_format(_jsonl(tmp_path / "b.jsonl.gz", [{"turns": ["hi"]}], gz=True)) == "chat-jsonl"
    assert detect_format(_jsonl(tmp_path / "c.json", [{"chosen": "\n\nHuman: a\n\nAssistant: b"}])) == "chat-jsonl"
    (tmp_path / "d.txt").write_text("plain")
    assert detect_format(tmp_path / "d.txt") == "text"
    (tmp_path / "src").mkdir()
    assert detect_format(tmp_path / "src") == "code-dir"


def test_detection_skips_broken_first_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"{broken\n\xff\xfe\n" + json.dumps({"instruction": "x"}).encode() + b"\n")
    assert detect_format(path) == "instruct-jsonl"


def test_gzip_is_read_by_magic_not_name(tmp_path):
    rows = [{"instruction": f"q{i}", "output": "a"} for i in range(3)]
    path = _jsonl(tmp_path / "data.jsonl", rows, gz=True)  # gzip without .gz
    records = list(read_records(Source(0, str(path), "instruct-jsonl")))
    assert [r.payload for r in records] == rows
    assert [r.record_index for r in records] == [0, 1, 2]


def test_bad_lines_become_records_with_reasons(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"instruction": "ok", "output": "fine"}\n\n{"instruction": \n' + b'{"text": "caf\xe9"}\n')
    records = list(read_records(Source(3, str(path), "chat-jsonl")))
    assert len(records) == 3  # the blank line is not a record
    assert records[0].error is None and records[0].source_index == 3
    assert records[1].error.startswith("broken JSON") and records[1].origin == "line 3"
    assert records[2].error.startswith("not UTF-8")


def test_limit_and_text_and_code_records(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": str(i)} for i in range(10)])
    assert len(list(read_records(Source(0, str(path), "chat-jsonl"), limit=4))) == 4
    (tmp_path / "t.txt").write_text("hello world")
    [text] = read_records(Source(0, str(tmp_path / "t.txt"), "text"))
    assert text.payload == "hello world"
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "b.py").write_text("x = 1\n")
    (src / "pkg" / "a.js").write_text("let y = 2;\n")
    (src / "blob.bin").write_bytes(b"\x00\x01")  # not a source suffix: skipped
    (src / ".hidden").mkdir()
    (src / ".hidden" / "c.py").write_text("z = 3\n")
    (src / "bad.py").write_bytes(b"\x00binary")
    recs = list(read_records(Source(1, str(src), "code-dir")))
    assert [r.origin for r in recs] == ["b.py", "bad.py", "pkg/a.js"]
    assert recs[1].error == "binary file (NUL bytes)"


def test_source_hash_changes_with_content(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("1")
    before = source_sha256(Source(0, str(src), "code-dir"))
    (src / "a.py").write_text("2")
    assert source_sha256(Source(0, str(src), "code-dir")) != before


def test_resolve_sources_errors(tmp_path):
    with pytest.raises(SpecstoreError, match="does not exist"):
        resolve_sources([str(tmp_path / "missing.jsonl")])
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(SpecstoreError, match="unknown corpus format 'yaml'"):
        resolve_sources([str(tmp_path / "a.txt")], "yaml")
    with pytest.raises(SpecstoreError, match="code-dir cannot read"):
        resolve_sources([str(tmp_path / "a.txt")], "code-dir")
    [s] = resolve_sources([str(tmp_path / "a.txt")])
    assert s.format == "text" and s.index == 0


def _as_read(records):
    return [(r.source_index, r.record_index, r.origin, r.payload, r.error) for r in records]


@pytest.mark.parametrize("chunk_bytes", [1, 17, 64, 10**6])
def test_chunks_read_exactly_what_one_reader_reads(tmp_path, chunk_bytes):
    """Workers read a source's chunks on their own; together, and numbered, they must be the
    records of one reader over the whole source: blank, broken and non-UTF-8 lines included."""
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": "x" * (i % 7), "i": i}).encode() for i in range(40)]
    lines[5], lines[6], lines[20], lines[30] = b"", b"   ", b'{"text": broken', b'{"text": "caf\xe9"}'  # \xe9: not UTF-8
    path.write_bytes(b"\n".join(lines) + b"\n" + b'{"text": "no newline at the end"}')
    source = Source(2, str(path), "chat-jsonl")
    chunks = plan_chunks(source, chunk_bytes=chunk_bytes)
    assert (len(chunks) > 5) == (chunk_bytes < 100)
    whole = _as_read(read_records(source))
    assert _as_read(r for c in chunks for r in read_chunk(c)) == whole
    assert sum(c.num_records for c in chunks) == len(whole) == 39
    assert _as_read(r for c in chunks for r in read_chunk(c, limit=11)) == whole[:11]


def test_code_dirs_are_chunked_by_files_and_gzip_is_one_chunk(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(7):
        (src / f"m{i}.py").write_text(f"x = {i}\n")
    source = Source(0, str(src), "code-dir")
    chunks = plan_chunks(source, chunk_files=3)
    assert [(c.start, c.end) for c in chunks] == [(0, 3), (3, 6), (6, 7)]
    assert _as_read(r for c in chunks for r in read_chunk(c)) == _as_read(read_records(source))
    gz = _jsonl(tmp_path / "g.jsonl.gz", [{"text": str(i)} for i in range(5)], gz=True)
    [one] = plan_chunks(Source(1, str(gz), "chat-jsonl"), chunk_bytes=1)
    assert one.end is None and len(list(read_chunk(one))) == 5
