"""`verify --endpoint` against `transformers serve` (the slow tier: it takes a minute or more to start on a CPU).

transformers serve takes text prompts only, ignores `logprobs`, reports no cached tokens and has no reset and no
/metrics: verify compares its answers as text and says in one line per row what it skipped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from foreign_engine import save_tiny_model
from kvbench.cli import app

START_S = 600  # transformers serve on a busy 2-core machine: about 70 s measured, with a wide margin


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"transformers serve exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"transformers serve did not answer within {START_S} s")


@pytest.mark.slow
def test_transformers_serve_passes_with_its_limits_skipped(tmp_path: Path) -> None:
    from transformers.utils import is_serve_available

    if not is_serve_available():
        pytest.skip("transformers serve needs transformers[serving] (fastapi, uvicorn, openai)")
    cli = Path(sys.executable).with_name("transformers")
    if not cli.exists():
        pytest.skip(f"no transformers command beside {sys.executable}")
    model = save_tiny_model(tmp_path / "model", tokenizer=True)
    port = free_port()
    proc = subprocess.Popen(
        [str(cli), "serve", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        ready(url, proc)
        r = CliRunner().invoke(app, ["verify", "--endpoint", url, "--reset", "none", "-n", "8", "--json"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {x["name"]: x for x in doc["checks"]}
    judged = {n for n, x in rows.items() if not x["skipped"]}
    assert judged == {
        "warm-cold:repeat",
        "warm-cold:interleaved",
        "batch-invariance:distinct",
        "batch-invariance:shared-prefix",
    }, rows
    assert all(rows[n]["passed"] for n in judged) and rows["warm-cold:repeat"]["tolerance"].startswith("identical text")
    e = doc["endpoint"]
    assert (e["token_prompts"], e["logprobs"], e["cached_tokens"], e["metrics"]) == (False, False, False, False)
