"""``specstore report`` on a MAT-against-size file (benchmarks/mat_vs_size.py): a table with
one row per datastore and method, and a plot of MAT against datastore tokens."""

from __future__ import annotations

import json

from specstore.runtime.cli import main


def _rows():
    rows = []
    for tokens, mat in ((1_000_000, 1.40), (10_000_000, 1.55), (80_000_000, 1.71)):
        for method, bump in (("rest", 0.0), ("respec", 0.2)):
            rows.append({"datastore": f"code-{tokens}@1", "index": "sparse", "tokens": tokens, "method": method,
                         "mat": mat + bump, "mat_low": mat + bump - 0.05, "mat_high": mat + bump + 0.04, "open_s": 0.01})
    rows.append({"datastore": "dense@1", "index": "dense", "tokens": 1_000_000, "method": "dresd", "mat": 1.3,
                 "mat_low": 1.25, "mat_high": 1.36, "open_s": 2.0})
    return rows


def test_report_tables_and_plots_mat_against_size(tmp_path, capsys):
    data = {"kind": "mat_vs_size", "references": "refs.json", "questions": "heldout.jsonl", "num_prompts": 40,
            "max_new_tokens": 128, "model": "m", "rows": _rows()}
    path = tmp_path / "sizes.json"
    path.write_text(json.dumps(data))
    assert main(["report", str(path), "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "| code-80000000@1 | sparse | 80,000,000 | respec | 1.910 | 1.860-1.950 |" in out
    assert "| dense@1 | dense | 1,000,000 | dresd | 1.300 | 1.250-1.360 |" in out
    assert out.count("| code-") == 6
    png = tmp_path / "plots" / "sizes_mat_vs_size.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
