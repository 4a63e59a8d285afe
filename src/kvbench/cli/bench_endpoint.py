"""`kvbench bench --endpoint URL`: serving latency of a running OpenAI-compatible server (bench/endpoint.py),
written to a run folder as the phases finish, then its table (or --json document).

Every check that needs no server runs first, then the probe (bench/endpoint_probe.py): a server that cannot be
reached or does not answer as OpenAI's API does is refused (exit 2) before the run folder exists. Once the run has
started, a server that fails (an HTTP error, a broken stream, no answer within --timeout) ends it: the phase is
recorded with the error, every finished phase is kept, meta.json says `failed`, and the command exits 1 with one
line. Ctrl-C keeps the finished phases and marks meta.json `interrupted` (exit 130).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import JustifyMethod

from kvbench import console
from kvbench.console import err, fitted, line, out, styled, wrote
from kvbench.errors import KVBenchError

if TYPE_CHECKING:
    from kvbench.bench.endpoint_rows import EndpointRow
    from kvbench.bench.endpoint_settings import EndpointOptions
    from kvbench.cli.bench_options import BenchOptions
    from kvbench.results.endpoint_report import EndpointRecorder


def bench_endpoint(opts: BenchOptions, given: dict[str, Any], o: EndpointOptions) -> None:
    """Check, probe, then run every phase into a claimed run folder; exit 1 when the server failed mid-run."""
    from kvbench.bench.endpoint import run_endpoint
    from kvbench.bench.endpoint_probe import probe
    from kvbench.bench.endpoint_settings import endpoint_workload
    from kvbench.cli.bench_progress import run_recorded
    from kvbench.endpoint.client import EndpointError
    from kvbench.endpoint.stream import StreamClient
    from kvbench.results.endpoint_report import EndpointRecorder, endpoint_meta
    from kvbench.results.rundir import check_run_dir, claimed_run_dir, unique_default_run_dir

    refused = {
        "--config": opts.config is not None,
        "--hf": opts.hf is not None,
        "--trust-remote-code": opts.trust_remote_code,
        "--layers": opts.layers is not None,
        "--export": opts.export is not None,
    }
    w = endpoint_workload(o, given, refused)
    out_dir = check_run_dir(w.out if w.out is not None else str(unique_default_run_dir("bench")), opts.force)
    base = _baseline(opts, out_dir)
    server = StreamClient(w.url, w.timeout)
    with err.status(f"probing {w.url} (GET /v1/models, one streamed request)"):
        served = probe(server, w)
    failed: EndpointError | None = None
    with claimed_run_dir(out_dir, opts.force) as run_dir:  # only now: a refused command leaves no folder
        for text in served.notes:
            console.note(text)
        recorder = EndpointRecorder(run_dir, endpoint_meta(w.settings(), served.meta(), w.reset))
        try:
            files = run_recorded(recorder, lambda progress: run_endpoint(server, served, w, recorder.add, progress))
        except EndpointError as e:  # the server failed mid-run: run_recorded has written the folder as `failed`
            failed = e
            files = [run_dir / n for n in ("summary.csv", "requests.csv", "meta.json", *recorder.meta["plots"])]
    _show(opts, recorder, files, base)
    if failed is not None:
        console.error(
            f"the server failed during the run: {failed}; {sum(r.status == 'ok' for r in recorder.summary)} finished "
            f"phase(s) kept in {recorder.run_dir}"
        )
        raise typer.Exit(1)


def _baseline(opts: BenchOptions, out_dir: Path) -> Path | None:
    """--baseline: an endpoint run folder, read now (a bad one fails before the run), kept apart from --out."""
    if opts.baseline is None:
        if opts.allow_env_change:
            raise KVBenchError("--allow-env-change applies to --baseline only")
        return None
    from kvbench.results.endpoint_runs import load_endpoint_run
    from kvbench.results.rundir import check_baseline_apart

    check_baseline_apart(opts.baseline, out_dir)
    load_endpoint_run(opts.baseline, "--baseline")
    return opts.baseline


def _show(opts: BenchOptions, recorder: EndpointRecorder, files: list[Path], base: Path | None) -> None:
    """The table (or the --json document), then the comparison with --baseline."""
    if opts.json_out:
        doc = recorder.json_doc()
        if base is not None:
            from kvbench.cli.compare import json_any, run_compare

            try:
                comparison, compare_files = run_compare(base, recorder.run_dir, allow_env_change=opts.allow_env_change)
            except KVBenchError:  # the run's document first, then the comparison's one line
                console.print_json(doc)
                raise
            doc["compare"] = json_any(comparison, [], compare_files)
        console.print_json(doc)
        return
    render_endpoint(recorder.summary, recorder.meta, files)
    if base is not None:
        from kvbench.cli.compare import render_any, run_compare

        comparison, compare_files = run_compare(base, recorder.run_dir, allow_env_change=opts.allow_env_change)
        render_any(comparison, [], compare_files)


# --- rendering ---
COLUMNS = ["phase", "conc", "reqs", "TTFT p50", "p99", "TPOT p50", "p99", "ITL p50", "p99", "e2e p50", "tok/s"]
COLUMNS += ["req/s", "cached"]


def _ms(x: float) -> str:
    if x != x:
        return "-"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _n(x: float, fmt: str = ".1f") -> str:
    return "-" if x != x or math.isinf(x) else format(x, fmt)


def _row(r: EndpointRow) -> list[Any]:
    phase = r.phase if r.status == "ok" else styled(f"{r.phase} (error)", "bold red")
    cached = _n(r.cached_tokens_mean, ".0f") + ("*" if r.cached_source == "probe" else "")
    return [
        phase,
        r.concurrency,
        r.requests,
        _ms(r.ttft_ms_p50),
        _ms(r.ttft_ms_p99),
        _ms(r.tpot_ms_p50),
        _ms(r.tpot_ms_p99),
        _ms(r.itl_ms_p50),
        _ms(r.itl_ms_p99),
        _ms(r.e2e_ms_p50),
        _n(r.output_tok_s),
        _n(r.requests_per_s, ".2f"),
        cached,
    ]


def render_endpoint(rows: list[EndpointRow], meta: dict[str, Any], files: list[Path]) -> None:
    """The phases' table, what its columns mean, the cold vs warm line, the notes, the files written."""
    s = meta["settings"]
    prefix = f"shared prefix {s['prefix_len']}" if s["prefix_len"] else "unique prompts"
    head = (
        f"bench --endpoint: {meta.get('model') or 'the served model'} at {s['endpoint']}; prompt {s['prompt_len']} "
        f"tokens ({prefix}), {s['new_tokens']} new, {s['requests']} requests per level, reset: "
        f"{meta['endpoint']['reset_how']}"
    )
    justify: list[JustifyMethod] = ["left" if i == 0 else "right" for i in range(len(COLUMNS))]
    for x in fitted(head, COLUMNS, [_row(r) for r in rows], out.width, keys=2, justify=justify):
        out.print(x)
    out.print(
        styled(
            "ms; p50/p99 over the phase's requests (ITL: every gap between streamed tokens, pooled). TTFT: send to "
            "first token; TPOT: (e2e - TTFT) / (tokens - 1); tok/s, req/s: over the phase's wall time; cached: mean "
            "cached prompt tokens the server reported" + (" (* one probe after the level)" if _probed(rows) else ""),
            "dim",
        )
    )
    for text in _lines(rows, meta):
        out.print(line(styled("note:", "yellow"), " ", text))
    out.print(wrote(files, files[0].parent))


def _probed(rows: list[EndpointRow]) -> bool:
    return any(r.cached_source == "probe" for r in rows)


def _lines(rows: list[EndpointRow], meta: dict[str, Any]) -> list[str]:
    """Cold vs warm in one line, short requests, errors."""
    out = []
    cw = meta.get("cold_vs_warm")
    if cw:
        out.append(
            f"cold vs warm TTFT at a {cw['prefix_len']}-token prefix: {_ms(cw['cold_ttft_ms_p50'])} ms cold, "
            f"{_ms(cw['warm_ttft_ms_p50'])} ms warm (x{_n(cw['cold_over_warm'], '.2f')}); cached tokens "
            f"{_n(cw['cold_cached_tokens_mean'], '.0f')} cold, {_n(cw['warm_cached_tokens_mean'], '.0f')} warm"
            + (f"; {cw['note']}" if cw.get("note") else "")
        )
    new = meta["settings"]["new_tokens"]
    short = [r for r in rows if r.short_requests]
    if short:
        where = ", ".join(f"{r.key}: {r.short_requests}" for r in short)
        out.append(f"requests that ended before {new} tokens (the engine stopped early): {where}")
    return out
