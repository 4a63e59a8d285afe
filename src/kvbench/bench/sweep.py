"""Sweeps and timing: engine x cache x prompt length, warm-up, synchronised clocks, repeats, cold vs warm.

For each configuration (engine, cache, prompt length, new tokens, batch) the engine prepares the configuration once
(our caches are allocated once and reset between runs; static-graph captures its CUDA graph once), then the sweep
runs `warmup` runs and `repeats` timed runs, each a whole generation of exactly `new_tokens` tokens from the same
random prompt ids. The first run of a configuration is the *cold* run: on CUDA it starts from an emptied allocator
cache and pays allocation, kernel selection, plan building for attention shapes not seen earlier in the sweep,
graph capture (static-graph) or compilation (hf-compiled). It is reported in its own columns and never mixed into
the warm medians (when `warmup` is 0 it is also the first timed repeat). Warm runs follow with the same shapes and
the same caches; nothing is freed or emptied between them. Every timed region is bracketed by a device
synchronisation.

Per configuration the summary holds medians over the timed repeats, the pooled decode-step distribution, peak
memory above what was allocated before the configuration (plus the weights of the engine in use, counted once),
whether its tokens agree with kvbench's `none` (bench/agreement.py) and which SDPA backend its attention calls got
(bench/backends.py); see docs/bench.md for every column. Rows come back through `on_result` as each configuration
completes, so a caller can write them at once and an interrupted sweep keeps what it finished. A configuration
that fails (out of memory, or an error raised by a cache plugin) becomes a row whose status says so, and the sweep
goes on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvbench.bench import floor
from kvbench.bench.agreement import TokenCheck, check_tokens
from kvbench.bench.backends import c_attention_calls, watch_sdpa
from kvbench.bench.engines import ENGINES, Configuration, Engine, RunTiming, build_engines
from kvbench.bench.profile import profile_run
from kvbench.bench.rows import ConfigResult, StepRow, SummaryRow
from kvbench.bench.settings import (
    BenchSettings,
    check_fits_context,
)
from kvbench.bench.timing_stats import ALWAYS, TTFT_PERCENTILES, describe_ms, tpot_extra_columns
from kvbench.caches import get_cache_spec
from kvbench.caches.base import Traffic
from kvbench.check.distortion import measure_layers
from kvbench.devices import memory_in_use, memory_peak, reset_peak_memory
from kvbench.errors import KVBenchError, is_out_of_memory
from kvbench.model import gemv
from kvbench.model.gpt2 import GPT, GPTConfig

if TYPE_CHECKING:
    from kvbench.bench.hf_sweep import HFBenchConfig, SweepModel


def seed_copy_estimate(bytes_per_token: int, n0: int, n1: int) -> float:
    """The seed's estimate of torch.cat traffic growing a cache from n0 to n1 tokens: bytes/token x (n1^2 - n0^2)/2."""
    return bytes_per_token * (n1 * n1 - n0 * n0) / 2


def _nan_row(**kw: object) -> SummaryRow:
    base: dict[str, Any] = {f.name: math.nan for f in fields(SummaryRow) if f.name != "tpot_ms_more"}
    base.update(flips=0, near_tie_flips=0, tokens_note="", sdpa_prefill="", sdpa_decode="", repeats=0)
    base.update(kw)
    return SummaryRow(**base)


def family(engine: str) -> str:
    """Rows of one family share a `none` baseline: hf-compiled is measured against transformers' own `none`."""
    return ENGINES[engine].family if engine in ENGINES else engine


