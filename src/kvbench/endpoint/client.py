"""The one HTTP client for an OpenAI-compatible server, from the standard library: every call bounded, every
failure one line.

Each call opens its own connection (so threads never share one), waits at most `timeout` seconds for the whole
answer (connecting, the headers and every byte of the body, not per read), and reads at most MAX_BODY bytes. What
can go wrong (nothing listening, a name that does not resolve, no answer in time, a connection closed unanswered, an
answer that is not HTTP, an HTTP error) becomes an `EndpointError` whose message names the URL, the request and the
fix (`Client.failures`); the CLI says it in one line and exits 2. `EndpointHTTPError` is the one kind that carries
the server's status, which probes read to fall back on a request form the server does accept. stream.py's
`StreamClient` is this client reading a streamed completion event by event. `parallel` runs calls on threads and
raises the first one's error.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvbench.errors import KVBenchError, one_line

MAX_BODY = 64 << 20  # an answer larger than this is not a completion
T = TypeVar("T")


class EndpointError(KVBenchError):
    """The server could not be read: unreachable, not OpenAI-compatible, an HTTP error, a broken stream, or no
    answer in time."""


class EndpointHTTPError(EndpointError):
    """The server answered with an HTTP error status (`status`); probes fall back on some (400 or 422: a prompt form
    or a field it does not take; 404: a route it lacks)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    def text(self, most: int = 200) -> str:
        """The body as text, cut to `most` characters on one line (for an error message)."""
        text = " ".join(self.body.decode("utf-8", "replace").split())
        return text if len(text) <= most else text[:most] + "..."


class Client:
    """One server: `url` its OpenAI base (http://HOST:PORT/v1; a URL without /v1 gets it), `timeout` seconds a call
    may take in all. Requests name paths from the server's root: "/v1/completions", "/metrics"."""

    ACCEPT = "application/json"  # the Accept header of every request

    def __init__(self, url: str, timeout: float) -> None:
        try:
            parts = urlsplit(url.strip())
        except ValueError as e:  # an unclosed [ of an IPv6 address
            raise EndpointError(
                f"--endpoint {url!r} is not a URL ({e}); give one such as http://127.0.0.1:8000/v1"
            ) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointError(f"--endpoint {url!r} is not an http(s) URL; give one such as http://127.0.0.1:8000/v1")
        try:
            port = parts.port
        except ValueError:
            raise EndpointError(f"--endpoint {url!r}: the port is not a number from 0 to 65535") from None
        self.url = url.strip()
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.https else 80)
        path = parts.path.rstrip("/")
        self.root = path[: -len("/v1")] if path.endswith("/v1") else path  # resets and /metrics live at the root
        self.timeout = timeout

    @property
    def where(self) -> str:
        return f"--endpoint {self.url}"

    def call(self, method: str, path: str, doc: Any = None) -> Answer:
        """`method` `path` (from the root) with `doc` as a JSON body; any status comes back, failures raise."""
        what = f"{method} {path}"
        with self.failures(what):
            deadline = time.monotonic() + self.timeout
            conn = self.connect()
            with _watchdog(conn, self.timeout) as expired:
                try:
                    self.send(conn, method, path, doc)
                    _left(conn, deadline)
                    resp = conn.getresponse()
                    return self.answer(conn, resp, deadline, what)
                except (OSError, http.client.HTTPException):
                    if expired.is_set():  # the watchdog shut the socket: the call's time is up
                        raise TimeoutError from None
                    raise
                finally:
                    conn.close()

    def call_ok(self, method: str, path: str, doc: Any = None) -> Answer:
        """`call`, with an HTTP error status raised as EndpointHTTPError carrying the server's message."""
        a = self.call(method, path, doc)
        if a.status >= 400:
            raise self.http_error(f"{method} {path}", a)
        return a

    def json(self, method: str, path: str, doc: Any = None, *, empty_ok: bool = False) -> Any:
        """The JSON document a 2xx answer holds (with `empty_ok`, None for a blank body); an HTTP error raises
        EndpointHTTPError with the server's message, any other answer EndpointError saying it is not an
        OpenAI-compatible one."""
        a = self.call_ok(method, path, doc)
        if empty_ok and not a.body.strip():
            return None
        try:
            return json.loads(a.body)
        except (ValueError, RecursionError):  # RecursionError: arrays nested past Python's recursion limit
            raise EndpointError(
                f"{self.where}: {method} {path} answered {a.content_type or 'no content type'}, not JSON "
                f"({self.shown(a, 80)!r}); is this an OpenAI-compatible server?"
            ) from None

    # --- what an error line says ---
    def shown(self, a: Answer, most: int = 200) -> str:
        """An answer's body as an error line quotes it."""
        return a.text(most)

    def said(self, a: Answer) -> str:
        """What an error answer says (error_message, the body quoted as `shown` quotes it)."""
        return error_message(a, self.shown)

    def http_error(self, what: str, a: Answer) -> EndpointHTTPError:
        return EndpointHTTPError(f"{self.where}: {what} answered HTTP {a.status}: {self.said(a)}", a.status)

    # --- the connection and its failures ---
    def connect(self) -> http.client.HTTPConnection:
        """A connection of its own for one call (not opened until the request is sent), each wait bounded by the
        timeout."""
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.timeout)

    def send(self, conn: http.client.HTTPConnection, method: str, path: str, doc: Any) -> None:
        """The request, `doc` as its JSON body, `path` from the server's root."""
        body = None if doc is None else json.dumps(doc).encode()
        headers = {"Accept": self.ACCEPT}
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, (self.root + path) or "/", body=body, headers=headers)

    def answer(
        self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, deadline: float, what: str
    ) -> Answer:
        """The whole answer, each read bounded by what is left of the call's time and the body by MAX_BODY."""
        chunks: list[bytes] = []
        size = 0
        while True:
            _left(conn, deadline)
            chunk = resp.read1(1 << 16)
            if not chunk:
                if resp.length:  # the connection closed before the Content-Length it promised
                    raise http.client.IncompleteRead(b"".join(chunks), resp.length)
                return Answer(resp.status, resp.getheader("Content-Type") or "", b"".join(chunks))
            size += len(chunk)
            if size > MAX_BODY:
                raise EndpointError(f"{self.where}: {what} answered more than {MAX_BODY >> 20} MiB")
            chunks.append(chunk)

    @contextmanager
    def failures(self, what: str) -> Iterator[None]:
        """A context in which every way a call `what` can fail becomes one EndpointError line."""
        try:
            yield
        except TimeoutError:
            raise EndpointError(
                f"{self.where}: no answer to {what} within {self.timeout:g} s (--timeout); the server hangs or is "
                "too slow for this timeout"
            ) from None
        except ConnectionRefusedError:
            raise EndpointError(
                f"{self.where}: connection refused at {self.host}:{self.port} ({what}); is the server running, and "
                "on that port?"
            ) from None
        except socket.gaierror:
            raise EndpointError(f"{self.where}: the host {self.host!r} cannot be resolved") from None
        except (http.client.RemoteDisconnected, http.client.IncompleteRead, ConnectionError) as e:
            raise EndpointError(
                f"{self.where}: the server closed the connection during {what} without a whole answer "
                f"({type(e).__name__}); did it stop?"
            ) from None
        except http.client.HTTPException as e:
            raise EndpointError(f"{self.where}: {what} got an answer that is not HTTP ({one_line(e)})") from None
        except OSError as e:
            raise EndpointError(f"{self.where}: {what} failed: {one_line(e)}") from None


