"""Sweeps and timing: engine x cache x prompt length, warm-up, synchronised clocks, repeats, cold vs warm.

For each shape (engine, cache, prompt length, new tokens, batch) the sweep runs `warmup` untimed-for-the-summary
runs and then `repeats` timed runs, each a whole generation of exactly `new_tokens` tokens from the same random
prompt ids. The very first run of a shape is the *cold* run (allocator, kernel selection and caches still warming
up); it is reported in its own columns and never mixed into the warm medians (when `warmup` is 0 it is also the
first timed repeat). Every timed region is bracketed by a device synchronisation.

Per configuration the summary holds medians over the timed repeats and the pooled decode-step distribution
(see docs/bench.md for every column). Rows come back through `on_result` as each configuration completes, so a
caller can write them at once and an interrupted sweep keeps what it finished.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from kvbench.caches import CACHES, parse_cache_names
from kvbench.devices import peak_memory, reset_peak_memory, synchronize
from kvbench.errors import KVBenchError
from kvbench.generation import generate

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib


# --- settings ----------------------------------------------------------------------------------------------------
@dataclass
class BenchSettings:
    """One sweep. Every field can come from a TOML file in configs/bench/ and be overridden on the command line."""

    model: str = "gpt2"  # preset name or GPT-2 config.json
    weights: str = "auto"  # auto | hub | random | PATH
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # fp16 on CUDA, fp32 on the CPU
    seed: int = 0  # random weights and the random prompt ids
    prompt_len: list[int] = field(default_factory=lambda: [16, 128, 512])  # the seed's three prompt lengths
    new_tokens: int = 400  # generated tokens per run (the first from the prefill, the rest decode steps)
    caches: list[str] = field(default_factory=lambda: list(CACHES))  # every registered cache by default
    engine: list[str] = field(default_factory=lambda: ["kvbench", "hf"])
    batch: int = 1  # sequences per run (same length, no padding)
    repeats: int = 3  # timed runs per configuration
    warmup: int = 1  # runs before the timed ones, same shapes; the first of them is the reported cold run
    out: str | None = None  # run directory; None: results/<timestamp>-bench/
    threads: int | None = None  # torch intra-op CPU threads; None: torch's default (one per core)


SETTING_KEYS = tuple(f.name for f in fields(BenchSettings))


def _as_list(key: str, value, cast, where: str) -> list:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple):
        value = [value]
    try:
        return [cast(v) for v in value]
    except (TypeError, ValueError):
        raise KVBenchError(f"{where}: {key} must be a list of {cast.__name__}s, got {value!r}") from None


def coerce(raw: dict, where: str) -> dict:
    """Validate keys and types of settings from a file or the command line; unknown keys are errors naming them."""
    out = {}
    for key, value in raw.items():
        if key not in SETTING_KEYS:
            raise KVBenchError(f"{where}: unknown key {key!r}; known keys: {', '.join(SETTING_KEYS)}")
        if key == "prompt_len":
            value = _as_list(key, value, int, where)
        elif key in ("caches", "engine"):
            value = _as_list(key, value, str, where)
        elif key in ("new_tokens", "batch", "repeats", "warmup", "seed", "threads"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise KVBenchError(f"{where}: {key} must be an integer, got {value!r}")
        elif not isinstance(value, str):
            raise KVBenchError(f"{where}: {key} must be a string, got {value!r}")
        out[key] = value
    return out


def resolve_config_path(path: str | Path) -> Path:
    """A TOML file, or the name of a sweep shipped with kvbench (`seed`, `quick`: configs/bench/NAME.toml)."""
    from kvbench.resources import bench_config_names, config_file

    p = Path(path).expanduser()
    if p.exists() or p.suffix or "/" in str(path):
        if p.is_dir():
            raise KVBenchError(
                f"--config {p} is a directory; give a TOML file or one of {bench_config_names()}"
            )
        return p
    if str(path) in bench_config_names():
        return config_file("bench", f"{path}.toml")
    raise KVBenchError(
        f"--config {path!r}: no such file, and no shipped sweep of that name; shipped: {', '.join(bench_config_names())}"
    )


def load_settings(path: str | Path | None, overrides: dict) -> BenchSettings:
    """Defaults < the TOML file at `path` < `overrides` (command-line options that were given, None = not given)."""
    merged: dict = {}
    if path is not None:
        p = resolve_config_path(path)
        try:
            with p.open("rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise KVBenchError(f"cannot read --config {p}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise KVBenchError(f"--config {p} is not valid TOML: {e}") from None
        merged.update(coerce(data, str(p)))
    merged.update(coerce({k: v for k, v in overrides.items() if v is not None}, "command line"))
    s = BenchSettings(**merged)
    check_settings(s)
    return s


def check_settings(s: BenchSettings) -> None:
    for key in ("repeats", "batch"):
        if getattr(s, key) < 1:
            raise KVBenchError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(s, key)}")
    if s.threads is not None and s.threads < 1:
        raise KVBenchError(f"--threads must be >= 1, got {s.threads}")
    if s.warmup < 0:
        raise KVBenchError(f"--warmup must be >= 0, got {s.warmup}")
    if s.new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (one prefill token + decode steps), got {s.new_tokens}"
        )
    if not s.prompt_len or min(s.prompt_len) < 1:
        raise KVBenchError(f"--prompt-len values must be >= 1, got {s.prompt_len}")
    s.caches = parse_cache_names(",".join(s.caches))
    for e in s.engine:
        if e not in ENGINES:
            raise KVBenchError(f"unknown engine {e!r}; engines: {', '.join(ENGINES)}")


def check_fits_context(s: BenchSettings, block_size: int, model_name: str) -> None:
    """Reject an impossible sweep before any work, naming every offending prompt length."""
    bad = [p for p in s.prompt_len if p + s.new_tokens > block_size]
    if bad:
        raise KVBenchError(
            f"prompt length + new tokens exceeds {model_name}'s context of {block_size}: "
            + ", ".join(f"{p} + {s.new_tokens} = {p + s.new_tokens}" for p in bad)
            + f"; use --prompt-len <= {block_size - s.new_tokens} or fewer --new-tokens"
        )


# --- engines -----------------------------------------------------------------------------------------------------
@dataclass
class RunTiming:
    """One whole generation, timed. total_s: the whole call, device synchronised at both ends."""

    ttft_s: float
    step_s: list[float]
    total_s: float
    cache_bytes: int | None
    bytes_copied: int | None
    tokens: list[list[int]]


class KVBenchEngine:
    """Our generation loop (generation.generate) on our GPT; every registered cache."""

    name = "kvbench"

    def __init__(self, model) -> None:
        self.model = model

    def supports(self, cache: str) -> bool:
        return True  # every registered cache and plugin runs through our loop (names validated up front)

    def run(self, ids: torch.Tensor, new_tokens: int, cache: str) -> RunTiming:
        device = ids.device
        synchronize(device)
        t0 = time.perf_counter()
        r = generate(self.model, ids.tolist(), new_tokens, cache=cache)
        synchronize(device)
        total = time.perf_counter() - t0
        return RunTiming(r.ttft_s, r.step_s, total, r.cache_bytes, r.bytes_copied, r.tokens)


class HFEngine:
    """transformers' generate on the same weights (see hf_engine.py for what its numbers include)."""

    name = "hf"

    def __init__(self, model) -> None:
        from kvbench.hf_engine import build_hf_model

        self.hf = build_hf_model(model)

    def supports(self, cache: str) -> bool:
        from kvbench.hf_engine import HF_CACHES

        return cache in HF_CACHES

    def run(self, ids: torch.Tensor, new_tokens: int, cache: str) -> RunTiming:
        from kvbench.hf_engine import hf_generate

        r = hf_generate(self.hf, ids, new_tokens, cache)
        return RunTiming(r.ttft_s, r.step_s, r.total_s, r.cache_bytes, None, r.tokens)


