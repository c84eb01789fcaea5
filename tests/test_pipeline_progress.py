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


def test_lines_for_a_log_file(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Where stderr is no terminal (the CLI passes progress="lines"), each stage writes plain
    lines instead of bars (no carriage returns): along the way and at its end, with the total."""
    from specstore.pipelines import workers

    monkeypatch.setattr(workers, "LINE_INTERVAL_S", 0.0)  # a line on every update, as if each took a minute
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"instruction": f"Say {i}.", "output": "word " * (i + 3)}) + "\n" for i in range(6)))
    m = build(tmp_path / "s", "lines", [str(corpus)], model=tiny_model_dir, pca_dims=4, batch_tokens=64,
              progress="lines").manifest
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if line.startswith(("prepare:", "embed:", "write:"))]
    assert lines and not any("\r" in line for line in lines)
    assert f"embed: {m.num_tokens:,}/{m.num_tokens:,} tok (100%)" in "\n".join(lines)
    assert f"write: {m.num_tokens:,}/{m.num_tokens:,} tok (100%)" in "\n".join(lines)
    assert sum(line.startswith("embed:") for line in lines) >= 2  # progress along the way, not only the end
    assert any("min left" in line for line in lines if line.startswith("embed:"))


def test_line_progress_reports_rate_and_time_left(monkeypatch):
    import io

    from specstore.pipelines import workers

    clock = iter([0.0, 30.0, 61.0, 90.0, 125.0])
    monkeypatch.setattr(workers.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    bar = workers.LineProgress("embed", 1000, "tok", stream=out)  # starts at 0 s
    bar.update(100)  # 30 s: under the interval, no line
    bar.update(400)  # 61 s: a line
    bar.update(100)  # 90 s: 29 s after the last line, none
    bar.close()  # 125 s: the end line
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("embed: 500/1,000 tok (50%), 8 tok/s, 1.0 min, about 1 min left")
    assert lines[1].startswith("embed: 600/1,000 tok (60%)")
