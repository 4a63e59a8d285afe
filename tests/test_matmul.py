"""The projections' one rule (model/matmul.py): kvbench's GEMV for one float32 row and oneDNN's inner product on the
CPU over (out, in) weights, ATen's addmm elsewhere. Each is held to the others and the whole model to transformers,
with the layout GPT.lay_out gives; the GEMV's build (model/gemv.py) to what it does without a compiler."""

from __future__ import annotations

import dataclasses
import json
from typing import cast

import pytest
import torch

from kvbench.errors import KVBenchError
from kvbench.model import gemv, matmul
from kvbench.model.gpt2 import GPT, PRESETS, Block, CausalSelfAttention, Conv1D
from kvbench.model.weights import to_hf_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch built without oneDNN")


@pytest.fixture
def aten_then_back():
    yield
    matmul.set_route(None)


@needs_onednn
@pytest.mark.parametrize("route", ["gemv", "onednn"])
@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 64), (2, 5, 64), (7, 64)])
def test_each_cpu_route_equals_addmm(shape, route, aten_then_back):
    layer = Conv1D(64, 96)
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias, std=0.1)
    layer.weight.data = layer.weight.data.t().contiguous().t()  # (out, in) in memory, as GPT.lay_out stores it
    x = torch.randn(shape)
    with torch.inference_mode():
        matmul.set_route(route)
        fast = layer(x)
        matmul.set_route("aten")
        slow = layer(x)
    assert fast.shape == slow.shape == (*shape[:-1], 96)
    assert torch.allclose(fast, slow, rtol=0, atol=1e-5)


needs_gemv = pytest.mark.skipif(gemv.library() is None, reason=f"kvbench's GEMV cannot be built: {gemv.unavailable()}")


def test_where_there_is_a_compiler_the_gemv_builds_and_passes_its_checks():
    """The tests marked needs_gemv skip where the kernel is unavailable; with a compiler here that is a failure: a
    kernel or a fused call that disagrees with torch is never used, and would leave the fast path untested."""
    if gemv.compiler() is None:
        pytest.skip("no C compiler ($CC, cc or gcc) here")
    assert gemv.library() is not None, gemv.unavailable()


def _every_way_and_thread(monkeypatch, run):
    """{(way, threads): run()} for each way of reading (the built kernel's functions, reading its rows that way) at
    1, 2 and 3 threads."""
    kernel, before, got = gemv.library(), torch.get_num_threads(), {}
    try:
        for way in gemv.WAYS:
            k = dataclasses.replace(kernel, rows=way[0], prefetch=way[1])
            monkeypatch.setattr(gemv, "library", lambda k=k: k)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                got[way, threads] = run()
    finally:
        torch.set_num_threads(before)
    return got


@needs_gemv
@pytest.mark.parametrize("n_out, n_in", [(1, 1), (3, 17), (4, 16), (37, 131), (768, 768), (50, 3072)])
def test_the_gemv_kernel_against_float64_and_the_same_at_any_thread_count_and_way_of_reading(n_out, n_in, monkeypatch):
    w, x, b = torch.randn(n_out, n_in), torch.randn(1, 1, n_in), torch.randn(n_out)
    ref = (w.double() @ x.double().view(-1) + b.double()).view(1, 1, n_out)
    got = _every_way_and_thread(monkeypatch, lambda: (gemv.gemv(x, w, b), gemv.gemv(x, w, None)))
    biased, bare = got[(1, 0), 1]
    assert torch.allclose(biased.double(), ref, rtol=1e-6, atol=1e-5 * n_in**0.5)
    assert torch.allclose(bare.double(), ref - b.double(), rtol=1e-6, atol=1e-5 * n_in**0.5)
    # a row is summed by one thread, in one order, whatever its neighbours: neither the split nor the way changes it
    assert len(got) == 3 * len(gemv.WAYS) == 18 and all(
        torch.equal(biased, g[0]) and torch.equal(bare, g[1]) for g in got.values()
    )


