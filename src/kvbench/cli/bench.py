"""`kvbench bench`: no cache vs each cache vs transformers, TTFT/TPOT/memory, written as the sweep runs.

The command gathers its options into one BenchOptions and dispatches on the mode: a prefill sweep of our GPT-2, the
same sweep of a Hugging Face model (--hf), or decode steps over random-filled caches (--fill random). Every mode
makes each check that needs no weights before loading anything, and creates the run folder only once every check
has passed. With --tp N (N > 1) the command checks, then launches N ranks of itself (kvbench.tp_command), or runs
as one when started by torchrun: every rank runs the sweep on its shard, rank 0 writes the run folder and reports.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvbench import console
from kvbench.bench.endpoint_settings import EndpointOptions, given_endpoint_options
from kvbench.bench.settings import BenchSettings
from kvbench.cli.app import Given, Terminated, command, load_for_cli  # noqa: F401  (Terminated: tests raise it)
from kvbench.cli.bench_options import BenchOptions
from kvbench.cli.bench_progress import _BenchProgress, run_recorded  # noqa: F401  (_BenchProgress: tests patch it)
from kvbench.cli.bench_render import render_bench, render_context, render_profile
from kvbench.console import err
from kvbench.errors import KVBenchError
from kvbench.results.rundir import check_baseline_apart, check_export_target

if TYPE_CHECKING:
    import torch

    from kvbench.bench.hf_sweep import BenchLoaded
    from kvbench.bench.tp import Ranks
    from kvbench.model.weights import LoadedModel
    from kvbench.tp_command import Split


@dataclass
class Prepared:
    """A prefill sweep ready to run: its checked settings, the run folder to create, the model as the sweep and the
    recorder read it, its engines, the warnings to print once the folder is claimed, and meta.json additions."""

    settings: BenchSettings
    out_dir: Path
    loaded: LoadedModel | BenchLoaded
    device: torch.device
    dtype: torch.dtype
    engines: dict
    notes: list[str]
    extra_meta: dict | None
    oversized: dict[int, str]  # batch sizes predicted not to fit the device: `oom` rows, not run
    ranks: Ranks | None = None  # bench --tp: this rank's part of the sweep (bench/tp.py); None in one process

    def __post_init__(self) -> None:
        if self.ranks is not None:  # each engine runs as this rank's part of the sweep
            self.engines = self.ranks.engines(self.engines)


@command(Given(BenchSettings), BenchOptions, EndpointOptions)
def bench(given: dict, opts: BenchOptions, ep: EndpointOptions) -> None:
    """Measure no cache vs each cache vs transformers: TTFT, TPOT, its bandwidth floor, memory, token agreement.

    With --hf SOURCE: transformers' own caches (none, dynamic, static, static-compiled) on any Hugging Face causal
    LM, in the same rows and files, its tokens checked against its own none. With --endpoint URL: a running
    OpenAI-compatible server's TTFT, TPOT, ITL and throughput per --concurrency level, cold vs warm TTFT."""
    from kvbench import distributed, tp_command
    from kvbench.results.rundir import check_export

    if ep.endpoint is not None:
        from kvbench.cli.bench_endpoint import bench_endpoint

        return bench_endpoint(opts, given, ep)
    without = given_endpoint_options(ep)
    if without:
        raise KVBenchError(f"{without[0]} applies to --endpoint only (a running server's serving latency)")
    opts.given = given
    opts.export = check_export(opts.export)  # a bad format or file is refused before the run starts
    base_run = _baseline_run(opts)
    if opts.hf is not None:
        checked = _hf_checked(opts)
        settings, out_dir = checked[0], checked[1]
    else:
        settings, out_dir = _gpt2_settings(opts)
    launches = distributed.role(settings.tp).launches  # a --tp that torchrun did not launch is refused
    split = _split(opts, settings)
    if launches:
        raise typer.Exit(tp_command.launch(split, sys.argv[1:]))  # the ranks have reported
    rank = tp_command.join(split)  # this process as one rank: what cannot be split is refused first
    if opts.hf is not None:
        prefill_sweep(opts, _prepare_hf(opts, checked, rank), base_run)
    elif settings.fill == "random":
        random_fill_sweep(opts, settings, out_dir)
    else:
        prefill_sweep(opts, _load_gpt2(settings, out_dir, rank), base_run)


