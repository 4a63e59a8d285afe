"""A streaming client for an OpenAI-compatible server, from the standard library: each token's arrival timed as
it comes, every wait bounded, every failure one line.

`Server` is one base URL (http://HOST:PORT/v1) and the seconds any wait may take. `Server.call` makes a plain call
and returns its JSON document, bounded as a whole by the timeout. `Server.stream` POSTs a completion with
`"stream": true` and reads its server-sent events line by line, stamping each event that carries output with
`time.perf_counter()` when its line arrives; there the timeout bounds connecting, the answer's headers and every
wait for the next line, so a server that stops sending ends the call within it whatever the length of the output.
Each call opens its own connection, so any number of threads may stream at once.

What can go wrong (nothing listening, a name that does not resolve, no answer in time, a connection closed
mid-stream, an answer that is not HTTP or not OpenAI's, an HTTP error status, an error event in the stream)
becomes a `StreamError` naming the URL, the request and, where there is one, the fix; `HTTPStatusError` is the one
kind that carries the server's status, which probes read to fall back on a request form the server does accept.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvbench.errors import KVBenchError, one_line

MAX_BODY = 64 << 20  # a plain answer larger than this is not a completion
MAX_LINE = 1 << 20  # a server-sent event line longer than this is not one token's chunk
COMPLETIONS = "/v1/completions"


class StreamError(KVBenchError):
    """The server could not be read: unreachable, not OpenAI-compatible, an HTTP error, a broken stream, or no
    answer in time."""


class HTTPStatusError(StreamError):
    """The server answered with an HTTP error status (`status`) and the message it gave."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Streamed:
    """One streamed completion as it arrived. Times are time.perf_counter() seconds; `arrivals[i]` is when the
    i-th event carrying output (text or token ids) arrived, `tokens[i]` how many tokens it carried (its token ids'
    count, or 1 where the server sends text alone)."""

    sent: float  # just before the request was written (connecting included after it)
    ended: float = 0.0  # when [DONE] arrived (or the stream closed after a chunk with a finish reason)
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None  # the usage object of the stream's last chunk, where the server sent one
    token_ids: bool = False  # whether the chunks carried token ids (kvbench serve, vLLM with return_token_ids)