def fill_relative(rows: list[SummaryRow]) -> None:
    """Fill the columns that compare rows of one run: speedup over the family's `none`, and TPOT against the
    fastest transformers row, both at the same prompt length and batch size. Recomputed from all rows, so sweep
    order does not matter."""
    ok = [r for r in rows if r.status == "ok"]
    base = {(family(r.engine), r.prompt_len, r.batch): r.total_s for r in ok if r.cache == "none"}
    fastest_hf: dict[tuple[int, int], float] = {}
    for r in ok:
        if family(r.engine) == "hf" and r.tpot_ms_median == r.tpot_ms_median:
            at = (r.prompt_len, r.batch)
            fastest_hf[at] = min(fastest_hf.get(at, math.inf), r.tpot_ms_median)
    for r in ok:
        key = (family(r.engine), r.prompt_len, r.batch)
        r.speedup_vs_none = base[key] / r.total_s if key in base else math.nan
        hf = fastest_hf.get((r.prompt_len, r.batch))
        r.speedup_vs_fastest_hf = hf / r.tpot_ms_median if hf is not None else math.nan


def failure_status(e: BaseException) -> str:
    """A configuration that raised: `oom` for an allocation failure on any device, else `error: <one line>`."""
    if is_out_of_memory(e):
        return "oom"
    text = " ".join(str(e).split())
    what = text if isinstance(e, KVBenchError) else f"{type(e).__name__}: {text}" if text else type(e).__name__
    return f"error: {what[:300]}"


# --- the sweep ---------------------------------------------------------------------------------------------------
ProgressFn = Callable[[int, int, str], None]  # (runs done, runs total, label of the run just finished)


def plan(s: BenchSettings, engines: Mapping[str, Engine]) -> list[tuple[int, int, str, str]]:
    """(prompt_len, batch, engine, cache) in run order: per prompt length and batch size (as given), the reference
    engine's `none` first (every row's token reference: kvbench's, or with --hf the model's own), then per engine
    (as given) its `none` before its caches (as given)."""
    order = sorted(s.caches, key=lambda c: c != "none")
    reference = next((e for e in s.engine if engines[e].token_reference), None)
    out = []
    for p in s.prompt_len:
        for b in s.batch:
            todo = [(p, b, e, c) for e in s.engine for c in order if engines[e].supports(c)]
            ref = (p, b, reference, "none")
            out += ([ref] if ref in todo else []) + [x for x in todo if x != ref]
    return out


class _Progress:
    def __init__(self, total: int, fn: ProgressFn | None) -> None:
        self.done, self.total, self.fn = 0, total, fn

    def advance(self, n: int, label: str) -> None:
        self.done += n
        if self.fn is not None:
            self.fn(self.done, self.total, label)


