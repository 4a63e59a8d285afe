"""The HTTP side of `kvbench serve`: a FastAPI application over the engine, and the uvicorn server that runs it.

    POST /v1/completions     OpenAI's completions: one prompt (text or token ids), max_tokens, temperature, seed,
                             logprobs (0..20), stream (server-sent events); usage.prompt_tokens_details.cached_tokens
    GET  /v1/models          the one model served, with its max_model_len
    GET  /metrics            Prometheus text: the prefix cache's queries and hits, the pool, the host tier, requests
    POST /reset_prefix_cache forget every cached block no request holds, in both tiers
    GET  /health             200 while the server runs

The engine runs in a thread of its own (engine.py); a request's events cross to the event loop through an asyncio
queue. A body is read up to protocol.MAX_BODY_BYTES and parsed (tokenized) on a worker thread, so a long prompt
never stalls the streams in flight; a client that goes away, streamed or not, has its request dropped by the engine.
SIGINT, SIGTERM and SIGHUP (unless ignored, as under nohup) stop the engine first (every request in flight ends,
failed), then uvicorn; `serve_forever` returns the signal that stopped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from kvbench.errors import KVBenchError
from kvbench.serve.engine import Done, Engine, Event, Failed, Submission, Token
from kvbench.serve.protocol import (
    MAX_BODY_BYTES,
    CompletionRequest,
    RequestError,
    Served,
    body_too_large,
    completion_document,
    error_document,
    logprobs_document,
    metrics_text,
    models_document,
    parse_completion,
    route_error,
    usage_document,
)

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
DRAIN_BYTES = 8 * MAX_BODY_BYTES  # a body past the cap is read and dropped up to this, so its client reads the 413


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

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, exc: HTTPException) -> Response:
        path = request.url.path[:200]
        allowed = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), None)
        doc = route_error(exc.status_code, request.method, path, allowed)
        log(f"{exc.status_code} {request.method} {path}: {doc['error']['message']}")
        return JSONResponse(doc, status_code=exc.status_code, headers=exc.headers)

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
            req = await asyncio.to_thread(parse_completion, await read_body(request), served)
        except RequestError as e:
            log(f"{e.status} POST /v1/completions: {e.message}")
            return JSONResponse(e.document(), status_code=e.status)
        except Exception as e:  # a bug in reading the request: one line, not a traceback; the server serves on
            log(f"500 POST /v1/completions: {type(e).__name__}: {e}")
            doc = error_document(f"internal error: {type(e).__name__}: {e}", None, None, "server_error")
            return JSONResponse(doc, status_code=500)
        flight = Inflight(req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        engine.submit(flight.sub)
        if req.stream:
            return StreamingResponse(stream(served, flight, rid, created, req), media_type="text/event-stream")
        try:
            return await unless_gone(request, complete(served, flight, rid, created, req))
        finally:
            flight.cancel()

    return app


async def read_body(request: Request) -> bytes:
    """The request's body, refused (RequestError, 413) once it is past MAX_BODY_BYTES, declared or sent. A body
    past the cap is still read, and dropped, up to DRAIN_BYTES, so a client that sends it all before reading gets
    the refusal instead of a reset connection; one declared longer is refused unread."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_BYTES:
        raise body_too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > DRAIN_BYTES:
            break
        if size <= MAX_BODY_BYTES:
            chunks.append(chunk)
    if size > MAX_BODY_BYTES:
        raise body_too_large()
    return b"".join(chunks)


async def unless_gone(request: Request, answer: Awaitable[Response]) -> Response:
    """`answer`, unless the client disconnects first: then it is cancelled (and the caller cancels the request, so
    the engine drops it) and nobody reads what is returned."""
    task = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return Response(status_code=499)  # nginx's "client closed request": logged nowhere, read by nobody
    finally:  # neither outlives the handler, however it ends (a shutdown cancels it)
        task.cancel()
        gone.cancel()


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body was read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            fix = "--port 0 picks a free port"
        else:
            fix = "--host takes an address of this machine: 127.0.0.1 (the default), ::1 or 0.0.0.0"
        raise KVBenchError(f"cannot listen on {host}:{port}: {why} ({fix})") from None
    return sock


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Server(uvicorn.Server):
    """uvicorn's server, stopping the engine first on SIGINT, SIGTERM or SIGHUP (so streams end at once) and saying
    when it is ready to answer. `stopped_by` is the first signal that stopped it (None: none did)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, on_ready: Callable[[], None]) -> None:
        super().__init__(config)
        self.engine, self.on_ready = engine, on_ready
        self.stopped_by: int | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.stopped_by = sig if self.stopped_by is None else self.stopped_by
        self.engine.stop(timeout=0)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Every stop signal goes to handle_exit while the server runs (an ignored SIGHUP, nohup's, stays ignored);
        unlike uvicorn's own, the signal is not raised again afterwards: serve_forever returns it."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = [s for s in STOP_SIGNALS if s != getattr(signal, "SIGHUP", None) or not _ignored(s)]
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self.on_ready()


def _ignored(sig: int) -> bool:
    return signal.getsignal(sig) is signal.SIG_IGN


def serve_forever(
    engine: Engine, served: Served, sock: socket.socket, on_ready: Callable[[], None], log: Callable[[str], None]
) -> int | None:
    """Run the engine and the HTTP server on `sock` until SIGINT, SIGTERM or SIGHUP, and return that signal (None:
    the server stopped without one); the engine's thread is joined before this returns."""
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
    return server.stopped_by
