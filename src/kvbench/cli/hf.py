"""The `--hf SOURCE` options that `verify` and `bench` share, and loading a Hugging Face model for them.

`verify --hf` and `bench --hf` run transformers' own model code and caches on any causal LM instead of our GPT-2;
the commands stay in verify.py and bench.py and call in here for the parts that differ.
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
    source: str, device: str, dtype: str, seed: int, layers: int | None, trust: bool, init_std: float | None
):
    """Resolve device and dtype, then load SOURCE (transformers kept quiet). Returns (loaded, device, dtype)."""
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.hf_models import load_hf

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    return load_hf(source, dev, dt, seed, layers, trust, init_std), dev, dt


def run_verify_hf(
    source: str, *, caches: str | None, prompt_len: int, new_tokens: int, batch: int, device: str, dtype: str,
    seed: int, layers: int | None, trust: bool, on_row,
):  # fmt: skip
    """`kvbench verify --hf`: load, run every check on every cache, return (report, meta) for the renderers."""
    from kvbench.cli.app import CHECK_INIT_STD
    from kvbench.devices import resolve_device
    from kvbench.errors import KVBenchError
    from kvbench.hf_models import check_length
    from kvbench.hf_verify import HF_CACHES, parse_hf_cache_names, run_hf_verify
    from kvbench.verify import random_prompts

    if new_tokens < 2:
        raise KVBenchError(
            f"--new-tokens must be >= 2 (the logits check needs a decode step), got {new_tokens}"
        )
    names = parse_hf_cache_names(caches, resolve_device(device))
    random_prompts(1, prompt_len, batch, seed)  # --batch and --prompt-len checked before a model is loaded
    loaded, dev, _ = load_hf_for_cli(source, device, dtype, seed, layers, trust, init_std=CHECK_INIT_STD)
    check_length(
        loaded.info, prompt_len + new_tokens, f"--prompt-len {prompt_len} + --new-tokens {new_tokens}",
        "lower --prompt-len or --new-tokens",
    )  # fmt: skip
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


def bench_settings_hf(config, overrides: dict):
    """BenchSettings for `bench --hf`: the file and the options as for GPT-2, but the caches are transformers'
    (HF_BENCH_CACHES) and the one engine is its generate."""
    from kvbench import bench as B
    from kvbench.errors import KVBenchError
    from kvbench.hf_bench import parse_hf_bench_caches

    refuse_gpt2_options(**{"--model": overrides.get("model"), "--weights": overrides.get("weights")})
    engine = overrides.get("engine")
    if engine is not None and engine.strip() != "hf":
        raise KVBenchError(
            f"--engine {engine}: with --hf the engine is transformers' generate (hf); drop --engine"
        )
    caches = overrides.get("caches")
    rest = {k: v for k, v in overrides.items() if k not in ("caches", "engine")}
    settings = B.load_settings(config, {**rest, "caches": "all"})  # our registry's names are not checked here
    settings.engine = ["hf"]
    # meta.json's `hf` block names the model; the GPT-2 model and weights settings do not apply
    settings.model = settings.weights = "--hf"
    names = None if caches is None else [c.strip() for c in caches.split(",")]
    settings.caches = parse_hf_bench_caches(names)
    return settings


def load_bench_hf(source: str, settings, layers: int | None, trust: bool):
    """Load SOURCE for the sweep. Returns (view for the recorder and the sweep, device, dtype, engines, meta)."""
    from kvbench.hf_bench import HFModelEngine, bench_view

    loaded, dev, dt = load_hf_for_cli(
        source, settings.device, settings.dtype, settings.seed, layers, trust, None
    )
    view = bench_view(loaded)
    return view, dev, dt, {"hf": HFModelEngine(loaded)}, loaded.meta()
