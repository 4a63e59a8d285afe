"""The run directory: meta.json and CSV files, written atomically as rows complete.

Every write goes to a temporary file in the same directory and is moved into place with `os.replace`, so a reader
(or an interrupted run) only ever sees a complete file: the previous version or the new one, never half of one.
"""

from __future__ import annotations

import csv
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvbench.bench import hugepages
from kvbench.errors import KVBenchError
from kvbench.jsonio import json_text

REPO_ROOT = Path(__file__).resolve().parents[2]


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
        raise KVBenchError(
            f"--out {p} is not a writable directory ({e.strerror}); choose another --out"
        ) from None
    return p


# What a bench run writes into its folder; --force replaces exactly these.
BENCH_FILES = ("summary.csv", "steps.csv", "meta.json", "latency.png", "speedup.png", "context.png")
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
        raise KVBenchError(
            f"--out {p} is not a writable directory ({parent} cannot be written); choose another --out"
        )
    return p


def _in_use(p: Path) -> str:
    return f"--out {p} is in use by another kvbench bench that is still running; wait for it, or choose another --out"


def _lock(p: Path) -> int | None:
    """Lock `p` for this run (an advisory lock the kernel drops when the process ends, however it ends); the open
    lock file's descriptor. KVBenchError when another run holds it. Where there are no advisory locks (not POSIX),
    None: the exclusive mkdir and the emptiness check in claimed_run_dir remain."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(p / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise KVBenchError(
            f"--out {p} is not a writable directory ({e.strerror}); choose another --out"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise KVBenchError(_in_use(p)) from None
    return fd


def _locked_by_another(p: Path) -> bool:
    """Does a running bench hold `p`'s lock?"""
    try:
        import fcntl

        fd = os.open(p / RUN_LOCK, os.O_RDONLY)
    except (ImportError, OSError):
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
        raise KVBenchError(
            f"--out {p} is not a writable directory ({e.strerror}); choose another --out"
        ) from None
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
        yield p
    finally:
        if fd is not None:
            with suppress(OSError):
                (p / RUN_LOCK).unlink(missing_ok=True)
            os.close(fd)


