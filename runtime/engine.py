"""The engine: one model and a few datastore references held open across many requests.

Owns serving requests in one process: opening the model and the datastore versions once, one
request at a time from any number of threads, following tags (a reference ``NAME@TAG`` or a bare
``NAME`` is re-resolved at most every ``refresh_seconds`` and on ``refresh()``; a new version is
opened beside the old one and swapped in between requests), naming in every result the
``NAME@VERSION`` that served it, cancellation at the next commit, handing each served request
to the log, and the served overlay (issue 15, point 3). Runs every decode of the package: the
one-shot ``api.generate`` and ``specstore generate`` are an engine serving one request. Does not
own decoding's loop (decode.py), prompts and streamed text (api.py), drafting (drafters/), the
overlay's store and search (overlay.py), the HTTP layer (serve.py) or the log's format
(served_log.py).

Versions: a request takes a snapshot of the open versions when it starts and decodes with it to
the end, so a switch never happens inside a request. ``gc`` of a version still in use is safe:
its suffix array and stream stay mapped after the files go (Linux keeps an unlinked mapped file)
and so are a compact version's dense files (an old-form version's rows are read into memory on open; retention.py).

The overlay (``overlay=True`` or a ServedOverlay; off unless asked, on in ``serve``): one per engine, fed in
``_served`` with each finished request (its response; its prompt too when the overlay keeps
prompts), under the engine's lock, so a request drafts from an overlay that does not change while
it runs; handed in ``_drafter`` to the methods the registry marks as reading it (pld, rest,
respec). A cancelled request is not added.

Calibrations (``calibration=True`` or a CalibrationCache; off unless asked, on in ``generate`` and
``serve``): a cost-aware method's calibration is one per engine and method; its first request
loads what earlier processes saved for this model, method, options and datastore names
(calibration_cache.py), and each finished request saves it again.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral

from specstore.runtime import api
from specstore.runtime.calibration_cache import CalibrationCache, calibration_key
from specstore.runtime.datastore import Datastore
from specstore.runtime.decode import DecodeStats, decode
from specstore.runtime.device import dtype_name
from specstore.runtime.drafters import registry
from specstore.runtime.drafters.base import Drafter
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.overlay import ServedOverlay
from specstore.runtime.sampling import Sampling
from specstore.runtime.served_log import ServedLog, now_iso, served_record
from specstore.runtime.store import Ref, Store

logger = logging.getLogger("specstore.engine")


class RequestCancelled(Exception):
    """The request's ``cancel`` event was set; decoding stopped at a commit."""


