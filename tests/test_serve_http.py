"""`kvbench serve` as a client sees it: a real server process on a free port, spoken to over HTTP with urllib.

Two servers: gpt2-tiny with random weights (the command line of the docs, held to `kvbench generate`), and a tiny
Hugging Face GPT-2 saved to disk (std 0.1: varied greedy output), held to transformers' GPT2LMHeadModel recomputing
every token. Exactness is asked of every path a prompt's K/V can take: cold, a device-tier hit, a host-tier hit, a
batch of mixed lengths, a request that waited for blocks."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from serve_client import Server, cached, greedy_reference, ids, logprobs, tokens

PROMPT = "The key to fast inference is a cache that keeps every key and value it has computed, so a step"
WARM_ATOL = 1e-5  # a warm hit against the cold run of the same server: the same kernels on the same values
HF_ATOL = 1e-4  # against transformers' eager attention over the whole sequence: summation order differs


@pytest.fixture(scope="module")
def served():
    s = Server("--model", "gpt2-tiny", "--weights", "random", "--kv-blocks", "32", "--host-blocks", "16")
    yield s
    s.close()


@pytest.fixture(scope="module")
def hf_served(hf_dir):
    s = Server("--weights", str(hf_dir), "--kv-blocks", "20", "--host-blocks", "64", "--max-batch", "8")
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(hf_dir):
    return greedy_reference(hf_dir)


def assert_close(got: list[float], want: list[float], atol: float) -> None:
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst <= atol, f"logprobs differ by {worst:.2e} > {atol:g}"


def generate_json(*args: str) -> dict:
    r = CliRunner().invoke(app, ["generate", *args, "-m", "gpt2-tiny", "-w", "random", "-d", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# --- gpt2-tiny, random weights: the documented command line -----------------------------------------------------
def test_ready_line_health_and_models(served):
    assert served.ready_line == f"kvbench serve: http://127.0.0.1:{served.port}/v1"
    assert served.request("GET", "/health")[0] == 200
    status, body, _ = served.request("GET", "/v1/models")
    assert status == 200
    assert json.loads(body) == {
        "object": "list",
        "data": [
            {"id": "gpt2-tiny", "object": "model", "owned_by": "kvbench", "max_model_len": 1024, "dtype": "float32"}
        ],
    }


def test_greedy_equals_generate_cold_and_warm(served):
    served.reset()
    cold = served.complete(PROMPT, 12, model="gpt2-tiny")
    n = cold["usage"]["prompt_tokens"]
    assert n > 16 and cached(cold) == 0, cold["usage"]
    want = generate_json(PROMPT, "-n", "12", "--no-stop")["completions"][0]
    assert tokens(cold) == want["tokens"] and cold["choices"][0]["text"] == want["text"]
    warm = served.complete(PROMPT, 12)
    assert cached(warm) == (n - 1) // 16 * 16 > 0, warm["usage"]
    assert tokens(warm) == want["tokens"]
    assert_close(logprobs(warm), logprobs(cold), WARM_ATOL)
    assert warm["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 12,
        "total_tokens": n + 12,
        "prompt_tokens_details": {"cached_tokens": cached(warm)},
    }
    assert warm["object"] == "text_completion" and warm["id"].startswith("cmpl-") and warm["model"] == "gpt2-tiny"


def test_seeded_sampling_is_reproducible(served):
    """The same seed gives the same tokens, another seed others (sampled from gpt2-tiny's flat distribution, a
    draw is not compared with `generate`'s: logits equal to rounding may still pick another token there)."""
    a = served.complete(PROMPT, 10, temperature=1.0, seed=11)
    b = served.complete(PROMPT, 10, temperature=1.0, seed=11)
    c = served.complete(PROMPT, 10, temperature=1.0, seed=12)
    assert tokens(a) == tokens(b) and tokens(a) != tokens(c)


def test_logprobs_document(served):
    out = served.complete(PROMPT, 4, logprobs=5)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(
        len(top) <= 5 and max(top.values()) == pytest.approx(t)
        for top, t in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True)
    )
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
    assert served.complete(PROMPT, 2, logprobs=None)["choices"][0]["logprobs"] is None


