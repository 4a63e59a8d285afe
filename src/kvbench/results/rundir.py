"""The run folder: chosen, validated and claimed for one run, written into atomically, and its rows exported.

A folder is checked before any work (`check_run_dir`: not a file, not an earlier run unless --force, writable),
then created and locked for the run alone (`claimed_run_dir`). Every write goes to a temporary file in the same
folder and is moved into place with `os.replace`, so a reader (or an interrupted run) only ever sees a complete
file: the previous version or the new one, never half of one.

`bench --export FORMAT FILE` writes a finished sweep's rows in the format of a tool that charts them over commits.
github-action-benchmark: benchmark-action/github-action-benchmark's `customSmallerIsBetter` input, a JSON list of
{"name", "unit", "value", "extra"}; one TPOT entry (median decode step) and one TTFT entry (median prefill + first
token) per ok row, named by engine, cache, prompt length (context with --fill random) and batch, so each series
stays the same configuration from commit to commit. Rows that did not complete (oom, error) are left out.
"""

from __future__ import annotations

import csv
import io
import math
import os
import time
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.jsonio import json_text
from kvbench.outputs import output_kind, write_output

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks (see _lock)
    ADVISORY_LOCKS = False
else:
    ADVISORY_LOCKS = True


def default_run_dir(kind: str = "bench") -> Path:
    return Path("results") / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}"


def prepare_run_dir(path: str | Path) -> Path:
    """Create `path` and prove it is writable, before any work is done; a clear error otherwise."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise KVBenchError(f"--out {p} is not a writable directory ({e.strerror}); choose another --out") from None
    return p


# What a bench run writes into its folder; --force replaces exactly these.
BENCH_FILES = (
    "summary.csv",
    "steps.csv",
    "ttft.csv",
    "meta.json",
    "latency.png",
    "speedup.png",
    "context.png",
    "batch.png",
    "profile_ops.csv",
    "tp.csv",
    "requests.csv",  # bench --endpoint
    "cold_warm.png",
)
# bench --profile's traces (*.trace.json); --force removes the traces, not the folder's other files
PROFILE_DIR = "profile"
# Held (locked) in a run folder while a bench writes into it; removed when the run ends.
RUN_LOCK = ".kvbench-run.lock"


def unique_default_run_dir(kind: str = "bench") -> Path:
    """results/<timestamp>-<kind>/, with -2, -3, ... appended if a run started in the same second."""
    base = default_run_dir(kind)
    p, n = base, 1
    while p.exists():
        n += 1
        p = base.with_name(f"{base.name}-{n}")
    return p


def check_run_dir(path: str, force: bool) -> Path:
    """Validate an --out folder without creating anything: not empty text, not a file, not an earlier run
    (unless `force`), and inside a folder that can be written."""
    if not str(path).strip():
        raise KVBenchError(
            "--out is empty; give a folder for the run (or leave --out out for results/<timestamp>-bench/)"
        )
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise KVBenchError(f"--out {p} exists and is not a folder; choose another --out")
    if p.is_dir() and _locked_by_another(p):
        raise KVBenchError(_in_use(p))
    if p.is_dir() and any(p.iterdir()) and not force:
        held = sorted(x.name for x in p.iterdir())
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise KVBenchError(
            f"--out {p} already holds files ({shown}); choose a new folder, or add --force to replace its "
            f"bench files ({', '.join(BENCH_FILES)})"
        )
    parent = p if p.exists() else next((a for a in p.absolute().parents if a.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise KVBenchError(f"--out {p} is not a writable directory ({parent} cannot be written); choose another --out")
    return p


def check_baseline_apart(baseline: Path | None, out_dir: str | Path) -> None:
    """A run's --baseline must survive it: refused when --out (with --force) would overwrite it."""
    if baseline is not None and Path(baseline).expanduser().resolve() == Path(out_dir).expanduser().resolve():
        raise KVBenchError(
            f"--baseline and --out are the same folder ({baseline}): the run would overwrite the baseline it is "
            "compared against; write the new run elsewhere"
        )


def _in_use(p: Path) -> str:
    return f"--out {p} is in use by another kvbench bench that is still running; wait for it, or choose another --out"


