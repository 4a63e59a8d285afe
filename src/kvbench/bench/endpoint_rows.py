"""The rows `bench --endpoint` writes: one RequestRow per request (requests.csv) and one EndpointRow per phase
(summary.csv), the statistics of a phase computed from its requests (`summarise`), and what a finished phase hands
back (PhaseResult). docs/bench-endpoint.md describes every column.

A phase is `cold` or `warm` (the cold vs warm TTFT rounds, one request in flight) or `load` (one --concurrency
level). Per request: TTFT is the time from sending the request to the first streamed event carrying output; ITL
each gap between two such events; TPOT (e2e - TTFT) / (output tokens - 1); e2e the time to [DONE]. Percentiles are
numpy's default (linear interpolation), as bench's other statistics (bench/timing_stats.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvbench.endpoint.stream import Streamed
from kvbench.rows import CsvRow

PHASES = ("cold", "warm", "load")


@dataclass
class RequestRow(CsvRow):
    phase: str  # cold | warm | load
    concurrency: int  # requests in flight in the phase (1 for cold and warm)
    request: int  # 1.. in the order the phase sent them
    round: int  # cold and warm: the round (1..--cold-warm); load: 0
    status: str  # ok | error: <one line>
    start_ms: float  # when it was sent, from the phase's start
    ttft_ms: float  # to the first streamed event carrying output
    tpot_ms: float  # (e2e - ttft) / (output_tokens - 1); empty for one token
    e2e_ms: float  # to [DONE]
    itl_ms_mean: float  # the gaps between its output events
    itl_ms_max: float
    output_tokens: int  # usage.completion_tokens; else the token ids (or events) streamed
    chunks: int  # streamed events that carried output
    prompt_tokens: float  # usage.prompt_tokens (empty: the server sent no usage)
    cached_tokens: float  # usage.prompt_tokens_details.cached_tokens (empty: not reported in the stream)
    finish_reason: str  # length | stop | ... as the server said


@dataclass
class EndpointRow(CsvRow):
    phase: str
    concurrency: int
    prompt_len: int  # tokens asked for (with a text prompt the engine's count is prompt_tokens_mean)
    prefix_len: int  # tokens every prompt of the phase shares
    new_tokens: int  # max_tokens of every request
    status: str  # ok | error: <one line>
    requests: int  # requests that finished
    duration_s: float  # the phase's first send to its last [DONE]
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    ttft_ms_mean: float
    tpot_ms_p50: float
    tpot_ms_p90: float
    tpot_ms_p99: float
    tpot_ms_mean: float
    itl_ms_p50: float  # every gap of every request, pooled
    itl_ms_p99: float
    e2e_ms_p50: float
    e2e_ms_p99: float
    output_tok_s: float  # output tokens of the phase / duration_s
    requests_per_s: float  # requests / duration_s
    output_tokens_mean: float
    short_requests: int  # requests that produced fewer than new_tokens tokens (stopped early)
    prompt_tokens_mean: float
    cached_tokens_mean: float  # from the stream's usage; or from one non-streamed probe after the phase
    cached_source: str  # stream | probe | none (cached_tokens_mean empty: the server does not say)

    @property
    def key(self) -> str:
        return f"{self.phase} concurrency {self.concurrency}"


@dataclass
class PhaseResult:
    """One finished phase: its row, its requests, every inter-token gap (pooled, in ms)."""

    summary: EndpointRow
    requests: list[RequestRow]
    itl_ms: list[float] = field(default_factory=list)


def request_row(s: Streamed, phase: str, concurrency: int, index: int, round_: int, started: float) -> RequestRow:
    """A streamed completion's row: its times from the arrivals, its counts from the usage where it came."""
    usage = s.usage or {}
    streamed = sum(s.tokens)
    n = _count(usage.get("completion_tokens"))
    out = int(n) if n == n else streamed
    ttft = (s.arrivals[0] - s.sent) * 1e3 if s.arrivals else math.nan
    e2e = (s.ended - s.sent) * 1e3
    gaps = np.diff(s.arrivals) * 1e3 if len(s.arrivals) > 1 else np.empty(0)
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else math.nan
    return RequestRow(
        phase=phase,
        concurrency=concurrency,
        request=index,
        round=round_,
        status="ok",
        start_ms=(s.sent - started) * 1e3,
        ttft_ms=ttft,
        tpot_ms=(e2e - ttft) / (out - 1) if out > 1 and ttft == ttft else math.nan,
        e2e_ms=e2e,
        itl_ms_mean=float(gaps.mean()) if gaps.size else math.nan,
        itl_ms_max=float(gaps.max()) if gaps.size else math.nan,
        output_tokens=out,
        chunks=len(s.arrivals),
        prompt_tokens=_count(usage.get("prompt_tokens")),
        cached_tokens=cached,
        finish_reason=s.finish_reason or "",
    )


