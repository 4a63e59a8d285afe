"""The static-graph, paged and int8 caches: exactness (or documented error), the fixed-shape decode step, paging's
block accounting, and int8's quantisation bound. CUDA-graph tests run only where CUDA is available."""

import os
import re
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from kvbench.caches import CACHES, make_caches
from kvbench.caches.int8 import Int8Cache, dequantize, quantize
from kvbench.caches.paged import BlockAllocator, PagedCache, paged_memory_report
from kvbench.caches.static import StaticCache
from kvbench.caches.static_graph import StaticGraphCache
from kvbench.check.faults import FAULTS, get_fault
from kvbench.check.verify import run_verify
from kvbench.decode.fixed_step import FixedShapeDecoder, runner_for
from kvbench.decode.generate import EXACT, generate
from kvbench.decode.rules import compile_mode
from kvbench.errors import CacheOverflowError
from kvbench.model import gemv, operators
from kvbench.model.gpt2 import GPT, PRESETS, GPTConfig

MASK_FAULT = FAULTS["mask"].rules  # the loop's rules with SDPA's causal flag left on in decode

MINE = ["static-graph", "paged", "int8"]
MINE_EXACT = [n for n in MINE if CACHES[n].exact]
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43, 38, 32], [7, 9, 400, 12, 5, 5, 301]]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")


def _logits(res) -> torch.Tensor:
    return torch.stack(res.logits)  # (N, B, V)


# --- registry: my caches are registered, exact ones are exact against the no-cache path --------------------------
def test_caches_are_registered_with_honest_flags():
    assert all(n in CACHES for n in MINE)
    assert CACHES["static-graph"].exact and CACHES["paged"].exact
    spec = CACHES["int8"]
    assert not spec.exact and 0 < spec.logit_atol <= 0.5 and 0 < spec.min_greedy_agreement < 1
    assert CACHES["static-graph"].fixed_step


@pytest.mark.parametrize("name", MINE_EXACT)
def test_exact_caches_equal_no_cache_single_and_batched(tiny_model, name):
    """fp32, 1e-5: one prompt alone, and three prompts of mixed lengths left-padded into one batch."""
    for prompts in ([PROMPTS[0]], PROMPTS):
        ref = generate(tiny_model, prompts, 24, cache="none", record_logits=True)
        got = generate(tiny_model, prompts, 24, cache=name, record_logits=True)
        assert got.tokens == ref.tokens, name
        assert len(set(ref.tokens[0])) > 5, "degenerate greedy output would hide bugs"
        torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-5, atol=1e-5, msg=name)


# --- static-graph: the fixed-shape step -----------------------------------------------------------------------
def test_generate_runs_the_fixed_shape_step_and_equals_static(tiny_model):
    cfg = tiny_model.config
    n_new = 20
    caches = make_caches("static-graph", cfg, 3, 11 + n_new, torch.float32, "cpu")
    got = generate(tiny_model, PROMPTS, n_new, cache="static-graph", record_logits=True, caches=caches)
    runner = caches[0].runner
    assert isinstance(runner, FixedShapeDecoder)
    assert runner.fixed_steps == n_new - 1, "every decode step must go through the fixed-shape step"
    assert runner.captures == 0 and not runner.use_graph  # no graph on the CPU
    ref = generate(tiny_model, PROMPTS, n_new, cache="static", record_logits=True)
    assert got.tokens == ref.tokens
    torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-5, atol=1e-5)
    # Reusing the caches reuses the runner (on CUDA: the captured graph).
    generate(tiny_model, PROMPTS, 5, cache="static-graph", caches=caches)
    assert caches[0].runner is runner and runner.fixed_steps == n_new - 1 + 4


