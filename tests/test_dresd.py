"""DReSD drafter: the live query finds its own datastore position; the next-token filter; caps."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specstore.runtime.api import generate
from specstore.runtime.datastore import Datastore
from specstore.runtime.dense import DenseIndex
from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.drafters.dresd import DresdDrafter
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.forward import hidden_states
from tests.datastore_helpers import stream_continuations, tiny_datastore


@pytest.fixture(scope="module")
def code_datastore(tiny_store):
    """The module's ``tiny_store`` opened: ``(datastore, loaded, docs)`` with ``docs[doc_id]`` its token ids."""
    store, loaded, manifest = tiny_store
    ds = Datastore.open(store, "code", loaded.info)
    docs = {}
    for row in store.open_table(manifest.tokens_table).to_arrow().to_pylist():
        docs.setdefault(row["doc_id"], []).append(row["token_id"])
    return ds, loaded, docs


def live_state(model, tokens, budget=20) -> DecodeState:
    """What the decode loop hands a drafter: the hidden state at tokens[-2]; tokens[-1] is pending."""
    hidden = hidden_states(model, torch.tensor([tokens[:-1]]))[0, -1]
    return DecodeState(tokens=list(tokens), num_prompt=len(tokens), last_hidden=hidden, budget=budget)


def paths(tree) -> list[list[int]]:
    return [[int(tree.tokens[i]) for i in tree.path_to(n)] for n in range(len(tree))]


def test_query_finds_its_own_position_and_drafts_what_follows(code_datastore):
    ds, loaded, docs = code_datastore
    drafter = DresdDrafter.from_datastore(ds)
    doc = docs[0]
    for p in (3, 8, 15):
        tokens = doc[: p + 2]  # pending token doc[p + 1]; query = hidden state at doc[p]
        tree = drafter.propose(live_state(loaded.model, tokens))
        first = [int(tree.tokens[i]) for i in tree.paths[0]]
        assert first == doc[p + 2 : p + 2 + 9]
        assert 1 <= tree.meta["num_neighbours"] <= 10 and len(tree) <= 64


def test_every_neighbour_agrees_with_the_pending_token(code_datastore):
    ds, loaded, docs = code_datastore
    drafter = DresdDrafter.from_datastore(ds, k=50, max_nodes=1000)
    tokens = docs[1][:6]
    state = live_state(loaded.model, tokens)
    found = ds.dense.search(ds.normaliser.apply_torch(state.last_hidden), 50, next_token=tokens[-1])
    conts = stream_continuations(ds)  # indexed by the compact index's row ids, stream positions
    assert len(found) == int((conts[:, 0] == tokens[-1]).sum())
    tree = drafter.propose(state)
    assert tree.meta["num_neighbours"] == len(found)
    expected = [conts[r, 1:10] for r in found.rows]
    expected = [[int(t) for t in e if t >= 0] for e in expected]
    for path, nodes in zip([e for e in expected if e], tree.paths, strict=True):
        assert [int(tree.tokens[i]) for i in nodes] == path


def test_edge_cases(code_datastore):
    ds, loaded, docs = code_datastore
    drafter = DresdDrafter.from_datastore(ds, max_nodes=5)
    state = live_state(loaded.model, docs[0][:6])
    assert len(drafter.propose(state)) == 5  # node cap
    state.budget = 2
    assert max(len(p) for p in paths(drafter.propose(state))) == 2  # depth capped by the budget
    state.budget = 0
    assert len(drafter.propose(state)) == 0
    assert len(drafter.propose(DecodeState(tokens=docs[0][:6], num_prompt=6, budget=9))) == 0  # no hidden state
    absent = next(t for t in range(1000) if t not in stream_continuations(ds)[:, 0])
    state = live_state(loaded.model, docs[0][:5] + [absent])
    assert len(drafter.propose(state)) == 0  # no datastore position is followed by the pending token
    last = docs[3][-2:]  # the document's end: the only neighbour may have nothing after it
    tree = drafter.propose(live_state(loaded.model, docs[3][:-2] + last))
    assert all(t >= 0 for t in tree.tokens)


def test_continuations_must_align_with_the_index(code_datastore):
    ds, _, _ = code_datastore
    index = DenseIndex(np.eye(3, 8, dtype=np.float32), np.arange(3))  # an old-form index: continuation rows beside it
    with pytest.raises(ValueError, match="rows but continuations"):
        DresdDrafter(ds.normaliser, index, np.zeros((2, 10), dtype=np.int32))


def test_dresd_greedy_output_is_identical_to_ar_and_accepts(own_output_store):
    store, loaded, ar = own_output_store
    drafter = make_drafter("dresd", Datastore.open(store, "own", loaded.info))
    mats = []
    for prompt, expected in ar.items():
        result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=len(expected))
        assert result.token_ids == expected
        mats.append(result.stats.mat)
    assert min(mats) > 1.5


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, 49151), min_size=1, max_size=12))
def test_dresd_matches_ar_on_random_prompts(own_output_store, prompt):
    store, loaded, _ = own_output_store
    drafter = make_drafter("dresd", Datastore.open(store, "own", loaded.info))
    ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=16)
    assert generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=16).token_ids == ar.token_ids


def test_datastore_of_one_document_and_no_match(tmp_path):
    store, loaded, _ = tiny_datastore(tmp_path, name="one", texts=["def add(a, b):\n    return a + b\n"])
    ds = Datastore.open(store, "one", loaded.info)
    for prompt in ("def add(a, b):", "zzz"):
        ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=12).token_ids
        for method in ("rest", "dresd"):
            assert generate(loaded.model, loaded.tokenizer, prompt, make_drafter(method, ds), max_new_tokens=12).token_ids == ar


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**31 - 1), st.sampled_from([3, 40, 70]))
def test_exact_block_search_is_the_brute_force_top_k_ties_by_row(k, seed, rows_per_chunk):
    """The exact scan (chunked products, torch's top-k then a tie-ordered cut) returns what a
    full sort does: best score first, equal scores by row, whatever the chunking."""
    import specstore.runtime.dense as dense

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200))
    codes = rng.integers(-3, 4, size=(n, 4)).astype(np.int8)  # few distinct values: many exact ties
    scales = np.ones(4, np.float32)
    index = DenseIndex.from_blocks(codes, scales, np.arange(n, dtype=np.int64) * 7, {5: (0, n)})
    query = rng.integers(-2, 3, size=4).astype(np.float32)
    old, dense.SCAN_CHUNK = dense.SCAN_CHUNK, rows_per_chunk
    try:
        found = index.search(torch.from_numpy(query), k, next_token=5)
    finally:
        dense.SCAN_CHUNK = old
    scores = codes.astype(np.float64) @ query
    order = np.lexsort((np.arange(n), -scores))[: min(k, n)]
    assert found.rows.tolist() == (order * 7).tolist()
    assert np.array_equal(found.scores, scores[order].astype(np.float32))
