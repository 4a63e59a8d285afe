"""`bench --endpoint URL`: serving latency of a running OpenAI-compatible server, measured from outside as
`vllm bench serve` reports it: TTFT, TPOT, ITL, end-to-end latency and throughput per concurrency level, and the
prefix cache's effect on TTFT, cold against warm.

The run (after the probe, bench/endpoint_probe.py) has two kinds of phase, each a summary row:

- cold and warm (--cold-warm rounds, one request in flight): each round resets the engine (--reset), sends one
  request (cold), then WARM_PER_ROUND requests sharing its first --prefix-len tokens (warm; with --prefix-len 0 the
  whole prompt is repeated). Where the reset empties the whole cache (a POST), every round reuses one prefix; where
  it cannot (none, or a field of the cold request alone), each round draws a fresh one, so its first request finds
  nothing cached either way.
- load, one per --concurrency level N: N client threads, each with one request in flight until --requests have
  been sent; the engine is reset before the level and the level's prompts share a prefix of its own (--prefix-len;
  0: every prompt unique), so each level starts cold whatever ran before it.

Rows come back through `on_result` as each phase completes. The first request that fails (an HTTP error, a broken
stream, no answer within --timeout) stops its phase: the phase's row is recorded with the error and the requests
that finished, and the run stops with ServerFailed. Ctrl-C stops the threads from sending more; the phase in flight
is not recorded.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvbench.bench.endpoint_probe import COMPLETIONS, Prompts, Served, cached_tokens, reset
from kvbench.bench.endpoint_rows import (
    EndpointRow,
    PhaseResult,
    RequestRow,
    Shape,
    failed_row,
    gaps_ms,
    request_row,
    summarise,
)
from kvbench.bench.endpoint_settings import Workload
from kvbench.endpoint.client import EndpointError
from kvbench.endpoint.stream import StreamClient, Streamed

WARM_PER_ROUND = 3  # warm requests after each cold one
T = TypeVar("T")
Progress = Callable[[int, int, str], None]


class ServerFailed(EndpointError):
    """A phase the server failed: its row is recorded with the error, and the run stops."""


@dataclass
class Bench:
    server: StreamClient
    served: Served
    w: Workload
    prompts: Prompts
    progress: _Counter


class _Counter:
    """Requests finished across the run, reported to a progress callback from the main thread."""

    def __init__(self, total: int, fn: Progress | None) -> None:
        self.done, self.total, self.fn, self.label = 0, total, fn, ""
        self.lock = threading.Lock()

    def add(self) -> None:
        with self.lock:
            self.done += 1

    def show(self) -> None:
        if self.fn is not None:
            self.fn(self.done, self.total, self.label)


def planned_requests(w: Workload) -> int:
    return w.cold_warm * (1 + WARM_PER_ROUND) + w.requests * len(w.concurrency)


def run_endpoint(
    server: StreamClient,
    served: Served,
    w: Workload,
    on_result: Callable[[PhaseResult], None],
    on_progress: Progress | None = None,
) -> None:
    """Every phase in order (module docstring), each row handed to `on_result` as it completes."""
    b = Bench(server, served, w, Prompts(w.seed, w.prompt_len, served.text), _Counter(planned_requests(w), on_progress))
    phases: list[Callable[[], list[PhaseResult]]] = []
    if w.cold_warm:
        phases.append(lambda: cold_warm(b))
    phases += [functools.partial(_level, b, c) for c in w.concurrency]
    for phase in phases:
        results = phase()
        for r in results:
            on_result(r)
        failed = next((r.summary for r in results if r.summary.status != "ok"), None)
        if failed is not None:
            raise ServerFailed(f"{failed.key}: {failed.status.removeprefix('error: ')}")


def _send(b: Bench, prompt: list[int] | str, **extra: Any) -> Streamed:
    out = b.server.stream(b.served.body(prompt, b.w.new_tokens, **extra))
    b.progress.add()
    return out


# --- cold and warm ---------------------------------------------------------------------------------------------------
def cold_warm(b: Bench) -> list[PhaseResult]:
    """--cold-warm rounds, one request at a time: the cold and the warm row (module docstring)."""
    w = b.w
    length = w.prefix_len or w.prompt_len
    prefix = b.prompts.prefix(length)
    rows: dict[str, list[RequestRow]] = {"cold": [], "warm": []}
    itl: dict[str, list[float]] = {"cold": [], "warm": []}
    error = ""
    started = time.perf_counter()
    b.progress.label = "cold vs warm"
    try:
        for round_ in range(1, w.cold_warm + 1):
            reset(b.server, w)
            if round_ > 1 and not w.reset.clears_all:
                prefix = b.prompts.prefix(length)
            for phase, extra in [("cold", w.reset.fields)] + [("warm", {})] * WARM_PER_ROUND:
                index = len(rows[phase]) + 1
                try:
                    s = _send(b, b.prompts.prompt(prefix), **extra)
                except EndpointError as e:
                    rows[phase].append(failed_row(phase, 1, index, round_, str(e)))
                    raise
                rows[phase].append(request_row(s, phase, 1, index, round_, started))
                itl[phase] += gaps_ms(s)
                b.progress.show()
    except EndpointError as e:
        error = f"error: {e}"
    out = []
    for phase in ("cold", "warm"):
        shape = Shape(phase, 1, w.prompt_len, length, w.new_tokens)
        busy = sum(r.e2e_ms for r in rows[phase] if r.status == "ok") / 1e3  # one at a time: time in flight
        out.append(PhaseResult(summarise(shape, rows[phase], itl[phase], busy, error or "ok"), rows[phase], itl[phase]))
    return out


# --- one concurrency level -------------------------------------------------------------------------------------------
def _level(b: Bench, concurrency: int) -> list[PhaseResult]:
    return [load_level(b, concurrency)]


def load_level(b: Bench, concurrency: int) -> PhaseResult:
    """--requests requests, `concurrency` in flight, sharing a fresh prefix (module docstring)."""
    w = b.w
    shape = Shape("load", concurrency, w.prompt_len, w.prefix_len, w.new_tokens)
    b.progress.label = f"concurrency {concurrency}"
    try:
        reset(b.server, w)
    except EndpointError as e:
        return PhaseResult(summarise(shape, [], [], 0.0, f"error: {e}"), [])
    prefix = b.prompts.prefix(w.prefix_len)
    prompts = [b.prompts.prompt(prefix) for _ in range(w.requests)]  # drawn here: the threads share no generator
    jobs = [functools.partial(_send, b, p) for p in prompts]
    started, done, error = concurrently(jobs, concurrency, b.progress.show)
    rows, itl = [], []
    for i, s in enumerate(done):
        if s is not None:
            rows.append(request_row(s, "load", concurrency, i + 1, 0, started))
            itl += gaps_ms(s)
    if error is not None:
        rows.append(failed_row("load", concurrency, error[0] + 1, 0, str(error[1])))
    ends = [s.ended for s in done if s is not None]
    status = "ok" if error is None else f"error: {error[1]}"
    row = summarise(shape, rows, itl, max(ends) - started if ends else 0.0, status)
    if b.served.cached_source == "probe" and error is None:
        try:
            _cached_by_probe(b, row, b.prompts.prompt(prefix))
        except EndpointError as e:
            row.status = f"error: {e}"
    return PhaseResult(row, rows, itl)


def _cached_by_probe(b: Bench, row: EndpointRow, prompt: list[int] | str) -> None:
    """A server whose stream carries no cached-token count: one non-streamed request with the phase's prefix."""
    doc = b.server.json("POST", COMPLETIONS, b.served.body(prompt, 1, stream=False), empty_ok=True)
    found = cached_tokens(doc.get("usage") if isinstance(doc, dict) else None)
    if found is not None:
        row.cached_tokens_mean, row.cached_source = float(found), "probe"