def run_sweep(
    model: GPT | SweepModel,
    s: BenchSettings,
    dtype_name: str,
    device_label: str,
    on_result: Callable[[ConfigResult], None] | None = None,
    on_progress: ProgressFn | None = None,
    engines: Mapping[str, Engine] | None = None,
    bandwidth: floor.Bandwidth | None = None,
    oversized: dict[int, str] | None = None,
    profile_dir: Path | None = None,
) -> list[ConfigResult]:
    """Run every configuration of `s` on `model`; returns (and streams through `on_result`) one result each.
    bandwidth: the device's, for every row's floor; measured here (once) when not given. oversized: batch sizes
    predicted not to fit the device (settings.check_sizes), each made an `oom` row with its reason, not run.
    profile_dir: with s.profile, where each configuration's trace goes (bench/profile.py). Engines that run as one
    rank of a tensor-parallel sweep (bench/tp.py's RankEngine, on `model`, this rank's shard) have no floor, end
    the sweep when a configuration raises, and give rank 0's results every rank's row (ConfigResult.ranks)."""
    device = _head(model).device
    check_fits_context(s, model.config.block_size, model.config.name)
    if engines is None:
        assert isinstance(model, GPT), "a --hf sweep is given its engines"
        engines = build_engines(model, s.engine, s.compile)
    if device.type == "cpu":  # kvbench's C kernels (the projections' on the gemv route, `--compile max`'s attention
        gemv.library()  # on every route) built and tuned before any row's time or memory: on a machine's first run,
        # seconds and 494 MB of matrices
    if bandwidth is None and all(e.has_floor for e in engines.values()):
        bandwidth = floor.measure_bandwidth(device)
    oversized = oversized or {}
    configs = plan(s, engines)
    progress = _Progress(len(configs) * (s.warmup + s.repeats), on_progress)
    per_token = model.config.kv_bytes_per_token(_head(model).element_size())
    g = torch.Generator().manual_seed(s.seed)
    # one prompt per sequence of the largest batch that runs; a batch of b decodes its first b (the same text)
    rows = max((b for b in s.batch if b not in oversized), default=1)
    prompts = {p: torch.randint(0, model.config.vocab_size, (rows, p), generator=g) for p in s.prompt_len}
    refs: dict[tuple[int, int], list[list[int]]] = {}  # kvbench none's tokens per (prompt, batch): the reference
    results: list[ConfigResult] = []

    beside = _Beside(bandwidth)

    def emit(c: _Configuration, bw: floor.Bandwidth | None = bandwidth) -> None:
        results.append(c.finish(refs, per_token * c.batch, bw, profile_dir if s.profile else None))
        add_distortion(results[-1], model, c.ids, s.new_tokens)  # untimed, once finish has let the caches go
        beside.untimed()  # the row's checks, profile and distortion ran since the last read
        fill_relative([r.summary for r in results])
        if on_result is not None:
            on_result(results[-1])

    for p, b in dict.fromkeys((p, b) for p, b, _, _ in configs):
        ids = prompts[p][:b].to(device)
        shared = dict(prompt_len=p, new_tokens=s.new_tokens, batch=b, dtype=dtype_name, device=device_label)
        group = [
            _Configuration(
                model, engines[e], ids, s, progress, dict(engine=e, cache=c, **shared), oversized.get(b), beside
            )
            for p_, b_, e, c in configs
            if (p_, b_) == (p, b)
        ]
        _run_group(group, s.order, bandwidth, device, emit)
    return results


class _Beside:
    """The read bandwidth just before and just after each timed run (floor.read_now), for the paired floor. A read
    taken after one timed run is the next one's read before when nothing ran in between, so a round of k runs costs
    k + 1 reads; anything else between them (a cold or warm-up run, a round's probe, a finished row's checks,
    profile and distortion pass) drops it. It reads nothing without a floor (tensor parallelism, --hf models) and
    off the CPU: on CUDA a read's 2 GiB would stay in the caching allocator's pool that the rows' reserved memory
    measures, and the run's own probes stand."""

    def __init__(self, bandwidth: floor.Bandwidth | None) -> None:
        on_cpu = bandwidth is not None and torch.device(bandwidth.device).type == "cpu"
        self.bandwidth = bandwidth if on_cpu else None
        self.last = math.nan

    def read(self) -> float:
        return math.nan if self.bandwidth is None else floor.read_now(self.bandwidth)

    def before(self) -> float:
        before, self.last = (self.last if self.last == self.last else self.read()), math.nan  # NaN: none kept
        return before

    def after(self) -> float:
        self.last = self.read()
        return self.last

    def untimed(self) -> None:
        self.last = math.nan


class _Emit(Protocol):
    def __call__(self, c: _Configuration, bw: floor.Bandwidth | None = ...) -> None: ...


def _run_group(
    group: list[_Configuration], order: str, bandwidth: floor.Bandwidth | None, device: torch.device, emit: _Emit
) -> None:
    """The configurations of one prompt length and batch size, each row emitted when it is complete."""
    if order == "sequential":  # each configuration's runs back to back, its row written when they end
        for c in group:
            c.run(c.n_runs)
            emit(c)
        return
    # interleaved: cold and warm-up runs back to back, then the timed runs in rounds over the group, so a
    # machine that slows down for a minute slows every row alike; the bandwidth is probed again each round
    # (the floor then moves with the same drift); the rows are written after the last round
    assert bandwidth is not None, "an interleaved sweep has a floor (rules: not under --tp)"
    probes, rounds = [bandwidth], (group[0].n_runs - group[0].back_to_back) if group else 0
    for c in group:
        c.run(c.back_to_back)
    for _ in range(rounds):
        probes.append(floor.measure_bandwidth(device, probes[0].nbytes, repeats=3))
        for c in group[:1]:  # the round's probe ran between the last timed run and the next: a read of its own
            c.beside.untimed()
        for c in group:
            c.run(1)
    pooled = floor.pooled(probes)
    for c in group:
        emit(c, pooled)