@needs_gemv
def test_the_way_of_reading_is_timed_once_per_machine_and_kept(tmp_path, monkeypatch):
    record = tmp_path / "tuning.json"
    fn = gemv.library().fn
    timed = []
    real = gemv._time_ways
    monkeypatch.setattr(gemv, "_time_ways", lambda f: timed.append(1) or real(f))  # counts, then times
    way = gemv.tune(fn, record)
    saved = json.loads(record.read_text())
    assert way in gemv.WAYS and (saved["rows"], saved["prefetch"]) == way and saved["threads"] >= 1
    ms = saved["median_ms"]
    assert {"1 row, 0 B ahead", "4 rows, 32768 B ahead"} <= set(ms) == {gemv._label(w) for w in gemv.WAYS}
    assert len(ms) == 6 and all(t > 0 for t in ms.values())
    assert way == gemv.choose({w: ms[gemv._label(w)] for w in gemv.WAYS})
    assert gemv.tune(fn, record) == way and len(timed) == 1  # kept: not timed again
    every = {gemv._label(w): 2.0 for w in gemv.WAYS}
    damaged = (
        "{not json",
        '{"rows": 1, "prefetch": 0}',  # no times
        "[]",
        '{"other": 1}',
        json.dumps({"median_ms": {**every, "1 row, 0 B ahead": True}}),  # not a time
        json.dumps({"median_ms": {**every, "1 row, 0 B ahead": -1.0}}),
        json.dumps({"median_ms": {k: v for k, v in every.items() if k != "4 rows, 16384 B ahead"}}),  # one missing
    )
    monkeypatch.setattr(gemv, "TUNE_SHAPES", ((300, 64), (5, 3)))  # timed again each time: on a small set here
    for text in damaged:
        record.write_text(text)
        assert gemv.tune(fn, record) in gemv.WAYS
    saved = json.loads(record.read_text())
    assert len(timed) == 1 + len(damaged) and (saved["rows"], saved["prefetch"]) in gemv.WAYS
    # a record that cannot be written is only not kept
    assert gemv.tune(fn, tmp_path / "no-such-folder" / "tuning.json") in gemv.WAYS
    assert not (tmp_path / "no-such-folder").exists()


def test_the_tuning_keeps_one_row_without_prefetching_unless_another_way_beats_it_by_more_than_five_percent(
    tmp_path,
):
    """Timed once, ways that tie within the noise are chosen by chance; one row with the hardware prefetcher alone is
    kept unless another way is clearly faster, and a kept record is chosen from by the same rule."""
    plain, other = gemv.PLAIN, (4, 32 << 10)
    ms = {w: 20.0 for w in gemv.WAYS}
    assert gemv.choose({**ms, plain: 15.3, other: 15.0}) == plain  # 2% slower: a tie
    assert gemv.choose({**ms, plain: 15.76, other: 15.0}) == other  # 5.1% slower: beaten
    assert gemv.choose({**ms, plain: 14.0, other: 15.0}) == plain
    record = tmp_path / "tuning.json"  # as the tuning wrote it before the rule: its own choice, the fastest
    times = {gemv._label(w): t for w, t in {**ms, plain: 15.33, other: 15.04}.items()}
    record.write_text(json.dumps({"rows": 4, "prefetch": 32768, "median_ms": times, "threads": 2}))
    assert gemv.tune(lambda *a: pytest.fail("timed again"), record) == plain


def test_a_call_between_other_kernels_reads_the_fastest_way_that_asks_ahead(tmp_path):
    """`--compile max`'s operator calls one matrix between other kernels, and there asking ahead won where the
    tuning's back-to-back calls chose one row without: its way is the fastest prefetching one of the same record,
    and a build keeps it beside the tuned way."""
    ms = {w: 20.0 for w in gemv.WAYS}
    assert gemv.between_calls({**ms, gemv.PLAIN: 10.0, (4, 32 << 10): 15.0}) == (4, 32 << 10)
    assert gemv.between_calls({**ms, (1, 16 << 10): 12.0, (4, 16 << 10): 12.5}) == (1, 16 << 10)
    assert all(gemv.between_calls({**ms, w: 1.0}) == w for w in gemv.WAYS if w[1] > 0)
    kernel = gemv.library()
    if kernel is None:
        pytest.skip(f"kvbench's GEMV cannot be built: {gemv.unavailable()}")
    records = [gemv.kept_times(r) for r in gemv.cache_root().glob("gemv/*/tuning.json")]  # this process's builds
    assert any(
        kept is not None
        and kernel.between == gemv.between_calls(kept)
        and (kernel.rows, kernel.prefetch) == gemv.choose(kept)
        for kept in records
    )
    assert kernel.between[1] > 0