@dataclass(slots=True)
class ServedResult:
    """One served request. ``datastore``: the ``NAME@VERSION`` that served it (None for methods
    that use none); ``reference``: the reference it was opened as (``code@prod``)."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: DecodeStats
    stop_reason: str
    method: str
    datastore: str | None
    reference: str | None
    lossless: bool
    routing: dict[str, float] | None = None  # several datastores: each one's score for this prompt
    drafter: object = field(default=None, repr=False)  # the request's drafter, for its own counters (ReSpec's)
    overlay: dict | None = None  # with the overlay on: overlay nodes drafted and accepted (OverlayUse)

    def to_dict(self) -> dict:
        return {
            "text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict(), "stop_reason": self.stop_reason,
            "method": self.method, "datastore": self.datastore, "reference": self.reference, "lossless": self.lossless,
            "routing": self.routing, "overlay": self.overlay,
        }


@dataclass(frozen=True, slots=True)
class _Slot:
    reference: Ref
    datastore: Datastore


def split_references(datastores: str | Sequence[str] | None) -> list[str]:
    """``"code@prod,chat"`` or a list -> the references, stripped, in order."""
    items = datastores.split(",") if isinstance(datastores, str) else list(datastores or ())
    return [r.strip() for r in items if r.strip()]


class Engine:
    """``Engine(load_model(...), store, "code@prod", method="rest")``, or ``Engine.load(...)``.

    ``drafter_options``: per method, keyword options for ``make_drafter`` (e.g.
    ``{"respec": {"entropy_threshold": 3.0}}``). ``dense``: load the dense rows on open (default:
    when ``method`` needs them); a request for a dense method on an engine opened without them
    loads them then. ``refresh_seconds``: how often tags and bare names are re-resolved at the
    start of a request (None: only on ``refresh()``). ``log``: a path or ServedLog to append
    each served request to (off when None). ``verify``: hash every file of a version when it is
    opened (off: opening checks sizes and headers only; ``specstore verify`` hashes).
    ``overlay``: learn from what is served (module docstring): True for a ServedOverlay with its
    defaults, or one to use; None or False: off. ``cost``: a cost.CostModel: the methods that
    ``cost_aware`` (auto, on, off: registry.uses_cost) selects size their trees by it
    (drafters/cost_aware.py), one calibration per method kept across requests; None: fixed caps.
    ``prefetch``: map each opened version's suffix-index pages in a background thread (a
    long-lived server, as ``serve``: its first searches then pay no page faults; a one-shot
    request would only compete with it). ``calibration``: keep each method's calibration
    between processes (calibration_cache.py): True for a CalibrationCache in the default folder,
    or one to use. A method's first request then starts from what earlier runs of this model,
    method, options and datastores saved, and each request saves what it taught. None or False
    (default): every engine starts from the priors and writes nothing.
    """

    def __init__(self, loaded, store: Store | str | None = None, datastores: str | Sequence[str] | None = (), *,
                 method: str = "rest", drafter_options: Mapping[str, Mapping] | None = None, dense: bool | None = None,
                 verify: bool = False, refresh_seconds: float | None = 5.0, log: ServedLog | str | os.PathLike | None = None,
                 overlay: bool | ServedOverlay | None = False, clock: Callable[[], float] = time.monotonic, cost=None,
                 cost_aware: str = "on", prefetch: bool = False, calibration=None):
        self.model, self.tokenizer, self.info = loaded.model, loaded.tokenizer, getattr(loaded, "info", None)
        self.cost, self.cost_aware, self._calibrators = cost, cost_aware, {}
        if calibration is True:
            calibration = CalibrationCache()
        if calibration not in (None, False) and not isinstance(calibration, CalibrationCache):
            raise SpecstoreError(f"calibration must be True, False, None or a CalibrationCache, got {calibration!r}")
        self.calibration = calibration or None
        self._calibration_keys: dict[str, dict] = {}
        self.calibration_errors = 0  # saves that failed (logged; serving goes on)
        self.device = next(self.model.parameters()).device
        refs = split_references(datastores)
        if refs and store is None:
            raise SpecstoreError("datastore references need a store")
        if len(set(refs)) != len(refs):
            raise SpecstoreError(f"a datastore reference is given twice: {', '.join(refs)}")
        self.store = Store(store) if isinstance(store, str) else store
        self.method = method
        self.drafter_options = {m: dict(o) for m, o in (drafter_options or {}).items()}
        self.dense = registry.needs_dense([method]) if dense is None else dense
        self.verify, self.refresh_seconds, self._clock, self.prefetch = verify, refresh_seconds, clock, prefetch
        self.log = ServedLog(log) if isinstance(log, str | os.PathLike) else log
        if overlay is not None and not isinstance(overlay, bool | ServedOverlay):
            raise SpecstoreError(f"overlay must be True, False or a ServedOverlay, got {overlay!r}")
        self.overlay = ServedOverlay() if overlay is True else None if overlay is False else overlay  # (an empty one is falsy)
        self._slots = tuple(_Slot(Ref.parse(r), self._open(r)) for r in refs)
        self._router: tuple[tuple[_Slot, ...], object] | None = None
        self._lock, self._refresh_lock = threading.Lock(), threading.Lock()
        self._checked_at = clock()
        self.refresh_errors: dict[str, str] = {}
        self.num_log_errors = 0
        self._drafter(method, self._slots[0].datastore if self._slots else None)  # fail now on a bad method or option

    @classmethod
    def load(cls, store: Store | str | None, datastores: str | Sequence[str] | None = (), *, model: str | None = None,
             dtype: str | None = None, device: str | None = None, **options) -> Engine:
        """Resolve the references (failing before the model loads), load the model, open them."""
        from specstore.runtime.models import load_model

        refs = split_references(datastores)
        if refs:
            store = store if isinstance(store, Store) else Store(store)
            for ref in refs:
                store.resolve(ref)
        return cls(load_model(model, dtype=dtype, device=device), store, refs, **options)

    @classmethod
    def for_model(cls, model, tokenizer, **options) -> Engine:
        """An engine over a model and tokenizer already loaded (no datastore; ``method`` ar
        unless given): what the one-shot ``api.generate`` serves its request with."""
        from types import SimpleNamespace

        options.setdefault("method", "ar")
        return cls(SimpleNamespace(model=model, tokenizer=tokenizer, info=None), **options)

    # ---- versions ------------------------------------------------------------------------------
    @property
    def datastores(self) -> dict[str, str]:
        """Each reference as opened -> the ``NAME@VERSION`` a request starting now would use."""
        return {str(s.reference): s.datastore.ref for s in self._slots}

    def _open(self, ref: str) -> Datastore:
        return Datastore.open(self.store, ref, self.info, verify=self.verify, dense=self.dense, device=self.device,
                              prefetch=self.prefetch)

    def refresh(self) -> dict[str, str]:
        """Re-resolve every tag and bare name now; open what moved and swap it in for the next
        request. Returns ``{reference: "code@1 -> code@2"}`` for each switch. A version that
        cannot be opened is reported in ``refresh_errors`` and the current one kept."""
        with self._refresh_lock:
            self._checked_at = self._clock()
            slots, changes, errors = list(self._slots), {}, {}
            for i, slot in enumerate(slots):
                if slot.reference.version is not None:
                    continue  # pinned
                try:
                    record = self.store.resolve(slot.reference)
                    if record.build_id == slot.datastore.record.build_id:
                        continue
                    opened = self._open(f"{record.name}@{record.version}")
                except Exception as exc:  # keep serving the open version whatever the catalogue or new files say
                    errors[str(slot.reference)] = str(exc)
                    logger.warning("refresh of %s failed, still serving %s: %s", slot.reference, slot.datastore.ref, exc)
                    continue
                changes[str(slot.reference)] = f"{slot.datastore.ref} -> {opened.ref}"
                slots[i] = _Slot(slot.reference, opened)
            self.refresh_errors = errors
            if changes:
                self._slots = tuple(slots)  # one assignment: a running request keeps its own snapshot
                logger.info("switched %s", ", ".join(f"{k}: {v}" for k, v in changes.items()))
            return changes

    def _maybe_refresh(self) -> None:
        if self.refresh_seconds is not None and self._clock() - self._checked_at >= self.refresh_seconds:
            self.refresh()

    # ---- requests ------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | Sequence, template: bool = True) -> list[int]:
        """Token ids of a prompt: through the chat template (as ``generate``) or, with
        ``template=False``, the raw text tokenised as is; a list of ids is used as given."""
        if template or not isinstance(prompt, str):
            return api.prompt_ids(self.tokenizer, prompt)
        return list(self.tokenizer(prompt)["input_ids"])

    def route(self, prompt: str | Sequence, *, template: bool = True) -> tuple[str, dict[str, float] | None]:
        """``(reference, scores)``: the open reference a request for ``prompt`` would draft from
        now (scores None when there was no choice). Pass it back as ``generate(datastore=...)``
        to decode with it without routing again."""
        with self._lock:  # the router runs the model
            slots = self._slots
            if not slots:
                raise SpecstoreError("this engine has no datastore open")
            slot, scores = self._choose(slots, None, self.prompt_ids(prompt, template), template)
            return str(slot.reference), scores

    def _pick(self, slots: tuple[_Slot, ...], method: str, datastore: str | None, ids: list[int], template: bool):
        if not registry.datastore_methods([method]) or not slots:
            return None, None
        return self._choose(slots, datastore, ids, template)

    def _choose(self, slots: tuple[_Slot, ...], datastore: str | None, ids: list[int], template: bool):
        if datastore is not None:
            for slot in slots:
                if datastore in (str(slot.reference), slot.reference.name, slot.datastore.ref):
                    return slot, None
            raise SpecstoreError(f"no datastore {datastore!r} is open in this engine (open: {', '.join(self.datastores)})")
        if len(slots) == 1:
            return slots[0], None
        from specstore.runtime.router import Router

        if self._router is None or self._router[0] is not slots:
            self._router = (slots, Router([s.datastore for s in slots]))
        route = self._router[1].route(self.model, ids, api.prompt_ids(self.tokenizer, "") if template else None)
        return slots[route.index], route.scores

    def _drafter(self, method: str, datastore: Datastore | None):
        options = dict(self.drafter_options.get(method, {}))
        if self.overlay is not None and registry.method_info(method).overlay:
            options["overlay"] = self.overlay
        cost = self.cost if registry.uses_cost(method, self.cost_aware) else None
        drafter = registry.make_drafter(method, datastore, cost=cost, **options)
        calibrator = getattr(drafter, "calibrator", None)
        if calibrator is not None:  # cost-aware: what earlier requests taught carries over
            if method not in self._calibrators and self.calibration is not None:
                self.calibration.load(self._calibration_key(method), calibrator)  # and what earlier processes taught
            drafter.calibrator = self._calibrators.setdefault(method, calibrator)
        return drafter

    def _calibration_key(self, method: str) -> dict:
        """The key of ``method``'s calibration (calibration_cache.calibration_key), once per method:
        options and datastore names are fixed for the engine's life (a moved tag keeps its name)."""
        key = self._calibration_keys.get(method)
        if key is None:
            options = {k: v for k, v in self.drafter_options.get(method, {}).items() if k != "overlay"}
            names = [s.reference.name for s in self._slots] if registry.datastore_methods([method]) else []
            revision = getattr(self.info, "revision", None)
            if revision is None:  # a model without load_model's info (Engine.for_model): its weights' hash
                from specstore.runtime.models import model_info

                revision = model_info(self.model, self.tokenizer, "").revision
            key = calibration_key(revision, dtype_name(next(self.model.parameters()).dtype), method, options, names)
            self._calibration_keys[method] = key
        return key

    def _save_calibration(self, method: str, drafter) -> None:
        """Save ``method``'s calibration when this engine keeps them and the request used it."""
        calibrator = self._calibrators.get(method)
        if self.calibration is None or calibrator is None or getattr(drafter, "calibrator", None) is not calibrator:
            return
        try:
            self.calibration.save(self._calibration_key(method), calibrator)
        except OSError as exc:  # a full disk or a read-only cache must not fail the answer
            self.calibration_errors += 1
            logger.warning("could not save the calibration of %s: %s", method, exc)

    def generate(self, prompt: str | Sequence, *, method: str | None = None, datastore: str | None = None,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stream: Callable[[str], None] | None = None, template: bool = True,
                 cancel: threading.Event | None = None, drafter: Drafter | None = None) -> ServedResult:
        """Serve one request (waits for the one in progress). ``prompt``: a string (one user
        message), chat messages, or token ids; ``template=False`` sends a string as raw text.
        ``datastore``: which open reference to draft from (by reference or name; default: the
        only one, or routed). ``stream`` receives new text; setting ``cancel`` stops the request
        at its next commit with RequestCancelled. ``drafter``: a ready Drafter to decode with
        instead of building one for ``method`` (``datastore`` does not apply)."""
        if drafter is not None and (method is not None or datastore is not None):
            raise SpecstoreError("give a drafter or a method and datastore, not both")
        method = method or self.method
        with self._lock:
            if cancel is not None and cancel.is_set():
                raise RequestCancelled("cancelled before it started")
            self._maybe_refresh()
            slots = self._slots  # this request's versions, whatever refresh() does meanwhile
            ids = self.prompt_ids(prompt, template)
            slot, routing, ds = None, None, None
            if drafter is None:
                slot, routing = self._pick(slots, method, datastore, ids, template)
                ds = slot.datastore if slot is not None else None
                if ds is not None and registry.needs_dense([method]) and ds.dense is None and ds.has_dense:
                    ds.load_dense()  # a sparse version has none: dresd refuses it (registry.check_index), respec skips it
                drafter = self._drafter(method, ds)
            else:
                method = getattr(drafter, "name", type(drafter).__name__)
            out = self._decode(ids, drafter, max_new_tokens, Sampling.seeded(temperature, top_p, seed),
                               _checked(stream, cancel))
            stats_of = getattr(drafter, "overlay_stats", None)
            result = ServedResult(
                out.text, out.token_ids, ids, out.stats, out.stop_reason, method,
                ds.ref if ds is not None else None, str(slot.reference) if slot is not None else None,
                bool(getattr(drafter, "lossless", True)), routing, drafter, stats_of() if callable(stats_of) else None,
            )
            self._served(prompt, template, result, dict(temperature=temperature, top_p=top_p, seed=seed))
            self._save_calibration(method, drafter)
            return result

    def _decode(self, ids: list[int], drafter: Drafter, max_new_tokens: int, sampling, stream) -> api.GenerateResult:
        """One decode with ``drafter``; ``stream`` receives newly committed text."""
        streamer = api.TextStream(self.tokenizer, stream) if stream is not None else None
        out = decode(self.model, ids, drafter, max_new_tokens, sampling, api.eos_ids(self.model, self.tokenizer),
                     on_commit=streamer)
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        if streamer is not None:
            streamer.flush(text)
        return api.GenerateResult(text, out.token_ids, out.stats, out.stop_reason, ids)

    def stream(self, prompt: str | Sequence, **options) -> TextIterator:
        """``for piece in engine.stream(prompt, ...)``: the text as it is accepted; ``.result``
        once exhausted; ``close()`` (or leaving a ``with`` block) cancels the request."""
        return TextIterator(self, prompt, options)

    def _served(self, prompt, template: bool, result: ServedResult, sampling: dict) -> None:
        if self.overlay is not None:
            self.overlay.add(result.token_ids, result.prompt_ids)
        if self.log is None:
            return
        meta = {
            "served_at": now_iso(), "datastore": result.datastore, "reference": result.reference, "method": result.method,
            "model": self.info.model_id, "stop_reason": result.stop_reason, "lossless": result.lossless,
            "prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids), "sampling": sampling,
            "stats": result.stats.to_dict(),
        }
        is_ids = not isinstance(prompt, str) and all(isinstance(t, Integral) for t in prompt)
        decoded = self.tokenizer.decode(result.prompt_ids) if is_ids else None
        try:
            self.log.write(served_record(prompt, result.text, meta, template=template, decoded_prompt=decoded))
        except OSError as exc:  # the answer is computed: serve it, and say the log lost a line
            self.num_log_errors += 1
            logger.error("served-request log %s: %s", self.log.path, exc)


def _checked(stream: Callable[[str], None] | None, cancel: threading.Event | None):
    if cancel is None:
        return stream

    def callback(text: str) -> None:
        if cancel.is_set():
            raise RequestCancelled("cancelled")
        if stream is not None:
            stream(text)

    return callback


_DONE = object()


class TextIterator:
    """The streaming form of ``Engine.generate``: the request runs in a thread of its own."""

    def __init__(self, engine: Engine, prompt, options: dict):
        self._pieces: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()
        self.result: ServedResult | None = None
        self.cancelled = False
        self._thread = threading.Thread(target=self._run, args=(engine, prompt, options), daemon=True)
        self._thread.start()

    def _run(self, engine: Engine, prompt, options: dict) -> None:
        try:
            self.result = engine.generate(prompt, stream=self._pieces.put, cancel=self._cancel, **options)
            self._pieces.put(_DONE)
        except RequestCancelled:
            self.cancelled = True
            self._pieces.put(_DONE)
        except BaseException as exc:  # handed to the reader's thread
            self._pieces.put(exc)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        item = self._pieces.get()
        if item is _DONE:
            self._pieces.put(_DONE)  # stays exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._cancel.set()
        self._thread.join()

    def __enter__(self) -> TextIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
