"""One bench sweep's settings as a dataclass: every field with its default and the option that sets it, the key a
TOML file in configs/bench/ gives it by. Reading them (settings.py) and their rules (rules.py) import this."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.options import (
    compile_option,
    device_option,
    dtype_option,
    list_option,
    model_option,
    option,
    seed_option,
    tp_option,
    tp_timeout_option,
    weights_option,
)


def all_caches() -> list[str]:
    from kvbench.caches import CACHES

    return list(CACHES)


def _default_percentiles() -> list[float]:
    from kvbench.bench.timing_stats import DEFAULT_PERCENTILES

    return list(DEFAULT_PERCENTILES)


@dataclass
class BenchSettings:
    """One sweep. Every field can come from a TOML file in configs/bench/ (its key is the field's name) and be
    overridden on the command line (its option is declared on the field); bench/rules.py bench_rules checks them."""

    model: str | None = model_option()  # None: gpt2, or the checkpoint's own with --weights
    weights: str = weights_option()
    device: str = device_option()
    dtype: str = dtype_option("auto")
    seed: int = seed_option()  # random weights and the random prompt ids
    prompt_len: list[int] = list_option(
        "--prompt-len",
        default=lambda: [16, 128, 512],  # a short, a medium and a long prompt
        help="Prompt lengths (with --fill random: contexts) to sweep, comma-separated; a k suffix is x1024, "
        "e.g. 256,1k,4k,16k (default: 16,128,512).",
    )
    # generated tokens per run (the first from the prefill, the rest decode steps)
    new_tokens: int = option("--new-tokens", "-n", default=400, help="Tokens generated per run (default: 400).")
    caches: list[str] = list_option(
        "--caches",
        default=all_caches,
        help="Comma-separated cache names, or 'all' (default: all registered). With --hf: none, dynamic, "
        "static, static-compiled.",
    )
    engine: list[str] = list_option(
        "--engine",
        default=lambda: ["kvbench", "hf"],
        help="kvbench, hf (transformers' generate, eager), hf-compiled (its static cache with its default "
        "torch.compile), ct2 (CTranslate2 in float32 and with int8 weights: ct2-fp32, ct2-int8; needs kvbench\\[ct2]), "
        "llamacpp (llama.cpp: llamacpp-f32, llamacpp-f16, llamacpp-f16-kv-q8_0, llamacpp-f16-kv-q4_0; needs "
        "kvbench\\[llamacpp]), comma-separated (default: kvbench,hf).",
    )
    # sequences per run (same length, no padding); several: a batch sweep (rows per batch size, batch.png)
    batch: list[int] = list_option(
        "--batch",
        default=lambda: [1],
        help="Sequences per run, comma-separated to sweep batch sizes (rows per size, batch.png), e.g. 1,4,16,64 "
        "(default: 1).",
    )
    repeats: int = option("--repeats", default=3, help="Timed runs per configuration (default: 3).")
    # the first warm-up is the reported cold run
    warmup: int = option(
        "--warmup", default=1, help="Runs before the timed ones; the first is reported as cold (default: 1)."
    )
    out: str | None = option("--out", "-o", default=None, help="Run folder (default: results/<timestamp>-bench/).")
    threads: int | None = option(
        "--threads", default=None, help="torch CPU threads (default: torch's default: one per core)."
    )
    fill: str = option(
        "--fill",
        default="prefill",
        help="prefill (default): a real prefill fills the cache, TTFT and decode timed. random: caches filled "
        "with random K/V to each --prompt-len without a prefill, only decode timed (long contexts: -m gpt2-long).",
    )
    order: str = option(
        "--order",
        default="sequential",
        help="sequential (default): each configuration's runs back to back. interleaved: cold and warm-up runs "
        "back to back, then the timed runs in rounds over every configuration of a prompt length, so drift on "
        "a shared machine hits every row alike (rows are written when the prompt length's rounds end).",
    )
    compile: str = compile_option()  # how static-graph's fixed-shape decode step runs (decode/fixed_step.py)
    profile: bool = option(
        "--profile/--no-profile",
        default=False,
        help="One more warm run per configuration under torch.profiler, after the timed ones: a Chrome/Perfetto "
        "trace in the run folder's profile/, its top operators by self time in profile_ops.csv and printed.",
    )
    # summary.csv's tpot_ms_pNN columns (50 and 90 are always there as tpot_ms_median, tpot_ms_p90)
    percentiles: list[float] = list_option(
        "--percentiles",
        default=_default_percentiles,
        help="TPOT percentiles written to summary.csv as tpot_ms_pNN, comma-separated, each strictly between 0 "
        "and 100 (default: 50,90,99; the median and p90 columns are always written).",
    )
    # tensor-parallel ranks: every rank runs the sweep on its shard, rank 0 writes the run folder (bench/tp.py)
    tp: int = tp_option()
    tp_timeout: float = tp_timeout_option()
