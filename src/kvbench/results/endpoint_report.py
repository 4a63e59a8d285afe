"""What `bench --endpoint` records in its run folder (results/rundir.py): meta.json at the start, summary.csv and
requests.csv rewritten as each phase completes, and the plots plus a final meta.json at the end, on an error or on
interruption. Nothing here loads torch: a run that measures a server from outside never needs it.
"""

from __future__ import annotations

import importlib.metadata as md
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvbench import __version__
from kvbench.bench.endpoint_rows import EndpointRow, PhaseResult, RequestRow
from kvbench.endpoint.resets import Reset
from kvbench.jsonio import SCHEMA_VERSION
from kvbench.outputs import writing_into
from kvbench.results.environment import cpu_facts, git_revision, load_average
from kvbench.results.rundir import write_csv, write_json

FILL = "endpoint"  # meta.json's `fill` for these runs: how compare and the schema tell them from a sweep's
TIMING = (
    "per request, from this client: ttft_ms from sending the request (connecting included) to the first streamed "
    "event carrying output; itl_ms each gap between two such events (an event carrying several tokens is one "
    "arrival); tpot_ms = (e2e_ms - ttft_ms) / (output_tokens - 1); e2e_ms to [DONE]. Per phase: percentiles over "
    "its finished requests (numpy's linear interpolation), itl_ms over every gap of every request pooled; "
    "output_tok_s and requests_per_s over duration_s, the first send to the last [DONE] (cold and warm: the sum of "
    "their requests' e2e, one at a time). Greedy requests (temperature 0)."
)
COLD_WARM = (
    "cold: the first request of each --cold-warm round, sent after --reset; warm: the requests that follow it, one "
    "at a time, sharing its first prefix_len tokens (the whole prompt with --prefix-len 0)"
)


def endpoint_meta(settings: dict[str, Any], served: dict[str, Any], reset: Reset) -> dict[str, Any]:
    """meta.json at the start of the run: the command, this client's host and software, the server as probed."""
    return {
        "schema_version": SCHEMA_VERSION,
        "command": shlex.join(["kvbench", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_revision(),
        "versions": _versions(),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), **cpu_facts()},
        "status": "running",
        "fill": FILL,
        "settings": settings,
        "model": served.get("model"),
        "seed": settings["seed"],
        "endpoint": {
            "url": settings["endpoint"],
            "reset": reset.name,
            "reset_how": reset.how,
            "reset_clears_all": reset.clears_all,
            **served,
        },
        "timing": TIMING,
        "cold_warm_note": COLD_WARM,
    }


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "kvbench": __version__}
    for pkg in ("numpy", "pandas", "matplotlib"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


class EndpointRecorder:
    """A bench --endpoint run folder (module docstring). `summary` and `plot_notes` are what the progress wrapper
    (cli/bench_progress.py run_recorded) reads."""

    def __init__(self, run_dir: Path, meta: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.meta = meta
        self.summary: list[EndpointRow] = []
        self.requests: list[RequestRow] = []
        self.plot_notes: list[str] = []
        write_json(run_dir / "meta.json", meta)

    def add(self, result: PhaseResult) -> None:
        self.summary.append(result.summary)
        self.requests += result.requests
        if result.summary.status != "ok":
            self.meta["error"] = result.summary.status.removeprefix("error: ")
        self._write_csvs()

    def _write_csvs(self) -> None:
        write_csv(self.run_dir / "summary.csv", EndpointRow.columns(), self.summary)
        write_csv(self.run_dir / "requests.csv", RequestRow.columns(), self.requests)

    def finish(self, status: str, engines: dict | None = None) -> list[Path]:
        """The final meta.json, the plots from whatever completed, then meta.json again; the files written."""
        from kvbench.results.endpoint_plot import write_endpoint_plots  # matplotlib: only when a run ends

        self._write_csvs()  # header-only files when nothing completed
        self.meta.update(
            status=status,
            finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            phases_completed=sum(r.status == "ok" for r in self.summary),
            phases_failed=sum(r.status != "ok" for r in self.summary),
            cold_vs_warm=cold_warm_summary(self.summary, self.meta),
        )
        if isinstance(self.meta.get("host", {}).get("load_average"), dict):
            self.meta["host"]["load_average"]["end"] = load_average()
        write_json(self.run_dir / "meta.json", self.meta)
        with writing_into(self.run_dir):
            pngs = write_endpoint_plots(self.run_dir, self.summary, self.requests, self.meta, self.plot_notes)
        self.meta["plots"] = [p.name for p in pngs]
        if self.plot_notes:
            self.meta["plots_not_drawn"] = self.plot_notes
        write_json(self.run_dir / "meta.json", self.meta)
        return [self.run_dir / n for n in ("summary.csv", "requests.csv", "meta.json")] + pngs

    def json_doc(self) -> dict[str, Any]:
        """The --json document: summary.csv's rows with its columns, empty cells as null."""
        rows = [{k: _null(v) for k, v in asdict(r).items()} for r in self.summary]
        return {"schema_version": SCHEMA_VERSION, "run_dir": str(self.run_dir), "meta": self.meta, "summary": rows}


def _null(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


def cold_warm_summary(rows: list[EndpointRow], meta: dict[str, Any]) -> dict[str, Any] | None:
    """The cold and warm rows side by side: TTFT medians, their ratio, cached tokens, and what the reset did."""
    by = {r.phase: r for r in rows if r.phase in ("cold", "warm") and r.requests}
    if len(by) < 2:
        return None
    cold, warm = by["cold"], by["warm"]
    out: dict[str, Any] = {
        "prefix_len": cold.prefix_len,
        "cold_ttft_ms_p50": cold.ttft_ms_p50,
        "warm_ttft_ms_p50": warm.ttft_ms_p50,
        "cold_over_warm": cold.ttft_ms_p50 / warm.ttft_ms_p50 if warm.ttft_ms_p50 > 0 else math.nan,
        "cold_cached_tokens_mean": cold.cached_tokens_mean,
        "warm_cached_tokens_mean": warm.cached_tokens_mean,
        "note": None,
    }
    clears = bool(meta.get("endpoint", {}).get("reset_clears_all"))
    if clears and cold.cached_tokens_mean > 0:
        out["note"] = (
            f"the reset did not empty the prefix cache: cold requests found {cold.cached_tokens_mean:.0f} cached "
            "tokens on average"
        )
    elif warm.cached_tokens_mean == 0:
        out["note"] = "warm requests found no cached tokens: the engine reused nothing of the shared prefix"
    return out