@needs_gemv
@pytest.mark.parametrize(
    "cache, per_block, after", [("static", [], ["step_static"]), ("dynamic", ["ln_gemv", "block_tail"], ["ln_gemv"])]
)
def test_a_decode_step_runs_fused_calls_and_equals_transformers(
    tiny_config, aten_then_back, monkeypatch, cache, per_block, after
):
    """Over static caches the whole step is one C call, writing into the caches' buffers; over any other cache a
    block is two, ln_1 with c_attn and everything after attention, around the cache's own update, and ln_f with
    lm_head one more (the prefill's last row too)."""
    from kvbench.caches import make_caches

    matmul.set_route("gemv")
    model = GPT(tiny_config).init_weights(seed=0, std=0.1).eval().lay_out()
    ids = torch.randint(0, tiny_config.vocab_size, (1, 12))
    caches = make_caches(cache, tiny_config, 1, 12, torch.float32, "cpu")
    calls: list[str] = []
    for name in ("gemv", "ln_gemv", "block_tail", "step_static"):
        real = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    with torch.inference_mode():
        model(ids[:, :11], torch.arange(11)[None], caches, last_only=True)
        assert calls == ["ln_gemv"]  # the prefill's one row: ln_f and lm_head
        step = model(ids[:, 11:], torch.tensor([[11]]), caches)[:, -1]  # (1, V)
        theirs = to_hf_model(model, "eager")(ids).logits[:, -1]
    assert calls == ["ln_gemv"] + per_block * tiny_config.n_layer + after
    assert all(c.length == 12 for c in caches)
    assert (step - theirs).abs().max() < 1e-5


def _block_and_row(tiny_config):
    from kvbench.model.gpt2 import Block

    torch.manual_seed(0)
    block = Block(tiny_config).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    for m in block.modules():
        if isinstance(m, Conv1D):
            m.weight.data = m.weight.data.t().contiguous().t()  # (out, in) in memory, as GPT.lay_out stores it
    return block, torch.randn(1, 1, tiny_config.n_embd)


def _decode(block, x, tiny_config, dtype=torch.float32, kind="dynamic", padding=None, cache=None):
    """The block's decode step for row x at position 5 over 5 cached random K/V (in a `kind` cache of 6 slots, or
    `cache`)."""
    from kvbench.caches import make_caches
    from kvbench.model.gpt2 import EXACT_MASK, AttentionMask

    cache = cache if cache is not None else make_caches(kind, tiny_config, 1, 6, dtype, "cpu")[0]
    g = torch.Generator().manual_seed(1)
    H, Dh = tiny_config.n_head, tiny_config.head_dim
    past = [torch.randn(1, H, 5, Dh, generator=g).to(dtype) for _ in range(2)]
    cache.update(*past, torch.arange(5)[None])
    mask = AttentionMask(1, 6, padding, EXACT_MASK, torch.tensor([[5]]))
    with torch.inference_mode():
        return block(x.to(dtype), torch.tensor([[5]]), cache, mask)


@needs_gemv
@pytest.mark.parametrize("kind, fused_call", [("dynamic", "block_tail")])
def test_the_fused_block_against_float64_and_the_same_at_any_thread_count_and_way_of_reading(
    tiny_config, aten_then_back, monkeypatch, kind, fused_call
):
    block, x = _block_and_row(tiny_config)
    matmul.set_route("aten")
    ref = _decode(block.double(), x, tiny_config, torch.float64, kind)  # the modules' own path, in float64
    block.float()
    for m in block.modules():
        if isinstance(m, Conv1D):
            m.weight.data = m.weight.data.t().contiguous().t()
    matmul.set_route("gemv")
    fused = []
    real = getattr(gemv, fused_call)
    monkeypatch.setattr(gemv, fused_call, lambda *a: fused.append(1) or real(*a))
    got = _every_way_and_thread(monkeypatch, lambda: _decode(block, x, tiny_config, kind=kind))
    assert len(fused) == len(got) == 18  # every one ran the fused calls
    first = got[(1, 0), 1]
    assert (first.double() - ref).abs().max() < 1e-5
    assert all(torch.equal(first, g) for g in got.values())  # LayerNorm on one thread, each row summed one way


