"""`bench --endpoint` refusing what it cannot measure, each with one line and exit 2, before a run folder exists:
bad options (no server needed), a URL where nothing listens, a server that is not OpenAI's (a plain web server),
one that never answers (held to --timeout), and a sweep's run folder given to compare beside an endpoint run's."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app


def bench(tmp_path: Path, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["bench", *args, "--out", str(tmp_path / "run")])
    return r.exit_code, r.output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


URL = "http://127.0.0.1:9/v1"  # never reached: each of these is refused before any request


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--endpoint", URL, "--concurrency", "0"), "--concurrency must be >= 1"),
        (("--endpoint", URL, "--concurrency", "1,x"), "--concurrency must be an integer"),
        (("--endpoint", URL, "--concurrency", ""), "--concurrency is empty"),
        (("--endpoint", URL, "--concurrency", "8", "--requests", "4"), "could never have 8 requests in flight"),
        (("--endpoint", URL, "--requests", "0"), "--requests must be >= 1"),
        (("--endpoint", URL, "--prompt-len", "64", "--prefix-len", "65"), "--prefix-len must be <= 64"),
        (("--endpoint", URL, "--prompt-len", "16,32"), "takes one length"),
        (("--endpoint", URL, "--new-tokens", "0"), "--new-tokens must be >= 1"),
        (("--endpoint", URL, "--reset", "flush"), "unknown --reset 'flush'"),
        (("--endpoint", URL, "--timeout", "0"), "--timeout must be >="),
        (("--endpoint", URL, "--cold-warm", "-1"), "--cold-warm must be >= 0"),
        (("--endpoint", URL, "--caches", "static"), "--caches chooses what kvbench runs itself"),
        (("--endpoint", URL, "--hf", "gpt2"), "--hf chooses what kvbench runs itself"),
        (("--endpoint", URL, "--export", "github-action-benchmark", "x.json"), "--export chooses"),
        (("--endpoint", " "), "--endpoint is empty"),
        (("--endpoint", "ftp://host/v1"), "is not an http(s) URL"),
        (("--endpoint", "http://127.0.0.1:99999/v1"), "the port is not a number"),
        (("--concurrency", "4"), "--concurrency applies to --endpoint only"),
        (("--prefix-len", "4"), "--prefix-len applies to --endpoint only"),
    ],
)
def test_bad_options_are_refused_before_any_request(tmp_path, args, said):
    code, output = bench(tmp_path, *args)
    assert code == 2, output
    assert said in output and output.count("error:") == 1, output
    assert not (tmp_path / "run").exists()


def test_nothing_listening_is_one_line(tmp_path):
    code, output = bench(tmp_path, "--endpoint", f"http://127.0.0.1:{free_port()}/v1")
    assert code == 2, output
    assert "connection refused" in output and "is the server running" in output, output
    assert not (tmp_path / "run").exists()


class _Page(BaseHTTPRequestHandler):
    """A plain web server: an HTML page for every request, the way a wrong port often answers."""

    def _page(self) -> None:
        body = b"<html><body>It works!</body></html>"
        self.send_response(200 if self.path == "/" else 404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _page

    def log_message(self, *args: object) -> None:
        pass


class _Silent(BaseHTTPRequestHandler):
    """A server that takes the request and never answers (until the test ends)."""

    def do_GET(self) -> None:
        time.sleep(5)

    def log_message(self, *args: object) -> None:
        pass


def _serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.fixture
def web_page() -> Iterator[str]:
    yield from _serving(_Page)


@pytest.fixture
def silent() -> Iterator[str]:
    yield from _serving(_Silent)


def test_a_server_that_is_not_openai_is_one_line(tmp_path, web_page):
    code, output = bench(tmp_path, "--endpoint", web_page)
    assert code == 2, output
    assert "GET /v1/models answered HTTP 404: an HTML page" in output, output
    assert "is this an OpenAI-compatible server" in output and output.count("error:") == 1
    assert not (tmp_path / "run").exists()


def test_a_server_that_never_answers_is_held_to_the_timeout(tmp_path, silent):
    started = time.monotonic()
    code, output = bench(tmp_path, "--endpoint", silent, "--timeout", "0.5")
    assert code == 2, output
    assert "no answer to GET /v1/models within 0.5 s (--timeout)" in output, output
    assert time.monotonic() - started < 4.5  # well before the server would have answered
    assert not (tmp_path / "run").exists()


def test_compare_refuses_an_endpoint_run_beside_a_sweep(tmp_path):
    for name, fill in (("a", "endpoint"), ("b", "prefill")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(json.dumps({"schema_version": 1, "fill": fill}))
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert r.exit_code == 2, r.output
    assert "the baseline is a bench --endpoint run" in r.output and "compare two runs of one kind" in r.output


def test_an_endpoint_run_folder_without_its_requests_is_refused(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(json.dumps({"schema_version": 1, "fill": "endpoint"}))
        (tmp_path / name / "summary.csv").write_text("phase,concurrency,prompt_len,prefix_len,new_tokens,status\n")
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert r.exit_code == 2, r.output
    assert "is not a bench --endpoint run folder (no requests.csv)" in r.output


def test_compare_refuses_an_alpha_outside_0_1_for_endpoint_runs_as_for_sweeps(tmp_path):
    """Two committed bench --endpoint folders compared at --alpha 1.5: one line, exit 2, as two sweeps are (a
    comparison that ran would write into --out, never into the committed folder)."""
    run = str(Path(__file__).resolve().parents[1] / "results" / "cpu-2core-serve-gpt2-prefix512")
    r = CliRunner().invoke(app, ["compare", run, run, "--alpha", "1.5", "--out", str(tmp_path / "cmp")])
    assert r.exit_code == 2, r.output
    assert "--alpha must be between 0 and 1, got 1.5" in r.output and "Traceback" not in r.output


def test_a_reset_that_answers_text_is_taken_as_verify_takes_it(tmp_path):
    """SGLang's POST /flush_cache answers a plain sentence: bench's reset takes any 2xx answer, as verify's does,
    and the engine's cache is emptied."""
    from types import SimpleNamespace

    from foreign_engine import Running, Settings, save_tiny_model
    from kvbench.bench.endpoint_probe import reset
    from kvbench.endpoint.resets import get_reset
    from kvbench.endpoint.stream import StreamClient

    model = save_tiny_model(tmp_path / "model")
    running = Running(model, Settings(reset="sglang"))
    with running as url:
        engine = running.server.engine
        engine.device[(1, 2, 3)] = None  # a cached prefix
        reset(StreamClient(url, 10.0), SimpleNamespace(reset=get_reset("sglang")))
        assert not engine.device
