"""The bench's reading of other work on the host (runtime/bench/host.py): /proc/stat parsed,
the tick slack not counted, a busy process beside the measurement counted, and the report
naming the runs other work disturbed."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specstore.runtime.bench import host
from specstore.runtime.bench.host import DISTURBED_CORES, HostMeter, Load, other_cores, read_stat
from specstore.runtime.bench.report import host_lines
from specstore.schemas.bench import BenchResult, MethodResult, PromptRecord

STAT = "cpu  {user} 0 {system} 900 5 1 2 {steal} 0 0\ncpu0 1 0 1 1 0 0 0 0 0 0\nintr 12\n"


def test_read_stat_takes_the_aggregate_line_in_seconds():
    busy, steal = read_stat(STAT.format(user=300, system=100, steal=40))
    assert busy == pytest.approx((300 + 100 + 1 + 2) / host.TICKS) and steal == pytest.approx(40 / host.TICKS)
    assert read_stat("cpu0 1 2 3 4\n") is None and read_stat("cpu a b c d\n") is None and read_stat("") is None
    # an old kernel's line without steal: none
    assert read_stat("cpu 10 0 5 100\n") == (pytest.approx(15 / host.TICKS), 0.0)


def test_meter_subtracts_its_own_process_and_counts_steal(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text(STAT.format(user=1000, system=0, steal=0))
    meter = HostMeter(stat)
    clocks = iter([10.0, 12.0])  # wall
    own = iter([5.0, 5.5])  # this process's CPU seconds
    monkeypatch.setattr(host.time, "perf_counter", lambda: next(clocks))
    monkeypatch.setattr(host.time, "process_time", lambda: next(own))
    start = meter.start()
    # 2 s later: all processes used 1.5 s more (this one 0.5 s), the hypervisor stole 0.3 s
    stat.write_text(STAT.format(user=1000 + int(1.5 * host.TICKS), system=0, steal=int(0.3 * host.TICKS)))
    load = meter.stop(start)
    assert load.wall_s == pytest.approx(2.0) and load.other_s == pytest.approx(1.0) and load.steal_s == pytest.approx(0.3)
    assert other_cores(1.0, 0.3, 2.0, cpu_count=2) == pytest.approx((1.3 - 2 / host.TICKS) / 2.0)
    assert Load(2.0, 0.0, 0.0).cores == 0.0 and other_cores(0.01, 0.0, 1.0, cpu_count=4) == 0.0  # within the ticks' slack


def test_meter_without_proc_stat_measures_nothing(tmp_path):
    meter = HostMeter(tmp_path / "missing")
    assert not meter.available and meter.start() is None and meter.stop(None) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the kernel's CPU accounting is Linux's /proc/stat")
def test_a_busy_process_beside_the_meter_is_counted():
    meter = HostMeter()
    start = meter.start()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"])
    _, status, usage = os.wait4(child.pid, 0)
    assert status == 0
    time.sleep(0.05)
    load = meter.stop(start)
    spent = usage.ru_utime + usage.ru_stime  # the child's CPU seconds, as the kernel counted them
    assert spent >= 0.5
    # everything the child used is other work (more may have run beside it; ticks round at each end)
    assert load.other_s >= spent - 2 * (os.cpu_count() or 1) / host.TICKS
    assert load.cores > 0.3


def _result(records: list[PromptRecord]) -> BenchResult:
    summary = {"num_prompts": 1, "num_tokens": 4, "mat": 1.0, "acceptance_rate": 0.0, "tokens_per_s": 1.0, "speedup_vs_ar": 1.0,
               "drafting_share": 0.0}
    return BenchResult(created_at="", command="", machine={"cpu_count": 2}, device="cpu", dtype="float32", model="m",
                       datastore=None, manifest_sha256=None, torch_version="", transformers_version="", questions="q",
                       max_new_tokens=4, temperature=0.0, methods={"ar": MethodResult(**summary, lossless=True)}, prompts=records)


def _record(method: str, prompt: str, wall: float, other: float | None) -> PromptRecord:
    return PromptRecord(method=method, prompt_id=prompt, category="c", num_tokens=4, steps=4, accepted_per_step=[1] * 4,
                        num_drafted=0, num_accepted=0, wall_s=wall, drafting_s=0.0, verifying_s=wall, host_other_s=other,
                        host_steal_s=None if other is None else 0.0)


def test_report_names_the_runs_other_work_disturbed():
    quiet = [_record("ar", "1", 2.0, 0.0), _record("pld", "1", 2.0, 0.03)]
    lines = host_lines(_result(quiet))
    assert len(lines) == 2 and lines[1].startswith("Host: quiet") and "2 runs" in lines[1]
    busy = [*quiet, _record("ar", "2", 2.0, 0.1), _record("pld", "2", 4.0, 3.0)]  # 3/4 of a core through the run
    text = "\n".join(host_lines(_result(busy)))
    assert "**Host busy**" in text and "1 of 4 runs" in text and f"{DISTURBED_CORES}" in text
    assert f"2 pld ({other_cores(3.0, 0.0, 4.0, cpu_count=2):.2f})" in text
    assert host_lines(_result([_record("ar", "1", 2.0, None)])) == []  # not measured (an older file): nothing said
    below = 2.0 * (DISTURBED_CORES - 0.001) + 2 / host.TICKS  # just under the bound, after the ticks' slack
    assert "at most 0.24 cores" in host_lines(_result([_record("ar", "1", 2.0, below)]))[1]
