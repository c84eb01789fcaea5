"""The served-request log: one JSON line per request an engine served, for ``build --append``.

Owns the line format and the append. A line is a record ``pipelines/corpus.py`` detects as
``chat-jsonl`` (it never has an ``instruction`` field) and ``pipelines/render.py`` reads:

- a chat request (a string prompt or messages): ``{"messages": [...the prompt's messages...,
  {"role": "assistant", "content": RESPONSE}], "specstore": {...}}``;
- a raw completion (no chat template): ``{"text": PROMPT + RESPONSE, "specstore": {...}}``.

``specstore`` holds what served it (datastore ``NAME@VERSION`` and the reference as opened,
method, stats, stop reason, sampling, time); the build ignores it. Each line is written with one
``write`` on a file opened in append mode, then flushed and fsynced, so a crash loses at most the
line being written; that half-written line is broken JSON, which the build rejects and counts.
The file is opened per request, so rotating it (``mv served.jsonl served.1.jsonl``) between
builds needs no restart, and a line left half-written by a crash is closed with a newline before
the next one so that it cannot swallow it.

Append builds choose sources by content hash: a log that grew since the last ``build --append``
is read again whole. Rotate the log and append each closed segment once.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime
from pathlib import Path


def served_record(prompt, response: str, meta: dict, *, template: bool = True, decoded_prompt: str | None = None) -> dict:
    """The log line for one request. ``prompt``: the request's string or chat messages (with
    ``template``), or its raw text (without); ``decoded_prompt``: the prompt's text when it was
    given as token ids."""
    if not template or decoded_prompt is not None:
        text = decoded_prompt if decoded_prompt is not None else str(prompt)
        return {"text": text + response, "specstore": meta}
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    return {"messages": [*messages, {"role": "assistant", "content": response}], "specstore": meta}


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class ServedLog:
    """Append-only JSONL at ``path`` (created with its folder on first write)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self._lock = threading.Lock()
        self.num_written = 0

    def write(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            created = not self.path.exists()
            with open(self.path, "ab+") as handle:
                size = handle.seek(0, os.SEEK_END)
                if size:
                    handle.seek(size - 1)
                    if handle.read(1) != b"\n":  # a line half-written by a crash: close it
                        line = b"\n" + line
                handle.write(line)  # O_APPEND: lands at the end whatever the position
                handle.flush()
                os.fsync(handle.fileno())
            if created:  # make the new directory entry durable too
                fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self.num_written += 1


def read_served(path: str | os.PathLike) -> list[dict]:
    """The complete records of a log (a half-written last line is left out)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
