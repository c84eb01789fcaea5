"""The request queue of ``specstore serve``: one worker thread serves jobs in turn.

Owns admission (at most ``max_waiting`` jobs wait besides the one being served; one more is
refused with QueueFull, which the HTTP layer answers with 503), the order (first come, first
served), cancellation (a job cancelled while waiting is dropped; one cancelled while running stops
at its next commit through the engine), refreshing the engine's tags while idle (so a moved tag
is opened between requests, off the request path), and the counters ``/health`` shows. Knows
nothing of HTTP: a job is a call plus a thread-safe ``emit`` for its events.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specstore.runtime.engine import Engine, RequestCancelled, ServedResult

logger = logging.getLogger("specstore.serve")

# events a job emits, in order: ("text", str)*, then one of ("done", ServedResult),
# ("cancelled", None), ("error", Exception)
Event = tuple[str, object]


class QueueFull(Exception):
    """No room: ``max_waiting`` jobs already wait (or the server is stopping)."""


@dataclass(eq=False)
class Job:
    """``call(stream, cancel)`` runs the request on the engine; ``emit`` receives its events."""

    call: Callable[[Callable[[str], None], threading.Event], ServedResult]
    emit: Callable[[Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    def __init__(self, engine: Engine, max_waiting: int, idle_refresh_seconds: float | None = 5.0):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine, self.max_waiting, self.idle_refresh_seconds = engine, max_waiting, idle_refresh_seconds
        self._jobs: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.current: Job | None = None
        self.num_served = self.num_cancelled = self.num_failed = self.num_refused = 0

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="specstore-serve", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel the running one and drop the waiting ones, join the worker."""
        with self._cv:
            self._stopping = True
            dropped = list(self._jobs)
            self._jobs.clear()
            if self.current is not None:
                self.current.cancel.set()
            self._cv.notify_all()
        for job in dropped:
            job.emit(("cancelled", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping or len(self._jobs) >= self.max_waiting:
                self.num_refused += 1
                raise QueueFull(f"{len(self._jobs)} requests are waiting (--max-queue {self.max_waiting})")
            self._jobs.append(job)
            self._cv.notify()

    def _next(self) -> Job | None:
        with self._cv:
            if not self._jobs and not self._stopping:
                self._cv.wait(self.idle_refresh_seconds)
            if self._stopping or not self._jobs:
                return None
            self.current = self._jobs.popleft()
            return self.current

    def _loop(self) -> None:
        while not self._stopping:
            job = self._next()
            if job is None:
                if not self._stopping and self.idle_refresh_seconds is not None:
                    self.engine.refresh()  # idle: open a moved tag now rather than in the next request
                continue
            try:
                self._run(job)
            finally:
                self.current = None

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():  # the client left while waiting
            self.num_cancelled += 1
            job.emit(("cancelled", None))
            return
        try:
            result = job.call(lambda text: job.emit(("text", text)), job.cancel)
        except RequestCancelled:
            self.num_cancelled += 1
            job.emit(("cancelled", None))
        except Exception as exc:  # reported to this request's client; the worker keeps serving
            self.num_failed += 1
            logger.debug("request failed", exc_info=True)
            job.emit(("error", exc))
        else:
            self.num_served += 1
            job.emit(("done", result))

    def stats(self) -> dict:
        return {
            "waiting": self.waiting, "max_waiting": self.max_waiting, "busy": self.current is not None,
            "served": self.num_served, "cancelled": self.num_cancelled, "failed": self.num_failed, "refused": self.num_refused,
        }