@needs_gemv
def test_a_hooked_or_replaced_part_keeps_the_modules_own_path(tiny_config, aten_then_back):
    """The fused calls stand for exactly the stock modules: a hook on one of them, or a part replaced (a subclass,
    a tensor-parallel RowParallel), runs the modules' own path, with the same result to rounding."""
    from kvbench.model.gpt2 import MLP

    block, x = _block_and_row(tiny_config)
    matmul.set_route("gemv")
    fused = _decode(block, x, tiny_config)
    seen = []
    hook = block.mlp.c_fc.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    hooked = _decode(block, x, tiny_config)
    hook.remove()
    assert seen == [(1, 1, 4 * tiny_config.n_embd)] and (hooked - fused).abs().max() < 1e-6

    class LoudMLP(MLP):
        def forward(self, x):
            seen.append("mine")
            return super().forward(x)

    mlp = LoudMLP(tiny_config)
    mlp.load_state_dict(block.mlp.state_dict())
    mlp.c_fc.weight.data = mlp.c_fc.weight.data.t().contiguous().t()
    mlp.c_proj.weight.data = mlp.c_proj.weight.data.t().contiguous().t()
    block.mlp = mlp
    replaced = _decode(block, x, tiny_config)
    assert seen[-1] == "mine" and (replaced - fused).abs().max() < 1e-6


def _laid_out_counting_steps(tiny_config, monkeypatch) -> tuple[GPT, torch.Tensor, list[int]]:
    """On the gemv route: a laid-out tiny model, 9 token ids, and a list that gains an item per whole-step call."""
    matmul.set_route("gemv")
    model = GPT(tiny_config).init_weights(seed=0, std=0.1).eval().lay_out()
    steps: list[int] = []
    real = gemv.step_static
    monkeypatch.setattr(gemv, "step_static", lambda *a, **k: steps.append(1) or real(*a, **k))
    return model, torch.randint(0, tiny_config.vocab_size, (1, 9)), steps


def _step(model, caches, ids, padding=None):
    """The prefill of ids[:, :-1] into `caches`, then the one-row step of the last token: its logits (1, V)."""
    T = ids.size(1)
    with torch.inference_mode():
        model(ids[:, :-1], torch.arange(T - 1)[None], caches, padding_mask=None if padding is None else padding[:, :-1])
        return model(ids[:, -1:], torch.tensor([[T - 1]]), caches, padding_mask=padding)[:, -1]


@needs_gemv
@pytest.mark.parametrize(
    "shape, std, T",
    [
        ({}, 0.1, 9),  # the tiny model: heads of 16, the C attention's general path
        # gpt2's heads of 64 (their own copy in the C code) over 43 slots (not a multiple of its vector widths), the
        # weights large enough that the GELU's inputs pass +-20 and the softmax's exponents fall below -100 (e^x
        # leaves the normal floats below -87)
        (dict(n_layer=2, n_head=2, n_embd=128), 0.5, 43),
    ],
)
def test_the_whole_step_call_against_float64_the_same_at_any_thread_count_and_way(
    tiny_config, aten_then_back, monkeypatch, shape, std, T
):
    from kvbench.caches import make_caches

    config = dataclasses.replace(tiny_config, **shape)
    model = GPT(config).init_weights(seed=0, std=std).eval()
    ids = torch.randint(0, config.vocab_size, (1, T))
    matmul.set_route("aten")
    ref = _step(model.double(), make_caches("static", config, 1, T, torch.float64, "cpu"), ids)
    matmul.set_route("gemv")
    model.float().lay_out()  # (out, in), as the gemv route reads them
    steps = []
    real = gemv.step_static
    monkeypatch.setattr(gemv, "step_static", lambda *a, **k: steps.append(1) or real(*a, **k))

    def run():
        caches = make_caches("static", config, 1, T, torch.float32, "cpu")
        return _step(model, caches, ids), caches[1].k.clone()

    got = _every_way_and_thread(monkeypatch, run)
    assert len(steps) == len(got) == 18
    first, k = got[(1, 0), 1]
    assert (first.double() - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item())
    assert all(torch.equal(first, g) and torch.equal(k, kk) for g, kk in got.values())  # bit for bit