# One registry of engines: the CLI's --engine choices and the sweep iterate it.
ENGINES: dict[str, type] = {"kvbench": KVBenchEngine, "hf": HFEngine}


# --- rows --------------------------------------------------------------------------------------------------------
@dataclass
class SummaryRow:
    engine: str
    cache: str
    prompt_len: int
    new_tokens: int
    batch: int
    dtype: str
    device: str
    status: str  # ok | oom
    ttft_ms: float  # median over timed repeats: prefill + first token
    tpot_ms_median: float  # median decode-step latency, all steps of all timed repeats pooled
    tpot_ms_p90: float
    total_s: float  # median over timed repeats: the whole generation, prefill included
    total_s_min: float
    total_s_max: float
    tokens_per_s: float  # batch x new_tokens / total_s
    speedup_vs_none: float  # total_s of this engine's `none` at the same prompt length / total_s
    peak_mem_mib: float  # CUDA max_memory_allocated; CPU: process peak RSS (high-water mark)
    peak_reserved_mib: float  # CUDA max_memory_reserved; NaN on the CPU
    kv_cache_mib: float  # bytes the cache holds at the end of a run
    bytes_copied: float  # history bytes copied by cache updates in one run (NaN where not counted)
    bytes_copied_seed_estimate: (
        float  # the seed's bytes/token x (n1^2 - n0^2)/2, n0 = prompt, n1 = prompt + new
    )
    cold_ttft_ms: float  # the first run of this shape
    cold_tpot_ms_median: float
    cold_total_s: float
    repeats: int  # timed repeats behind the medians

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class StepRow:
    engine: str
    cache: str
    prompt_len: int
    batch: int
    repeat: int  # 1..repeats (timed runs only)
    step: int  # decode step 1..new_tokens-1 (token step+1; token 1 comes from the prefill)
    latency_ms: float

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class ConfigResult:
    """One configuration finished: its summary row, its timed steps, and its TTFTs (for cumulative plots)."""

    summary: SummaryRow
    steps: list[StepRow]
    ttft_ms: list[float]  # per timed repeat