def concurrently(
    jobs: Sequence[Callable[[], T]], threads: int, tick: Callable[[], None] | None = None
) -> tuple[float, list[T | None], tuple[int, EndpointError] | None]:
    """Run `jobs` on `threads` threads, each taking the next job when its last one ends, all released together:
    (when they were released, perf_counter seconds; each job's result, None where it did not finish; the first
    EndpointError with its job's index, or None). After the first error no job starts; the ones in flight end
    within the client's timeout. Ctrl-C in the main thread does the same, then propagates. `tick` is called from
    the main thread while it waits."""
    results: list[T | None] = [None] * len(jobs)
    failures: list[tuple[int, EndpointError]] = []
    lock, stop = threading.Lock(), threading.Event()
    queue = iter(range(len(jobs)))
    ready, go = threading.Barrier(threads + 1), threading.Event()

    def work() -> None:
        ready.wait()
        go.wait()
        while not stop.is_set():
            with lock:
                i = next(queue, None)
            if i is None:
                return
            try:
                results[i] = jobs[i]()
            except EndpointError as e:
                with lock:
                    failures.append((i, e))
                stop.set()

    pool = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    ready.wait()  # every thread started and waiting: the clock starts as they are released
    started = time.perf_counter()
    go.set()
    try:
        for t in pool:
            while t.is_alive():  # a bounded join, so Ctrl-C reaches the main thread
                t.join(0.1)
                if tick is not None:
                    tick()
    except BaseException:
        stop.set()
        raise
    return started, results, (min(failures, key=lambda f: f[0]) if failures else None)
