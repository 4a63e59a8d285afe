"""The bandwidth floor's byte counts against independent counts (the model's own parameters and cache tensors), each
design's traffic, the arithmetic of a CUDA run done on the CPU, and the crossover contexts the docs state."""

import math

import pytest
import torch

from kvbench.bench.engines import ENGINES
from kvbench.bench.floor import (
    Bandwidth,
    crossover_context,
    decode_floor_ms,
    measure_bandwidth,
    probe_bytes,
    step_bytes,
    weight_bytes,
)
from kvbench.caches import CACHES, make_caches
from kvbench.caches.base import UNKNOWN_TRAFFIC
from kvbench.hf.caches import HF_CACHES
from kvbench.model.gpt2 import GPT, PRESETS

HF_TRAFFIC = {n: c.traffic for n, c in HF_CACHES.items() if c.traffic is not None}

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def traffic(design: str):
    """A design's Traffic: our caches' from their specs, transformers' (hf:<name>) from the hf engine's table."""
    return HF_TRAFFIC[design[3:]] if design.startswith("hf:") else CACHES[design].traffic


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


@pytest.mark.parametrize("cache", ["static", "dynamic", "paged"])
def test_kv_bytes_match_a_real_cache(cache):
    """Attention reads exactly the bytes a static cache holds for L tokens; torch.cat re-copies L-1 of them (read
    and write); the paged gather copies whole 16-token blocks."""
    cfg = PRESETS["gpt2-tiny"]
    L = 37
    caches = make_caches("static", cfg, 2, L, F32, "cpu")
    held = sum(c.nbytes for c in caches)
    slot = held // L
    b = step_bytes(cfg, F32, 2, L, L, traffic(cache))
    assert b.kv == held and b.slots == L
    assert b.kv_write == slot
    blocks = 3 * 16  # 37 tokens in 16-token blocks
    expected = {"static": 0, "dynamic": 2 * (L - 1) * slot, "paged": 2 * blocks * slot}[cache]
    assert b.design == expected
    assert b.total == b.weights + b.kv + b.kv_write + b.design


def test_dynamic_traffic_equals_what_the_cache_counts():
    """The bytes torch.cat re-reads in one step are exactly what the dynamic cache's own counter adds."""
    cfg = PRESETS["gpt2-tiny"]
    caches = make_caches("dynamic", cfg, 1, 64, F32, "cpu")
    k = torch.zeros(1, cfg.n_head, 20, cfg.head_dim)
    for c in caches:
        c.update(k, k, None)
    before = sum(c.bytes_copied for c in caches)
    for c in caches:
        c.update(k[:, :, :1], k[:, :, :1], None)  # the step that brings the cache to L = 21
    copied = sum(c.bytes_copied for c in caches) - before
    assert step_bytes(cfg, F32, 1, 21, 64, traffic("dynamic")).design == 2 * copied  # read, then written


def test_int8_reads_its_own_storage_and_writes_one_copy():
    cfg = PRESETS["gpt2-tiny"]
    L = 40
    caches = make_caches("int8", cfg, 1, L, F32, "cpu")
    stored = sum(c.nbytes for c in caches)  # int8 + fp32 scales for L slots
    b = step_bytes(cfg, F32, 1, L, L, traffic("int8"))
    slot = 2 * cfg.n_layer * cfg.n_embd * 4
    assert b.design == stored + L * slot  # read int8 + scales, write the fp32 dequantised copy
    assert b.kv_write == stored // L
    # bf16 keeps fp32 scales (int8.scale_dtype_for): 4 bytes per head, not bf16's 2
    bf = make_caches("int8", cfg, 1, L, BF16, "cpu")
    assert step_bytes(cfg, BF16, 1, L, L, traffic("int8")).kv_write == sum(c.nbytes for c in bf) // L