def _split(opts: BenchOptions, settings: BenchSettings) -> Split:
    """What this sweep splits over --tp ranks: our GPT-2 (the sweep's model config) or --hf's model."""
    from kvbench.tp_command import Split

    at = (settings.tp, settings.device, settings.tp_timeout)
    if opts.hf is not None:
        return Split(*at, hf=opts.hf, trust_remote_code=opts.trust_remote_code)
    if settings.tp == 1:  # nothing to split: the model runs whole in this process
        return Split(*at)
    from kvbench.bench.settings import sweep_model_config

    return Split(*at, config=sweep_model_config(settings))


def _baseline_run(opts: BenchOptions):
    """--baseline's run, read before anything else (a bad folder fails now, not after the sweep); None without it."""
    if opts.baseline is not None:
        from kvbench.results.runs import load_run

        return load_run(opts.baseline, "--baseline")
    if opts.allow_env_change:
        raise KVBenchError("--allow-env-change applies to --baseline only (it allows comparing across environments)")
    return None


def _hf_checked(opts: BenchOptions) -> tuple:
    """--hf: the same checks that need no model as for our GPT-2 (cli/hf.py), the baseline kept apart from --out.
    Returns (settings, the run folder to create, device, dtype)."""
    from kvbench.cli.hf import check_bench_hf

    checked = check_bench_hf(opts.config, opts.given, opts.force)
    check_baseline_apart(opts.baseline, checked[1])
    check_export_target(opts.export, checked[1])
    return checked


def _prepare_hf(opts: BenchOptions, checked: tuple, rank=None) -> Prepared:
    """--hf: the same folder, sweep and files as for our GPT-2; the model and its engine from cli/hf.py (under --tp
    this rank's shard, split by transformers' plan)."""
    from kvbench.cli.hf import prepare_bench_hf

    assert opts.hf is not None, "--hf given"
    return Prepared(*prepare_bench_hf(opts.hf, checked, opts.layers, opts.trust_remote_code, rank))


def _gpt2_settings(opts: BenchOptions) -> tuple[BenchSettings, Path]:
    """Our GPT-2's sweep: the --hf options refused, then every check that needs no weights (_validated), and the
    baseline kept apart from --out. Returns (settings, the run folder to create)."""
    from kvbench import validate

    validate.only_with_hf(
        opts.hf, **{"--trust-remote-code": opts.trust_remote_code, "--layers": opts.layers is not None}
    )
    settings, out_dir = _validated(opts.config, opts.given, opts.force)
    check_baseline_apart(opts.baseline, out_dir)
    check_export_target(opts.export, out_dir)
    return settings, out_dir


def _load_gpt2(settings: BenchSettings, out_dir: Path, rank=None) -> Prepared:
    """Load our GPT-2, check the sweep against the checkpoint's own shape (when --weights is a folder), build the
    engines. `rank`: this process is one rank of a tensor-parallel group (kvbench.distributed.Rank): the model is
    loaded on the rank's device and the engine runs this rank's shard of it (model/tp.py)."""
    from dataclasses import replace

    from kvbench.bench.engines import build_engines
    from kvbench.bench.settings import check_sizes, sweep_warnings

    device = settings.device if rank is None else str(rank.device)
    loaded, dev, dt = load_for_cli(settings.model, settings.weights, device, settings.dtype, settings.seed)
    oversized = check_sizes(settings, loaded.config, dt, dev, weights_loaded=True)
    ranks = None
    if rank is not None:  # the whole model gives way to this rank's shard
        from kvbench.bench.tp import GPT2Ranks
        from kvbench.model.tp import shard

        loaded = replace(loaded, model=shard(loaded.model, rank.rank, rank.world))
        ranks = GPT2Ranks(rank, dt, loaded.config)
    engines = build_engines(loaded.model, settings.engine, settings.compile)
    notes = sweep_warnings(settings)
    return Prepared(settings, out_dir, loaded, dev, dt, engines, notes, None, oversized, ranks)


