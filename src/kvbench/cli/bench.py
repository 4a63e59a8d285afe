"""`kvbench bench`: no cache vs each cache vs transformers, TTFT/TPOT/memory, written as the sweep runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from kvbench import console
from kvbench.cli.app import (
    DeviceOpt,
    JsonOpt,
    ModelOpt,
    SeedOpt,
    WeightsOpt,
    app,
    handle_errors,
    load_for_cli,
)
from kvbench.cli.hf import HFOpt, LayersOpt, TrustOpt
from kvbench.console import err, out
from kvbench.errors import KVBenchError


@app.command()
@handle_errors
def bench(
    prompt_len: Annotated[
        str | None,
        typer.Option("--prompt-len", help="Prompt lengths to sweep, comma-separated (default: 16,128,512)."),
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
            "--engine", help="kvbench, hf (transformers' generate), comma-separated (default: both)."
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
        typer.Option("--config", "-c", help="A TOML sweep (configs/bench/); options override it."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Run directory (default: results/<timestamp>-bench/).")
    ] = None,
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
    json_out: JsonOpt = False,
    hf: HFOpt = None,
    trust_remote_code: TrustOpt = False,
    layers: LayersOpt = None,
) -> None:
    """Measure no cache vs each cache vs transformers: TTFT, TPOT, memory.

    With --hf SOURCE: transformers' own caches (none, dynamic, static, static-compiled) on any Hugging Face causal
    LM, side by side, in the same files."""
    from kvbench import bench as B
    from kvbench import report

    overrides = dict(
        prompt_len=prompt_len, new_tokens=new_tokens, caches=caches, engine=engine, batch=batch, repeats=repeats,
        warmup=warmup, model=model, weights=weights, device=device, dtype=dtype, seed=seed, threads=threads,
        out=None if out is None else str(out),
    )  # fmt: skip
    if hf is not None:
        from kvbench.cli.hf import bench_settings_hf

        settings = bench_settings_hf(config, overrides)
    else:
        for flag, value in (("--trust-remote-code", trust_remote_code), ("--layers", layers is not None)):
            if value:
                raise KVBenchError(f"{flag} applies to --hf models only")
        settings = B.load_settings(config, overrides)
    run_dir = report.prepare_run_dir(settings.out or report.default_run_dir("bench"))  # before any work
    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    engines = None
    if hf is not None:
        from kvbench.cli.hf import load_bench_hf

        loaded, dev, dt, engines, hf_meta = load_bench_hf(hf, settings, layers, trust_remote_code)
    else:
        loaded, dev, dt = load_for_cli(
            settings.model, settings.weights, settings.device, settings.dtype, settings.seed
        )
    B.check_fits_context(settings, loaded.config.block_size, loaded.config.name)
    recorder = report.BenchRecorder(run_dir, loaded, dev, dt, settings, config)
    if hf is not None:
        recorder.meta["hf"] = hf_meta
        report.write_json(run_dir / "meta.json", recorder.meta)
    with bench_progress() as progress:
        try:
            B.run_sweep(
                loaded.model,
                settings,
                recorder.dtype,
                recorder.device_label,
                on_result=recorder.add,
                on_progress=progress.update,
                engines=engines,
            )
        except KeyboardInterrupt:
            recorder.finish("interrupted")
            console.note(f"interrupted: {len(recorder.summary)} completed configuration(s) kept in {run_dir}")
            raise
    files = recorder.finish("complete")
    if json_out:
        console.print_json(recorder.json_doc())
    else:
        render_bench(recorder.summary, recorder.meta, run_dir, files)


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


def _f(x: float, fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)  # x != x: NaN


def render_bench(rows: list, meta: dict, run_dir, files: list) -> None:
    cols = ["engine", "cache", "prompt", "TTFT ms", "TPOT ms", "p90", "total s", "speedup", "peak MiB", "KV MiB",
            "copied", "cold TPOT"]  # fmt: skip
    body = []
    for r in rows:
        speedup = _f(r.speedup_vs_none, ".2f") + ("x" if r.speedup_vs_none == r.speedup_vs_none else "")
        body.append(
            [
                r.engine, r.cache if r.status == "ok" else f"[red]{r.cache} ({r.status})[/]", r.prompt_len, _f(r.ttft_ms, ".1f"),
                _f(r.tpot_ms_median, ".2f"), _f(r.tpot_ms_p90, ".2f"), _f(r.total_s, ".3f"), speedup,
                _f(r.peak_mem_mib, ".0f"), _f(r.kv_cache_mib, ".2f"),
                "-" if r.bytes_copied != r.bytes_copied else console.fmt_bytes(int(r.bytes_copied)),
                _f(r.cold_tpot_ms_median, ".2f"),
            ]
        )  # fmt: skip
    first = rows[0] if rows else None
    title = f"bench: {meta['model']} ({meta['weights']}) on {meta['device_name']}, {meta['dtype']}"
    if first is not None:
        title += f", {first.new_tokens} new tokens, batch {first.batch}, {first.repeats} repeats"
    caption = (
        "TTFT, total: medians over timed repeats (total includes the prefill). TPOT: decode steps pooled over "
        "repeats. speedup: vs the same engine's `none`. cold: the first run of each shape. peak: "
        + (
            "CUDA max allocated."
            if meta["device"].startswith("cuda")
            else "process peak RSS (high-water mark)."
        )
    )
    tbl = Table(
        title=title,
        caption=caption,
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for i, c in enumerate(cols):
        tbl.add_column(c, no_wrap=True, justify="left" if i < 2 else "right")
    for r in body:
        tbl.add_row(*[str(x) for x in r])
    # A narrow (or non-tty, 80-column) console would squeeze the numbers into ellipses: print at full width instead.
    wide = out if out.width >= 130 else Console(highlight=False, width=130)
    wide.print(tbl)
    out.print(f"[green]wrote[/] {', '.join(p.name for p in files)} [dim]in[/] {run_dir}")
