"""`specstore generate`: streaming, --json, and one clear error line for every bad input."""

import json
import shutil

import pytest

from specstore.runtime.cli import main
from tests.datastore_helpers import tiny_datastore


@pytest.fixture(scope="module")
def tagged_store(tiny_store):
    """The module's ``tiny_store`` with ``code@1`` tagged ``prod``: ``(folder, manifest)``, the
    folder holding ``model/`` and ``store/``."""
    store, _, manifest = tiny_store
    store.set_tag("code@1", "prod")
    return store.root.parent, manifest


def run(capsys, folder, *args):
    code = main(["generate", "--store", str(folder / "store"), "--model", str(folder / "model"),
                 "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--dtype", "float32", *args])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(code, err) -> str:
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if "specstore" in line]  # fixtures' own progress bars aside
    assert len(lines) == 1 and lines[0].startswith("specstore: error: "), err
    return lines[0]


@pytest.mark.parametrize("method", ["ar", "pld", "rest", "dresd"])
def test_json_output_is_identical_across_methods(capsys, tagged_store, method):
    folder, _ = tagged_store
    code, out, _ = run(capsys, folder, "--method", method, "--datastore", "code@prod", "--json")
    assert code == 0
    result = json.loads(out)
    assert len(result["token_ids"]) == 8 and isinstance(result["text"], str)
    for key in ("steps", "mat", "accepted_per_step", "drafting_s", "verifying_s"):
        assert key in result["stats"]
    code, ar_out, _ = run(capsys, folder, "--method", "ar", "--json")
    assert json.loads(ar_out)["token_ids"] == result["token_ids"]


def test_streams_text_and_a_summary(capsys, tagged_store):
    folder, _ = tagged_store
    code, out, err = run(capsys, folder, "--method", "rest", "--datastore", "code")
    assert code == 0 and out.strip() and "[rest] 8 tokens" in err


@pytest.mark.parametrize(
    "ref, message",
    [("chat", "no datastore named 'chat'"), ("code@7", "no version 7"), ("code@beta", "no tag 'beta'"), ("Bad Name", "invalid datastore name")],
)
def test_unknown_references(capsys, tagged_store, ref, message):
    folder, _ = tagged_store
    code, _, err = run(capsys, folder, "--method", "dresd", "--datastore", ref)
    assert message in error_line(code, err)


def test_missing_datastore_and_store(capsys, tagged_store, tmp_path):
    folder, _ = tagged_store
    code, _, err = run(capsys, folder, "--method", "rest")
    assert "needs --datastore" in error_line(code, err)
    code = main(["generate", "--store", str(tmp_path / "none"), "--datastore", "code", "--method", "rest", "--prompt", "x"])
    assert "does not exist" in error_line(code, capsys.readouterr().err)


def test_tokenizer_mismatch_names_the_field(capsys, tagged_store, tmp_path):
    from transformers import AutoTokenizer

    folder, _ = tagged_store
    other = tmp_path / "model"
    shutil.copytree(folder / "model", other)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_special_tokens({"additional_special_tokens": ["<|specstore-test|>"]})
    tok.save_pretrained(str(other))
    code = main(["generate", "--store", str(folder / "store"), "--model", str(other), "--datastore", "code",
                 "--method", "rest", "--prompt", "x", "--dtype", "float32"])
    assert "'tokenizer_hash' does not match" in error_line(code, capsys.readouterr().err)


def test_corrupted_files_fail_with_one_line(capsys, tmp_path):
    store, _, manifest = tiny_datastore(tmp_path)
    for rel in ("suffix_array.npy", "table"):
        if rel == "table":
            path = store.root / next(k for k in manifest.files if k.endswith(".lance"))
        else:
            path = store.files_dir("code", manifest.build_id) / rel
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x55
        path.write_bytes(bytes(data))
        # opening checks sizes and headers only (issue 12); the full hash is `specstore verify`'s
        code = main(["verify", "--store", str(store.root), "--ref", "code"])
        assert "fails its checksum" in error_line(code, capsys.readouterr().err)


def test_respec_with_a_draft_model_fallback(capsys, tagged_store, tmp_path):
    from tests.helpers import make_tiny_model

    folder, _ = tagged_store
    draft = make_tiny_model(tmp_path / "draft", seed=3, layers=1)  # another model, the same tokenizer
    code, out, _ = run(capsys, folder, "--method", "respec", "--datastore", "code", "--json", "--entropy-threshold", "0",
                       "--draft-model", str(draft), "--draft-tokens", "3")
    assert code == 0, out
    result = json.loads(out)
    # threshold 0: never retrieves, so every drafting step is the draft model's
    stats = result["respec"]
    assert stats["fallback"] == "model" and stats["retrieved_steps"] == 0 and 0 < stats["fallback_steps"] <= result["stats"]["steps"]
    assert result["lossless"] is True
    _, ar_out, _ = run(capsys, folder, "--method", "ar", "--json")
    assert result["token_ids"] == json.loads(ar_out)["token_ids"]  # strict verification of model drafts
    # the target as its own draft model: its greedy drafts are all accepted (float32); fixed caps,
    # since cost-aware pruning keeps what a timed cost table (measured once, on a loaded machine
    # perhaps) says pays, which is not what this checks
    code, out, _ = run(capsys, folder, "--method", "respec", "--datastore", "code", "--json", "--entropy-threshold", "0",
                       "--draft-model", str(folder / "model"), "--draft-tokens", "3", "--cost-aware", "off")
    assert json.loads(out)["stats"]["mat"] > 2.5

    other = tmp_path / "other"
    shutil.copytree(draft, other)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_special_tokens({"additional_special_tokens": ["<|specstore-test|>"]})
    tok.save_pretrained(str(other))
    code, _, err = run(capsys, folder, "--method", "respec", "--datastore", "code", "--draft-model", str(other))
    assert "tokenizer differs from the target's" in error_line(code, err)
    code, _, err = run(capsys, folder, "--method", "rest", "--datastore", "code", "--draft-model", str(draft))
    assert "does not use one" in error_line(code, err)


def test_another_methods_option_is_one_error_line_before_the_model_loads(capsys, tagged_store):
    folder, _ = tagged_store
    code = main(["generate", "--store", str(folder / "store"), "--model", str(folder / "missing-model"), "--prompt", "x",
                 "--method", "pld", "--entropy-threshold", "1.0"])
    assert "--entropy-threshold is an option of method 'respec'" in error_line(code, capsys.readouterr().err)
