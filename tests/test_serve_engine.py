"""The serving cache in process: the pool's books (hashes, reference counts, LRU, the host tier's copies, reset),
the engine's batches against `generate` one prompt at a time, admission, cancellation, and the serving checks
(serve/scenarios.py) passing on the honest pool and catching each server fault."""

from __future__ import annotations

import pytest
import torch

from kvbench.decode.generate import generate
from kvbench.serve.engine import Done, Engine, Submission, Token
from kvbench.serve.faults import SERVER_FAULTS, HashWithoutParent
from kvbench.serve.pool import KVPool, PoolExhausted
from kvbench.serve.scenarios import run_checks
from tiny import varied_gpt


def pool(blocks: int, host: int = 0, cls: type[KVPool] = KVPool) -> KVPool:
    return cls(2, 2, 4, blocks, 4, torch.float32, "cpu", host)  # 2 layers, 2 heads of 4, blocks of 4 tokens


@pytest.fixture(scope="module")
def model():
    return varied_gpt()


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the pool ------------------------------------------------------------------------------------------------------
def test_a_block_hash_names_its_whole_prefix():
    p = pool(4)
    a = p.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)
    b = p.prefix_hashes([9, 9, 9, 9, 5, 6, 7, 8], 2)
    assert a[1] != b[1] and a == p.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 2)
    bad = pool(4, cls=HashWithoutParent)
    assert bad.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)[1] == bad.prefix_hashes([9, 9, 9, 9, 5, 6, 7, 8], 2)[1]


def test_held_blocks_are_never_evicted_and_cached_ones_go_least_recently_used_first():
    p = pool(3)
    blocks = [p.allocate() for _ in range(3)]
    hashes = p.prefix_hashes(list(range(12)), 3)
    for b, h in zip(blocks, hashes, strict=True):
        p.commit(b, h)
    with pytest.raises(PoolExhausted):
        p.allocate()
    p.release([blocks[2]])
    p.release([blocks[0]])
    assert list(p.evictable) == [blocks[2], blocks[0]] and p.used == 1 and p.available == 2
    assert p.allocate() == blocks[2] and hashes[2] not in p.by_hash  # the oldest cached block, its hash forgotten
    assert p.match(hashes).kinds == ("device", "device")
    p.release([blocks[1]])
    assert p.cached == 2 and p.counters.evictions == 1


def test_the_host_tier_holds_real_copies_and_gives_them_back():
    p = pool(2, host=4)
    tokens = list(range(8))
    hashes = p.prefix_hashes(tokens, 2)
    blocks = [p.allocate(), p.allocate()]
    for b, h in zip(blocks, hashes, strict=True):
        p.k[:, b] = torch.randn(p.k[:, b].shape)
        p.v[:, b] = torch.randn(p.v[:, b].shape)
        p.commit(b, h)
    k0, v0 = p.k[:, blocks[0]].clone(), p.v[:, blocks[0]].clone()
    p.release(blocks)
    other = p.allocate()  # evicts blocks[0] (least recently used): copied to the host first
    p.k[:, other] = 0.0  # the device copy is overwritten
    assert p.counters.swap_out_blocks == 1 and p.host_used == 1 and p.match(hashes).kinds == ("host", "device")
    p.release([other])
    got, host = p.acquire(hashes, 9)
    assert host == 4 and p.counters.swap_in_blocks == 1 and len(got) == 2
    assert torch.equal(p.k[:, got[0]], k0) and torch.equal(p.v[:, got[0]], v0)
    assert (p.counters.queries, p.counters.hits, p.counters.host_hits) == (9, 8, 4)


def test_reset_forgets_both_tiers_but_not_what_a_request_holds():
    p = pool(3, host=2)
    hashes = p.prefix_hashes(list(range(12)), 3)
    blocks = [p.allocate() for _ in range(3)]
    for b, h in zip(blocks, hashes, strict=True):
        p.commit(b, h)
    p.release(blocks[:2])
    p.allocate()  # evicts blocks[0] into the host tier
    assert p.host_used == 1
    assert p.reset() == (1, 1)  # blocks[1] on the device, blocks[0]'s copy on the host; blocks[2] is held
    assert p.match(hashes).kinds == () and hashes[2] in p.by_hash


