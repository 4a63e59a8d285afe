"""A real `kvbench serve` process for the tests, and a small urllib client for it (no mocked server).

`Server(*args)` starts `python -m kvbench serve --port 0 --device cpu ...`, reads the ready line from its stdout and
stops it with SIGTERM; its stderr (the server's log) is kept in a file the tests read."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

READY = re.compile(r"^kvbench serve: (http://127\.0\.0\.1:(\d+)/v1)$")
START_S = 180  # a loaded 2-core machine imports torch and FastAPI slowly: a deadline, not a speed
ROOT = Path(__file__).resolve().parents[1]


def default_sighup() -> None:
    """In a child, before exec: SIGHUP back to its default action (nohup and some job runners start everything
    with it ignored, and kvbench keeps an ignored SIGHUP ignored)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class Server:
    def __init__(self, *args: str) -> None:
        self.log = Path(tempfile.mkstemp(prefix="kvbench-serve-", suffix=".log")[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "kvbench", "serve", "--port", "0", "--device", "cpu", *args]
        with self.log.open("w") as err:
            # SIGHUP as a terminal leaves it, whatever this run inherited: under nohup the server would keep ignoring it
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, preexec_fn=default_sighup
            )
        self.ready_line = self._ready()
        m = READY.match(self.ready_line)
        assert m, f"not the ready line: {self.ready_line!r}"
        self.url, self.port = m.group(1), int(m.group(2))
        self.base = self.url.removesuffix("/v1")

    def _ready(self) -> str:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(START_S) else ""
        if not line:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"kvbench serve did not start within {START_S} s:\n{self.log.read_text()}")
        return line.rstrip("\n")

    def stderr(self) -> str:
        return self.log.read_text()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then its exit status (it must end by itself within `timeout`); the log stays readable."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        """Stop it (if it still runs) and remove its log."""
        self.stop()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.log.unlink(missing_ok=True)

    # --- HTTP ---------------------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, str]:
        """(status, body, content type) of one request; an HTTP error status is returned, not raised."""
        req = urllib.request.Request(self.base + path, data=body, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers.get("Content-Type", "")

    def post(self, path: str, doc: Any) -> tuple[int, dict]:
        status, body, _ = self.request("POST", path, json.dumps(doc).encode())
        return status, json.loads(body)

    def complete(self, prompt: str | list[int], max_tokens: int, **fields: Any) -> dict:
        """A completion that must succeed (greedy unless `temperature` is given), logprobs of every token."""
        doc = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0, **fields}
        status, out = self.post("/v1/completions", doc)
        assert status == 200, out
        return out

    def metrics(self) -> dict[str, float]:
        status, body, kind = self.request("GET", "/metrics")
        assert status == 200 and kind.startswith("text/plain"), (status, kind)
        rows = [line.split() for line in body.decode().splitlines() if line and not line.startswith("#")]
        return {name: float(value) for name, value in rows}

    def reset(self) -> dict:
        status, out = self.post("/reset_prefix_cache", {})
        assert status == 200, out
        return out

    def stream(self, doc: dict) -> list[str]:
        """The raw server-sent events of a streamed completion, each `data: ...` payload in order."""
        req = urllib.request.Request(self.url + "/completions", data=json.dumps({**doc, "stream": True}).encode())
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.headers.get("Content-Type", "").startswith("text/event-stream"), r.headers
            text = r.read().decode()
        assert text.endswith("\n\n"), text[-200:]
        events = text.split("\n\n")[:-1]
        assert all(e.startswith("data: ") for e in events), events
        return [e.removeprefix("data: ") for e in events]


def tokens(doc: dict) -> list[int]:
    return doc["choices"][0]["token_ids"]


def logprobs(doc: dict) -> list[float]:
    return doc["choices"][0]["logprobs"]["token_logprobs"]


def cached(doc: dict) -> int:
    return doc["usage"]["prompt_tokens_details"]["cached_tokens"]


def greedy_reference(hf_dir: Path):
    """transformers' greedy tokens and their logprobs for a checkpoint, every token recomputed over the whole
    sequence (no cache): prompt, n -> (tokens, logprobs)."""
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    memo: dict[tuple, tuple[list[int], list[float]]] = {}

    def greedy(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        if (tuple(prompt), n) not in memo:
            ids, out, lps = torch.tensor([prompt]), [], []
            with torch.no_grad():
                for _ in range(n):
                    logp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
                    t = int(logp.argmax())
                    out.append(t)
                    lps.append(float(logp[t]))
                    ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
            memo[(tuple(prompt), n)] = (out, lps)
        return memo[(tuple(prompt), n)]

    return greedy


def ids(seed: int, n: int, vocab: int = 500) -> list[int]:
    """`n` seeded random token ids below `vocab`."""
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
