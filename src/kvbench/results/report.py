"""What a bench run records in its folder (results/rundir.py): meta.json at the start, summary.csv and steps.csv
rewritten as each configuration completes, and the plots plus a final meta.json at the end or on interruption.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench import __version__
from kvbench.bench import hugepages
from kvbench.bench.backends import sdpa_settings
from kvbench.bench.context import FILL_NOTE, ContextDistortionRow, ContextRow, ContextStepRow
from kvbench.bench.profile import OpRow
from kvbench.bench.rows import DistortionRow, StepRow, SummaryRow
from kvbench.bench.settings import settings_dict
from kvbench.bench.sweep import fill_relative
from kvbench.bench.tp import RankRow
from kvbench.check.distortion import REFERENCE_CACHE, weights_note
from kvbench.devices import cpu_peak_resettable, device_name, dtype_name
from kvbench.jsonio import SCHEMA_VERSION
from kvbench.outputs import writing_into
from kvbench.results.environment import cpu_facts, cuda_facts, git_revision, load_average, operator_facts
from kvbench.results.rundir import write_csv, write_json
from kvbench.rows import CsvRow


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "kvbench": __version__}
    for pkg in ("torch", "transformers", "numpy", "pandas", "matplotlib"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    for pkg in PEER_PACKAGES:  # the peer engines' packages, where installed (a peer row names what ran it)
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    out["cuda"] = torch.version.cuda
    out["torch_threads"] = str(torch.get_num_threads())
    return out


PEER_PACKAGES = ("ctranslate2", "llama_cpp_python", "gguf")


def meta_doc(**fields: Any) -> dict[str, Any]:
    """The common header of meta.json: command line, git revision, versions, host; plus the caller's fields."""
    return {
        "schema_version": SCHEMA_VERSION,
        "command": shlex.join(["kvbench", *sys.argv[1:]]),  # as typed (argv[0] normalised to `kvbench`)
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_revision(),
        "versions": versions(),
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            **cpu_facts(),  # model, cores usable, load average at the start (results/environment.py)
            "huge_pages": hugepages.status(),
        },
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
    "x_floor_paired holds each timed run's steps to the read bandwidth measured just before and after that run "
    "(the mean of the two, per run in paired_read_gbps; CPU only) and reports the median step: on a machine whose "
    "bandwidth moves within a run "
    "it is the one to read. floor.steps below breaks each row's bytes down."
)


DISTORTION_NOTE = (
    f"each lossy cache's row against the full-precision {REFERENCE_CACHE} cache, both fed the same tokens: the "
    "prompt (--fill random: the same random K/V, then one seeded random token), then at every step the token the "
    f"full-precision path chose. kl: KL(p_{REFERENCE_CACHE} || p_lossy) of the next-token distributions in nats; "
    "top1_agreement: the same top token; abs_dp: |change| in the probability of the full-precision path's token; "
    "depth: the tokens a step reads. Untimed, after the row's timed runs; per token in distortion.csv, by "
    "power-of-two depth bins here"
)


def floor_meta(bandwidth) -> dict:
    return {"bandwidth": bandwidth.as_dict(), "note": FLOOR_NOTE, "steps": {}}


def device_label(device) -> str:
    """`cpu`, `cuda`, `cuda:1`: the device as rows and meta.json name it."""
    return device.type if device.index is None else f"{device.type}:{device.index}"


