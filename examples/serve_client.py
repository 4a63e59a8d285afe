"""Talk to `kvbench serve` with the standard library: one prompt cold, warm, evicted to the host tier and back, and
after a reset, each with the cached tokens the server reports, its time to first token and its first tokens.

    kvbench serve -m gpt2-tiny -w random --kv-blocks 16 --host-blocks 32 --port 8000 &
    python examples/serve_client.py http://127.0.0.1:8000/v1

or let it start a server of its own on a free port (and stop it with SIGTERM at the end); the options after
--start are kvbench serve's:

    python examples/serve_client.py --start -m gpt2-tiny -w random -d cpu
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

PROMPT = (
    "A serving cache keeps the keys and values of every prompt it has seen, block by block, so that the next "
    "request that starts the same way computes only what is new."
)
FLOODS = [f"Request number {i} asks about something else entirely, with words of its own, " * 6 for i in range(4)]


def post(url: str, doc: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def streamed(url: str, prompt: str, max_tokens: int) -> tuple[float, list[int], int]:
    """(ms to the first token, the token ids, cached tokens) of one greedy streamed completion."""
    doc = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/completions", data=json.dumps(doc).encode())
    t0, first, ids, cached = time.perf_counter(), None, [], 0
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if chunk["choices"][0]["token_ids"] and first is None:
                first = (time.perf_counter() - t0) * 1e3
            ids += chunk["choices"][0]["token_ids"]
            cached = chunk.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", cached)
    return first or 0.0, ids, cached


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        rows = [x.split() for x in r.read().decode().splitlines() if x and not x.startswith("#")]
    return {name: float(value) for name, value in rows}


def tour(url: str) -> None:
    model = json.loads(urllib.request.urlopen(url + "/models", timeout=30).read())["data"][0]
    print(f"model {model['id']}, context {model['max_model_len']} tokens")
    print(f"{'request':<22}{'cached':>7}{'TTFT ms':>9}  first tokens")

    def show(label: str) -> None:
        ms, ids, cached = streamed(url, PROMPT, 8)
        print(f"{label:<22}{cached:>7}{ms:>9.1f}  {ids[:6]}")

    show("cold")
    show("warm (device tier)")
    before = metrics(url)
    for text in FLOODS:  # other prompts fill the device tier: the prompt's blocks go to the host tier
        post(url + "/completions", {"prompt": text, "max_tokens": 1})
    show("back from host tier")
    after = metrics(url)
    moved = {k: int(after[k] - before[k]) for k in after if "swap" in k or "host_tier" in k}
    post(url.removesuffix("/v1") + "/reset_prefix_cache", {})
    show("after a reset")
    print("host tier: " + ", ".join(f"{k.removeprefix('kvbench_')} +{v}" for k, v in moved.items()))
    m = metrics(url)
    print(
        f"prefix cache: {int(m['kvbench_prefix_cache_hits_total'])} of {int(m['kvbench_prefix_cache_queries_total'])} prompt tokens hit"
    )


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "--start":
        tour(argv[0] if argv else "http://127.0.0.1:8000/v1")
        return
    cmd = ["kvbench", "serve", "--port", "0", "--kv-blocks", "16", "--host-blocks", "32", *argv[1:]]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        ready = server.stdout.readline().strip()
        if not ready.startswith("kvbench serve: "):
            sys.exit(f"kvbench serve did not start (exit status {server.wait()})")
        print(ready)
        tour(ready.removeprefix("kvbench serve: "))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    main(sys.argv[1:])
