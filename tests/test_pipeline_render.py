"""Records -> documents: message extraction per format, chat rendering, tokenising, chunking,
rejections with reasons, and deterministic document ids."""

from __future__ import annotations

import numpy as np
import pytest

from specstore.pipelines.corpus import RawRecord
from specstore.pipelines.render import (
    Document,
    Prompt,
    Rejection,
    chunk,
    doc_id,
    parse_transcript,
    prepare,
    regeneration_prompt,
    render_chat,
    split_doc_id,
    to_messages,
    tokenise,
)
from tests.helpers import default_tokenizer


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def test_instruction_formats():
    assert to_messages({"instruction": "Sum", "input": "1, 2", "output": "3"}) == [
        {"role": "user", "content": "Sum\n\n1, 2"},
        {"role": "assistant", "content": "3"},
    ]
    assert to_messages({"instruction": "Hi", "input": "", "response": "Hello"})[1]["content"] == "Hello"
    assert to_messages({"instruction": "Only a question"}) == [{"role": "user", "content": "Only a question"}]


def test_chat_formats():
    turns = to_messages({"turns": ["q1", "q2"], "choices": [{"turns": ["a1", "a2"]}]})
    assert [m["role"] for m in turns] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in to_messages({"turns": ["q1", "q2"]})] == ["q1", "q2"]
    chosen = to_messages({"chosen": "\n\nHuman: hi there\n\nAssistant: hello\n\nHuman: bye\n\nAssistant: ciao", "rejected": "x"})
    assert chosen == [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    sharegpt = to_messages({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]})
    assert [m["role"] for m in sharegpt] == ["user", "assistant"]
    assert to_messages({"text": "raw words"}) == "raw words"
    assert parse_transcript("no speakers here") == []


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"instruction": "  ", "output": "x"}, "empty instruction"),
        ({"turns": ["", " "]}, "empty turns"),
        ({"text": ""}, "empty text"),
        ({"foo": 1}, "no known fields"),
        ([1, 2], "not an object"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown message role"),
    ],
)
def test_unusable_records_raise_with_reason(record, reason):
    with pytest.raises(ValueError, match=reason):
        to_messages(record)


def test_render_and_tokenise_match_the_chat_template(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = render_chat(tok, messages)
    assert text.endswith("<|im_start|>assistant\nhello<|im_end|>\n")
    ids = tokenise(tok, text)
    assert ids.dtype == np.int32
    assert tok.decode(ids.tolist()) == text
    prompt = render_chat(tok, regeneration_prompt(messages), add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "hello" not in prompt


def test_chunk_splits_exactly():
    tokens = np.arange(10, dtype=np.int32)
    pieces = chunk(tokens, 4)
    assert [p.tolist() for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert chunk(np.zeros(0, np.int32), 4) == []
    with pytest.raises(ValueError):
        chunk(tokens, 0)


def test_doc_ids_order_by_source_record_chunk():
    ids = [doc_id(0, 5, 0), doc_id(0, 5, 1), doc_id(0, 6, 0), doc_id(1, 0, 0)]
    assert ids == sorted(ids) and len(set(ids)) == 4
    assert split_doc_id(doc_id(3, 1234, 7)) == (3, 1234, 7)
    with pytest.raises(ValueError):
        doc_id(0, 1 << 28)


def _rec(payload=None, error=None, index=0):
    return RawRecord(0, index, f"line {index + 1}", payload=payload, error=error)


def test_prepare_chat_documents_and_rejections(tok):
    [doc] = prepare(_rec({"instruction": "Add", "output": "a + b"}), "instruct-jsonl", tok, max_doc_tokens=512)
    assert isinstance(doc, Document) and doc.doc_id == doc_id(0, 0)
    assert "a + b" in tok.decode(doc.tokens.tolist())
    [too_long] = prepare(_rec({"instruction": "word " * 300, "output": "x"}), "instruct-jsonl", tok, max_doc_tokens=64)
    assert isinstance(too_long, Rejection) and too_long.reason.startswith("too long")
    [no_answer] = prepare(_rec({"turns": ["a question"]}), "chat-jsonl", tok, max_doc_tokens=512)
    assert "no response" in no_answer.reason
    [broken] = prepare(_rec(error="broken JSON: x"), "chat-jsonl", tok, max_doc_tokens=512)
    assert broken.reason == "broken JSON: x"
    [prompt] = prepare(_rec({"turns": ["a question"]}), "chat-jsonl", tok, max_doc_tokens=512, regenerate=True)
    assert isinstance(prompt, Prompt) and tok.decode(prompt.tokens.tolist()).endswith("<|im_start|>assistant\n")


def test_prepare_text_is_raw_and_chunked(tok):
    text = "alpha beta gamma " * 40
    docs = prepare(_rec(text, index=2), "text", tok, max_doc_tokens=16)
    assert all(isinstance(d, Document) and len(d.tokens) <= 16 for d in docs)
    assert [split_doc_id(d.doc_id) for d in docs] == [(0, 2, i) for i in range(len(docs))]
    assert np.concatenate([d.tokens for d in docs]).tolist() == tok(text, add_special_tokens=False)["input_ids"]
    [empty] = prepare(_rec("   \n"), "code-dir", tok, max_doc_tokens=16)
    assert empty.reason == "empty record"
