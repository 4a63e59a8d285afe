"""`verify --endpoint` against servers that misbehave on purpose, and the options careless users give it.

The server here is a throwaway in the standard library (`Fake`): a deterministic "model" (each completion token a
function of the prompt and the step), an honest prefix cache's cached_tokens, /metrics and a reset, and one
`Misbehaviour` at a time: NaN logprobs on warm runs, logprobs that are not numbers, /metrics sizes that are no
counts, a pool too large to flood, prompt_tokens of 0, an answer dripped a byte at a time, JSON nested past Python's
recursion limit, a body shorter than its Content-Length. Each must end in a verdict or one line with a documented
exit status: never a traceback (exit 70), a false pass, or a run that takes hours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvbench.cli import app

ROOT = Path(__file__).resolve().parents[1]
NOWHERE = "http://127.0.0.1:9/v1"  # the discard port: nothing listens there
BLOCK = 16


@dataclass
class Misbehaviour:
    nan_warm: bool = False  # warm answers (a prompt whose prefix is cached) carry NaN logprobs
    null_tops: bool = False  # top_logprobs values are null
    torn: bool = False  # warm answers: token 2 another, and logprobs.tokens cut to one (token_ids and logprobs 4)
    metrics: str | None = None  # /metrics text in place of the honest one
    max_model_len: Any = 4096
    zero_prompt_tokens: bool = False  # usage.prompt_tokens 0 on every answer
    drip_s: float | None = None  # GET /v1/models answered a byte at a time, this long between bytes
    deep_models: bool = False  # GET /v1/models answers '[' nested 100,000 deep
    short_body: bool = False  # completions promise a Content-Length and close after a few bytes
    budget: int | None = None  # completions after this many answer HTTP 500 (a run that would never end, ended)


class Fake(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.bad = Misbehaviour()
        self.lock = threading.Lock()
        self.cached: set[tuple[int, ...]] = set()  # block-boundary prefixes, as an engine's prefix cache keeps them
        self.completions = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def set(self, **bad: Any) -> None:
        with self.lock:
            self.bad, self.cached, self.completions = Misbehaviour(**bad), set(), 0

    def complete(self, body: dict) -> dict:
        prompt = body["prompt"]
        assert isinstance(prompt, list), "the fake takes token ids"
        n, bad = body["max_tokens"], self.bad
        out = [(sum(prompt) * 31 + 7 * i + len(prompt)) % 200 + 3 for i in range(n)]
        with self.lock:
            k = max((b for b in range(BLOCK, len(prompt), BLOCK) if tuple(prompt[:b]) in self.cached), default=0)
            whole = prompt + out
            self.cached |= {tuple(whole[:b]) for b in range(BLOCK, len(whole) + 1, BLOCK)}
        if bad.torn and k:
            out[2] += 1
        lp = float("nan") if bad.nan_warm and k else -1.0
        tops = [{str(t): (None if bad.null_tops else lp), "x": None if bad.null_tops else -3.0} for t in out]
        logprobs = {"tokens": [str(t) for t in out], "token_logprobs": [lp] * n, "top_logprobs": tops}
        if bad.torn and k:
            logprobs["tokens"] = logprobs["tokens"][:1]
        usage = {
            "prompt_tokens": 0 if bad.zero_prompt_tokens else len(prompt),
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": k},
        }
        choice = {"index": 0, "text": " ".join(map(str, out)), "finish_reason": "length", "token_ids": out}
        return {
            "object": "text_completion",
            "model": "fake",
            "choices": [{**choice, "logprobs": logprobs}],
            "usage": usage,
        }

    def metrics(self) -> str:
        if self.bad.metrics is not None:
            return self.bad.metrics
        return f"kvbench_kv_blocks_total 4\nkvbench_kv_block_size {BLOCK}\n"


class Handler(BaseHTTPRequestHandler):
    server: Fake
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send(self, status: int, data: bytes, kind: str = "application/json", length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        bad = self.server.bad
        if self.path == "/v1/models" and bad.drip_s is not None:
            raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: " + b"d" * 200 + b"\r\n\r\n{}"
            try:
                for byte in raw:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(bad.drip_s)
            except OSError:  # the client gave up: as it should
                pass
            return
        if self.path == "/v1/models":
            if bad.deep_models:
                return self.send(200, b"[" * 100_000)
            model = {"id": "fake", "object": "model", "max_model_len": bad.max_model_len, "dtype": "float32"}
            return self.send(200, json.dumps({"object": "list", "data": [model]}).encode())
        if self.path == "/metrics":
            return self.send(200, self.server.metrics().encode(), "text/plain; version=0.0.4")
        self.send(404, b'{"error": {"message": "no route"}}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        fake = self.server
        if self.path == "/reset_prefix_cache":
            with fake.lock:
                fake.cached.clear()
            return self.send(200, b'{"reset": true}')
        with fake.lock:
            fake.completions += 1
            over = fake.bad.budget is not None and fake.completions > fake.bad.budget
        if over:
            return self.send(500, b'{"error": {"message": "the test\'s request budget is spent"}}')
        data = json.dumps(fake.complete(body)).encode()
        if fake.bad.short_body:
            return self.send(200, data[:10], length=len(data))
        self.send(200, data)


@pytest.fixture(scope="module")
def fake():
    server = Fake()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def verify(*args: str):
    return CliRunner().invoke(app, ["verify", "-n", "4", *args])


def no_traceback(r) -> None:
    assert "Traceback" not in r.output and "unexpected" not in r.output, r.output
    assert r.exit_code != 70, r.output


def last_line(r) -> str:
    no_traceback(r)
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), r.output
    return lines[-1]


def rows(r) -> dict[str, dict]:
    no_traceback(r)
    return {row["name"]: row for row in json.loads(r.stdout)["checks"]}


# --- what a hostile server answers --------------------------------------------------------------------------------------
def test_nan_logprobs_on_warm_runs_fail_the_check(fake):
    """Before: |NaN - x| > tol is False, so a warm run whose logprobs were NaN passed as 'drift bounded'."""
    fake.set(nan_warm=True)
    r = verify("--endpoint", fake.url, "--checks", "warm-cold", "--json")
    assert r.exit_code == 1, r.output
    repeat = rows(r)["warm-cold:repeat"]
    assert not repeat["passed"] and "differs by nan" in repeat["detail"], repeat


def test_top_logprobs_that_are_not_numbers_are_read_as_none(fake):
    """Before: float(None) raised TypeError, exit 70."""
    fake.set(null_tops=True)
    r = verify("--endpoint", fake.url, "--checks", "warm-cold", "--json")
    assert r.exit_code == 0, r.output
    assert all(row["passed"] for row in rows(r).values())


def test_logprobs_of_other_lengths_than_the_tokens_are_none(fake):
    """Before: a warm answer with 4 token ids and 4 logprobs but 1 token string reached the near-tie rule, which
    indexed the missing strings: IndexError, exit 70."""
    fake.set(torn=True)
    r = verify("--endpoint", fake.url, "--checks", "warm-cold", "--json")
    assert r.exit_code == 1, r.output
    repeat = rows(r)["warm-cold:repeat"]
    assert not repeat["passed"] and "token 2 differs" in repeat["detail"], repeat


@pytest.mark.parametrize(
    "metrics",
    ["kvbench_kv_blocks_total NaN\nkvbench_kv_block_size 16\n", "kvbench_kv_blocks_total 4\nkvbench_kv_block_size 0\n"],
    ids=["pool NaN", "block size 0"],
)
def test_metrics_sizes_that_are_no_counts_are_none_stated(fake, metrics):
    """Before: int(NaN x 16) raised ValueError; a block size of 0 divided by zero in accounting (exit 70 each)."""
    fake.set(metrics=metrics)
    r = verify("--endpoint", fake.url, "--checks", "evicted,accounting", "--json")
    got = rows(r)
    assert r.exit_code == 0, r.output
    assert got["evicted"]["skipped"] and "reports no KV pool size" in got["evicted"]["detail"], got["evicted"]
    assert got["accounting:cached-tokens"]["passed"], got["accounting:cached-tokens"]


def test_a_pool_too_large_to_flood_is_a_skip_not_hours(fake):
    """Before: a pool of 16 billion tokens in /metrics started a flood of up to 100,000 requests (here: until the
    fake's budget of 60 ran out, then exit 2)."""
    fake.set(metrics="kvbench_kv_blocks_total 1e9\nkvbench_kv_block_size 16\n", budget=60)
    t0 = time.monotonic()
    r = verify("--endpoint", fake.url, "--checks", "evicted", "--json")
    assert r.exit_code == 5, r.output  # every row skipped: nothing checked
    row = rows(r)["evicted"]
    assert row["skipped"] and "past the 10,000 kvbench sends" in row["detail"], row
    assert time.monotonic() - t0 < 30
    assert fake.completions < 10


def test_prompt_tokens_of_zero_end_the_flood_at_its_plan(fake):
    """Before: the flood counted the 0 the engine reported, never reached its target and ran until the budget."""
    fake.set(zero_prompt_tokens=True, budget=60)
    r = verify("--endpoint", fake.url, "--checks", "evicted", "--evict-tokens", "64", "--json")
    assert r.exit_code == 0, r.output
    assert rows(r)["evicted:repeat"]["passed"]


def test_an_answer_dripped_byte_by_byte_ends_at_the_timeout(fake):
    """Before: each read waited up to the time left, and every byte came in time, so 220 bytes at 0.1 s took 22 s
    past a 1 s --timeout."""
    fake.set(drip_s=0.1)
    t0 = time.monotonic()
    r = verify("--endpoint", fake.url, "--timeout", "1")
    took = time.monotonic() - t0
    assert r.exit_code == 2, r.output
    assert "no answer to GET /v1/models within 1 s (--timeout)" in last_line(r)
    assert took < 10, took


def test_json_nested_past_the_recursion_limit_is_not_json(fake):
    """Before: json.loads raised RecursionError, exit 70."""
    fake.set(deep_models=True)
    r = verify("--endpoint", fake.url)
    assert r.exit_code == 2, r.output
    assert "GET /v1/models answered application/json, not JSON" in last_line(r)


def test_a_body_shorter_than_its_content_length_is_a_closed_connection(fake):
    """Before: the truncated body was read as whole and said to be 'not JSON' (is this an OpenAI server?)."""
    fake.set(short_body=True)
    r = verify("--endpoint", fake.url)
    assert r.exit_code == 2, r.output
    assert "closed the connection during POST /v1/completions without a whole answer" in last_line(r)


def test_a_max_model_len_that_is_a_bool_is_none_stated(fake):
    """Before: true was taken as 1, and every run was refused as longer than the engine's context of 1."""
    fake.set(max_model_len=True)
    r = verify("--endpoint", fake.url, "--checks", "warm-cold", "--json")
    assert r.exit_code == 0, r.output


# --- what a careless user types -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, said",
    [
        (["--endpoint", "http://[::1"], "--endpoint 'http://[::1' is not a URL (Invalid IPv6 URL)"),
        (["--endpoint", NOWHERE, "--evict-tokens", str(10**12)], "--evict-tokens 1,000,000,000,000: flooding past"),
        (["--endpoint", NOWHERE, "--prompt-len", str(10**9)], "need requests of 2,250,000,013 tokens, past any"),
        (["--endpoint", NOWHERE, "--new-tokens", str(10**9)], "need requests of 2,000,000,077 tokens, past any"),
        (
            ["--endpoint", NOWHERE, "--batch", "5000", "--prompt-len", "5000"],
            "--batch 5,000: with --endpoint at most 64",
        ),
    ],
)
def test_options_past_any_engine_are_refused_before_a_request(args, said):
    r = verify(*args)
    assert r.exit_code == 2, r.output
    assert said in last_line(r), r.output


def test_a_json_document_stdout_cannot_take_is_one_line():
    """Before: writing the error document to a full stdout raised inside the error handler: a traceback, exit 1."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered: the text left fails at exit
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    with open("/dev/full", "w") as full:
        p = subprocess.run(
            [sys.executable, "-m", "kvbench", "verify", "--endpoint", NOWHERE, "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr
    assert p.stderr.startswith("error: --endpoint http://127.0.0.1:9/v1: connection refused"), p.stderr
