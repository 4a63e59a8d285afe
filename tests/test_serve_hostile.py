"""`kvbench serve` against careless and hostile clients and command lines.

One gpt2-tiny server for the module (pool of 32 blocks, batch of 2), stopped by the last test with SIGHUP. Each bad
request must get OpenAI's error document and one log line, never a traceback or a hang, never a neighbour's
request failed with it; the server serves on. A command line the machine cannot serve is one line and its exit
status before the model loads."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from serve_client import ROOT, Server, tokens

PROMPT = "The key to fast inference is a cache that keeps every key and value it has computed"


@pytest.fixture(scope="module")
def served():
    s = Server("--model", "gpt2-tiny", "--weights", "random", "--kv-blocks", "32", "--max-batch", "2")
    yield s
    s.close()


def openai_error(status: int, body: bytes, kind: str) -> dict:
    assert kind.startswith("application/json"), (status, kind, body[:200])
    doc = json.loads(body)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    return doc["error"]


def wait_idle(s: Server, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while (m := s.metrics())["kvbench_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return m


# --- routes and fields ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "status", "said"),
    [
        ("GET", "/v1/completions", 405, "GET is not allowed on /v1/completions; use POST"),
        ("POST", "/v1/models", 405, "POST is not allowed on /v1/models; use GET"),
        ("GET", "/reset_prefix_cache", 405, "GET is not allowed on /reset_prefix_cache; use POST"),
        ("GET", "/nope", 404, "no route GET /nope; this server answers POST /v1/completions"),
        ("POST", "/v1/chat/completions", 404, "no route POST /v1/chat/completions"),
    ],
)
def test_a_route_or_method_the_server_lacks_is_an_openai_error(served, method, path, status, said):
    """Before: FastAPI's own {"detail": "Not Found"} / {"detail": "Method Not Allowed"}, and no log line."""
    got, body, kind = served.request(method, path, b"{}" if method == "POST" else None)
    err = openai_error(got, body, kind)
    assert got == status and said in err["message"], (got, err)
    assert f"{status} {method} {path}: {err['message']}" in served.stderr()


def test_null_fields_take_their_defaults(served):
    """Before: "max_tokens": null failed an assertion inside the handler: HTTP 500 and a traceback in the log."""
    status, out = served.post("/v1/completions", {"prompt": "hi", "max_tokens": None, "stream": None, "temperature": 0})
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 16 or out["choices"][0]["finish_reason"] == "stop", out
    assert "Traceback" not in served.stderr()


@pytest.mark.parametrize("prompt", [[[[1]]], [["a"]]], ids=["ids nested twice", "a list in a list"])
def test_a_prompt_nested_too_deep_is_the_wrong_type(served, prompt):
    """Before: [[[1]]] was refused as "one prompt per request, got 1"."""
    status, body, kind = served.request("POST", "/v1/completions", json.dumps({"prompt": prompt}).encode())
    err = openai_error(status, body, kind)
    assert status == 400 and err["param"] == "prompt", err
    assert err["message"] == "prompt must be a string or a list of token ids", err


