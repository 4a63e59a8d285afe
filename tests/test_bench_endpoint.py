"""`bench --endpoint` against a real `kvbench serve` process (gpt2-tiny, random weights, a free port): every phase
measured and written, the figures held to what the server itself reports (its usage, its block-rounded cached
prefix) and to the requests' own rows, the --json document to the bench schema, two runs compared, and a server
that dies mid-run or a run that is stopped keeping what finished.

Skipped, with the reason, where kvbench.serve is not in the tree: these tests need the real server."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import kvbench
from kvbench.cli import app

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("kvbench.serve") is None,
    reason="kvbench.serve is not in this tree: bench --endpoint's tests run against a real kvbench serve",
)

SRC = Path(kvbench.__file__).resolve().parents[1]
BLOCK = 16  # kvbench serve's default --block-size: cached tokens come in whole blocks
READY = "kvbench serve: http://127.0.0.1:"


class Serve:
    """`python -m kvbench serve` on a free port: its URL from the ready line, stdout drained, stderr to a file."""

    def __init__(self, log: Path, *args: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "kvbench", "serve", "--model", "gpt2-tiny", "--weights", "random"]
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [*cmd, "--port", "0", "--device", "cpu", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout or ()], daemon=True).start()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                text = lines.get(timeout=1).strip()
            except queue.Empty:
                assert self.proc.poll() is None, f"kvbench serve exited: {log.read_text()[-2000:]}"
                continue
            if text.startswith(READY):
                self.url = text.removeprefix("kvbench serve: ")
                return
        self.close()
        raise AssertionError("kvbench serve printed no ready line within 240 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Serve(tmp_path_factory.mktemp("serve") / "serve.log")
    yield s.url
    s.close()


def bench(url: str, out: Path, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["bench", "--endpoint", url, "--out", str(out), *args])
    return r.exit_code, r.output


WORKLOAD = ("--prompt-len", "48", "--new-tokens", "8", "--prefix-len", "32", "--requests", "6")


def test_every_phase_is_measured_and_written(served, tmp_path):
    code, output = bench(served, tmp_path / "run", *WORKLOAD, "--concurrency", "1,3", "--cold-warm", "2")
    assert code == 0, output
    run = tmp_path / "run"
    summary, requests = pd.read_csv(run / "summary.csv"), pd.read_csv(run / "requests.csv")
    assert list(zip(summary.phase, summary.concurrency, strict=True)) == [
        ("cold", 1),
        ("warm", 1),
        ("load", 1),
        ("load", 3),
    ]
    assert (summary.status == "ok").all() and list(summary.requests) == [2, 6, 6, 6]
    assert len(requests) == 20 and (requests.status == "ok").all()
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["fill"] == "endpoint" and meta["model"] == "gpt2-tiny"
    assert meta["endpoint"]["prompt_form"] == "token ids" and meta["endpoint"]["cached_tokens_from"] == "stream"
    assert sorted(meta["plots"]) == ["cold_warm.png", "latency.png"]
    for name in meta["plots"]:
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cached_tokens_are_the_servers_block_rounded_prefix(served, tmp_path):
    """The reset empties the cache before every cold request and level; the shared 32-token prefix is two blocks."""
    code, output = bench(served, tmp_path / "run", *WORKLOAD, "--concurrency", "1", "--cold-warm", "2")
    assert code == 0, output
    r = pd.read_csv(tmp_path / "run" / "requests.csv")
    assert (r[r.phase == "cold"].cached_tokens == 0).all()
    assert (r[r.phase == "warm"].cached_tokens == 32).all()
    level = r[r.phase == "load"].sort_values("request")
    assert list(level.cached_tokens) == [0] + [32] * 5  # the first request after the reset computes the prefix
    assert (r.prompt_tokens == 48).all()  # token ids sent as they are
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    cw = meta["cold_vs_warm"]
    assert (cw["prefix_len"], cw["cold_cached_tokens_mean"], cw["warm_cached_tokens_mean"]) == (32, 0, 32)


def test_each_request_row_follows_the_definitions(served, tmp_path):
    code, output = bench(served, tmp_path / "run", *WORKLOAD, "--concurrency", "2", "--cold-warm", "0")
    assert code == 0, output
    r = pd.read_csv(tmp_path / "run" / "requests.csv")
    # kvbench serve streams one token per event, and says in its usage how many it generated
    assert (r.chunks == r.output_tokens).all()
    full = r.finish_reason == "length"
    assert (r[full].output_tokens == 8).all() and (r[~full].finish_reason == "stop").all()
    np.testing.assert_allclose(r.tpot_ms, (r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1), rtol=1e-5)
    # the first token, then every gap, then [DONE]: nothing is counted twice
    assert (r.ttft_ms + r.itl_ms_mean * (r.chunks - 1) <= r.e2e_ms * (1 + 1e-6)).all()
    assert (r.ttft_ms > 0).all() and (r.itl_ms_max >= r.itl_ms_mean).all()
    s = pd.read_csv(tmp_path / "run" / "summary.csv").iloc[0]
    for col, q in (("ttft_ms_p50", 0.5), ("ttft_ms_p99", 0.99), ("tpot_ms_p50", 0.5)):
        assert s[col] == pytest.approx(r[col.rsplit("_", 1)[0]].quantile(q), rel=1e-5)
    assert s.output_tok_s == pytest.approx(r.output_tokens.sum() / s.duration_s, rel=1e-5)
    # two in flight: the level lasts at least as long as its longest request, and less than all of them in a row
    assert r.e2e_ms.max() / 1e3 <= s.duration_s * (1 + 1e-6) <= r.e2e_ms.sum() / 1e3


def test_the_json_document_and_meta_json_follow_the_bench_schema(served, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from kvbench.jsonio import load_schema

    code, output = bench(served, tmp_path / "run", *WORKLOAD, "--concurrency", "2", "--cold-warm", "1", "--json")
    assert code == 0, output
    doc = json.loads(output)
    validator = jsonschema.Draft202012Validator(load_schema("bench"))
    validator.validate(doc)
    validator.validate(json.loads((tmp_path / "run" / "meta.json").read_text()))
    assert [(r["phase"], r["concurrency"]) for r in doc["summary"]] == [("cold", 1), ("warm", 1), ("load", 2)]


def test_compare_reads_two_runs_phase_by_phase(served, tmp_path):
    for name in ("a", "b"):
        code, output = bench(served, tmp_path / name, *WORKLOAD, "--concurrency", "1,2", "--cold-warm", "1")
        assert code == 0, output
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    jsonschema = pytest.importorskip("jsonschema")
    from kvbench.jsonio import load_schema

    jsonschema.Draft202012Validator(load_schema("compare")).validate(doc)
    assert [(x["phase"], x["concurrency"]) for x in doc["rows"]] == [("cold", 1), ("warm", 1), ("load", 1), ("load", 2)]
    assert [x["tpot_n_baseline"] for x in doc["rows"]] == [1, 3, 6, 6] and doc["unmatched"] == []
    assert {x["ttft_verdict"] for x in doc["rows"][2:]} <= {"slower", "faster", "no significant change"}
    assert (tmp_path / "b" / "compare.png").is_file()
    code, output = bench(served, tmp_path / "c", *WORKLOAD, "--concurrency", "4", "--cold-warm", "0")
    assert code == 0, output
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "x")])
    assert r.exit_code == 2, r.output  # load 1 and 2 against load 4, cold and warm against none
    assert "no phase in common" in r.output and "load concurrency 4: only in the candidate" in r.output


def test_bench_baseline_compares_after_the_run(served, tmp_path):
    code, output = bench(served, tmp_path / "a", *WORKLOAD, "--concurrency", "1", "--cold-warm", "0")
    assert code == 0, output
    code, output = bench(
        served, tmp_path / "b", *WORKLOAD, "--concurrency", "1", "--cold-warm", "0", "--baseline", str(tmp_path / "a")
    )
    assert code == 0, output
    assert "compare:" in output and (tmp_path / "b" / "compare.json").is_file()


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvbench", "bench", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_rows(path: Path, rows: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) > rows:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"{path} never had {rows} rows")


LONG = ("--prompt-len", "32", "--new-tokens", "16", "--requests", "1000", "--concurrency", "1", "--cold-warm", "1")


@pytest.mark.slow
def test_a_server_that_dies_mid_run_keeps_the_finished_phases(tmp_path):
    server = Serve(tmp_path / "serve.log")
    try:
        proc = _cli("--endpoint", server.url, "--out", str(tmp_path / "run"), *LONG)
        _wait_for_rows(tmp_path / "run" / "summary.csv", 2, proc)  # cold and warm written
        time.sleep(1.0)  # the level is under way
    finally:
        server.close()  # SIGKILL: no goodbye
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith("error: the server failed during the run: load concurrency 1: --endpoint"), err
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status"] == "failed" and meta["error"]
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert list(summary.phase) == ["cold", "warm", "load"] and list(summary.status[:2]) == ["ok", "ok"]
    assert summary.status[2].startswith("error: ")
    requests = pd.read_csv(tmp_path / "run" / "requests.csv")
    level = requests[requests.phase == "load"]
    assert (level.status.str.startswith("error")).sum() == 1 and (level.status == "ok").sum() == summary.requests[2]


@pytest.mark.slow
def test_sigterm_keeps_the_finished_phases(served, tmp_path):
    proc = _cli("--endpoint", served, "--out", str(tmp_path / "run"), *LONG)
    _wait_for_rows(tmp_path / "run" / "summary.csv", 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status"] == "interrupted" and meta["plots"] == ["cold_warm.png"]
    assert list(pd.read_csv(tmp_path / "run" / "summary.csv").phase) == ["cold", "warm"]
