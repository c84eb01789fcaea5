"""Per-process resources of the build's workers: the shared model and tokenizer, progress bars,
and giving freed heap pages back to the OS.

Owns what the steps of one worker process share instead of owning: one tokenizer and one model
per process (``apache_beam.utils.shared.Shared``, so every DoFn instance and, when the whole
pipeline runs in the driver's process, the driver's own model check use the same object), the
process' progress bars (tqdm, one per stage, with the stage's total when it is known), and
``release_memory`` after each batch. Does not own any step: the DoFns are in steps.py.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from apache_beam.utils import shared

# one handle per kind of resource: a handle holds one object, and acquiring it with another tag
# replaces that object, so a tokenizer and a model sharing a handle would evict each other
_SHARED_TOKENIZER = shared.Shared()
_SHARED_MODEL = shared.Shared()
_BARS: dict[str, object] = {}
_BARS_LOCK = threading.Lock()
LINE_INTERVAL_S = 60.0  # progress="lines": at most one line per stage this often (and one at its end)


class LineProgress:
    """A progress bar's stand-in for a log file (a scheduled rebuild's stderr is no terminal): one
    plain line per stage at most every ``LINE_INTERVAL_S`` and one when it ends, with the amount
    done, the share of the total, the rate and the time left when the total is known."""

    def __init__(self, desc: str, total: int | None, unit: str, stream=None):
        self.desc, self.total, self.unit, self.n = desc, total, unit, 0
        self.stream = stream
        self.start = self.last = time.monotonic()
        self.closed = False

    def update(self, amount: int) -> None:
        self.n += amount
        now = time.monotonic()
        if now - self.last >= LINE_INTERVAL_S:
            self.last = now
            self._line(now)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.n / elapsed
        text = f"{self.desc}: {self.n:,}"
        if self.total:
            text += f"/{self.total:,} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            text += f" {self.unit}"
        text += f", {rate:,.0f} {self.unit}/s, {elapsed / 60:.1f} min"
        if self.total and rate > 0 and self.n < self.total:
            text += f", about {(self.total - self.n) / rate / 60:.0f} min left"
        print(text, file=self.stream or sys.stderr, flush=True)


class _Holder:
    """Weak-referenceable box for a shared resource (Shared keeps weak references)."""

    def __init__(self, value):
        self.value = value


def shared_tokenizer(model_path: str):
    """The tokenizer of ``model_path`` for this process (loaded on first use, then shared)."""
    def load():
        from transformers import AutoTokenizer

        return _Holder(AutoTokenizer.from_pretrained(model_path))

    return _SHARED_TOKENIZER.acquire(load, tag=("tokenizer", model_path)).value


def shared_model(model_path: str, dtype: str):
    """The ``LoadedModel`` the build's steps in this process use (loaded on first use, then shared).

    Shared keeps an object alive while someone holds it, and keeps the most recently acquired
    object alive besides: a model acquired to check it while planning is still there when
    ``model_held`` acquires it again to run the pipeline."""
    def load():
        from specstore.runtime.models import load_model

        return load_model(model_path, dtype=dtype)

    return _SHARED_MODEL.acquire(load, tag=("model", model_path, dtype))


@contextmanager
def model_held(model_path: str, dtype: str, hold: bool) -> Iterator[None]:
    """Hold this process' shared model for the block (``hold``: the steps run in this process),
    so that the DoFns reuse it however often they are set up and torn down; released after."""
    held = shared_model(model_path, dtype) if hold else None
    try:
        yield
    finally:
        del held


def _libc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


_MALLOC_TRIM = _libc_trim()


def release_memory() -> None:
    """Give the heap's free pages back to the OS after a batch (glibc ``malloc_trim``).

    Each batch allocates and frees hundreds of MB of differently shaped arrays, and glibc keeps
    freed pages for reuse: without a trim a worker's resident memory grows with the corpus. A
    no-op where the C library is not glibc.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def advance(desc: str, amount: int, enabled: bool | str, total: int | None = None, unit: str = "tok") -> None:
    """Advance this process' progress bar ``desc`` (created on first use) by ``amount``;
    ``total`` (the stage's whole amount, from a side input) gives the bar its end and an ETA.
    ``enabled``: True for tqdm bars (a terminal), ``"lines"`` for ``LineProgress`` (a log
    file), False for none."""
    if not enabled:
        return
    from tqdm import tqdm

    with _BARS_LOCK:
        bar = _BARS.get(desc)
        if bar is None:
            bar = _BARS[desc] = (LineProgress(desc, total, unit) if enabled == "lines" else
                                 tqdm(desc=desc, total=total, unit=unit, unit_scale=True, dynamic_ncols=True))
        bar.update(amount)
        if bar.total is not None and bar.n >= bar.total:
            bar.close()  # the stage is done: its rate and time stay as they were at its end


def progress_counts() -> dict[str, int]:
    """How far each of this process' bars has come (stage -> amount), in the order they began."""
    with _BARS_LOCK:
        return {desc: bar.n for desc, bar in _BARS.items()}


def close_progress() -> None:
    """Close this process' bars (the in-process DirectRunner shares them with the driver)."""
    with _BARS_LOCK:
        for bar in _BARS.values():
            bar.close()
        _BARS.clear()