def test_a_tiny_temperature_samples_the_argmax_and_spares_its_neighbour(served):
    """Before: logits / 1e-300 overflowed to inf, the softmax to NaN, and torch.multinomial raised inside the
    engine's step: that request and its running neighbour both ended with HTTP 500."""
    alone = served.complete(PROMPT, 120)
    greedy = served.complete("hi", 6)
    out: list[dict] = []
    neighbour = threading.Thread(target=lambda: out.append(served.complete(PROMPT, 120)))
    neighbour.start()
    deadline = time.monotonic() + 60
    while not served.metrics()["kvbench_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    for t in (1e-300, 1e-40, 5e-324):
        tiny = served.complete("hi", 6, temperature=t, seed=3)
        assert tokens(tiny) == tokens(greedy), t
    neighbour.join(120)
    assert out and tokens(out[0]) == tokens(alone)
    assert "engine step failed" not in served.stderr()


def test_logprobs_past_a_small_vocabulary_are_every_token_in_it():
    """A model of 8 tokens asked for the top 20 (in process: a served model's vocabulary comes from its config).
    Before: topk(20) raised inside the engine's step, failing the request and its neighbour in the batch."""
    import torch

    from kvbench.model.gpt2 import GPT, GPTConfig
    from kvbench.serve.engine import Done, Engine, Submission, Token
    from kvbench.serve.pool import KVPool

    model = GPT(GPTConfig(block_size=64, vocab_size=8, n_layer=1, n_head=2, n_embd=16)).eval()
    c = model.config
    engine = Engine(model, KVPool(c.n_layer, c.n_head, c.head_dim, 8, 4, torch.float32, "cpu"), 4, None)
    asked, neighbour = [], []
    engine.submit(Submission([1, 2, 3], 3, emit=asked.append, logprobs=20))
    engine.submit(Submission([4, 5], 3, emit=neighbour.append))
    while not (asked and isinstance(asked[-1], Done) and neighbour and isinstance(neighbour[-1], Done)):
        engine.step()
    tops = [t.top for t in asked if isinstance(t, Token)]
    assert len(tops) == 3 and all(top is not None and len(top) == 8 for top in tops), tops
    assert neighbour[-1] == Done("length", 2, 3, 0)


# --- bodies and clients -----------------------------------------------------------------------------------------------
def test_a_body_declared_past_the_cap_is_refused_unread(served):
    """Before: the server waited for all 100 GB of it."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Content-Length: 100000000000\r\n\r\n{")
        reply = b""
        while not reply.endswith(b"}}") and (more := sock.recv(65536)):
            reply += more
    status, _, body = reply.decode().partition("\r\n\r\n")
    assert status.startswith("HTTP/1.1 413"), reply[:200]
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_body_sent_past_the_cap_is_413_and_the_server_serves_on(served):
    """Before: 9 MiB of prompt was read, parsed and tokenized on the event loop (60 MB froze every stream for 45 s
    and took 3.4 GB), then refused as past the context."""
    body = json.dumps({"prompt": "a" * (9 << 20), "max_tokens": 1}).encode()
    status, out, kind = served.request("POST", "/v1/completions", body)
    err = openai_error(status, out, kind)
    assert status == 413 and err["code"] == "request_too_large", (status, err)
    assert f"413 POST /v1/completions: {err['message']}" in served.stderr()
    assert served.complete("hi", 1)["usage"]["completion_tokens"] == 1


def test_a_client_that_goes_away_before_its_whole_answer_cancels_it(served):
    """Before: only a stream noticed its client leave; a plain request decoded all its max_tokens for nobody."""
    before = served.metrics()["kvbench_generation_tokens_total"]
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    doc = {"prompt": "hi", "max_tokens": 400, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(doc), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while not served.metrics()["kvbench_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.close()
    m = wait_idle(served)
    assert m["kvbench_requests_running"] == 0 and m["kvbench_kv_blocks_used"] == 0, m
    assert m["kvbench_generation_tokens_total"] - before < 400, "the request ran to its end for nobody"


# --- the command line -----------------------------------------------------------------------------------------------
def test_a_host_that_is_no_address_names_host_not_port():
    """Before: "cannot listen on nowhere.invalid:0: ... (--port 0 picks a free port)", the wrong fix."""
    r = CliRunner().invoke(
        app, ["serve", "-m", "gpt2-tiny", "-w", "random", "--host", "nowhere.invalid", "--port", "0"]
    )
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "cannot listen on nowhere.invalid:0" in r.output and "--host takes an address" in r.output, r.output


def test_both_tiers_on_the_cpu_past_memory_together_is_exit_3(monkeypatch):
    """On the CPU the device tier and the host tier take the same memory. Before: each was held to the memory
    available alone, so two tiers of 0.6 x it each passed, and the model loaded."""
    import torch

    import kvbench.devices
    import kvbench.serve.app
    from kvbench.model.weights import peek_config
    from kvbench.serve.rules import pool_bytes

    available = pool_bytes(peek_config("gpt2-tiny", "random"), 1000, 16, torch.float32)
    monkeypatch.setattr(kvbench.devices, "available_memory_bytes", lambda device: available)

    def served(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(kvbench.serve.app, "serve_forever", served)
    args = ["serve", "-m", "gpt2-tiny", "-w", "random", "-d", "cpu", "--port", "0"]
    r = CliRunner().invoke(app, [*args, "--kv-blocks", "600", "--host-blocks", "600"])
    assert r.exit_code == 3, r.output
    assert "--kv-blocks 600 and --host-blocks 600 blocks of 16 tokens of gpt2-tiny's K/V need" in r.output, r.output
    assert "together (the device is the CPU)" in r.output


def test_sigint_ends_it_with_130_even_where_its_parent_ignored_sigint():
    """A shell script's background job starts with SIGINT ignored; uvicorn catches it all the same. Before: the
    server stopped but exited 0, saying nothing."""
    cmd = [sys.executable, "-m", "kvbench", "serve", "-m", "gpt2-tiny", "-w", "random", "-d", "cpu", "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=ignore)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("kvbench serve: http://")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted", err


# --- last: stops the module's server ----------------------------------------------------------------------------------
def test_sighup_ends_it_like_sigterm(served):
    """Before: SIGHUP raised Terminated inside uvicorn's event loop: "Exception in ASGI application" and two
    tracebacks in the log, and the stream in flight cut off with no error event and no [DONE]."""
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
        doc = {"prompt": "hi", "max_tokens": 400, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(doc), {"Content-Type": "application/json"})
        r = conn.getresponse()
        for raw in r:
            lines.append(raw.decode())
            started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    served.proc.send_signal(signal.SIGHUP)
    assert served.proc.wait(60) == 128 + signal.SIGHUP
    reader.join(30)
    assert lines[-2:] == ["data: [DONE]\n", "\n"], lines[-4:]
    assert any("the server is shutting down" in line for line in lines[-4:]), lines[-4:]
    log = served.stderr()
    assert "Traceback" not in log and log.strip().splitlines()[-1] == "error: terminated (SIGHUP)", log
