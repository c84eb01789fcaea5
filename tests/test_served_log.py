"""The served-request log: one JSON line per served request, fsynced, in a shape ``build --append``
reads (chat requests as ``messages``, raw completions as ``text``); a line half-written by a crash
is closed before the next one and rejected (and counted) by the build; the engine follows the
bare name to the appended version."""

from __future__ import annotations

import json

import pytest

from specstore.pipelines.build import build
from specstore.pipelines.corpus import detect_format
from specstore.runtime import Engine
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.models import load_model
from specstore.runtime.served_log import ServedLog, read_served, served_record
from specstore.runtime.store import Store
from tests.helpers import BUILD_OPTIONS, CORPUS_DIR

OPTIONS = BUILD_OPTIONS | {"max_doc_tokens": 256}


def test_records_and_a_half_written_line(tmp_path):
    chat = served_record("hi", "hello", {"method": "rest"})
    assert chat == {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "specstore": {"method": "rest"}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert served_record(messages, "yo", {})["messages"] == [*messages, {"role": "assistant", "content": "yo"}]
    assert served_record("def f(", "):", {}, template=False) == {"text": "def f():", "specstore": {}}
    path = tmp_path / "logs" / "served.jsonl"
    log = ServedLog(path)
    log.write(chat)
    with open(path, "ab") as handle:  # a crash in the middle of the next line
        handle.write(b'{"messages": [{"role": "user", "content": "cut')
    log.write(served_record("again", "fine", {}))
    lines = path.read_bytes().split(b"\n")
    assert lines[1].startswith(b'{"messages": [{"role": "user", "content": "cut') and lines[2].startswith(b'{"messages"')
    assert [r["messages"][0]["content"] for r in read_served(path)] == ["hi", "again"]
    assert detect_format(path) == "chat-jsonl" and log.num_written == 2


def test_served_log_round_trips_through_build_append(tiny_model_dir, tmp_path):
    store = Store(tmp_path / "store", create=True)
    first = build(store, "chat", [str(CORPUS_DIR / "instruct.jsonl")], model=tiny_model_dir, **OPTIONS).manifest
    log_path = tmp_path / "served.jsonl"
    engine = Engine(load_model(tiny_model_dir, dtype="float32", device="cpu"), store, "chat", method="rest", log=log_path, refresh_seconds=None)
    served = [
        engine.generate("Name three colours.", max_new_tokens=12),
        engine.generate([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}], max_new_tokens=12),
        engine.generate("def add(a, b):", template=False, max_new_tokens=12, method="pld"),
    ]
    assert [r.datastore for r in served] == ["chat@1", "chat@1", None]
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["specstore"]["datastore"] for r in records] == ["chat@1", "chat@1", None]
    assert [r["specstore"]["method"] for r in records] == ["rest", "rest", "pld"]
    assert records[0]["messages"][-1] == {"role": "assistant", "content": served[0].text}
    assert records[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert records[2]["text"] == "def add(a, b):" + served[2].text
    assert records[0]["specstore"]["stats"]["mat"] == served[0].stats.mat
    assert records[0]["specstore"]["completion_tokens"] == len(served[0].token_ids)
    with open(log_path, "ab") as handle:  # the engine crashed while writing a fourth line
        handle.write(b'{"messages": [{"role": "user", "content": "Name a')

    argv = ["build", "--store", str(store.root), "--name", "chat", "--corpus", str(log_path), "--model", tiny_model_dir, "--append"]
    assert main(argv) == 0
    appended = store.resolve("chat").manifest
    assert appended.version == 2 and appended.lineage.mode == "append"
    source = appended.sources[-1]
    assert source.path == str(log_path.resolve()) and source.format == "chat-jsonl"
    assert source.num_rejected == 1 and appended.num_documents == first.num_documents + 3
    rejected = (store.files_dir("chat", appended.build_id) / "rejected.jsonl").read_text()
    assert "broken JSON" in rejected and str(log_path.resolve()) in rejected
    # what was served is now in the datastore: the rendered conversations are found in the new stream
    tok = engine.tokenizer
    ds = Datastore.open(store, "chat@2", engine.info, dense=False)
    for record in records:
        messages = [{**m, "content": m["content"].strip()} for m in record.get("messages", [])]  # as render.py reads them
        text = record["text"] if "text" in record else tok.apply_chat_template(messages, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ds.suffix.positions(ids)) >= 1, record
    assert engine.refresh() == {"chat": "chat@1 -> chat@2"}  # the bare name follows the new version
    assert engine.generate("Name three colours.", max_new_tokens=4).datastore == "chat@2"


@pytest.mark.parametrize("tail", [b"", b"\n"])
def test_complete_lines_are_left_as_they_are(tmp_path, tail):
    path = tmp_path / "served.jsonl"
    path.write_bytes(b'{"text": "a"}\n' + tail)
    ServedLog(path).write({"text": "b"})
    assert [r["text"] for r in read_served(path)] == ["a", "b"]
    assert path.read_bytes() == b'{"text": "a"}\n' + tail + b'{"text": "b"}\n'