def prefill_sweep(opts: BenchOptions, p: Prepared, base_run) -> None:
    """Plan, check the baseline against the plan, measure the bandwidth, then claim the run folder and run the sweep,
    writing rows as they complete; exit 1 when a configuration failed."""
    from kvbench.bench import sweep as B
    from kvbench.results import report
    from kvbench.results.rundir import claimed_run_dir

    config_path, extra_meta = _planned(opts, p, base_run)
    if p.ranks is not None and not p.ranks.reports:  # another rank: the same sweep, in step, writing nothing
        from kvbench.devices import dtype_name

        B.run_sweep(
            p.loaded.model,
            p.settings,
            dtype_name(p.dtype),
            report.device_label(p.device),
            engines=p.engines,
            oversized=p.oversized,
        )
        return
    # no floor under tensor parallelism (a rank's step is not one device's stream of the whole model)
    bandwidth = measure_bandwidth(p.device) if p.ranks is None else None
    # only now: a rejected command leaves no folder behind
    with claimed_run_dir(p.out_dir, opts.force) as run_dir:
        for note in p.notes:  # after every error that could still stop the command
            console.warn(note)
        recorder = report.BenchRecorder(
            run_dir, p.loaded, p.device, p.dtype, p.settings, config_path, bandwidth, extra_meta
        )
        files = run_recorded(
            recorder,
            lambda progress: B.run_sweep(
                p.loaded.model,
                p.settings,
                recorder.dtype,
                recorder.device_label,
                on_result=recorder.add,
                on_progress=progress,
                engines=p.engines,
                bandwidth=bandwidth,
                oversized=p.oversized,
                profile_dir=run_dir / "profile",
            ),
            p.engines,
        )
        _show_bench(opts, recorder, run_dir, files)
    export_rows(opts.export, recorder.summary)
    _exit_if_failed(recorder.summary, lambda r: f"{r.engine} {r.cache} prompt {r.prompt_len} batch {r.batch}")


def _planned(opts: BenchOptions, p: Prepared, base_run) -> tuple[Path | None, dict]:
    """(the config file, meta.json's additions with the configurations planned); the whole baseline check before the
    sweep: the same identity, rows in common."""
    from kvbench.bench.settings import resolve_config_path
    from kvbench.bench.sweep import plan
    from kvbench.results import report

    # a config given by name (seed) is recorded as the shipped file it stands for
    config_path = None if opts.config is None else resolve_config_path(opts.config)
    planned = plan(p.settings, p.engines)
    extra_meta = {
        **(p.extra_meta or {}),
        "configurations_planned": [{"engine": e, "cache": c, "prompt_len": n, "batch": b} for n, b, e, c in planned],
        **({"tp": p.ranks.meta()} if p.ranks is not None else {}),
    }
    if base_run is not None:
        from kvbench.results.compare import check_baseline

        meta = {**report.run_meta(p.loaded, p.device, p.dtype, p.settings, config_path), **extra_meta}
        check_baseline(base_run, meta, [(e, c, n, b) for n, b, e, c in planned], opts.allow_env_change)
    return config_path, extra_meta


def _show_bench(opts: BenchOptions, recorder, run_dir, files: list[Path]) -> None:
    """The bench table (or --json document), then the comparison with --baseline."""
    if opts.json_out:
        print_bench_json(recorder, opts.baseline, run_dir, opts.allow_env_change)
        return
    render_bench(recorder.summary, recorder.meta, run_dir, files, recorder.tp_rows)
    if recorder.profile_ops:
        render_profile(recorder.profile_ops)
    if opts.baseline is not None:  # the bench table is out first, whatever the comparison says
        from kvbench.cli.compare import render_compare, run_compare

        comparison, compare_files = run_compare(opts.baseline, run_dir, allow_env_change=opts.allow_env_change)
        render_compare(comparison, [], compare_files)


def print_bench_json(recorder, baseline, run_dir, allow_env_change: bool) -> None:
    """--json: the bench document, with the comparison as its `compare` member when there is a baseline. A
    comparison that still fails after the sweep prints the bench document first, then its one-line error."""
    doc = recorder.json_doc()
    if baseline is not None:
        from kvbench.cli.compare import run_compare
        from kvbench.results.compare import json_doc

        try:
            comparison, compare_files = run_compare(baseline, run_dir, allow_env_change=allow_env_change)
        except KVBenchError:
            console.print_json(doc)
            raise
        doc["compare"] = json_doc(comparison, [], compare_files)
    console.print_json(doc)