class _Configuration:
    """One configuration's runs: configured on its first run, then `run(n)` more at a time; `finish()` makes its
    row. In interleaved order only the back-to-back runs (cold and warm-up) record peak memory: during the rounds
    the other configurations' caches are allocated too."""

    def __init__(
        self,
        model: GPT | SweepModel,
        engine: Engine,
        ids: torch.Tensor,
        s: BenchSettings,
        progress: _Progress,
        common: dict[str, Any],
        oversized: str | None = None,
        beside: _Beside | None = None,
    ) -> None:
        self.model, self.engine, self.ids, self.s = model, engine, ids, s
        self.beside = beside or _Beside(None)
        self.has_floor = _traffic(model.config, common["engine"], common["cache"]) is not None
        self.run_gbps: list[float] = []  # per timed run: the mean of the reads just before and after it
        self.progress, self.common, self.batch = progress, common, common["batch"]
        self.label = f"{common['engine']} {common['cache']} prompt {common['prompt_len']}" + (
            f" batch {self.batch}" if len(s.batch) > 1 else ""
        )
        self.n_runs = s.warmup + s.repeats
        # runs made back to back (all of them in sequential order; cold and warm-ups, at least one, interleaved)
        self.back_to_back = self.n_runs if s.order == "sequential" else max(s.warmup, 1)
        self.conf: Configuration | None = None  # made by the first run
        self.runs: list[RunTiming] = []
        self.peaks: list[tuple[float, float]] = []  # (peak above the base, reserved) of the back-to-back runs
        self.failure: str | None = None
        self.base = 0.0
        self.compiled_in_c = False  # the timed runs called kvbench's attention op (a `--compile max` CPU step)
        self.oversized = oversized  # predicted not to fit the device: an `oom` row with this reason, never run
        if oversized is not None:
            self.failure = "oom"
            progress.advance(self.n_runs, f"{self.label}: oom (predicted: not run)")

    def run(self, n: int) -> None:
        device, cache = self.ids.device, self.common["cache"]
        n = min(n, self.n_runs - len(self.runs))
        if self.failure is not None or n <= 0:
            return
        if self.conf is None:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # every configuration's cold run starts from an empty pool; warm never do
            self.base = memory_in_use(device)
        c_calls = c_attention_calls()
        for _ in range(n):
            try:
                if self.conf is None:  # allocated once, inside the try: a failure here is this row's
                    max_len = self.common["prompt_len"] + self.s.new_tokens
                    self.conf = self.engine.configure(cache, self.batch, max_len)
                paired = self.has_floor and len(self.runs) >= self.s.warmup  # a timed run with a floor
                before = self.beside.before() if paired else math.nan  # outside the peak: the read's tensor
                reset_peak_memory(device)
                t = self.conf.run(self.ids, self.s.new_tokens)
                if len(self.runs) < self.back_to_back:  # a CPU resident set can shrink below its baseline
                    self.peaks.append((max(memory_peak(device) - self.base, 0.0), _reserved(device)))
                if paired:
                    self.run_gbps.append((before + self.beside.after()) / 2)
                else:
                    self.beside.untimed()
            except Exception as e:
                self.beside.untimed()
                if self.engine.failure_ends_sweep:  # one rank of several: the others are in this run's collectives
                    raise
                self.failure = failure_status(e)  # oom, or a plugin raised: the sweep goes on
                break
            self.runs.append(t)
            self.progress.advance(1, self.label)
        self.compiled_in_c |= c_attention_calls() > c_calls
        if self.failure is not None:  # outside the except block, so its frames (and tensors) are freed
            self.conf = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            self.progress.advance(self.n_runs - len(self.runs), f"{self.label}: {self.failure}")

    def finish(
        self,
        refs: dict[tuple[int, int], list[list[int]]],
        bpt: int,
        bandwidth: floor.Bandwidth | None,
        profile_dir: Path | None = None,
    ) -> ConfigResult:
        model, engine, ids, s, common = self.model, self.engine, self.ids, self.s, self.common
        cache, prompt_len, conf, runs = common["cache"], common["prompt_len"], self.conf, self.runs
        self.conf = None  # the row holds what it needs; the cache goes when this returns
        if self.failure is not None:
            note = f"not run: {self.oversized}" if self.oversized else ""
            return ConfigResult(_nan_row(**common, status=self.failure, tokens_note=note), [], [])
        assert conf is not None, "a configuration that did not fail ran"
        key = (prompt_len, self.batch)
        if engine.token_reference and cache == "none":
            refs.setdefault(key, runs[0].tokens)
        tokens = _check_tokens(model, conf, engine, cache, ids, s, refs.get(key), runs)
        try:
            sdpa = watch_sdpa(lambda: conf.probe(ids), model.config.n_layer, self.compiled_in_c)
        except Exception as e:  # a diagnosis, not a measurement: say it failed, keep the row
            sdpa = {"prefill": f"unknown ({type(e).__name__})", "decode": ""}
        result = _summarise(common, runs, s, self.peaks, engine.weight_bytes(), conf.capture_s, tokens, sdpa, bpt)
        if bandwidth is not None:  # none under tensor parallelism: a rank's step is not one device's floor
            add_floor(result, model.config, _head(model).dtype, bandwidth, runs[-1].cache_bytes)
            add_paired_floor(result, runs[s.warmup :], self.run_gbps)
        result.bandwidth = bandwidth
        result.ranks = engine.rank_rows(conf, ids, s.new_tokens, result.summary)  # None in one process
        if profile_dir is not None and engine.profiled:  # after every timed run: its overhead is in none of them
            labels = {k: common[k] for k in ("engine", "cache", "prompt_len", "batch")}
            result.profile = profile_run(lambda: conf.run(ids, s.new_tokens), ids.device, profile_dir, labels)
        return result