def seed_copy_estimate(bytes_per_token: int, n0: int, n1: int) -> float:
    """The seed's estimate of torch.cat traffic growing a cache from n0 to n1 tokens: bytes/token x (n1^2 - n0^2)/2."""
    return bytes_per_token * (n1 * n1 - n0 * n0) / 2


def exact_copy_bytes(bytes_per_token: int, n0: int, n1: int) -> int:
    """Exact torch.cat traffic growing from n0 to n1 cached tokens one at a time: each append re-copies the current
    length L for L = n0 .. n1-1, i.e. bytes/token x (n1 - n0)(n0 + n1 - 1)/2."""
    return bytes_per_token * (n1 - n0) * (n0 + n1 - 1) // 2


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q  # linear interpolation, as numpy's default
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _nan_row(**kw) -> SummaryRow:
    nan = math.nan
    base = {f.name: nan for f in fields(SummaryRow)}
    base.update(kw)
    return SummaryRow(**base)


# --- the sweep ---------------------------------------------------------------------------------------------------
ProgressFn = Callable[[int, int, str], None]  # (runs done, runs total, label of the run just finished)


def plan(s: BenchSettings, engines: dict) -> list[tuple[int, str, str]]:
    """(prompt_len, engine, cache) in run order: per prompt length, per engine, `none` first so speedups are
    known as soon as later rows complete."""
    order = sorted(s.caches, key=lambda c: c != "none")
    return [(p, e, c) for p in s.prompt_len for e in s.engine for c in order if engines[e].supports(c)]


