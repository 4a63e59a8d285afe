"""`bench --export FORMAT FILE`: a finished sweep's rows in the format of a tool that charts them over commits.

github-action-benchmark: benchmark-action/github-action-benchmark's `customSmallerIsBetter` input, a JSON list of
{"name", "unit", "value", "extra"}; one TPOT entry (median decode step) and one TTFT entry (median prefill + first
token) per ok row, named by engine, cache, prompt length (context with --fill random) and batch, so each series
stays the same configuration from commit to commit. Rows that did not complete (oom, error) are left out.
"""

from __future__ import annotations

import math
from pathlib import Path

from kvbench.errors import KVBenchError
from kvbench.jsonio import json_text
from kvbench.results.rundir import atomic_write_text

FORMATS = ("github-action-benchmark",)


def check_export(export: tuple[str, Path] | None) -> tuple[str, Path] | None:
    """--export FORMAT FILE checked before the run starts: a known format, a file in a folder that exists."""
    if export is None:
        return None
    fmt, path = export
    if fmt not in FORMATS:
        raise KVBenchError(f"--export {fmt!r}: unknown format; choose {', '.join(FORMATS)}")
    p = Path(path).expanduser()
    if not str(path).strip() or p.is_dir():
        raise KVBenchError(f"--export {fmt} {str(path)!r}: give a file path, e.g. bench-output.json")
    if not p.parent.is_dir():
        raise KVBenchError(
            f"--export {fmt} {p}: the folder {p.parent} does not exist; create it or choose another path"
        )
    return fmt, p


def _label(r) -> str:
    if hasattr(r, "context"):  # --fill random: decode over a random-filled cache, no prefill
        return f"kvbench/{r.cache} context={r.context} batch={r.batch}"
    return f"{r.engine}/{r.cache} prompt={r.prompt_len} batch={r.batch}"


def _number(x) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def github_action_benchmark(rows: list) -> tuple[list[dict], list[str]]:
    """(the customSmallerIsBetter entries, the labels of the rows left out with their status)."""
    entries, skipped = [], []
    for r in rows:
        if r.status != "ok":
            skipped.append(f"{_label(r)} ({r.status})")
            continue
        extra = f"{r.device} {r.dtype}; {r.repeats} timed repeats; TPOT p90 {r.tpot_ms_p90:.4g} ms"
        for metric, value in (("TPOT", r.tpot_ms_median), ("TTFT", getattr(r, "ttft_ms", None))):
            if _number(value) is not None:  # 4 significant digits: finer than any run-to-run noise
                ms = float(f"{_number(value):.4g}")
                entries.append({"name": f"{_label(r)} {metric}", "unit": "ms", "value": ms, "extra": extra})
    return entries, skipped


def write_export(export: tuple[str, Path], rows: list) -> tuple[Path, int, list[str]]:
    """Write the export atomically: (its path, entries written, rows left out)."""
    fmt, path = export
    assert fmt in FORMATS, fmt
    entries, skipped = github_action_benchmark(rows)
    atomic_write_text(path, json_text(entries) + "\n")
    return path, len(entries), skipped
