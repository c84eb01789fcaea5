"""What the CLI checks before any work: unknown options (build forwards only Beam's own), store
URIs and storage options on every command that takes --store, and a clean stderr (no Beam import warning, no Beam
import at all outside build)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specstore.runtime.cli import _build_parser, main

CORPUS = str(Path(__file__).parent / "fixtures" / "corpus" / "instruct.jsonl")
SPECSTORE = str(Path(sys.executable).parent / "specstore")
APITOOLS = "apitools not found"


def _one_error_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specstore: error: "), captured.err
    assert captured.out == ""
    return lines[0]


@pytest.mark.parametrize(
    ("extra", "named", "hint"),
    [
        (["--tags", "prod"], "--tags", "did you mean --tag?"),
        (["--max-doc", "5"], "--max-doc", "did you mean --max-docs?"),  # a prefix is not taken for --max-docs
        (["--max_docs", "5"], "--max_docs", "did you mean --max-docs?"),
        (["--indx", "sparse"], "--indx", "did you mean --index?"),
        (["--frobnicate=1"], "--frobnicate", None),
        (["--direct_num_worker=2"], "--direct_num_worker", "did you mean --direct_num_workers?"),  # near a Beam option
    ],
)
def test_unknown_build_option_fails_fast_and_creates_nothing(extra, named, hint, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    line = _one_error_line(capsys, ["build", "--store", str(cwd / "store"), "--name", "x", "--corpus", CORPUS,
                                    "--model", str(tmp_path / "no-model"), *extra])
    assert f"unknown option {named} for build" in line
    if hint:
        assert line.endswith(hint)
    else:
        assert "did you mean" not in line
    assert list(cwd.iterdir()) == []


def test_bad_beam_values_and_runners_fail_fast(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = ["build", "--store", str(tmp_path / "store"), "--name", "x", "--corpus", CORPUS]
    assert "invalid choice: 'bogus'" in _one_error_line(capsys, base + ["--direct_running_mode=bogus"])
    assert "invalid int value" in _one_error_line(capsys, base + ["--direct_num_workers", "two"])
    assert "unexpected argument 'true'" in _one_error_line(capsys, base + ["--save_main_session", "true"])
    assert "unknown Beam runner 'Flnk'" in _one_error_line(capsys, base + ["--runner", "Flnk"])
    assert list(tmp_path.iterdir()) == []


def test_other_commands_name_an_unknown_option_in_one_line(tmp_path, capsys):
    line = _one_error_line(capsys, ["versions", "--store", str(tmp_path), "--name", "x", "--jsn"])
    assert line == "specstore: error: unknown option --jsn for versions (see specstore versions --help); did you mean --json?"
    line = _one_error_line(capsys, ["tag", "--store", str(tmp_path), "--ref", "x@1", "--tag", "t", "stray", "--force"])
    assert line.startswith("specstore: error: unknown option --force for tag")
    assert _one_error_line(capsys, ["gc", "--store", str(tmp_path), "--name", "x", "--keep", "1", "stray"]).endswith(
        "unexpected argument 'stray' for gc")
    assert list(tmp_path.iterdir()) == []


def _commands_with_store() -> dict[str, argparse.ArgumentParser]:
    parser = _build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: p for name, p in sub.choices.items() if any("--store" in a.option_strings for a in p._actions)}


# the required options of every command that takes --store (a new such command must be added here)
REQUIRED = {
    "build": ["--name", "x", "--corpus", CORPUS],
    "versions": ["--name", "x"],
    "tag": ["--ref", "x@1", "--tag", "prod"],
    "gc": ["--name", "x", "--keep", "1"],
    "verify": ["--ref", "x@1"],
    "generate": ["--prompt", "hi", "--datastore", "x"],
    "bench": ["--questions", "q.jsonl", "--datastore", "x"],
    "simulate": ["--references", "r.json", "--datastore", "x"],
    "serve": ["--datastore", "x"],
}


def test_every_command_with_a_store_is_listed():
    assert set(_commands_with_store()) == set(REQUIRED)


@pytest.mark.parametrize("command", sorted(REQUIRED))
@pytest.mark.parametrize("uri", ["ftp://host/db", "hdfs://cluster/db"])
def test_store_uri_of_an_unknown_scheme_is_refused_and_creates_nothing(command, uri, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(capsys, [command, "--store", uri, *REQUIRED[command]])
    assert line.startswith(f"specstore: error: unsupported store URI '{uri}': use a local path or one of s3://, gs://, az://")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_a_storage_option_must_be_key_value(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [command, "--store", "s3://bucket/db", "--storage-option", "aws_region", *REQUIRED[command]]
    line = _one_error_line(capsys, argv)
    assert line == "specstore: error: storage option 'aws_region' is not KEY=VALUE (e.g. aws_region=us-east-1)"
    assert list(tmp_path.iterdir()) == []


class _Stop(Exception):
    """Raised instead of running the pipeline: the options it was handed are what is checked."""


@pytest.fixture
def handed_options(monkeypatch):
    """The PipelineOptions of the pipeline a build runs (the build stops where it would run it)."""
    from apache_beam.pipeline import Pipeline

    seen = []

    def run(self, *args, **kwargs):
        seen.append(self._options)
        raise _Stop

    monkeypatch.setattr(Pipeline, "run", run)
    return seen


def _build_argv(tmp_path, model: str, *extra: str) -> list[str]:
    return ["build", "--store", str(tmp_path / "store"), "--name", "x", "--corpus", CORPUS, "--model", model,
            "--pca-dims", "8", "--continuation-length", "4", *extra]


def test_multi_processing_options_reach_the_pipeline(tiny_model_dir, tmp_path, handed_options):
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    with pytest.raises(_Stop):
        main(_build_argv(tmp_path, tiny_model_dir, "--direct_running_mode=multi_processing", "--direct_num_workers=2"))
    (options,) = handed_options
    direct = options.view_as(DirectOptions)
    assert (direct.direct_running_mode, direct.direct_num_workers) == ("multi_processing", 2)
    assert options.view_as(StandardOptions).runner == "DirectRunner"


def test_portable_runner_options_reach_the_pipeline(tiny_model_dir, tmp_path, handed_options):
    from apache_beam.options.pipeline_options import PortableOptions, StandardOptions

    with pytest.raises(_Stop):  # no job server is started: the pipeline stops before it would run
        main(_build_argv(tmp_path, tiny_model_dir, "--runner", "PortableRunner", "--job_endpoint", "localhost:1",
                         "--environment_type", "EXTERNAL", "--environment_config=localhost:2"))
    (options,) = handed_options
    portable = options.view_as(PortableOptions)
    assert (portable.job_endpoint, portable.environment_type, portable.environment_config) == ("localhost:1", "EXTERNAL", "localhost:2")
    assert options.view_as(StandardOptions).runner == "PortableRunner"


@pytest.mark.slow
def test_multi_processing_build_from_the_cli(tiny_model_dir, tmp_path, capsys):
    from specstore.runtime.store import Store

    assert main(_build_argv(tmp_path, tiny_model_dir, "--direct_running_mode=multi_processing", "--direct_num_workers=2")) == 0
    assert "x@1: 4 documents" in capsys.readouterr().out
    assert [v.version for v in Store(tmp_path / "store").versions("x")] == [1]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_no_beam_import_warning_on_stderr(tmp_path):
    # the build imports Beam (to check its options) and stops at the unknown option
    build = _run([SPECSTORE, "build", "--store", "store", "--name", "x", "--corpus", CORPUS, "--tags", "prod"], tmp_path)
    assert build.returncode == 2
    assert build.stderr.strip().splitlines() == [
        "specstore: error: unknown option --tags for build (neither a specstore option nor a Beam pipeline option); did you mean --tag?"
    ]
    (tmp_path / "empty").mkdir()
    versions = _run([SPECSTORE, "versions", "--store", "empty", "--name", "x"], tmp_path)
    assert (versions.returncode, versions.stderr) == (0, "")
    assert versions.stdout.startswith("no versions of 'x'")
    control = _run([sys.executable, "-c", "import apache_beam"], tmp_path)
    assert APITOOLS in control.stderr, "Beam no longer logs the apitools warning: quiet_beam_import can go"


def test_help_and_runtime_commands_do_not_import_beam(tmp_path):
    (tmp_path / "empty").mkdir()
    code = (
        "import sys\n"
        "from specstore.runtime.cli import main\n"
        "for argv in (['--help'], *([cmd, '--help'] for cmd in ('build', 'generate', 'bench', 'simulate'))):\n"
        "    try:\n        main(argv)\n    except SystemExit as done:\n        assert done.code == 0, argv\n"
        "    else:\n        raise AssertionError(f'{argv} did not exit')\n"
        "assert main(['versions', '--store', 'empty', '--name', 'x']) == 0\n"
        "assert main(['gc', '--store', 'empty', '--name', 'x', '--keep', '1', '--dry-run']) == 0\n"
        "assert main(['tag', '--store', 's3://b/db', '--ref', 'x@1', '--tag', 't']) == 2\n"
        "beam = sorted(m for m in sys.modules if m.startswith('apache_beam'))\n"
        "assert not beam, beam[:5]\n"
    )
    done = _run([sys.executable, "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    assert APITOOLS not in done.stderr
