"""The engine: float32 identity with ``api.generate`` for every method, tag following (between
requests, never inside one; at most every ``refresh_seconds``; on demand), gc of the version in
use while serving, one request at a time from several threads, streaming and cancellation."""

from __future__ import annotations

import threading

import pytest

from specstore.runtime import Engine, RequestCancelled
from specstore.runtime import engine as engine_module
from specstore.runtime.api import generate
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.retention import collect
from tests.datastore_helpers import PROMPTS, TEXTS, model_hidden, own_output_datastore, write_datastore

METHODS = ("ar", "pld", "rest", "dresd", "respec")
N = 24


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A store whose ``own@1`` holds the tiny model's own answers (tagged prod) and ``own@2``
    unrelated texts (so the two versions draft differently)."""
    store, loaded, outputs = own_output_datastore(tmp_path_factory.mktemp("engine"), max_new_tokens=N)
    store.set_tag("own@1", "prod")
    docs = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    write_datastore(store, "own", docs, model_hidden(loaded.model, docs), loaded.info)
    return store, loaded, outputs


def _reference(store, loaded, ref, method, prompt, **kw):
    ds = Datastore.open(store, ref, loaded.info)
    return generate(loaded.model, loaded.tokenizer, prompt, make_drafter(method, ds), N, **kw)


def test_engine_output_equals_generate_for_every_method(own):
    store, loaded, outputs = own
    engine = Engine(loaded, store, "own@1", method="rest", dense=True)
    for method in METHODS:
        for prompt in PROMPTS[:2]:
            result = engine.generate(prompt, method=method, max_new_tokens=N)
            reference = _reference(store, loaded, "own@1", method, prompt)
            assert result.token_ids == reference.token_ids == outputs[prompt], method
            assert result.text == reference.text and result.stop_reason == reference.stop_reason
            assert result.stats.accepted_per_step == reference.stats.accepted_per_step, method
            assert result.method == method and result.lossless and result.drafter.name == method
            assert result.datastore == ("own@1" if method in ("rest", "dresd", "respec") else None)
    assert engine.generate(PROMPTS[0], max_new_tokens=N).stats.mat > 1.5  # its own answers: retrieval finds them
    # chat messages, raw text without the template, sampling with a seed
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
    assert engine.generate(messages, max_new_tokens=N).token_ids == _reference(store, loaded, "own@1", "rest", messages).token_ids
    raw = loaded.tokenizer(PROMPTS[0])["input_ids"]
    result = engine.generate(PROMPTS[0], template=False, max_new_tokens=N)
    assert result.prompt_ids == raw and result.token_ids == _reference(store, loaded, "own@1", "rest", raw).token_ids
    sampled = engine.generate(PROMPTS[2], method="pld", max_new_tokens=N, temperature=0.8, top_p=0.9, seed=5)
    assert sampled.token_ids == _reference(store, loaded, "own@1", "pld", PROMPTS[2], temperature=0.8, top_p=0.9, seed=5).token_ids
    assert set(result.to_dict()) >= {"text", "stats", "datastore", "reference", "method", "stop_reason"}


def test_engine_refuses_bad_methods_and_references(own):
    store, loaded, _ = own
    with pytest.raises(SpecstoreError, match="needs a datastore"):
        Engine(loaded, None, (), method="rest")
    with pytest.raises(SpecstoreError, match="unknown drafting method"):
        Engine(loaded, store, "own@1", method="nope")
    with pytest.raises(SpecstoreError, match="given twice"):
        Engine(loaded, store, "own,own")
    engine = Engine(loaded, None, (), method="pld")  # model-free methods need no store
    assert engine.generate(PROMPTS[0], max_new_tokens=4).datastore is None
    engine = Engine(loaded, store, "own@1")
    with pytest.raises(SpecstoreError, match="no datastore 'chat' is open"):
        engine.generate(PROMPTS[0], datastore="chat")
    assert engine.generate(PROMPTS[0], datastore="own", max_new_tokens=4).datastore == "own@1"


def test_tag_switches_between_requests_never_inside_one(own):
    store, loaded, _ = own
    engine = Engine(loaded, store, "own@prod", refresh_seconds=None)
    assert engine.datastores == {"own@prod": "own@1"}
    moved: list[dict] = []

    def move_tag_mid_request(text: str) -> None:
        if not moved:
            store.set_tag("own@2", "prod")
            moved.append(engine.refresh())  # from inside the request: applies to the next one

    try:
        result = engine.generate(PROMPTS[0], max_new_tokens=N, stream=move_tag_mid_request)
        assert moved == [{"own@prod": "own@1 -> own@2"}]
        assert result.datastore == "own@1" and result.reference == "own@prod"
        # the whole request drafted from version 1: the same steps as a run on version 1 alone
        assert result.stats.accepted_per_step == _reference(store, loaded, "own@1", "rest", PROMPTS[0]).stats.accepted_per_step
        assert engine.datastores == {"own@prod": "own@2"}
        after = engine.generate(PROMPTS[0], max_new_tokens=N)
        assert after.datastore == "own@2"
        assert after.stats.accepted_per_step == _reference(store, loaded, "own@2", "rest", PROMPTS[0]).stats.accepted_per_step
        assert engine.refresh() == {}
    finally:
        store.set_tag("own@1", "prod")


def test_tags_are_checked_at_most_every_refresh_seconds(own):
    store, loaded, _ = own
    now = [100.0]
    engine = Engine(loaded, store, "own@prod,own@1", refresh_seconds=5.0, clock=lambda: now[0])
    try:
        store.set_tag("own@2", "prod")
        now[0] += 4.9
        assert engine.generate(PROMPTS[0], datastore="own@prod", max_new_tokens=2).datastore == "own@1"  # not checked yet
        now[0] += 0.1
        assert engine.generate(PROMPTS[0], datastore="own@prod", max_new_tokens=2).datastore == "own@2"
        assert engine.generate(PROMPTS[0], datastore="own@1", max_new_tokens=2).datastore == "own@1"  # pinned
        # a version the engine cannot open (built for another model) is reported, the old one kept
        bad = loaded.info.model_copy(update={"tokenizer_hash": "0" * 64})
        docs = [loaded.tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]]
        version = write_datastore(store, "own", docs, model_hidden(loaded.model, docs), bad).version
        store.set_tag(f"own@{version}", "prod")
        assert engine.refresh() == {} and "tokenizer_hash" in engine.refresh_errors["own@prod"]
        assert engine.generate(PROMPTS[0], datastore="own@prod", max_new_tokens=2).datastore == "own@2"
    finally:
        store.set_tag("own@1", "prod")


def test_gc_of_the_version_in_use_while_serving(tmp_path):
    store, loaded, outputs = own_output_datastore(tmp_path, max_new_tokens=N)
    store.set_tag("own@1", "prod")
    docs = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    write_datastore(store, "own", docs, model_hidden(loaded.model, docs), loaded.info)
    v1 = store.resolve("own@1").manifest
    engine = Engine(loaded, store, "own@prod", method="dresd", refresh_seconds=None)  # dense rows and the suffix array
    removed: list = []

    def retag_and_collect(text: str) -> None:
        if not removed:
            store.set_tag("own@2", "prod")
            removed.append(collect(store, "own", keep=1, grace_seconds=0))

    result = engine.generate(PROMPTS[0], max_new_tokens=N, stream=retag_and_collect)
    assert removed[0].removed_versions == [1] and not store.files_dir("own", v1.build_id).exists()
    assert result.datastore == "own@1" and result.token_ids == outputs[PROMPTS[0]]
    # not refreshed yet: version 1 keeps serving from its mapped and loaded files, all methods
    for method in METHODS:
        again = engine.generate(PROMPTS[1], method=method, max_new_tokens=N)
        assert again.token_ids == outputs[PROMPTS[1]] and again.datastore in (None, "own@1")
    assert engine.refresh() == {"own@prod": "own@1 -> own@2"}
    assert engine.generate(PROMPTS[0], max_new_tokens=N).datastore == "own@2"


def test_requests_from_several_threads_run_one_at_a_time(own, monkeypatch):
    store, loaded, outputs = own
    engine = Engine(loaded, store, "own@1")
    active, peak, lock = [0], [0], threading.Lock()
    inner = engine_module.decode

    def counting(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return inner(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(engine_module, "decode", counting)
    results: dict[tuple[int, int], list[int]] = {}

    def client(i: int) -> None:
        for j in range(2):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            results[i, j] = engine.generate(prompt, method=METHODS[i], max_new_tokens=N).token_ids

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 8 and peak[0] == 1
    for (i, j), ids in results.items():
        assert ids == outputs[PROMPTS[(i + j) % len(PROMPTS)]]


def test_stream_iterator_and_cancellation(own):
    store, loaded, outputs = own
    engine = Engine(loaded, store, "own@1", method="pld")
    stream = engine.stream(PROMPTS[1], max_new_tokens=N)
    assert "".join(stream) == stream.result.text and stream.result.token_ids == outputs[PROMPTS[1]]
    with engine.stream(PROMPTS[0], method="ar", max_new_tokens=2000) as early:
        next(early)
    assert early.cancelled and early.result is None
    cancel = threading.Event()

    def stop_after_first(text: str) -> None:
        cancel.set()

    with pytest.raises(RequestCancelled):
        engine.generate(PROMPTS[0], method="ar", max_new_tokens=2000, stream=stop_after_first, cancel=cancel)
    with pytest.raises(RequestCancelled, match="before it started"):
        engine.generate(PROMPTS[0], cancel=cancel)
    assert engine.generate(PROMPTS[1], max_new_tokens=N).token_ids == outputs[PROMPTS[1]]  # still serving
    with pytest.raises(SpecstoreError, match="max_new_tokens must be >= 0"):
        list(engine.stream(PROMPTS[0], max_new_tokens=-1))
