"""The rows a bench sweep writes: one SummaryRow per configuration (summary.csv), one StepRow per timed decode step
(steps.csv), one DistortionRow per generated token of a lossy row (distortion.csv), and what a finished configuration
hands back (ConfigResult). docs/bench.md describes every column."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from kvbench.bench import floor
from kvbench.bench.profile import Profiled
from kvbench.bench.timing_stats import tpot_extra_columns
from kvbench.check.distortion import Distortion
from kvbench.rows import CsvRow


# --- rows --------------------------------------------------------------------------------------------------------
@dataclass
class SummaryRow(CsvRow):
    engine: str
    cache: str
    prompt_len: int
    new_tokens: int
    batch: int
    dtype: str
    device: str
    status: str  # ok | oom | error: <one line>
    ttft_ms: float  # median over timed repeats: prefill + first token
    tpot_ms_median: float  # median decode-step latency, all steps of all timed repeats pooled
    tpot_ms_p90: float
    ttft_ms_mean: float  # over the timed repeats (one TTFT each; ttft.csv); std: the sample's (ddof=1)
    ttft_ms_std: float
    ttft_ms_p10: float  # percentiles: numpy's default (linear interpolation)
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    tpot_ms_mean: float  # the pooled decode steps, as tpot_ms_median
    tpot_ms_std: float
    # the bandwidth floor of the median decode step: step_bytes / measured read bandwidth (bench/floor.py)
    floor_ms: float
    x_floor: float  # tpot_ms_median / floor_ms; empty for `none` (no cache: the floor does not apply)
    # every timed step over the floor at the read bandwidth measured just before and after its run, the median
    # (bench/floor.py, `paired`; CPU only), then the fastest and slowest run's median step so held
    x_floor_paired: float
    x_floor_paired_min: float
    x_floor_paired_max: float
    paired_read_gbps: float  # median over the timed runs of the read bandwidth each was held to, GB/s
    # bytes the median decode step moves: weights, K/V read and written, the design's copies
    step_bytes: float
    total_s: float  # median over timed repeats: the whole generation, prefill included
    total_s_min: float
    total_s_max: float
    tokens_per_s: float  # batch x new_tokens / total_s: the whole generation, prefill included
    # batch x decode steps / decode time (median over timed repeats): tokens/s across the batch, decode only
    decode_tokens_per_s: float
    speedup_vs_none: float  # total_s of this engine family's `none` at the same prompt length / total_s
    # TPOT of the fastest transformers row (hf, hf-compiled) at this prompt / TPOT
    speedup_vs_fastest_hf: float
    # fraction of generated tokens equal to kvbench `none`'s (worst run); bench/agreement.py
    token_agreement: float
    first_divergence: float  # first differing token index (empty when identical)
    flips: int  # sequences whose tokens differ from the reference
    near_tie_flips: int  # of those, flips at near-ties (rounding, judged as verify does)
    tokens_note: str  # identical | the first flip and its explanation | why there is no reference
    peak_mem_mib: float  # weights_mib + run_peak_mib
    weights_mib: float  # the engine's weights, each storage once (hf and kvbench share the same tensors)
    # peak during the runs above what was in use before the configuration (caches, activations)
    run_peak_mib: float
    peak_reserved_mib: float  # CUDA max_memory_reserved (the allocator's whole pool); NaN on the CPU
    kv_cache_mib: float  # bytes the cache holds at the end of a run
    bytes_copied: float  # history bytes copied by cache updates in one run (NaN where not counted)
    # the seed's bytes/token x (n1^2 - n0^2)/2, n0 = prompt, n1 = prompt + new
    bytes_copied_seed_estimate: float
    cold_ttft_ms: float  # the first run of this configuration
    cold_tpot_ms_median: float
    cold_total_s: float
    capture_ms: float  # CUDA-graph warm-up + capture, once per configuration, inside the cold run (NaN: none)
    sdpa_prefill: str  # SDPA backend(s) the prefill's attention calls got
    sdpa_decode: str  # SDPA backend(s) the decode steps' attention calls got
    repeats: int  # timed repeats behind the medians
    # A lossy cache against the full-precision `static` cache, teacher-forced on that cache's greedy tokens from the
    # same prompt ids (check/distortion.py), per token in distortion.csv; empty for exact caches and transformers.
    kl_mean: float = math.nan  # KL(p_full || p_lossy) in nats, every token of every sequence
    top1_agreement: float = math.nan  # fraction of tokens whose top choice is the full-precision path's
    mean_abs_dp: float = math.nan  # mean |Δp|: how far the probability of the full-precision path's token moved
    # tpot_ms_pNN for each --percentiles value beyond 50 and 90 (columns after tpot_ms_std)
    tpot_ms_more: dict[str, float] = field(default_factory=dict)

    def distortion_key(self) -> str:
        """The row's name among meta.json's distortion rows."""
        return f"{self.engine} {self.cache} prompt {self.prompt_len} batch {self.batch}"

    @classmethod
    def columns(cls, percentiles: list[float] | tuple[float, ...] = ()) -> list[str]:
        names = [f.name for f in fields(cls) if f.name != "tpot_ms_more"]
        at = names.index("tpot_ms_std") + 1
        return names[:at] + tpot_extra_columns(list(percentiles)) + names[at:]

    def record(self) -> dict:
        """The row as summary.csv holds it: the tpot_ms_more columns beside the others."""
        d = asdict(self)
        d.update(d.pop("tpot_ms_more"))
        return d


@dataclass
class StepRow(CsvRow):
    engine: str
    cache: str
    prompt_len: int
    batch: int
    repeat: int  # 1..repeats (timed runs only)
    step: int  # decode step 1..new_tokens-1 (token step+1; token 1 comes from the prefill)
    latency_ms: float


@dataclass
class DistortionRow(CsvRow):
    """One generated token of a lossy row, teacher-forced against the full-precision path (distortion.csv)."""

    engine: str
    cache: str
    prompt_len: int
    batch: int
    token: int  # 1..new_tokens (token 1 is read from the prefill's last row)
    depth: int  # tokens its step reads: prompt_len + token - 1
    kl: float  # KL(p_full || p_lossy) in nats, averaged over the batch's sequences
    top1_agreement: float  # fraction of the batch's sequences whose top choice is the full-precision path's
    abs_dp: float  # |Δp| of the full-precision path's token, averaged over the sequences


@dataclass
class ConfigResult:
    """One configuration finished: its summary row, its timed steps, and its TTFTs (for cumulative plots)."""

    summary: SummaryRow
    steps: list[StepRow]
    ttft_ms: list[float]  # per timed repeat
    floor_bytes: floor.StepBytes | None = None  # the median decode step's bytes by source; None: no floor
    bandwidth: floor.Bandwidth | None = None  # what floor_ms divides by (interleaved: pooled over the rounds)
    run_gbps: list[float] | None = None  # the read bandwidth beside each timed run (x_floor_paired), GB/s
    profile: Profiled | None = None  # --profile: the trace of one more warm run and its top operators
    distortion: Distortion | None = None  # a lossy row's cost against the full-precision path
    distortion_failed: str = ""  # why a lossy row's distortion was not measured (failure_status)
    ranks: list | None = None  # bench --tp, on rank 0: every rank's bench.tp.RankRow of this configuration