def test_reset_and_the_metrics_count_queries_and_hits(served):
    prompt = PROMPT + " reads the cache"
    served.complete(prompt, 3)
    before = served.metrics()
    warm = served.complete(prompt, 3)
    after = served.metrics()
    n = warm["usage"]["prompt_tokens"]
    assert after["kvbench_prefix_cache_queries_total"] - before["kvbench_prefix_cache_queries_total"] == n
    assert after["kvbench_prefix_cache_hits_total"] - before["kvbench_prefix_cache_hits_total"] == cached(warm) > 0
    assert after["kvbench_generation_tokens_total"] - before["kvbench_generation_tokens_total"] == 3
    assert after["kvbench_kv_blocks_total"] == 32 and after["kvbench_kv_block_size"] == 16
    assert after["kvbench_host_blocks_total"] == 16 and after["kvbench_kv_blocks_used"] == 0
    assert after["kvbench_requests_running"] == 0 and after["kvbench_requests_waiting"] == 0
    assert served.reset()["reset"] is True
    assert cached(served.complete(prompt, 3)) == 0
    assert served.metrics()["kvbench_prefix_cache_hits_total"] == after["kvbench_prefix_cache_hits_total"]


def test_stream_is_server_sent_events(served):
    doc = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    events = served.stream(doc)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 7  # one per token, then the last with the finish reason and the usage
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        assert c["object"] == "text_completion" and len(choice["token_ids"]) == 1 and choice["finish_reason"] is None
        assert len(choice["logprobs"]["token_logprobs"]) == 1
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 6
    whole = served.complete(PROMPT, 6, logprobs=1)
    assert [c["choices"][0]["token_ids"][0] for c in chunks[:-1]] == tokens(whole)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_a_client_that_goes_away_cancels_its_request(served):
    doc = {"prompt": "hi", "max_tokens": 400, "temperature": 0, "stream": True}
    before = served.metrics()["kvbench_generation_tokens_total"]
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(doc), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.readline().startswith(b"data: {")
    conn.close()  # mid-stream: the server sees the disconnect and the engine drops the request
    deadline = time.monotonic() + 60
    while (m := served.metrics())["kvbench_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m["kvbench_requests_running"] == 0 and m["kvbench_kv_blocks_used"] == 0, m
    assert m["kvbench_generation_tokens_total"] - before < 400, "the request ran to its end"
    assert m["kvbench_requests_finished_total"] < m["kvbench_requests_total"]  # it never finished


BAD = [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "max_tokens must be >= 1"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ({"prompt": "hi", "max_tokens": 10**12}, "max_tokens", "past the model's context of 1024"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", "must be an integer"),
    ({"prompt": [7] * 1024, "max_tokens": 1}, "prompt", "leaves no room in the model's context"),
    ({"prompt": [1, 2, 50257], "max_tokens": 1}, "prompt", "token id 50257 is outside the vocabulary"),
    ({"prompt": [1, -3], "max_tokens": 1}, "prompt", "token id -3 is outside the vocabulary"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs must be 0 .. 20"),
    ({"prompt": "hi", "model": "gpt-4"}, "model", "does not exist; this server serves 'gpt2-tiny'"),
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt": []}, "prompt", "prompt is empty"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"max_tokens": 3}, "prompt", "prompt must be a string or a list of token ids"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"prompt": "hi", "echo": True}, "echo", "echo is not supported"),
    ({"prompt": [5] * 300, "max_tokens": 300}, "max_tokens", "needs 38 KV blocks of 16 tokens and the pool holds 32"),
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD, ids=[m for _, _, m in BAD])
def test_a_bad_request_is_400_with_an_error_document_and_the_server_serves_on(served, body, param, message):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, out, kind = served.request("POST", "/v1/completions", raw)
    assert status == 400 and kind.startswith("application/json"), (status, out)
    err = json.loads(out)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and message in err["message"], err
    assert f"400 POST /v1/completions: {err['message']}" in served.stderr()
    assert served.complete("hi", 1)["usage"]["completion_tokens"] == 1


def test_sigterm_ends_the_server_quickly_and_its_requests_with_it(served):
    """The module's last test: it stops the module's server. A request decoding when SIGTERM arrives ends at once
    (its stream closes), the process exits 143 with one line, and it started no process of its own."""
    doc = {"prompt": "hi", "max_tokens": 400, "temperature": 0, "stream": True}
    started, lines = threading.Event(), []

    def read() -> None:
        import urllib.request

        req = urllib.request.Request(served.url + "/completions", data=json.dumps(doc).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                lines.append(raw.decode())
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == served.proc.pid]
    assert not children, f"kvbench serve started processes: {children}"
    t0 = time.monotonic()
    assert served.stop(timeout=60) == 128 + signal.SIGTERM
    took = time.monotonic() - t0
    reader.join(30)
    assert not reader.is_alive() and lines[-2:] == ["data: [DONE]\n", "\n"], lines[-3:]
    assert took < 30, f"{took:.1f} s to stop"  # seconds on an idle machine; the margin is for a loaded one
    assert "error: terminated" in served.stderr()


def _ppid(p: Path) -> int | None:
    try:
        return int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


# --- a tiny Hugging Face GPT-2 on disk: every path against transformers ------------------------------------------------
def test_exact_against_transformers_cold_warm_and_from_the_host_tier(hf_served, reference):
    s = hf_served
    s.reset()
    prompt = ids(1, 40)
    want, want_lp = reference(prompt, 24)
    cold = s.complete(prompt, 24)
    assert tokens(cold) == want and cached(cold) == 0
    assert_close(logprobs(cold), want_lp, HF_ATOL)
    warm = s.complete(prompt, 24)
    assert tokens(warm) == want and cached(warm) == 32
    assert_close(logprobs(warm), logprobs(cold), WARM_ATOL)
    before = s.metrics()
    for seed in (2, 3, 4, 5):  # 7 blocks each in a pool of 20: every cached block of the prompt goes to the host
        s.complete(ids(seed, 100), 1)
    back = s.complete(prompt, 24)
    after = s.metrics()
    assert after["kvbench_host_swap_out_blocks_total"] > before["kvbench_host_swap_out_blocks_total"]
    assert after["kvbench_host_tier_hits_total"] - before["kvbench_host_tier_hits_total"] == 32
    assert after["kvbench_host_swap_in_blocks_total"] - before["kvbench_host_swap_in_blocks_total"] == 2
    assert tokens(back) == want and cached(back) == 32
    assert_close(logprobs(back), logprobs(cold), WARM_ATOL)


def test_a_batch_of_mixed_lengths_decodes_together_and_exactly(hf_served, reference):
    s = hf_served
    s.reset()
    prompts = [ids(10 + i, n) for i, n in enumerate((5, 23, 40, 61))]
    before = s.metrics()["kvbench_decode_steps_total"]
    barrier = threading.Barrier(len(prompts))

    def one(p: list[int]) -> dict:
        barrier.wait()
        return s.complete(p, 40)

    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(one, prompts))
    steps = s.metrics()["kvbench_decode_steps_total"] - before
    for p, out in zip(prompts, outs, strict=True):
        want, want_lp = reference(p, 40)
        assert tokens(out) == want
        assert_close(logprobs(out), want_lp, HF_ATOL)
    assert steps < len(prompts) * 39, f"{steps} decode steps: the requests were not batched"


def test_requests_past_the_pool_wait_for_blocks_and_finish_exactly(hf_served, reference):
    """Three requests of 8 blocks each on a pool of 20: the third waits for the first to finish."""
    s = hf_served
    s.reset()
    prompts = [ids(20 + i, 64) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: s.complete(p, 64), prompts))
    for p, out in zip(prompts, outs, strict=True):
        assert tokens(out) == reference(p, 64)[0]
    assert s.metrics()["kvbench_kv_blocks_used"] == 0


def test_models_names_the_checkpoint(hf_served, hf_dir):
    status, body, _ = hf_served.request("GET", "/v1/models")
    (model,) = json.loads(body)["data"]
    assert status == 200 and model["id"] == str(hf_dir) and model["max_model_len"] == 128


def test_serve_refuses_bad_options_in_one_line():
    for args, match in [
        (["--kv-blocks", "0"], "--kv-blocks must be >= 1"),
        (["--port", "70000"], "--port must be <= 65,535"),
        (["--fault", "nope"], "unknown server fault 'nope'"),
        (["--block-size", "0"], "--block-size must be >= 1"),
    ]:
        r = CliRunner().invoke(app, ["serve", "-m", "gpt2-tiny", "-w", "random", *args])
        assert r.exit_code == 2 and match in r.output and "Traceback" not in r.output, r.output


def test_serve_without_fastapi_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # an environment without the serve extra
    r = CliRunner().invoke(app, ["serve", "-m", "gpt2-tiny", "-w", "random"])
    assert r.exit_code == 2 and "pip install 'kvbench[serve]'" in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_a_port_in_use_is_refused_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(app, ["serve", "-m", "gpt2-tiny", "-w", "random", "--port", str(port)])
    assert r.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in r.output and "--port 0" in r.output, r.output
