"""Decode cost against context: caches filled to a context with random K/V (no prefill), then decode steps timed.

Prefill at 16k tokens takes minutes on a CPU, and what the question "does the cached step stay flat?" needs is the
decode step at that context. So each cache is filled directly through its own `update` with random keys and values
of the context's length (`bench --fill random`, labelled as such in every output), and only the decode steps that
follow are timed, each synchronised. The weights are random too: the time of a step does not depend on the values
it reads.

Past GPT-2's 1,024 positions this runs `gpt2-long`, GPT-2 124M's widths with 65,536 learned positions: a synthetic
configuration for timing only (random weights, never a checkpoint).

Per (context, cache) the caches are allocated once; each of the `warmup + repeats` runs resets them, fills them to
the context and times `new_tokens` decode steps from there, so warm-ups have exactly the shapes of the timed runs.
The median, 10th and 90th percentiles are over every timed step of every timed run.

A lossy cache's row also carries its distortion at that context (check/distortion.py), untimed, after its timed
runs: it and the full-precision `static` cache are filled with the same random K/V and fed the same tokens. Random
K/V read by random weights describe this model and this fill only: the figures show how the loss moves with depth.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench import validate
from kvbench.bench import floor
from kvbench.bench.engines import KVBenchEngine
from kvbench.bench.sweep import failure_status
from kvbench.bench.timing_stats import describe_ms
from kvbench.caches import get_cache_spec, make_caches
from kvbench.check.distortion import Distortion, measure_layers
from kvbench.decode import fixed_step
from kvbench.devices import synchronize
from kvbench.model.gpt2 import GPT
from kvbench.rows import CsvRow

FILL_CHUNK = 4096  # tokens per update while filling: bounds the temporary random K/V
FILL_NOTE = (
    "caches filled with random K/V to the context through each cache's own update (no prefill); only the decode "
    "steps after it are timed. Weights are random: a step's time does not depend on the values it reads."
)


@dataclass
class ContextRow(CsvRow):
    cache: str
    context: int  # tokens in the cache before the first timed step
    new_tokens: int  # decode steps timed per repeat
    batch: int
    dtype: str
    device: str
    fill: str  # "random": filled with random K/V, no prefill
    status: str  # ok | oom | error: ...
    tpot_ms_median: float  # every timed step of every timed repeat pooled
    tpot_ms_p10: float
    tpot_ms_p90: float
    floor_ms: float  # the bandwidth floor of the median step (bench/floor.py)
    x_floor: float  # tpot_ms_median / floor_ms
    step_bytes: int  # what the median step must move
    kv_read_bytes: int  # of which K/V read by attention
    weight_bytes: int  # of which weights
    design_bytes: int  # of which the design's own copies (torch.cat, gathers, dequantisation)
    kv_cache_mib: float  # bytes the caches hold or reserve
    repeats: int  # timed repeats behind the medians
    # A lossy cache against the full-precision `static` cache, both filled with the same random K/V, teacher-forced
    # on that cache's greedy tokens (measure_distortion); empty for exact caches. As SummaryRow's.
    kl_mean: float = math.nan
    top1_agreement: float = math.nan
    mean_abs_dp: float = math.nan

    def distortion_key(self) -> str:
        """The row's name among meta.json's distortion rows."""
        return f"{self.cache} context {self.context}"


@dataclass
class ContextDistortionRow(CsvRow):
    """One teacher-forced step of a lossy cache at a filled context (distortion.csv)."""

    cache: str
    context: int
    batch: int
    token: int  # 1..new_tokens: the step after the context's first fed token is token 1
    depth: int  # tokens its step reads: context + token
    kl: float  # as DistortionRow's (bench/rows.py)
    top1_agreement: float
    abs_dp: float


@dataclass
class ContextStepRow(CsvRow):
    cache: str
    context: int
    batch: int
    repeat: int  # 1..repeats (timed runs only)
    step: int  # 1..new_tokens; step i attends over context + i slots
    latency_ms: float


@dataclass
class ContextResult:
    summary: ContextRow
    steps: list[ContextStepRow]
    distortion: Distortion | None = None  # a lossy cache's cost at this context
    distortion_failed: str = ""  # why a lossy cache's distortion was not measured (failure_status)


def fill_random(caches: list, model: GPT, batch: int, context: int, generator: torch.Generator) -> None:
    """Write `context` tokens of random K/V into every layer's cache through its own update (B, H, T, Dh). One
    random block of FILL_CHUNK tokens is drawn per fill and written chunk after chunk (drawing 16k tokens x 12
    layers afresh would take longer than the steps it prepares; the values do not change a step's time)."""
    cfg, w = model.config, model.lm_head.weight
    T0 = min(FILL_CHUNK, context)
    shape = (batch, cfg.n_head, T0, cfg.head_dim)  # (B, H, T0, Dh)
    k, v = (torch.randn(shape, generator=generator).to(w.device, w.dtype) for _ in range(2))
    for start in range(0, context, FILL_CHUNK):
        T = min(FILL_CHUNK, context - start)
        positions = torch.arange(start, start + T, device=w.device).expand(batch, T)  # (B, T)
        for cache in caches:
            cache.update(k[:, :, :T], v[:, :, :T], positions)


@torch.inference_mode()
def time_decode(
    model: GPT, cache: str, caches: list, context: int, steps: int, batch: int, compile: str = "off"
) -> list[float]:
    """`steps` greedy decode steps after a filled cache of `context` tokens; seconds per step (forward + argmax),
    the device synchronised before and after each."""
    spec = get_cache_spec(cache)
    device = model.lm_head.weight.device
    forward = fixed_step.runner_for(model, caches, compile=compile) if spec.fixed_step else model
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


DISTORTION_SEED = 1  # added to --seed: every lossy cache at a context reads the same K/V, apart from the timed fills


def measure_distortion(model: GPT, cache: str, context: int, new_tokens: int, batch: int, seed: int) -> Distortion:
    """Cache `cache` against the full-precision `static` cache, both filled with the same random K/V to `context`
    (fill_random), then fed one seeded random token and teacher-forced for `new_tokens` steps (check/distortion.py).
    The K/V and the token depend on `seed` and `context` only: every cache at a context is measured on the same."""
    g = torch.Generator().manual_seed(seed + DISTORTION_SEED)
    first = torch.randint(0, model.config.vocab_size, (batch, 1), generator=g).tolist()  # (B, 1)
    fill = lambda caches: fill_random(caches, model, batch, context, g)  # noqa: E731
    return measure_layers(model, cache, first, new_tokens, context, fill)


def median_step_bytes(model: GPT, cache: str, context: int, new_tokens: int, batch: int) -> floor.StepBytes:
    """The bytes of the median timed step: steps attend over context+1 .. context+new_tokens slots."""
    cfg, dtype = model.config, model.lm_head.weight.dtype
    traffic = KVBenchEngine.traffic(cache)
    return floor.step_bytes(cfg, dtype, batch, context + (new_tokens + 1) // 2, context + new_tokens, traffic)


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
    on_result: Callable[[ContextResult], None] | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
    compile: str = "off",
) -> list[ContextResult]:
    """Every (context, cache), contexts outermost so that an interrupted sweep has every cache at the contexts it
    finished. A configuration that runs out of memory, or whose cache raises, becomes a row saying so."""
    cfg = model.config
    # the caller's promise (bench/rules.py refuses none with --fill random; settings.check_sizes, the context)
    assert "none" not in caches, caches
    assert not any(validate.past_context(c + new_tokens, cfg.block_size) for c in contexts), (contexts, new_tokens)
    total, done, results = len(caches) * len(contexts) * (warmup + repeats), 0, []

    def advance(n: int, label: str) -> None:
        nonlocal done
        done += n
        if on_progress:
            on_progress(done, total, label)

    g = torch.Generator().manual_seed(seed)
    common = dict(new_tokens=new_tokens, batch=batch, dtype=dtype_name, device=device_label, fill="random")
    for L in contexts:
        for cache in caches:
            runs, held, status = _measure(model, cache, L, new_tokens, warmup + repeats, batch, g, compile, advance)
            timed = runs[warmup:]
            b = median_step_bytes(model, cache, L, new_tokens, batch)
            row = _row(common, cache, L, status, timed, b, floor.floor_ms(b, bandwidth), held)
            steps = [
                ContextStepRow(cache, L, batch, r + 1, i + 1, 1e3 * t)
                for r, run in enumerate(timed)
                for i, t in enumerate(run)
            ]
            results.append(ContextResult(row, steps))
            if status == "ok" and not get_cache_spec(cache).exact:
                _add_distortion(results[-1], model, new_tokens, batch, seed)
            if on_result:
                on_result(results[-1])
    return results


def _add_distortion(result: ContextResult, model: GPT, new_tokens: int, batch: int, seed: int) -> None:
    """A lossy cache's row at a context: its cost against the full-precision cache (measure_distortion), after its
    timed runs; a pass that raises leaves the columns empty and says why in `distortion_failed`."""
    r = result.summary
    try:
        d = measure_distortion(model, r.cache, r.context, new_tokens, batch, seed)
    except Exception as e:  # oom, or a plugin that raised: the timed row stands
        result.distortion_failed = failure_status(e)
    else:
        r.kl_mean, r.top1_agreement, r.mean_abs_dp = d.kl_mean, d.top1_agreement, d.mean_abs_dp
        result.distortion = d
    if model.lm_head.weight.device.type == "cuda":
        torch.cuda.empty_cache()


def _measure(
    model: GPT,
    cache: str,
    context: int,
    new_tokens: int,
    runs: int,
    batch: int,
    generator: torch.Generator,
    compile: str,
    advance: Callable[[int, str], None],
) -> tuple[list[list[float]], int, str]:
    """`runs` runs of one (context, cache) on caches allocated once: each resets them, fills them to `context` and
    times `new_tokens` decode steps. Returns (seconds per step of each run, bytes the caches held, status): status
    `ok`, or failure_status's line, with no runs, when the allocation or a run raised."""
    dev, dt = model.lm_head.weight.device, model.lm_head.weight.dtype
    label = f"{cache} context {context:,} (random fill)"
    out: list[list[float]] = []
    held, failure = 0, None
    try:
        layers = make_caches(cache, model.cache_config, batch, context + new_tokens, dt, dev)
        assert layers is not None, "a random fill needs a cache (bench/rules.py refuses none)"
        for _ in range(runs):
            for c in layers:
                c.reset()
            fill_random(layers, model, batch, context, generator)
            out.append(time_decode(model, cache, layers, context, new_tokens, batch, compile))
            advance(1, label)
        held = sum(c.nbytes for c in layers)
    except Exception as e:  # oom, or a cache plugin that raised: the row says so, the sweep goes on
        failure = failure_status(e)
    layers = None  # outside the except block: the caches (and the exception's frames) are freed here
    if failure is not None:
        advance(runs - len(out), f"{label}: {failure}")
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return ([], 0, failure) if failure is not None else (out, held, "ok")


def _row(
    common: dict,
    cache: str,
    context: int,
    status: str,
    timed: list[list[float]],
    b: floor.StepBytes,
    floor_ms: float,
    held: int,
) -> ContextRow:
    """One (context, cache)'s summary row: percentiles over every timed step of every timed run (NaN: none)."""
    steps = [x for r in timed for x in r]
    tpot = describe_ms(steps, (10.0, 50.0, 90.0))  # NaN when no step was timed
    med = tpot["p50"]
    return ContextRow(
        cache=cache,
        context=context,
        **common,
        status=status,
        tpot_ms_median=med,
        tpot_ms_p10=tpot["p10"],
        tpot_ms_p90=tpot["p90"],
        floor_ms=floor_ms,
        x_floor=med / floor_ms,
        step_bytes=b.total,
        kv_read_bytes=b.kv,
        weight_bytes=b.weights,
        design_bytes=b.design,
        kv_cache_mib=held / 2**20,
        repeats=len(timed),
    )