def test_whole_buffer_designs_read_their_capacity():
    cfg = PRESETS["gpt2"]
    for design in ("static-graph", "hf:static"):
        a = step_bytes(cfg, F16, 1, 100, 1024, traffic(design))
        b = step_bytes(cfg, F16, 1, 1024, 1024, traffic("static"))
        assert a.kv == b.kv and a.slots == 1024, design
    assert step_bytes(cfg, F16, 1, 100, 1024, traffic("static")).slots == 100


def test_each_engine_names_its_designs_traffic_and_plugins_get_unknown():
    assert ENGINES["kvbench"].traffic("none") is None and ENGINES["hf"].traffic("none") is None
    assert ENGINES["hf"].traffic("static") is ENGINES["hf-compiled"].traffic("static") is HF_TRAFFIC["static"]
    assert ENGINES["hf"].traffic("dynamic") is HF_TRAFFIC["dynamic"]
    assert ENGINES["kvbench"].traffic("paged") is CACHES["paged"].traffic
    plugin = step_bytes(PRESETS["gpt2-tiny"], F32, 1, 30, 64, None)
    assert plugin.design == 0 and plugin.note == UNKNOWN_TRAFFIC.note
    assert all(spec.traffic is not None for spec in CACHES.values() if spec.factory is not None)


def test_crossover_gpt2():
    """gpt2: weights ~494 MB in fp32 (~247 MB fp16); one token's K+V over 12 layers = 73,728 B fp32: 6,709 tokens."""
    cfg = PRESETS["gpt2"]
    n = crossover_context(cfg, 4)
    per_slot = 2 * 12 * 768 * 4
    assert (n - 1) * per_slot < weight_bytes(cfg, 4) <= n * per_slot
    assert n == 6709  # the figure docs/performance.md and the README state
    assert crossover_context(cfg, 2) == n  # the ratio does not depend on the dtype
    assert crossover_context(PRESETS["gpt2-long"], 4) == n  # a step reads one row of wpe, however long


def test_crossovers_the_readme_states_from_the_planner():
    """The README's crossovers for two presets of configs/models.toml: the planner's weight bytes over its KV bytes
    per token (bf16 weights, fp16 cache), arithmetic only."""
    from kvbench.memory.planner import plan
    from kvbench.memory.presets import get_model

    stated = {"llama-2-7b": 25_706, "llama-3-8b": 122_533}
    for name, tokens in stated.items():
        p = plan(get_model(name), [1024])
        assert math.ceil(p.weights_bytes / p.bytes_per_token) == tokens, name


def test_floor_arithmetic_of_a_cuda_run_on_the_cpu():
    """What a CUDA row's floor would be (fp16, the H200's measured 4.24 TB/s), checked here: gpt2's weights alone
    are the 0.058 ms docs/performance.md states; a static step at prompt 128 + 400 new tokens adds K/V for 328
    slots; static-graph reads its whole 528-slot buffer."""
    cfg = PRESETS["gpt2"]
    bw = Bandwidth(read_gbps=4240.0, copy_gbps=3900.0, nbytes=2 << 30, device="cuda:0")
    assert round(1e3 * weight_bytes(cfg, 2) / 4240e9, 3) == 0.058
    assert round(1e3 * weight_bytes(PRESETS["gpt2-xl"], 2) / 4240e9, 3) == 0.734
    ms, b = decode_floor_ms(cfg, F16, 1, 128, 400, traffic("static"), bw)
    assert b.context == 328 and b.kv == 328 * 36_864
    assert ms == pytest.approx(1e3 * (weight_bytes(cfg, 2) + 329 * 36_864) / 4240e9)
    _, g = decode_floor_ms(cfg, F16, 1, 128, 400, traffic("static-graph"), bw)
    assert g.kv == 528 * 36_864
    # the probe's size on CUDA: 2 GiB, but never more than a quarter of the free memory
    assert probe_bytes("cuda", None, 80 << 30) == 2 << 30
    assert probe_bytes("cuda", None, 4 << 30) == 1 << 30