def test_runner_is_rebuilt_when_the_parameters_move(tiny_model):
    """A captured graph replays reads of the addresses it recorded: after `model.to(...)` gives the parameters new
    storage (the old freed), the runner must be rebuilt, and an old one refuses to run; an in-place weight update
    keeps the storage, so the runner (and its graph) stays valid."""
    import copy

    model = copy.deepcopy(tiny_model)
    caches = make_caches("static-graph", model.config, 1, 40, torch.float32, "cpu")
    generate(model, [PROMPTS[0]], 5, cache="static-graph", caches=caches)
    runner = caches[0].runner
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(1.0)  # in place: same storage
    assert runner_for(model, caches) is runner
    model.to(torch.float64)  # new tensors for every parameter
    assert not runner.matches(model, caches)
    ids = torch.tensor([PROMPTS[0]])
    with pytest.raises(AssertionError, match="stale"):
        runner(ids, torch.arange(ids.size(1))[None], caches)  # the next generation's prefill
    fresh = runner_for(model, caches)
    assert fresh is not runner and caches[0].runner is fresh and fresh.matches(model, caches)


def test_fixed_step_never_reads_the_unfilled_tail(tiny_model):
    """Attention reads the whole (B, H, max_len, Dh) buffer; the device-computed length mask must hide the tail."""
    cfg = tiny_model.config
    ref = generate(tiny_model, PROMPTS, 12, cache="static", record_logits=True)
    caches = make_caches("static-graph", cfg, 3, 64, torch.float32, "cpu")
    for c in caches:
        c.k.fill_(1e4)  # garbage everywhere; the prefill and each step overwrite only the columns they fill
        c.v.fill_(-1e4)
    got = generate(tiny_model, PROMPTS, 12, cache="static-graph", record_logits=True, caches=caches)
    assert caches[0].runner.fixed_steps == 11
    torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-5, atol=1e-5)


def test_static_graph_cache_through_plain_forward_uses_the_models_tail_mask(tiny_model):
    """Without the runner a decode step's update returns the whole buffer; model.py's AttentionMask hides the tail."""
    cfg = tiny_model.config
    ids = torch.tensor([PROMPTS[0]])
    T = ids.size(1)
    caches = make_caches("static-graph", cfg, 1, T + 8, torch.float32, "cpu")
    for c in caches:
        c.k.fill_(1e4)
        c.v.fill_(-1e4)
    with torch.inference_mode():
        tiny_model(ids, torch.arange(T)[None], caches)
        nxt = torch.tensor([[7]])
        step = tiny_model(nxt, torch.tensor([[T]]), caches)[:, -1]
        full = tiny_model(torch.cat([ids, nxt], 1), torch.arange(T + 1)[None])[:, -1]
    assert caches[0].runner is None and caches[0].length == T + 1
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_fixed_step_overflow_names_capacity(tiny_model):
    caches = make_caches("static-graph", tiny_model.config, 1, 5, torch.float32, "cpu")
    with torch.inference_mode():
        tiny_model(torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5)[None], caches)
        runner = runner_for(tiny_model, caches)
        with pytest.raises(CacheOverflowError, match="capacity 5"):
            runner(torch.tensor([[6]]), torch.tensor([[5]]), caches)


def test_runner_rebuilt_when_the_mask_rule_changes(tiny_model):
    """A captured graph bakes in the mask rule it was built with; the `mask` fault must not replay a stale graph."""
    caches = make_caches("static-graph", tiny_model.config, 1, 32, torch.float32, "cpu")
    clean = generate(tiny_model, [PROMPTS[0]], 8, cache="static-graph", caches=caches)
    first = caches[0].runner
    broken = generate(tiny_model, [PROMPTS[0]], 8, cache="static-graph", caches=caches, rules=MASK_FAULT)
    assert caches[0].runner is not first
    assert broken.tokens != clean.tokens, "the mask fault must show through the fixed-shape step"
    again = generate(tiny_model, [PROMPTS[0]], 8, cache="static-graph", caches=caches)
    assert again.tokens == clean.tokens


# --- paged: block accounting ---------------------------------------------------------------------------------
def test_allocator_allocates_frees_and_reuses():
    a = BlockAllocator(4)
    got = [a.allocate() for _ in range(3)]
    assert got == [0, 1, 2] and a.num_used == 3 and a.num_free == 1
    a.free([1])
    assert a.num_used == 2 and a.allocate() == 1, "a freed block is handed out again first"
    a.allocate()
    with pytest.raises(CacheOverflowError, match="all 4 blocks"):
        a.allocate()
    with pytest.raises(AssertionError):
        a.free([1, 1])


