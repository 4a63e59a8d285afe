"""A `bench --endpoint` run folder read back and checked: meta.json (its `fill` is "endpoint"), summary.csv (one row
per phase) and requests.csv (one row per request), as results/runs.py reads a sweep's folder: a corrupt file, a
missing column, a cell that is not a number or not one its column may hold is one KVBenchError line naming the
file, the line and the column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.errors import KVBenchError
from kvbench.results.endpoint_report import FILL
from kvbench.results.runs import MS, WHOLE, Number, _check_schema_version, _read_csv, _read_json, _to_numbers

# Rows of two runs are the same phase of the same workload when all of these are equal.
KEY = ("phase", "concurrency", "prompt_len", "prefix_len", "new_tokens")
COUNT = Number(0, 2**31 - 1, integer=True)
TOKENS = Number(0, 2**31 - 1)  # a mean of token counts
RATE = Number(0, 1e12)
SUMMARY_NUMBERS = {
    "concurrency": WHOLE,
    "prompt_len": WHOLE,
    "prefix_len": COUNT,
    "new_tokens": WHOLE,
    "requests": COUNT,
    "ttft_ms_p50": MS,
    "tpot_ms_p50": MS,
    "output_tok_s": RATE,
    "cached_tokens_mean": TOKENS,
}
REQUEST_NUMBERS = {"concurrency": WHOLE, "ttft_ms": MS, "tpot_ms": MS, "e2e_ms": MS}


@dataclass
class EndpointRun:
    path: Path
    meta: dict
    summary: pd.DataFrame
    requests: pd.DataFrame

    @property
    def status(self) -> str | None:
        return self.meta.get("status")

    @property
    def model(self) -> str | None:
        return self.meta.get("model")


def is_endpoint_run(path: str | Path) -> bool:
    """Is `path` a folder whose meta.json says it is a bench --endpoint run? (Anything unreadable: no; reading it
    as a run then says what is wrong.)"""
    try:
        meta = json.loads((Path(path).expanduser() / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and meta.get("fill") == FILL


def load_endpoint_run(path: str | Path, role: str) -> EndpointRun:
    p = Path(path).expanduser()
    what = f"{role} {p}"
    if not p.is_dir():
        raise KVBenchError(f"{what}: no such folder" if not p.exists() else f"{what} is a file, not a run folder")
    absent = [n for n in ("meta.json", "summary.csv", "requests.csv") if not (p / n).is_file()]
    if absent:
        raise KVBenchError(f"{what} is not a bench --endpoint run folder (no {', '.join(absent)})")
    meta = _read_json(p / "meta.json", role)
    _check_schema_version(meta, p / "meta.json", role)
    summary = _read_csv(p / "summary.csv", role, (*KEY, "status"))
    requests = _read_csv(p / "requests.csv", role, ("phase", "concurrency", "status", "ttft_ms", "tpot_ms"))
    for df, numbers, name in ((summary, SUMMARY_NUMBERS, "summary.csv"), (requests, REQUEST_NUMBERS, "requests.csv")):
        for col, spec in numbers.items():
            if col in df.columns:
                _to_numbers(df, col, p / name, role, spec)
    if summary.empty:
        raise KVBenchError(f"{what}: summary.csv has no rows (did the run finish any phase?)")
    incomplete = summary[list(KEY)].isna().any(axis=1).to_numpy()
    if incomplete.any():
        line = int(summary.attrs["lines"][np.flatnonzero(incomplete)[0]])
        raise KVBenchError(f"{what}: summary.csv line {line} is incomplete (an empty phase, concurrency or length)")
    if summary.duplicated(list(KEY)).any():
        r = summary[summary.duplicated(list(KEY))].iloc[0]
        raise KVBenchError(f"{what}: summary.csv has two rows for {r['phase']} concurrency {r['concurrency']}")
    return EndpointRun(p, meta, summary, requests)
