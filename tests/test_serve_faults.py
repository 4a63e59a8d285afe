"""The server faults (`kvbench serve --fault NAME`), each shown from outside: a real server with the fault injected
gives wrong tokens or wrong cached-token counts in its scenario, where the honest server gives transformers' tokens
and the counts the cache holds; and each fault is dormant where its registry entry says. `kvbench break NAME` for a
server fault runs the same scenarios in process."""

from __future__ import annotations

import json
import threading
import urllib.request
from dataclasses import dataclass

import jsonschema
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.jsonio import load_schema
from kvbench.serve.faults import SERVER_FAULTS
from serve_client import Server, cached, greedy_reference, ids, tokens

NEW = 24
BLOCKS = 80  # the servers' pool: 1,280 tokens, room for the long request of shared-prefix beside the others


@dataclass
class Seen:
    """A scenario's request as the client saw it, beside what transformers and the cache's contents say."""

    tokens: list[int]
    want: list[int]
    cached: list[int]
    expected: list[int]

    @property
    def tokens_right(self) -> bool:
        return self.tokens == self.want

    @property
    def counts_right(self) -> bool:
        return self.cached == self.expected


def flood(s: Server, seed: int) -> None:
    """Six prompts of 19 blocks each through a pool of 80: every cached block before them is evicted."""
    for i in range(6):
        s.complete(ids(seed + i, 300), 1)


def warm(s: Server, ref) -> Seen:
    s.reset()
    p = ids(40, 40)
    s.complete(p, NEW)
    got = s.complete(p, NEW)
    return Seen(tokens(got), ref(p, NEW)[0], [cached(got)], [32])


def host_hit(s: Server, ref) -> Seen:
    s.reset()
    p = ids(41, 40)
    s.complete(p, NEW)
    flood(s, 100)
    got = s.complete(p, NEW)
    return Seen(tokens(got), ref(p, NEW)[0], [cached(got)], [32])


def distinct_prefix(s: Server, ref) -> Seen:
    """The prompt after a prompt holding its blocks one block later (behind another first block)."""
    s.reset()
    p = ids(42, 40)
    s.complete(ids(43, 16) + p, 1)
    got = s.complete(p, NEW)
    return Seen(tokens(got), ref(p, NEW)[0], [cached(got)], [0])


def reset(s: Server, ref) -> Seen:
    s.reset()
    p = ids(44, 40)
    s.complete(p, NEW)
    flood(s, 200)
    s.reset()
    got = s.complete(p, NEW)
    return Seen(tokens(got), ref(p, NEW)[0], [cached(got)], [0])


def shared_prefix(s: Server, ref) -> Seen:
    """A long request on a cached prompt; once it streams, a second request on the same prompt that ends at its
    first token. The long one (600 tokens: it still decodes when the short one arrives, however loaded the
    machine) allocates blocks after the short one finished."""
    s.reset()
    p, n = ids(45, 40), 600
    s.complete(p, n)
    started, chunks = threading.Event(), []

    def long() -> None:
        doc = {"prompt": p, "max_tokens": n, "temperature": 0, "stream": True}
        req = urllib.request.Request(s.url + "/completions", data=json.dumps(doc).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                if raw.startswith(b"data: {"):
                    chunks.append(json.loads(raw[6:]))
                    started.set()

    reader = threading.Thread(target=long)
    reader.start()
    assert started.wait(120)
    short = s.complete(p, 1)
    reader.join(120)
    got = [c["choices"][0]["token_ids"][0] for c in chunks if c["choices"][0]["token_ids"]]
    return Seen(
        got, ref(p, n)[0], [cached(short), chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]], [32, 32]
    )


SCENARIOS = {
    "warm": warm,
    "host-hit": host_hit,
    "shared-prefix": shared_prefix,
    "distinct-prefix": distinct_prefix,
    "reset": reset,
}


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """A tiny Hugging Face GPT-2 (3 layers, 4 heads of 16, a vocabulary of 500, std 0.1: varied greedy output) with
    GPT-2's context of 1,024 positions, saved to disk."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
    cfg = GPT2Config(n_layer=3, n_head=4, n_embd=64, n_positions=1024, vocab_size=500, initializer_range=0.1)
    d = tmp_path_factory.mktemp("hf-gpt2-1024")
    GPT2LMHeadModel(cfg).eval().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def reference(long_dir):
    return greedy_reference(long_dir)


def test_every_fault_has_a_scenario_here():
    assert {f.check for f in SERVER_FAULTS.values()} <= set(SCENARIOS)


@pytest.mark.parametrize("fault", [None, *SERVER_FAULTS])
def test_a_server_fault_shows_in_its_scenario_and_the_honest_server_passes_every_one(fault, long_dir, reference):
    args = ["--weights", str(long_dir), "--kv-blocks", str(BLOCKS), "--host-blocks", "256"]
    s = Server(*args, *(["--fault", fault] if fault else []))
    try:
        if fault is None:
            for name, scenario in SCENARIOS.items():
                seen = scenario(s, reference)
                assert seen.tokens_right and seen.counts_right, (name, seen)
            return
        f = SERVER_FAULTS[fault]
        assert f"injected server fault {fault}" in s.stderr()
        seen = SCENARIOS[f.check](s, reference)
        if fault == "reset-keeps-host-tier":  # wrong accounting: a "cold" request that reports cached tokens
            assert seen.tokens_right and seen.cached[0] > 0 == seen.expected[0], seen
        elif fault == "hash-without-parent":  # wrong output and wrong accounting
            assert not seen.tokens_right and seen.cached[0] > 0 == seen.expected[0], seen
        else:  # wrong output, the counts as an honest server's
            assert not seen.tokens_right and seen.counts_right, seen
        dormant = SCENARIOS["warm"](s, reference)  # a warm request alone: every fault is dormant there
        assert dormant.tokens_right and dormant.counts_right, dormant
    finally:
        s.close()


def test_break_runs_a_server_fault_in_process_and_catches_it():
    r = CliRunner().invoke(app, "break hash-without-parent -m gpt2-tiny -w random -d cpu -n 8 --json".split())
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, load_schema("break"))  # break's document, whichever fault it shows
    (bug,) = doc["bugs"]
    assert doc["all_detected"] and bug["cache"] == "serve" and bug["caught_by"] == ["distinct-prefix"], bug
    rows = {c["name"]: c for c in bug["checks"]}
    assert not rows["distinct-prefix"]["passed"] and rows["warm"]["passed"] and rows["batch"]["passed"]
    assert bug["location"].startswith("distinct-prefix: the prompt after one holding its blocks"), bug["location"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["break", "freed-block-reused", "--cache", "static"], "lives in kvbench serve's pool, not in a cache"),
        (["break", "nope"], "server faults: freed-block-reused, hit-without-copy"),
    ],
)
def test_break_refuses_a_server_fault_it_cannot_run(args, match):
    r = CliRunner().invoke(app, [*args, "-m", "gpt2-tiny", "-w", "random", "-d", "cpu"])
    assert r.exit_code == 2 and match in r.output and "Traceback" not in r.output, r.output
