"""A serving process for the concurrency test: opens ``REF`` and decodes a prompt over and over
with REST, logging (time, version, token ids) per decode as JSON lines, until ``STOP`` exists;
when ``REOPEN`` appears it reopens ``REF`` once (as a server does on a reload signal).

usage: python tests/ops_reader.py STORE REF MODEL LOG REOPEN STOP
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from specstore.runtime.api import generate
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.models import load_model


def main(store: str, ref: str, model: str, log: str, reopen: str, stop: str) -> None:
    loaded = load_model(model, dtype="float32", device="cpu")
    ds = Datastore.open(store, ref, loaded.info, dense=False)
    reopened = False
    with open(log, "a") as out:
        while not Path(stop).exists():
            if not reopened and Path(reopen).exists():
                ds, reopened = Datastore.open(store, ref, loaded.info, dense=False), True
            result = generate(loaded.model, loaded.tokenizer, "def add(a, b):", make_drafter("rest", ds), 12)
            out.write(json.dumps({"t": time.time(), "version": ds.record.version, "ids": result.token_ids}) + "\n")
            out.flush()
            time.sleep(0.02)


if __name__ == "__main__":
    main(*sys.argv[1:7])
