"""`kvbench bench`: no cache vs each cache vs transformers, TTFT/TPOT/memory, written as the sweep runs."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from kvbench import console
from kvbench.cli.app import (
    COMPILE_HELP,
    DeviceOpt,
    JsonOpt,
    ModelOpt,
    SeedOpt,
    WeightsOpt,
    app,
    handle_errors,
    load_for_cli,
)
from kvbench.cli.bench_render import render_bench, render_context
from kvbench.cli.hf import HFOpt, LayersOpt, TrustOpt
from kvbench.console import err
from kvbench.errors import KVBenchError


@app.command()
@handle_errors
def bench(
    prompt_len: Annotated[
        str | None,
        typer.Option(
            "--prompt-len",
            help="Prompt lengths (with --fill random: contexts) to sweep, comma-separated; a k suffix is x1024, "
            "e.g. 256,1k,4k,16k (default: 16,128,512).",
        ),
    ] = None,
    new_tokens: Annotated[
        int | None, typer.Option("--new-tokens", help="Tokens generated per run (default: 400).")
    ] = None,
    caches: Annotated[
        str | None,
        typer.Option(
            "--caches",
            help="Comma-separated cache names, or 'all' (default: all registered). With --hf: none, dynamic, "
            "static, static-compiled.",
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="kvbench, hf (transformers' generate, eager), hf-compiled (its static cache with its default "
            "torch.compile), comma-separated (default: kvbench,hf).",
        ),
    ] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="Sequences per run (default: 1).")] = None,
    repeats: Annotated[
        int | None, typer.Option("--repeats", help="Timed runs per configuration (default: 3).")
    ] = None,
    warmup: Annotated[
        int | None,
        typer.Option(
            "--warmup", help="Runs before the timed ones; the first is reported as cold (default: 1)."
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="A TOML sweep (configs/bench/) or a shipped one by name (seed, quick)."
        ),
    ] = None,
    out: Annotated[
        str | None, typer.Option("--out", "-o", help="Run folder (default: results/<timestamp>-bench/).")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the bench files of an earlier run in --out.")
    ] = False,
    model: ModelOpt = None,
    weights: WeightsOpt = None,
    device: DeviceOpt = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="fp32 | fp16 | bf16 | auto (fp16 on CUDA, fp32 on CPU).")
    ] = None,
    seed: SeedOpt = None,
    threads: Annotated[
        int | None,
        typer.Option("--threads", help="torch CPU threads (default: torch's default: one per core)."),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            "--baseline",
            help="A previous run folder: compare this run against it when the sweep ends (as kvbench compare).",
        ),
    ] = None,
    allow_env_change: Annotated[
        bool,
        typer.Option(
            "--allow-env-change",
            help="With --baseline: compare even though the baseline ran on another device, dtype or library "
            "versions (the changes are printed).",
        ),
    ] = False,
    fill: Annotated[
        str | None,
        typer.Option(
            "--fill",
            help="prefill (default): a real prefill fills the cache, TTFT and decode timed. random: caches filled "
            "with random K/V to each --prompt-len without a prefill, only decode timed (long contexts: -m gpt2-long).",
        ),
    ] = None,
    order: Annotated[
        str | None,
        typer.Option(
            "--order",
            help="sequential (default): each configuration's runs back to back. interleaved: cold and warm-up runs "
            "back to back, then the timed runs in rounds over every configuration of a prompt length, so drift on "
            "a shared machine hits every row alike (rows are written when the prompt length's rounds end).",
        ),
    ] = None,
    compile: Annotated[str | None, typer.Option("--compile", help=COMPILE_HELP + " Default: off.")] = None,
    json_out: JsonOpt = False,
    hf: HFOpt = None,
    trust_remote_code: TrustOpt = False,
    layers: LayersOpt = None,
) -> None:
    """Measure no cache vs each cache vs transformers: TTFT, TPOT, its bandwidth floor, memory, token agreement.

    With --hf SOURCE: transformers' own caches (none, dynamic, static, static-compiled) on any Hugging Face causal
    LM, in the same rows and files, its tokens checked against its own none."""
    from kvbench.bench import sweep as B
    from kvbench.results import report

    base_run = None
    if baseline is not None:
        from kvbench.results.runs import load_run

        base_run = load_run(baseline, "--baseline")  # a bad folder fails now, not after the sweep
    elif allow_env_change:
        raise KVBenchError(
            "--allow-env-change applies to --baseline only (it allows comparing across environments)"
        )

    overrides = dict(
        prompt_len=prompt_len, new_tokens=new_tokens, caches=caches, engine=engine, batch=batch, repeats=repeats,
        warmup=warmup, model=model, weights=weights, device=device, dtype=dtype, seed=seed, threads=threads, out=out,
        fill=fill, order=order, compile=compile,
    )  # fmt: skip
    if hf is not None:  # the same checks, folder, sweep and files; the model and its engine from cli/hf.py
        from kvbench.cli.hf import prepare_bench_hf

        settings, out_dir, loaded, dev, dt, engines, notes, extra_meta = prepare_bench_hf(
            hf, config, overrides, force, layers, trust_remote_code
        )
        _check_baseline(baseline, out_dir)
    else:
        for flag, given in (("--trust-remote-code", trust_remote_code), ("--layers", layers is not None)):
            if given:
                raise KVBenchError(f"{flag} applies to --hf models only")
        settings, out_dir = _validated(config, overrides, force)
        _check_baseline(baseline, out_dir)
        if settings.fill == "random":
            if baseline is not None:
                raise KVBenchError("--baseline compares prefill sweeps; it does not apply to --fill random")
            config_path = None if config is None else B.resolve_config_path(config)
            random_fill_sweep(settings, out_dir, force, config_path, json_out)
            return
        loaded, dev, dt = load_for_cli(
            settings.model, settings.weights, settings.device, settings.dtype, settings.seed
        )
        # the checkpoint's own shape, when --weights is a folder
        B.check_sizes(settings, loaded.config, dt, dev)
        engines = B.build_engines(loaded.model, settings.engine, settings.compile)
        notes, extra_meta = B.sweep_warnings(settings), None
    # a config given by name (seed) is recorded as the shipped file it stands for
    config_path = None if config is None else B.resolve_config_path(config)
    planned = B.plan(settings, engines)
    extra_meta = {
        **(extra_meta or {}),
        "configurations_planned": [{"engine": e, "cache": c, "prompt_len": p} for p, e, c in planned],
    }
    if base_run is not None:  # the whole baseline check before the sweep: the same identity, rows in common
        from kvbench.results.compare import check_baseline

        meta = {**report.run_meta(loaded, dev, dt, settings, config_path), **extra_meta}
        check_baseline(base_run, meta, [(e, c, p) for p, e, c in planned], allow_env_change)
    bandwidth = measure_bandwidth(dev)
    # only now: a rejected command leaves no folder behind
    with report.claimed_run_dir(out_dir, force) as run_dir:
        for note in notes:  # after every error that could still stop the command
            console.warn(note)
        recorder = report.BenchRecorder(
            run_dir, loaded, dev, dt, settings, config_path, bandwidth, extra_meta
        )
        files = run_recorded(
            recorder,
            lambda progress: B.run_sweep(loaded.model, settings, recorder.dtype, recorder.device_label,
                                         on_result=recorder.add, on_progress=progress, engines=engines,
                                         bandwidth=bandwidth),
            engines,
        )  # fmt: skip
        if json_out:
            print_bench_json(recorder, baseline, run_dir, allow_env_change)
        else:
            render_bench(recorder.summary, recorder.meta, run_dir, files)
            if baseline is not None:  # the bench table is out first, whatever the comparison says
                from kvbench.cli.compare import render_compare, run_compare

                comparison, compare_files = run_compare(baseline, run_dir, allow_env_change=allow_env_change)
                render_compare(comparison, [], compare_files)
    _exit_if_failed(recorder.summary, lambda r: f"{r.engine} {r.cache} prompt {r.prompt_len}")


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


def random_fill_sweep(settings, out_dir, force: bool, config_path, json_out: bool) -> None:
    """`--fill random`: load, measure the bandwidth, then time every (context, cache) on caches filled with random
    K/V (bench/context.py), writing rows as they complete."""
    import torch

    from kvbench.bench import floor
    from kvbench.bench import sweep as B
    from kvbench.bench.context import run_context_sweep
    from kvbench.results import report

    loaded, dev, dt = load_for_cli(
        settings.model, settings.weights, settings.device, settings.dtype, settings.seed
    )
    B.check_sizes(settings, loaded.config, dt, dev, weights_loaded=True)  # the checkpoint's own shape
    bandwidth = measure_bandwidth(dev)
    elt = torch.empty((), dtype=dt).element_size()
    crossover = floor.crossover_context(loaded.config, elt, settings.batch)
    # only now: a rejected command leaves no folder behind
    with report.claimed_run_dir(out_dir, force) as run_dir:
        recorder = report.ContextRecorder(
            run_dir, loaded, dev, dt, settings, config_path, bandwidth, crossover
        )
        files = run_recorded(
            recorder,
            lambda progress: run_context_sweep(
                loaded.model, settings.caches, settings.prompt_len, settings.new_tokens, settings.repeats,
                settings.warmup, settings.batch, bandwidth, recorder.dtype, recorder.device_label,
                seed=settings.seed, on_result=recorder.add, on_progress=progress, compile=settings.compile,
            ),
        )  # fmt: skip
    if json_out:
        console.print_json(recorder.json_doc())
    else:
        render_context(recorder.summary, recorder.meta, run_dir, files)
    _exit_if_failed(recorder.summary, lambda r: f"{r.cache} context {r.context}")


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


def run_recorded(recorder, sweep, engines: dict | None = None) -> list[Path]:
    """Run `sweep(on_progress)` under a progress bar, with SIGTERM and SIGHUP handled as Ctrl-C: an interruption
    keeps every completed row, writes the plots and marks meta.json `interrupted`. Returns the files written."""
    try:
        with _signals_interrupt(), bench_progress() as progress:
            sweep(progress.update)
    except KeyboardInterrupt as e:
        with _signals_ignored():  # a second Ctrl-C or a SIGTERM now would lose the rows' plots and meta.json
            recorder.finish("interrupted", engines)
        for text in recorder.plot_notes:
            console.note(text)
        console.note(
            f"interrupted: {len(recorder.summary)} completed configuration(s) kept in {recorder.run_dir}"
        )
        if isinstance(e, Terminated):
            console.error("terminated")
            raise typer.Exit(128 + e.signum) from None
        raise
    with _signals_ignored():
        files = recorder.finish("complete", engines)
    for text in recorder.plot_notes:
        console.note(text)
    return files


def _check_baseline(baseline: Path | None, out_dir) -> None:
    """The baseline must survive the run: refused when --out (with --force) would overwrite it."""
    if baseline is not None and Path(baseline).expanduser().resolve() == Path(out_dir).expanduser().resolve():
        raise KVBenchError(
            f"--baseline and --out are the same folder ({baseline}): the run would overwrite the baseline it is "
            "compared against; write the new run elsewhere"
        )


def _validated(config, overrides: dict, force: bool):
    """Every check that needs no weights, before anything is loaded, allocated or created on disk:
    (settings, the run folder to create)."""
    from kvbench.bench import sweep as B
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.results import report

    settings = B.load_settings(config, overrides)
    default = str(report.unique_default_run_dir("bench"))
    out_dir = report.check_run_dir(settings.out if settings.out is not None else default, force)
    dev = resolve_device(settings.device)
    dt = resolve_dtype(settings.dtype, dev)
    B.check_sizes(settings, B.sweep_model_config(settings), dt, dev)
    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    return settings, out_dir


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) during a sweep: handled like Ctrl-C (rows kept, meta.json says interrupted)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _signals_interrupt():
    """While the sweep runs, SIGTERM and SIGHUP stop it the way Ctrl-C does."""
    if not _in_main_thread():  # signal handlers can only be set from the main thread
        yield
        return

    def stop(signum, frame):
        raise Terminated(signum)

    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    old = {sig: signal.signal(sig, stop) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_ignored():
    """While the rows are written out: Ctrl-C, SIGTERM and SIGHUP wait (ignored) until the files are complete."""
    if not _in_main_thread():
        yield
        return
    sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# --- rendering ---
class _BenchProgress:
    """A Rich progress bar over the sweep's runs (warm-ups included), on stderr so --json stdout stays clean."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]bench[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=err,
            transient=True,
        )
        self._task = None

    def __enter__(self) -> _BenchProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def update(self, done: int, total: int, label: str) -> None:
        if self._task is None:
            self._task = self._progress.add_task(label, total=total)
        self._progress.update(self._task, completed=done, total=total, description=label)


def bench_progress() -> _BenchProgress:
    return _BenchProgress()
