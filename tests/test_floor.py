"""The bandwidth floor's byte counts against independent counts (the model's own parameters and cache tensors)."""

import pytest
import torch

from kvbench.caches import make_caches
from kvbench.floor import (
    Bandwidth,
    crossover_context,
    decode_floor_ms,
    measure_bandwidth,
    step_bytes,
    weight_bytes,
)
from kvbench.model import GPT, PRESETS


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2"])
def test_weight_bytes_match_the_models_parameters(name):
    """Every parameter once (lm_head is wte), minus the embedding tables a step reads only one row of."""
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    tables = cfg.vocab_size * cfg.n_embd + cfg.block_size * cfg.n_embd  # wte and wpe
    rows = 2 * cfg.n_embd  # one wte row, one wpe row (batch 1)
    # wte is read whole as lm_head: add it back once
    expected = 4 * (params - tables + rows + cfg.vocab_size * cfg.n_embd)
    assert weight_bytes(cfg, 4) == expected
    if name == "gpt2":
        assert 490e6 < weight_bytes(cfg, 4) < 500e6  # ~124M parameters minus wpe, fp32


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_kv_bytes_match_a_real_cache(cache):
    """Attention reads exactly the bytes a static cache holds for L tokens."""
    cfg = PRESETS["gpt2-tiny"]
    L = 37
    caches = make_caches("static", cfg, 2, L, torch.float32, "cpu")
    held = sum(c.nbytes for c in caches)
    b = step_bytes(cfg, 4, 2, L, L, cache)
    assert b.kv == held
    assert b.kv_write == held // L
    if cache == "dynamic":
        assert b.design == (2 * L - 1) * held // L  # reads L-1 slots, writes L


def test_static_graph_reads_its_whole_buffer():
    cfg = PRESETS["gpt2"]
    a = step_bytes(cfg, 2, 1, 100, 1024, "static-graph")
    b = step_bytes(cfg, 2, 1, 1024, 1024, "static")
    assert a.kv + a.design == b.kv


def test_crossover_gpt2():
    """gpt2: weights ~249 MB in fp16; one token's K+V over 12 layers = 36,864 B: crossover at 6,7xx tokens."""
    cfg = PRESETS["gpt2"]
    n = crossover_context(cfg, 2)
    per_slot = 2 * 12 * 768 * 2
    assert (n - 1) * per_slot < weight_bytes(cfg, 2) <= n * per_slot
    assert crossover_context(cfg, 4) == n  # the ratio does not depend on the dtype


def test_floor_arithmetic_and_a_real_bandwidth_probe():
    bw = Bandwidth(read_gbps=25.0, copy_gbps=20.0, nbytes=1, device="cpu")
    ms, b = decode_floor_ms(PRESETS["gpt2"], 4, 1, 512, 64, "static", bw)
    assert ms == pytest.approx(1e3 * b.total / 25e9)
    assert 15 < ms < 25  # ~0.5 GB at 25 GB/s
    real = measure_bandwidth(torch.device("cpu"), nbytes=16 << 20, repeats=2)
    assert real.read_gbps > 0.1 and real.copy_gbps > 0.1 and real.used == "read"
