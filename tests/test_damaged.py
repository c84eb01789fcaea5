"""A damaged datastore costs speed, never output or a crash (issue 12): with out-of-range entries
in the suffix array and out-of-vocabulary ids in the stream (file sizes and headers intact, so
the version still opens), rest, respec and pld decode exactly as ar in float32, no drafted id
outside the vocabulary reaches the verifier, and `specstore verify` names the damaged file."""

from __future__ import annotations

import numpy as np
import pytest

from specstore.runtime.api import generate
from specstore.runtime.cli import main
from specstore.runtime.datastore import Datastore
from specstore.runtime.drafters.registry import make_drafter
from specstore.runtime.retrieval import suffix_sample
from specstore.runtime.sharded_suffix import ShardedSuffixIndex
from specstore.runtime.suffix_array import SEPARATOR, SuffixIndex, build_suffix_array, join_documents
from specstore.runtime.tree import DraftTree, within_vocab
from specstore.runtime.verify import TreeVerifier
from tests.datastore_helpers import PROMPTS, own_output_datastore

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


def damage_suffix_array(sa: np.ndarray, n: int) -> None:
    """In place: every third entry out of range (past the end, huge, negative, most negative)."""
    bad = np.array([n, n + 7, INT32_MAX, -3, INT32_MIN, -1], dtype=np.int64)
    idx = np.arange(0, len(sa), 3)
    sa[idx] = bad[np.arange(len(idx)) % len(bad)].astype(sa.dtype)


def damage_stream(stream: np.ndarray, vocab: int) -> None:
    """In place: every fifth token an id no model takes (past the vocabulary, huge, negative)."""
    bad = np.array([vocab, vocab + 100, INT32_MAX, -7, INT32_MIN], dtype=np.int64)
    idx = np.arange(2, len(stream), 5)
    stream[idx] = bad[np.arange(len(idx)) % len(bad)].astype(stream.dtype)


def test_within_vocab_cuts_each_draft_at_its_first_bad_id():
    #          0   1    2   3    4   5
    tokens = [5, 99, 7, 8, -2, 9]
    parents = [-1, 0, 1, -1, 3, 4]  # 5 -> 99 -> 7 ; 8 -> -2 -> 9
    tree = DraftTree(np.array(tokens), np.array(parents), node_data={"score": np.arange(6.0)})
    cut = within_vocab(tree, 50)
    assert cut.tokens.tolist() == [5, 8] and cut.parents.tolist() == [-1, -1]
    assert cut.node_data["score"].tolist() == [0.0, 3.0]
    assert within_vocab(tree, None) is tree
    good = DraftTree.chain([1, 2, 3])
    assert within_vocab(good, 50) is good  # the common case: one vectorised check, no copy


@pytest.mark.parametrize("sharded", [False, True])
def test_suffix_reads_are_bounds_checked(sharded):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 20, size=int(rng.integers(5, 40))) for _ in range(30)]
    vocab = 20

    def index(part):
        stream, _ = join_documents(part)
        sa = build_suffix_array(stream)
        damage_suffix_array(sa, len(stream))
        damage_stream(stream, vocab)
        return SuffixIndex(stream, sa, vocab_size=vocab)

    idx = ShardedSuffixIndex([index(docs[:10]), index(docs[10:])]) if sharded else index(docs)
    for doc in docs:
        for end in range(2, len(doc)):
            sample = suffix_sample(idx, doc[:end].tolist(), 8, max_span=6, min_span=1, max_matches=16)
            if sample is None:
                continue
            rows = sample.rows
            assert ((rows == SEPARATOR) | ((rows >= 0) & (rows < vocab))).all()
            after = np.cumsum(rows == SEPARATOR, axis=1) > 0
            assert (rows[after] == SEPARATOR).all()  # a row ends at its first bad id
        assert np.all((idx.positions(doc[:2].tolist()) >= 0) & (idx.positions(doc[:2].tolist()) < len(idx)))


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    folder = tmp_path_factory.mktemp("damaged")
    store, loaded, ar = own_output_datastore(folder)
    record = store.resolve("own")
    files = store.files_dir("own", record.build_id)
    sizes = {n: (files / n).stat().st_size for n in ("stream.npy", "suffix_array.npy", "first_token_ranks.npy")}
    stream = np.load(files / "stream.npy", mmap_mode="r+")
    sa = np.load(files / "suffix_array.npy", mmap_mode="r+")
    ranks = np.load(files / "first_token_ranks.npy", mmap_mode="r+")
    damage_suffix_array(sa, len(stream))
    damage_stream(stream, loaded.info.vocab_size)
    # first-token ranks moved by one where the table stays plausible (from 0 to n, never falling),
    # so the runtime uses them: searches start from wrong intervals
    wide = np.flatnonzero(np.diff(ranks) > 1)
    wide = wide[wide >= 1][::3]  # the start of a block of 2+ suffixes, moved inside it
    ranks[wide] += 1
    assert wide.size > 5
    stream.flush()
    sa.flush()
    ranks.flush()
    del stream, sa, ranks
    assert {n: (files / n).stat().st_size for n in sizes} == sizes
    return store, loaded, ar


def test_damaged_datastore_decodes_exactly_as_ar(damaged, monkeypatch):
    store, loaded, ar = damaged
    vocab = loaded.info.vocab_size
    step = TreeVerifier.step
    seen = []

    def checked_step(self, pending, tree, acceptance=None):
        assert self.vocab_size == vocab
        assert len(tree) == 0 or (tree.tokens.min() >= 0 and tree.tokens.max() < vocab)
        seen.append(len(tree))
        return step(self, pending, tree, acceptance)

    monkeypatch.setattr(TreeVerifier, "step", checked_step)
    ds = Datastore.open(store, "own", loaded.info)  # sizes and headers are intact: it opens
    assert ds.suffix.first_ranks is not None  # the plausible damaged table is in use
    drafters = {
        "pld": "pld",
        "rest": make_drafter("rest", ds),
        "respec": make_drafter("respec", ds, entropy_threshold=100.0),
    }
    for name, drafter in drafters.items():
        for prompt in PROMPTS:
            seen.clear()
            out = generate(loaded.model, loaded.tokenizer, prompt, drafter, max_new_tokens=24)
            assert out.token_ids == ar[prompt], (name, prompt)
            assert seen  # it went through the checked verifier
    # the damage was read: some datastore drafts reached the verifier, cut before their bad ids
    out = generate(loaded.model, loaded.tokenizer, PROMPTS[0], drafters["rest"], max_new_tokens=24)
    assert out.stats.num_drafted > 0


def test_verify_names_the_damaged_files(damaged, capsys):
    store, _, _ = damaged
    capsys.readouterr()
    assert main(["verify", "--store", str(store.root), "--ref", "own"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fails its checksum" in err[0]
    assert any(name in err[0] for name in ("stream.npy", "suffix_array.npy", "first_token_ranks.npy"))
