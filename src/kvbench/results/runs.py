"""Reading a bench run folder back: meta.json, summary.csv, steps.csv and (when the run wrote it) ttft.csv, checked,
with every row's key filled in.

A folder that is not a bench run, a corrupt or non-UTF-8 file, a column named twice, a cell that is not a number or
holds one out of its range (an infinite or negative latency, a prompt length of 0): each is a KVBenchError naming
the file, the line and the column, never a traceback. Every number compare reads, from the CSVs or from meta.json,
is checked here, so nothing downstream sees NaN where a value is required, an infinity or a negative time. Columns
are read by name, so files with extra columns (or without the optional ones) from other kvbench versions read the
same way.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench.errors import KVBenchError
from kvbench.text import printable

# Rows are the same configuration when all of these are equal.
KEY = ("engine", "cache", "model", "weights", "dtype", "device", "prompt_len", "new_tokens", "batch")
INT_KEYS = ("prompt_len", "new_tokens", "batch")
# summary.csv must have these; the other KEY fields may come from meta.json (one value per run).
SUMMARY_REQUIRED = ("engine", "cache", "prompt_len")
STEPS_REQUIRED = ("engine", "cache", "prompt_len", "latency_ms")
TTFT_REQUIRED = ("engine", "cache", "prompt_len", "ttft_ms")  # ttft.csv, one row per timed repeat


# --- what a number in a run folder may be ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Number:
    """The values a numeric field may hold: finite, within [low, high] (above low when `above`), whole if
    `integer`."""

    low: float
    high: float
    integer: bool = False
    above: bool = False  # strictly above `low`

    def allows(self, v: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(v) & ((v > self.low) if self.above else (v >= self.low)) & (v <= self.high)
            if self.integer:
                ok &= v == np.round(v)
        return ok

    def problem(self, v: float) -> str:
        """What is wrong with `v` (a value `allows` refused), for an error message."""
        if math.isnan(v):
            return "not a number"
        if not math.isfinite(v):
            return "not a finite number"
        if self.integer and v != round(v):
            return f"not a whole number (from {self.low:,.0f} to {self.high:,.0f})"
        low = f"above {self.low:g}" if self.above else f"at least {self.low:g}"
        return f"out of range (it must be {low} and at most {self.high:,.0f})"


WHOLE = Number(1, 2**31 - 1, integer=True)
MS = Number(0, 86_400_000, above=True)  # a time in ms: above 0, at most a day
MIB = Number(0, 2**40)  # memory in MiB: an exbibyte at most
# Every numeric column compare reads; a column not listed is never read as a number.
NUMBERS = {
    "prompt_len": WHOLE,
    "new_tokens": WHOLE,
    "batch": WHOLE,
    "repeat": WHOLE,
    "latency_ms": MS,
    "ttft_ms": MS,
    "tpot_ms_median": MS,
    "tokens_per_s": Number(0, 1e12, above=True),
    "peak_mem_mib": MIB,
    "kv_cache_mib": MIB,
    "token_agreement": Number(0, 1),
}
BANDWIDTH_GBPS = Number(0, 1e6, above=True)  # meta.json floor.bandwidth.gbps
LOAD = Number(0, 1e6)  # meta.json host.load_average.start.1m
SUMMARY_NUMBERS = (
    "ttft_ms",
    "tpot_ms_median",
    "tokens_per_s",
    "peak_mem_mib",
    "kv_cache_mib",
    "token_agreement",
)


# --- loading a run folder ------------------------------------------------------------------------------------------
@dataclass
class Run:
    """A bench run folder, read and checked: its meta.json, and its CSVs with every KEY column filled in."""

    path: Path
    meta: dict
    summary: pd.DataFrame
    steps: pd.DataFrame
    ttft: pd.DataFrame | None = None  # ttft.csv; None for runs from before kvbench wrote it

    @property
    def status(self) -> str | None:
        """meta.json's status: complete, interrupted, running (still running, or stopped without a word)."""
        return self.meta.get("status")

    @property
    def planned(self) -> list[tuple[str, str, int, int]] | None:
        """The configurations the sweep set out to run, (engine, cache, prompt_len, batch); None where meta.json
        does not say (runs from before kvbench recorded it). Runs from before batch sweeps ran one batch size."""
        rows = self.meta.get("configurations_planned")
        if rows is None:
            return None
        batch = run_level(self.meta)["batch"]
        return [(r["engine"], r["cache"], r["prompt_len"], r.get("batch", batch)) for r in rows]


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
    except RecursionError:
        raise KVBenchError(f"{what}: {path} is nested too deeply to be a kvbench meta.json") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise KVBenchError(f"{what}: {path} is not a kvbench meta.json ({e})") from None
    if not isinstance(doc, dict):
        raise KVBenchError(f"{what}: {path} is not a kvbench meta.json (a JSON object was expected)")
    return doc