def _rand(H, T, Dh, seed):
    return torch.randn(H, T, Dh, generator=torch.Generator().manual_seed(seed))


def test_paged_sequence_spanning_many_blocks_reads_back_exactly():
    H, Dh, bs = 2, 8, 4
    cache = PagedCache(1, H, Dh, num_blocks=32, dtype=torch.float32, device="cpu", block_size=bs, max_len=100)
    k, v = _rand(H, 37, Dh, 0), _rand(H, 37, Dh, 1)
    cache.append(0, k[:, :5], v[:, :5])  # a chunk, then one token at a time, as prefill + decode would
    for t in range(5, 37):
        cache.append(0, k[:, t : t + 1], v[:, t : t + 1])
    assert len(cache.tables[0]) == 10 and cache.allocator.num_used == 10  # ceil(37 / 4)
    rk, rv = cache.read(0)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_paged_mixed_lengths_interleaved_blocks_free_and_reuse():
    H, Dh, bs = 2, 8, 4
    lens = [3, 9, 14]
    cache = PagedCache(3, H, Dh, num_blocks=12, dtype=torch.float32, device="cpu", block_size=bs, max_len=16)
    data = {s: (_rand(H, n, Dh, 10 + s), _rand(H, n, Dh, 20 + s)) for s, n in enumerate(lens)}
    for t in range(max(lens)):  # round-robin token by token: the sequences' blocks interleave in the pool
        for s, n in enumerate(lens):
            if t < n:
                cache.append(s, data[s][0][:, t : t + 1], data[s][1][:, t : t + 1])
    assert [len(t) for t in cache.tables] == [1, 3, 4]
    assert cache.tables == [[0], [1, 3, 5], [2, 4, 6, 7]], "blocks are handed out as sequences grow: interleaved"
    for s in range(3):
        rk, rv = cache.read(s)
        assert torch.equal(rk, data[s][0]) and torch.equal(rv, data[s][1])
    assert cache.used_bytes == 8 * cache.block_bytes
    freed = list(cache.tables[1])
    cache.free(1)
    assert cache.allocator.num_used == 5 and cache.seq_lens[1] == 0
    cache.append(1, data[0][0][:, :2], data[0][1][:, :2])  # a new sequence in slot 1 reuses a freed block
    assert cache.tables[1][0] in freed
    for s in (0, 2):  # the others are untouched
        assert torch.equal(cache.read(s)[0], data[s][0])
    with pytest.raises(CacheOverflowError, match="capacity 16"):
        cache.append(2, data[2][0][:, :3], data[2][1][:, :3])


def test_paged_batched_update_returns_the_static_view_and_reset_frees_all():
    B, H, T, Dh = 2, 3, 21, 4
    paged = PagedCache(B, H, Dh, num_blocks=12, dtype=torch.float32, device="cpu", block_size=4, max_len=24)
    static = StaticCache(B, H, 24, Dh, torch.float32, "cpu")
    k, v = torch.randn(B, H, T, Dh), torch.randn(B, H, T, Dh)
    for chunk in (slice(0, 9), *[slice(t, t + 1) for t in range(9, T)]):
        pk, pv = paged.update(k[:, :, chunk], v[:, :, chunk], None)
        sk, sv = static.update(k[:, :, chunk], v[:, :, chunk], None)
        assert torch.equal(pk, sk) and torch.equal(pv, sv)
    assert paged.length == T and paged.allocator.num_used == B * 6  # ceil(21 / 4) each
    assert paged.bytes_copied > 0  # the gather re-reads history (no paged-attention kernel)
    paged.reset()
    assert paged.allocator.num_used == 0 and paged.length == 0 and paged.tables == [[], []]