@needs_gemv
def test_the_whole_step_call_only_where_every_layer_is_stock_static_and_reads_every_slot(
    tiny_config, aten_then_back, monkeypatch
):
    """Left padding (a mask to apply), a StaticCache subclass (its own update), a hook on one block, or a dynamic
    cache keep the blocks one by one, with the same result to rounding; the one call writes each row's K/V where
    update would; a full cache is refused as update refuses it."""
    assert tiny_config.n_layer == 3
    from kvbench.caches import make_caches
    from kvbench.caches.static import StaticCache
    from kvbench.errors import CacheOverflowError

    model, ids, steps = _laid_out_counting_steps(tiny_config, monkeypatch)
    H, Dh = tiny_config.n_head, tiny_config.head_dim

    def static(cls=StaticCache, n=9):
        return [cls(1, H, n, Dh, torch.float32, "cpu") for _ in range(tiny_config.n_layer)]

    one = static()
    whole = _step(model, one, ids)
    assert steps == [1] and all(c.length == 9 for c in one)
    updates = []

    class Counted(StaticCache):
        def update(self, k, v, positions):
            updates.append(k.size(2))
            return super().update(k, v, positions)

    counted = static(Counted)
    assert (_step(model, counted, ids) - whole).abs().max() < 1e-6 and updates == [8] * 3 + [1] * 3 and steps == [1]
    assert all(
        torch.allclose(a.k, b.k, atol=1e-6) and torch.allclose(a.v, b.v, atol=1e-6)
        for a, b in zip(one, counted, strict=True)
    )
    hook = model.transformer.h[1].register_forward_hook(lambda m, a, out: updates.append("hook"))
    assert (_step(model, static(), ids) - whole).abs().max() < 1e-6 and updates[-1] == "hook" and steps == [1]
    hook.remove()
    dynamic = make_caches("dynamic", tiny_config, 1, 9, torch.float32, "cpu")
    assert (_step(model, dynamic, ids) - whole).abs().max() < 1e-6 and steps == [1]
    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1]])  # the first slot is padding: a mask the step must apply
    masked = _step(model, static(), ids, padding)
    matmul.set_route("aten")
    plain = _step(model, static(), ids, padding)
    matmul.set_route("gemv")
    assert steps == [1] and (masked - plain).abs().max() < 1e-6 and (masked - whole).abs().max() > 1e-4
    wrong = static()
    for c in wrong:  # a design that offers buffers of another layout: never handed to the C code
        c.in_place_slot = lambda c=c: (c.k.transpose(2, 3).contiguous(), c.v.transpose(2, 3).contiguous(), c.length)
    with torch.inference_mode():
        model(ids[:, :8], torch.arange(8)[None], wrong)
        assert (model(ids[:, 8:], torch.tensor([[8]]), wrong)[:, -1] - whole).abs().max() < 1e-6 and steps == [1]
    full = static(n=8)
    with torch.inference_mode():
        model(ids[:, :8], torch.arange(8)[None], full)
        with pytest.raises(
            CacheOverflowError, match="static KV cache overflow: 8 cached \\+ 1 new = 9 tokens, capacity 8"
        ):
            model(ids[:, 8:], torch.tensor([[8]]), full)
    assert steps == [1] and all(c.length == 8 for c in full)