def _lock(p: Path) -> int | None:
    """Lock `p` for this run (an advisory lock the kernel drops when the process ends, however it ends); the open
    lock file's descriptor. KVBenchError when another run holds it. Where there are no advisory locks (not POSIX),
    None: the exclusive mkdir and the emptiness check in claimed_run_dir remain."""
    if not ADVISORY_LOCKS:
        return None
    try:
        fd = os.open(p / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise KVBenchError(f"--out {p} is not a writable directory ({e.strerror}); choose another --out") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise KVBenchError(_in_use(p)) from None
    return fd


def _locked_by_another(p: Path) -> bool:
    """Does a running bench hold `p`'s lock?"""
    if not ADVISORY_LOCKS:
        return False
    try:
        fd = os.open(p / RUN_LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@contextmanager
def claimed_run_dir(path: Path, force: bool):
    """The (validated) run folder, created once all other validation has passed and held for this run alone until
    the block ends. It is created exclusively and locked, so two benches given the same --out cannot both write
    there: the second is refused (even with `force`) while the first runs. Without `force` it must still be empty
    (another command may have filled it since validation); with `force`, the bench files of an earlier run are
    removed first, so no file of that run survives next to the new one."""
    p = Path(path).expanduser()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            p.mkdir()
            made = True
        except FileExistsError:
            made = False
    except OSError as e:
        raise KVBenchError(f"--out {p} is not a writable directory ({e.strerror}); choose another --out") from None
    fd = _lock(p)
    try:
        held = [] if made or force else sorted(x.name for x in p.iterdir() if x.name != RUN_LOCK)
        if held:
            shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
            raise KVBenchError(
                f"--out {p} was written to while this run got ready (it now holds {shown}); choose a new folder, "
                "or add --force to replace its bench files"
            )
        prepare_run_dir(p)
        if force:
            for name in BENCH_FILES:
                (p / name).unlink(missing_ok=True)
            for trace in (p / PROFILE_DIR).glob("*.trace.json") if (p / PROFILE_DIR).is_dir() else ():
                trace.unlink(missing_ok=True)
        yield p
    finally:
        if fd is not None:
            with suppress(OSError):
                (p / RUN_LOCK).unlink(missing_ok=True)
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    write_output(path, text.encode("utf-8"))


def _cell(v: Any) -> Any:
    """NaN -> empty cell; integral floats (byte counts) -> exact integers; other floats -> 7 significant digits."""
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return str(int(v)) if v.is_integer() and abs(v) < 2**63 else f"{v:.7g}"
    return v


def write_csv(path: Path, columns: list[str], rows: list[Any]) -> None:
    """Rows are dataclasses or dicts; NaN is written as an empty cell. Atomic."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        d = asdict(r) if not isinstance(r, dict) else r
        w.writerow([_cell(d.get(c, "")) for c in columns])
    atomic_write_text(path, buf.getvalue())


def write_json(path: Path, doc: Any) -> None:
    atomic_write_text(path, json_text(doc) + "\n")


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
    output_kind(p, f"--export {fmt}")  # a block device or a socket refused before the run
    return fmt, p


def check_export_target(export: tuple[str, Path] | None, run_dir: Path) -> None:
    """Once the run folder is known: the export goes into a folder that exists (or into the run folder, made when
    the run starts), and is none of the files the run itself writes there, nor any file of another kvbench run
    folder (one holding a meta.json, its profile/ folder included). Paths are compared resolved: a symbolic link
    or `..` spells the same folder."""
    if export is None:
        return
    fmt, p = export
    target = Path(os.path.realpath(p))  # the file a write would replace: links followed, `..` folded
    own = Path(os.path.realpath(Path(run_dir).expanduser()))
    inside = target.parent == own
    if inside and (target.name in BENCH_FILES or target.name in (PROFILE_DIR, "compare.json", "compare.png")):
        raise KVBenchError(
            f"--export {fmt} {p}: that is the run's own {target.name}; give the export another name, e.g. "
            f"{p.parent / 'bench-output.json'}"
        )
    folder = target.parent.parent if target.parent.name == PROFILE_DIR else target.parent
    if folder == own and target.parent != own:
        raise KVBenchError(f"--export {fmt} {p}: that is inside the run's own {PROFILE_DIR}/; choose another path")
    if folder != own and (folder / "meta.json").is_file():
        raise KVBenchError(
            f"--export {fmt} {p}: {folder} is a kvbench run folder (it has a meta.json), whose files kvbench never "
            "replaces; choose a path outside it"
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
        where = f"{r.device} {r.dtype}; {r.repeats} timed repeat{'' if r.repeats == 1 else 's'}"
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
    write_output(path, (json_text(entries) + "\n").encode("utf-8"), f"--export {fmt}")
    return path, len(entries), skipped