def test_paged_memory_report_mixed_lengths():
    cfg = PRESETS["gpt2"]
    rep = paged_memory_report(cfg, [5, 16, 17, 100], max_len=128, dtype=torch.float16)
    per_token = cfg.kv_bytes_per_token(2)  # 36864 bytes: 2 x 12 layers x 768 x 2 bytes
    assert rep.blocks_used == 1 + 1 + 2 + 7
    assert rep.paged_bytes == 11 * 16 * per_token
    assert rep.static_bytes == 4 * 128 * per_token
    assert rep.needed_bytes == 138 * per_token
    assert rep.paged_bytes < rep.static_bytes and rep.saving == pytest.approx(1 - 176 / 512)
    assert rep.paged_waste == pytest.approx(1 - 138 / 176) and rep.static_waste == pytest.approx(1 - 138 / 512)


# --- int8: the quantisation bound, memory, and its documented error ---------------------------------------------
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_int8_error_is_at_most_half_a_scale_step(scale_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 64, generator=g) * torch.logspace(-3, 2, 40)[None, None, :, None]  # many magnitudes
    x[0, 0, 5] = 0.0  # an all-zero row: scale 0, dequantises to zeros
    x[1, 2, 7, 3] = 1e3  # one outlier dominates its row's scale
    q, scale = quantize(x, scale_dtype)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, 40, 1) and scale.dtype == scale_dtype
    assert int(q.abs().max()) <= 127
    err = (dequantize(q, scale, torch.float32) - x).abs()
    bound = scale.float() / 2 * (1 + 1e-6) + 1e-12
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0, "quantisation should not be lossless on random data"
    assert torch.equal(dequantize(q, scale, torch.float32)[0, 0, 5], torch.zeros(64))


def test_int8_cache_update_and_memory_ratio():
    B, H, L, Dh = 2, 12, 32, 64
    c16 = Int8Cache(B, H, L, Dh, torch.float16, "cpu")
    ref16 = StaticCache(B, H, L, Dh, torch.float16, "cpu")
    assert c16.nbytes / ref16.nbytes == pytest.approx(66 / 128)  # (Dh + a 2-byte scale) / (Dh x 2 bytes)
    c32 = Int8Cache(B, H, L, Dh, torch.float32, "cpu")
    assert c32.nbytes / StaticCache(B, H, L, Dh, torch.float32, "cpu").nbytes == pytest.approx(68 / 256)
    k, v = torch.randn(B, H, 5, Dh), torch.randn(B, H, 5, Dh)
    ko, vo = c32.update(k, v, None)
    assert ko.shape == (B, H, 5, Dh) and ko.dtype == torch.float32
    step = c32.k_scale[:, :, :5] / 2
    assert bool(((ko - k).abs() <= step * (1 + 1e-6)).all()) and not torch.equal(ko, k)
    ko, vo = c32.update(k[:, :, :1], v[:, :, :1], None)
    assert ko.shape == (B, H, 6, Dh) and c32.length == 6


def test_int8_within_its_documented_tolerance(tiny_model):
    spec = CACHES["int8"]
    prompt = PROMPTS[0]
    res = generate(tiny_model, [prompt], 40, cache="int8", record_logits=True)
    got = res.tokens[0]
    with torch.inference_mode():
        ids = torch.tensor([prompt + got[:-1]])
        full = tiny_model(ids, torch.arange(ids.size(1))[None])[0, len(prompt) - 1 :]  # (40, V)
    err = float((torch.stack([r[0] for r in res.logits]) - full).abs().max())
    agree = float((full.argmax(-1) == torch.tensor(got)).float().mean())
    assert 1e-6 < err <= spec.logit_atol, err  # lossy (not silently exact) and within the documented bound
    assert agree >= spec.min_greedy_agreement, agree


# --- CUDA: the captured graph (skipped on machines without CUDA) ------------------------------------------------
def _cuda_model(dtype):
    cfg = GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=128, vocab_size=500)
    return GPT(cfg).init_weights(seed=0, std=0.1).to("cuda", dtype).eval()