def random_fill_sweep(opts: BenchOptions, settings: BenchSettings, out_dir: Path) -> None:
    """`--fill random`: load, measure the bandwidth, then time every (context, cache) on caches filled with random
    K/V (bench/context.py), writing rows as they complete; exit 1 when a configuration failed."""
    import torch

    from kvbench.bench import floor
    from kvbench.bench.context import run_context_sweep
    from kvbench.bench.settings import check_sizes, resolve_config_path
    from kvbench.results import report
    from kvbench.results.rundir import claimed_run_dir

    if opts.baseline is not None:
        raise KVBenchError("--baseline compares prefill sweeps; it does not apply to --fill random")
    config_path = None if opts.config is None else resolve_config_path(opts.config)
    loaded, dev, dt = load_for_cli(settings.model, settings.weights, settings.device, settings.dtype, settings.seed)
    check_sizes(settings, loaded.config, dt, dev, weights_loaded=True)  # the checkpoint's own shape
    bandwidth = measure_bandwidth(dev)
    elt = torch.empty((), dtype=dt).element_size()
    crossover = floor.crossover_context(loaded.config, elt, settings.batch[0])
    # only now: a rejected command leaves no folder behind
    with claimed_run_dir(out_dir, opts.force) as run_dir:
        recorder = report.ContextRecorder(run_dir, loaded, dev, dt, settings, config_path, bandwidth, crossover)
        files = run_recorded(
            recorder,
            lambda progress: run_context_sweep(
                loaded.model,
                settings.caches,
                settings.prompt_len,
                settings.new_tokens,
                settings.repeats,
                settings.warmup,
                settings.batch[0],
                bandwidth,
                recorder.dtype,
                recorder.device_label,
                seed=settings.seed,
                on_result=recorder.add,
                on_progress=progress,
                compile=settings.compile,
            ),
        )
    if opts.json_out:
        console.print_json(recorder.json_doc())
    else:
        render_context(recorder.summary, recorder.meta, run_dir, files)
    export_rows(opts.export, recorder.summary)
    _exit_if_failed(recorder.summary, lambda r: f"{r.cache} context {r.context}")


def export_rows(export, rows: list) -> None:
    """--export: the finished sweep's ok rows, in the chosen format; a note names the file and the rows left out."""
    if export is None:
        return
    from kvbench.results.rundir import write_export

    path, n, skipped = write_export(export, rows)
    left = f"; left out (not ok): {', '.join(skipped)}" if skipped else ""
    console.note(f"--export {export[0]}: {n} entries written to {path}{left}")


def _exit_if_failed(rows: list, label) -> None:
    """Exit 1 when any configuration failed: its rows are kept in summary.csv with their error."""
    failed = [r for r in rows if r.status.startswith("error")]
    if failed:
        console.error(
            f"{len(failed)} configuration(s) failed and were recorded with their error in summary.csv "
            f"(first: {label(failed[0])}: {failed[0].status})"
        )
        raise typer.Exit(1)


def measure_bandwidth(device):
    """The device's read bandwidth, once per run, before the run folder exists (an interruption here leaves none)."""
    from kvbench.bench import floor

    with err.status("measuring the device's read bandwidth (the floor of every row)"):
        return floor.measure_bandwidth(device)


def _validated(config, given: dict, force: bool):
    """Every check that needs no weights, before anything is loaded, allocated or created on disk:
    (settings, the run folder to create)."""
    from kvbench.bench.settings import check_sizes, load_settings, sweep_model_config
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.results.rundir import check_run_dir, unique_default_run_dir

    settings = load_settings(config, given)
    default = str(unique_default_run_dir("bench"))
    out_dir = check_run_dir(settings.out if settings.out is not None else default, force)
    dev = resolve_device(settings.device)
    dt = resolve_dtype(settings.dtype, dev)
    check_sizes(settings, sweep_model_config(settings), dt, dev)
    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    return settings, out_dir
