"""What the host's CPUs did besides this process while a bench run was timed.

A bench run's wall time is decoding speed only while nothing else competes for the cores its
threads run on. A compile, another benchmark, a virtual machine's neighbour (the hypervisor's
steal time) can slow one run of one method several fold (a prompt's pld run took 7.9 s where
ar's took 3.3 s, 135 ms a step against 38, while the same machine compiled a kernel; the
method's speedup interval over 24 prompts reached down to 0.98x because of it), and the
paired comparison cannot tell that from the method. ``HostMeter`` reads the kernel's own
accounting around each run: the CPU seconds all processes used (``/proc/stat``) less this
process's (``time.process_time``), and the steal seconds, as a share of the run's wall time
in cores (``Load.cores``). Linux only; elsewhere nothing is measured (None).

The bench records both per run, and its report names the runs where other work took at least
``DISTURBED_CORES`` cores on average: their times are not the method's alone. Runs are not
repeated: drafters learn from what they serve (SuffixDecoding adds each output to its tree,
ReSpec's scores move), so a second run of a prompt would not be the same measurement."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# a run is disturbed when other work (other processes' CPU time and the hypervisor's steal)
# averaged this many cores over it: a single-threaded compile beside the bench's two threads on
# two cores is 1, system daemons at rest about 0.01 (BENCHMARKS.md, thirty-third session)
DISTURBED_CORES = 0.25


@dataclass(frozen=True, slots=True)
class Sample:
    wall: float  # perf_counter seconds
    own: float  # this process's CPU seconds, all threads
    busy: float  # CPU seconds all processes used on every core (user, nice, system, irq, softirq)
    steal: float  # seconds the hypervisor ran something else while a core of this machine wanted to run


@dataclass(frozen=True, slots=True)
class Load:
    """Other work during a timed interval, in seconds of one core."""

    wall_s: float
    other_s: float  # other processes' CPU seconds (and the kernel's interrupts)
    steal_s: float

    @property
    def cores(self) -> float:
        """Other work as a number of cores busy with it on average over the interval (other_cores)."""
        return other_cores(self.other_s, self.steal_s, self.wall_s)


def other_cores(other_s: float, steal_s: float, wall_s: float, cpu_count: int | None = None) -> float:
    """Other work over ``wall_s`` seconds as a number of cores busy with it on average: the
    kernel counts every core's time in ticks, so each core's count can be up to a tick short at
    either end; that much (a tick a core) is not counted as other work."""
    if wall_s <= 0:
        return 0.0
    slack = (cpu_count or os.cpu_count() or 1) / TICKS
    return max(other_s + steal_s - slack, 0.0) / wall_s


def _ticks() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


TICKS = _ticks()


def read_stat(text: str) -> tuple[float, float] | None:
    """(busy, steal) seconds of all cores together from the text of ``/proc/stat`` (its first,
    aggregate line: user nice system idle iowait irq softirq steal ...); None when it is not
    there or not in that form. Guest time is already part of user and nice."""
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0] != "cpu":
            continue
        try:
            values = [float(v) for v in fields[1:]]
        except ValueError:
            return None
        if len(values) < 4:
            return None
        values += [0.0] * (8 - len(values))
        user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
        return (user + nice + system + irq + softirq) / TICKS, steal / TICKS
    return None


class HostMeter:
    """``start()`` before a run, ``stop(start)`` after it: the other work during it (a Load), or
    None where the host does not say (no ``/proc/stat``)."""

    def __init__(self, stat: Path = PROC_STAT):
        self.stat = stat
        self.available = self._read() is not None

    def _read(self) -> tuple[float, float] | None:
        try:
            return read_stat(self.stat.read_text())
        except OSError:
            return None

    def start(self) -> Sample | None:
        if not self.available:
            return None
        read = self._read()
        if read is None:
            return None
        return Sample(time.perf_counter(), time.process_time(), *read)

    def stop(self, start: Sample | None) -> Load | None:
        if start is None:
            return None
        end = self.start()
        if end is None:
            return None
        wall = end.wall - start.wall
        # the kernel counts in ticks: a short run's difference can round below this process's own time
        other = max((end.busy - start.busy) - (end.own - start.own), 0.0)
        return Load(wall, other, max(end.steal - start.steal, 0.0))