@cuda
def test_cuda_graph_replay_equals_eager_static_fp32():
    model = _cuda_model(torch.float32)
    caches = make_caches("static-graph", model.config, 3, 11 + 30, torch.float32, "cuda")
    got = generate(model, PROMPTS, 30, cache="static-graph", record_logits=True, caches=caches)
    runner = caches[0].runner
    assert runner.use_graph and runner.captures == 1 and runner.fixed_steps == 29
    ref = generate(model, PROMPTS, 30, cache="static", record_logits=True)
    assert got.tokens == ref.tokens
    torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-5, atol=1e-5)
    again = generate(model, PROMPTS, 30, cache="static-graph", record_logits=True, caches=caches)
    assert runner.captures == 1, "reused caches replay the graph captured before"
    assert again.tokens == got.tokens


@cuda
def test_cuda_graph_fp16_agrees_with_static():
    model = _cuda_model(torch.float16)
    got = generate(model, PROMPTS, 30, cache="static-graph", record_logits=True)
    ref = generate(model, PROMPTS, 30, cache="static", record_logits=True)
    diff = (_logits(got)[:5] - _logits(ref)[:5]).abs().max()
    assert float(diff) < 5e-2, float(diff)


@cuda
@pytest.mark.slow
def test_cuda_graph_of_compiled_step_equals_eager():
    model = _cuda_model(torch.float32)
    caches = make_caches("static-graph", model.config, 3, 11 + 12, torch.float32, "cuda")
    caches[0].runner = FixedShapeDecoder(model, caches, compile="default")
    got = generate(model, PROMPTS, 12, cache="static-graph", record_logits=True, caches=caches, compile="default")
    assert caches[0].runner.compile and caches[0].runner.captures == 1
    ref = generate(model, PROMPTS, 12, cache="static", record_logits=True)
    torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-4, atol=1e-4)


def test_static_graph_cache_is_a_static_cache():
    c = StaticGraphCache(1, 2, 8, 4, torch.float32, "cpu")
    k, _ = c.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), None)
    assert k.shape == (1, 2, 3, 4)  # prefill: the filled prefix (SDPA's causal fast path)
    k, _ = c.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), None)
    assert k.shape == (1, 2, 8, 4) and c.length == 4 and c.bytes_copied == 0  # decode: the whole buffer


# --- static-graph compiled on the CPU: --compile default and max ------------------------------------------------------
@pytest.mark.parametrize("mode", ["off", "default", "max"])
def test_compile_modes_are_accepted(mode):
    assert compile_mode(mode, "cpu") == mode and compile_mode(mode) == mode


@pytest.mark.parametrize(
    "text, device, match",
    [
        ("1", "cpu", "use off"),
        ("fast", "cpu", "use off"),
        ("MAX", None, "use off"),
        ("max", "cuda", "default"),
    ],
)
def test_compile_mode_refuses_unknown_values_and_max_off_the_cpu(text, device, match):
    from kvbench.errors import KVBenchError

    with pytest.raises(KVBenchError, match=match):
        compile_mode(text, device)


def _small_model() -> GPT:
    """Small enough that Inductor compiles (and autotunes) its step in seconds; vocabulary large enough for varied
    greedy output."""
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=512)
    return GPT(cfg).init_weights(seed=0, std=0.1).eval()


@pytest.mark.slow
def test_compiled_fixed_step_on_the_cpu_equals_static():
    """`--compile default` on the CPU: the step as Inductor's C++ code gives the eager static cache's tokens and
    logits to 1e-5, batched with left padding."""
    model = _small_model()
    caches = make_caches("static-graph", model.config, 3, 11 + 12, torch.float32, "cpu")
    got = generate(model, PROMPTS, 12, cache="static-graph", record_logits=True, caches=caches, compile="default")
    assert caches[0].runner.compile_mode == "default" and caches[0].runner.fixed_steps == 11
    ref = generate(model, PROMPTS, 12, cache="static", record_logits=True)
    assert got.tokens == ref.tokens
    torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_rows_count_their_compilations_and_a_failure_is_located_eagerly():
    """verify --compile default: every row of static-graph says what torch.compile did during its runs (the single
    prompt's step compiles once; the batch and each prompt alone recompile for their shapes); a failing compiled row
    is located by the same run without compilation, and says so. Dynamo keeps compiled code per code object for the
    whole process, so a step compiled by an earlier test for other shapes makes this one's first compilation a
    recompile (as it is in a long-lived process): the counts are taken from a fresh start, as in a `verify` process."""
    torch._dynamo.reset()
    model = _small_model()
    counts = re.compile(r"compiled \(--compile default\): (\d+) compilation\(s\), (\d+) recompile\(s\), 0 graph break")
    report = run_verify(model, ["static-graph"], PROMPTS, 8, "none", compile="default", checks=("logits", "batched"))
    assert report.passed, report.checks
    rows = {r.name: counts.search(r.detail) for r in report.checks}
    assert rows["logits"] and rows["logits"].groups() == ("1", "0"), report.checks
    assert rows["batched"] and int(rows["batched"][2]) >= 1, report.checks
    report = run_verify(
        model, ["static-graph"], PROMPTS, 8, "none", fault=get_fault("mask"), compile="default", checks=("logits",)
    )
    (row,) = report.checks
    assert not row.passed and counts.search(row.detail), row
    assert row.location.startswith("K/V equal; attention output differs first at layer 0 (step 1, "), row.location
    assert row.location.endswith(" (replayed without compilation)"), row.location


