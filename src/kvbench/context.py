"""Decode cost against context: caches filled to a context with random K/V (no prefill), then decode steps timed.

Prefill at 16k tokens takes minutes on a CPU, and what the seed's question needs is the decode step at that context:
does it stay flat? So each cache is filled directly through its own `update` with random keys and values of the
context's length (`--fill random`, labelled as such in every output), and only the decode steps that follow are timed,
each synchronised. The weights are random too: the time of a step does not depend on the values it reads.

Past GPT-2's 1,024 positions this runs `gpt2-long`, GPT-2 124M's widths with 65,536 learned positions: a synthetic
configuration for timing only (random weights, never a checkpoint).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from kvbench import floor
from kvbench.caches import get_cache_spec, make_caches
from kvbench.devices import synchronize
from kvbench.errors import KVBenchError
from kvbench.model import GPT

FILL_CHUNK = 1024  # tokens per update while filling: bounds the temporary random K/V


@dataclass
class ContextRow:
    cache: str
    context: int  # tokens in the cache before the first timed step
    new_tokens: int  # decode steps timed per repeat
    batch: int
    dtype: str
    device: str
    fill: str  # "random": filled without a prefill
    status: str  # ok | oom | error: ...
    tpot_ms_median: float
    tpot_ms_p10: float
    tpot_ms_p90: float
    repeats: int
    floor_ms: float  # the bandwidth floor of the median step (floor.py)
    x_floor: float  # tpot_ms_median / floor_ms
    step_bytes: int  # what the median step must move
    kv_read_bytes: int  # of which K/V read by attention
    weight_bytes: int  # of which weights
    kv_cache_mib: float  # bytes the caches hold or reserve

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def fill_random(caches: list, model: GPT, batch: int, context: int, generator: torch.Generator) -> None:
    """Write `context` tokens of random K/V into every layer's cache through its own update (B, H, T, Dh)."""
    cfg, w = model.config, model.lm_head.weight
    for start in range(0, context, FILL_CHUNK):
        T = min(FILL_CHUNK, context - start)
        positions = torch.arange(start, start + T, device=w.device).expand(batch, T)  # (B, T)
        for cache in caches:
            k, v = (
                torch.randn(batch, cfg.n_head, T, cfg.head_dim, generator=generator).to(w.device, w.dtype)
                for _ in range(2)
            )  # (B, H, T, Dh)
            cache.update(k, v, positions)


@torch.inference_mode()
def time_decode(model: GPT, cache: str, caches: list, context: int, steps: int, batch: int) -> list[float]:
    """`steps` greedy decode steps after a filled cache of `context` tokens; seconds per step, synchronised."""
    spec = get_cache_spec(cache)
    device = model.lm_head.weight.device
    forward = model if spec.decode_runner is None else spec.decode_runner(model, caches)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (B, 1)
    out = []
    for i in range(steps):
        positions = torch.full((batch, 1), context + i, dtype=torch.long, device=device)  # (B, 1)
        synchronize(device)
        t0 = time.perf_counter()
        logits = forward(ids, positions, caches, None, last_only=True)[:, -1]  # (B, V)
        ids = logits.argmax(-1, keepdim=True)
        synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_context_sweep(
    model: GPT,
    caches: list[str],
    contexts: list[int],
    new_tokens: int,
    repeats: int,
    warmup: int,
    batch: int,
    bandwidth: floor.Bandwidth,
    dtype_name: str,
    device_label: str,
    seed: int = 0,
    on_row: Callable[[ContextRow], None] | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> list[ContextRow]:
    """Every (cache, context): fill once per run, time `new_tokens` decode steps; the first `warmup` runs untimed."""
    cfg = model.config
    dev, dt = model.lm_head.weight.device, model.lm_head.weight.dtype
    too_long = [c for c in contexts if c + new_tokens > cfg.block_size]
    if too_long:
        raise KVBenchError(
            f"context + new tokens exceeds {cfg.name}'s {cfg.block_size:,} positions for {too_long}; "
            "use --model gpt2-long (65,536 positions) or shorter contexts"
        )
    if "none" in caches:
        raise KVBenchError(
            "--fill random times decode steps over a filled cache; `none` has no cache to fill"
        )
    elt = model.lm_head.weight.element_size()
    rows, total, done = [], len(caches) * len(contexts) * (warmup + repeats), 0
    g = torch.Generator().manual_seed(seed)
    for cache in caches:
        design = get_cache_spec(cache).name
        for L in contexts:
            label = f"{cache} context {L:,} (random fill)"
            steps: list[float] = []
            status, held = "ok", 0
            try:
                layers = make_caches(cache, cfg, batch, L + new_tokens, dt, dev)
                for i in range(warmup + repeats):
                    for c in layers:
                        c.reset()
                    fill_random(layers, model, batch, L, g)
                    t = time_decode(model, cache, layers, L, new_tokens, batch)
                    if i >= warmup:
                        steps += t
                    done += 1
                    if on_progress:
                        on_progress(done, total, label)
                held = sum(c.nbytes for c in layers)
                del layers
            except torch.cuda.OutOfMemoryError:
                status = "oom"
            except RuntimeError as e:
                if "can't allocate memory" not in str(e):
                    raise
                status = "oom"
            if status != "ok":
                done = min(total, done + warmup + repeats)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            fl, b = _floor(cfg, elt, batch, L, new_tokens, design, bandwidth)
            med = 1e3 * statistics.median(steps) if steps else math.nan
            row = ContextRow(
                cache=cache, context=L, new_tokens=new_tokens, batch=batch, dtype=dtype_name, device=device_label,
                fill="random", status=status, tpot_ms_median=med,
                tpot_ms_p10=1e3 * _pct(steps, 0.1) if steps else math.nan,
                tpot_ms_p90=1e3 * _pct(steps, 0.9) if steps else math.nan, repeats=repeats if steps else 0,
                floor_ms=fl, x_floor=med / fl, step_bytes=b.total, kv_read_bytes=b.kv, weight_bytes=b.weights,
                kv_cache_mib=held / 2**20,
            )  # fmt: skip
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def _floor(cfg, elt, batch, context, new_tokens, design, bw) -> tuple[float, floor.StepBytes]:
    """The floor of the median timed step: steps attend over context+1 .. context+new_tokens slots."""
    b = floor.step_bytes(cfg, elt, batch, context + (new_tokens + 1) // 2, context + new_tokens, design)
    return 1e3 * b.total / (bw.gbps * floor.GB), b
