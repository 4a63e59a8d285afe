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
from kvbench.results.rundir import BENCH_FILES, PROFILE_DIR, atomic_write_text

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
    return fmt, p


def check_export_target(export: tuple[str, Path] | None, run_dir: Path) -> None:
    """Once the run folder is known: the export goes into a folder that exists (or into the run folder, made when
    the run starts), and is none of the files the run itself writes there."""
    if export is None:
        return
    fmt, p = export
    inside = p.absolute().parent == Path(run_dir).expanduser().absolute()
    if inside and (p.name in BENCH_FILES or p.name in (PROFILE_DIR, "compare.json", "compare.png")):
        raise KVBenchError(
            f"--export {fmt} {p}: that is the run's own {p.name}; give the export another name, e.g. "
            f"{p.parent / 'bench-output.json'}"
        )
    if not inside and not p.parent.is_dir():
        raise KVBenchError(
            f"--export {fmt} {p}: the folder {p.parent} does not exist; create it or choose another path"
        )


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
        where = f"{r.device} {r.dtype}; {r.repeats} timed repeats"
        for metric, value, p90 in (
            ("TPOT", r.tpot_ms_median, r.tpot_ms_p90),
            ("TTFT", getattr(r, "ttft_ms", None), getattr(r, "ttft_ms_p90", None)),
        ):
            if _number(value) is not None:  # 4 significant digits: finer than any run-to-run noise
                ms = float(f"{_number(value):.4g}")
                extra = where + (f"; {metric} p90 {p90:.4g} ms" if _number(p90) is not None else "")
                entries.append({"name": f"{_label(r)} {metric}", "unit": "ms", "value": ms, "extra": extra})
    return entries, skipped


def write_export(export: tuple[str, Path], rows: list) -> tuple[Path, int, list[str]]:
    """Write the export atomically: (its path, entries written, rows left out)."""
    fmt, path = export
    assert fmt in FORMATS, fmt
    entries, skipped = github_action_benchmark(rows)
    atomic_write_text(path, json_text(entries) + "\n")
    return path, len(entries), skipped