def _read_csv(path: Path, what: str, required: tuple[str, ...]) -> pd.DataFrame:
    """Every field as text (empty cells: NaN), so a stray value is reported rather than guessed at; each row's line
    in the file in `df.attrs["lines"]`. A row with more or fewer fields than the header is an error (a parser that
    filled or folded it would compare the wrong numbers)."""
    with _reading(path, what):
        text = path.read_text(encoding="utf-8")
    first = text.split("\n", 1)[0]
    # what bench writes: no quoting anywhere
    plain = '"' not in text and "\r" not in text and "\0" not in text
    header = (first.split(",") if first else None) if plain else next(csv.reader([first]), None)
    if not header:
        raise KVBenchError(f"{what}: {path} is empty (not even a header line)")
    df = _parse_plain(text, header, path, what) if plain else None
    if df is None:
        header, df = _parse_csv(text, path, what)
    twice = [name for name, n in Counter(header).items() if n > 1]
    if twice:
        raise KVBenchError(f"{what}: {path} names the column {twice[0]!r} more than once (line 1)")
    missing = [c for c in required if c not in header]
    if missing:
        shown = ", ".join(header[:8]) + (", ..." if len(header) > 8 else "")
        raise KVBenchError(
            f"{what}: {path} has no column {', '.join(missing)} (columns: {shown}); is it a kvbench bench file?"
        )
    return df


def _wrong_width(path: Path, what: str, line: int, fields: int, header: int) -> KVBenchError:
    return KVBenchError(
        f"{what}: {path} line {line} has {fields} fields, the header {header} (a corrupt or truncated file?)"
    )


def _parse_plain(text: str, header: list[str], path: Path, what: str) -> pd.DataFrame | None:
    """A CSV without a single quote character (what bench writes): every line is its fields split at commas, so
    the widths are checked line by line and pandas' C parser reads the cells (no Python per cell). None
    where pandas reads it otherwise: the csv module's reading is then the one used."""
    b = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)  # (bytes,)
    starts = np.concatenate(([0], np.flatnonzero(b == ord("\n")) + 1))  # (lines,) where each line starts
    ends = np.append(starts[1:] - 1, len(b))  # (lines,) its newline (or the end of the file)
    body = np.flatnonzero(ends > starts)[1:]  # non-empty lines after the header (line 1)
    at = np.flatnonzero(b == ord(","))  # (commas,) sorted byte offsets
    # fields in each line: its commas + 1
    widths = np.searchsorted(at, ends[body]) - np.searchsorted(at, starts[body]) + 1
    wrong = np.flatnonzero(widths != len(header))
    if len(wrong):
        i = int(wrong[0])
        raise _wrong_width(path, what, int(body[i]) + 1, int(widths[i]), len(header))
    numbered = body + 1  # line numbers
    names = [f"c{j}" for j in range(len(header))]  # header names as given (pandas would rename repeated ones)
    df = pd.read_csv(
        io.StringIO(text),
        header=None,
        skiprows=1,
        names=names,
        dtype=str,
        keep_default_na=False,
        na_values=[""],
        skip_blank_lines=True,
        engine="c",
        quoting=csv.QUOTE_NONE,
    )
    if len(df) != len(numbered):
        return None
    df.columns = header
    if any(str(dt) != "object" for dt in df.dtypes):  # pandas versions whose str dtype is not object
        df = df.astype(object)
    df.attrs["lines"] = numbered.astype(np.int64)
    return df


def _parse_csv(text: str, path: Path, what: str) -> tuple[list[str], pd.DataFrame]:
    """Any CSV, quoted fields and all, with the csv module (strict: broken quoting is an error)."""
    lines: list[int] = []
    rows = []
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, None)
        for row in reader:
            if not row:
                continue
            assert header is not None  # a row follows the header
            if len(row) != len(header):
                raise _wrong_width(path, what, reader.line_num, len(row), len(header))
            rows.append(row)
            lines.append(reader.line_num)
    except csv.Error as e:
        raise KVBenchError(f"{what}: {path} is not a valid CSV (line {reader.line_num}: {e})") from None
    if not header:
        raise KVBenchError(f"{what}: {path} is empty (not even a header line)")
    df = pd.DataFrame(rows, columns=range(len(header)), dtype=object)
    df = df.mask(df == "")  # empty cells -> NaN
    df.columns = header
    df.attrs["lines"] = np.asarray(lines, dtype=np.int64)
    return header, df