def test_probe_size_on_the_cpu_exceeds_the_last_level_cache():
    assert probe_bytes("cpu", None, 64 << 30) == 512 << 20
    assert probe_bytes("cpu", 480 << 20, 64 << 30) == 960 << 20  # twice a large L3
    assert probe_bytes("cpu", 480 << 20, 2 << 30) == 256 << 20  # but at most an eighth of the memory


def test_a_real_bandwidth_probe():
    real = measure_bandwidth(torch.device("cpu"), nbytes=16 << 20, repeats=2)
    assert real.read_gbps > 0.1 and real.copy_gbps > 0.1 and real.used == "read" and real.gbps == real.read_gbps
    assert real.read_range[0] <= real.read_gbps <= real.read_range[1]
    assert real.nbytes == 16 << 20 and real.repeats == 2


def _probe(lo: float, hi: float) -> dict:
    return Bandwidth((lo + hi) / 2, 30.0, 1 << 20, "cpu", read_range=(lo, hi), repeats=7).as_dict()


def test_a_run_whose_bandwidth_moved_past_the_steady_swing_is_called_unsteady():
    from kvbench.bench.floor import STEADY_SWING, unsteady

    assert unsteady({"bandwidth": _probe(30.0, 30.0 * STEADY_SWING)}) is None  # at the limit: steady
    assert unsteady({}) is None and unsteady({"bandwidth": _probe(math.nan, math.nan)}) is None  # nothing probed
    note = unsteady({"bandwidth": _probe(33.0, 35.0), "by_prompt_len": {"512": _probe(29.1, 63.7)}})
    assert note is not None and "between 29.1 and 63.7 GB/s (x2.19)" in note  # the rounds' extremes count
    # each probe steady, but the run's first and a later one far apart
    assert "(x1.80)" in unsteady({"bandwidth": _probe(33.0, 34.0), "by_prompt_len": {"8": _probe(55.0, 59.4)}})
    # every probe steady, but a timed run met another bandwidth (the reads beside it, x_floor_paired)
    steady = {"bandwidth": _probe(30.0, 34.0), "by_prompt_len": {"512": _probe(31.0, 36.0)}}
    assert unsteady({**steady, "paired_read_gbps": {"kvbench static prompt 512 batch 1": [33.0, 35.5]}}) is None
    note = unsteady({**steady, "paired_read_gbps": {"a": [33.0, 35.5], "b": [34.0, 63.0]}})
    assert note is not None and "between 30.0 and 63.0 GB/s (x2.10)" in note


def test_bench_says_when_the_floor_is_unsteady_and_not_when_it_is_steady(tmp_path, monkeypatch):
    import dataclasses

    from typer.testing import CliRunner

    from kvbench.bench import floor
    from kvbench.cli import app
    from kvbench.cli import bench as cli_bench

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real = floor.measure_bandwidth(torch.device("cpu"), nbytes=16 << 20, repeats=2)
    argv = ["bench", "--model", "gpt2-tiny", "--weights", "random", "--device", "cpu", "--repeats", "1"]
    argv += ["--warmup", "0", "--prompt-len", "8", "--new-tokens", "4", "--caches", "static"]
    for hi, shown in ((real.read_gbps, False), (2 * real.read_gbps, True)):
        # the machine's bandwidth as a shared host moves it: the real probe, its fastest repeat `hi`
        moved = dataclasses.replace(real, read_range=(real.read_gbps, hi))
        monkeypatch.setattr(cli_bench, "measure_bandwidth", lambda dev, moved=moved: moved)
        monkeypatch.setattr(floor, "read_now", lambda bw, repeats=3: bw.read_gbps)  # the reads beside the run too
        result = CliRunner().invoke(app, [*argv, "--out", str(tmp_path / f"run-{shown}")])
        assert result.exit_code == 0, result.output
        assert ("unsteady floor: the device's read bandwidth moved" in result.stdout) == shown, result.stdout