@needs_gemv
def test_what_the_whole_step_checked_once_follows_every_later_change_to_the_model(
    tiny_config, aten_then_back, monkeypatch
):
    """The step keeps what it checked of the modules between steps; a weight given new storage, a new value in place,
    a hook, a replaced module, another eps or a gradient wanted after a fused step are all seen at the next one: the
    result is the modules' own (the aten route's) every time, through the C step only where it may run."""
    from kvbench.caches.static import StaticCache

    model, ids, steps = _laid_out_counting_steps(tiny_config, monkeypatch)
    H, Dh = tiny_config.n_head, tiny_config.head_dim

    def check(fused: bool) -> torch.Tensor:
        caches = [StaticCache(1, H, 9, Dh, torch.float32, "cpu") for _ in range(tiny_config.n_layer)]
        before = len(steps)
        got = _step(model, caches, ids)
        matmul.set_route("aten")
        want = _step(model, [StaticCache(1, H, 9, Dh, torch.float32, "cpu") for _ in caches], ids)
        matmul.set_route("gemv")
        assert len(steps) - before == fused and (got - want).abs().max() < 1e-5
        return got

    first = check(fused=True)
    block = cast(Block, model.transformer.h[1])
    fc = block.mlp.c_fc
    fc.weight.data = (torch.randn_like(fc.weight) * 0.1).t().contiguous().t()  # new storage, (out, in) laid out
    assert (check(fused=True) - first).abs().max() > 1e-4
    with torch.no_grad():
        fc.bias.add_(0.5)  # a new value in place: same storage, read live
    check(fused=True)
    proj = block.attn.c_proj  # square: its storage seen transposed keeps the address, not the strides
    proj.weight.data = proj.weight.data.t()
    check(fused=False)
    proj.weight.data = proj.weight.data.t()
    check(fused=True)
    seen = []
    hook = block.attn.c_attn.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    check(fused=False)
    assert seen == [(1, 8, 3 * tiny_config.n_embd), (1, 1, 3 * tiny_config.n_embd)] * 2
    hook.remove()
    check(fused=True)

    class Louder(type(block.mlp)):
        def forward(self, x):
            seen.append("louder")
            return super().forward(x)

    class Watched(CausalSelfAttention):
        def attend(self, *args):
            seen.append("watched")
            return super().attend(*args)

    louder = Louder(tiny_config)
    louder.load_state_dict(block.mlp.state_dict())
    block.mlp = louder
    check(fused=False)
    assert seen[-1] == "louder"
    block.mlp = type(block.mlp).__mro__[1](tiny_config)  # a stock MLP again, its weights (in, out): not laid out
    block.mlp.load_state_dict(louder.state_dict())
    check(fused=False)
    model.lay_out()
    check(fused=True)
    watched = Watched(tiny_config)  # another attention module around the same projections: the same parameters
    watched.c_attn, watched.c_proj = block.attn.c_attn, block.attn.c_proj
    block.attn = watched
    check(fused=False)
    assert seen[-1] == "watched"
    block.attn = CausalSelfAttention(tiny_config)
    block.attn.c_attn, block.attn.c_proj = watched.c_attn, watched.c_proj
    check(fused=True)
    block.ln_2.eps = 1e-3  # one eps unlike the others
    check(fused=False)
    block.ln_2.eps = model.transformer.ln_f.eps
    check(fused=True)

    def step_with_grad_enabled() -> torch.Tensor:
        caches = [StaticCache(1, H, 9, Dh, torch.float32, "cpu") for _ in range(tiny_config.n_layer)]
        with torch.no_grad():
            model(ids[:, :8], torch.arange(8)[None], caches)
        return model(ids[:, 8:], torch.tensor([[8]]), caches)

    model.requires_grad_(False)  # nothing to train: the C step, gradient mode or not
    before = len(steps)
    assert step_with_grad_enabled().grad_fn is None and len(steps) == before + 1
    fc = block.mlp.c_fc  # the MLP's now
    fc.weight = torch.nn.Parameter(fc.weight.data)  # a trainable parameter over the same storage and layout
    assert step_with_grad_enabled().grad_fn is not None and len(steps) == before + 1
    model.requires_grad_(True)
    for p in (*model.transformer.wte.parameters(), *model.transformer.wpe.parameters()):
        p.requires_grad_(False)  # frozen embeddings (and the tied head), trained blocks: the row wants no gradient
    assert step_with_grad_enabled().grad_fn is not None and len(steps) == before + 1
    model.requires_grad_(False)
    check(fused=True)
    assert getattr(model, "_step_plan", None) is not None
    model.double()  # the kept checks hold views of the float32 weights: they go with them
    assert model._step_plan is None


@needs_gemv
def test_a_nan_reaching_the_gelu_comes_out_as_nan_as_in_the_modules(tiny_config, aten_then_back):
    """A NaN in the MLP (a broken checkpoint) gives NaN logits through the C step's GELU, as through torch's: never
    numbers that look fine."""
    from kvbench.caches.static import StaticCache

    model = GPT(tiny_config).init_weights(seed=0, std=0.1).eval()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.bias[0] = float("nan")
    ids = torch.randint(0, tiny_config.vocab_size, (1, 9))
    H, Dh = tiny_config.n_head, tiny_config.head_dim
    got = {}
    for route in ("aten", "gemv"):
        matmul.set_route(route)
        model.lay_out()
        got[route] = _step(model, [StaticCache(1, H, 9, Dh, torch.float32, "cpu") for _ in range(3)], ids)
    assert got["aten"].isnan().all() and got["gemv"].isnan().all()


def test_without_a_compiler_the_gemv_route_is_onednn_and_says_why(tmp_path, monkeypatch, aten_then_back):
    try:
        with monkeypatch.context() as env:
            env.setenv("CC", str(tmp_path / "no-such-cc"))
            env.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
            gemv.reset()
            assert gemv.library() is None and "cannot run" in gemv.unavailable()
            assert "no-such-cc" in gemv.unavailable()
            expected = "onednn" if torch.backends.mkldnn.is_available() else "aten"
            assert matmul.set_route("gemv") == expected and matmul.set_route(None) == expected
    finally:  # loaded again under the real environment, so no later test finds it built under a blocked one
        gemv.reset()
        gemv.library()


