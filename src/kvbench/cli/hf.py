"""The `--hf SOURCE` options that `verify` and `bench` share, and loading a Hugging Face model for them.

`verify --hf` and `bench --hf` run transformers' own model code and caches on any causal LM instead of our GPT-2;
the commands stay in check/verify.py and bench/sweep.py and call in here for the parts that differ.
"""

from __future__ import annotations

from typing import Annotated

import typer

HFOpt = Annotated[
    str | None,
    typer.Option(
        "--hf",
        help="Run on a Hugging Face causal LM instead of our GPT-2: a model directory, a config.json (random "
        "weights, transformers' init), or a hub id (online, or in the local cache).",
        rich_help_panel="Hugging Face models",
    ),
]
TrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="With --hf: let the model directory's own modelling code (auto_map) run.",
        rich_help_panel="Hugging Face models",
    ),
]
LayersOpt = Annotated[
    int | None,
    typer.Option(
        "--layers",
        help="With --hf: keep the first N decoder layers (faster; the cache code is the same in every layer).",
        rich_help_panel="Hugging Face models",
    ),
]


def refuse_gpt2_options(**given) -> None:
    """Options that choose our GPT-2 have no meaning with --hf: name the first one given."""
    from kvbench.errors import KVBenchError

    for flag, value in given.items():
        if value:
            raise KVBenchError(
                f"{flag} chooses kvbench's own GPT-2; with --hf the model is SOURCE, drop {flag}"
            )


def load_hf_for_cli(
    source: str, device: str, dtype: str, seed: int, layers: int | None, trust: bool, init_std: float | None,
    run: tuple[int, int] | None = None, check=None,
):  # fmt: skip
    """Resolve device and dtype, then load SOURCE (transformers kept quiet; `run` and `check` as in load_hf).
    Returns (loaded, device, dtype)."""
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.hf.models import load_hf

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    return load_hf(source, dev, dt, seed, layers, trust, init_std, run, check), dev, dt


def run_verify_hf(
    source: str, *, caches: str | None, prompt_len: int, new_tokens: int, batch: int, device: str, dtype: str,
    seed: int, layers: int | None, trust: bool, on_row,
):  # fmt: skip
    """`kvbench verify --hf`: load, run every check on every cache, return (report, meta) for the renderers."""
    from kvbench.check.hf_verify import run_hf_verify
    from kvbench.check.verify import random_prompts
    from kvbench.cli.app import CHECK_INIT_STD
    from kvbench.devices import resolve_device
    from kvbench.errors import KVBenchError
    from kvbench.hf.caches import HF_CACHES, parse_verify_caches
    from kvbench.hf.models import check_length

    if new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (the logits check needs a decode step), got {new_tokens}"
        )
    names = parse_verify_caches(caches, resolve_device(device))
    random_prompts(1, prompt_len, batch, seed)  # --batch and --prompt-len checked before a model is loaded

    def fits(shape) -> None:  # on the meta-device build, before any weight is read
        check_length(
            shape.info, prompt_len + new_tokens, f"--prompt-len {prompt_len} + --new-tokens {new_tokens}",
            "lower --prompt-len or --new-tokens",
        )  # fmt: skip

    loaded, dev, _ = load_hf_for_cli(source, device, dtype, seed, layers, trust, init_std=CHECK_INIT_STD,
                                     run=(batch, prompt_len + new_tokens), check=fits)  # fmt: skip
    prompts = random_prompts(loaded.info.vocab_size, prompt_len, batch, seed)
    report = run_hf_verify(loaded, names, prompts, new_tokens, on_row=on_row)
    meta = {
        "model": loaded.label,
        "weights": loaded.weights,
        "device": str(dev),
        "dtype": report.dtype,
        "hf": {**loaded.meta(), "caches": {n: HF_CACHES[n].summary for n in names}},
    }
    return report, meta


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
    loaded = load_hf(source, dev, dt, settings.seed, layers, trust, run=(min(settings.batch), longest),
                     check=lambda shape: oversized.update(check_sizes_hf(settings, shape, dt, dev)))  # fmt: skip
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
