"""Reading a bench run folder back: meta.json, summary.csv and steps.csv, checked, with every row's key filled in.

A folder that is not a bench run, a corrupt or non-UTF-8 file, a cell that is not a number: each is a KVBenchError
naming the file (and the line), never a traceback. Columns are read by name, so files with extra columns (or
without the optional ones) from other kvbench versions read the same way.
"""

from __future__ import annotations

import csv
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.errors import KVBenchError

# Rows are the same configuration when all of these are equal.
KEY = ("engine", "cache", "model", "weights", "dtype", "device", "prompt_len", "new_tokens", "batch")
INT_KEYS = ("prompt_len", "new_tokens", "batch")
# summary.csv must have these; the other KEY fields may come from meta.json (one value per run).
SUMMARY_REQUIRED = ("engine", "cache", "prompt_len")
STEPS_REQUIRED = ("engine", "cache", "prompt_len", "latency_ms")


# --- loading a run folder ------------------------------------------------------------------------------------------
@dataclass
class Run:
    """A bench run folder, read and checked: its meta.json, and its CSVs with every KEY column filled in."""

    path: Path
    meta: dict
    summary: pd.DataFrame
    steps: pd.DataFrame


def weights_kind(desc: object) -> str:
    """meta.json's weights description -> what kind of weights: hub, random or local (a directory)."""
    s = str(desc)
    if s.startswith("hub:"):
        return "hub"
    if s.startswith("random"):
        return "random"
    return "local" if s and s != "None" else "unknown"


@contextmanager
def _reading(path: Path, what: str):
    """A file that cannot be read or is not UTF-8 text becomes one line naming it."""
    try:
        yield
    except UnicodeDecodeError:
        raise KVBenchError(f"{what}: {path} is not UTF-8 text; is this a kvbench run folder?") from None
    except OSError as e:
        raise KVBenchError(f"{what}: cannot read {path} ({e.strerror})") from None


def _read_json(path: Path, what: str) -> dict:
    try:
        with _reading(path, what):
            doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise KVBenchError(f"{what}: {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(doc, dict):
        raise KVBenchError(f"{what}: {path} is not a kvbench meta.json (a JSON object was expected)")
    return doc


def _read_csv(path: Path, what: str, required: tuple[str, ...]) -> pd.DataFrame:
    """Every field as text (empty cells: NaN), so a stray value is reported rather than guessed at. Read with the
    csv module rather than pandas, which would quietly turn a row with extra fields into an index."""
    try:
        with _reading(path, what), path.open(encoding="utf-8", newline="") as f:
            reader = csv.reader(f, strict=True)
            header = next(reader, None)
            rows = []
            for row in reader:
                if not row:
                    continue
                if len(row) != len(header):
                    raise KVBenchError(
                        f"{what}: {path} line {reader.line_num} has {len(row)} fields, the header {len(header)} "
                        "(a corrupt or truncated file?)"
                    )
                rows.append(row)
    except csv.Error as e:
        raise KVBenchError(f"{what}: {path} is not a valid CSV (line {reader.line_num}: {e})") from None
    if not header:
        raise KVBenchError(f"{what}: {path} is empty (not even a header line)")
    missing = [c for c in required if c not in header]
    if missing:
        shown = ", ".join(header[:8]) + (", ..." if len(header) > 8 else "")
        raise KVBenchError(
            f"{what}: {path} has no column {', '.join(missing)} (columns: {shown}); is it a kvbench bench file?"
        )
    df = pd.DataFrame(rows, columns=header, dtype=object)
    return df.mask(df == "")  # empty cells -> NaN


def _to_numbers(df: pd.DataFrame, col: str, path: Path, what: str, integer: bool = False) -> None:
    """Convert one column in place; a cell that is not a number is an error naming file, line and value."""
    values = pd.to_numeric(df[col], errors="coerce")
    bad = values.isna() & df[col].notna()
    if integer:
        bad |= values.notna() & (values != values.round())
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise KVBenchError(
            f"{what}: {path} line {i + 2}: {col} is {df[col].iloc[i]!r}, not a{'n integer' if integer else ' number'}"
        )
    df[col] = values


def _run_level(meta: dict) -> dict:
    """The KEY fields one bench run has a single value for, from its meta.json."""
    settings = meta.get("settings") if isinstance(meta.get("settings"), dict) else {}
    return {
        "model": meta.get("model"),
        "weights": weights_kind(meta.get("weights")),
        "dtype": meta.get("dtype"),
        "device": meta.get("device"),
        "new_tokens": settings.get("new_tokens"),
        "batch": settings.get("batch", 1),
    }


def load_run(path: str | Path, role: str) -> Run:
    """Read a run folder written by `kvbench bench`; KVBenchError (one line, naming the file) when it is not one."""
    p = Path(path).expanduser()
    what = f"{role} {p}"
    if not p.exists():
        raise KVBenchError(f"{what}: no such folder")
    if not p.is_dir():
        raise KVBenchError(f"{what} is a file, not a run folder; give the folder kvbench bench wrote")
    absent = [n for n in ("meta.json", "summary.csv", "steps.csv") if not (p / n).is_file()]
    if absent:
        raise KVBenchError(
            f"{what} is not a kvbench run folder (no {', '.join(absent)}); give a folder written by kvbench bench"
        )
    meta = _read_json(p / "meta.json", role)
    summary = _read_csv(p / "summary.csv", role, SUMMARY_REQUIRED)
    steps = _read_csv(p / "steps.csv", role, STEPS_REQUIRED)
    if summary.empty:
        raise KVBenchError(f"{what}: summary.csv has no rows (did the sweep finish any configuration?)")
    # Every KEY column filled in: from summary.csv where it has the column, else the run's one value from meta.json.
    level = _run_level(meta)
    for col in KEY:
        if col not in summary.columns:
            if level.get(col) is None:
                raise KVBenchError(f"{what}: neither summary.csv nor meta.json says the run's {col}")
            summary[col] = str(level[col])
        elif col == "weights":  # a per-row description, if a bench ever writes one: compare its kind
            summary[col] = summary[col].map(weights_kind)
    for col in INT_KEYS:
        _to_numbers(summary, col, p / "summary.csv", role, integer=True)
    for col in INT_KEYS:
        if col in steps.columns:
            _to_numbers(steps, col, p / "steps.csv", role, integer=True)
    _to_numbers(steps, "latency_ms", p / "steps.csv", role)
    for col in (
        "ttft_ms",
        "tpot_ms_median",
        "tokens_per_s",
        "peak_mem_mib",
        "kv_cache_mib",
        "token_agreement",
    ):
        if col in summary.columns:
            _to_numbers(summary, col, p / "summary.csv", role)
    empty = summary[list(KEY)].isna().any(axis=1)
    if empty.any():
        i = int(np.flatnonzero(empty.to_numpy())[0])
        raise KVBenchError(
            f"{what}: summary.csv line {i + 2} is incomplete (an empty engine, cache or length)"
        )
    if steps["latency_ms"].isna().any():
        i = int(np.flatnonzero(steps["latency_ms"].isna().to_numpy())[0])
        raise KVBenchError(f"{what}: steps.csv line {i + 2} has no latency_ms (a truncated file?)")
    dup = summary.duplicated(list(KEY))
    if dup.any():
        r = summary[dup].iloc[0]
        raise KVBenchError(
            f"{what}: summary.csv has two rows for {row_label(r)}; rows are matched on {', '.join(KEY)}"
        )
    return Run(p, meta, summary, steps)


def row_label(r) -> str:
    return f"{r.engine} {r.cache} prompt {int(r.prompt_len)}"