def _shown(v: object, limit: int = 40) -> str:
    """A value for an error message: its repr, cut short."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _to_numbers(df: pd.DataFrame, col: str, path: Path, what: str, spec: Number | None = None) -> None:
    """Convert one column in place (empty cells stay NaN); a cell that is not a number, or not one the column may
    hold (`spec`, else NUMBERS), is an error naming the file, the line, the column and the value."""
    spec = spec or NUMBERS[col]
    try:  # every cell a number (or empty): numpy converts them all at once
        values = pd.Series(df[col].to_numpy().astype(float), index=df.index)
    except (ValueError, TypeError):  # some cell is not: pandas finds which
        values = pd.to_numeric(df[col], errors="coerce")
    bad = df[col].notna().to_numpy() & ~spec.allows(values.to_numpy(dtype=float))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        line = int(df.attrs["lines"][i]) if "lines" in df.attrs else i + 2
        problem = spec.problem(float(values.iloc[i]))
        raise KVBenchError(f"{what}: {path} line {line}: {col} is {_shown(df[col].iloc[i])}, {problem}")
    if spec.integer and not values.isna().any():
        values = values.astype(np.int64)  # whole numbers read back as such (8, not 8.0, in messages and keys)
    df[col] = values


def _field(meta: dict, path: tuple[str, ...]):
    doc: Any = meta
    for k in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(k)
    return doc


def _meta_number(meta: dict, path: tuple[str, ...], spec: Number, where: str):
    """A number meta.json holds, checked like a CSV cell; None when absent."""
    v = _field(meta, path)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise KVBenchError(f"{where}: {'.'.join(path)} is {_shown(v)}, not a number")
    try:
        f = float(v)
    except OverflowError:  # an integer beyond any float: out of every range
        f = sys.float_info.max if v > 0 else -sys.float_info.max
    if not spec.allows(np.array([f]))[0]:
        raise KVBenchError(f"{where}: {'.'.join(path)} is {_shown(v)}, {spec.problem(f)}")
    return int(v) if spec.integer else float(v)


def _check_meta(meta: dict, where: str) -> None:
    """The fields of meta.json that compare reads, of the type and range they must have."""
    for key in ("settings", "host", "versions", "floor", "git"):
        if key in meta and meta[key] is not None and not isinstance(meta[key], dict):
            raise KVBenchError(f"{where}: {key} is {type(meta[key]).__name__}, not an object")
    for key in ("model", "dtype", "device", "status"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise KVBenchError(f"{where}: {key} is {_shown(meta[key])}, not a name")
    _meta_number(meta, ("settings", "new_tokens"), WHOLE, where)
    batch = _field(meta, ("settings", "batch"))
    if isinstance(batch, list):  # a batch sweep: its sizes (older runs: one number)
        for i, b in enumerate(batch):
            _meta_number({"b": b}, ("b",), WHOLE, f"{where}: settings.batch[{i}]")
    else:
        _meta_number(meta, ("settings", "batch"), WHOLE, where)
    _meta_number(meta, ("floor", "bandwidth", "gbps"), BANDWIDTH_GBPS, where)
    _meta_number(meta, ("host", "load_average", "start", "1m"), LOAD, where)
    planned = meta.get("configurations_planned")
    if planned is not None:
        fine = isinstance(planned, list) and all(
            isinstance(r, dict)
            and isinstance(r.get("engine"), str)
            and isinstance(r.get("cache"), str)
            and isinstance(r.get("prompt_len"), int)
            and not isinstance(r.get("prompt_len"), bool)
            and (r.get("batch") is None or (isinstance(r["batch"], int) and not isinstance(r["batch"], bool)))
            for r in planned
        )
        if not fine:
            raise KVBenchError(
                f"{where}: configurations_planned is not a list of {{engine, cache, prompt_len}} objects"
            )


def run_level(meta: dict) -> dict:
    """The KEY fields one bench run has a single value for, from its (checked) meta.json."""
    settings = meta.get("settings")
    if not isinstance(settings, dict):
        settings = {}
    return {
        "model": meta.get("model"),
        "weights": weights_kind(meta.get("weights")),
        "dtype": meta.get("dtype"),
        "device": meta.get("device"),
        "new_tokens": settings.get("new_tokens"),
        # one batch size for the run (older runs, or a sweep of one); a batch sweep's rows each say theirs
        "batch": _one(settings.get("batch", 1)),
    }


def _one(value):
    """A setting that may be a list: its only value, or None when it has several."""
    if isinstance(value, list):
        return value[0] if len(value) == 1 else None
    return value


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
    _check_schema_version(meta, p / "meta.json", role)
    _check_meta(meta, f"{role}: {p / 'meta.json'}")
    summary = _read_csv(p / "summary.csv", role, SUMMARY_REQUIRED)
    steps = _read_csv(p / "steps.csv", role, STEPS_REQUIRED)
    if summary.empty:
        raise KVBenchError(f"{what}: summary.csv has no rows (did the sweep finish any configuration?)")
    # Every KEY column filled in: from summary.csv where it has the column, else the run's one value from meta.json.
    level = run_level(meta)
    for col in KEY:
        if col not in summary.columns:
            if level.get(col) is None:
                raise KVBenchError(f"{what}: neither summary.csv nor meta.json says the run's {col}")
            summary[col] = str(level[col])
        elif col == "weights":  # a per-row description, if a bench ever writes one: compare its kind
            summary[col] = summary[col].map(weights_kind)
    for col in (*INT_KEYS, *SUMMARY_NUMBERS):
        if col in summary.columns:
            _to_numbers(summary, col, p / "summary.csv", role)
    for col in (*INT_KEYS, "repeat", "latency_ms"):
        if col in steps.columns:
            _to_numbers(steps, col, p / "steps.csv", role)
    empty = summary[list(KEY)].isna().any(axis=1).to_numpy()
    if empty.any():
        line = int(summary.attrs["lines"][np.flatnonzero(empty)[0]])
        raise KVBenchError(f"{what}: summary.csv line {line} is incomplete (an empty engine, cache or length)")
    no_latency = steps["latency_ms"].isna().to_numpy()
    if no_latency.any():
        line = int(steps.attrs["lines"][np.flatnonzero(no_latency)[0]])
        raise KVBenchError(f"{what}: steps.csv line {line} has no latency_ms (a truncated file?)")
    ttft = _read_ttft(p / "ttft.csv", role) if (p / "ttft.csv").is_file() else None
    if level["batch"] is None:  # a batch sweep: each step and TTFT must say its batch, or sizes would be pooled
        for name, df in (("steps.csv", steps), ("ttft.csv", ttft)):
            if df is not None and "batch" not in df.columns:
                raise KVBenchError(
                    f"{what}: {name} has no batch column, but meta.json lists several batch sizes "
                    f"({_shown(_field(meta, ('settings', 'batch')))}): its rows cannot be told apart by batch"
                )
    dup = summary.duplicated(list(KEY))
    if dup.any():
        r = summary[dup].iloc[0]
        raise KVBenchError(f"{what}: summary.csv has two rows for {row_label(r)}; rows are matched on {', '.join(KEY)}")
    return Run(p, meta, summary, steps, ttft)


def _check_schema_version(meta: dict, path: Path, role: str) -> None:
    """meta.json's schema_version read as the docs promise: this kvbench's version is read; a newer one (a key
    removed, renamed or retyped since) or one that is no version at all is refused; none at all (runs from before
    kvbench wrote it) is read as version 1, with a warning."""
    from kvbench import console
    from kvbench.jsonio import SCHEMA_VERSION

    if "schema_version" not in meta:
        console.warn(
            f"{role} {path} has no schema_version (a run from before kvbench recorded it): read as version "
            f"{SCHEMA_VERSION}"
        )
        return
    v = meta["schema_version"]
    if isinstance(v, int) and not isinstance(v, bool) and v == SCHEMA_VERSION:
        return
    if isinstance(v, int) and not isinstance(v, bool) and v > SCHEMA_VERSION:
        raise KVBenchError(
            f"{role} {path}: schema_version {_shown(v)} is newer than the {SCHEMA_VERSION} this kvbench reads (a key was "
            "removed, renamed or changed type since); compare it with the kvbench that wrote it"
        )
    raise KVBenchError(
        f"{role} {path}: schema_version is {_shown(v)}, not a version kvbench writes (this kvbench writes and reads "
        f"the whole number {SCHEMA_VERSION})"
    )


def _read_ttft(path: Path, role: str) -> pd.DataFrame:
    """ttft.csv, checked as steps.csv is: every TTFT a time in ms."""
    ttft = _read_csv(path, role, TTFT_REQUIRED)
    for col in (*INT_KEYS, "repeat", "ttft_ms"):
        if col in ttft.columns:
            _to_numbers(ttft, col, path, role)
    missing = ttft["ttft_ms"].isna().to_numpy()
    if missing.any():
        line = int(ttft.attrs["lines"][np.flatnonzero(missing)[0]])
        raise KVBenchError(f"{role} {path.parent}: ttft.csv line {line} has no ttft_ms (a truncated file?)")
    return ttft


def row_label(r) -> str:
    """'<engine> <cache> prompt <n>', and ' batch <b>' past batch 1 (a batch sweep's rows differ by it)."""
    batch = int(getattr(r, "batch", 1) or 1)
    return printable(f"{r.engine} {r.cache} prompt {int(r.prompt_len)}" + (f" batch {batch}" if batch != 1 else ""))