@contextmanager
def writing_into(folder: Path):
    """A write into a run folder that fails becomes one line: the folder was removed while the run wrote into it,
    or the file system refused (full, read-only)."""
    try:
        yield
    except OSError as e:
        if not folder.is_dir():
            raise KVBenchError(f"the run folder disappeared: {folder}") from None
        raise KVBenchError(f"cannot write into {folder} ({e.strerror or e})") from None


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing_into(path.parent):
        with tmp.open("w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _cell(v: Any) -> Any:
    """NaN -> empty cell; integral floats (byte counts) -> exact integers; other floats -> 7 significant digits."""
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return str(int(v)) if v.is_integer() and abs(v) < 2**63 else f"{v:.7g}"
    return v


def write_csv(path: Path, columns: list[str], rows: list[Any]) -> None:
    """Rows are dataclasses or dicts; NaN is written as an empty cell. Atomic."""
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        d = asdict(r) if not isinstance(r, dict) else r
        w.writerow([_cell(d.get(c, "")) for c in columns])
    atomic_write_text(path, buf.getvalue())


def write_json(path: Path, doc: Any) -> None:
    atomic_write_text(path, json_text(doc) + "\n")


def git_revision() -> dict[str, Any]:
    """The source tree's commit and whether it had uncommitted changes; None where git is unavailable."""

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    rev = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if rev else None
    return {"commit": rev, "dirty": bool(status) if status is not None else None}


def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    import torch

    from kvbench import __version__

    out: dict[str, str | None] = {"python": platform.python_version(), "kvbench": __version__}
    for pkg in ("torch", "transformers", "numpy", "pandas", "matplotlib"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    out["cuda"] = torch.version.cuda
    out["torch_threads"] = str(torch.get_num_threads())
    return out


def meta_doc(**fields: Any) -> dict[str, Any]:
    """The common header of meta.json: command line, git revision, versions, host; plus the caller's fields."""
    return {
        "command": shlex.join(["kvbench", *sys.argv[1:]]),  # as typed (argv[0] normalised to `kvbench`)
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_revision(),
        "versions": versions(),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "huge_pages": hugepages.status()},
        # the KVBENCH_ environment variables set for the run (KVBENCH_PROBE_BYTES sizes the bandwidth probe)
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVBENCH_")},
        **fields,
    }


# --- bench ---------------------------------------------------------------------------------------------------------
COLD_WARM = (
    "cold: the first run of each configuration (engine x cache x prompt length); on CUDA it starts from an emptied "
    "allocator cache and pays allocation, kernel selection, plan building for attention shapes not seen earlier in "
    "the sweep (so it depends on sweep order), CUDA-graph capture (static-graph, also in capture_ms) and "
    "compilation (hf-compiled). warm: the timed repeats after --warmup runs, same shapes, same caches, nothing "
    "freed or emptied in between; medians and spread are over these only."
)
TOKEN_REFERENCE = (
    "token_agreement: fraction of a row's generated tokens equal to kvbench none's for the same prompt ids in this "
    "run (kvbench and transformers rows alike), worst of the row's runs; a flip whose top-2 logit gap is within "
    "twice the logit error at that token is a near-tie (rounding), as verify judges it"
)
PEAK_NOTE = {
    "cuda": "peak_mem_mib = weights_mib (the engine's weights, each storage once) + run_peak_mib "
    "(torch.cuda.max_memory_allocated during the timed runs minus what was allocated before the configuration "
    "started, so the other engine's weights and earlier configurations are not counted); peak_reserved_mib is the "
    "allocator's whole pool (max_memory_reserved), absolute",
    "cpu": "peak_mem_mib = weights_mib + run_peak_mib (peak resident set size, VmHWM reset before every run, minus "
    "the resident set before the configuration started); resident memory the C allocator keeps after frees can "
    "hide part of a peak, so CPU figures are indicative",
    "cpu-hwm": "CPU peak cannot be reset here (no /proc): run_peak_mib is not measured (empty)",
}
FLOOR_NOTE = (
    "floor_ms: the bytes the median decode step must move (every weight once, lm_head included; K and V of the "
    "slots attention reads; this token's K and V written; the design's own copies: torch.cat history, paged "
    "gathers, int8 dequantisation) over the device's read bandwidth measured at the start of the run (with "
    "--order interleaved: the median of that probe and one more per round, per prompt length in by_prompt_len); "
    "x_floor = tpot_ms_median / floor_ms; step_bytes: those bytes. Rows without a cache (`none`) have no floor. "
    "floor.steps below breaks each row's bytes down."
)


def floor_meta(bandwidth) -> dict:
    return {"bandwidth": bandwidth.as_dict(), "note": FLOOR_NOTE, "steps": {}}


def device_label(device) -> str:
    """`cpu`, `cuda`, `cuda:1`: the device as rows and meta.json name it."""
    return device.type if device.index is None else f"{device.type}:{device.index}"


def run_meta(loaded, device, dtype, settings, config_path) -> dict[str, Any]:
    """The meta.json fields every run folder starts with: the run, the model, the device (status `running`).
    Also what `bench --baseline` checks against the baseline before the sweep."""
    from kvbench.bench.sweep import settings_dict
    from kvbench.devices import device_name, dtype_name

    return meta_doc(
        status="running",
        config_file=None if config_path is None else str(config_path),
        settings=settings_dict(settings),
        model=loaded.config.name,
        model_config={
            k: getattr(loaded.config, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
        },
        weights=loaded.weights,
        random_weights=loaded.random,
        device=device_label(device),
        device_name=device_name(device),
        dtype=dtype_name(dtype),
        seed=settings.seed,
    )


class BenchRecorder:
    """A bench run directory: meta.json at the start, summary.csv and steps.csv rewritten (atomically) each time a
    configuration completes, and the plots plus a final meta.json at the end or on interruption."""

    def _start(self, run_dir: Path, loaded, device, dtype, settings, config_path) -> None:
        """The fields every run folder shares: the run, the model, the device."""
        from kvbench.devices import dtype_name

        self.run_dir = run_dir
        self.dtype = dtype_name(dtype)
        self.device_label = device_label(device)
        self.summary: list = []
        self.steps: list = []
        self.plot_notes: list[str] = []  # plots not drawn, and why (finish)
        self.meta = run_meta(loaded, device, dtype, settings, config_path)

    def __init__(
        self, run_dir: Path, loaded, device, dtype, settings, config_path, bandwidth=None, extra_meta=None
    ) -> None:
        from kvbench.bench.backends import sdpa_settings
        from kvbench.devices import cpu_peak_resettable

        self._start(run_dir, loaded, device, dtype, settings, config_path)
        self.meta.update(
            fill="prefill",
            peak_memory_note=PEAK_NOTE[
                "cuda" if device.type == "cuda" else "cpu" if cpu_peak_resettable() else "cpu-hwm"
            ],
            cold_warm=COLD_WARM,
            token_reference=TOKEN_REFERENCE,
            sdpa=sdpa_settings(),
            engines={},
        )
        # what a caller adds or replaces (bench --hf: the model, its own token reference, its settings)
        self.meta.update(extra_meta or {})
        # the run's first probe; the rows of an interleaved sweep carry their pooled one
        self.bandwidth = bandwidth
        if bandwidth is not None:
            self.meta["floor"] = floor_meta(bandwidth)
        write_json(self.run_dir / "meta.json", self.meta)

    def add(self, result) -> None:
        from kvbench.bench.sweep import StepRow, SummaryRow, fill_relative

        self.summary.append(result.summary)
        self.steps.extend(result.steps)
        fill_relative(self.summary)
        r = result.summary
        if result.floor_bytes is not None and "floor" in self.meta:
            key = f"{r.engine} {r.cache} prompt {r.prompt_len}"
            self.meta["floor"]["steps"][key] = result.floor_bytes.as_dict()
            if result.bandwidth is not None and result.bandwidth is not self.bandwidth:
                rounds = self.meta["floor"].setdefault("by_prompt_len", {})  # interleaved: probed every round
                rounds[str(r.prompt_len)] = result.bandwidth.as_dict()
        write_csv(self.run_dir / "summary.csv", SummaryRow.columns(), self.summary)
        write_csv(self.run_dir / "steps.csv", StepRow.columns(), self.steps)

    def frames(self):
        import pandas as pd

        from kvbench.bench.sweep import StepRow, SummaryRow

        summary = pd.DataFrame([asdict(r) for r in self.summary], columns=SummaryRow.columns())
        # column by column: a long sweep has millions of steps, and asdict per row would take a minute
        steps = pd.DataFrame({c: [getattr(r, c) for r in self.steps] for c in StepRow.columns()})
        return summary, steps

    def finish(self, status: str, engines: dict | None = None) -> list[Path]:
        """Write the final meta.json and the plots from whatever completed; returns the files written. meta.json is
        written before the plots (so a kill while drawing still leaves the right status) and again after them."""
        from kvbench.results.plots import write_plots

        if not self.summary:  # nothing completed: still leave valid (header-only) CSVs
            self.add_empty()
        self.meta["status"] = status
        self.meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.meta["configurations_completed"] = len(self.summary)
        self.meta["configurations_failed"] = sum(r.status != "ok" for r in self.summary)
        self.meta["engines"] = {name: e.describe() for name, e in (engines or {}).items()}
        self.meta["sdpa"]["observed"] = {
            f"{r.engine} {r.cache}": {"prefill": r.sdpa_prefill, "decode": r.sdpa_decode}
            for r in self.summary
            if r.status == "ok"
        }
        write_json(self.run_dir / "meta.json", self.meta)
        summary, steps = self.frames()
        with writing_into(self.run_dir):
            pngs = write_plots(self.run_dir, summary, steps, self.meta, self.plot_notes)
        self._plotted(pngs)
        names = ["summary.csv", "steps.csv", "meta.json"]
        return [self.run_dir / n for n in names] + pngs

    def _plotted(self, pngs: list[Path]) -> None:
        """meta.json again, now with the plots drawn (and those not drawn, with the reason)."""
        self.meta["plots"] = [p.name for p in pngs]
        if self.plot_notes:
            self.meta["plots_not_drawn"] = self.plot_notes
        write_json(self.run_dir / "meta.json", self.meta)

    def add_empty(self) -> None:
        from kvbench.bench.sweep import StepRow, SummaryRow

        write_csv(self.run_dir / "summary.csv", SummaryRow.columns(), [])
        write_csv(self.run_dir / "steps.csv", StepRow.columns(), [])

    def json_doc(self) -> dict:
        rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(r).items()}
                for r in self.summary]  # fmt: skip
        return {"run_dir": str(self.run_dir), "meta": self.meta, "summary": rows}