def _expire(conn: http.client.HTTPConnection, expired: threading.Event) -> None:
    """The call's time is up: shut its socket, so whatever read or write it is in ends now."""
    expired.set()
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)


@contextmanager
def _watchdog(conn: http.client.HTTPConnection, timeout: float) -> Iterator[threading.Event]:
    """A timer that shuts `conn`'s socket once `timeout` seconds have passed, so a server dripping its answer a
    byte at a time cannot outlast the call (each read alone is bounded, their sum is not); the event says it fired."""
    expired = threading.Event()
    timer = threading.Timer(timeout, _expire, (conn, expired))
    timer.daemon = True
    timer.start()
    try:
        yield expired
    finally:
        timer.cancel()


def _left(conn: http.client.HTTPConnection, deadline: float) -> None:
    """Bound the next socket operation by what is left of the call's time."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(left)


def server_message(a: Answer) -> str | None:
    """OpenAI's error.message, FastAPI's detail or a message field, where the body is a JSON object holding one."""
    try:
        doc = json.loads(a.body)
    except (ValueError, RecursionError):
        return None
    if isinstance(doc, dict):
        err = doc.get("error")
        for said in (err.get("message") if isinstance(err, dict) else err, doc.get("detail"), doc.get("message")):
            if said:
                return " ".join(str(said).split())[:200]
    return None


def error_message(a: Answer, shown: Callable[[Answer, int], str] = Answer.text) -> str:
    """What an error answer says: the server's message (server_message), else the body's text as `shown` quotes
    it, else "(empty body)"."""
    return server_message(a) or shown(a, 200) or "(empty body)"


def parallel(calls: list[Callable[[], T]]) -> list[T]:
    """Each call on its own thread, all started together; their results in order, or the first error raised here.
    Every HTTP call is bounded by the client's timeout, so the threads end."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = calls[i]()
        except BaseException as e:  # handed to the caller's thread, which raises it
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # a bounded join, so Ctrl-C reaches the main thread
            t.join(0.2)
    if errors:
        raise errors[0]
    return results