def run_meta(loaded, device, dtype, settings, config_path) -> dict[str, Any]:
    """The meta.json fields every run folder starts with: the run, the model, the device (status `running`), on
    CUDA the device's other processes and clocks. Also what `bench --baseline` checks against the baseline before
    the sweep."""
    meta = meta_doc(
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
    if device.type == "cuda":
        meta["host"]["cuda"] = cuda_facts(device)
    if device.type == "cpu" and settings.compile == "max":
        meta["host"].update(operator_facts())
    return meta


@dataclass
class TTFTRow(CsvRow):
    """One timed repeat's time to first token (prefill + first token), as ttft.csv holds it."""

    engine: str
    cache: str
    prompt_len: int
    batch: int
    repeat: int  # 1..repeats (timed runs only), as in steps.csv
    ttft_ms: float


class BenchRecorder:
    """A bench run directory: meta.json at the start, summary.csv and steps.csv rewritten (atomically) each time a
    configuration completes, and the plots plus a final meta.json at the end or on interruption."""

    def _start(self, run_dir: Path, loaded, device, dtype, settings, config_path) -> None:
        """The fields every run folder shares: the run, the model, the device."""
        self.run_dir = run_dir
        self.dtype = dtype_name(dtype)
        self.device_label = device_label(device)
        self.summary: list = []
        self.steps: list = []
        self.ttfts: list[TTFTRow] = []
        self.percentiles = list(getattr(settings, "percentiles", ()))  # the tpot_ms_pNN columns (SummaryRow)
        self.distortion_rows: list = []  # each lossy row's tokens (distortion.csv)
        self.plot_notes: list[str] = []  # plots not drawn, and why (finish)
        self.meta = run_meta(loaded, device, dtype, settings, config_path)

    def __init__(
        self, run_dir: Path, loaded, device, dtype, settings, config_path, bandwidth=None, extra_meta=None
    ) -> None:
        self._start(run_dir, loaded, device, dtype, settings, config_path)
        self.profile_ops: list[OpRow] = []  # --profile: every configuration's top operators (profile_ops.csv)
        self.tp_rows: list[RankRow] = []  # --tp: every rank's row of every configuration (tp.csv)
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
        self.summary.append(result.summary)
        self.steps.extend(result.steps)
        r = result.summary
        self.ttfts += [
            TTFTRow(r.engine, r.cache, r.prompt_len, r.batch, i + 1, t) for i, t in enumerate(result.ttft_ms)
        ]
        fill_relative(self.summary)
        if result.floor_bytes is not None and "floor" in self.meta:
            key = f"{r.engine} {r.cache} prompt {r.prompt_len} batch {r.batch}"
            self.meta["floor"]["steps"][key] = result.floor_bytes.as_dict()
            if result.run_gbps:  # the read bandwidth beside each timed run (x_floor_paired)
                self.meta["floor"].setdefault("paired_read_gbps", {})[key] = [round(g, 2) for g in result.run_gbps]
            if result.bandwidth is not None and result.bandwidth is not self.bandwidth:
                rounds = self.meta["floor"].setdefault("by_prompt_len", {})  # interleaved: probed every round
                swept = len(self.meta["settings"].get("batch", [])) > 1
                rounds[f"{r.prompt_len} batch {r.batch}" if swept else str(r.prompt_len)] = result.bandwidth.as_dict()
        self.tp_rows += result.ranks or []
        self._write_bench_csvs()
        if result.profile is not None:
            self._add_profile(r, result.profile)
        if result.distortion is not None:
            self.distortion_rows += [
                DistortionRow(r.engine, r.cache, r.prompt_len, r.batch, i + 1, *step)
                for i, step in enumerate(_steps(result.distortion))
            ]
        self._add_distortion(result, r.distortion_key(), DistortionRow)

    def _add_distortion(self, result, key: str, row_type) -> None:
        """A lossy row's distortion: its depth bins and bytes in meta.json (or why it was not measured), its tokens
        in distortion.csv, rewritten now."""
        if result.distortion is None and not result.distortion_failed:
            return
        meta = self.meta.setdefault(
            "distortion",
            {"note": weights_note(bool(self.meta.get("random_weights"))), "definition": DISTORTION_NOTE, "rows": {}},
        )
        if result.distortion is None:
            meta.setdefault("not_measured", {})[key] = result.distortion_failed
        else:
            d = result.distortion.as_dict()
            meta["rows"][key] = {k: v for k, v in d.items() if k not in ("per_step", "note")}
        write_csv(self.run_dir / "distortion.csv", row_type.columns(), self.distortion_rows)

    def _add_profile(self, r, profiled) -> None:
        """--profile: the configuration's trace listed in meta.json, its top operators added to profile_ops.csv."""
        self.profile_ops.extend(profiled.ops)
        key = f"{r.engine} {r.cache} prompt {r.prompt_len} batch {r.batch}"
        self.meta.setdefault("profiles", {})[key] = str(profiled.trace.relative_to(self.run_dir))
        write_csv(self.run_dir / "profile_ops.csv", OpRow.columns(), self.profile_ops)
        write_json(self.run_dir / "meta.json", self.meta)

    def _write_bench_csvs(self) -> None:
        write_csv(
            self.run_dir / "summary.csv",
            SummaryRow.columns(self.percentiles),
            [r.record() for r in self.summary],
        )
        write_csv(self.run_dir / "steps.csv", StepRow.columns(), self.steps)
        write_csv(self.run_dir / "ttft.csv", TTFTRow.columns(), self.ttfts)
        if "tp" in self.meta:
            write_csv(self.run_dir / "tp.csv", RankRow.columns(), self.tp_rows)

    def frames(self):
        import pandas as pd  # with the plots: a command refused before any work does not load it

        summary = pd.DataFrame([r.record() for r in self.summary], columns=SummaryRow.columns(self.percentiles))
        # column by column: a long sweep has millions of steps, and asdict per row would take a minute
        steps = pd.DataFrame({c: [getattr(r, c) for r in self.steps] for c in StepRow.columns()})
        return summary, steps

    def finish(self, status: str, engines: dict | None = None) -> list[Path]:
        """Write the final meta.json and the plots from whatever completed; returns the files written. meta.json is
        written before the plots (so a kill while drawing still leaves the right status) and again after them."""
        from kvbench.results import plots  # matplotlib, only when a run draws its plots

        self._close(status)
        self.meta["engines"] = {name: e.describe() for name, e in (engines or {}).items()}
        self.meta["sdpa"]["observed"] = {
            f"{r.engine} {r.cache}": {"prefill": r.sdpa_prefill, "decode": r.sdpa_decode}
            for r in self.summary
            if r.status == "ok"
        }
        write_json(self.run_dir / "meta.json", self.meta)
        summary, steps = self.frames()
        with writing_into(self.run_dir):
            pngs = plots.write_plots(self.run_dir, summary, steps, self.meta, self.plot_notes)
            pngs += self._distortion_plot()
        self._plotted(pngs)
        names = ["summary.csv", "steps.csv", "ttft.csv", "meta.json"] + (
            ["profile_ops.csv", "profile"] if self.profile_ops else []
        )
        names += ["tp.csv"] if "tp" in self.meta else []
        return [self.run_dir / n for n in names] + self._distortion_csv() + pngs

    def _distortion_csv(self) -> list[Path]:
        return [self.run_dir / "distortion.csv"] if (self.run_dir / "distortion.csv").exists() else []

    def _distortion_plot(self) -> list[Path]:
        """distortion.png, when a lossy row was measured (results/distortion_plot.py)."""
        if not self.distortion_rows:
            return []
        import pandas as pd

        from kvbench.results.distortion_plot import distortion_figure

        frame = pd.DataFrame([asdict(r) for r in self.distortion_rows])
        return [distortion_figure(frame, self.meta, self.run_dir / "distortion.png")]

    def _close(self, status: str) -> None:
        """The run's end in meta.json: its status, when, what completed, the load average now."""
        if not self.summary:  # nothing completed: still leave valid (header-only) CSVs
            self.add_empty()
        self.meta["status"] = status
        self.meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.meta["configurations_completed"] = len(self.summary)
        self.meta["configurations_failed"] = sum(r.status != "ok" for r in self.summary)
        if isinstance(self.meta.get("host", {}).get("load_average"), dict):
            self.meta["host"]["load_average"]["end"] = load_average()

    def _plotted(self, pngs: list[Path]) -> None:
        """meta.json again, now with the plots drawn (and those not drawn, with the reason)."""
        self.meta["plots"] = [p.name for p in pngs]
        if self.plot_notes:
            self.meta["plots_not_drawn"] = self.plot_notes
        write_json(self.run_dir / "meta.json", self.meta)

    def add_empty(self) -> None:
        self._write_bench_csvs()

    def json_doc(self) -> dict:
        """The --json document: summary.csv's rows with its columns, empty cells as null (an oom or error row's
        tpot_ms_pNN included), and under --tp tp.csv's rows."""
        rows = [_nulls(self._columns(r.record())) for r in self.summary]
        doc = {
            "schema_version": SCHEMA_VERSION,
            "run_dir": str(self.run_dir),
            "meta": self.meta,
            "summary": rows,
        }
        if "tp" in self.meta:  # tp.csv's rows
            doc["tp"] = [_nulls(asdict(r)) for r in self.tp_rows]
        return doc

    def _columns(self, record: dict) -> dict:
        """A summary row as summary.csv has it: every column, in its order (NaN where the row has no value)."""
        names = SummaryRow.columns(self.percentiles)
        if not set(record) <= set(names):  # another kind of row (--fill random's): its own keys
            return record
        return {c: record.get(c, math.nan) for c in names}


def _nulls(record: dict) -> dict:
    """A CSV row for JSON: NaN (an empty cell) as null."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}


# --- bench --fill random: decode cost against context --------------------------------------------------------------
class ContextRecorder(BenchRecorder):
    """The run folder of a random-fill context sweep: summary.csv (one row per context x cache, with its `fill`),
    steps.csv and meta.json rewritten as rows complete, context.png at the end or on interruption."""

    def __init__(self, run_dir: Path, loaded, device, dtype, settings, config_path, bandwidth, crossover) -> None:
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
        self.summary.append(result.summary)
        self.steps.extend(result.steps)
        write_csv(self.run_dir / "summary.csv", ContextRow.columns(), self.summary)
        write_csv(self.run_dir / "steps.csv", ContextStepRow.columns(), self.steps)
        r = result.summary
        if result.distortion is not None:
            self.distortion_rows += [
                ContextDistortionRow(r.cache, r.context, r.batch, i + 1, *step)
                for i, step in enumerate(_steps(result.distortion))
            ]
        self._add_distortion(result, r.distortion_key(), ContextDistortionRow)

    def add_empty(self) -> None:
        write_csv(self.run_dir / "summary.csv", ContextRow.columns(), [])
        write_csv(self.run_dir / "steps.csv", ContextStepRow.columns(), [])

    def finish(self, status: str, engines: dict | None = None) -> list[Path]:
        """The final meta.json, then context.png from whatever completed, then meta.json again."""
        import pandas as pd  # with the plots: a command refused before any work does not load it

        from kvbench.results import context_plot  # matplotlib, only when a run draws its plots

        self._close(status)
        write_json(self.run_dir / "meta.json", self.meta)
        summary = pd.DataFrame([asdict(r) for r in self.summary], columns=ContextRow.columns())
        with writing_into(self.run_dir):
            pngs = context_plot.write_context_plots(self.run_dir, summary, self.meta)
            pngs += self._distortion_plot()
        self._plotted(pngs)
        names = ("summary.csv", "steps.csv", "meta.json")
        return [self.run_dir / n for n in names] + self._distortion_csv() + pngs


def _steps(d) -> list[tuple]:
    """A Distortion's steps as (depth, kl, top1_agreement, abs_dp), each averaged over the sequences."""
    s = d.per_step
    return list(zip(s["depth"], s["kl"], s["top1"], s["abs_dp"], strict=True))