# --- bench --fill random: decode cost against context --------------------------------------------------------------
class ContextRecorder(BenchRecorder):
    """The run folder of a random-fill context sweep: summary.csv (one row per context x cache, with its `fill`),
    steps.csv and meta.json rewritten as rows complete, context.png at the end or on interruption."""

    def __init__(
        self, run_dir: Path, loaded, device, dtype, settings, config_path, bandwidth, crossover
    ) -> None:
        from kvbench.bench.context import FILL_NOTE

        self._start(run_dir, loaded, device, dtype, settings, config_path)
        self.meta.update(
            fill="random",
            fill_note=FILL_NOTE,
            timing=(
                "per context x cache: --warmup untimed runs then --repeats timed runs, each one resets the caches, "
                "fills them to the context and times --new-tokens decode steps (forward + argmax, the device "
                "synchronised around each); medians and percentiles over every timed step"
            ),
            floor=floor_meta(bandwidth),
            crossover_context=crossover,
            crossover_note=(
                "the context at which attention's K/V read equals the weight read (floor.crossover_context): "
                "past it, reading the cache is most of a decode step"
            ),
        )
        write_json(self.run_dir / "meta.json", self.meta)

    def add(self, result) -> None:
        from kvbench.bench.context import ContextRow, ContextStepRow

        self.summary.append(result.summary)
        self.steps.extend(result.steps)
        write_csv(self.run_dir / "summary.csv", ContextRow.columns(), self.summary)
        write_csv(self.run_dir / "steps.csv", ContextStepRow.columns(), self.steps)

    def add_empty(self) -> None:
        from kvbench.bench.context import ContextRow, ContextStepRow

        write_csv(self.run_dir / "summary.csv", ContextRow.columns(), [])
        write_csv(self.run_dir / "steps.csv", ContextStepRow.columns(), [])

    def finish(self, status: str, engines: dict | None = None) -> list[Path]:
        """The final meta.json, then context.png from whatever completed, then meta.json again."""
        import pandas as pd

        from kvbench.bench.context import ContextRow
        from kvbench.results.plots import write_context_plots

        if not self.summary:
            self.add_empty()
        self.meta["status"] = status
        self.meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.meta["configurations_completed"] = len(self.summary)
        self.meta["configurations_failed"] = sum(r.status != "ok" for r in self.summary)
        write_json(self.run_dir / "meta.json", self.meta)
        summary = pd.DataFrame([asdict(r) for r in self.summary], columns=ContextRow.columns())
        with writing_into(self.run_dir):
            pngs = write_context_plots(self.run_dir, summary, self.meta)
        self._plotted(pngs)
        return [self.run_dir / n for n in ("summary.csv", "steps.csv", "meta.json")] + pngs
