"""The dtype defaults: a build's (issue 12) and decoding's, bf16 where the hardware runs it
natively, float32 otherwise or on request; one module decides, and the resolved name (never
"auto") reaches the build's plan, the bench's result and what generate and serve report."""

from __future__ import annotations

import pytest
import torch

from specstore.runtime import device
from specstore.runtime.cli import _build_parser
from specstore.runtime.errors import SpecstoreError

CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n\nprocessor\t: 1\n"


def _cpuinfo(tmp_path, extra: str):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO.format(extra=extra))
    return path


@pytest.mark.parametrize(("flags", "expected"), [
    ("amx_bf16 amx_tile", "bfloat16"),
    ("avx512_bf16", "bfloat16"),
    ("avx512_vnni", "float32"),
    ("", "float32"),
])
def test_auto_follows_the_cpu_flags_without_a_gpu(tmp_path, monkeypatch, flags, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpuinfo = _cpuinfo(tmp_path, flags)
    assert device.resolve_build_dtype("auto", cpuinfo) == expected
    assert device.resolve_build_dtype(None, cpuinfo) == expected
    fast, why = device.fast_bf16(cpuinfo)
    assert fast == (expected == "bfloat16") and why


def test_a_gpu_means_bf16_and_an_explicit_dtype_wins(tmp_path, monkeypatch):
    cpuinfo = _cpuinfo(tmp_path, "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.resolve_build_dtype("auto", cpuinfo) == "bfloat16"
    assert device.resolve_build_dtype("float32", cpuinfo) == "float32"  # on request, even where bf16 is fast
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.resolve_build_dtype("bfloat16", cpuinfo) == "bfloat16"
    assert device.resolve_build_dtype("auto", tmp_path / "no-such-file") == "float32"  # unreadable: no flags
    with pytest.raises(SpecstoreError, match="float16"):
        device.resolve_build_dtype("float16", cpuinfo)


def test_cli_default_is_auto_and_help_says_why():
    parser = _build_parser()
    args = parser.parse_args(["build", "--store", "s", "--name", "x", "--corpus", "c.txt"])
    assert args.dtype == "auto"
    sub = next(a for a in parser._actions if a.dest == "command").choices["build"]
    text = " ".join(sub.format_help().split())
    assert "default auto: bfloat16 on a CUDA GPU or a CPU with native bf16" in text and "float32 elsewhere" in text


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("flags", "given", "expected"), [
    ("amx_bf16", "auto", "bfloat16"), ("", "auto", "float32"), ("amx_bf16", "float32", "float32"),
])
def test_build_plans_with_the_resolved_dtype(tmp_path, monkeypatch, flags, given, expected):
    """What the plan gets (and so what the manifest's settings record and the unchanged check compares)."""
    from specstore.pipelines import build as build_module

    seen = {}

    def fake_plan(store, name, corpus, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": frozenset(flags.split()))
    monkeypatch.setattr(build_module, "plan_build", fake_plan)
    with pytest.raises(_Stop):
        build_module.build(tmp_path / "store", "x", ["c.txt"], dtype=given)
    assert seen["dtype"] == expected


@pytest.mark.parametrize(("flags", "expected"), [
    ("amx_bf16 amx_tile", torch.bfloat16), ("avx512_bf16", torch.bfloat16), ("avx512_vnni avx512f", torch.float32), ("", torch.float32),
])
def test_decoding_auto_follows_the_cpu_flags(tmp_path, monkeypatch, flags, expected):
    """A CPU without native bf16 decodes in float32 by default (emulated bf16 makes every tree
    verification several times dearer there, device.py); explicit dtypes win."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpuinfo = _cpuinfo(tmp_path, flags)
    assert device.resolve_dtype(None, "cpu", cpuinfo) == expected
    assert device.resolve_dtype("auto", None, cpuinfo) == expected
    assert device.auto_dtype_name("cpu", cpuinfo) == device.dtype_name(expected)
    assert device.resolve_dtype("bfloat16", "cpu", cpuinfo) == torch.bfloat16
    assert device.resolve_dtype("float32", "cpu", cpuinfo) == torch.float32
    assert device.resolve_dtype(torch.float16, "cpu", cpuinfo) == torch.float16
    with pytest.raises(SpecstoreError, match="unknown dtype 'half'"):
        device.resolve_dtype("half", "cpu", cpuinfo)


def test_decoding_auto_on_cuda_is_bf16_and_the_cpu_of_a_gpu_machine_goes_by_its_flags(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plain = _cpuinfo(tmp_path, "")
    assert device.resolve_dtype("auto", "cuda", plain) == torch.bfloat16
    assert device.resolve_dtype("auto", None, plain) == torch.bfloat16  # auto device: CUDA
    assert device.resolve_dtype("auto", "cpu", plain) == torch.float32  # the GPU does not make the CPU fast
    assert device.fast_bf16(plain)[0] is True  # the build's rule: any GPU on the machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fast, why = device.fast_bf16(plain)
    assert not fast and why.startswith("no CUDA GPU and the CPU has no amx_bf16")


@pytest.mark.parametrize("command", [
    ["generate", "--store", "s", "--prompt", "x"],
    ["bench", "--store", "s", "--questions", "q.jsonl"],
    ["serve", "--store", "s"],
])
def test_decoding_commands_default_to_auto_and_say_why(command):
    parser = _build_parser()
    assert parser.parse_args(command).dtype == "auto"
    sub = next(a for a in parser._actions if a.dest == "command").choices[command[0]]
    text = " ".join(sub.format_help().split())
    assert "default auto: bfloat16 on a CUDA GPU or a CPU with native bf16" in text and "float32 elsewhere" in text
    assert parser.parse_args(["simulate", "--store", "s", "--references", "r.json"]).dtype is None  # the bench's own


@pytest.mark.parametrize(("flags", "expected"), [("amx_bf16", torch.bfloat16), ("avx512f", torch.float32)])
def test_load_model_auto_loads_in_the_resolved_dtype(tmp_path, monkeypatch, flags, expected):
    from specstore.runtime.models import load_model

    from .helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": frozenset(flags.split()))
    assert next(load_model(str(model), dtype="auto", device="cpu").model.parameters()).dtype == expected
    assert next(load_model(str(model), device="cpu").model.parameters()).dtype == expected