@pytest.mark.slow
def test_frozen_step_is_exact_and_sees_weights_changed_in_place():
    """`--compile max` (weights frozen into the step, GEMMs autotuned over C++ templates, attention kvbench's C) gives
    the eager static cache's tokens and logits to 1e-5, batched with left padding. After an in-place weight update
    (same storage), and after a LayerNorm's eps changes, the runner no longer matches, and the one built next decodes
    with the new weights and eps, not the frozen old ones."""
    model = _small_model()
    caches = make_caches("static-graph", model.config, 3, 11 + 12, torch.float32, "cpu")

    def decode_and_check():
        attended = operators.calls("decode_attention")
        got = generate(model, PROMPTS, 12, cache="static-graph", record_logits=True, caches=caches, compile="max")
        # attention is kvbench's C in the compiled step, every layer of every step
        assert operators.calls("decode_attention") - attended == (11 * 2 if gemv.library() is not None else 0)
        ref = generate(model, PROMPTS, 12, cache="static", record_logits=True)
        runner = caches[0].runner
        assert runner.compile_mode == "max" and runner.fixed_steps == 11
        assert runner_for(model, caches, compile="max") is runner, "same model, same weights: the runner is reused"
        assert got.tokens == ref.tokens
        torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-5, atol=1e-5)
        return runner, _logits(got)

    runner, before = decode_and_check()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(3.0)  # in place: same storage, new values
    assert not runner.matches(model, caches, compile="max")
    fresh, after = decode_and_check()
    assert fresh is not runner
    assert not torch.allclose(after, before, atol=1e-3), "the update must change the logits"
    for block in model.transformer.h:  # a module's setting, not a tensor: Dynamo's module guards are skipped
        block.ln_1.eps = 0.5
    assert not fresh.matches(model, caches, compile="max")
    _, with_eps = decode_and_check()
    assert not torch.allclose(with_eps, after, atol=1e-3), "the new eps must change the logits"