def add_floor(
    result: ConfigResult,
    cfg: GPTConfig | HFBenchConfig,
    dtype: torch.dtype,
    bw: floor.Bandwidth,
    cache_bytes: int | None,
) -> None:
    """Fill a completed row's floor_ms, x_floor and step_bytes. The buffer a whole-buffer design attends over
    (static-graph, transformers' StaticCache) is read from the cache the run held: transformers sizes its buffer
    per call, and never smaller than an earlier call's on the same model, so it can exceed prompt + new tokens."""
    r = result.summary
    traffic = _traffic(cfg, r.engine, r.cache)
    if traffic is None or not isinstance(cfg, GPTConfig):  # the second: what _traffic said, for the type checker
        return
    per_slot = cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * r.batch
    capacity = r.prompt_len + r.new_tokens
    if traffic.whole_buffer and cache_bytes:
        capacity = cache_bytes // per_slot
    engine = ENGINES[r.engine]
    welt, kvelt = engine.weight_element_size, engine.kv_element_size
    ms, b = floor.decode_floor_ms(cfg, dtype, r.batch, r.prompt_len, r.new_tokens, traffic, bw, capacity, welt, kvelt)
    r.floor_ms, r.x_floor, r.step_bytes = ms, r.tpot_ms_median / ms, float(b.total)
    result.floor_bytes = b


