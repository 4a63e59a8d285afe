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


def check_bench_hf(config, overrides: dict, force: bool):
    """`kvbench bench --hf`, every check the GPT-2 bench makes before any work that needs no model, in its order:
    settings, the run folder and --force, device and dtype. Nothing is created on disk here.

    Returns (settings, run folder to create, device, dtype)."""
    from kvbench.bench.hf_sweep import hf_bench_settings
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.results.rundir import check_run_dir, unique_default_run_dir

    settings = hf_bench_settings(config, overrides)
    default = str(unique_default_run_dir("bench"))
    out_dir = check_run_dir(settings.out if settings.out is not None else default, force)
    dev = resolve_device(settings.device)
    return settings, out_dir, dev, resolve_dtype(settings.dtype, dev)


def prepare_bench_hf(source: str, checked: tuple, layers: int | None, trust: bool, tp=None):
    """`kvbench bench --hf` up to the sweep, after check_bench_hf (`checked`): the model's context and the device's
    memory, read from the model's config with no weight loaded, then the model. `tp`: this process is one rank of a
    tensor-parallel group (kvbench.distributed.Rank): the model is loaded split by transformers' plan, this rank's
    shard on its device. Nothing is created on disk here.

    Returns (settings, run folder to create, the model as the sweep and the recorder read it, device, dtype,
    engines, warnings, meta.json additions, the batch sizes predicted not to fit with their reasons, and under
    --tp this rank's part of the sweep: bench/tp.py)."""
    from kvbench.bench import hf_sweep as hs
    from kvbench.check.causal import refuse_non_causal
    from kvbench.hf.models import load_hf

    settings, out_dir, dev, dt = checked
    if tp is not None:
        dev = tp.device
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
        check=lambda shape: oversized.update(hs.check_sizes_hf(settings, shape, dt, dev)),
        tp=tp is not None,
    )
    refuse_non_causal(loaded)  # token agreement against recomputation means nothing otherwise
    engines = {"hf": hs.HFModelEngine(loaded)}
    untimed = [c for c in settings.caches if not engines["hf"].supports(c)]
    settings.caches = [c for c in settings.caches if c not in untimed]
    notes = hs.sweep_warnings_hf(settings, dev)
    if untimed:
        notes.append(f"{', '.join(untimed)} not timed: {engines['hf'].no_caches}")
    ranks = None
    if tp is not None:
        from kvbench.bench.tp import HFRanks

        ranks = HFRanks(tp, dt, loaded, layers)
    return (
        settings,
        out_dir,
        hs.bench_view(loaded),
        dev,
        dt,
        engines,
        notes,
        hs.bench_meta(loaded, settings, layers, trust),
        oversized,
        ranks,
    )
