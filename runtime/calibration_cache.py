"""Acceptance calibrations kept between processes.

A cost-aware drafter sizes its trees by a calibration of how often its nodes are accepted
(drafters/cost_aware.py, ``Calibrator``), learnt online from the steps it verifies. Within a
process it carries over from request to request (the Engine keeps one per method); without this
module every process started from the priors, so a one-shot ``specstore generate`` paid for
what the calibration had not yet seen. Replayed with a fresh drafter per prompt (drafting priced
at 0.3 ms a step), rest ran at 1.36x on code ID and 1.04x on chat OOD against 1.43x and 1.09x
with one calibration across the prompts; started from the tune split's saved counts, at 1.44x
and 1.09x (BENCHMARKS.md, thirty-fourth session).

Owns the files, one per key, ``DIGEST.json`` under ``$SPECSTORE_CALIBRATION_DIR`` (default
``cache_dir()/calibration``, so ``~/.cache/specstore/calibration``)::

    {"key": {...}, "table": [[counts of bucket 0], ...], "saved_at": "..."}

The key (``calibration_key``) is what the counts depend on: the model's weights and the dtype
(which tokens the target picks), the method, its options, the datastores open (by name: a new
version of a domain keeps what the last one taught), and ``SIGNALS_REVISION``, the meaning of
the drafters' buckets. A file for another key, or one that is not a table of counts, is
ignored (a warning names it) and overwritten by the next save.

Loading scales each bucket's counts down to at most ``CARRY`` trials: the past is a prior worth
that many trials, which this run's own counts soon outweigh, so a drift in the prompts or the
datastore is followed within a request or two. Saving writes the calibrator's whole table
(written to a temporary file and renamed over the old one: a reader never sees half a file; two
processes saving at once keep the last one's counts).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from specstore.runtime import tree_kernel
from specstore.runtime.cost import cache_path
from specstore.runtime.models import cache_dir

logger = logging.getLogger(__name__)

# Bump when a drafter's buckets (cost_aware module doc, 1) change meaning: older files then no
# longer match any key and are not loaded.
SIGNALS_REVISION = 1
CARRY = 200.0  # trials a loaded bucket is worth at most (module doc)
_TRIED_ALL = 2 * tree_kernel.DEPTH_BINS  # the table's columns (csrc/draft_tree.c)


def _option_value(value):
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, list | tuple):
        return [_option_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _option_value(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return type(value).__name__  # an object (a served overlay): its kind, not its identity


def calibration_key(model_revision: str | None, dtype: str, method: str, options: Mapping | None = None,
                    datastores: Iterable[str] = ()) -> dict:
    """What a calibration's counts depend on (module doc)."""
    return {"model": model_revision, "dtype": dtype, "method": method,
            "options": {str(k): _option_value(v) for k, v in sorted((options or {}).items())},
            "datastores": sorted(set(datastores)), "signals": SIGNALS_REVISION}


def carried(table: np.ndarray, carry: float = CARRY) -> np.ndarray:
    """``table`` with each bucket's counts scaled down to at most ``carry`` trials in all."""
    out = np.array(table, dtype=np.float64, copy=True, order="C")
    tried = out[:, _TRIED_ALL]
    over = tried > carry
    out[over] *= (carry / tried[over])[:, None]
    return out


def valid_table(table) -> bool:
    """A table of counts as Calibrator keeps them: finite, non-negative, no more accepted than tried."""
    try:
        t = np.asarray(table, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    if t.ndim != 2 or t.shape[1] != tree_kernel.TABLE_COLS or not 0 < t.shape[0] <= 1 << 16:
        return False
    if not np.isfinite(t).all() or (t < 0).any():
        return False
    d = tree_kernel.DEPTH_BINS
    slack = 1e-9 * np.maximum(t[:, :d], 1.0)
    return bool((t[:, d:2 * d] <= t[:, :d] + slack).all()
                and (t[:, _TRIED_ALL + 1] <= t[:, _TRIED_ALL] + 1e-9 * np.maximum(t[:, _TRIED_ALL], 1.0)).all())


def default_root() -> Path:
    """``$SPECSTORE_CALIBRATION_DIR``, else ``cache_dir()/calibration``."""
    env = os.environ.get("SPECSTORE_CALIBRATION_DIR")
    return Path(env).expanduser() if env else cache_dir() / "calibration"


class CalibrationCache:
    """Loads and saves calibrations by key (module doc). ``root``: the folder (default
    ``default_root()``); ``carry``: CARRY."""

    def __init__(self, root: str | os.PathLike | None = None, carry: float = CARRY):
        if not (np.isfinite(carry) and carry >= 0):
            raise ValueError(f"carry must be a finite number >= 0, got {carry}")
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.carry = float(carry)

    def path(self, key: dict) -> Path:
        return cache_path(key, self.root)  # named as the cost tables are: a digest of the key

    def load(self, key: dict, calibrator) -> bool:
        """Start ``calibrator`` from the counts saved for ``key``, carried (module doc). False,
        with the calibrator untouched, when there are none (or none usable)."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the calibration in %s: %s", path, exc)
            return False
        if not isinstance(data, dict) or data.get("key") != key or not valid_table(data.get("table")):
            logger.warning("ignoring the calibration in %s: not a table of counts for this model, method and datastore", path)
            return False
        table = carried(np.asarray(data["table"], dtype=np.float64), self.carry)
        rows = max(len(calibrator.table), len(table))
        full = np.zeros((rows, tree_kernel.TABLE_COLS), dtype=np.float64)
        full[:len(table)] = table
        calibrator.table = full
        return True

    def save(self, key: dict, calibrator) -> Path:
        """Write ``calibrator``'s counts for ``key`` (its used rows; atomically)."""
        table = np.asarray(calibrator.table, dtype=np.float64)
        used = np.flatnonzero(table[:, _TRIED_ALL] > 0)
        table = table[: int(used[-1]) + 1 if len(used) else 1]
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "table": table.tolist(),
                                   "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
        os.replace(tmp, path)
        return path