@pytest.mark.slow
def test_frozen_step_of_one_row_runs_every_projection_on_the_gemv():
    """At batch 1, `--compile max`'s step calls kvbench's GEMV (the operator kvbench::gemv) for every projection of
    every step, four a block and lm_head, and decodes the eager static cache's tokens and logits to 1e-5."""
    if gemv.library() is None:
        pytest.skip(f"kvbench's GEMV cannot be built: {gemv.unavailable()}")
    model = _small_model().lay_out()
    before = operators.calls("gemv")  # the operator's calls, whichever kernel (C++ or Python) answers
    got = generate(model, PROMPTS[:1], 9, cache="static-graph", record_logits=True, compile="max")
    steps = 9 - 1  # the first token comes from the prefill, which is not one row
    assert operators.calls("gemv") - before == (4 * model.config.n_layer + 1) * steps
    before = operators.calls("gemv")
    ref = generate(model, PROMPTS[:1], 9, cache="static", record_logits=True)
    assert operators.calls("gemv") == before, "the eager static step is one C call, not the GEMV alone"
    assert got.tokens == ref.tokens
    torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_frozen_step_that_dynamo_breaks_is_still_exact(monkeypatch):
    """A step Dynamo cannot trace whole (here attention behind code it breaks the graph at, as a plugin's can be):
    the code after the break is one resume function for every block, and with the modules' guards skipped its graph,
    compiled with the first block's frozen weights, served every block (logits off by 4.2). `--compile max` now
    compiles such a step with every guard, and it decodes the eager cache's tokens and logits."""
    from kvbench.model import gpt2

    real = gpt2.attention

    def untraceable(*args):
        torch._dynamo.graph_break()
        return real(*args)

    monkeypatch.setattr(gpt2, "attention", untraceable)
    model = _small_model()
    caches = make_caches("static-graph", model.config, 3, 11 + 12, torch.float32, "cpu")
    got = generate(model, PROMPTS, 12, cache="static-graph", record_logits=True, caches=caches, compile="max")
    ref = generate(model, PROMPTS, 12, cache="static", record_logits=True)
    assert got.tokens == ref.tokens
    torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_frozen_step_past_dynamos_recompile_limit_still_decodes():
    """Each cache shape is a compilation of the same step, and Dynamo allows `recompile_limit` per function (8 in
    torch 2.13); a step traced whole raises past it. `--compile max` then compiles a new copy for the new shape."""
    model = _small_model()
    for prompts in (PROMPTS, PROMPTS[:2]):  # two batch sizes: two shapes
        with torch._dynamo.config.patch(recompile_limit=1):  # (monkeypatch's undo deletes a config's attribute)
            got = generate(model, prompts, 6, cache="static-graph", record_logits=True, compile="max")
        ref = generate(model, prompts, 6, cache="static", record_logits=True)
        assert got.tokens == ref.tokens
        torch.testing.assert_close(_logits(got), _logits(ref), rtol=1e-5, atol=1e-5)


_FROZEN_IN_A_PROCESS = """
import sys, torch
from kvbench.caches import make_caches
from kvbench.decode.generate import generate
from kvbench.model.gpt2 import GPT, GPTConfig
torch.set_num_threads(1)
cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=512)
model = GPT(cfg).init_weights(seed=int(sys.argv[1]), std=0.1).eval()
prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43, 38, 32], [7, 9, 400, 12, 5, 5, 301]]
caches = make_caches("static-graph", cfg, 3, 23, torch.float32, "cpu")
got = generate(model, prompts, 12, cache="static-graph", caches=caches, compile="max").tokens
ref = generate(model, prompts, 12, cache="static").tokens
print("equal" if got == ref else f"differ: {got} != {ref}")
"""


@pytest.mark.slow
def test_frozen_step_of_other_weights_in_another_process_is_compiled_for_them(tmp_path):
    """Two processes compile `--compile max` for two models of the same shapes, sharing Inductor's on-disk caches.
    Before: the second was served the first one's packed weights from Inductor's FX graph cache (same shapes, same
    key) and decoded other tokens than its own eager static cache."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    for seed in (0, 1):
        p = subprocess.run(
            [sys.executable, "-c", _FROZEN_IN_A_PROCESS, str(seed)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.strip().splitlines()[-1] == "equal", (seed, p.stdout[-2000:])


@pytest.mark.slow
def test_frozen_step_follows_the_mask_rule():
    """`max` skips Dynamo's guards on the model's modules (the runner's key holds what the step reads of them and
    the mask rule), so a rule changed between generations must still reach the step: with the `mask` fault's rule,
    the compiled step decodes as the eager fixed-shape step does with it, and differently from the correct run."""
    model = _small_model()

    def run(mode: str, rules):
        res = generate(model, PROMPTS, 12, cache="static-graph", record_logits=True, rules=rules, compile=mode)
        return _logits(res)

    good, bad = run("max", EXACT), run("max", MASK_FAULT)
    torch.testing.assert_close(bad, run("off", MASK_FAULT), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(bad, good, atol=1e-2), "the switch must change the logits"
    torch.testing.assert_close(run("max", EXACT), good, rtol=1e-5, atol=1e-5)  # and back