def test_a_compiler_that_fails_and_a_damaged_cached_library(tmp_path):
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'gemv.c:1: error: no such ISA' >&2\nexit 1\n")
    failing.chmod(0o755)
    lib, why = gemv.build(str(failing), tmp_path)
    assert lib is None and why == f"{failing} failed to build gemv.c: gemv.c:1: error: no such ISA"
    real = gemv.compiler()
    if real is None:
        pytest.skip("no C compiler here")
    lib, why = gemv.build(real, tmp_path / "a")
    assert lib is not None and why == ""
    (built,) = (tmp_path / "a").glob("gemv/*/libkvgemv.so")
    # the same library in another cache, damaged since it was written (never rewritten in place here: this process
    # has the first one mapped): built again, once
    damaged = tmp_path / "b" / built.relative_to(tmp_path / "a")
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a library")
    lib, why = gemv.build(real, tmp_path / "b")
    assert lib is not None and why == "" and damaged.read_bytes()[:4] == b"\x7fELF"


@needs_onednn
def test_lay_out_keeps_shapes_values_and_the_checkpoint_format(tiny_config):
    model = GPT(tiny_config).init_weights(seed=0, std=0.1).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.lay_out()
    for m in model.modules():
        if isinstance(m, Conv1D):
            assert m.weight.shape[0] == m.weight.t().shape[1] and m.weight.t().is_contiguous()  # (in, out) view
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].shape == after[k].shape for k in before)
    # on a layout-agnostic device path the same model lays its weights back (in, out)
    matmul.set_route("aten")
    try:
        model.lay_out()
        assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, Conv1D))
    finally:
        matmul.set_route(None)


@needs_onednn
def test_a_laid_out_model_equals_transformers(tiny_config):
    model = GPT(tiny_config).init_weights(seed=0, std=0.1).eval().lay_out()
    ids = torch.randint(0, tiny_config.vocab_size, (2, 20))
    with torch.inference_mode():
        ours = model(ids, torch.arange(20).expand(2, -1))
        theirs = to_hf_model(model, "eager")(ids).logits
    assert (ours - theirs).abs().max() < 1e-5


def test_training_takes_the_differentiable_path(tiny_config):
    """oneDNN's op has no backward: with gradients on, every projection is addmm and gradients reach the weights."""
    model = GPT(tiny_config).init_weights(seed=0, std=0.1).lay_out()
    ids = torch.randint(0, tiny_config.vocab_size, (1, 8))
    model(ids, torch.arange(8)[None]).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_the_hf_engine_gets_its_own_in_out_layout(tiny_config):
    from kvbench.hf.engine import build_hf_model

    model = GPT(tiny_config).init_weights(seed=0, std=0.1).eval().lay_out()
    hf = build_hf_model(model)
    assert hf.transformer.h[0].attn.c_attn.weight.is_contiguous()
    assert hf.transformer.wte.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # the rest shared


def test_an_unknown_route_is_refused(monkeypatch, aten_then_back):
    monkeypatch.setenv(matmul.ROUTE_ENV, "mkl")
    with pytest.raises(KVBenchError, match="KVBENCH_CPU_MATMUL='mkl': expected one of gemv, onednn, aten"):
        matmul.set_route(None)
    monkeypatch.setenv(matmul.ROUTE_ENV, "ATEN")
    assert matmul.set_route(None) == "aten"


@needs_onednn
def test_bf16_runs_the_onednn_route():
    model = GPT(PRESETS["gpt2-tiny"]).init_weights(seed=0).eval().to(torch.bfloat16).lay_out()
    ids = torch.randint(0, 50257, (1, 6))
    with torch.inference_mode():
        fast = model(ids, torch.arange(6)[None]).float()
        matmul.set_route("aten")
        try:
            slow = model(ids, torch.arange(6)[None]).float()
        finally:
            matmul.set_route(None)
    assert (fast - slow).abs().max() < 0.1  # bf16 rounding of two summation orders


@needs_gemv
def test_a_row_of_the_wrong_width_is_refused_by_onednn_never_read_past_by_the_gemv(aten_then_back):
    matmul.set_route("gemv")
    w, b = torch.randn(96, 64), torch.randn(96)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        matmul.linear(torch.randn(1, 1, 63), w, b)  # the kernel would read one float past the row
    with torch.inference_mode(), pytest.raises(RuntimeError):
        matmul.linear(torch.randn(1, 1, 64), w, torch.randn(95))  # nor write past a short bias


