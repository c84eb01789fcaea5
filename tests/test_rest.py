"""REST drafter: prefix counting into a token tree, suffix matching, edge cases."""

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specstore.runtime.api import generate
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.drafters.rest import RestConfig, RestDrafter, prefix_tree
from specstore.runtime.suffix_array import SEPARATOR, SuffixIndex, build_suffix_array, join_documents


def index_of(docs) -> SuffixIndex:
    stream, _ = join_documents(docs)
    return SuffixIndex(stream, build_suffix_array(stream))


def state(tokens, budget=10, num_prompt=None) -> DecodeState:
    return DecodeState(tokens=list(tokens), num_prompt=len(tokens) if num_prompt is None else num_prompt, budget=budget)


def tree_paths(tree) -> list[tuple[int, ...]]:
    return [tuple(int(tree.tokens[i]) for i in tree.path_to(n)) for n in range(len(tree))]


def prefix_counts(rows) -> Counter:
    counts = Counter()
    for row in rows:
        real = [int(t) for t in row]
        real = real[: real.index(SEPARATOR)] if SEPARATOR in real else real
        for d in range(1, len(real) + 1):
            counts[tuple(real[:d])] += 1
    return counts


rows_strategy = st.lists(st.lists(st.integers(-1, 3), min_size=4, max_size=4), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, max_nodes=st.integers(1, 12))
def test_prefix_tree_keeps_the_most_frequent_prefixes(rows, max_nodes):
    rows = np.array(rows)
    tree = prefix_tree(rows, max_nodes)
    counts = prefix_counts(rows)
    paths = tree_paths(tree)
    assert len(paths) == len(set(paths)) == min(max_nodes, len(counts))
    for path, count in zip(paths, tree.node_data["counts"], strict=True):
        assert counts[path] == count
        assert path[:-1] in set(paths) | {()}  # closed under prefixes
    if paths:  # nothing left out is more frequent than something kept
        assert max((c for p, c in counts.items() if p not in set(paths)), default=0) <= min(tree.node_data["counts"])
    # row order does not matter
    again = prefix_tree(rows[::-1], max_nodes)
    assert np.array_equal(again.tokens, tree.tokens) and np.array_equal(again.parents, tree.parents)


def test_prefix_tree_min_count_and_empty():
    rows = np.array([[1, 2, 3], [1, 2, 4], [5, -1, -1]])
    assert tree_paths(prefix_tree(rows, 64, min_count=2)) == [(1,), (1, 2)]
    assert len(prefix_tree(np.zeros((0, 3), dtype=np.int32), 64)) == 0
    assert len(prefix_tree(rows, 0)) == 0
    assert len(prefix_tree(np.full((2, 3), SEPARATOR), 64)) == 0


def test_rest_drafts_what_follows_the_pending_token():
    docs = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 8], [2, 3, 4, 5, 0]]
    drafter = RestDrafter(index_of(docs))
    tree = drafter.propose(state([0, 0, 2, 3, 4]))  # context ends "2 3 4" (pending token 4)
    assert drafter.last_match_len == 3 and tree.meta["num_matches"] == 3
    paths = tree_paths(tree)
    assert paths[0] == (5,)  # follows two of three matches: the most frequent first
    assert set(paths) == {(5,), (5, 6), (5, 0), (7,), (7, 8)}  # documents end: nothing crosses
    # the longest span wins over more frequent shorter ones
    tree = drafter.propose(state([9, 2, 3, 4]))
    assert drafter.last_match_len == 4 and tree_paths(tree) == [(7,), (7, 8)]


def test_rest_edge_cases():
    drafter = RestDrafter(index_of([[1, 2, 3, 4]]))  # a datastore of one document
    assert tree_paths(drafter.propose(state([1, 2]))) == [(3,), (3, 4)]
    assert len(drafter.propose(state([7, 8, 9]))) == 0  # no match
    assert len(drafter.propose(state([3]))) == 0  # context shorter than min_span
    assert len(drafter.propose(state([3, 4]))) == 0  # match at a document end: nothing follows
    assert len(drafter.propose(state([1, 2], budget=0))) == 0
    assert tree_paths(drafter.propose(state([1, 2], budget=1))) == [(3,)]
    empty = RestDrafter(index_of([]))
    assert len(empty.propose(state([1, 2]))) == 0


def test_rest_caps_nodes_and_matches_deterministically():
    rng = np.random.default_rng(0)
    docs = [[5, 6] + list(rng.integers(0, 4, size=8)) for _ in range(500)]
    drafter = RestDrafter(index_of(docs), RestConfig(max_nodes=16, max_matches=100))
    tree = drafter.propose(state([5, 6]))
    assert len(tree) == 16 and tree.meta["num_matches"] == 500
    assert sum(tree.node_data["counts"][tree.parents == -1]) <= 100  # only the sample was counted
    again = drafter.propose(state([5, 6]))
    assert np.array_equal(tree.tokens, again.tokens) and np.array_equal(tree.parents, again.parents)


def test_rest_greedy_output_is_identical_to_ar_and_accepts(own_output_store):
    store, loaded, ar = own_output_store
    drafter = make_drafter("rest", Datastore.open(store, "own", loaded.info, dense=False))
    mats = []
    for prompt, expected in ar.items():
        result = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=len(expected))
        assert result.token_ids == expected
        mats.append(result.stats.mat)
    assert min(mats) > 1.5  # the datastore holds these very answers


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, 49151), min_size=1, max_size=12))
def test_rest_matches_ar_on_random_prompts(own_output_store, prompt):
    store, loaded, _ = own_output_store
    drafter = make_drafter("rest", Datastore.open(store, "own", loaded.info, dense=False))
    ar = generate(loaded.model, loaded.tokenizer, prompt, "ar", max_new_tokens=16)
    assert generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=16).token_ids == ar.token_ids
