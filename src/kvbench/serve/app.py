"""The HTTP side of `kvbench serve`: a FastAPI application over the engine, and the uvicorn server that runs it.

    POST /v1/completions     OpenAI's completions: one prompt (text or token ids), max_tokens, temperature, seed,
                             logprobs (0..20), stream (server-sent events); usage.prompt_tokens_details.cached_tokens
    GET  /v1/models          the one model served, with its max_model_len
    GET  /metrics            Prometheus text: the prefix cache's queries and hits, the pool, the host tier, requests
    POST /reset_prefix_cache forget every cached block no request holds, in both tiers
    GET  /health             200 while the server runs

The engine runs in a thread of its own (engine.py); a request's events cross to the event loop through an asyncio
queue. SIGINT and SIGTERM stop the engine first (every request in flight ends, failed), then uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvbench.errors import KVBenchError
from kvbench.serve.engine import Done, Engine, Event, Failed, Submission, Token
from kvbench.serve.protocol import (
    CompletionRequest,
    RequestError,
    Served,
    completion_document,
    error_document,
    logprobs_document,
    metrics_text,
    models_document,
    parse_completion,
    usage_document,
)

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


class Inflight:
    """One request's side of the bridge: the engine's thread emits events, the event loop reads them in order."""

    def __init__(self, req: CompletionRequest) -> None:
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.sub = Submission(req.prompt, req.max_tokens, req.temperature, req.seed, req.logprobs, emit=self.emit)
        self.over = False

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody reads this request any more
            pass

    async def next(self) -> Event:
        event = await self.events.get()
        self.over = isinstance(event, Done | Failed)
        return event

    def cancel(self) -> None:
        """The client went away (or the server is stopping): the engine drops the request and its blocks."""
        if not self.over:
            self.sub.cancelled.set()


class TextDeltas:
    """A streamed completion's text, token by token: a character split across byte-level tokens is sent once it is
    whole (its tokens' chunks carry empty text), and the rest is sent with the last chunk."""

    def __init__(self, served: Served) -> None:
        self.served, self.shown = served, ""
        self.ids: list[int] = []

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.served.text(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.shown = text[len(self.shown) :], text
        return delta

    def rest(self) -> str:
        text = self.served.text(self.ids)
        delta, self.shown = text[len(self.shown) :], text
        return delta


def failure(event: Failed) -> JSONResponse:
    status = 503 if "shutting down" in event.message else 500
    kind = "service_unavailable" if status == 503 else "server_error"
    return JSONResponse(error_document(event.message, None, None, kind), status_code=status)


def build_app(engine: Engine, served: Served, log: Callable[[str], None]) -> FastAPI:
    """The application: the routes of the module docstring over `engine`; `log` gets one line per refused request."""
    app = FastAPI(title="kvbench serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_document(served)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(metrics_text(engine.stats()), media_type=PROMETHEUS)

    @app.post("/reset_prefix_cache")
    async def reset() -> dict[str, Any]:
        device, host = await asyncio.wrap_future(engine.reset_prefix_cache())
        return {"reset": True, "device_blocks": device, "host_blocks": host}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            req = parse_completion(await request.body(), served)
        except RequestError as e:
            log(f"{e.status} POST /v1/completions: {e.message}")
            return JSONResponse(e.document(), status_code=e.status)
        flight = Inflight(req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        engine.submit(flight.sub)
        if req.stream:
            return StreamingResponse(stream(served, flight, rid, created, req), media_type="text/event-stream")
        try:
            return await complete(served, flight, rid, created, req)
        finally:
            flight.cancel()

    return app


async def complete(served: Served, flight: Inflight, rid: str, created: int, req: CompletionRequest) -> Response:
    """A whole completion, once its request ended: the document, or the error that ended it."""
    tokens: list[Token] = []
    while not isinstance(event := await flight.next(), Done | Failed):
        tokens.append(event)
    if isinstance(event, Failed):
        return failure(event)
    ids = [t.id for t in tokens]
    choice = {
        "text": served.text(ids),
        "finish_reason": event.finish_reason,
        "logprobs": logprobs_document(served, tokens) if req.logprobs is not None else None,
        "token_ids": ids,
    }
    return JSONResponse(completion_document(rid, created, served, choice, usage_document(event)))


async def stream(
    served: Served, flight: Inflight, rid: str, created: int, req: CompletionRequest
) -> AsyncIterator[str]:
    """A completion as server-sent events, one per token, then the last chunk with the usage, then [DONE]."""
    deltas, offset = TextDeltas(served), 0
    try:
        while not isinstance(event := await flight.next(), Done | Failed):
            lp = None
            if req.logprobs is not None:
                lp = logprobs_document(served, [event], offset)
                offset += len(lp["tokens"][0])
            choice = {"text": deltas.push(event.id), "finish_reason": None, "logprobs": lp, "token_ids": [event.id]}
            yield sse(completion_document(rid, created, served, choice, None))
        if isinstance(event, Failed):
            yield sse(error_document(event.message, None, None, "server_error"))
        else:
            last: dict[str, Any] = {"text": deltas.rest(), "finish_reason": event.finish_reason}
            last |= {"logprobs": None, "token_ids": []}
            yield sse(completion_document(rid, created, served, last, usage_document(event)))
        yield "data: [DONE]\n\n"
    finally:
        flight.cancel()


def sse(doc: dict[str, Any]) -> str:
    """One server-sent event carrying `doc`."""
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one the kernel picks), or one line saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = e.strerror or str(e)
        raise KVBenchError(f"cannot listen on {host}:{port}: {why} (--port 0 picks a free port)") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server, stopping the engine first on SIGINT/SIGTERM (so streams end at once) and saying when it is
    ready to answer."""

    def __init__(self, config: uvicorn.Config, engine: Engine, on_ready: Callable[[], None]) -> None:
        super().__init__(config)
        self.engine, self.on_ready = engine, on_ready

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine.stop(timeout=0)
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self.on_ready()


def serve_forever(
    engine: Engine, served: Served, sock: socket.socket, on_ready: Callable[[], None], log: Callable[[str], None]
) -> None:
    """Run the engine and the HTTP server on `sock` until SIGINT or SIGTERM; the engine's thread is joined before
    this returns (or raises the signal's exception)."""
    app = build_app(engine, served, log)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3, lifespan="off")
    server = Server(config, engine, on_ready)
    engine.on_error = log
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