def test_cc_may_carry_flags(tmp_path):
    real = gemv.compiler()
    if real is None:
        pytest.skip("no C compiler here")
    lib, why = gemv.build(f"{real} -DKVBENCH_UNUSED=1", tmp_path)
    assert lib is not None and why == ""
    lib, why = gemv.build('cc "unterminated', tmp_path)
    assert lib is None and why.startswith('cannot run cc "unterminated:')


def test_a_library_without_the_kernel_is_never_used(tmp_path):
    real = gemv.compiler()
    if real is None:
        pytest.skip("no C compiler here")
    lib, why = gemv.build(f"{real} -Dkv_gemv_f32=other_name", tmp_path)  # builds, but not the kernel's symbol
    assert lib is None and why.endswith("was built but does not load"), why


def test_a_kernel_that_computes_wrongly_fails_its_check():
    import ctypes

    def zeros(w, x, b, y, n_out, n_in, threads, rows, prefetch):  # the C kernel's signature; writes zeros
        ctypes.memset(y, 0, 4 * n_out)

    assert gemv._agrees(gemv.Kernel(zeros, 4)) is False
    if gemv.library() is not None:
        assert all(gemv._agrees(gemv.Kernel(gemv.library().fn, *way)) for way in gemv.WAYS)


def test_a_cache_folder_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    lib, why = gemv.build(gemv.compiler() or "cc", blocker)
    assert lib is None and why.startswith(f"cannot write under {blocker / 'gemv'}") and "KVBENCH_CACHE_DIR" in why


@needs_gemv
def test_the_gemv_operator_runs_the_kernel_and_states_its_shape():
    """`kvbench::gemv`, as `--compile max`'s step calls it: the GEMV on real tensors against a float64 product, with
    and without a bias; the output shape on fake tensors (what tracing sees)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(1, 1, 131, generator=g), torch.randn(37, 131, generator=g), torch.randn(37, generator=g)
    for bias in (b, None):
        got = torch.ops.kvbench.gemv(x, w, bias)
        ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        assert got.shape == (1, 1, 37)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    with FakeTensorMode() as mode:
        fake = torch.ops.kvbench.gemv(*(mode.from_tensor(t) for t in (x, w, b)))
    assert fake.shape == (1, 1, 37)


@needs_gemv
def test_gemv_inside_a_traced_step_only_where_frozen_weights_says():
    """Traced outside `frozen_weights` (`--compile default`), a projection is ATen's; inside it on the gemv route it
    is the operator kvbench::gemv; all three equal the eager GEMV to rounding."""
    traced: list[list[str]] = []

    def backend(gm, example_inputs):
        traced.append([str(n.target) for n in gm.graph.nodes])
        return gm.forward

    x, w = torch.randn(1, 64), torch.randn(48, 64)
    with torch.no_grad():
        eager = matmul.linear(x, w)
        torch._dynamo.reset()
        plain = torch.compile(matmul.linear, backend=backend, fullgraph=True)(x, w)
        torch._dynamo.reset()
        with matmul.frozen_weights():
            frozen = torch.compile(matmul.linear, backend=backend, fullgraph=True)(x, w)
    torch._dynamo.reset()
    assert not any("kvbench" in t for t in traced[0]), "--compile default's trace: no GEMV"
    assert "kvbench.gemv" in traced[1], traced[1]
    for y in (plain, frozen):
        torch.testing.assert_close(y, eager, rtol=1e-5, atol=1e-5)


def test_frozen_step_without_the_kernel_keeps_onednn(monkeypatch):
    """Where the GEMV cannot be built the route is oneDNN, so `--compile max`'s trace never holds the operator."""
    monkeypatch.setattr(gemv, "library", lambda: None)
    monkeypatch.setattr(matmul, "_route", None)  # chosen again on first use, without the kernel
    traced = []

    def backend(gm, example_inputs):
        traced.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    x, w = torch.randn(1, 64), torch.randn(48, 64)
    with torch.no_grad(), matmul.frozen_weights():
        assert matmul._frozen_gemv is False and matmul.route() == "onednn"
        torch._dynamo.reset()
        y = torch.compile(matmul.linear, backend=backend, fullgraph=True)(x, w)
    torch._dynamo.reset()
    assert traced and not any("kvbench" in t for t in traced), traced
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)
