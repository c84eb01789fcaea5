"""Records -> documents: what the model sees, as token ids, with a deterministic id.

Owns interpreting a raw record (instruction/input/output|response, ``messages``, multi-turn
``turns``, ``chosen`` Human/Assistant transcripts, ``text``), rendering chat records through the
model's chat template and text/code as raw text, tokenising, chunking long text, rejecting what
cannot be used (with a reason), and numbering documents. Pure functions: no Beam, no model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from specstore.pipelines.corpus import RawRecord

_SOURCE_BITS, _RECORD_BITS, _CHUNK_BITS = 15, 28, 20
_TRANSCRIPT_RE = re.compile(r"(?:^|\n\n)(Human|Assistant):\s?")
_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True, slots=True)
class Document:
    """One datastore document: ``tokens`` int32 [T], numbered by ``doc_id``."""

    doc_id: int
    tokens: np.ndarray


@dataclass(frozen=True, slots=True)
class TokenRef:
    """Where a document's tokens were spilled: ``length`` tokens at ``offset`` of the staging
    file ``file`` (relative to the version's files folder). What the suffix-array steps carry
    instead of the tokens, so no stage holds the whole corpus's tokens at once."""

    doc_id: int
    length: int
    file: str
    offset: int


@dataclass(frozen=True, slots=True)
class Prompt:
    """A chat prompt the model answers itself (``--regenerate``): ``tokens`` int32 [T]."""

    doc_id: int
    tokens: np.ndarray


@dataclass(frozen=True, slots=True)
class Rejection:
    """A record that did not become a document, and why (one line of rejected.jsonl)."""

    source_index: int
    record_index: int
    origin: str
    reason: str

    def to_json(self, source_path: str) -> dict:
        return {"source": source_path, "record": self.record_index, "origin": self.origin, "reason": self.reason}


def doc_id(source_index: int, record_index: int, chunk_index: int = 0) -> int:
    """Deterministic, order-preserving id: source, then record, then chunk (bits 15/28/20)."""
    if not (0 <= source_index < 1 << _SOURCE_BITS and 0 <= record_index < 1 << _RECORD_BITS and 0 <= chunk_index < 1 << _CHUNK_BITS):
        raise ValueError(f"document index out of range: source {source_index}, record {record_index}, chunk {chunk_index}")
    return (source_index << (_RECORD_BITS + _CHUNK_BITS)) | (record_index << _CHUNK_BITS) | chunk_index


def split_doc_id(value: int) -> tuple[int, int, int]:
    return value >> (_RECORD_BITS + _CHUNK_BITS), (value >> _CHUNK_BITS) & ((1 << _RECORD_BITS) - 1), value & ((1 << _CHUNK_BITS) - 1)


def _text(value) -> str:
    return value.strip() if isinstance(value, str) else ""


def parse_transcript(text: str) -> list[dict]:
    """``"\\n\\nHuman: hi\\n\\nAssistant: hello"`` -> chat messages."""
    parts = _TRANSCRIPT_RE.split(text)
    messages = []
    for speaker, content in zip(parts[1::2], parts[2::2], strict=True):
        if content.strip():
            messages.append({"role": "user" if speaker == "Human" else "assistant", "content": content.strip()})
    return messages


def to_messages(obj: dict) -> list[dict] | str:
    """A JSON record as chat messages, or as a raw text (``{"text": ...}``).

    Raises ValueError with a reason when the record has no usable content.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"record is a JSON {type(obj).__name__}, not an object")
    if "instruction" in obj:
        prompt = _text(obj.get("instruction"))
        extra = _text(obj.get("input"))
        if extra:
            prompt = f"{prompt}\n\n{extra}" if prompt else extra
        answer = _text(obj.get("output")) or _text(obj.get("response"))
        if not prompt:
            raise ValueError("empty instruction")
        return [{"role": "user", "content": prompt}] + ([{"role": "assistant", "content": answer}] if answer else [])
    if isinstance(obj.get("messages") or obj.get("conversations"), list):
        messages = []
        for m in obj.get("messages") or obj.get("conversations"):
            if not isinstance(m, dict):
                raise ValueError("a message is not an object")
            role = _ROLE_ALIASES.get(str(m.get("role", m.get("from", ""))).lower())
            content = _text(m.get("content", m.get("value")))
            if role is None:
                raise ValueError(f"unknown message role {m.get('role', m.get('from'))!r}")
            if content:
                messages.append({"role": role, "content": content})
        if not messages:
            raise ValueError("empty conversation")
        return messages
    if isinstance(obj.get("turns"), list):
        questions = [_text(t) for t in obj["turns"]]
        answers: list = []
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            answers = [_text(t) for t in choices[0].get("turns", [])]
        messages = []
        for i, question in enumerate(questions):
            if not question:
                continue
            messages.append({"role": "user", "content": question})
            if i < len(answers) and answers[i]:
                messages.append({"role": "assistant", "content": answers[i]})
        if not messages:
            raise ValueError("empty turns")
        return messages
    if isinstance(obj.get("chosen"), str):
        messages = parse_transcript(obj["chosen"])
        if not messages:
            raise ValueError("empty transcript")
        return messages
    if "text" in obj:
        text = obj["text"] if isinstance(obj["text"], str) else ""
        if not text.strip():
            raise ValueError("empty text")
        return text
    raise ValueError("no known fields (expected instruction, messages, turns, chosen or text)")


def regeneration_prompt(messages: list[dict]) -> list[dict]:
    """The conversation up to (not including) its first assistant message: what the model answers."""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            return messages[:i]
    return messages


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template, so chat records cannot be rendered")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenise(tokenizer, text: str) -> np.ndarray:
    """Token ids of an already rendered text (no special tokens added): int32 [T]."""
    return tokenise_batch(tokenizer, [text])[0]


def tokenise_batch(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each already rendered text (no special tokens added), one int32 array per
    text: the fast tokenizer's batch encoding (Rust, in parallel) when its backend adds nothing of
    its own (no truncation or padding set), else the tokenizer's call. Same ids either way."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no character offsets
        return [np.asarray(e.ids, dtype=np.int32) for e in encode(texts, add_special_tokens=False)]
    return [np.asarray(ids, dtype=np.int32) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def chunk(tokens: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Consecutive pieces of at most ``max_tokens`` tokens (text and code longer than a document)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    return [tokens[i : i + max_tokens] for i in range(0, len(tokens), max_tokens)]


def prepare(
    record: RawRecord, source_format: str, tokenizer, *, max_doc_tokens: int, regenerate: bool = False
) -> list[Document | Prompt | Rejection]:
    """One raw record -> its documents (or one prompt with ``regenerate``) or one rejection."""
    return prepare_batch([record], lambda _: source_format, tokenizer, max_doc_tokens=max_doc_tokens, regenerate=regenerate)


def prepare_batch(
    records: list[RawRecord], format_of, tokenizer, *, max_doc_tokens: int, regenerate: bool = False
) -> list[Document | Prompt | Rejection]:
    """Raw records -> their documents, prompts and rejections, in record order, every text of the
    batch tokenised in one call (``format_of(source_index)``: a record's source format). Each
    record gives what ``prepare`` gives it alone."""
    out: list[Document | Prompt | Rejection] = []
    rendered: list[tuple[RawRecord, str, str]] = []  # (record, kind, text to tokenise), kind: text | prompt | chat
    slots: list[int | list] = []  # per record: an index into rendered, or its rejection
    for record in records:
        found = _render(record, format_of(record.source_index), tokenizer, regenerate)
        if isinstance(found, str):
            slots.append([Rejection(record.source_index, record.record_index, record.origin, found)])
        else:
            slots.append(len(rendered))
            rendered.append((record, *found))
    tokens = tokenise_batch(tokenizer, [text for _, _, text in rendered])
    for slot in slots:
        if isinstance(slot, list):
            out.extend(slot)
            continue
        (record, kind, _), ids = rendered[slot], tokens[slot]
        if kind == "text":  # raw text: split, never rejected for length
            out.extend(Document(doc_id(record.source_index, record.record_index, i), p) for i, p in enumerate(chunk(ids, max_doc_tokens)))
        elif kind == "prompt" and len(ids) >= max_doc_tokens:
            out.append(Rejection(record.source_index, record.record_index, record.origin,
                                 f"prompt too long: {len(ids)} tokens >= max_doc_tokens {max_doc_tokens}"))
        elif kind == "chat" and len(ids) > max_doc_tokens:
            out.append(Rejection(record.source_index, record.record_index, record.origin,
                                 f"too long: {len(ids)} tokens > max_doc_tokens {max_doc_tokens}"))
        else:
            out.append((Prompt if kind == "prompt" else Document)(doc_id(record.source_index, record.record_index), ids))
    return out


def _render(record: RawRecord, source_format: str, tokenizer, regenerate: bool) -> tuple[str, str] | str:
    """``(kind, text)``: what of a record gets tokenised (kind ``text``, ``prompt`` or ``chat``),
    or the reason it is rejected."""
    if record.error is not None:
        return record.error
    if source_format in ("text", "code-dir"):
        content: list[dict] | str = record.payload if isinstance(record.payload, str) else ""
        if not content.strip():
            return "empty record"
    else:
        try:
            content = to_messages(record.payload)
        except ValueError as exc:
            return str(exc)
    if isinstance(content, str):
        return "text", content
    try:
        if regenerate:
            prompt = regeneration_prompt(content)
            if not prompt:
                return "conversation starts with an assistant message: nothing to answer"
            return "prompt", render_chat(tokenizer, prompt, add_generation_prompt=True)
        if not any(m["role"] == "assistant" for m in content):
            return "no response (build with --regenerate to let the model answer)"
        return "chat", render_chat(tokenizer, content)
    except ValueError as exc:
        return str(exc)
