"""The SuffixDecoding reference drafter (optional extra ``arctic-inference``): it sees the
datastore's documents split exactly at their separators, drafts what follows the context in
them or in the request so far, and decodes identically to ar in float32 (it is lossless)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specstore.runtime.drafters.base import DecodeState
from specstore.runtime.drafters.suffixdecoding import datastore_documents
from specstore.runtime.sharded_suffix import ShardedSuffixIndex
from specstore.runtime.suffix_array import SuffixIndex, build_suffix_array, join_documents


def _index(docs) -> SuffixIndex:
    stream, _ = join_documents([np.asarray(d, dtype=np.int32) for d in docs])
    return SuffixIndex(stream, build_suffix_array(stream))


def test_documents_come_back_whole_from_one_or_many_shards():
    docs = [[1, 2, 3], [4], [5, 6, 7, 8], [0, 0]]
    for suffix in (_index(docs), ShardedSuffixIndex([_index(docs[:1]), _index(docs[1:3]), _index(docs[3:])])):
        got = datastore_documents(SimpleNamespace(suffix=suffix))
        assert [d.tolist() for d in got] == docs


def test_drafts_from_the_datastore_and_the_request():
    pytest.importorskip("arctic_inference.suffix_decoding")
    from specstore.runtime.drafters.suffixdecoding import SuffixDecodingDrafter

    drafter = SuffixDecodingDrafter(SimpleNamespace(suffix=_index([[10, 11, 12, 13, 14, 15]])), max_spec_tokens=3,
                                    max_spec_factor=4.0)
    drafter.reset([1, 2, 3])
    tree = drafter.propose(DecodeState(tokens=[1, 2, 3, 10, 11], num_prompt=3, budget=10))
    assert tree.tokens.tolist() == [12, 13, 14] and tree.parents.tolist() == [-1, 0, 1]  # max_spec_tokens caps it
    assert len(drafter.propose(DecodeState(tokens=[1, 2, 3, 10, 11], num_prompt=3, budget=0))) == 0
    drafter.reset([7, 8, 9, 7, 8])  # the prompt itself is searched too
    tree = drafter.propose(DecodeState(tokens=[7, 8, 9, 7, 8], num_prompt=5, budget=1))
    assert tree.tokens.tolist() == [9]


def test_identical_to_ar_in_float32(tmp_path):
    pytest.importorskip("arctic_inference.suffix_decoding")
    from specstore.runtime.api import generate
    from specstore.runtime.datastore import Datastore
    from specstore.runtime.drafters.registry import make_drafter
    from tests.datastore_helpers import PROMPTS, own_output_datastore

    store, loaded, outputs = own_output_datastore(tmp_path)
    ds = Datastore.open(store, "own", loaded.info, dense=False)
    drafter = make_drafter("suffixdecoding", ds)
    mats = []
    for prompt in PROMPTS:
        result = generate(loaded.model, loaded.tokenizer, prompt, drafter, 24)
        assert result.token_ids == outputs[prompt]
        mats.append(result.stats.mat)
    assert max(mats) > 1.5  # the model's own answers are in the datastore: drafts get accepted