# --- the engine --------------------------------------------------------------------------------------------------------
def run(engine: Engine, prompts: list[list[int]], n: int, **kw) -> list[list]:
    events: list[list] = [[] for _ in prompts]
    for p, e in zip(prompts, events, strict=True):
        engine.submit(Submission(p, n, emit=e.append, **kw))
    while not all(e and isinstance(e[-1], Done) for e in events):
        engine.step()
    return events


def engine_for(model, blocks: int, max_batch: int = 8, cls: type[KVPool] = KVPool, host: int = 0) -> Engine:
    c = model.config
    return Engine(model, cls(c.n_layer, c.n_head, c.head_dim, blocks, 4, torch.float32, "cpu", host), max_batch, None)


def test_a_batch_of_mixed_lengths_gives_each_prompt_its_own_generation(model):
    prompts = [prompt(i, n) for i, n in enumerate((3, 9, 17, 30))]
    engine = engine_for(model, 64)
    events = run(engine, prompts, 12, logprobs=0)
    assert engine.counters["steps"] == 11  # one decode forward per token for the whole batch
    for p, e in zip(prompts, events, strict=True):
        want = generate(model, [p], 12, cache="dynamic", record_logits=True)
        got = [t for t in e if isinstance(t, Token)]
        assert [t.id for t in got] == want.tokens[0]
        assert want.logits is not None
        ref = [float(torch.log_softmax(lg[0], -1)[t]) for lg, t in zip(want.logits, want.tokens[0], strict=True)]
        assert max(abs(t.logprob - r) for t, r in zip(got, ref, strict=True)) < 1e-5  # type: ignore[operator]
        assert e[-1] == Done("length", len(p), 12, 0)


def test_a_request_that_does_not_fit_yet_waits_and_then_runs(model):
    engine = engine_for(model, 8)  # 32 tokens: one request of 20 + 8 at a time
    a, b = prompt(1, 20), prompt(2, 20)
    events: list[list] = [[], []]
    for p, e in zip((a, b), events, strict=True):
        engine.submit(Submission(p, 9, emit=e.append))
    engine.step()
    assert len(engine.running) == 1 and len(engine.waiting) == 1
    while not all(e and isinstance(e[-1], Done) for e in events):
        engine.step()
    for p, e in zip((a, b), events, strict=True):
        assert [t.id for t in e if isinstance(t, Token)] == generate(model, [p], 9, cache="dynamic").tokens[0]
    assert engine.pool.used == 0


def test_a_cancelled_request_leaves_the_batch_and_its_blocks(model):
    engine = engine_for(model, 16)
    events: list = []
    sub = Submission(prompt(3, 10), 30, emit=events.append)
    engine.submit(sub)
    for _ in range(3):
        engine.step()
    emitted = len(events)
    sub.cancelled.set()
    engine.step()
    assert not engine.running and engine.pool.used == 0 and len(events) == emitted
    assert not any(isinstance(e, Done) for e in events)


def test_the_stop_token_ends_a_request_without_being_returned(model):
    p = prompt(4, 7)
    first = generate(model, [p], 1, cache="dynamic").tokens[0][0]
    c = model.config
    engine = Engine(model, KVPool(c.n_layer, c.n_head, c.head_dim, 8, 4, torch.float32, "cpu"), 4, stop_id=first)
    (events,) = run(engine, [p], 5)
    assert events == [Done("stop", 7, 0, 0)]


# --- the serving checks ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [prompt(10, 6), prompt(11, 13), prompt(12, 9)]


def test_the_honest_pool_passes_every_serving_check(model, prompts):
    rows, _ = run_checks(model, KVPool, prompts, 12)
    assert all(r.passed for r in rows), [(r.name, r.detail) for r in rows if not r.passed]


@pytest.mark.parametrize("name", list(SERVER_FAULTS))
def test_each_server_fault_is_caught_by_its_check_and_only_there(model, prompts, name):
    f = SERVER_FAULTS[name]
    rows, _ = run_checks(model, f.pool, prompts, 12)
    failed = {r.name for r in rows if not r.passed}
    assert f.check in failed, [(r.name, r.detail) for r in rows]
    assert "warm" not in failed and "batch" not in failed  # where every fault is dormant