def gaps_ms(s: Streamed) -> list[float]:
    return [float(g) for g in np.diff(s.arrivals) * 1e3] if len(s.arrivals) > 1 else []


def failed_row(phase: str, concurrency: int, index: int, round_: int, line: str) -> RequestRow:
    nan = math.nan
    return RequestRow(
        phase, concurrency, index, round_, f"error: {line[:300]}", nan, nan, nan, nan, nan, nan, 0, 0, nan, nan, ""
    )


def _count(v: object) -> float:
    return float(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else math.nan


def _q(x: np.ndarray, q: float) -> float:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if x.size else math.nan


def _mean(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else math.nan


@dataclass(frozen=True)
class Shape:
    """What every request of a phase asked for."""

    phase: str
    concurrency: int
    prompt_len: int
    prefix_len: int
    new_tokens: int


def summarise(
    shape: Shape, rows: list[RequestRow], itl: list[float], duration: float, status: str = "ok"
) -> EndpointRow:
    """A phase's row from its requests (the finished ones: status ok), its pooled gaps and its duration (s)."""
    ok = [r for r in rows if r.status == "ok"]

    def col(name: str) -> np.ndarray:
        return np.array([getattr(r, name) for r in ok], dtype=float)

    ttft, tpot, e2e, gaps = col("ttft_ms"), col("tpot_ms"), col("e2e_ms"), np.asarray(itl, dtype=float)
    cached = col("cached_tokens")
    tokens = int(sum(r.output_tokens for r in ok))
    per_s = duration if duration > 0 else math.nan
    return EndpointRow(
        phase=shape.phase,
        concurrency=shape.concurrency,
        prompt_len=shape.prompt_len,
        prefix_len=shape.prefix_len,
        new_tokens=shape.new_tokens,
        status=status,
        requests=len(ok),
        duration_s=duration,
        ttft_ms_p50=_q(ttft, 50),
        ttft_ms_p90=_q(ttft, 90),
        ttft_ms_p99=_q(ttft, 99),
        ttft_ms_mean=_mean(ttft),
        tpot_ms_p50=_q(tpot, 50),
        tpot_ms_p90=_q(tpot, 90),
        tpot_ms_p99=_q(tpot, 99),
        tpot_ms_mean=_mean(tpot),
        itl_ms_p50=_q(gaps, 50),
        itl_ms_p99=_q(gaps, 99),
        e2e_ms_p50=_q(e2e, 50),
        e2e_ms_p99=_q(e2e, 99),
        output_tok_s=tokens / per_s if ok else math.nan,
        requests_per_s=len(ok) / per_s if ok else math.nan,
        output_tokens_mean=_mean(col("output_tokens")),
        short_requests=sum(r.output_tokens < shape.new_tokens for r in ok),
        prompt_tokens_mean=_mean(col("prompt_tokens")),
        cached_tokens_mean=_mean(cached),
        cached_source="stream" if ok and not np.isnan(cached).all() else "none",
    )
