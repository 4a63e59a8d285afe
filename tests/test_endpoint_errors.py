"""`verify --endpoint` when the engine cannot be read: nothing listening, an answer that is not OpenAI's, an HTTP
error, a server that hangs or dies mid-run, a wrong option. Each is one line on stderr and exit 2 (1 when a check
had failed before the server stopped), never a traceback or a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from foreign_engine import Running, Settings, save_tiny_model
from kvbench.cli import app

HERE = Path(__file__).resolve().parent
NOWHERE = "http://127.0.0.1:9/v1"  # the discard port: nothing listens there


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("foreign") / "model")


def verify(*args: str):
    return CliRunner().invoke(app, ["verify", "-n", "4", *args])


def one_line(r) -> str:
    assert "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), r.output
    return lines[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "args, said",
    [
        (["--endpoint", "ftp://127.0.0.1/v1"], "--endpoint 'ftp://127.0.0.1/v1' is not an http(s) URL"),
        (["--endpoint", "127.0.0.1:8000"], "is not an http(s) URL; give one such as http://127.0.0.1:8000/v1"),
        (["--endpoint", NOWHERE, "--reset", "tgi"], "unknown --reset 'tgi'; use kvbench, vllm, sglang, llamacpp, none"),
        (["--endpoint", NOWHERE, "--timeout", "0"], "--timeout 0 must be > 0 seconds"),
        (["--endpoint", NOWHERE, "--checks", "warm,cold"], "unknown --checks warm, cold; choose from warm-cold,"),
        (["--endpoint", NOWHERE, "--evict-tokens", "0"], "--evict-tokens 0 must be >= 1"),
        (["--endpoint", NOWHERE, "--logprob-tol", "-1"], "--logprob-tol -1 must be a finite number >= 0"),
        (["--endpoint", NOWHERE, "--caches", "dynamic"], "--caches chooses what kvbench runs itself; with --endpoint"),
        (["--endpoint", NOWHERE, "--hf", "gpt2"], "--hf chooses what kvbench runs itself"),
        (["--reset", "vllm"], "--reset applies to --endpoint only"),
        (["--timeout", "5"], "--timeout applies to --endpoint only"),
    ],
)
def test_bad_options_are_refused_before_any_request(args, said):
    r = verify(*args)
    assert r.exit_code == 2, r.output
    assert said in one_line(r), r.output


def test_nothing_listening_is_one_line():
    port = free_port()
    r = verify("--endpoint", f"http://127.0.0.1:{port}/v1")
    assert r.exit_code == 2, r.output
    assert one_line(r) == (
        f"error: --endpoint http://127.0.0.1:{port}/v1: connection refused at 127.0.0.1:{port} (GET /v1/models); "
        "is the server running, and on that port?"
    )


def test_the_error_document_under_json():
    port = free_port()
    r = verify("--endpoint", f"http://127.0.0.1:{port}", "--json")
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert doc["passed"] is False and doc["exit_code"] == 2 and "connection refused" in doc["error"], doc


@pytest.mark.parametrize(
    "mode, said",
    [
        (
            "garbage",
            "GET /v1/models answered text/html, not JSON ('<html><body>not an API</body></html>'); is this an ",
        ),
        ("error", "POST /v1/completions answered HTTP 500: internal server error"),
    ],
)
def test_an_answer_that_is_not_openai_is_one_line(model_dir, mode, said):
    with Running(model_dir, Settings(mode=mode)) as url:
        r = verify("--endpoint", url, "--reset", "vllm")
    assert r.exit_code == 2, r.output
    assert said in one_line(r), r.output


def test_a_reset_the_engine_lacks_is_one_line(model_dir):
    with Running(model_dir, Settings(reset="vllm")) as url:
        r = verify("--endpoint", url, "--reset", "sglang")
    assert r.exit_code == 2, r.output
    assert (
        "POST /flush_cache answered HTTP 404: no route /flush_cache; --reset sglang (SGLang: POST /flush_cache) is "
        in one_line(r)
    )


def test_a_run_longer_than_the_engine_takes_is_refused(model_dir):
    with Running(model_dir, Settings()) as url:
        r = verify("--endpoint", url, "--reset", "vllm", "--prompt-len", "300")
    assert r.exit_code == 2, r.output
    assert "--prompt-len 300 and --new-tokens 4 need 688 tokens of context; foreign-tiny takes 512" in one_line(r)


def test_a_hanging_server_ends_at_the_timeout(model_dir):
    with Running(model_dir, Settings(hang_after=3)) as url:
        t0 = time.monotonic()
        r = verify("--endpoint", url, "--reset", "vllm", "--timeout", "1")
        took = time.monotonic() - t0
    assert r.exit_code == 2, r.output
    assert "no answer to POST /v1/completions within 1 s (--timeout); the server hangs" in one_line(r)
    assert took < 60, took  # a margin for a loaded machine: the point is that it ends


def test_a_server_dying_after_a_failed_check_exits_1(model_dir):
    # the probe and warm-cold:repeat's 4 requests are answered (the repeat fails: corrupt warm hits), then it dies
    with Running(model_dir, Settings(mode="corrupt-warm", die_after=6)) as url:
        r = verify("--endpoint", url, "--reset", "vllm")
    assert r.exit_code == 1, r.output
    line = one_line(r)
    assert "closed the connection during POST /v1/completions without a whole answer" in line, line
    assert line.endswith("(after 1 failed check(s): warm-cold:repeat/foreign-tiny)"), line


def test_a_server_killed_mid_run_is_one_line(model_dir):
    """A real process that exits in the middle of answering (os._exit), not a thread that stops."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "foreign_engine.py"), str(model_dir), "--die-after", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().strip()
        assert ready.startswith("foreign engine: http://127.0.0.1:"), ready
        r = verify("--endpoint", ready.split(": ", 1)[1], "--reset", "vllm")
        assert proc.wait(timeout=60) == 3
    finally:
        proc.kill()
        proc.wait()
    assert r.exit_code == 2, r.output
    assert "the server closed the connection during POST /v1/completions without a whole answer" in one_line(r)