def run_sweep(
    model,
    s: BenchSettings,
    dtype_name: str,
    device_label: str,
    on_result: Callable[[ConfigResult], None] | None = None,
    on_progress: ProgressFn | None = None,
    engines: dict | None = None,
) -> list[ConfigResult]:
    """Run every configuration of `s` on `model`; returns (and streams through `on_result`) one result each."""
    device = model.lm_head.weight.device
    check_fits_context(s, model.config.block_size, model.config.name)
    if engines is None:
        engines = {name: ENGINES[name](model) for name in s.engine}
    configs = plan(s, engines)
    total_runs = len(configs) * (s.warmup + s.repeats)
    done = 0
    bpt = model.config.kv_bytes_per_token(model.lm_head.weight.element_size()) * s.batch
    g = torch.Generator().manual_seed(s.seed)
    prompts = {p: torch.randint(0, model.config.vocab_size, (s.batch, p), generator=g) for p in s.prompt_len}
    none_total: dict[tuple[str, int], float] = {}
    results: list[ConfigResult] = []
    for prompt_len, engine_name, cache in configs:
        engine = engines[engine_name]
        ids = prompts[prompt_len].to(device)
        label = f"{engine_name} {cache} prompt {prompt_len}"
        common = dict(
            engine=engine_name,
            cache=cache,
            prompt_len=prompt_len,
            new_tokens=s.new_tokens,
            batch=s.batch,
            dtype=dtype_name,
            device=device_label,
        )
        timed: list[RunTiming] = []
        mems: list[dict] = []
        cold: RunTiming | None = None
        oom = False
        for i in range(s.warmup + s.repeats):
            reset_peak_memory(device)
            try:
                t = engine.run(ids, s.new_tokens, cache)
            except torch.cuda.OutOfMemoryError:
                oom = True
            if oom:  # outside the except block, so the exception's frames (and their tensors) are freed first
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                done += s.warmup + s.repeats - i
                if on_progress is not None:
                    on_progress(done, total_runs, f"{label}: out of memory")
                break
            if i == 0:
                cold = t
            if i >= s.warmup:
                timed.append(t)
                mems.append(peak_memory(device))
            done += 1
            if on_progress is not None:
                on_progress(done, total_runs, label)
        if oom:
            row = _nan_row(**common, status="oom", repeats=0)
            result = ConfigResult(row, [], [])
        else:
            result = _summarise(common, timed, mems, cold, bpt, prompt_len, s, none_total)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _summarise(common, timed, mems, cold, bpt, prompt_len, s, none_total) -> ConfigResult:
    totals = [t.total_s for t in timed]
    steps = [x for t in timed for x in t.step_s]
    total = statistics.median(totals)
    key = (common["engine"], prompt_len)
    if common["cache"] == "none":
        none_total[key] = total
    speedup = none_total[key] / total if key in none_total else math.nan
    mem = {k: max(m[k] for m in mems) for k in mems[0]}
    last = timed[-1]
    row = SummaryRow(
        **common,
        status="ok",
        ttft_ms=1e3 * statistics.median(t.ttft_s for t in timed),
        tpot_ms_median=1e3 * _pct(steps, 0.5),
        tpot_ms_p90=1e3 * _pct(steps, 0.9),
        total_s=total,
        total_s_min=min(totals),
        total_s_max=max(totals),
        tokens_per_s=s.batch * s.new_tokens / total,
        speedup_vs_none=speedup,
        peak_mem_mib=mem.get("peak_allocated_mib", mem.get("peak_rss_mib", math.nan)),
        peak_reserved_mib=mem.get("peak_reserved_mib", math.nan),
        kv_cache_mib=(last.cache_bytes / 2**20) if last.cache_bytes is not None else math.nan,
        bytes_copied=float(last.bytes_copied) if last.bytes_copied is not None else math.nan,
        bytes_copied_seed_estimate=(
            seed_copy_estimate(bpt, prompt_len, prompt_len + s.new_tokens)
            if common["cache"] != "none" and common["engine"] == "kvbench"
            else math.nan
        ),
        cold_ttft_ms=1e3 * cold.ttft_s,
        cold_tpot_ms_median=1e3 * _pct(cold.step_s, 0.5),
        cold_total_s=cold.total_s,
        repeats=len(timed),
    )
    step_rows = [
        StepRow(common["engine"], common["cache"], prompt_len, s.batch, r + 1, j + 1, 1e3 * dt)
        for r, t in enumerate(timed)
        for j, dt in enumerate(t.step_s)
    ]
    return ConfigResult(row, step_rows, [1e3 * t.ttft_s for t in timed])


def settings_dict(s: BenchSettings) -> dict:
    return asdict(s)