class Server:
    """One server: `url` its OpenAI base (http://HOST:PORT/v1; a URL without /v1 gets it), `timeout` the seconds
    any wait may take. Paths are named from the server's root: "/v1/completions", "/reset_prefix_cache"."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StreamError(f"--endpoint {url!r} is not an http(s) URL; give one such as http://127.0.0.1:8000/v1")
        try:
            port = parts.port
        except ValueError:
            raise StreamError(f"--endpoint {url!r}: the port is not a number from 0 to 65535") from None
        self.url = url.strip()
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.https else 80)
        path = parts.path.rstrip("/")
        self.root = path[: -len("/v1")] if path.endswith("/v1") else path
        self.timeout = timeout

    @property
    def where(self) -> str:
        return f"--endpoint {self.url}"

    def call(self, method: str, path: str, doc: Any = None) -> Any:
        """`method` `path` with `doc` as its JSON body: the JSON document of a 2xx answer (None for an empty one),
        the whole call bounded by the timeout."""
        what = f"{method} {path}"
        with self._failures(what):
            conn = self._connect()
            try:
                deadline = time.monotonic() + self.timeout
                self._send(conn, method, path, doc)
                resp = conn.getresponse()
                body = _read_all(conn, resp, deadline, self, what)
            finally:
                conn.close()
        if resp.status >= 400:
            raise HTTPStatusError(f"{self.where}: {what} answered HTTP {resp.status}: {_said(body)}", resp.status)
        if not body.strip():
            return None
        try:
            return json.loads(body)
        except ValueError:
            kind = resp.getheader("Content-Type") or "no content type"
            raise StreamError(
                f"{self.where}: {what} answered {kind}, not JSON ({_said(body, 80)!r}); is this an OpenAI-compatible "
                "server?"
            ) from None

    def stream(self, doc: dict[str, Any], path: str = COMPLETIONS) -> Streamed:
        """POST `doc` (with "stream": true) and read the events until [DONE] (module docstring)."""
        what = f"POST {path} (streamed)"
        with self._failures(what):
            conn = self._connect()
            try:
                out = Streamed(sent=time.perf_counter())
                self._send(conn, "POST", path, doc)
                resp = conn.getresponse()
                if resp.status >= 400:
                    body = _read_all(conn, resp, time.monotonic() + self.timeout, self, what)
                    raise HTTPStatusError(
                        f"{self.where}: {what} answered HTTP {resp.status}: {_said(body)}", resp.status
                    )
                kind = resp.getheader("Content-Type") or ""
                if not kind.startswith("text/event-stream"):
                    raise StreamError(
                        f"{self.where}: {what} answered {kind or 'no content type'}, not a stream of server-sent "
                        "events; the server does not stream completions"
                    )
                self._read_events(resp, out, what)
                return out
            finally:
                conn.close()

    def _read_events(self, resp: http.client.HTTPResponse, out: Streamed, what: str) -> None:
        """Every `data:` line up to [DONE]: output stamped as it arrives, the finish reason and the usage kept."""
        while True:
            line = resp.readline(MAX_LINE + 1)
            now = time.perf_counter()
            if not line:
                if out.finish_reason is not None:  # a server that closes the stream after its last chunk
                    out.ended = now
                    return
                raise StreamError(f"{self.where}: {what} ended before its last token; did the server stop?")
            if len(line) > MAX_LINE:
                raise StreamError(f"{self.where}: {what} sent an event line over {MAX_LINE >> 20} MiB")
            text = line.decode("utf-8", "replace").strip()
            if not text.startswith("data:"):
                continue  # blank separators, comments (": ping"), event names
            data = text[len("data:") :].strip()
            if data == "[DONE]":
                out.ended = now
                return
            self._take_chunk(_chunk(data, self, what), out, now, what)

    def _take_chunk(self, chunk: dict[str, Any], out: Streamed, now: float, what: str) -> None:
        if "error" in chunk:
            raise StreamError(f"{self.where}: {what} streamed an error: {_error_text(chunk['error'])}")
        if isinstance(chunk.get("usage"), dict):
            out.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise StreamError(f"{self.where}: {what} streamed a chunk without choices; is this an OpenAI server?")
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            text = choice.get("text") or ""
            if isinstance(ids, list) and ids:
                out.token_ids = True
            if text or (isinstance(ids, list) and ids):
                out.arrivals.append(now)
                out.tokens.append(len(ids) if isinstance(ids, list) and ids else 1)
                out.text += str(text)
            if choice.get("finish_reason"):
                out.finish_reason = str(choice["finish_reason"])

    # --- the connection and its failures ---
    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.timeout)

    def _send(self, conn: http.client.HTTPConnection, method: str, path: str, doc: Any) -> None:
        body = None if doc is None else json.dumps(doc).encode()
        headers = {"Accept": "application/json, text/event-stream"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, self.root + path, body=body, headers=headers)

    def _failures(self, what: str) -> _Failures:
        return _Failures(self, what)


class _Failures:
    """A context in which every way a call can fail becomes one StreamError line (module docstring)."""

    def __init__(self, server: Server, what: str) -> None:
        self.server, self.what = server, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        if e is not None and isinstance(e, Exception) and not isinstance(e, StreamError):
            raise StreamError(_failure_line(self.server, self.what, e)) from None


def _failure_line(s: Server, what: str, e: Exception) -> str:
    if isinstance(e, TimeoutError | socket.timeout):
        return (
            f"{s.where}: no answer to {what} within {s.timeout:g} s (--timeout); the server hangs or is too slow "
            "for this timeout"
        )
    if isinstance(e, ConnectionRefusedError):
        return f"{s.where}: connection refused at {s.host}:{s.port} ({what}); is the server running, and on that port?"
    if isinstance(e, socket.gaierror):
        return f"{s.where}: the host {s.host!r} cannot be resolved"
    if isinstance(e, http.client.RemoteDisconnected | http.client.IncompleteRead | ConnectionError):
        return f"{s.where}: the server closed the connection during {what} ({type(e).__name__}); did it stop or crash?"
    if isinstance(e, http.client.HTTPException):
        return f"{s.where}: {what} got an answer that is not HTTP ({one_line(e)})"
    if isinstance(e, OSError):
        return f"{s.where}: {what} failed: {one_line(e)}"
    raise e


def _read_all(
    conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, deadline: float, s: Server, what: str
) -> bytes:
    """The whole body, each read bounded by what is left of the call's time and the body by MAX_BODY."""
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if conn.sock is not None:
            conn.sock.settimeout(left)
        chunk = resp.read1(1 << 16)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_BODY:
            raise StreamError(f"{s.where}: {what} answered more than {MAX_BODY >> 20} MiB")
        chunks.append(chunk)


def _chunk(data: str, s: Server, what: str) -> dict[str, Any]:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise StreamError(
            f"{s.where}: {what} streamed an event that is not JSON ({data[:80]!r}); is this an OpenAI-compatible "
            "server?"
        ) from None
    if not isinstance(chunk, dict):
        raise StreamError(f"{s.where}: {what} streamed {data[:80]!r}, not a completion chunk")
    return chunk


def _error_text(err: object) -> str:
    if isinstance(err, dict):
        err = err.get("message") or err
    return " ".join(str(err).split())[:200]


def _said(body: bytes, most: int = 200) -> str:
    """What an error answer says: OpenAI's error.message, FastAPI's detail, a message field, or the body's text."""
    text = " ".join(body.decode("utf-8", "replace").split())
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        for said in (err.get("message") if isinstance(err, dict) else err, doc.get("detail"), doc.get("message")):
            if said:
                return " ".join(str(said).split())[:most]
    if not text:
        return "(empty body)"
    if text.startswith("<"):
        return "an HTML page, not OpenAI's error document"
    return text if len(text) <= most else text[:most] + "..."