def add_paired_floor(result: ConfigResult, timed: list[RunTiming], run_gbps: list[float]) -> None:
    """Fill a row's paired x floor (floor.paired) from its timed runs and the read bandwidth beside each, once
    add_floor has given it a floor; a row without one, or with a run that has no decode step, keeps it empty."""
    b, r = result.floor_bytes, result.summary
    if b is None or len(run_gbps) != len(timed) or not all(t.step_s for t in timed):
        return
    p = floor.paired(b, [[1e3 * dt for dt in t.step_s] for t in timed], run_gbps)
    r.x_floor_paired, r.x_floor_paired_min, r.x_floor_paired_max = p.x_floor, p.x_floor_min, p.x_floor_max
    r.paired_read_gbps = p.read_gbps
    result.run_gbps = list(run_gbps)


def _traffic(cfg: GPTConfig | HFBenchConfig, engine: str, cache: str) -> Traffic | None:
    """What a row's median decode step moves, or None where it has no floor: --hf models (the byte count is
    GPT-2's) and `none` (no cache: the step recomputes the sequence)."""
    if not isinstance(cfg, GPTConfig) or engine not in ENGINES:
        return None
    return ENGINES[engine].traffic(cache)


def add_distortion(result: ConfigResult, model: GPT | SweepModel, ids: torch.Tensor, new_tokens: int) -> None:
    """A completed row of a lossy cache on our engine: its cost against the full-precision cache, teacher-forced
    from the same prompt ids, after every timed run (check/distortion.py). A pass that raises leaves the columns
    empty and says why in `distortion_failed`."""
    r = result.summary
    if r.status != "ok" or r.engine != "kvbench" or get_cache_spec(r.cache).exact:
        return
    assert isinstance(model, GPT), "only our engine's rows are measured"
    try:
        d = measure_layers(model, r.cache, ids.tolist(), new_tokens)
    except Exception as e:  # oom, or a plugin that raised: the timed row stands
        result.distortion_failed = failure_status(e)
        return
    r.kl_mean, r.top1_agreement, r.mean_abs_dp = d.kl_mean, d.top1_agreement, d.mean_abs_dp
    result.distortion = d


def _head(model: GPT | SweepModel) -> torch.Tensor:
    """The output projection's weight: its device and dtype are the run's."""
    w = model.lm_head.weight
    assert isinstance(w, torch.Tensor), "lm_head holds a weight tensor"
    return w


