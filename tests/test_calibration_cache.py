"""Calibrations kept between processes (runtime/calibration_cache.py): keys, the carry, files
that are not tables, the engine loading and saving them, and `generate --calibration`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from specstore.runtime import Engine
from specstore.runtime.calibration_cache import (
    CARRY,
    SIGNALS_REVISION,
    CalibrationCache,
    calibration_key,
    carried,
    default_root,
    valid_table,
)
from specstore.runtime.cli import main
from specstore.runtime.cost import CostModel
from specstore.runtime.drafters.cost_aware import Calibrator
from specstore.runtime.models import load_model

COST = CostModel([0, 1, 8, 64], [0], [[0.01, 0.0105, 0.013, 0.03]], {"test": True}, online=False)
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):"


def _counted() -> Calibrator:
    cal = Calibrator()
    cal.add(3, 1, 500.0, 400.0)  # past the carry: scaled down
    cal.add(3, 2, 100.0, 10.0)
    cal.add(7, 1, 20.0, 5.0)  # below it: kept as is
    return cal


def test_key_names_everything_the_counts_depend_on():
    base = calibration_key("abc", "float32", "rest", {"max_nodes": 8}, ["code", "chat", "code"])
    assert base["datastores"] == ["chat", "code"] and base["signals"] == SIGNALS_REVISION
    cache = CalibrationCache("/tmp/x")
    others = [calibration_key("abd", "float32", "rest", {"max_nodes": 8}, ["code", "chat"]),
              calibration_key("abc", "bfloat16", "rest", {"max_nodes": 8}, ["code", "chat"]),
              calibration_key("abc", "float32", "dresd", {"max_nodes": 8}, ["code", "chat"]),
              calibration_key("abc", "float32", "rest", {"max_nodes": 9}, ["code", "chat"]),
              calibration_key("abc", "float32", "rest", {"max_nodes": 8}, ["code"])]
    paths = {cache.path(k) for k in others}
    assert len(paths) == len(others) and cache.path(base) not in paths
    # the order of datastores and options does not matter; paths and objects become plain values
    same = calibration_key("abc", "float32", "rest", {"max_nodes": 8}, ["chat", "code"])
    assert cache.path(same) == cache.path(base)
    key = calibration_key("m", "float32", "respec", {"head": Path("/h.safetensors"), "o": object(), "t": (1, 2)})
    assert key["options"] == {"head": "/h.safetensors", "o": "object", "t": [1, 2]}
    json.dumps(key)


def test_carry_scales_each_bucket_down_and_keeps_its_rates():
    cal = _counted()
    out = carried(cal.table, 200.0)
    assert out is not cal.table and cal.table[3, 16] == 600.0  # the original is untouched
    assert out[3, 16] == pytest.approx(200.0) and out[3, 17] == pytest.approx(200.0 * 410 / 600)
    assert out[3, 0] / out[3, 8] == pytest.approx(500 / 400) and out[3, 1] == pytest.approx(100 * 200 / 600)
    np.testing.assert_array_equal(out[7], cal.table[7])  # 20 trials: below the carry
    np.testing.assert_array_equal(carried(cal.table, 1e9), cal.table)
    assert CARRY > 0


@pytest.mark.parametrize("table, ok", [
    (np.zeros((4, 18)), True),
    (np.zeros((4, 17)), False),
    (np.zeros(18), False),
    (np.zeros((0, 18)), False),
    ([[float("nan")] * 18], False),
    ([[-1.0] + [0.0] * 17], False),
    ([[1.0] + [0.0] * 7 + [2.0] + [0.0] * 9], False),  # more accepted than tried
    ("not a table", False),
])
def test_valid_table(table, ok):
    assert valid_table(table) is ok


def test_save_then_load_carries_the_counts(tmp_path):
    cache, key = CalibrationCache(tmp_path / "cal"), calibration_key("m", "float32", "pld")
    source = _counted()
    path = cache.save(key, source)
    saved = json.loads(path.read_text())
    assert saved["key"] == key and len(saved["table"]) == 8  # rows up to the last bucket counted
    fresh = Calibrator()
    assert cache.load(key, fresh)
    expected = carried(source.table)
    np.testing.assert_allclose(fresh.table[:8], expected[:8])
    assert len(fresh.table) == 64 and not fresh.table[8:].any()
    assert fresh.rate(3, 1) == pytest.approx(0.8) and fresh.rate(7, 1) == pytest.approx(0.25)
    # another key, no file, a broken file, a file that is not counts: False, the calibrator untouched
    other = Calibrator()
    assert not cache.load(calibration_key("m", "float32", "rest"), other) and not other.table.any()
    path.write_text("{broken")
    assert not cache.load(key, other) and not other.table.any()
    path.write_text(json.dumps({"key": key, "table": [[1.0] * 17]}))
    assert not cache.load(key, other) and not other.table.any()
    path.write_text(json.dumps({"key": calibration_key("n", "float32", "pld"), "table": saved["table"]}))
    assert not cache.load(key, other) and not other.table.any()
    assert not list(path.parent.glob("*.tmp*"))  # nothing half-written left behind


def test_default_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTORE_CALIBRATION_DIR", str(tmp_path / "here"))
    assert default_root() == tmp_path / "here" and CalibrationCache().root == tmp_path / "here"
    monkeypatch.delenv("SPECSTORE_CALIBRATION_DIR")
    monkeypatch.setenv("SPECSTORE_CACHE", str(tmp_path / "cache"))
    assert default_root() == tmp_path / "cache" / "calibration"
    with pytest.raises(ValueError):
        CalibrationCache(tmp_path, carry=-1.0)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32")


def _engine(tiny, calibration, method="pld"):
    return Engine(tiny, method=method, cost=COST, cost_aware="on", calibration=calibration)


def test_engines_start_from_what_earlier_ones_saved(tiny, tmp_path):
    cache = CalibrationCache(tmp_path / "cal")
    first = _engine(tiny, cache)
    assert not first._calibrators["pld"].table.any()  # nothing saved yet: the priors
    a = first.generate(PROMPT, max_new_tokens=24)
    files = list(cache.root.glob("*.json"))
    assert len(files) == 1 and first.calibration_errors == 0
    learnt = first._calibrators["pld"].table.copy()
    assert learnt[:, 16].sum() > 0  # the request tried nodes
    saved = np.asarray(json.loads(files[0].read_text())["table"])
    np.testing.assert_array_equal(saved, learnt[:len(saved)])
    second = _engine(tiny, cache)  # a new process, as one-shot `generate` is
    np.testing.assert_allclose(second._calibrators["pld"].table[:len(saved)], carried(saved))
    b = second.generate(PROMPT, max_new_tokens=24)
    plain = Engine(tiny, method="ar").generate(PROMPT, max_new_tokens=24)
    assert a.token_ids == b.token_ids == plain.token_ids  # pruning removes nodes only: still lossless
    # off: starts from the priors and writes nothing
    before = sorted(p.read_text() for p in cache.root.glob("*.json"))
    for off in (None, False):
        engine = _engine(tiny, off)
        assert engine.calibration is None and not engine._calibrators["pld"].table.any()
        assert engine.generate(PROMPT, max_new_tokens=24).token_ids == plain.token_ids
    assert sorted(p.read_text() for p in cache.root.glob("*.json")) == before
    # methods without a calibration (ar, or fixed caps) save nothing
    Engine(tiny, method="pld", calibration=cache).generate(PROMPT, max_new_tokens=8)
    Engine(tiny, method="ar", calibration=cache).generate(PROMPT, max_new_tokens=8)
    assert sorted(p.read_text() for p in cache.root.glob("*.json")) == before
    with pytest.raises(Exception, match="calibration must be"):
        _engine(tiny, "yes")


def test_a_failed_save_does_not_fail_the_answer(tiny, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    engine = _engine(tiny, CalibrationCache(blocker / "cal"))  # a folder under a file: every save fails
    with caplog.at_level(logging.WARNING):
        result = engine.generate(PROMPT, max_new_tokens=8)
    assert len(result.token_ids) == 8 and engine.calibration_errors == 1
    assert "could not save the calibration of pld" in caplog.text


def test_datastore_methods_key_by_the_open_datastores_names(tiny_store, tmp_path):
    store, loaded, _ = tiny_store
    cache = CalibrationCache(tmp_path / "cal")
    engine = Engine(loaded, store, "code", method="rest", cost=COST, calibration=cache)
    engine.generate(PROMPT, max_new_tokens=8)
    (saved,) = [json.loads(p.read_text()) for p in cache.root.glob("*.json")]
    assert saved["key"]["datastores"] == ["code"] and saved["key"]["method"] == "rest"
    engine.generate(PROMPT, method="pld", max_new_tokens=8)
    keys = [json.loads(p.read_text())["key"] for p in cache.root.glob("*.json")]
    assert sorted((k["method"], tuple(k["datastores"])) for k in keys) == [("pld", ()), ("rest", ("code",))]


def test_generate_command_keeps_calibrations_unless_told_not_to(capsys, tiny_store, monkeypatch, tmp_path):
    store, _, _ = tiny_store
    folder = store.root.parent
    root = tmp_path / "kept"
    monkeypatch.setenv("SPECSTORE_CALIBRATION_DIR", str(root))
    args = ["generate", "--store", str(folder / "store"), "--model", str(folder / "model"), "--prompt", PROMPT,
            "--max-new-tokens", "8", "--dtype", "float32", "--method", "rest", "--datastore", "code", "--json"]
    assert main([*args, "--calibration", "off"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert not root.exists()
    assert main(args) == 0
    on = json.loads(capsys.readouterr().out)
    assert len(list(root.glob("*.json"))) == 1 and on["token_ids"] == off["token_ids"]
