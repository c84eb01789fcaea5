"""The served overlay: bounded, evicting the oldest requests (exact token counts), searched like a
suffix array (checked against a brute-force search, through eviction and compaction); drafters
that read it (rest pooled with the datastore, pld beside the context, respec's pool); an engine
with the overlay on stays identical to ar in float32 and drafts from what it served the second
time a prompt comes; ``specstore serve --overlay on`` reaches the engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specstore.runtime import Engine, RequestCancelled
from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.drafters.respec_pool import CandidatePool, PoolConfig
from specstore.runtime.drafters.rest import RestDrafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.overlay import ServedOverlay, overlay_flags
from specstore.runtime.retrieval import SuffixSample, pooled_sample, suffix_sample
from specstore.runtime.suffix_array import SEPARATOR, SuffixIndex, build_suffix_array, join_documents
from tests.datastore_helpers import PROMPTS

N = 24


# --- the store --------------------------------------------------------------------------------


def test_bounded_and_evicting_the_oldest_requests_first():
    overlay = ServedOverlay(max_tokens=10)
    assert overlay.add([1, 2, 3, 4]) == 1 and overlay.add([5, 6, 7]) == 2
    assert overlay.num_tokens == 7 and overlay.request_ids() == [1, 2]
    assert overlay.add([8, 9, 10, 11]) == 3  # 11 tokens would not fit: request 1 goes, whole
    assert overlay.num_tokens == 7 and overlay.request_ids() == [2, 3] and overlay.num_evicted == 1
    assert overlay.documents() == [[5, 6, 7], [8, 9, 10, 11]]
    assert overlay.add([12, 13, 14]) == 4  # exactly 10: nothing evicted
    assert overlay.num_tokens == 10 and overlay.request_ids() == [2, 3, 4]
    overlay.add(list(range(20, 30)))  # a full-size request evicts everything before it
    assert overlay.num_tokens == 10 and overlay.request_ids() == [5] and overlay.num_evicted == 4
    assert overlay.documents() == [list(range(20, 30))]
    assert overlay.add([]) is None and overlay.num_added == 5  # nothing to hold
    # a request larger than the bound keeps its response's head, its prompt dropped
    big = ServedOverlay(max_tokens=5, prompts=True)
    big.add(list(range(100, 108)), prompt=[1, 2, 3])
    assert big.documents() == [[100, 101, 102, 103, 104]] and big.num_tokens == 5
    # prompts are held only when asked for; a request counts both
    with_prompts, without = ServedOverlay(max_tokens=9, prompts=True), ServedOverlay(max_tokens=9)
    for overlay in (with_prompts, without):
        overlay.add([3, 4, 5], prompt=[1, 2])
        overlay.add([8, 9], prompt=[6, 7])
    assert with_prompts.documents() == [[1, 2], [3, 4, 5], [6, 7], [8, 9]] and with_prompts.num_tokens == 9
    assert without.documents() == [[3, 4, 5], [8, 9]] and without.num_tokens == 5
    with_prompts.add([10], prompt=[11])  # 11 tokens: the oldest request (5 tokens) goes
    assert with_prompts.documents() == [[6, 7], [8, 9], [11], [10]] and with_prompts.num_tokens == 6
    with pytest.raises(ValueError, match="max_tokens"):
        ServedOverlay(max_tokens=0)


def _brute(docs: list[list[int]], context: list[int], max_len: int):
    """Longest context suffix (2..max_len) occurring in a document with a token after it, and the
    set of continuations (``length`` 4) after its occurrences."""
    for n in range(min(max_len, len(context)), 1, -1):
        tail = context[-n:]
        found = [tuple(d[i : i + 4]) for d in docs for i in range(n, len(d)) if d[i - n : i] == tail]
        if found:
            return n, sorted(found)
    return 0, []


def _rows(rows: np.ndarray) -> list[tuple]:
    return sorted(tuple(int(t) for t in r if t != SEPARATOR) for r in rows)


def test_search_equals_brute_force_through_eviction_and_compaction():
    rng = np.random.default_rng(0)
    overlay = ServedOverlay(max_tokens=400)
    for request in range(300):  # ~9000 tokens through a 400-token bound: eviction and compaction happen
        overlay.add(rng.integers(0, 6, int(rng.integers(1, 60))).tolist(), prompt=[1, 2])
        if request % 37:
            continue
        docs = overlay.documents()
        assert overlay.num_tokens == sum(map(len, docs)) <= 400
        for _ in range(20):
            context = rng.integers(0, 6, 12).tolist()
            length, expected = _brute(docs, context, 8)
            match = overlay.longest_suffix_match(context, 8, 2)
            if not expected:
                assert match is None
                continue
            assert match.length == length and match.count == len(expected)
            rows, offsets = overlay.continuations(match, 4, return_offsets=True)
            assert rows.dtype == np.int32 and rows.shape == (len(expected), 4)
            assert _rows(rows) == sorted(tuple(e) for e in expected)
            assert rows.tolist() == sorted(rows.tolist())  # rows sorted (SEPARATOR first)
            assert offsets.shape == (len(expected),)
            sample = overlay.continuations(match, 4, 3, spread=True)
            assert len(sample) == min(3, len(expected))
    assert overlay.num_evicted > 200 and overlay._base > 0  # compacted at least once


def test_search_agrees_with_the_suffix_array_on_real_text():
    """Same documents in a SuffixIndex: same longest match and the same drafts (the suffix array
    also counts an occurrence that ends its document, which the overlay leaves out)."""
    from tests.helpers import default_tokenizer

    tok = default_tokenizer()
    texts = ["def add(a, b):\n    return a + b\n", "def mul(a, b):\n    return a * b\n", "for x in range(10):\n    print(x)\n"]
    docs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    overlay = ServedOverlay()
    for d in docs:
        overlay.add(d)
    stream, _ = join_documents(docs)
    index = SuffixIndex(stream, build_suffix_array(stream))
    context = tok("x = 3\ndef sub(a, b):\n    return a", add_special_tokens=False)["input_ids"]
    ours = suffix_sample(overlay, context, 6, max_span=16, min_span=2, max_matches=100)
    theirs = suffix_sample(index, context, 6, max_span=16, min_span=2, max_matches=100)
    assert ours.match_length == theirs.match_length >= 3
    assert _rows(ours.rows) == _rows(theirs.rows[(theirs.rows != SEPARATOR).any(axis=1)])


# --- drafters ---------------------------------------------------------------------------------


def test_pooled_sample_prefers_the_longer_match_and_weighs_ties_equally():
    rows = lambda *r: np.array(r, dtype=np.int32)  # noqa: E731
    found = SuffixSample(3, 4, rows([1, 2], [1, 2], [1, 2], [5, 6]), np.arange(4))
    served = SuffixSample(3, 1, rows([7, 8]), np.array([90]))
    pooled, served_rows = pooled_sample(found, served)
    assert pooled.rows.tolist().count([7, 8]) == 4 and len(pooled.rows) == 8 and served_rows.tolist() == [[7, 8]]
    longer = SuffixSample(5, 1, rows([7, 8]), np.array([90]))
    assert pooled_sample(found, longer) == (longer, longer.rows)
    assert pooled_sample(found, None) == (found, None) and pooled_sample(None, served)[0] is served
    shorter = SuffixSample(2, 1, rows([7, 8]), np.array([90]))
    assert pooled_sample(found, shorter) == (found, None)


def test_rest_pld_and_respec_draft_a_continuation_served_earlier():
    served = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    overlay = ServedOverlay()
    overlay.add(served)
    datastore_stream, _ = join_documents([[1, 2, 3, 4, 5, 6, 7]])
    index = SuffixIndex(datastore_stream, build_suffix_array(datastore_stream))
    state = DecodeState(tokens=[9, 9, 41, 42, 43], num_prompt=2, budget=16)
    # rest: the overlay's longer match wins, and its nodes are marked
    rest = RestDrafter(index, overlay=overlay)
    tree = rest.propose(state)
    assert tree.tokens.tolist()[:6] == served[4:10] and tree.node_data["overlay"].all()
    assert RestDrafter(index).propose(state).tokens.size == 0  # the datastore alone has nothing
    # pld: the context has no match, the overlay has
    pld = make_drafter("pld", overlay=overlay)
    assert pld.propose(state).tokens.tolist() == served[4:10]
    assert make_drafter("pld").propose(state).tokens.size == 0
    # respec's pool: an overlay candidate with its own key
    pool = CandidatePool(None, PoolConfig(), overlay)
    [candidate] = [c for c in pool.gather(state, 4) if c.source == "overlay"]
    assert candidate.tokens == served[4:8] and candidate.key == ("overlay", 4 - len(state.tokens))
    # flags of a tree against rows
    flags = overlay_flags(np.array([44, 45, 7]), np.array([-1, 0, -1]), np.array([[44, 45, SEPARATOR]]))
    assert flags.tolist() == [True, True, False]


# --- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def code(tiny_store):
    """The tiny model and a datastore of unrelated texts (``code@1``), and its ar outputs."""
    store, loaded, _ = tiny_store
    ar = Engine(loaded, None, (), method="ar")
    return store, loaded, {p: ar.generate(p, max_new_tokens=N).token_ids for p in PROMPTS}


@pytest.mark.parametrize("method", ["rest", "pld", "respec"])
def test_overlay_on_is_identical_to_ar_and_drafts_the_second_time(code, method):
    store, loaded, outputs = code
    # respec retrieves only under its entropy threshold: the tiny random model is never that sure
    options = {"drafter_options": {"respec": {"entropy_threshold": float("inf")}}} if method == "respec" else {}
    on = Engine(loaded, store, "code@1", method=method, overlay=True, **options)
    off = Engine(loaded, store, "code@1", method=method, **options)
    for engine in (on, off):
        for _round in range(2):
            for prompt in PROMPTS:
                assert engine.generate(prompt, max_new_tokens=N).token_ids == outputs[prompt], (method, prompt)
    assert off.overlay is None and on.overlay.num_requests == len(PROMPTS) * 2
    prompt = PROMPTS[0]
    first_on = Engine(loaded, store, "code@1", method=method, overlay=True, **options).generate(prompt, max_new_tokens=N)
    again_on, again_off = on.generate(prompt, max_new_tokens=N), off.generate(prompt, max_new_tokens=N)
    assert again_on.token_ids == again_off.token_ids == outputs[prompt]
    assert first_on.overlay == {"steps": 0, "drafted": 0, "accepted": 0}  # an empty overlay drafts nothing
    assert again_off.overlay is None
    assert again_on.overlay["accepted"] >= N // 2, again_on.overlay  # the served answer, drafted back
    assert again_on.stats.mat > again_off.stats.mat
    assert first_on.stats.accepted_per_step == again_off.stats.accepted_per_step  # an empty overlay changes nothing


def test_engine_overlay_options(code):
    store, loaded, outputs = code
    overlay = ServedOverlay(prompts=True)
    engine = Engine(loaded, store, "code@1", method="rest", overlay=overlay)
    assert engine.overlay is overlay
    first = engine.generate(PROMPTS[0], max_new_tokens=N)
    assert overlay.documents() == [first.prompt_ids, first.token_ids]  # prompts too, when asked
    # a small bound: a request larger than it keeps its response; the next evicts it
    small = ServedOverlay(max_tokens=N + 2, prompts=True)
    engine = Engine(loaded, store, "code@1", method="rest", overlay=small)
    engine.generate(PROMPTS[0], max_new_tokens=N)
    assert small.documents() == [outputs[PROMPTS[0]]] and small.num_tokens == N
    engine.generate(PROMPTS[1], max_new_tokens=N)
    assert small.documents() == [outputs[PROMPTS[1]]] and small.request_ids() == [2]
    # ar and dresd read no overlay: they decode as always
    assert engine.generate(PROMPTS[2], method="ar", max_new_tokens=N).overlay is None
    with pytest.raises(SpecstoreError, match="overlay must be"):
        Engine(loaded, store, "code@1", overlay="yes")
    # a cancelled request is not added
    cancel = threading.Event()
    cancel.set()
    before = small.num_added
    with pytest.raises(RequestCancelled):
        engine.generate(PROMPTS[0], cancel=cancel)
    assert small.num_added == before


# --- the real model ---------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_default_model_overlay_on_identical_to_ar_float32(tmp_path):
    """The real default model in float32 over a small code datastore of real text: rest, pld and
    respec with the overlay on decode exactly what ar decodes, and a repeated prompt is drafted
    from the overlay."""
    from specstore.runtime.models import load_model
    from specstore.runtime.store import Store
    from tests.datastore_helpers import CODE_RECORDS, model_hidden, write_datastore

    loaded = load_model(None, dtype="float32", device="cpu")
    docs = [loaded.tokenizer(r["instruction"] + "\n" + r["output"], add_special_tokens=False)["input_ids"] for r in CODE_RECORDS]
    store = Store(tmp_path / "store", create=True)
    write_datastore(store, "code", docs, model_hidden(loaded.model, docs), loaded.info)
    prompts = ["Write a Python function that reverses a string.", "Write a Python function that counts the vowels in a string.",
               "Write a Python function that reverses a string."]
    ar = Engine(loaded, None, (), method="ar")
    expected = [ar.generate(p, max_new_tokens=48).token_ids for p in prompts]
    for method in ("rest", "pld", "respec"):
        engine = Engine(loaded, store, "code@1", method=method, overlay=True)
        results = [engine.generate(p, max_new_tokens=48) for p in prompts]
        assert [r.token_ids for r in results] == expected, method
        assert results[2].overlay["accepted"] > 0 and results[2].stats.mat > results[0].stats.mat, method


# --- the serve command --------------------------------------------------------------------------


def _http(url: str, path: str, body: dict | None = None) -> dict:
    import json
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_serve_overlay_on_reaches_the_engine(code, monkeypatch, capsys):
    """``specstore serve --overlay on`` (the default): the command's engine holds an overlay of the
    asked size (shown by /health), a served request lands in it, and the response says what it
    drafted; ``--overlay off`` has none."""
    from specstore.runtime import serve
    from specstore.runtime.cli import main

    store, loaded, outputs = code
    seen = {}

    class Server:  # stands in for the command's server: serves on a free port on a thread, asks, and returns
        def __init__(self, app):
            self.app = app

        def run(self) -> None:
            with serve.ServerThread(self.app) as server:
                seen["before"] = _http(server.url, "/health")["overlay"]
                for _ in range(2):
                    seen["reply"] = _http(server.url, "/v1/chat/completions", {
                        "model": "model", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": N})
                seen["after"] = _http(server.url, "/health")["overlay"]

    real = serve.uvicorn_server
    monkeypatch.setattr(serve, "uvicorn_server",  # port 0 is ServerThread's own call
                        lambda app, host, port, log_level="info": real(app, host, port, log_level) if port == 0 else Server(app))
    argv = ["serve", "--store", str(store.root), "--datastore", "code@1", "--model", str(store.root.parent / "model"),
            "--dtype", "float32", "--device", "cpu", "--method", "rest"]
    assert main([*argv, "--overlay", "on", "--overlay-tokens", "5000", "--overlay-prompts"]) == 0
    assert "overlay on (5000 tokens, prompts too)" in capsys.readouterr().err
    assert seen["before"] == {"tokens": 0, "max_tokens": 5000, "requests": 0, "added": 0, "evicted": 0, "prompts": True}
    assert seen["after"]["requests"] == 2 and seen["after"]["tokens"] > 2 * N
    vendor = seen["reply"]["specstore"]
    assert vendor["overlay"]["accepted"] > 0 and seen["reply"]["choices"][0]["message"]["content"] == (
        loaded.tokenizer.decode(outputs[PROMPTS[0]], skip_special_tokens=True))
    seen.clear()
    assert main(argv) == 0  # on by default, at the default size, responses only
    assert seen["before"] == {"tokens": 0, "max_tokens": 65536, "requests": 0, "added": 0, "evicted": 0, "prompts": False}
    assert seen["reply"]["specstore"]["overlay"] is not None
    seen.clear()
    assert main([*argv, "--overlay", "off"]) == 0
    assert seen["before"] is None and seen["reply"]["specstore"]["overlay"] is None
    assert main([*argv, "--overlay", "off", "--overlay-tokens", "10"]) == 2
    assert "specstore: error: --overlay-tokens and --overlay-prompts need --overlay on" in capsys.readouterr().err