def _reserved(device: torch.device) -> float:
    return float(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else math.nan


def _check_tokens(
    model: GPT | SweepModel,
    conf: Configuration,
    engine: Engine,
    cache: str,
    ids: torch.Tensor,
    s: BenchSettings,
    ref: list[list[int]] | None,
    runs: list[RunTiming],
) -> TokenCheck:
    if ref is None:
        return TokenCheck.missing(f"no reference: {engine.reference_label} did not run at this prompt length")

    def rerun() -> tuple[list[list[int]], list[torch.Tensor]]:
        t = conf.run(ids, s.new_tokens, record_logits=True)
        assert t.logits is not None, "recorded"
        return t.tokens, t.logits

    # the rounding a correct path may show at a flip, and whether the cache is lossy
    rtol, atol, lossy = engine.token_tolerance(cache, _head(model).dtype)
    tokens = check_tokens(
        ref,
        [r.tokens for r in runs],
        lambda d: engine.reference_logits(ids, ref, d),
        rerun,
        rtol,
        atol,
        lossy=lossy,
    )
    unjudged = getattr(engine, "unjudged", lambda n: None)(ids.size(1) + s.new_tokens)
    if unjudged and tokens.flips:  # as verify: a difference the model's own discontinuity allows is not judged
        tokens.note = f"not judged exact ({unjudged}): {tokens.note}"
    return tokens


def _memory_columns(weights: int, peaks: list[tuple[float, float]], last: RunTiming) -> dict[str, Any]:
    """summary.csv's memory columns in MiB, from the timed runs' (allocated, reserved) peaks (interleaved runs: only
    the back-to-back ones recorded peaks, so the caller passes all of them) and the last run's cache."""
    mib, run_peak = 2**20, max(p for p, _ in peaks)
    return dict(
        peak_mem_mib=(weights + run_peak) / mib,
        weights_mib=weights / mib,
        run_peak_mib=run_peak / mib,
        peak_reserved_mib=max(r for _, r in peaks) / mib,
        kv_cache_mib=(last.cache_bytes / mib) if last.cache_bytes is not None else math.nan,
        bytes_copied=float(last.bytes_copied) if last.bytes_copied is not None else math.nan,
    )


def _summarise(
    common: dict[str, Any],
    runs: list[RunTiming],
    s: BenchSettings,
    peaks: list[tuple[float, float]],
    weights: int,
    capture_s: float | None,
    tokens: TokenCheck,
    sdpa: dict[str, str],
    bpt: int,
) -> ConfigResult:
    cold, timed = runs[0], runs[s.warmup :]
    totals = [t.total_s for t in timed]
    steps = [x for t in timed for x in t.step_s]
    total = statistics.median(totals)
    last, batch = timed[-1], common["batch"]
    ttft = describe_ms([t.ttft_s for t in timed], TTFT_PERCENTILES)
    tpot = describe_ms(steps, sorted({*ALWAYS, *s.percentiles}))  # median and p90, and those asked for
    ttft_columns: dict[str, Any] = {f"ttft_ms_{k}": v for k, v in ttft.items()}
    row = SummaryRow(
        **common,
        status="ok",
        ttft_ms=ttft["p50"],
        tpot_ms_median=tpot["p50"],
        tpot_ms_p90=tpot["p90"],
        **ttft_columns,
        tpot_ms_mean=tpot["mean"],
        tpot_ms_std=tpot["std"],
        tpot_ms_more={c: tpot[c.removeprefix("tpot_ms_")] for c in tpot_extra_columns(s.percentiles)},
        floor_ms=math.nan,  # filled by add_floor
        x_floor=math.nan,
        x_floor_paired=math.nan,  # filled by add_paired_floor
        x_floor_paired_min=math.nan,
        x_floor_paired_max=math.nan,
        paired_read_gbps=math.nan,
        step_bytes=math.nan,
        total_s=total,
        total_s_min=min(totals),
        total_s_max=max(totals),
        tokens_per_s=batch * s.new_tokens / total,
        decode_tokens_per_s=statistics.median(batch * len(t.step_s) / sum(t.step_s) for t in timed),
        speedup_vs_none=math.nan,  # filled by fill_relative
        speedup_vs_fastest_hf=math.nan,
        token_agreement=tokens.agreement,
        first_divergence=math.nan if tokens.first_divergence is None else float(tokens.first_divergence),
        flips=tokens.flips,
        near_tie_flips=tokens.near_tie_flips,
        tokens_note=tokens.note,
        **_memory_columns(weights, peaks[s.warmup :] or peaks, last),
        bytes_copied_seed_estimate=(
            seed_copy_estimate(bpt, common["prompt_len"], common["prompt_len"] + s.new_tokens)
            if common["cache"] != "none" and common["engine"] == "kvbench"
            else math.nan
        ),
        cold_ttft_ms=1e3 * cold.ttft_s,
        cold_tpot_ms_median=describe_ms(cold.step_s, (50.0,))["p50"],
        cold_total_s=cold.total_s,
        capture_ms=math.nan if capture_s is None else 1e3 * capture_s,
        sdpa_prefill=sdpa["prefill"],
        sdpa_decode=sdpa["decode"],
        repeats=len(timed),
    )
    return ConfigResult(row, _step_rows(common, timed), [1e3 * t.ttft_s for t in timed])


def _step_rows(common: dict, timed: list[RunTiming]) -> list[StepRow]:
    """steps.csv's rows: every decode step of every timed run, in ms."""
    at = (common["engine"], common["cache"], common["prompt_len"], common["batch"])
    return [StepRow(*at, r + 1, j + 1, 1e3 * dt) for r, t in enumerate(timed) for j, dt in enumerate(t.step_s)]
