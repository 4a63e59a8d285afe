"""Decode timing at a filled context: the fill writes exactly the context, every cache decodes from it exactly."""

import math

import torch

from kvbench.caches import make_caches
from kvbench.context import fill_random, run_context_sweep, time_decode
from kvbench.floor import Bandwidth
from kvbench.generation import generate


def test_fill_then_decode_equals_the_same_cache_filled_by_a_prefill(tiny_model):
    """A cache filled through `update` with the K/V a prefill would write decodes the same logits as after that
    prefill: the decode path does not care how the cache was filled."""
    prompt = torch.randint(0, 500, (20,)).tolist()
    ref = generate(tiny_model, [prompt], 5, cache="static", record_logits=True)
    # capture the prefill's K/V by running it into a dynamic cache, then replay them through fill-style updates
    dyn = make_caches("dynamic", tiny_model.config, 1, 25, torch.float32, "cpu")
    tiny_model(torch.tensor([prompt]), torch.arange(20)[None], dyn)
    static = make_caches("static", tiny_model.config, 1, 25, torch.float32, "cpu")
    for s, d in zip(static, dyn, strict=True):
        s.update(d.k, d.v, torch.arange(20)[None])
    logits = tiny_model(torch.tensor([[ref.tokens[0][0]]]), torch.tensor([[20]]), static)[0, -1]
    torch.testing.assert_close(logits, ref.logits[1][0], rtol=1e-5, atol=1e-5)


def test_fill_random_fills_exactly_the_context(tiny_model):
    for cache in ("static", "paged", "int8", "dynamic"):
        layers = make_caches(cache, tiny_model.config, 2, 70, torch.float32, "cpu")
        fill_random(layers, tiny_model, 2, 64, torch.Generator().manual_seed(0))
        assert all(c.length == 64 for c in layers), cache
        steps = time_decode(tiny_model, cache, layers, 64, 3, 2)
        assert len(steps) == 3 and all(s > 0 for s in steps)
        assert all(c.length == 67 for c in layers), cache


def test_sweep_rows_carry_the_floor_and_the_label(tiny_model):
    bw = Bandwidth(read_gbps=20.0, copy_gbps=15.0, nbytes=1, device="cpu")
    rows = run_context_sweep(tiny_model, ["static", "static-graph"], [16, 64], 4, 2, 1, 1, bw, "fp32", "cpu")
    assert [(r.cache, r.context) for r in rows] == [("static", 16), ("static", 64), ("static-graph", 16),
                                                    ("static-graph", 64)]  # fmt: skip
    for r in rows:
        assert r.fill == "random" and r.status == "ok" and r.repeats == 2
        assert math.isclose(r.x_floor, r.tpot_ms_median / r.floor_ms)
    static64 = next(r for r in rows if r.cache == "static" and r.context == 64)
    static16 = next(r for r in rows if r.cache == "static" and r.context == 16)
    assert static64.kv_read_bytes > static16.kv_read_bytes  # attention reads more at a longer context
