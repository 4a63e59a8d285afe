"""Loading a Hugging Face model for `verify --hf` and `bench --hf`, which run transformers' own model code and caches
on any causal LM instead of our GPT-2 (the --hf options are declared in kvbench/options.py)."""

from __future__ import annotations


def load_hf_for_cli(
    source: str,
    device: str,
    dtype: str,
    seed: int,
    layers: int | None,
    trust: bool,
    init_std: float | None,
    run: tuple[int, int] | None = None,
    check=None,
):
    """Resolve device and dtype, then load SOURCE (transformers kept quiet; `run` and `check` as in load_hf).
    Returns (loaded, device, dtype)."""
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.hf.models import load_hf

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    return load_hf(source, dev, dt, seed, layers, trust, init_std, run, check), dev, dt


def prepare_bench_hf(source: str, config, overrides: dict, force: bool, layers: int | None, trust: bool):
    """`kvbench bench --hf` up to the sweep. First every check the GPT-2 bench makes before any work, in its order
    (settings, the run folder and --force, device and dtype, the model's context and the device's memory, here read
    from the model's config with no weight loaded), then the model. Nothing is created on disk here.

    Returns (settings, run folder to create, the model as the sweep and the recorder read it, device, dtype,
    engines, warnings, meta.json additions, the batch sizes predicted not to fit with their reasons)."""
    from kvbench.bench.hf_sweep import (
        HFModelEngine,
        bench_meta,
        bench_view,
        check_sizes_hf,
        hf_bench_settings,
        sweep_warnings_hf,
    )
    from kvbench.check.causal import refuse_non_causal
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.hf.models import load_hf
    from kvbench.results.rundir import check_run_dir, unique_default_run_dir

    settings = hf_bench_settings(config, overrides)
    default = str(unique_default_run_dir("bench"))
    out_dir = check_run_dir(settings.out if settings.out is not None else default, force)
    dev = resolve_device(settings.device)
    dt = resolve_dtype(settings.dtype, dev)
    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    longest, oversized = max(settings.prompt_len) + settings.new_tokens, {}
    loaded = load_hf(
        source,
        dev,
        dt,
        settings.seed,
        layers,
        trust,
        run=(min(settings.batch), longest),
        check=lambda shape: oversized.update(check_sizes_hf(settings, shape, dt, dev)),
    )
    refuse_non_causal(loaded)  # token agreement against recomputation means nothing otherwise
    engines = {"hf": HFModelEngine(loaded)}
    untimed = [c for c in settings.caches if not engines["hf"].supports(c)]
    settings.caches = [c for c in settings.caches if c not in untimed]
    notes = sweep_warnings_hf(settings, dev)
    if untimed:
        notes.append(f"{', '.join(untimed)} not timed: {engines['hf'].no_caches}")
    return (
        settings,
        out_dir,
        bench_view(loaded),
        dev,
        dt,
        engines,
        notes,
        bench_meta(loaded, settings, layers, trust),
        oversized,
    )
