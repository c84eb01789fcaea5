"""``specstore serve``: an OpenAI-compatible HTTP layer over one Engine (Starlette + uvicorn).

Owns the routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``), the
bridge between the event loop and the queue's worker thread, server-sent events in OpenAI's chunk
format, errors in OpenAI's shape (4xx for a malformed request, 404 for an unknown model, 503 when
the queue is full), and cancellation: a client that disconnects, while waiting or mid-stream,
cancels its request, and the engine goes on with the next. Does not own the wire models
(serve_protocol.py), the queue (serve_queue.py) or decoding (engine.py).

Model ids: the model's own name (the default datastore, or routing between several) and each
datastore reference as opened (``code@prod``) to draft from that one. A request may pick another
method with the vendor field ``{"specstore": {"method": "pld"}}``.

Imported only by the serve command and tests: ``import specstore.runtime`` never loads Starlette.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specstore.runtime.device import dtype_name
from specstore.runtime.engine import Engine
from specstore.runtime.errors import SpecstoreError
from specstore.runtime.serve_protocol import (
    RequestError,
    chat_response,
    chunk,
    completion_response,
    error_body,
    parse_request,
    usage_chunk,
)
from specstore.runtime.serve_queue import Job, QueueFull, Scheduler

_POLL_S = 0.2  # how often a waiting request checks that its client is still there


@dataclass(frozen=True)
class Defaults:
    """What a request that does not say gets (the serve command's generate options)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


def model_name(engine: Engine) -> str:
    return Path(engine.info.model_id).name or engine.info.model_id


def _error(exc: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class _Channel:
    """Events of one job, posted from the worker thread into this request's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self._pending: asyncio.Future | None = None

    def emit(self, event) -> None:  # worker thread
        with contextlib.suppress(RuntimeError):  # the loop is gone (server stopped): nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self, request: Request):
        """The next event, or None once the client has disconnected."""
        while True:
            self._pending = self._pending or asyncio.ensure_future(self.queue.get())
            done, _ = await asyncio.wait({self._pending}, timeout=_POLL_S)
            if done:
                event, self._pending = self._pending.result(), None
                return event
            if await request.is_disconnected():
                self._pending.cancel()
                return None


def _failure(event) -> RequestError:
    """The error a job's last event stands for (a user mistake is a 400, anything else a 500)."""
    kind, value = event
    if kind == "cancelled":
        return RequestError("the request was cancelled (server stopping)", status=503, type="server_error", code="cancelled")
    if isinstance(value, SpecstoreError):
        return RequestError(str(value))
    return RequestError(f"internal error: {type(value).__name__}: {value}", status=500, type="server_error")


def create_app(engine: Engine, *, max_queue: int = 16, defaults: Defaults | None = None,
               idle_refresh_seconds: float | None = 5.0) -> Starlette:
    """The ASGI app. ``max_queue``: requests that may wait besides the one being served."""
    defaults = defaults or Defaults()
    scheduler = Scheduler(engine, max_queue, idle_refresh_seconds)
    name = model_name(engine)
    started = int(time.time())

    def served_models() -> dict[str, str | None]:
        return {name: None, **{ref: ref for ref in engine.datastores}}

    async def complete(request: Request, kind: str) -> Response:
        try:
            try:
                body = await request.json()
            except ValueError:
                raise RequestError("the request body is not valid JSON") from None
            req = parse_request(kind, body)
            models = served_models()
            if req.model not in models:
                raise RequestError(f"model {req.model!r} does not exist (this server has: {', '.join(models)})",
                                   status=404, param="model", code="model_not_found")
            prompt = req.chat_messages() if kind == "chat" else req.raw_prompt()
        except RequestError as exc:
            return _error(exc)
        limit = req.limit()
        options = dict(
            method=req.method, datastore=models[req.model], template=kind == "chat",
            max_new_tokens=defaults.max_new_tokens if limit is None else limit,
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_p=defaults.top_p if req.top_p is None else req.top_p, seed=defaults.seed if req.seed is None else req.seed,
        )
        channel = _Channel()
        job = Job(lambda stream, cancel: engine.generate(prompt, stream=stream, cancel=cancel, **options), channel.emit)
        try:
            scheduler.submit(job)
        except QueueFull as exc:
            return _error(RequestError(f"server busy: {exc}; retry later", status=503, type="server_error", code="queue_full"),
                          headers={"Retry-After": "1"})
        first = await channel.next(request)  # waits for its turn; None: the client left meanwhile
        if first is None:
            job.cancel.set()
            return Response(status_code=499)  # nobody reads it
        if first[0] in ("error", "cancelled"):
            return _error(_failure(first))
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        if req.stream:
            return StreamingResponse(_events(kind, rid, created, req, first, channel, job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        event = first
        while event[0] == "text":
            event = await channel.next(request)
            if event is None:
                job.cancel.set()
                return Response(status_code=499)
        if event[0] != "done":
            return _error(_failure(event))
        build = chat_response if kind == "chat" else completion_response
        return JSONResponse(build(rid, created, req.model, event[1]))

    async def _events(kind, rid, created, req, first, channel: _Channel, job: Job):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if kind == "chat":
                yield sse(chunk(kind, rid, created, req.model, role=True))
            event = first
            while True:
                kind_of, value = event
                if kind_of == "text":
                    yield sse(chunk(kind, rid, created, req.model, value))
                elif kind_of == "done":
                    yield sse(chunk(kind, rid, created, req.model, result=value))
                    if req.include_usage:
                        yield sse(usage_chunk(kind, rid, created, req.model, value))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield sse(_failure(event).body())
                    yield "data: [DONE]\n\n"
                    return
                event = await channel.queue.get()
        finally:
            job.cancel.set()  # a no-op once done; stops decoding when the client went away mid-stream

    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat")

    async def completions(request: Request) -> Response:
        return await complete(request, "completion")

    async def models(request: Request) -> Response:
        data = [{"id": mid, "object": "model", "created": started, "owned_by": "specstore",
                 "specstore": {"datastore": engine.datastores.get(ref) if ref else None, "method": engine.method}}
                for mid, ref in served_models().items()]
        return JSONResponse({"object": "list", "data": data})

    dtype = dtype_name(next(engine.model.parameters()).dtype)  # what decodes (--dtype auto resolved)

    async def health(request: Request) -> Response:
        return JSONResponse({
            "status": "ok", "model": name, "dtype": dtype, "method": engine.method, "datastores": engine.datastores,
            "refresh_errors": engine.refresh_errors, "log_errors": engine.num_log_errors, "queue": scheduler.stats(),
            "overlay": engine.overlay.stats() if engine.overlay is not None else None,
        })

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", code=code), status_code=exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.scheduler = scheduler
    return app


def uvicorn_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


class ServerThread:
    """A server on its own thread (tests, benchmarks): ``with ServerThread(app) as s: s.url``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = uvicorn_server(app, host, port, log_level)
        self.thread = threading.Thread(target=self.server.run, name="specstore-uvicorn", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
