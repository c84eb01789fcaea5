"""Progress bars of a build: each long stage's bar knows its total and ends exactly at it."""

from __future__ import annotations

import io
import json

import pytest
import tqdm

from specstore.pipelines.build import build
from specstore.pipelines.plan import single_process
from tests.helpers import make_tiny_model


class _Recorder(tqdm.tqdm):
    bars: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **(kwargs | {"file": io.StringIO()}))  # count, draw nowhere
        self.counted = 0
        _Recorder.bars.append(self)

    def update(self, n=1):
        self.counted += n
        return super().update(n)


def test_bars_have_totals_and_reach_them(tiny_model_dir, tmp_path, monkeypatch):
    corpus = tmp_path / "q.jsonl"
    rows = [{"turns": [f"Question number {i}, " + "and more " * i]} for i in range(7)] + [{"broken": True}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    monkeypatch.setattr(tqdm, "tqdm", _Recorder)
    _Recorder.bars = []
    result = build(tmp_path / "s", "p", [str(corpus)], model=tiny_model_dir, regenerate=True, max_new_tokens=5, pca_dims=4,
                   batch_tokens=128, progress=True)
    m = result.manifest
    bars = {b.desc: b for b in _Recorder.bars}
    assert set(bars) == {"prepare", "generate", "embed", "write"}
    assert (bars["prepare"].total, bars["prepare"].counted) == (9, 9)  # every record read, rejected ones too
    assert (bars["generate"].total, bars["generate"].counted) == (7, 7)
    for stage in ("embed", "write"):
        assert (bars[stage].total, bars[stage].counted) == (m.num_tokens, m.num_tokens), stage
    assert m.num_documents == 7 and m.num_rejected == 2


@pytest.mark.parametrize(("runner", "args", "single"), [
    ("DirectRunner", [], True),
    ("DirectRunner", ["--direct_running_mode=multi_processing", "--direct_num_workers=2"], False),
    ("DirectRunner", ["--direct_num_workers=2"], False),
    ("DataflowRunner", [], False),
])
def test_totals_only_where_one_process_runs_every_step(runner, args, single):
    assert single_process(runner, args) is single


def test_in_process_build_loads_the_model_once(tmp_path, monkeypatch):
    """The driver's model (loaded to check and fingerprint it) is the one the in-process workers
    use: one load per build, not two."""
    from specstore.runtime import models

    model_dir = str(make_tiny_model(tmp_path / "model"))  # its own folder: no cached load of a shared one to find
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"instruction": f"Say {i}.", "output": f"{i} " * (i + 2)}) + "\n" for i in range(6)))
    loads = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    first = build(tmp_path / "s", "once", [str(corpus)], model=model_dir, pca_dims=4, progress=False)
    assert len(loads) == 1 and first.manifest.num_documents == 6
    # the fingerprint is the one a separate load gives: an unchanged rebuild is recognised
    assert first.manifest.model == real(model_dir, dtype="float32").info
    assert build(tmp_path / "s", "once", [str(corpus)], model=model_dir, pca_dims=4, progress=False).unchanged
