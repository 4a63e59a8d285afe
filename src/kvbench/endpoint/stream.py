"""The streaming client for an OpenAI-compatible server: client.py's `Client`, reading a streamed completion event
by event with each token's arrival timed as it comes; every wait bounded, every failure one line.

`StreamClient.stream` POSTs a completion with `"stream": true` and reads its server-sent events line by line,
stamping each event that carries output with `time.perf_counter()` when its line arrives; there the timeout bounds
connecting, the answer's headers and every wait for the next line, so a server that stops sending ends the call
within it whatever the length of the output. Everything else (plain calls, bounded as a whole by the timeout; the
connection; the failures, as client.py's EndpointError and EndpointHTTPError) is the Client's. Each call opens its
own connection, so any number of threads may stream at once.

Beyond the Client's failures, a stream can fail in its own ways (an answer that is not a stream of server-sent
events, a stream that ends before its last token, an event that is not a completion chunk, an error event): each is
an EndpointError naming the URL and the request.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any

from kvbench.endpoint.client import Answer, Client, EndpointError

MAX_LINE = 1 << 20  # a server-sent event line longer than this is not one token's chunk
COMPLETIONS = "/v1/completions"


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


class StreamClient(Client):
    """A Client that also streams completions (module docstring); `timeout` bounds each wait of a stream, and each
    plain call as a whole."""

    ACCEPT = "application/json, text/event-stream"

    def shown(self, a: Answer, most: int = 200) -> str:
        """An error answer's body as a line quotes it; an HTML page (a proxy's, a wrong port's) is named, not
        quoted."""
        text = a.text(most)
        return "an HTML page, not OpenAI's error document" if text.startswith("<") else text

    def stream(self, doc: dict[str, Any], path: str = COMPLETIONS) -> Streamed:
        """POST `doc` (with "stream": true) and read the events until [DONE] (module docstring)."""
        what = f"POST {path} (streamed)"
        with self.failures(what):
            conn = self.connect()
            try:
                out = Streamed(sent=time.perf_counter())
                self.send(conn, "POST", path, doc)
                resp = conn.getresponse()
                if resp.status >= 400:
                    raise self.http_error(what, self.answer(conn, resp, time.monotonic() + self.timeout, what))
                kind = resp.getheader("Content-Type") or ""
                if not kind.startswith("text/event-stream"):
                    raise EndpointError(
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
                raise EndpointError(f"{self.where}: {what} ended before its last token; did the server stop?")
            if len(line) > MAX_LINE:
                raise EndpointError(f"{self.where}: {what} sent an event line over {MAX_LINE >> 20} MiB")
            text = line.decode("utf-8", "replace").strip()
            if not text.startswith("data:"):
                continue  # blank separators, comments (": ping"), event names
            data = text[len("data:") :].strip()
            if data == "[DONE]":
                out.ended = now
                return
            self._take_chunk(self._chunk(data, what), out, now, what)

    def _chunk(self, data: str, what: str) -> dict[str, Any]:
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: arrays nested past the recursion limit
            raise EndpointError(
                f"{self.where}: {what} streamed an event that is not JSON ({data[:80]!r}); is this an "
                "OpenAI-compatible server?"
            ) from None
        if not isinstance(chunk, dict):
            raise EndpointError(f"{self.where}: {what} streamed {data[:80]!r}, not a completion chunk")
        return chunk

    def _take_chunk(self, chunk: dict[str, Any], out: Streamed, now: float, what: str) -> None:
        if "error" in chunk:
            raise EndpointError(f"{self.where}: {what} streamed an error: {_error_text(chunk['error'])}")
        if isinstance(chunk.get("usage"), dict):
            out.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise EndpointError(f"{self.where}: {what} streamed a chunk without choices; is this an OpenAI server?")
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


def _error_text(err: object) -> str:
    if isinstance(err, dict):
        err = err.get("message") or err
    return " ".join(str(err).split())[:200]
